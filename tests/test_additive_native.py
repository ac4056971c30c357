"""The additive kernel's native CPU path (`plugformer.native` builds `csrc/additive.c`; `kernels_additive_native`)
against independent references: tanh in float64, the formula under plain autograd in float64, and the torch path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import additive_path, count_applies, tiny_config
from tolerances import model_length, model_steps, softmax_spread, tolerance

from plugformer import PlugformerForCausalLM, native
from plugformer import kernels_additive_native as native_kernels
from plugformer.biases import RelativeBias


@pytest.fixture(autouse=True)
def native_path(monkeypatch):
    additive_path(monkeypatch, "native")


@pytest.fixture
def fresh_load():
    """`native.load` with its per-process cache cleared before and after (the kernel modules keep their own)."""
    native.load.cache_clear()
    yield native.load
    native.load.cache_clear()


def test_tanh_is_within_1_3_ulp_of_the_exact_one():
    """Scores of one key at 0 with energy 1 are tanh(q): over 2^20 + 1 points of [-12, 12] within 1.3 ulp of tanh in
    float64 (torch's own float tanh is within 0.5), and exact at the special values."""
    grid = torch.linspace(-12, 12, 2**20 + 1)
    specials = torch.tensor([0.0, 1e-30, -1e-30, 20.0, -20.0, float("inf"), float("-inf"), float("nan")])
    points = torch.cat([grid, specials])
    scores = native_kernels.native_scores(points.view(1, 1, -1, 1), torch.zeros(1, 1, 1, 1), torch.ones(1, 1))
    scores = scores.flatten()
    exact = torch.tanh(grid.double())
    ulp = (torch.nextafter(exact.float(), torch.tensor(float("inf"))).double() - exact.float().double()).abs()
    assert ((scores[: grid.numel()].double() - exact).abs() / ulp).max() <= 1.3
    assert torch.equal(scores[-8:-1], torch.tensor([0.0, 1e-30, -1e-30, 1.0, -1.0, 1.0, -1.0]))
    assert scores[-1].isnan()


def float64_formula(query, key, value, energy, bias, mask):
    """softmax(Σ_a v_a tanh(q_ia + k_ja) + bias, masked) V in float64, a bool mask applied by `masked_fill` (no
    gradient reaches a blocked score), a float one added (0 or the fp32 minimum), as the kernels apply them."""
    scores = torch.einsum("bhqka,ha->bhqk", torch.tanh(query[:, :, :, None] + key[:, :, None]), energy) + bias
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    else:
        scores = scores + mask.double()
    return torch.matmul(torch.softmax(scores, dim=-1), value)


# rounded operations of one score term v_a tanh(q_a + k_a) in units of u relative to |v_a|: the native tanh's 1.3 ulp,
# the add before it (|x| sech²(x) ≤ 0.45) and the product after it
SCORE_STEPS = 3.3
# of one gradient term through tanh' = 1 − tanh²: twice tanh's 1.3 ulp, the add, the subtraction and two products
GRADIENT_STEPS = 6.0


def score_gradient_tolerances(energy_size, upstream_size, dtype: torch.dtype) -> dict[str, float]:
    """`atol` of the additive scores' gradients (B, H, 5 queries, 7 keys) in `dtype`: each sums |upstream| · |v_a|
    over keys (query) or queries (key), |upstream| over every pair (energy, |tanh| ≤ 1)."""
    largest = energy_size.max().item()
    return {
        "query": tolerance(
            dtype, magnitude=largest * upstream_size.sum(-1).max().item(), length=7, steps=GRADIENT_STEPS
        ),
        "key": tolerance(dtype, magnitude=largest * upstream_size.sum(-2).max().item(), length=5, steps=GRADIENT_STEPS),
        "energy": tolerance(
            dtype, magnitude=upstream_size.sum((0, 2, 3)).max().item(), length=2 * 5 * 7, steps=GRADIENT_STEPS
        ),
    }


def chunk_tolerances(query, key, value, energy, bias, mask, upstream) -> dict[str, float]:
    """`atol` of a chunk of `NativeAdditiveAttention` (fp32) against `float64_formula` and of its gradients (upstream
    `upstream`), as `tolerances.attention_tolerances` for dot-product scores: growth √K, the rows' spread, the scores'
    own rounding in units of u (SCORE_STEPS · max Σ_a |v_a|, one for the bias), exp and the division (and for the
    gradients GRADIENT_STEPS through tanh'); magnitudes max|V| for the output, for the gradients the terms each sums,
    from ds_ij = p_ij (g_ij − Σ_k p_ik g_ik) with g = dO Vᵀ: times max|v_a| over a row (query) or a column (key), times
    |tanh| ≤ 1 over every pair of a head (energy; the bias's table too), Σ_i p_ij |dO_i| for the values."""
    with torch.no_grad():
        query, key, value, energy, upstream = (t.detach().double() for t in (query, key, value, energy, upstream))
        bias = bias.detach() if torch.is_tensor(bias) else bias
        scores = torch.einsum("bhqka,ha->bhqk", torch.tanh(query[:, :, :, None] + key[:, :, None]), energy) + bias
        allowed = mask if mask.dtype == torch.bool else mask == 0
        if mask.dtype == torch.bool:  # the reference's weights: a fully blocked row's uniform
            weights = scores.masked_fill(~mask, torch.finfo(torch.float32).min).softmax(-1)
        else:
            weights = (scores + mask.double()).softmax(-1)
        size = energy.abs().sum(-1).max().item()
        spread = softmax_spread(scores, allowed) + SCORE_STEPS * size + 1
        growth = {"length": scores.shape[-1], "spread": spread}
        g = (upstream @ value.transpose(-1, -2)).abs()  # (B, H, Q, K)
        terms = weights * (g + (weights * g).sum(-1, keepdim=True))
        largest = energy.abs().max().item()
        gradients = {
            "query": largest * terms.sum(-1).max().item(),
            "key": largest * terms.sum(-2).max().item(),
            "value": (weights.transpose(-1, -2) @ upstream.abs()).max().item(),
            "energy": terms.sum((0, 2, 3)).max().item(),
            "values": terms.sum((0, 2, 3)).max().item(),
        }
    bounds = {"output": tolerance(torch.float32, magnitude=value.abs().max().item(), steps=2, **growth)}
    for name, magnitude in gradients.items():
        bounds[name] = tolerance(torch.float32, magnitude=magnitude, steps=2 + GRADIENT_STEPS, **growth)
    return bounds


def leaves(*shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=generator) * 1.5).requires_grad_() for shape in shapes]


