"""The banded sdpa kernel for biases constant beyond a distance (`kernels_banded`): its output and every gradient
against the materialised softmax, when the sdpa kernel selects it, and the schemes' declarations against T5's
reference bucketing."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_training_step, count_applies, tiny_config, training_step_by_kernel
from conftest import materialised_relative_attention as materialised
from tolerances import relative_bias_tolerances
from transformers.models.t5.modeling_t5 import T5Attention

import plugformer.kernels_banded as banded
from plugformer import PlugformerForCausalLM
from plugformer.biases import RelativeBias
from plugformer.kernels_banded import BandedBiasAttention, banded_bias_applies
from plugformer.positions import POSITION_SCHEMES


CONSTANT_BIAS_SCHEMES = ["t5_bias", "clamped_bias"]


@pytest.mark.parametrize(
    ("length", "far", "rows", "kv_heads", "forward_rows"),
    [(37, 5, 8, 3, 16), (64, 16, 8, 1, 7), (50, 1, 16, 3, 64), (70, 13, 64, 1, 32), (33, 32, 4, 3, 8)],
    ids=["blocks", "gqa-short-forward-blocks", "width-1", "one-short-band-block", "far-part-of-one-row"],
)
def test_output_and_every_gradient_equal_the_materialised_softmax(
    length, far, rows, kv_heads, forward_rows, monkeypatch
):
    """fp64: output and the gradients of Q, K, V and the bias table (distances clamped at `far`, as clamped_bias's)
    equal autograd through the materialised computation, with band blocks of several sizes, forward and backward."""
    monkeypatch.setattr(banded, "BAND_ROWS", rows)
    monkeypatch.setattr(banded, "FORWARD_ROWS", forward_rows)
    generator = torch.Generator().manual_seed(length)
    heads, dim = 3, 4

    def tensor(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator).requires_grad_()

    query = tensor(2, heads, length, dim)
    key, value = tensor(2, kv_heads, length, dim), tensor(2, kv_heads, length, dim)
    table = tensor(heads, far + 1)
    distances = torch.arange(2 * length - 1) - (length - 1)  # key − query
    inputs = (query, key, value, table)
    grad_output = torch.randn(2, heads, length, dim, dtype=torch.float64, generator=generator)
    results = []
    for function, extra in ((BandedBiasAttention.apply, (far, 0.37)), (materialised, (0.37,))):
        values = table[:, (-distances).clamp(0, far)]  # (H, 2N − 1)
        output = function(query, key, value, values, *extra)
        results.append((output, torch.autograd.grad(output, inputs, grad_output)))
    (output, grads), (expected, expected_grads) = results
    # two fp64 computations: `attention_tolerances` in fp64; a table entry sums every distance clamped to it
    atol = relative_bias_tolerances(query, key, value, values, 0.37, grad_output)
    torch.testing.assert_close(output, expected, atol=atol["output"], rtol=0)
    for name, grad, reference in zip(("query", "key", "value", "table"), grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference, atol=atol["bias" if name == "table" else name], rtol=0, msg=name)


def test_a_frozen_bias_skips_its_gradient_and_keeps_the_others_exact(monkeypatch):
    """A bias that wants no gradient (a frozen scheme, LoRA on the projections): dQ, dK, dV still equal the
    materialised softmax's, and the band's bias gradient is not computed."""
    monkeypatch.setattr(banded, "BAND_ROWS", 8)
    asked, backward = [], banded.banded_backward

    def recording(*operands, bias_gradient):
        asked.append(bias_gradient)
        return backward(*operands, bias_gradient=bias_gradient)

    monkeypatch.setattr(banded, "banded_backward", recording)
    generator = torch.Generator().manual_seed(1)
    query, key, value = (
        torch.randn(2, 2, 40, 4, dtype=torch.float64, generator=generator).requires_grad_() for _ in range(3)
    )
    values = torch.randn(2, 7, dtype=torch.float64, generator=generator)[:, (torch.arange(79) - 39).neg().clamp(0, 6)]
    grad_output = torch.randn(2, 2, 40, 4, dtype=torch.float64, generator=generator)
    results = []
    for function, extra in ((BandedBiasAttention.apply, (6, 0.5)), (materialised, (0.5,))):
        output = function(query, key, value, values, *extra)
        results.append(torch.autograd.grad(output, (query, key, value), grad_output))
    atol = relative_bias_tolerances(query, key, value, values, 0.5, grad_output)  # two fp64 computations
    for name, grad, reference in zip(("query", "key", "value"), *results, strict=True):
        torch.testing.assert_close(grad, reference, atol=atol[name], rtol=0, msg=name)
    assert asked == [False]


def test_bf16_output_is_as_close_to_fp64_as_the_materialised_bf16_softmax(monkeypatch):
    monkeypatch.setattr(banded, "FORWARD_ROWS", 32)  # three band blocks
    generator = torch.Generator().manual_seed(0)
    shape = (2, 4, 96, 16)
    query, key, value = (torch.randn(*shape, dtype=torch.float64, generator=generator) for _ in range(3))
    values = torch.randn(4, 2 * 96 - 1, dtype=torch.float64, generator=generator)
    values[:, : 96 - 1 - 10] = values[:, 96 - 1 - 10 : 96 - 10]  # distances ≤ −10 share one value per head
    exact = materialised(query, key, value, values, 0.25)
    low = [tensor.bfloat16() for tensor in (query, key, value)]
    error = (BandedBiasAttention.apply(*low, values.float(), 10, 0.25).double() - exact).abs().max()
    reference_error = (materialised(*low, values.bfloat16(), 0.25).double() - exact).abs().max()
    assert error <= 2 * reference_error


@pytest.mark.parametrize("score", ["scaled_dot", "multiplicative"])
@pytest.mark.parametrize("scheme", CONSTANT_BIAS_SCHEMES)
def test_sdpa_training_takes_the_banded_kernel_and_equals_eager(scheme, score, monkeypatch):
    """A causal batch without padding, 40 tokens beyond the tiny preset's distances (T5: 16, clamped: 8), GQA:
    sdpa takes the banded kernel in every layer, and its logits and every parameter's gradient (the bias table's
    included) equal eager's."""
    calls = count_applies(monkeypatch, BandedBiasAttention)
    monkeypatch.setattr(banded, "FORWARD_ROWS", 16)  # three band blocks
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 40), generator=generator)
    config = tiny_config(score, scheme)
    results = training_step_by_kernel(config, ids)
    assert len(calls) == config.num_hidden_layers
    assert_same_training_step(results, config)


