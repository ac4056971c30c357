"""ALiBi's causal sdpa kernel (`kernels_alibi`): its output and every gradient against softmax(s · Q Kᵀ − m_h · (i − j))
written out from the slopes, its precision at a length where folding the bias into the keys without blocks would
lose digits, when the sdpa kernel selects it, and when it leaves a call to the blockwise kernel."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_training_step, count_applies, tiny_config, training_step_by_kernel
from tolerances import relative_bias_tolerances

import plugformer.kernels_alibi as kernels_alibi
from plugformer import PlugformerForCausalLM
from plugformer.biases import RelativeBias
from plugformer.kernels_alibi import LinearBiasAttention, linear_bias_applies
from plugformer.positions import POSITION_SCHEMES, alibi_slopes


def alibi_values(heads: int, length: int, dtype=torch.float64) -> torch.Tensor:
    """The `RelativeBias` values `(H, 2N − 1)` of ALiBi: −m_h · |d| at distances d = j − i from 1 − N to N − 1."""
    distances = torch.arange(2 * length - 1, dtype=dtype) - (length - 1)
    return -alibi_slopes(heads).to(dtype)[:, None] * distances.abs()


def by_hand(query, key, value, scaling):
    """softmax over j ≤ i of s · q_i · k_j − m_h · (i − j), times V: the bias from the slopes, not from the values."""
    heads, length = query.shape[1], query.shape[2]
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)  # (B, H, N, D)
    slots = torch.arange(length)
    behind = (slots[:, None] - slots[None, :]).to(query.dtype)  # (N, N): i − j
    scores = query @ key.transpose(-1, -2) * scaling - alibi_slopes(heads).to(query.dtype)[:, None, None] * behind
    scores = scores.masked_fill(behind < 0, float("-inf"))  # (B, H, N, N)
    return torch.softmax(scores, dim=-1) @ value


def random_inputs(length, heads, kv_heads, dtype=torch.float64, dim=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, length, dim), (2, kv_heads, length, dim), (2, kv_heads, length, dim)]
    return [torch.randn(*shape, dtype=torch.float64, generator=generator).to(dtype) for shape in shapes]


@pytest.mark.parametrize(
    ("length", "rows", "heads", "kv_heads"),
    [(37, 8, 4, 4), (50, 7, 6, 2), (16, 16, 4, 1), (21, 32, 12, 3), (1, 8, 4, 2)],
    ids=["blocks-short-last", "gqa-odd-rows", "one-full-block", "one-short-block-12-heads", "one-token"],
)
def test_output_and_every_gradient_equal_the_alibi_softmax_by_hand(length, rows, heads, kv_heads, monkeypatch):
    """fp64: output and the gradients of Q, K and V equal autograd through the bias written out from the slopes
    (12 heads: slopes that are not powers of two)."""
    monkeypatch.setattr(kernels_alibi, "ROWS", rows)
    query, key, value = (tensor.requires_grad_() for tensor in random_inputs(length, heads, kv_heads))
    grad_output = torch.randn(2, heads, length, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    output = LinearBiasAttention.apply(query, key, value, alibi_values(heads, length), 0.37)
    expected = by_hand(query, key, value, 0.37)
    # two fp64 computations (blocks against the materialised bias): `attention_tolerances` in fp64
    atol = relative_bias_tolerances(query, key, value, alibi_values(heads, length), 0.37, grad_output)
    torch.testing.assert_close(output, expected, atol=atol["output"], rtol=0)
    grads = torch.autograd.grad(output, (query, key, value), grad_output)
    expected_grads = torch.autograd.grad(expected, (query, key, value), grad_output)
    for name, grad, reference in zip(("query", "key", "value"), grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference, atol=atol[name], rtol=0, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_are_as_close_to_fp64_as_the_materialised_softmax(dtype):
    """1024 tokens in 256-row blocks, slopes up to 1/2 (bias values to −511): the output and gradients in fp32 / bf16
    are as close to fp64 as the materialised softmax in that dtype with the fp32 bias (eager's). Adding m_h · j
    without blocks would round scores near 512 to 3e-5 (fp32)."""
    length, heads = 1024, 8
    exact_inputs = [tensor.requires_grad_() for tensor in random_inputs(length, heads, heads, dim=16)]
    low_inputs = [tensor.detach().to(dtype).requires_grad_() for tensor in exact_inputs]
    grad_output = torch.randn(2, heads, length, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    exact = by_hand(*exact_inputs, 0.25)
    exact_grads = torch.autograd.grad(exact, exact_inputs, grad_output)

    def errors(output, inputs):
        grads = torch.autograd.grad(output, inputs, grad_output.to(dtype))
        differences = [output.double() - exact] + [g.double() - e for g, e in zip(grads, exact_grads, strict=True)]
        return [difference.abs().max().item() for difference in differences]

    values = alibi_values(heads, length, torch.float32)
    mine = errors(LinearBiasAttention.apply(*low_inputs, values, 0.25), low_inputs)
    slots = torch.arange(length)
    bias = values[:, slots[None, :] - slots[:, None] + length - 1]  # (H, N, N), eager's fp32 bias
    query, key, value = low_inputs
    scores = (query @ key.transpose(-1, -2)).float() * 0.25 + bias
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    reference = errors(torch.softmax(scores, dim=-1).to(dtype) @ value, low_inputs)
    for name, error, bound in zip(("output", "query", "key", "value"), mine, reference, strict=True):
        assert error <= 2 * bound, (name, error, bound)


@pytest.mark.parametrize("score", ["scaled_dot", "multiplicative"])
def test_sdpa_training_takes_the_alibi_kernel_and_equals_eager(score, monkeypatch):
    """A causal batch without padding, 40 tokens in 16-row blocks, GQA (the tiny preset): sdpa takes the kernel in
    every layer, and its logits and every parameter's gradient equal eager's."""
    monkeypatch.setattr(kernels_alibi, "ROWS", 16)
    calls = count_applies(monkeypatch, LinearBiasAttention)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    config = tiny_config(score, "alibi")
    results = training_step_by_kernel(config, ids)
    assert len(calls) == config.num_hidden_layers
    assert_same_training_step(results, config)


def test_padding_dropout_and_decoding_take_the_blockwise_kernel(monkeypatch):
    """A padding mask, attention dropout and cached decoding steps leave the kernel out (the blockwise kernel computes
    them; `test_fast_paths` checks it against eager); a generate's prefill takes it."""
    calls = count_applies(monkeypatch, LinearBiasAttention)
    config = copy.deepcopy(tiny_config("scaled_dot", "alibi", attention_dropout=0.1))
    config._attn_implementation = "sdpa"
    model = PlugformerForCausalLM(config)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    model.train()(input_ids=ids, labels=ids).loss.backward()  # dropout
    assert not calls
    with torch.no_grad():
        model.eval()(input_ids=ids, attention_mask=mask)
        assert not calls
        model.generate(ids[:1, :20], max_new_tokens=3, do_sample=False)
    assert len(calls) == config.num_hidden_layers


def test_applies_only_to_a_linear_causal_unmasked_undropped_fixed_bias():
    query = key = value = torch.zeros(1, 2, 20, 4)
    bias = RelativeBias(alibi_values(2, 20, torch.float32), 20, 20, linear=True)
    assert linear_bias_applies(query, key, value, None, 0.0, bias, True)
    assert linear_bias_applies(query.bfloat16(), key.bfloat16(), value.bfloat16(), None, 0.0, bias, True)
    assert not linear_bias_applies(query, key, value, None, 0.0, bias, False)  # an encoder sees later keys
    assert not linear_bias_applies(query, key, value, torch.ones(1, 1, 20, 20, dtype=torch.bool), 0.0, bias, True)
    assert not linear_bias_applies(query, key, value, None, 0.1, bias, True)  # attention dropout
    assert not linear_bias_applies(query, key, torch.zeros(1, 2, 20, 8), None, 0.0, bias, True)  # wider values
    assert not linear_bias_applies(query.half(), key.half(), value.half(), None, 0.0, bias, True)
    assert not linear_bias_applies(query[:, :, :1], key, value, None, 0.0, bias, True)  # a step after a cache
    assert not linear_bias_applies(query, key, value, None, 0.0, RelativeBias(bias.values, 20, 20), True)
    learned = RelativeBias(bias.values.clone().requires_grad_(), 20, 20, linear=True)
    assert not linear_bias_applies(query, key, value, None, 0.0, learned, True)


def test_only_alibi_declares_a_linear_bias():
    """The schemes' declaration (`linear_bias_slopes`) reaches the bias object; ALiBi's values are that linear bias."""
    config = tiny_config("scaled_dot", "alibi")
    linear = [name for name in POSITION_SCHEMES if POSITION_SCHEMES.get(name).linear_bias_slopes(config) is not None]
    assert linear == ["alibi"]
    scheme = POSITION_SCHEMES.get("alibi")(config)
    distances = torch.arange(-9, 1)
    slopes = POSITION_SCHEMES.get("alibi").linear_bias_slopes(config)
    torch.testing.assert_close(scheme.distance_bias(distances), slopes[:, None] * distances.float())
