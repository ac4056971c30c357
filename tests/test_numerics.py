"""Half precision with scores beyond the fp16 range (65504): nothing overflows, masked keys stay masked, and the
outputs stay close to the same model run in fp32.

The weights are set so that every score is huge *and* the softmax is decided by a wide margin: each query's own key
wins by far more than half precision can misjudge. The fp32 reference is then a hard, unambiguous choice, and a
half-precision run either reproduces it (up to rounding of O(1) activations) or is wrong by O(1).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build, tiny_config

from plugformer import ATTENTION_SCORES, supported_kernels
from plugformer.kernels import repeat_kv
from plugformer.scores import AdditiveScore


FP16_MAX = torch.finfo(torch.float16).max  # 65504
HIDDEN = 32  # the tiny preset's width; heads are made this wide so that a head sees the whole normalised state
LENGTH = 64  # tokens: as many distinct ones as the tiny preset has learned positions
# Dot-product scores: q = k = SCALE · x with x RMS-normalised (|x|² = 32), so q_i·k_i = SCALE² · 32 = 524288 (8× the
# fp16 maximum; still 92682 after scaled_dot's 1/sqrt(32)), and q_i·k_j < q_i·k_i for every other key.
SCALE = 128.0
# Additive scores: pre-activations a(x_i − x_j) ± b, energies ±c (see `additive_model`).
SLOPE, OFFSET, ENERGY = 8.0, 1.0, 2000.0
# Two layers of O(1) activations each rounded a dozen times (embedding, norm, projections, softmax, MLP, head):
# errors stay within a few machine epsilons of the logits' scale. An overflow, a NaN or a different key chosen
# moves the logits by their own scale (≈ 0.5 here), far outside.
EPSILONS = 4


def cpu_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU build runs matrix products in `dtype` (older builds raise for fp16)."""
    try:
        torch.ones(2, 2, dtype=dtype) @ torch.ones(2, 2, dtype=dtype)
    except RuntimeError:
        return False
    return True


HALF_DTYPES = [
    pytest.param(
        dtype,
        id=str(dtype).removeprefix("torch."),
        marks=pytest.mark.skipif(not cpu_supports(dtype), reason=f"this CPU build has no {dtype} matmul"),
    )
    for dtype in (torch.bfloat16, torch.float16)
]
# Every dot-product score from the registry, but those whose logits half precision always holds (nothing to overflow),
# each with the reason.
BOUNDED_SCORES = {"cosine": "e = g_h · q̂·k̂ with unit q̂, k̂, so |e| <= |g_h|, a parameter of the same dtype"}
DOT_PRODUCT_SCORES = [
    name for name in ATTENTION_SCORES if ATTENTION_SCORES.get(name).dot_product and name not in BOUNDED_SCORES
]
SCHEMES = ("learned", "rope", "alibi", "t5_bias")


def dot_product_model(score: str, scheme: str, kernel: str, key_sign: float = 1.0):
    """Every head computes q = SCALE · x, k = key_sign · SCALE · x from the normalised state x (head_dim = hidden)."""
    model = build(tiny_config(score, scheme, head_dim=HIDDEN), kernel)
    config, identity = model.config, torch.eye(HIDDEN)
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            attention.q_proj.weight.copy_(SCALE * identity.repeat(config.num_attention_heads, 1))
            attention.k_proj.weight.copy_(key_sign * SCALE * identity.repeat(config.num_key_value_heads, 1))
    return model