def test_native_scores_and_gradients_equal_the_formula_in_float64():
    """`NativeAdditiveScores` (fp32) against autograd over the formula in float64, an upstream gradient with zeros
    (pairs the backward skips) included."""
    query, key, energy = leaves((2, 3, 5, 4), (2, 3, 7, 4), (3, 4))
    upstream = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(1))
    upstream[:, :, :, 4:] = 0.0
    scores = native_kernels.NativeAdditiveScores.apply(query, key, energy)
    doubles = [tensor.detach().double().requires_grad_() for tensor in (query, key, energy)]
    reference = torch.einsum(
        "bhqka,ha->bhqk", torch.tanh(doubles[0][:, :, :, None] + doubles[1][:, :, None]), doubles[2]
    )
    # fp32 against fp64: a sum over the attention dim of terms of size |v_a|
    energy_size = energy.detach().abs()
    atol = tolerance(torch.float32, magnitude=energy_size.sum(-1).max().item(), length=4, steps=SCORE_STEPS)
    torch.testing.assert_close(scores.double(), reference, atol=atol, rtol=0)
    grads = torch.autograd.grad(scores, (query, key, energy), upstream)
    expected = torch.autograd.grad(reference, doubles, upstream.double())
    # each gradient sums terms |upstream| · |v_a| (query: over keys, key: over queries) or |upstream| (energy: over
    # batch, queries and keys, |tanh| ≤ 1)
    size = upstream.abs()
    bounds = score_gradient_tolerances(energy_size, size, torch.float32)
    for name, grad, want in zip(("query", "key", "energy"), grads, expected, strict=True):
        torch.testing.assert_close(grad.double(), want, atol=bounds[name], rtol=0, msg=name)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_attention_chunk_equals_the_formula_with_bias_padding_and_causal_mask(with_bias, mask_kind):
    """One chunk (query rows 3..8 over keys 0..8) of `NativeAdditiveAttention` against autograd over the formula in
    float64: a causal mask (bool, or added as 0 / fp32 minimum), a left-padded row whose padding queries see no key
    (uniform weights, as eager's softmax of a fully blocked row), a learned relative bias whose values get their
    gradient; it keeps no (c, K) tensor."""
    batch, heads, length, attn_dim, value_dim = 2, 3, 11, 4, 5
    query, key, value = leaves(
        (batch, heads, length, attn_dim), (batch, heads, length, attn_dim), (batch, heads, length, value_dim)
    )
    energy, values = leaves((heads, attn_dim), (heads, 2 * length - 1), seed=1)
    real = torch.ones(batch, length, dtype=torch.bool)
    real[1, :5] = False  # the second row is left-padded by 5: its queries 3 and 4 see no key
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]  # (B, 1, Q, K)
    start, stop = 3, 9
    chunk_mask = mask[:, :, start:stop, :stop]
    if mask_kind == "float":
        chunk_mask = torch.zeros(chunk_mask.shape).masked_fill(~chunk_mask, torch.finfo(torch.float32).min)
    inputs = (query[:, :, start:stop], key[:, :, :stop], value[:, :, :stop], energy)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor.shape) or tensor, lambda x: x):
        output = native_kernels.NativeAdditiveAttention.apply(
            *inputs, values if with_bias else None, chunk_mask, (length, length), (start, stop), stop
        )
    assert (batch, heads, stop - start, stop) not in saved
    doubles = [tensor.detach().double().requires_grad_() for tensor in (*inputs, values)]
    bias = RelativeBias(doubles[4], length, length).rows(start, stop, stop) if with_bias else 0.0
    reference = float64_formula(*doubles[:4], bias, chunk_mask)
    upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(2))
    # fp32 against fp64 through the softmax of a chunk (`chunk_tolerances`)
    bounds = chunk_tolerances(*doubles[:4], bias, chunk_mask, upstream)
    torch.testing.assert_close(output.double(), reference, atol=bounds["output"], rtol=0)
    wanted = (*inputs, values) if with_bias else inputs
    grads = torch.autograd.grad(output, wanted, upstream)
    expected = torch.autograd.grad(reference, doubles[: len(wanted)], upstream.double())
    for name, grad, want in zip(("query", "key", "value", "energy", "values"), grads, expected, strict=False):
        torch.testing.assert_close(grad.double(), want, atol=bounds[name], rtol=0, msg=name)


