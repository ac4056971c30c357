"""One block of query rows of the blockwise sdpa kernel for a bias that needs no gradient (ALiBi's), in training:
the fused CPU flash kernel forward and backward, with the block's mask built again in the backward instead of kept.

Autograd keeps the float mask (1, H, r, keys) of each block for SDPA's backward: H·N²/2 numbers per causal layer,
a memory cost growing with N. Here the block keeps its log-sum-exp
(B, H, r) and its output, and the backward rebuilds the mask from the bias values (the (H, Q + K − 1) table) and calls
the fused backward with them.
"""

from __future__ import annotations

import torch


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def flash_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` with their last axis contiguous, as torch's raw CPU flash op (which the bias kernels call directly)
    needs: it takes other strides without an error and returns other numbers (torch 2.13: 2.4 off on unit-variance
    inputs; the public SDPA makes them contiguous first). Only the tensors that are not are copied."""
    return tuple(tensor if tensor.stride(-1) == 1 else tensor.contiguous() for tensor in tensors)


def recomputes_fixed_mask(query, key, value, position_bias, dropout: float) -> bool:
    """Whether `FixedBiasBlock` computes this block: a bias that needs no gradient while the block's inputs do, no
    attention dropout, on CPU (torch's CPU flash kernel, which wants values as wide as the queries), outside
    torch.compile / export tracing; otherwise SDPA takes the mask (and autograd keeps it)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or dropout != 0.0:
        return False
    if position_bias.values.requires_grad or query.device.type != "cpu" or value.shape[-1] != query.shape[-1]:
        return False
    return any(tensor.requires_grad for tensor in (query, key, value))


def _mask(position_bias, allowed, start: int, stop: int, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """The float mask `(B or 1, H, r, keys)`: the rows' bias, −inf where `allowed` blocks (as `kernels._bias_mask`)."""
    mask = position_bias.rows(start, stop, keys).to(dtype)  # (1, H, r, keys)
    return mask if allowed is None else mask.masked_fill(~allowed, float("-inf"))


def _heads(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> (B, H_kv · groups, S, D), as `kernels.repeat_kv` (the CPU flash kernel takes no GQA)."""
    return tensor.repeat_interleave(groups, 1) if groups > 1 else tensor


def sum_over_groups(grad_key: torch.Tensor, grad_value: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H_kv · groups, S, D) gradients -> (B, H_kv, S, D): each key/value head served `groups` query heads (GQA),
    so its gradient is theirs summed (the adjoint of `kernels.repeat_kv`)."""
    if groups == 1:
        return grad_key, grad_value
    return grad_key.unflatten(1, (-1, groups)).sum(2), grad_value.unflatten(1, (-1, groups)).sum(2)


class FixedBiasBlock(torch.autograd.Function):
    """softmax(s · Q Kᵀ + bias, blocked where `allowed` is false) V for the query rows `start..stop-1` (`query`
    `(B, H, r, D)`) over `key`, `value` `(B, H_kv, keys, D)`, a bias object whose values need no gradient."""

    @staticmethod
    def forward(ctx, query, key, value, position_bias, allowed, start: int, stop: int, scaling: float):
        query, key, value = flash_operands(query, key, value)
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = _heads(key, groups), _heads(value, groups)  # (B, H, keys, D)
        mask = _mask(position_bias, allowed, start, stop, key.shape[2], query.dtype)
        output, lse = _flash(query, key_heads, value_heads, 0.0, False, attn_mask=mask, scale=scaling)
        ctx.save_for_backward(query, key, value, output, lse, allowed)
        ctx.bias, ctx.rows, ctx.scaling = position_bias, (start, stop), scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, lse, allowed = ctx.saved_tensors
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = _heads(key, groups), _heads(value, groups)  # (B, H, keys, D)
        mask = _mask(ctx.bias, allowed, *ctx.rows, key.shape[2], query.dtype)
        grad_query, grad_key, grad_value = _flash_backward(
            grad_output.contiguous(),
            query,
            key_heads,
            value_heads,
            output,
            lse,
            0.0,
            False,
            attn_mask=mask,
            scale=ctx.scaling,
        )
        grad_key, grad_value = sum_over_groups(grad_key, grad_value, groups)  # (B, H_kv, keys, D)
        return grad_query, grad_key, grad_value, None, None, None, None, None