def additive_model(scheme: str, energy_sign: float = 1.0):
    """Bahdanau scores with a bump at δ = x_i − x_j = 0: the prepared query is [a x + b; a x − b] (a q_proj bias gives
    the offsets), the prepared key [−a x; −a x], W1 = W2 = I and v = energy_sign · c [1; −1], so

        e_ij = energy_sign · c Σ_d [tanh(a δ_d + b) − tanh(a δ_d − b)].

    Each term peaks at δ_d = 0 (2 tanh b) and vanishes for |a δ_d| ≫ b: a query's own key scores
    32 · 2 tanh(1) · c ≈ 97 000, others far less (most of their 32 terms vanish).
    """
    config = tiny_config("additive", scheme, head_dim=2 * HIDDEN, attention_bias=True, additive_chunk_size=16)
    model = build(config, "eager")
    identity, ones = torch.eye(HIDDEN), torch.ones(HIDDEN)
    query_map = torch.cat([SLOPE * identity, SLOPE * identity])  # (2·hidden, hidden)
    with torch.no_grad():
        for layer in model.model.layers:
            attention, score = layer.self_attn, layer.self_attn.score
            attention.q_proj.weight.copy_(query_map.repeat(config.num_attention_heads, 1))
            attention.q_proj.bias.copy_(torch.cat([OFFSET * ones, -OFFSET * ones]).repeat(config.num_attention_heads))
            attention.k_proj.weight.copy_(-query_map.repeat(config.num_key_value_heads, 1))
            attention.k_proj.bias.zero_()
            score.query_weight.copy_(torch.eye(2 * HIDDEN).expand_as(score.query_weight))
            score.key_weight.copy_(torch.eye(2 * HIDDEN).expand_as(score.key_weight))
            score.energy.copy_(energy_sign * ENERGY * torch.cat([ones, -ones]).expand_as(score.energy))
    return model