@pytest.mark.parametrize("scheme", ["none", "rope", "alibi", "t5_bias", "kerple_log", "fire"])
def test_a_training_step_equals_the_torch_paths(scheme, monkeypatch):
    """A tiny additive model (grouped key heads, a left-padded row) trains to the same loss and gradients on the
    native path as on the torch path; the chunks run as `NativeAdditiveAttention` (FIRE's query-dependent bias, whose
    gradient does not fold into a table: checkpointed `NativeAdditiveScores`)."""
    config = tiny_config("additive", scheme, num_key_value_heads=2)
    ids = torch.randint(3, config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :4] = 0
    results = []
    for path in ("torch", "native"):
        torch.manual_seed(0)
        model = PlugformerForCausalLM(config).train()
        with monkeypatch.context() as patch:
            additive_path(patch, path)
            fused = count_applies(patch, native_kernels.NativeAdditiveAttention)
            scores = count_applies(patch, native_kernels.NativeAdditiveScores)
            loss = model(input_ids=ids, attention_mask=attention_mask, labels=ids).loss
            loss.backward()
        grads = {name: parameter.grad for name, parameter in model.named_parameters() if parameter.grad is not None}
        results.append((loss.detach(), grads))
    assert (len(scores) > 0) if scheme == "fire" else (len(fused) > 0 and not scores)
    (torch_loss, torch_grads), (native_loss, native_grads) = results
    # two fp32 training steps: fp32's rounding through the model's layers and longest reduction, times the loss
    # (at least 1) and the largest gradient (as `tolerances.assert_same_step`)
    growth = {"length": model_length(config, ids.shape[1]), "steps": model_steps(config)}
    atol = tolerance(torch.float32, magnitude=max(torch_loss.abs().item(), 1.0), **growth)
    torch.testing.assert_close(native_loss, torch_loss, atol=atol, rtol=0)
    assert native_grads.keys() == torch_grads.keys()
    atol = tolerance(torch.float32, magnitude=max(grad.abs().max().item() for grad in torch_grads.values()), **growth)
    for name, grad in torch_grads.items():
        torch.testing.assert_close(native_grads[name], grad, atol=atol, rtol=0, msg=name)


