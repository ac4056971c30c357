"""Attention sinks (gpt-oss) on SDPA, exactly: `sdpa_sinks_forward`, which plugformer's `sdpa` entry
(`kernels_sdpa.sdpa_forward`) calls when a model has sinks."""

from __future__ import annotations

import torch
from torch import nn

from .biases import RelativeBias
from .kernels import bias_rows, repeat_kv


def sdpa_sinks_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: RelativeBias | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with gpt-oss's attention sinks, exactly: a sink is one more key whose logit is s_h for every query and
    whose value is zero, so it takes its share of the softmax and adds nothing to the output. Its column of the float
    mask (B, H, Q, K + 1) holds s_h beside the key mask as 0 / −inf and the position bias (materialised, as
    transformers' SDPA would take a bias); no row is fully masked, so no NaN."""
    is_causal = module.is_causal if is_causal is None else is_causal
    batch, heads, query_length, _ = query.shape
    key_length = key.shape[2]
    if attention_mask is None:  # what SDPA's `is_causal` would mask: top-left aligned, and only for several queries
        allowed = torch.ones(query_length, key_length, dtype=torch.bool, device=query.device)
        allowed = (allowed.tril() if is_causal and query_length > 1 else allowed)[None, None]
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask[..., :key_length]
    else:
        allowed = attention_mask[..., :key_length] > torch.finfo(attention_mask.dtype).min
    mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(~allowed, float("-inf"))
    if position_bias is not None:
        mask = mask + bias_rows(position_bias, slice(None)).to(query.dtype)  # (1, H, Q, K)
    sink = s_aux.to(query.dtype).reshape(1, -1, 1, 1).expand(batch, heads, query_length, 1)
    mask = torch.cat([mask.expand(batch, heads, query_length, key_length), sink], dim=-1)  # (B, H, Q, K + 1)
    groups = heads // key.shape[1]
    key = repeat_kv(torch.cat([key, key.new_zeros(*key.shape[:2], 1, key.shape[3])], dim=2), groups)  # (B, H, K+1, D)
    value = repeat_kv(torch.cat([value, value.new_zeros(*value.shape[:2], 1, value.shape[3])], dim=2), groups)
    dropout = dropout if module.training else 0.0
    output = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # (B, H, Q, D)
    return output.transpose(1, 2).contiguous(), None
