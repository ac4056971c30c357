"""The relative-bias kernels' band in C (`csrc/band.c`, built by `plugformer.native`; `kernels_band_native`) in the
banded kernel (its forward over every key, its near band's backward), against the materialised softmax in float64,
the torch paths, and the eager kernel of a whole model. Attention wholly in C: `test_relative_native.py`."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_training_step, attention_leaves, tiny_config, training_step_by_kernel
from conftest import materialised_relative_attention as materialised
from tolerances import attention_tolerances

import plugformer.kernels_banded as banded
import plugformer.kernels_relative_native as relative_native
from plugformer.bench.measure import profile_call
from plugformer.kernels_band_native import native_band, native_band_applies, native_band_forward


@pytest.fixture(autouse=True)
def built():
    if native_band() is None:
        pytest.skip("no C compiler builds csrc/band.c here")


def spy(monkeypatch) -> list[str]:
    """The banded kernel's C functions called from now on, by name."""
    calls = []
    for name in ("native_forward", "native_band_backward"):
        function = getattr(banded, name)
        monkeypatch.setattr(banded, name, lambda *args, _f=function, _n=name: calls.append(_n) or _f(*args))
    return calls


def inputs(length, far, dim, kv_heads, layout, seed=0):
    """`conftest.attention_leaves` (query `(2, 4, N, D)`, key and value `(2, kv_heads, N, D)` in `layout`) and the
    table `(4, far + 1)` of a bias constant from `far` slots behind (clamped_bias's shape)."""
    generator = torch.Generator().manual_seed(seed)
    query, key, value = attention_leaves(length, dim, kv_heads, layout, generator)
    return query, key, value, torch.randn(4, far + 1, generator=generator).requires_grad_()


def values_of(table, length, far):
    distances = torch.arange(2 * length - 1) - (length - 1)  # key − query
    return table[:, (-distances).clamp(0, far)]  # (H, 2N − 1)


@pytest.mark.parametrize(
    ("length", "far", "dim", "kv_heads", "layout"),
    [(37, 5, 16, 2, "bnhd"), (300, 40, 32, 4, "bhnd"), (129, 128, 64, 2, "bnhd"), (70, 16, 16, 1, "bhnd"),
     (50, 1, 48, 4, "bnhd"), (40, 8, 16, 2, "bhdn")],
    ids=["short-band", "several-tiles-mha", "band-wider-than-a-tile", "band-one-tile-wide-mqa", "width-1",
         "rows-not-contiguous"],
)  # fmt: skip
def test_output_and_every_gradient_equal_the_materialised_softmax(length, far, dim, kv_heads, layout, monkeypatch):
    """fp32 on the C path: output and the gradients of Q, K, V and the bias table equal autograd through the
    materialised softmax in float64 (the same fp32 inputs), to fp32 rounding."""
    calls = spy(monkeypatch)
    leaves = inputs(length, far, dim, kv_heads, layout)
    grad_output = torch.randn(2, 4, length, dim, generator=torch.Generator().manual_seed(1))
    output = banded.BandedBiasAttention.apply(*leaves[:3], values_of(leaves[3], length, far), far, 0.3)
    grads = torch.autograd.grad(output, leaves, grad_output)
    assert calls == ["native_forward", "native_band_backward"]
    exact = [leaf.detach().double().requires_grad_() for leaf in leaves]
    expected = materialised(*exact[:3], values_of(exact[3], length, far), 0.3)
    expected_grads = torch.autograd.grad(expected, exact, grad_output.double())
    slots = torch.arange(length)
    bias = values_of(leaves[3].detach(), length, far)[:, slots[None, :] - slots[:, None] + length - 1]  # (H, N, N)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    # the far entry's gradient sums every pair's score gradient: the bias's bound, over every pair of a head
    atol = attention_tolerances(*leaves[:3], grad_output, 0.3, bias, causal)
    torch.testing.assert_close(output.double(), expected, atol=atol["output"], rtol=0)
    for name, grad, want in zip(("query", "key", "value", "bias"), grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.double(), want, atol=atol[name], rtol=0, msg=name)


