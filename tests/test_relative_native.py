"""Causal attention with any relative bias wholly in C (`kernels_relative_native`, `csrc/band.c` with a band as wide
as the sequence): output and every gradient against the materialised softmax in float64, ALiBi's and KERPLE's sdpa
training steps against eager, where the sdpa entry point sends a call, and what a profile names it."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_training_step, attention_leaves, tiny_config, training_step_by_kernel
from conftest import materialised_relative_attention as materialised
from tolerances import attention_tolerances

import plugformer.kernels_relative_native as native
from plugformer.bench.measure import profile_call
from plugformer.biases import RelativeBias
from plugformer.kernels_band_native import native_band
from plugformer.kernels_sdpa import SDPA_PATHS


@pytest.fixture(autouse=True)
def built():
    if native_band() is None:
        pytest.skip("no C compiler builds csrc/band.c here")


def spy(monkeypatch) -> list[tuple[str, int]]:
    """The C functions `kernels_relative_native` calls from now on: (name, band width)."""
    calls = []
    for name in ("native_band_forward", "native_band_backward"):
        function = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *args, _f=function, _n=name: calls.append((_n, args[-2])) or _f(*args))
    return calls


def leaves(length, dim, kv_heads, layout, seed=0):
    return attention_leaves(length, dim, kv_heads, layout, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("length", "dim", "kv_heads", "layout", "spread"),
    [(45, 16, 2, "bnhd", 1.0), (300, 32, 4, "bhnd", 1.0), (40, 16, 2, "bhdn", 1.0), (1100, 16, 1, "bnhd", 6.0)],
    ids=["one-tile-group", "several-tiles-mha", "rows-not-contiguous", "several-key-chunks-mqa"],
)
def test_output_and_every_gradient_equal_the_materialised_softmax(length, dim, kv_heads, layout, spread, monkeypatch):
    """Output and the gradients of Q, K, V and every bias value (future distances: 0) equal autograd through the
    materialised softmax in float64 (the same fp32 inputs), to fp32 rounding. 1100 tokens take the forward over two
    chunks of keys and five groups of query tiles; bias values spread ±6 make a later chunk raise a row's maximum (the
    online softmax's rescaling)."""
    calls = spy(monkeypatch)
    query, key, value = leaves(length, dim, kv_heads, layout)
    generator = torch.Generator().manual_seed(6)
    values = (torch.randn(4, 2 * length - 1, generator=generator) * spread).requires_grad_()
    grad_output = torch.randn(2, 4, length, dim, generator=torch.Generator().manual_seed(7))
    output = native.NativeRelativeAttention.apply(query, key, value, values, 0.3)
    grads = torch.autograd.grad(output, (query, key, value, values), grad_output)
    assert calls == [("native_band_forward", length), ("native_band_backward", length)]  # every key up to the query
    exact = [tensor.detach().double().requires_grad_() for tensor in (query, key, value, values)]
    expected = materialised(*exact, 0.3)
    expected_grads = torch.autograd.grad(expected, exact, grad_output.double())
    slots = torch.arange(length)
    bias = values.detach()[:, slots[None, :] - slots[:, None] + length - 1]  # (H, N, N)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    atol = attention_tolerances(query, key, value, grad_output, 0.3, bias, causal)
    torch.testing.assert_close(output.double(), expected, atol=atol["output"], rtol=0)
    for name, grad, want in zip(("query", "key", "value", "bias"), grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.double(), want, atol=atol[name], rtol=0, msg=name)
    assert not grads[3][:, length:].any()


@pytest.mark.parametrize("scheme", ["alibi", "kerple_log", "t5_bias", "clamped_bias"])
def test_a_training_step_on_sdpa_equals_eager(scheme, monkeypatch):
    """ALiBi (fixed slopes), KERPLE (learned r1, r2), T5's buckets and the clamped distances (learned tables, constant
    beyond 16 and 8 slots) with heads 16 wide (GQA): the sdpa training step runs forward and backward in C, once per
    layer each, and equals the eager kernel's logits and gradients."""
    config = tiny_config("scaled_dot", scheme, hidden_size=64)  # 4 heads of 16, 2 key/value heads
    ids = torch.randint(3, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    calls = spy(monkeypatch)
    assert_same_training_step(training_step_by_kernel(config, ids), config)
    layers = config.num_hidden_layers
    assert sorted(calls) == [("native_band_backward", 33)] * layers + [("native_band_forward", 33)] * layers


def call(dtype=torch.float32, dim=16, mask=None, causal=True, dropout=0.0, length=20, constant_beyond=None):
    query = torch.zeros(1, 2, length, dim, dtype=dtype)
    bias = RelativeBias(torch.zeros(2, 2 * length - 1), length, length, constant_beyond=constant_beyond)
    return native.native_relative_applies(query, query, query, mask, dropout, bias, causal)


def test_it_takes_fp32_causal_calls_with_whole_16_float_heads_only():
    assert call() and call(constant_beyond=8)
    # a bias constant beyond a distance over a long sequence: the banded kernel's (its far keys' fused backward)
    assert call(length=native.BANDED_FROM, constant_beyond=8) is False
    assert call(length=native.BANDED_FROM - 1, constant_beyond=8) and call(length=native.BANDED_FROM)
    assert not call(dtype=torch.bfloat16) and not call(dtype=torch.float64)
    assert not call(dim=8)
    assert not call(mask=torch.ones(1, 1, 20, 20, dtype=torch.bool))
    assert not call(causal=False)
    assert not call(dropout=0.1)


def test_a_profile_names_the_path():
    """`plugformer bench` labels the step's kernel `relative-native` (the C band's own label beside it)."""
    query, key, value = leaves(40, 16, 2, "bnhd")
    bias = RelativeBias(torch.randn(4, 79, generator=torch.Generator().manual_seed(1)), 40, 40)

    def step():
        output, _ = SDPA_PATHS["relative_native"](None, query, key, value, None, 0.25, 0.0, bias, True)
        output.sum().backward()

    assert profile_call(step, "cpu").sdpa_backends == ["band-native", "relative-native"]
