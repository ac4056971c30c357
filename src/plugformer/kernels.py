"""plugformer's own attention kernels: the eager dot-product kernel and the blockwise SDPA kernel for relative score
biases (the query-chunked additive kernel, which shares the helpers here, is `kernels_additive`).

All follow transformers' attention-function signature, `(module, query, key, value, attention_mask, *, scaling,
dropout, position_bias, **kwargs) -> (output (B, Q, H, D), weights (B, H, Q, K) | None)`, so they are
interchangeable with the sdpa / flex functions in `transformers.ALL_ATTENTION_FUNCTIONS`. They take the
`position_bias` as a bias object of `biases` (a `RelativeBias` (H, Q + K − 1), FIRE's `QueryPositionBias`) and ask
it only for the query rows they work on. transformers' flex attention gets the object too (it reads
`position_bias[b, h, i, j]`, which the bias answers from its values). Which kernel takes what is declared in
`capabilities.KERNELS`.

Which path runs where, for a score bias (`alibi`, `t5_bias`, `clamped_bias`):

| `attn_implementation` | kernel | kept for backward |
|---|---|---|
| `sdpa` | `sdpa_relative_bias_forward`: fused torch SDPA per block of query rows, the block's bias as its mask (a mask
  that never requires grad) | no score-sized tensor: `LearnedBiasAttention` (learned bias) and, on CPU,
  `kernels_fixed.FixedBiasBlock` (ALiBi with a mask; causal ALiBi without one takes `kernels_alibi`, no mask at all)
  recompute the block's weights / mask in the backward |
| `eager` | `eager_attention_forward` (materialises the scores anyway) | the scores; the bias (1, H, Q, K) |
| `flex_attention` | transformers' flex; `score_mod` reads the bias per distance from the (H, Q + K − 1) values | no
  score-sized tensor (no backward on CPU) |
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward as transformers_sdpa

from .biases import QueryPositionBias, RelativeBias
from .kernels_fixed import FixedBiasBlock, recomputes_fixed_mask, sum_over_groups


# Bytes of one (B, H, block, K) score-sized tensor of the relative-bias SDPA kernel.
BIAS_BLOCK_BYTES = 16 * 2**20
# The profiler range around that kernel.
PROFILER_NAME = "plugformer::sdpa_relative_bias"


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> (B, H_kv * n_rep, S, D): each key/value head serves `n_rep` query heads (GQA/MQA)."""
    if n_rep == 1:
        return hidden_states
    batch, num_kv_heads, seq_len, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None].expand(batch, num_kv_heads, n_rep, seq_len, head_dim)
    return hidden_states.reshape(batch, num_kv_heads * n_rep, seq_len, head_dim)  # (B, H, S, D)


def bias_rows(position_bias: RelativeBias | None, rows: slice, keys: int | None = None) -> torch.Tensor | None:
    """The `(1, H, r, keys)` bias of the query rows `rows` over the first `keys` keys (all by default), or `None`."""
    if position_bias is None:
        return None
    if isinstance(position_bias.query_length, torch.SymInt):  # `slice.indices` needs ints; rows lie within Q here
        start = 0 if rows.start is None else rows.start
        return position_bias.rows(start, position_bias.query_length if rows.stop is None else rows.stop, keys)
    start, stop, _ = rows.indices(position_bias.query_length)
    return position_bias.rows(start, stop, keys)


def causal_keys(query_length: int, key_length: int, stop: int) -> int:
    """Keys a causal block of query rows `..stop-1` can see at most: the queries are the last `query_length` of
    `key_length` slots (a dynamic cache; a static cache's extra empty slots lie beyond them), so every key after
    slot `key_length − query_length + stop − 1` is in the block's future."""
    return min(key_length, key_length - query_length + stop)


def mask_blocks_the_future(attention_mask: torch.Tensor, query_length: int, key_length: int) -> bool:
    """Whether a 4-D mask blocks every key after each query's slot (the queries the last `query_length` of
    `key_length` slots), so `causal_keys` may drop those keys. The causal masks transformers builds always do; a
    custom 4-D mask passed to the model may not (a prefix-LM pattern). One reduction over the mask; `False` while
    torch.compile traces (a data-dependent branch): all keys are then scored, which is exact, only slower."""
    if torch.compiler.is_compiling():
        return False
    mask = attention_mask[..., :key_length]
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    future = torch.ones(query_length, key_length, dtype=torch.bool, device=mask.device)
    future = future.triu(key_length - query_length + 1)  # (Q, K): key slot after the query's slot
    return not bool((allowed & future).any())


