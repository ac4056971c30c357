"""flex_attention: transformers' compiled kernel on an accelerator, torch's uncompiled flex on the CPU.

torch 2.13's compiled CPU flex kernel returns wrong outputs at some sequence lengths, with no mask too: with one
or two threads, lengths 8, 24, 40 and 56 differed from SDPA by 0.4-3.0 in the output (bare `torch.compile(
flex_attention)`, transformers' Llama alike), and which lengths go wrong changes from run to run. Its uncompiled path
applies the same `score_mod` and block mask to every score (the reference implementation) and agrees with SDPA and
eager to float rounding at every length tried, left-padded batches included. So on a CPU tensor plugformer's
`flex_attention` runs that path, also inside `torch.compile` (a graph break), and on other devices transformers'
`flex_attention_forward` unchanged.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers.integrations.flex_attention import flex_attention_forward

from .biases import RelativeBias


def flex_forward(module: nn.Module, query: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """plugformer's `flex_attention` entry, with transformers' attention-function arguments: `uncompiled_flex_forward`
    for CPU tensors, else transformers' `flex_attention_forward`."""
    forward = uncompiled_flex_forward if query.device.type == "cpu" else flex_attention_forward
    return forward(module, query, *args, **kwargs)


@torch.compiler.disable  # never traced: inductor would build the CPU kernel this function exists to avoid
def uncompiled_flex_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    scaling: float | None = None,
    softcap: float | None = None,
    position_bias: RelativeBias | None = None,
    dropout: float = 0.0,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Flex attention through torch's uncompiled path, with transformers' `score_mod` contract: each score capped as
    c·tanh(s / c) by `softcap` c, then the additive float mask (when the mask is no `BlockMask`) and the
    `position_bias` added, read per (batch, head, query, key). Returns (B, Q, H, D) and no weights."""
    if dropout > 0:
        raise ValueError(
            f"attn_implementation='flex_attention' takes no attention dropout (dropout={dropout}): use "
            "it in eval mode, or set attention_dropout=0.0"
        )
    if s_aux is not None:
        raise ValueError(
            "attn_implementation='flex_attention' cannot add attention sinks on the CPU; use 'sdpa' or 'eager'"
        )
    block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
    additive = None
    if attention_mask is not None and block_mask is None:
        additive = attention_mask[:, :, :, : key.shape[-2]]  # (B, 1, Q, K)

    def score_mod(score, batch, head, query_index, key_index):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if additive is not None:
            score = score + additive[batch, 0, query_index, key_index]
        if position_bias is not None:
            score = score + position_bias[batch, head, query_index, key_index]
        return score

    with warnings.catch_warnings():  # torch warns that the uncompiled path computes every score: it is meant to
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        output = flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling,
                                enable_gqa=query.shape[1] != key.shape[1])  # fmt: skip  # (B, H, Q, D)
    return output.transpose(1, 2).contiguous(), None