@pytest.mark.parametrize(("length", "width"), [(130, 16), (130, 40), (1100, 100), (1100, 1030)])
def test_the_c_forward_over_a_band_narrower_than_the_sequence_is_the_softmax_over_that_band(length, width):
    """Every caller passes the whole sequence as the band (`native_forward`); the C forward's narrower band, each
    query seeing its last `width` keys, is checked here on its own (1100 tokens: two key chunks)."""
    generator = torch.Generator().manual_seed(1)
    # one key head per query head: the C functions take keys and values already repeated to every query head
    query, key, value = (leaf.detach() for leaf in attention_leaves(length, 16, 4, "bnhd", generator))
    values = torch.randn(4, 2 * length - 1, generator=generator) * 3
    output, lse = query.new_empty(2, 4, length, 16), query.new_empty(2, 4, length)
    native_band_forward(query, key, value, values, output, lse, width, 0.25)
    slots = torch.arange(length)
    behind = slots[:, None] - slots[None, :]  # (N, N): i − j
    scores = (query.double() @ key.double().transpose(-1, -2)) * 0.25
    scores = scores + values.double()[:, slots[None, :] - slots[:, None] + length - 1]  # (B, H, N, N) + (H, N, N)
    scores = scores.masked_fill((behind < 0) | (behind >= width), float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ value.double()
    band = (behind >= 0) & (behind < width)
    bias = values[:, slots[None, :] - slots[:, None] + length - 1]
    atol = attention_tolerances(query, key, value, torch.zeros_like(query), 0.25, bias, band)["output"]
    torch.testing.assert_close(output.double(), expected, atol=atol, rtol=0)
    # the log-sum-exp: the scores' errors and the sum's, in the same growth, of size max(|lse|, 1) for max|V|
    reference = torch.logsumexp(scores, dim=-1)
    atol = atol / value.abs().max().item() * max(reference.abs().max().item(), 1.0)
    torch.testing.assert_close(lse.double(), reference, atol=atol, rtol=0)


def test_the_c_path_equals_the_torch_path(monkeypatch):
    """The same call with the C path turned off (the torch blocks) gives the same numbers to fp32 rounding."""
    leaves = inputs(200, 24, 32, 2, "bnhd", seed=3)
    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(banded, "native_band_applies", lambda *tensors: False)
        output = banded.BandedBiasAttention.apply(*leaves[:3], values_of(leaves[3], 200, 24), 24, 0.2)
        results.append((output, torch.autograd.grad(output.square().sum(), leaves)))
    (output, grads), (reference, reference_grads) = results
    # both fp32, each within the bound against fp64 (`attention_tolerances`; upstream 2·output, the bias table's
    # entries summing every pair of a head they cover)
    slots = torch.arange(200)
    bias = values_of(leaves[3].detach(), 200, 24)[:, slots[None, :] - slots[:, None] + 199]  # (H, N, N)
    causal = torch.ones(200, 200, dtype=torch.bool).tril()
    atol = attention_tolerances(*leaves[:3], 2 * reference.detach(), 0.2, bias, causal)
    torch.testing.assert_close(output, reference, atol=atol["output"], rtol=0)
    for name, grad, want in zip(("query", "key", "value", "bias"), grads, reference_grads, strict=True):
        torch.testing.assert_close(grad, want, atol=atol[name], rtol=0, msg=name)


@pytest.mark.parametrize("scheme", ["t5_bias", "clamped_bias"])
def test_a_training_step_on_sdpa_equals_eager(scheme, monkeypatch):
    """A model whose heads are 16 wide (GQA) over more tokens than the bias's far distance and at least
    `BANDED_FROM`: its sdpa training step runs in C (the forward over every key, the near band's backward) and equals the eager kernel's logits and
    gradients (bias table included)."""
    config = tiny_config("scaled_dot", scheme, hidden_size=64)  # 4 heads of 16, 2 key/value heads
    ids = torch.randint(3, config.vocab_size, (2, 45), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(relative_native, "BANDED_FROM", 45)  # this length is a long one: the banded kernel's
    calls = spy(monkeypatch)
    assert_same_training_step(training_step_by_kernel(config, ids), config)
    assert calls.count("native_forward") == config.num_hidden_layers
    assert calls.count("native_band_backward") == config.num_hidden_layers


@pytest.mark.parametrize(
    ("dtype", "dim"), [(torch.float64, 16), (torch.float32, 8), (torch.bfloat16, 16)], ids=["fp64", "8-wide", "bf16"]
)
def test_other_dtypes_and_head_sizes_keep_the_torch_path(dtype, dim):
    query = torch.zeros(1, 2, 20, dim, dtype=dtype)
    assert not native_band_applies(query, query, query, torch.zeros(2, 39))


@pytest.mark.parametrize(
    ("setting", "flags", "runs"),
    [
        ("", {"avx2", "avx512f"}, True),
        ("", {"avx2", "fma"}, True),
        ("", {"sse4_2", "avx"}, False),  # untimed: the torch paths take the calls
        ("", {"asimd", "fp"}, False),  # Arm's NEON
        ("", set(), False),
        ("1", {"sse2"}, True),
        ("0", {"avx512f"}, False),
    ],
    ids=["avx512", "avx2", "avx", "neon", "no-flags", "forced-on", "off"],
)
def test_the_tiles_run_on_x86_with_avx2_or_where_told(monkeypatch, setting, flags, runs):
    from plugformer import kernels_band_native

    monkeypatch.setenv("PLUGFORMER_NATIVE_TILES", setting)
    monkeypatch.setattr(kernels_band_native, "cpu_flags", lambda: frozenset(flags))
    assert kernels_band_native.tiles_run_here() is runs
    query = torch.zeros(1, 2, 20, 16)
    assert kernels_band_native.tiles_take(query, query, query) is runs  # fire.c's rule too
    assert native_band_applies(query, query, query, torch.zeros(2, 39)) is (runs and native_band() is not None)


def test_a_profile_names_the_c_path():
    """`plugformer bench` labels the step's kernel `band-native` (beside the far keys' fused backward)."""
    leaves = inputs(40, 8, 16, 2, "bnhd")
    values = values_of(leaves[3], 40, 8)

    def step():
        banded.BandedBiasAttention.apply(*leaves[:3], values, 8, 0.25).sum().backward()

    with torch.no_grad():
        forward = profile_call(lambda: banded.BandedBiasAttention.apply(*leaves[:3], values, 8, 0.25), "cpu")
    assert forward.sdpa_backends == ["band-native"]  # every key in C: no flash call
    assert profile_call(step, "cpu").sdpa_backends == ["band-native", "flash"]