def symbolic_sizes(*tensors: torch.Tensor) -> bool:
    """Whether a sequence length is symbolic: traced with dynamic shapes (`torch.export` with `Dim`s, `torch.compile`
    with `dynamic=True`, ONNX's dynamo export). The blockwise loops below then run as one block: a Python loop over a
    symbolic length would specialise the graph to the traced length (torch.export refuses, ONNX exported a fixed
    shape). One block is exact, but holds the whole (B, H, Q, K) score-sized tensor the blocks bound."""
    return any(isinstance(size, torch.SymInt) for tensor in tensors for size in tensor.shape[-2:])


def fused_causal_call(query, key, value, attention_mask, dropout: float, position_bias, is_causal: bool) -> bool:
    """What every bias kernel on torch's fused CPU flash kernel (`kernels_alibi`, `kernels_banded`, `kernels_relative`)
    needs of a call: a `RelativeBias` over causal self-attention of N tokens from slot 0 (no cache offset: Q = K) with
    no mask (no padding, packing or window: transformers then leaves the mask out), no attention dropout, values as wide
    as the queries (the CPU flash kernel wants them so), on CPU, outside torch.compile / export tracing (a Python loop
    over blocks would specialise the graph). Each kernel adds its own conditions (bias kind, dtypes)."""
    if not isinstance(position_bias, RelativeBias) or torch.compiler.is_compiling() or symbolic_sizes(query, key):
        return False
    length = query.shape[2]
    same = length == key.shape[2] == position_bias.query_length == position_bias.key_length
    same = same and value.shape[-1] == query.shape[-1]
    return same and is_causal and attention_mask is None and dropout == 0.0 and query.device.type == "cpu"


