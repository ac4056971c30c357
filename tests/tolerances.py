"""Tolerances for comparisons whose two sides round differently, derived from the dtypes and the operation.

Two computations of one quantity (a kernel against eager, the native C kernel against torch, sdpa against eager, a
backward written by hand against autograd, chunks against one pass) differ by their rounding errors only, and those
depend on the machine: which instructions the CPU has (FMA or not, 8 or 16 SIMD lanes; torch picks its vectorised
exp, tanh and softmax by `ATEN_CPU_CAPABILITY`, and at some row lengths a vectorised loop and its scalar tail round
differently), the order in which BLAS and SIMD lanes add, the thread count. A fixed `atol` that held on one CPU may
fail on the next, so the bound is derived instead. For a result computed in a dtype with unit roundoff u (half the
dtype's `eps`: the coarsest dtype either side computes in, e.g. fp32's scores inside an fp64 comparison)

    atol = SAFETY · u · (steps + √length + spread) · magnitude

- `magnitude`: the size of the terms the result is formed from (Σ|x_i| for a sum Σ x_i; max|v| for softmax-weighted
  values v; |v|·Σ_j p_ij (|g_ij| + Σ_k p_ik |g_ik|) for a softmax's gradient), not of the result, which cancellation
  can make small.
- `length`: the number of terms of the reduction. A sum of n terms errs by at most n·u·Σ|x_i| in any order; rounding
  errors of random signs grow as √n·u·Σ|x_i| (Higham & Mary, "A new approach to probabilistic rounding error
  analysis", SIAM J. Sci. Comput. 2019), which is what blocked, pairwise and SIMD sums reach in practice.
- `spread`: for results through a softmax (`softmax_spread`), the largest mean distance Σ_j p_ij (m_i − s_ij) of a
  row's scores below its maximum m_i, weighted by the row's softmax p: exp(s − m) is computed from s − m rounded by
  u·|s − m|, which moves it by the relative u·|s − m| (exp's condition number is |x|), and a weight p_j moves the
  output Σ_j p_j x_j by p_j (x_j − o) per unit of its score, so the softmax's error grows by that mean. It is at most
  ln K over K keys (the row's entropy less ln Σ_j exp(s_j − m)).
- `steps`: rounded operations chained around the reduction (each elementwise op or cast a relative u; a vectorised
  exp or tanh as many as its ulp bound; a model: its layers times the rounded stages of one layer, `model_steps`).
- `SAFETY`: 2 for the two sides, each within the bound, times 2 for the probabilistic bound's constant.

A bound from these quantities stays orders of magnitude below the error of any wrong formula (a dropped term, a
wrong mask, a missed chunk), which is of the size of the magnitude itself. Where a computation is too ill-conditioned
for the estimate (a fuzzed model with scores in the hundreds), its condition κ is measured instead: the same forward
in fp32 against fp64 differs by κ·u_fp32, so two fp64 computations by κ·u_fp64 (`conditioned_tolerance`).
"""

from __future__ import annotations

import math

import torch


SAFETY = 4.0
# rounded stages of one decoder layer, each a reduction or an elementwise chain: the norms, the q/k/v projections,
# the score, the softmax, the weighted values, o_proj, the MLP's two products, the residual adds
STAGES_PER_LAYER = 10


def unit_roundoff(*dtypes: torch.dtype) -> float:
    """u of the coarsest of `dtypes`: half the distance from 1 to the next number (2^-24 for fp32, 2^-53 for fp64)."""
    return max(torch.finfo(dtype).eps for dtype in dtypes) / 2


def tolerance(
    *dtypes: torch.dtype, magnitude: float = 1.0, length: int = 1, spread: float = 0.0, steps: float = 1.0
) -> float:
    """`atol` for two computations in `dtypes` of a result from terms of size `magnitude`, through a reduction of
    `length` terms, a softmax of rows spread over `spread` below their maxima and `steps` rounded operations: SAFETY ·
    u · (steps + √length + spread) · magnitude (see the module's docstring)."""
    return SAFETY * unit_roundoff(*dtypes) * (steps + math.sqrt(length) + spread) * magnitude