@pytest.mark.parametrize("scheme", CONSTANT_BIAS_SCHEMES)
def test_padding_and_decoding_take_the_blockwise_kernel(scheme, monkeypatch):
    """A padding mask, a cached decoding step and a sequence within the constant distance leave the banded kernel
    out (the blockwise kernel computes them; `test_fast_paths` checks it against eager)."""
    calls = count_applies(monkeypatch, BandedBiasAttention)
    config = copy.deepcopy(tiny_config("scaled_dot", scheme))
    config._attn_implementation = "sdpa"
    model = PlugformerForCausalLM(config).eval()
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids[:, :8])  # within both schemes' constant distance
        model.generate(ids[:1, :20], max_new_tokens=2, do_sample=False)  # the prefill takes it, the steps do not
    assert len(calls) == config.num_hidden_layers


def test_applies_only_to_causal_unmasked_undropped_equal_lengths():
    query = key = value = torch.zeros(1, 2, 20, 4)
    bias = RelativeBias(torch.zeros(2, 39), 20, 20, constant_beyond=8)
    assert banded_bias_applies(query, key, value, None, 0.0, bias, True)
    assert not banded_bias_applies(query, key, value, None, 0.0, bias, False)  # an encoder sees later keys
    assert not banded_bias_applies(query, key, value, torch.ones(1, 1, 20, 20, dtype=torch.bool), 0.0, bias, True)
    assert not banded_bias_applies(query, key, value, None, 0.1, bias, True)  # attention dropout
    assert not banded_bias_applies(query, key, torch.zeros(1, 2, 20, 8), None, 0.0, bias, True)  # wider values
    assert not banded_bias_applies(query, key, value, None, 0.0, RelativeBias(torch.zeros(2, 39), 20, 20), True)
    assert not banded_bias_applies(query, key, value, None, 0.0, RelativeBias(bias.values, 20, 20, 20), True)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_buckets_are_constant_beyond_the_declared_distance(bidirectional):
    """transformers' T5 bucketing (the reference) puts every distance from `relative_attention_max_distance` on in
    one bucket per side, as `T5BucketBias.constant_bias_distance` declares."""
    config = tiny_config("scaled_dot", "t5_bias")
    far = POSITION_SCHEMES.get("t5_bias").constant_bias_distance(config)
    distances = torch.arange(far, 4 * far)
    for sign in (-1, 1) if bidirectional else (-1,):
        buckets = T5Attention._relative_position_bucket(
            sign * distances,
            bidirectional,
            config.relative_attention_num_buckets,
            config.relative_attention_max_distance,
        )
        assert (buckets == buckets[0]).all()
    scheme = POSITION_SCHEMES.get("t5_bias")(config, bidirectional=bidirectional)
    bias = scheme.distance_bias(torch.cat([-distances, distances]))  # (H, 2M)
    assert (bias[:, : len(distances)] == bias[:, :1]).all() and (bias[:, len(distances) :] == bias[:, -1:]).all()