def merge_by_lse(first, first_lse, second, second_lse, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax attentions of the same queries over disjoint keys, `(B, H, r, D)` each with its log-sum-exp
    `(B, H, r)`, merged into the attention over all their keys (as FlashAttention-2 merges key blocks), in `dtype`."""
    merged = torch.logaddexp(first_lse, second_lse)  # (B, H, r)
    output = (
        first.to(dtype) * (first_lse - merged).exp()[..., None]
        + second.to(dtype) * (second_lse - merged).exp()[..., None]
    )
    return output, merged


def _add_bias_and_mask(
    scores: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_bias: torch.Tensor | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Adds the position bias and the additive float mask (eager masks are 0 / dtype-min) to fp32 scores, after
    capping them as c·tanh(scores / c) with `softcap` c (Gemma 2's eager kernel and transformers' flex `score_mod`
    cap before the mask, and flex before its `position_bias`).

    An fp16 mask blocks with -65504, which fp32 scores above 65504 would outweigh (future or padding keys would leak),
    so its blocked entries are set to the fp32 minimum; bool masks block with it directly.
    """
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if position_bias is not None:
        scores = scores + position_bias.float()
    if attention_mask is not None:
        mask = attention_mask[..., : scores.shape[-1]]
        if mask.dtype == torch.bool:
            return scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        scores = scores + mask.float()
        if mask.dtype == torch.float16:  # bf16/fp32 minima already outweigh any fp32 score; fp16's -65504 does not
            scores = scores.masked_fill(mask == torch.finfo(torch.float16).min, torch.finfo(torch.float32).min)
    return scores


def _softmax_dropout_values(
    module: nn.Module, scores: torch.Tensor, value: torch.Tensor, dropout: float, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    # Softmax in fp32 whatever the input dtype (as transformers' eager kernels do): half-precision scores of
    # long rows overflow.
    if sinks is not None:  # gpt-oss's sinks: one more key column per head with a learned logit, no value
        scores = torch.cat([scores, sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    if sinks is not None:  # dropped after the softmax: the row's weights sum to less than 1
        weights = weights[..., :-1]
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value), weights  # (B, H, Q, D), (B, H, Q, K)


def _wants_weights(module: nn.Module, kwargs: dict) -> bool:
    return bool(kwargs.get("output_attentions", getattr(module.config, "output_attentions", False)))


def dense_products(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The start of a kernel that materialises its weights: the dot products Q Kᵀ `(B, H, Q, K)` in `dtype` (the
    query's by default), unscaled, and the values `(B, H, K, D_v)`, the key/value heads repeated for their groups of
    query heads (`repeat_kv`)."""
    dtype = query.dtype if dtype is None else dtype
    key = repeat_kv(key, module.num_key_value_groups)  # (B, H_kv, K, D) -> (B, H, K, D)
    value = repeat_kv(value, module.num_key_value_groups)  # (B, H_kv, K, D_v) -> (B, H, K, D_v)
    return torch.matmul(query.to(dtype), key.to(dtype).transpose(2, 3)), value


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: RelativeBias | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scaling · Q Kᵀ + bias + mask) V with materialised weights (Vaswani et al. 2017, eq. 1).

    `position_bias` is the `RelativeBias` of a score-bias scheme (ALiBi, T5 buckets, clamped distances); `softcap` c
    caps the logits before it: softmax(c·tanh(scaling · Q Kᵀ / c) + bias + mask) V (Gemma 2). `s_aux` (H,) are
    attention sinks (gpt-oss's `eager_attention_forward`): s_h joins each row of head h as one more logit in the
    softmax, and its weight is dropped.
    """
    # fp16 dot products of long unscaled vectors overflow (65504): score in fp32 there; bf16/fp32 keep their dtype.
    products, value = dense_products(module, query, key, value, torch.float32 if query.dtype == torch.float16 else None)
    scores = products.float() * scaling
    scores = _add_bias_and_mask(scores, attention_mask, bias_rows(position_bias, slice(None)), softcap)  # (B, H, Q, K)
    output, weights = _softmax_dropout_values(module, scores, value, dropout, s_aux)
    return output.transpose(1, 2).contiguous(), weights  # (B, Q, H, D)


def _allowed_keys(
    attention_mask: torch.Tensor | None, is_causal: bool, query_length: int, start: int, stop: int, keys: int, device
) -> torch.Tensor | None:
    """Boolean `(B or 1, 1, r, keys)` of the keys query rows `start..stop-1` may see, or `None` for all.

    Without a mask, a causal multi-token query block starts at key slot 0 (transformers leaves the mask out only
    then: no cache, or an empty one), so query i sees keys 0..i.
    """
    if attention_mask is None:
        if not is_causal or query_length == 1:
            return None
        return (torch.arange(start, stop, device=device)[:, None] >= torch.arange(keys, device=device))[None, None]
    mask = attention_mask[:, :, start:stop, :keys]
    if mask.dtype != torch.bool:  # an additive float mask: blocked where it holds the dtype minimum
        mask = mask > torch.finfo(mask.dtype).min
    return mask


def _bias_mask(
    position_bias: RelativeBias, allowed: torch.Tensor | None, start: int, stop: int, keys: int, dtype: torch.dtype
) -> torch.Tensor:
    """The float SDPA mask `(B or 1, H, r, keys)` of query rows `start..stop-1`: their bias, -inf where blocked.

    -inf rather than the dtype minimum: fp16's minimum, -65504, is outweighed by fp32 scores above 65504 (masked keys
    would leak); SDPA returns zeros for a row with every key blocked (left padding).
    """
    mask = position_bias.rows(start, stop, keys).to(dtype)  # (1, H, r, keys)
    if allowed is None:
        return mask
    return mask.masked_fill(~allowed, _blocked_score(keys, dtype))


def _blocked_score(keys, dtype: torch.dtype) -> float:
    """The score of a blocked key: -inf, or the dtype's minimum in a traced graph. A graph traced for another runtime
    (ONNX) may not zero a row with every key at -inf as torch's SDPA does: its NaN (a padding query) would reach the
    real tokens through the next layer's values. There the finite minimum blocks (fp32/bf16 scores never outweigh it;
    fp16 exports keep the leak risk the -inf avoids)."""
    return torch.finfo(dtype).min if isinstance(keys, torch.SymInt) else float("-inf")


def _sdpa(query, key, value, mask, scaling: float, dropout: float = 0.0) -> torch.Tensor:
    return nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )  # (B, H, r, D)


def _sdpa_bias_block(query, key, value, position_bias, allowed, start, stop, scaling, dropout) -> torch.Tensor:
    if recomputes_fixed_mask(query, key, value, position_bias, dropout):  # ALiBi in training: no mask kept
        return FixedBiasBlock.apply(query, key, value, position_bias, allowed, start, stop, scaling)
    mask = _bias_mask(position_bias, allowed, start, stop, key.shape[2], query.dtype)
    return _sdpa(query, key, value, mask, scaling, dropout)


class LearnedBiasAttention(torch.autograd.Function):
    """Attention over one block of query rows with a score bias that requires grad.

    Forward without dropout: the fused kernel with the bias folded into a mask that does not require grad (torch's
    CPU SDPA would take its math path for one that does). With attention dropout: the weights P of the block, a
    keep mask Z drawn from a generator seeded per block (the seed is drawn from torch's default generator, so
    `torch.manual_seed` makes runs repeat), O = (P ⊙ Z / (1 − p)) V (`block_output`).

    Backward, by hand from P recomputed for this block only (`block_gradients`), and the bias gradient dS summed over
    the batch and folded along the diagonals into the bias values.
    """

    @staticmethod
    def forward(ctx, query, key, value, values, lengths, allowed, start, stop, scaling, dropout):
        bias = RelativeBias(values, *lengths)
        output, seed = block_output(query, key, value, bias, allowed, (start, stop), scaling, dropout)
        ctx.save_for_backward(query, key, value, values, output, allowed)
        ctx.lengths, ctx.rows, ctx.scaling, ctx.dropout, ctx.seed = lengths, (start, stop), scaling, dropout, seed
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, values, output, allowed = ctx.saved_tensors
        bias = RelativeBias(values, *ctx.lengths)
        *grads, d_scores = block_gradients(
            query, key, value, bias, allowed, ctx.rows, ctx.scaling, output, grad_output, ctx.dropout, ctx.seed
        )
        # the bias is shared by the batch; blocked entries have zero weight, so zero d_scores
        grad_values = bias.fold_rows(d_scores.sum(dim=0), ctx.rows[0])
        return *grads, grad_values.to(values.dtype), None, None, None, None, None, None


def block_output(query, key, value, bias, allowed, rows: tuple[int, int], scaling: float, dropout: float):
    """The output `(B, H, r, D)` of one block of query rows with `bias` (its rows `rows`) and no autograd, and the seed
    of its dropout mask (`None` without dropout): the fused kernel with the bias as a mask, or with dropout the block's
    weights P, a keep mask Z from a generator seeded per block, O = (P ⊙ Z / (1 − p)) V."""
    with torch.no_grad():
        if dropout == 0.0:
            return _sdpa_bias_block(query, key, value, bias, allowed, *rows, scaling, 0.0), None
        seed = int(torch.randint(2**62, (), device="cpu"))
        block = _BlockWeights(query, key, value, bias, allowed, rows, scaling)
        kept = block.weights * _kept_scale(block.weights, dropout, seed)  # (B, H, r, K)
        return torch.matmul(kept.to(block.compute), block.value_heads).to(query.dtype), seed  # (B, H, r, D)


def block_gradients(query, key, value, bias, allowed, rows, scaling, output, grad_output, dropout, seed):
    """dQ, dK, dV (in the inputs' dtype) and the score gradient dS `(B, H, r, K)` (fp32, fp64 for fp64 inputs) of one
    block of query rows, by hand from its weights P recomputed (and its dropout mask Z regenerated from `seed`):
    dV = (P ⊙ Z')ᵀ dO, dP = (dO Vᵀ) ⊙ Z', dS = P ⊙ (dP − rowsum(dO ⊙ O)) (the softmax backward; Z' = Z / (1 − p), or
    1 without dropout), dQ = s·dS K, dK = s·dSᵀ Q. dS is also the gradient of the bias rows."""
    block = _BlockWeights(query, key, value, bias, allowed, rows, scaling)
    weights, compute = block.weights, block.compute  # (B, H, r, K) in fp32 (fp64 for fp64 inputs)
    grad_output = grad_output.to(compute)
    # score-sized temporaries are updated in place: each new one maps fresh pages, which cost more than the arithmetic
    d_weights = torch.matmul(grad_output, block.value_heads.transpose(2, 3)).to(weights.dtype)  # (B, H, r, K)
    kept = weights
    if dropout:
        scale = _kept_scale(weights, dropout, seed)  # the forward's mask, regenerated
        kept = weights * scale
        d_weights.mul_(scale)
    if query.dtype in (torch.float16, torch.bfloat16):
        # rowsum(dO ⊙ O) = Σ_j P dP, taken from the P recomputed here: O came from the fused forward with its bias
        # rounded to the inputs' dtype (fp16's too, though its products here run in fp32), so its rowsum would leave
        # each row of dS a nonzero sum, which a bias that adds about the same to a row's scores (FIRE's output layer)
        # reads as gradient (4% error measured)
        delta = (d_weights * weights).sum(dim=-1, keepdim=True)  # (B, H, r, 1)
    else:
        delta = (grad_output.to(weights.dtype) * output.to(weights.dtype)).sum(dim=-1, keepdim=True)  # (B, H, r, 1)
    d_scores = d_weights.sub_(delta).mul_(weights)  # (B, H, r, K)
    grad_value = torch.matmul(kept.to(compute).transpose(2, 3), grad_output)  # (B, H, K, D)
    d_scores_cast = d_scores.to(compute)
    grad_query = torch.matmul(d_scores_cast, block.key_heads).mul_(scaling)  # (B, H, r, D)
    grad_key = torch.matmul(d_scores_cast.transpose(2, 3), block.query).mul_(scaling)  # (B, H, K, D)
    grad_key, grad_value = sum_over_groups(grad_key, grad_value, query.shape[1] // key.shape[1])  # (B, H_kv, K, D)
    dtype = query.dtype
    return grad_query.to(dtype), grad_key.to(dtype), grad_value.to(dtype), d_scores


class _BlockWeights:
    """The softmax weights P (B, H, r, K) of one block of query rows, with the operands the products need.

    Matmuls run in `compute` (fp32 for fp16, whose products of long unscaled vectors overflow 65504, as in the
    eager kernel; else the input dtype); scores and weights in fp32 (fp64 for fp64 inputs).
    """

    def __init__(self, query, key, value, bias: RelativeBias, allowed, rows: tuple[int, int], scaling: float):
        self.compute = torch.float32 if query.dtype == torch.float16 else query.dtype
        accumulate = torch.promote_types(query.dtype, torch.float32)
        groups = query.shape[1] // key.shape[1]
        self.bias, self.query = bias, query.to(self.compute)
        self.key_heads = repeat_kv(key.to(self.compute), groups)  # (B, H, K, D)
        self.value_heads = repeat_kv(value.to(self.compute), groups)  # (B, H, K, D)
        keys = key.shape[2]
        scores = torch.matmul(self.query, self.key_heads.transpose(2, 3)).to(accumulate)  # (B, H, r, K)
        scores.mul_(scaling).add_(bias.rows(*rows, keys))  # in place, as `_bias_mask` without its own tensor
        if allowed is not None:
            scores.masked_fill_(~allowed, _blocked_score(keys, accumulate))
        weights = torch.softmax(scores, dim=-1)  # (B, H, r, K)
        if allowed is not None:  # a row with every key masked has NaN weights and zero output (no branch: compile)
            weights.masked_fill_(~allowed.any(dim=-1, keepdim=True), 0.0)
        self.weights = weights


def _kept_scale(weights: torch.Tensor, dropout: float, seed: int) -> torch.Tensor:
    """Z / (1 − p) for a (B, H, r, K) block: 0 with probability p, else 1 / (1 − p); the same tensor for the same
    seed (the forward draws it, the backward redraws it)."""
    generator = torch.Generator(device=weights.device).manual_seed(seed)
    keep = torch.empty_like(weights).bernoulli_(1.0 - dropout, generator=generator)
    return keep / (1.0 - dropout)


def bias_block_rows(batch: int, heads: int, keys: int, element_size: int) -> int:
    """Query rows per block so one (B, H, rows, K) score-sized tensor stays within `BIAS_BLOCK_BYTES`."""
    return max(16, BIAS_BLOCK_BYTES // (batch * heads * keys * element_size))


def sdpa_relative_bias_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: RelativeBias | QueryPositionBias | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with a relative score bias, one block of query rows at a time, so no (B, H, Q, K) tensor exists.

    torch's SDPA takes a bias only as a float mask, and on CPU falls back to its math path (every score and weight
    kept for backward) when that mask requires grad, as a learned bias does. Here each block's mask
    (B or 1, H, block, K) is built from the bias's rows, and a causal block skips the keys after its last query
    (`causal_keys`; with a mask, when `mask_blocks_the_future`). Per block:

    - bias requiring grad (`t5_bias`, `clamped_bias`, `kerple_log` in training; `kernels_banded` and
      `kernels_relative` where they apply):
      `LearnedBiasAttention`, a fused forward (with attention dropout, the block's weights and a seeded keep mask),
      a backward that recomputes the block's weights (and mask) and reduces the bias gradient into the bias values;
    - fixed bias (`alibi`, or no gradient wanted): the fused kernel; in training on CPU `kernels_fixed.FixedBiasBlock`
      (the fused forward and backward, the block's mask built again in the backward, not kept);
    - FIRE's per-row bias (`QueryPositionBias`, nothing to fold): the fused kernel with the rows as its mask. Training
      runs `kernels_query_bias` instead (rows recomputed in the backward); traced graphs and attention sinks get
      rows that require grad here, so SDPA takes its math path and autograd carries the gradient to θ.

    Returns `(output (B, Q, H, D), None)`: no attention weights (use eager for `output_attentions`).
    """
    is_causal = module.is_causal if is_causal is None else is_causal
    batch, heads, query_length, _ = query.shape
    key_length = key.shape[2]
    # a bias whose gradient folds into its values (`RelativeBias`); FIRE's rows here reach θ through SDPA's float mask
    learned = torch.is_grad_enabled() and position_bias.folds_gradient and position_bias.values.requires_grad
    if symbolic_sizes(query, key):
        # traced with dynamic shapes: one block of all rows over all keys (see `symbolic_sizes`)
        block, skip_future = query_length, False
    else:
        block = bias_block_rows(batch, heads, key_length, max(query.element_size(), 4))
        # a causal block skips the keys after its last query; without a mask the queries start at key slot 0
        skip_future = is_causal and query_length > 1
        skip_future = skip_future and (
            attention_mask is None or mask_blocks_the_future(attention_mask, query_length, key_length)
        )
    outputs = []
    with torch.profiler.record_function(PROFILER_NAME):  # so a profile (`plugformer bench`) names the path
        for start in range(0, query_length, block) if block is not query_length else (0,):
            outputs.append(
                _bias_block_forward(
                    query,
                    key,
                    value,
                    attention_mask,
                    position_bias,
                    is_causal,
                    skip_future,
                    start,
                    query_length if block is query_length else min(start + block, query_length),
                    scaling,
                    dropout,
                    learned,
                )
            )
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # (B, H, Q, D)
    output = output.transpose(1, 2)  # (B, Q, H, D)
    if symbolic_sizes(query, key):  # ONNX's decomposition took `contiguous()` for a no-op here and failed to view it
        return output.clone(memory_format=torch.contiguous_format), None
    return output.contiguous(), None


def _bias_block_forward(
    query, key, value, attention_mask, position_bias, is_causal, skip_future, start, stop, scaling, dropout, learned
) -> torch.Tensor:
    """Output rows `start..stop-1` (B, H, r, D) of `sdpa_relative_bias_forward` on the path its docstring lists."""
    query_length, key_length = query.shape[2], key.shape[2]
    keys = causal_keys(query_length, key_length, stop) if skip_future else key_length
    allowed = _allowed_keys(attention_mask, is_causal, query_length, start, stop, keys, query.device)
    block_args = (query[:, :, start:stop], key[:, :, :keys], value[:, :, :keys])
    if learned:
        lengths = (position_bias.query_length, position_bias.key_length)
        return LearnedBiasAttention.apply(
            *block_args, position_bias.values, lengths, allowed, start, stop, scaling, dropout
        )
    return _sdpa_bias_block(*block_args, position_bias, allowed, start, stop, scaling, dropout)


def sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: RelativeBias | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """plugformer's `sdpa`: transformers' SDPA function without a bias; with a `RelativeBias`, the blockwise
    `sdpa_relative_bias_forward` (transformers' would build the (B, H, Q, K) bias as its mask)."""
    if position_bias is None:
        return transformers_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return sdpa_relative_bias_forward(
        module, query, key, value, attention_mask, scaling, dropout, position_bias=position_bias, **kwargs
    )