def softmax_spread(scores: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """The largest Σ_j p_ij (m_i − s_ij) over the rows of `scores` (..., K): m_i the row's maximum, p_ij its softmax,
    over the keys `mask` (a bool tensor broadcast to `scores`, True where a key is seen) allows; 0 for a row that
    sees no key."""
    scores = scores.detach().double()
    allowed = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask.expand_as(scores)
    blocked = scores.masked_fill(~allowed, -math.inf)
    peak = blocked.amax(-1, keepdim=True)
    weights = blocked.softmax(-1).nan_to_num(0.0)
    return (weights * (peak - scores).masked_fill(~allowed, 0.0).nan_to_num(0.0)).sum(-1).max().item()


def model_steps(config) -> float:
    """Rounded stages of a forward through `config`'s decoder layers (an encoder-decoder's both stacks; a model
    without a stack of layers, as decomposable attention, one layer's)."""
    layers = getattr(config, "num_hidden_layers", None) or 1
    layers += getattr(config, "num_decoder_layers", 0) * config.is_encoder_decoder
    return STAGES_PER_LAYER * max(layers, 1)


def model_length(config, tokens: int) -> int:
    """The longest reduction of a forward of `tokens` through `config`: a projection's, the MLP's or a row's keys."""
    return max(config.hidden_size, getattr(config, "intermediate_size", 0), tokens)


def model_tolerance(
    config, reference: torch.Tensor, dtype: torch.dtype = torch.float32, magnitude: float | None = None
) -> float:
    """`tolerance` for a model's output `reference` `(B, N, ...)` (logits, hidden states, a gradient) computed two ways
    in `dtype`: the steps of its layers (`model_steps`), its longest reduction (`model_length`) and `magnitude`, by
    default max|reference| and at least 1 (logits near 0 still come from unit-sized hidden states and weights); for a
    gradient, pass the largest of the step's gradients (its backward's values, which every parameter's sums take)."""
    if magnitude is None:
        magnitude = max(reference.detach().abs().max().item(), 1.0)
    tokens = reference.shape[1] if reference.dim() > 1 else 1
    return tolerance(dtype, magnitude=magnitude, length=model_length(config, tokens), steps=model_steps(config))


def assert_same_step(
    config,
    logits: torch.Tensor,
    grads: dict,
    reference_logits: torch.Tensor,
    reference_grads: dict,
    msg: str = "",
    tokens: int | None = None,
) -> None:
    """A training step's logits and gradients `{name: gradient}` equal a reference step's of the same `config` in
    fp32 within `model_tolerance` over `tokens` (defaults to the logits' second axis; the gradients' magnitude: the
    largest of the reference's gradients)."""
    tokens = reference_logits.shape[1] if tokens is None else tokens
    length, steps = model_length(config, tokens), model_steps(config)
    magnitude = max(reference_logits.detach().abs().max().item(), 1.0)
    atol = tolerance(torch.float32, magnitude=magnitude, length=length, steps=steps)
    torch.testing.assert_close(logits, reference_logits, atol=atol, rtol=0, msg=msg)
    assert grads.keys() == reference_grads.keys()
    atol = gradient_tolerance(config, reference_grads, tokens)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=atol, rtol=0, msg=f"{msg}: {name}")


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *dtypes: torch.dtype,
    magnitude: float | None = None,
    length: int = 1,
    spread: float = 0.0,
    steps: float = 1.0,
    msg: str | None = None,
) -> None:
    """`torch.testing.assert_close(actual, expected)` within `tolerance(*dtypes, ...)` (`rtol` 0), the magnitude
    max|expected| where not given, the dtypes `actual`'s and `expected`'s where none are given."""
    dtypes = dtypes or (actual.dtype, expected.dtype)
    if magnitude is None:
        magnitude = expected.detach().abs().max().item()
    atol = tolerance(*dtypes, magnitude=magnitude, length=length, spread=spread, steps=steps)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0, msg=msg)