@pytest.mark.parametrize(
    ("buckets", "max_distance", "expected"),
    # a decoder's distance d >= 16 takes bucket 16 + floor(16 log(d / 16) / log 8), 31 from d >= 16 * 8^(15/16) =
    # 112.4; an encoder's side 8 + floor(8 log(d / 8) / log 16), 15 from d >= 8 * 16^(7/8) = 90.5: the larger, 113.
    # (8, 16): decoder 4 + floor(4 log(d / 4) / log 4) = 7 from d >= 4 * 4^(3/4) = 11.3, encoder 6: 12. (32, 32):
    # decoder 31 from d >= 16 * 2^(15/16) = 30.6, encoder 27: 31.
    [(32, 128, 113), (8, 16, 12), (32, 32, 31)],
    ids=["t5-default", "small-table", "short-max-distance"],
)
def test_t5_constant_distance_is_the_first_in_the_last_bucket(buckets, max_distance, expected):
    """By hand for T5's default (32 buckets, 128): the band stops at 113, not at the max distance. Small configs
    against transformers' bucketing: the distance before the declared one still has a bucket of its own."""
    config = tiny_config(
        "scaled_dot", "t5_bias", relative_attention_num_buckets=buckets, relative_attention_max_distance=max_distance
    )
    far = POSITION_SCHEMES.get("t5_bias").constant_bias_distance(config)
    assert far == expected
    before = [
        T5Attention._relative_position_bucket(torch.tensor([far - 1, far]) * sign, bidirectional, buckets, max_distance)
        for bidirectional, sign in ((False, -1), (True, -1), (True, 1))
    ]
    assert any(pair[0] != pair[1] for pair in before)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_clamped_bias_is_constant_beyond_the_clamp(bidirectional):
    config = tiny_config("scaled_dot", "clamped_bias")
    far = POSITION_SCHEMES.get("clamped_bias").constant_bias_distance(config)
    assert far == config.max_relative_distance
    scheme = POSITION_SCHEMES.get("clamped_bias")(config, bidirectional=bidirectional)
    distances = torch.arange(far, 4 * far)
    bias = scheme.distance_bias(torch.cat([-distances, distances]))  # (H, 2M)
    behind = bias[:, : len(distances)]
    assert (behind == behind[:, :1]).all()
    if bidirectional:
        assert (bias[:, len(distances) :] == bias[:, -1:]).all()