def test_a_chunk_reads_its_keys_in_place():
    """The first K keys of a contiguous (B, H, N, A) tensor are read where they lie (one stride per (batch, head));
    a transposed layout is copied once."""
    keys = torch.randn(2, 3, 10, 4)
    rows, stride = native_kernels.key_rows(keys[:, :, :6])
    assert rows.data_ptr() == keys.data_ptr() and stride == 40
    query, energy = torch.randn(2, 3, 5, 4), torch.randn(3, 4)
    torch.testing.assert_close(
        native_kernels.native_scores(query, keys[:, :, :6], energy),
        native_kernels.native_scores(query, keys[:, :, :6].contiguous(), energy),
        atol=0,
        rtol=0,
    )
    rows, stride = native_kernels.key_rows(torch.randn(2, 10, 3, 4).transpose(1, 2))
    assert rows.is_contiguous() and stride == 40


def test_the_build_is_cached_and_written_atomically(tmp_path, monkeypatch, fresh_load):
    """A new cache directory gets one library (no temporary file left); loading again in a new process (the
    per-process cache cleared) builds nothing."""
    monkeypatch.setenv(native.CACHE, str(tmp_path))
    builds = []
    build = native.build
    monkeypatch.setattr(native, "build", lambda *args: builds.append(args) or build(*args))
    assert fresh_load("additive") is not None
    assert [path.name.startswith("additive-") for path in tmp_path.iterdir()] == [True]
    native.load.cache_clear()
    assert fresh_load("additive") is not None
    assert len(builds) == 1


def test_a_failing_compiler_leaves_the_torch_path_with_a_warning(tmp_path, monkeypatch, fresh_load, caplog):
    """`CC=false` (a compiler that fails): `load` warns once and returns `None`, nothing is left in the cache
    directory, and the additive kernel still computes (on its torch path)."""
    monkeypatch.setenv(native.CACHE, str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert fresh_load("additive") is None
    assert "unavailable" in caplog.text and "exited 1" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_compiler_without_openmp_gets_the_build_with_posix_threads(tmp_path, monkeypatch, fresh_load):
    """A compiler that refuses `-fopenmp` (Apple's clang): the second set of flags (`-fopenmp-simd`, POSIX threads)
    builds, loads and computes the same scores."""
    real = native.compiler()
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {real[0]} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv(native.CACHE, str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    library = fresh_load("additive")
    assert library is not None
    assert [path.name for path in (tmp_path / "cache").iterdir()] == [
        native.library_path("additive", [str(wrapper)], native.THREADING[1]).name
    ]


@pytest.mark.skipif(
    not Path(torch.__file__).with_name("lib").joinpath("libgomp.so.1").exists(),
    reason="this torch bundles no libgomp.so.1",
)
def test_the_openmp_build_runs_on_torchs_own_runtime(fresh_load):
    """Where torch bundles libgomp.so.1 (its Linux wheels), the kernels' OpenMP build loads no second runtime: the
    process maps one libgomp, torch's."""
    assert fresh_load("band") is not None
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert mapped == {str(Path(torch.__file__).with_name("lib") / "libgomp.so.1")}


def test_the_switch_turns_native_kernels_off(monkeypatch, fresh_load):
    monkeypatch.setenv(native.SWITCH, "0")
    monkeypatch.setattr(native, "build", None)  # a build would fail
    assert fresh_load("additive") is None


def test_scores_before_a_mask_skip_the_pairs_it_blocks():
    """Given the mask applied after them (bool, or float at the fp32 minimum), the scores of blocked pairs are 0 (no
    tanh formed) and every other score is the unmasked one's."""
    query, key, energy = (tensor.detach() for tensor in leaves((2, 3, 5, 4), (2, 3, 7, 4), (3, 4)))
    allowed = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(3)) > 0.5
    plain = native_kernels.native_scores(query, key, energy)
    for mask in (allowed, torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)):
        scores = native_kernels.masked_scores(query, key, energy, mask)
        torch.testing.assert_close(scores, plain.masked_fill(~allowed, 0.0), atol=0, rtol=0)


def test_a_profile_names_the_native_path():
    """`plugformer bench` labels a step that ran the C kernel (`eager:additive-native`)."""
    from plugformer.bench.measure import profile_call

    query, key, energy = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(2, 8)
    assert profile_call(lambda: native_kernels.native_scores(query, key, energy), "cpu").sdpa_backends == [
        "additive-native"
    ]