def attention_tolerances(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_output: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """`atol` of softmax(scale · Q Kᵀ + bias, masked) V `(B, H, Q, D)` and of its gradients (upstream `grad_output`)
    computed in `dtype` against the same formula elsewhere: {"output", "query", "key", "value", "bias"} (the bias's
    summed over every pair of a head, as a table of distances may gather them). Key and value heads are repeated to
    the query heads; `mask` (bool, True where a key is seen) broadcasts to the scores.

    Growth: the row's softmax (√K, `softmax_spread`, exp and the division) and the scores' own rounding in units of u
    (√D · scale · max Σ_d |q_d k_d| for the dot product, max(1, max|bias|) for adding the bias). Magnitudes: max|V|
    for the output; for the gradients the terms each sums, from ds_ij = p_ij (g_ij − Σ_k p_ik g_ik) with g = dO Vᵀ, whose error is
    u·p_ij (|g_ij| + Σ_k p_ik |g_ik|) per unit of growth: times scale·max|K| summed over a row (query), scale·max|Q|
    over a column (key); Σ_i p_ij |dO_i| for the values (the key's and value's times the query heads
    that share a key head)."""
    with torch.no_grad():
        groups = query.shape[1] // key.shape[1]
        query, key, value, grad_output = (tensor.detach().double() for tensor in (query, key, value, grad_output))
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = query @ key.transpose(-1, -2) * scale + (0.0 if bias is None else bias.double())
        allowed = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask.expand_as(scores)
        weights = scores.masked_fill(~allowed, -math.inf).softmax(-1).nan_to_num(0.0)  # (B, H, Q, K)
        dot = math.sqrt(query.shape[-1]) * scale * (query.abs() @ key.abs().transpose(-1, -2)).max().item()
        added = 1.0 if bias is None else max(1.0, bias.detach().abs().max().item())
        growth = {"length": scores.shape[-1], "spread": softmax_spread(scores, allowed) + dot + added, "steps": 2}
        g = (grad_output @ value.transpose(-1, -2)).abs()  # (B, H, Q, K)
        terms = weights * (g + (weights * g).sum(-1, keepdim=True))
        magnitudes = {
            "output": value.abs().max().item(),
            "query": scale * key.abs().max().item() * terms.sum(-1).max().item(),
            "key": groups * scale * query.abs().max().item() * terms.sum(-2).max().item(),  # a key's query heads
            "value": groups * (weights.transpose(-1, -2) @ grad_output.abs()).max().item(),
            "bias": terms.sum((0, 2, 3)).max().item(),
        }
    return {name: tolerance(dtype, magnitude=magnitude, **growth) for name, magnitude in magnitudes.items()}


def layer_tolerance(attention, hidden: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """`atol` of one attention layer's output `(B, T, hidden)` from its input `hidden` computed two ways in `dtype`:
    o_proj's terms, at most max|v| · max_o Σ_k |W_o[o, k]| (softmax-weighted values are at most max|v|, and
    max|v| ≤ max|hidden| · max_k Σ_d |W_v[k, d]|), through one layer's `STAGES_PER_LAYER` steps, its longest
    reduction (the hidden size, o_proj's inputs or the T keys) and a softmax spread of at most ln T."""
    config, tokens = attention.config, hidden.shape[1]
    value = hidden.detach().abs().max().item() * attention.v_proj.weight.detach().abs().sum(-1).max().item()
    rows = attention.o_proj.weight.detach().abs().sum(-1).max().item()
    length = max(config.hidden_size, attention.o_proj.weight.shape[1], tokens)
    return tolerance(dtype, magnitude=value * rows, length=length, spread=math.log(tokens), steps=STAGES_PER_LAYER)


def conditioned_tolerance(config, reference: torch.Tensor, coarse: torch.Tensor) -> float:
    """`model_tolerance` of `reference` (a model's output in fp64) where the model is too ill-conditioned for the
    steps-and-lengths estimate (unscaled dot products of unit-sized weights: scores in the hundreds, whose rounding
    the softmax carries to the output): the condition is measured instead. `coarse`, the same forward in fp32,
    differs from `reference` by κ · u_fp32, so two fp64 computations differ by κ · u_fp64 each: SAFETY ·
    max|coarse − reference| · u_fp64 / u_fp32 on top of `model_tolerance` in fp64."""
    error = (coarse.detach().double() - reference.detach().double()).abs().max().item()
    if not math.isfinite(error):  # fp32 overflowed: no measure of κ, only the fp64 estimate
        error = 0.0
    ratio = unit_roundoff(torch.float64) / unit_roundoff(torch.float32)
    return SAFETY * error * ratio + model_tolerance(config, reference, dtype=torch.float64)


def gradient_tolerance(config, reference_grads: dict, tokens: int) -> float:
    """`atol` of a training step's gradients `{name: gradient}` through `config` over `tokens` computed two ways in
    fp32 (checkpointed blocks recomputed, another accumulation order): `assert_same_step`'s gradient bound, the
    magnitude the largest of `reference_grads`."""
    size = max(grad.abs().max().item() for grad in reference_grads.values())
    return tolerance(torch.float32, magnitude=size, length=model_length(config, tokens), steps=model_steps(config))


def relative_bias_tolerances(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    grad_output: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> dict[str, float]:
    """`attention_tolerances` of causal attention `(B, H, N, D)` with the bias of the relative table `values`
    `(H, 2N − 1)` (distance j − i at column j − i + N − 1, as `conftest.materialised_relative_attention` gathers it):
    a table entry's gradient sums the pairs at its distances, within the bias's bound over every pair of a head."""
    length = query.shape[2]
    slots = torch.arange(length)
    bias = values.detach()[:, slots[None, :] - slots[:, None] + length - 1]  # (H, N, N)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return attention_tolerances(query, key, value, grad_output, scale, bias, causal, dtype=dtype)