def layer0_scores(model, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Layer 0's scores (B, H, Q, K) computed naively in `dtype`: the prepared q·kᵀ · scaling (or vᵀ tanh(W1 q + W2 k))
    with no upcast and no mask; positions are left out (they move scores by tens at most)."""
    model = copy.deepcopy(model).to(dtype)
    layer = model.model.layers[0]
    attention, score = layer.self_attn, layer.self_attn.score
    with torch.no_grad():
        x = layer.input_layernorm(model.model.embed_tokens(ids))
        query = score.prepare_query(attention.split_heads(attention.q_proj(x)))
        key = repeat_kv(score.prepare_key(attention.split_heads(attention.k_proj(x))), attention.num_key_value_groups)
        if isinstance(score, AdditiveScore):
            hidden = torch.tanh(query[:, :, :, None] + key[:, :, None])  # (B, H, Q, K, A)
            return torch.einsum("bhqka,ha->bhqk", hidden, score.energy)
        return torch.matmul(query, key.transpose(2, 3)) * score.scaling


def tolerance(dtype: torch.dtype, reference: torch.Tensor) -> float:
    return EPSILONS * torch.finfo(dtype).eps * reference.abs().max().item()


def distinct_tokens() -> torch.Tensor:
    """(1, LENGTH) distinct ids (no special ids): distinct tokens have distinct normalised states."""
    return (torch.randperm(125, generator=torch.Generator().manual_seed(0))[:LENGTH] + 3)[None]


CASES = [
    pytest.param(score, scheme, kernel, id=f"{score}-{scheme}-{kernel}")
    for score in DOT_PRODUCT_SCORES
    for scheme in SCHEMES
    for kernel in supported_kernels(tiny_config(score, scheme))
    if kernel != "flex_attention"  # compiled per shape on CPU; the fused kernels here are sdpa's
] + [
    # rope rotates the prepared query and key apart, which would shift the bump off δ = 0
    pytest.param("additive", scheme, "eager", id=f"additive-{scheme}-eager")
    for scheme in SCHEMES
    if scheme != "rope"
]


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("score,scheme,kernel", CASES)
def test_scores_beyond_the_fp16_range_stay_finite_and_match_fp32(score, scheme, kernel, dtype):
    model = additive_model(scheme) if score == "additive" else dot_product_model(score, scheme, kernel)
    ids = distinct_tokens()
    # the test means something: naive fp16 scores overflow (the diagonal alone is 1.5× to 8× the fp16 maximum)
    assert layer0_scores(model, ids, torch.float32).diagonal(dim1=-2, dim2=-1).min() > 1.4 * FP16_MAX
    assert torch.isinf(layer0_scores(model, ids, torch.float16)).any()
    weights = kernel == "eager"
    with torch.no_grad():
        reference = model(ids, output_attentions=weights)
        half = copy.deepcopy(model).to(dtype)(ids, output_attentions=weights)
    assert torch.isfinite(half.logits).all()
    torch.testing.assert_close(half.logits.float(), reference.logits, atol=tolerance(dtype, reference.logits), rtol=0)
    if weights:
        for expected, got in zip(reference.attentions, half.attentions, strict=True):
            # the reference is the hard choice built above: every query attends to its own key only
            torch.testing.assert_close(expected, torch.eye(LENGTH).expand_as(expected), atol=1e-6, rtol=0)
            torch.testing.assert_close(got.float(), expected, atol=torch.finfo(dtype).eps, rtol=0)


LEAK_CASES = [
    pytest.param(score, scheme, kernel, id=f"{score}-{scheme}-{kernel}")
    for score in ("dot", "scaled_dot", "additive")
    for scheme in ("none", "alibi", "t5_bias")
    for kernel in ("eager", "sdpa")
    if kernel in supported_kernels(tiny_config(score, scheme))
]


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("score,scheme,kernel", LEAK_CASES)
def test_masked_keys_stay_masked_when_scores_exceed_the_fp16_range(score, scheme, kernel, dtype):
    """An fp16 additive mask blocks with -65504; a blocked key scoring more than 65504 above the allowed ones would
    win anyway. Here a left-padding key and a future key are anti-aligned with every real query and outscore its
    allowed keys by about 10^6 (dot) or 10^5 (additive)."""
    if score == "additive":
        model = additive_model(scheme, energy_sign=-1.0)  # a query's own (identical) keys now score lowest
    else:
        model = dot_product_model(score, scheme, kernel, key_sign=-1.0)  # q_i·k_j = -SCALE² x_i·x_j
    with torch.no_grad():
        model.model.embed_tokens.weight[4] = -model.model.embed_tokens.weight[3]  # token 4 is anti-aligned with 3
    ids = torch.tensor([[4] + [3] * 14 + [4], [3] * 16])
    mask = torch.ones_like(ids)
    mask[0, 0] = 0  # a padding key, blocked for every query
    scores = layer0_scores(model, ids, torch.float32)
    assert (scores[0, :, 1, [0, 15]].min(-1).values - FP16_MAX > scores[0, :, 1, 1:15].max(-1).values).all()
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        half = copy.deepcopy(model).to(dtype)(ids, attention_mask=mask).logits.float()
    real = mask.bool()  # padding queries see no key at all: their outputs differ between kernels and mean nothing
    assert torch.isfinite(half[real]).all()
    torch.testing.assert_close(half[real], reference[real], atol=tolerance(dtype, reference[real]), rtol=0)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("score,kernel", [("dot", "sdpa"), ("scaled_dot", "eager"), ("additive", "eager")])
def test_a_half_precision_training_step_with_a_learned_bias_is_finite(score, kernel, dtype):
    """With gradients on, the t5 bias requires grad: sdpa runs the blockwise kernel with its hand-written backward."""
    model = additive_model("t5_bias") if score == "additive" else dot_product_model(score, "t5_bias", kernel)
    ids = distinct_tokens()
    reference = model.train()(ids, labels=ids).loss
    half = copy.deepcopy(model).to(dtype).train()
    loss = half(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.float(), reference, atol=tolerance(dtype, reference), rtol=0)
    assert all(torch.isfinite(p.grad).all() for p in half.parameters() if p.grad is not None)
    assert half.model.positions.relative_attention_bias.weight.grad is not None


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("scheme", ["alibi", "t5_bias"])
def test_cached_half_precision_decoding_with_a_score_bias_on_sdpa(scheme, cache_implementation, dtype):
    """Prefill (a causal block without a mask, or an empty static cache) and one-token decode steps fold the bias
    differently; every step's logits match a full fp32 forward over the generated sequence."""
    model = dot_product_model("dot", scheme, "sdpa")
    prompt = distinct_tokens()[:, :24]
    out = (
        copy.deepcopy(model)
        .to(dtype)
        .generate(
            prompt,
            max_new_tokens=8,
            do_sample=False,
            cache_implementation=cache_implementation,
            output_logits=True,
            return_dict_in_generate=True,
        )
    )
    steps = torch.stack(out.logits, dim=1).float()  # (1, 8, V)
    with torch.no_grad():
        reference = model(out.sequences, use_cache=False).logits[:, 23:-1]
    assert torch.isfinite(steps).all()
    torch.testing.assert_close(steps, reference, atol=tolerance(dtype, reference), rtol=0)
