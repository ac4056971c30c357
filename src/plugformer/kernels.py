"""plugformer's own attention kernels: the eager dot-product kernel (with additive position bias) and the
query-chunked additive (Bahdanau) kernel.

Both follow transformers' attention-function signature, `(module, query, key, value, attention_mask, *, scaling,
dropout, position_bias, **kwargs) -> (output (B, Q, H, D), weights (B, H, Q, K) | None)`, so they are
interchangeable with the sdpa / flex functions in `transformers.ALL_ATTENTION_FUNCTIONS`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


# Bytes of (B, H, chunk, K, A) tanh activations the additive kernel may hold at once.
ADDITIVE_CHUNK_BYTES = 64 * 2**20


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> (B, H_kv * n_rep, S, D): each key/value head serves `n_rep` query heads (GQA/MQA)."""
    if n_rep == 1:
        return hidden_states
    batch, num_kv_heads, seq_len, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None].expand(batch, num_kv_heads, n_rep, seq_len, head_dim)
    return hidden_states.reshape(batch, num_kv_heads * n_rep, seq_len, head_dim)  # (B, H, S, D)


def _add_bias_and_mask(
    scores: torch.Tensor, attention_mask: torch.Tensor | None, position_bias: torch.Tensor | None
) -> torch.Tensor:
    """Adds the position bias and the additive float mask (eager masks are 0 / dtype-min) to fp32 scores.

    An fp16 mask blocks with -65504, which fp32 scores above 65504 would outweigh (future or padding keys would leak),
    so its blocked entries are set to the fp32 minimum; bool masks block with it directly.
    """
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


def fold_bias_into_mask(
    position_bias: torch.Tensor, attention_mask: torch.Tensor | None, is_causal: bool
) -> torch.Tensor:
    """The float mask `(B, H, Q, K)` SDPA gets for a score bias: the bias where attention is allowed, -inf elsewhere.

    transformers' sdpa folds the bias into its mask itself, but blocks with the dtype's minimum; in fp16 that is
    -65504, which SDPA's fp32 scores above 65504 outweigh (masked keys leak). Used for fp16 only. Without a mask,
    a causal multi-token query block starts at key slot 0 (as transformers assumes there: no cache, or an empty
    static one), so query i sees keys 0..i.
    """
    query_length, key_length = position_bias.shape[-2:]
    if attention_mask is None:
        if not is_causal or query_length == 1:
            return position_bias
        device = position_bias.device
        attention_mask = torch.arange(query_length, device=device)[:, None] >= torch.arange(key_length, device=device)
    if attention_mask.dtype != torch.bool:  # an additive float mask: blocked where it holds the dtype minimum
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min
    return position_bias.masked_fill(~attention_mask, float("-inf"))


def _softmax_dropout_values(
    module: nn.Module, scores: torch.Tensor, value: torch.Tensor, dropout: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # Softmax in fp32 whatever the input dtype (as transformers' eager kernels do): half-precision scores of
    # long rows overflow.
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value), weights  # (B, H, Q, D), (B, H, Q, K)


def _wants_weights(module: nn.Module, kwargs: dict) -> bool:
    return bool(kwargs.get("output_attentions", getattr(module.config, "output_attentions", False)))


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scaling · Q Kᵀ + bias + mask) V with materialised weights (Vaswani et al. 2017, eq. 1).

    `position_bias` is a float `(1 or B, H, Q, K)` score bias (ALiBi, T5 buckets, clamped distances).
    """
    key = repeat_kv(key, module.num_key_value_groups)  # (B, H, K, D)
    value = repeat_kv(value, module.num_key_value_groups)
    # fp16 dot products of long unscaled vectors overflow (65504): score in fp32 there; bf16/fp32 keep their dtype.
    compute_dtype = torch.float32 if query.dtype == torch.float16 else query.dtype
    scores = torch.matmul(query.to(compute_dtype), key.to(compute_dtype).transpose(2, 3)).float() * scaling
    scores = _add_bias_and_mask(scores, attention_mask, position_bias)  # (B, H, Q, K)
    output, weights = _softmax_dropout_values(module, scores, value, dropout)
    return output.transpose(1, 2).contiguous(), weights  # (B, Q, H, D)


def _additive_chunk(
    module: nn.Module,
    query_chunk: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    energy: torch.Tensor,
    mask_chunk: torch.Tensor | None,
    bias_chunk: torch.Tensor | None,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # e_ij = vᵀ tanh(W1 q_i + W2 k_j): the projections were applied by the score function, so here the
    # (B, H, c, K, A) tanh tensor exists for one query chunk only. fp16 is scored in fp32 (as in the eager kernel):
    # vᵀ tanh(.) reaches sum |v|, which overflows 65504 when the energies are large; bf16/fp32 keep their dtype.
    compute_dtype = torch.float32 if query_chunk.dtype == torch.float16 else query_chunk.dtype
    query_chunk, key, energy = query_chunk.to(compute_dtype), key.to(compute_dtype), energy.to(compute_dtype)
    hidden = torch.tanh(query_chunk[:, :, :, None, :] + key[:, :, None, :, :])  # (B, H, c, K, A)
    scores = torch.einsum("bhqka,ha->bhqk", hidden, energy).float()  # (B, H, c, K)
    scores = _add_bias_and_mask(scores, mask_chunk, bias_chunk)
    return _softmax_dropout_values(module, scores, value, dropout)


def additive_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float = 1.0,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    energy: torch.Tensor | None = None,
    chunk_size: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bahdanau et al. (2015) additive attention, processed in query chunks so peak memory stays bounded.

    `query` and `key` arrive already projected (`W1 q`, `W2 k`, last dim A); `energy` is the per-head vector v
    `(H, A)`. Each chunk holds a `(B, H, chunk, K, A)` tanh tensor of at most `ADDITIVE_CHUNK_BYTES`; in training
    each chunk is checkpointed so the backward recomputes it instead of storing every chunk's activations.
    `scaling` is ignored: the score has no dot product to scale.
    """
    key = repeat_kv(key, module.num_key_value_groups)  # (B, H, K, A)
    value = repeat_kv(value, module.num_key_value_groups)  # (B, H, K, D)
    batch, heads, q_len, attn_dim = query.shape
    if chunk_size is None:
        element_size = 4 if query.dtype == torch.float16 else query.element_size()  # fp16 is scored in fp32
        per_query = batch * heads * key.shape[2] * attn_dim * element_size
        chunk_size = max(1, ADDITIVE_CHUNK_BYTES // per_query)
    recompute = module.training and torch.is_grad_enabled()
    outputs, weights = [], []
    for start in range(0, q_len, chunk_size):
        rows = slice(start, start + chunk_size)
        mask_chunk = None if attention_mask is None else attention_mask[:, :, rows]
        bias_chunk = None if position_bias is None else position_bias[:, :, rows]
        args = (module, query[:, :, rows], key, value, energy, mask_chunk, bias_chunk, dropout)
        if recompute:
            out, w = checkpoint(_additive_chunk, *args, use_reentrant=False)
        else:
            out, w = _additive_chunk(*args)
        outputs.append(out)
        if _wants_weights(module, kwargs):
            weights.append(w)
    output = torch.cat(outputs, dim=2).transpose(1, 2).contiguous()  # (B, Q, H, D)
    return output, (torch.cat(weights, dim=2) if weights else None)
