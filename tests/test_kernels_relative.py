"""The sdpa kernel for any relative bias (`kernels_relative`, KERPLE's): its output and every gradient against the
materialised softmax, and that the sdpa kernel selects it where it applies."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_training_step, count_applies, tiny_config, training_step_by_kernel
from conftest import materialised_relative_attention as materialised
from tolerances import relative_bias_tolerances

import plugformer.kernels_relative as kernels_relative
from plugformer.biases import RelativeBias
from plugformer.kernels_relative import RelativeBiasAttention, relative_bias_applies


@pytest.mark.parametrize("layout", ["heads-first", "distances-first"])
@pytest.mark.parametrize("learned", [True, False], ids=["learned-bias", "fixed-bias"])
@pytest.mark.parametrize(
    ("length", "rows", "hand_rows", "kv_heads"),
    [(37, 16, 8, 3), (64, 7, 64, 1), (50, 64, 5, 3), (1, 4, 4, 3)],
    ids=["blocks", "gqa-short-fused-blocks", "one-fused-block", "one-token"],
)
def test_output_and_every_gradient_equal_the_materialised_softmax(
    length, rows, hand_rows, kv_heads, learned, layout, monkeypatch
):
    """fp64: output and the gradients of Q, K, V and of every bias value (future distances: none) equal autograd
    through the materialised computation, by the hand backward (learned) or the fused one (fixed); also with the
    values laid out distances-first, as T5's bucket lookup hands them over (a transposed (2N − 1, H) tensor: the
    backward once read it as if heads-first, and got every gradient wrong while the output was right)."""
    monkeypatch.setattr(kernels_relative, "ROWS", rows)
    monkeypatch.setattr(kernels_relative, "HAND_ROWS", hand_rows)
    generator = torch.Generator().manual_seed(length)
    heads, dim = 3, 4

    def tensor(*shape, grad=True):
        return torch.randn(*shape, dtype=torch.float64, generator=generator).requires_grad_(grad)

    query = tensor(2, heads, length, dim)
    key, value = tensor(2, kv_heads, length, dim), tensor(2, kv_heads, length, dim)
    if layout == "heads-first":
        values = tensor(heads, 2 * length - 1, grad=learned)
    else:
        values = tensor(2 * length - 1, heads, grad=learned).t()  # (H, 2N − 1), strides (1, H)
    inputs = (query, key, value, values) if learned else (query, key, value)
    grad_output = torch.randn(2, heads, length, dim, dtype=torch.float64, generator=generator)
    results = []
    for function in (RelativeBiasAttention.apply, materialised):
        output = function(query, key, value, values, 0.37)
        results.append((output, torch.autograd.grad(output, inputs, grad_output)))
    (output, grads), (expected, expected_grads) = results
    atol = relative_bias_tolerances(query, key, value, values, 0.37, grad_output)  # two fp64 computations
    torch.testing.assert_close(output, expected, atol=atol["output"], rtol=0)
    names = ("query", "key", "value", "values")[: len(grads)]
    for name, grad, reference in zip(names, grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference, atol=atol["bias" if name == "values" else name], rtol=0, msg=name)


@pytest.mark.parametrize("score", ["scaled_dot", "multiplicative"])
def test_sdpa_training_takes_the_relative_kernel_and_equals_eager(score, monkeypatch):
    """A causal batch without padding, GQA, KERPLE's bias: sdpa takes this kernel in every layer, and its logits and
    every parameter's gradient (r1, r2 included) equal eager's."""
    calls = count_applies(monkeypatch, RelativeBiasAttention)
    monkeypatch.setattr(kernels_relative, "ROWS", 16)  # three fused blocks
    monkeypatch.setattr(kernels_relative, "HAND_ROWS", 8)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    config = tiny_config(score, "kerple_log")
    results = training_step_by_kernel(config, ids)
    assert len(calls) == config.num_hidden_layers
    assert_same_training_step(results, config)


def test_t5_bias_shorter_than_its_far_distance_takes_the_relative_kernel_and_equals_eager(monkeypatch):
    """T5's buckets (constant from 16 slots in `tiny`) over 12 tokens: the banded kernel does not apply, this one
    does, with the bucket lookup's transposed values; logits and every gradient equal eager's."""
    calls = count_applies(monkeypatch, RelativeBiasAttention)
    monkeypatch.setattr(kernels_relative, "HAND_ROWS", 5)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    config = tiny_config("dot", "t5_bias")
    results = training_step_by_kernel(config, ids)
    assert len(calls) == config.num_hidden_layers
    assert_same_training_step(results, config)


def test_applies_only_to_causal_unmasked_undropped_equal_lengths():
    query = key = value = torch.zeros(1, 2, 20, 4)
    bias = RelativeBias(torch.zeros(2, 39), 20, 20)
    assert relative_bias_applies(query, key, value, None, 0.0, bias, True)
    assert not relative_bias_applies(query, key, value, None, 0.0, bias, False)  # an encoder sees later keys
    assert not relative_bias_applies(query, key, value, torch.ones(1, 1, 20, 20, dtype=torch.bool), 0.0, bias, True)
    assert not relative_bias_applies(query, key, value, None, 0.1, bias, True)  # attention dropout
    assert not relative_bias_applies(query, key, torch.zeros(1, 2, 20, 8), None, 0.0, bias, True)  # wider values
    assert not relative_bias_applies(query[:, :, :1], key, value, None, 0.0, bias, True)  # a decoding step
    assert not relative_bias_applies(query.half(), key.half(), value.half(), None, 0.0, bias, True)
    assert not relative_bias_applies(query.bfloat16(), key.bfloat16(), value.bfloat16(), None, 0.0, bias, True)
    assert not relative_bias_applies(query, key, value, None, 0.0, RelativeBias(bias.values.half(), 20, 20), True)


@pytest.mark.parametrize("kernel", ["linear", "banded", "relative"])
def test_the_raw_flash_kernels_take_any_layout(kernel):
    """torch's raw CPU flash op, which the bias kernels call, returns other numbers when a last axis is not contiguous
    (the public SDPA copies first): each kernel's output and gradients for queries, keys and values laid out with D
    outermost equal the materialised softmax's, as with contiguous ones (fp64)."""
    from plugformer.kernels_alibi import LinearBiasAttention
    from plugformer.kernels_banded import BandedBiasAttention

    generator = torch.Generator().manual_seed(11)
    length, far = 24, 6
    contiguous = [torch.randn(2, 2, length, 8, dtype=torch.float64, generator=generator) for _ in range(3)]
    strided = [tensor.transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_() for tensor in contiguous]
    assert all(tensor.stride(-1) != 1 for tensor in strided)
    distances = torch.arange(2 * length - 1, dtype=torch.float64) - (length - 1)  # key − query
    table = torch.randn(2, far + 1, dtype=torch.float64, generator=generator)  # constant from `far` slots behind
    values = {
        "linear": -0.25 * distances.abs().expand(2, -1),
        "banded": table[:, distances.neg().clamp(0, far).long()],
        "relative": torch.randn(2, 2 * length - 1, dtype=torch.float64, generator=generator),
    }[kernel]
    function = {
        "linear": lambda *args: LinearBiasAttention.apply(*args, 0.3),
        "banded": lambda *args: BandedBiasAttention.apply(*args, far, 0.3),
        "relative": lambda *args: RelativeBiasAttention.apply(*args, 0.3),
    }[kernel]
    output = function(*strided, values.contiguous())
    exact = [tensor.detach().clone().requires_grad_() for tensor in contiguous]
    expected = materialised(*exact, values, 0.3)
    grad_output = torch.randn(expected.shape, dtype=torch.float64, generator=generator)
    atol = relative_bias_tolerances(*exact, values, 0.3, grad_output)  # two fp64 computations
    torch.testing.assert_close(output, expected, atol=atol["output"], rtol=0)
    grads = torch.autograd.grad(output, strided, grad_output)
    expected_grads = torch.autograd.grad(expected, exact, grad_output)
    for name, grad, want in zip(("query", "key", "value"), grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want, atol=atol[name], rtol=0, msg=name)
