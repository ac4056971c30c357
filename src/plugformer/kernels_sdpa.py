"""plugformer's `sdpa` entry point, the function every `attn_implementation="sdpa"` call goes through (the kernel
table's `sdpa` record, `capabilities`): with attention sinks `kernels_sinks.sdpa_sinks_forward`, else
`kernels.sdpa_attention_forward` (transformers' SDPA without a bias, the blockwise kernel with one); a bias constant
beyond a distance (T5 buckets, clamped distances) in causal training or prefill takes `kernels_relative_native` (in C)
or else `kernels_banded`, any other relative bias `kernels_relative_native` or else `kernels_alibi` (ALiBi) and
`kernels_relative` (KERPLE), where they apply, and a bias computed from the queries' positions (FIRE) or from each
row's tokens (forgetting attention's `DecayBias`) in training `kernels_query_bias`."""

from __future__ import annotations

import torch
from torch import nn

from .biases import RelativeBias
from .kernels import sdpa_attention_forward, transformers_sdpa
from .kernels_alibi import linear_bias_applies, linear_bias_attention_forward
from .kernels_banded import banded_bias_applies, banded_bias_attention_forward
from .kernels_query_bias import query_bias_applies, query_bias_attention_forward
from .kernels_relative import relative_bias_applies, relative_bias_attention_forward
from .kernels_relative_native import native_relative_applies, native_relative_attention_forward
from .kernels_sinks import sdpa_sinks_forward


def sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: RelativeBias | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """plugformer's `sdpa` (`capabilities`): `sdpa_sinks_forward` with attention sinks (`s_aux`); the C kernel for a
    relative bias where `native_relative_applies`, else the banded kernel for a bias constant beyond a distance where
    `banded_bias_applies`, the linear-bias kernel for ALiBi where `linear_bias_applies`, the Toeplitz-view kernel for
    any other relative bias where `relative_bias_applies`, `query_bias_attention_forward` for a bias recipe (FIRE's,
    forgetting attention's) where `query_bias_applies`; else `kernels.sdpa_attention_forward`."""
    if s_aux is not None:
        return sdpa_sinks_forward(
            module, query, key, value, attention_mask, scaling, dropout, position_bias, s_aux, **kwargs
        )
    if position_bias is None:  # transformers' SDPA, without the calls that look for a bias (every Llama-like step)
        return transformers_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    is_causal = module.is_causal if kwargs.get("is_causal") is None else kwargs["is_causal"]
    if native_relative_applies(query, key, value, attention_mask, dropout, position_bias, is_causal):
        return native_relative_attention_forward(query, key, value, scaling, position_bias)
    if banded_bias_applies(query, key, value, attention_mask, dropout, position_bias, is_causal):
        return banded_bias_attention_forward(query, key, value, scaling, position_bias)
    if linear_bias_applies(query, key, value, attention_mask, dropout, position_bias, is_causal):
        return linear_bias_attention_forward(query, key, value, scaling, position_bias)
    if relative_bias_applies(query, key, value, attention_mask, dropout, position_bias, is_causal):
        return relative_bias_attention_forward(query, key, value, scaling, position_bias)
    if query_bias_applies(query, key, position_bias):
        return query_bias_attention_forward(
            module, query, key, value, attention_mask, scaling, dropout, position_bias, is_causal=is_causal
        )
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling, dropout, position_bias, **kwargs)
