"""Causal attention with any relative bias (ALiBi, T5's buckets, the clamped distances, KERPLE) wholly in C, forward
and backward: `csrc/band.c` with a band as wide as the sequence (every key up to the query, no far part).

The forward is FlashAttention's online softmax over tiles of 16 queries and chunks of keys, the bias read per
distance from the scheme's values (no mask built or kept); the backward forms each tile's P and dS from the saved
log-sum-exp and returns dQ, dK, dV and the bias gradient by distance (dS summed along the diagonals). Every score is
s·q_i·k_j + f(j − i), f one of the values, added once: the materialised softmax's numbers, where the kernels on
torch's fused flash kernel split a linear bias (`kernels_alibi`) or merge a band with the far keys
(`kernels_banded`).

It takes a call first where it applies (fp32 on the CPU, heads a multiple of 16 wide, the library built); the kernels
on torch's fused kernel keep bf16, fp64 and other head sizes (their speeds side by side: BENCHMARKS.md, "Design
measurements"). A bias constant beyond a distance over `BANDED_FROM` tokens or more goes to `kernels_banded`.
"""

from __future__ import annotations

import torch

from .biases import RelativeBias
from .kernels import fused_causal_call, repeat_kv, sum_over_groups
from .kernels_band_native import native_band_applies, native_band_backward, native_band_forward, rows_contiguous


# The length from which a bias constant beyond a distance (T5's, the clamped one) goes to `kernels_banded` instead,
# whose backward calls torch's fused kernel for the far keys (its forward runs here either way). Backward per call,
# B=2, H=6, D=64, W=128, fp32, 1 thread: 165 against 191 ms at N = 2048, 657 / 642 ms at 4096, 2702 / 2384 ms at 8192.
BANDED_FROM = 4096


def native_forward(query, key_heads, value_heads, values, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp `(B, H, N, D)`, `(B, H, N)` (contiguous) of causal attention with the relative
    bias `values` `(H, 2N − 1)` (fp32), by `csrc/band.c`."""
    batch, heads, length, dim = query.shape
    # contiguous: writing the (B, N, H, D) layout the model reads next costs more than the copy after (78 against
    # 68 ms a call at N = 2048, the setting of the module docstring)
    output = query.new_empty(batch, heads, length, dim)
    lse = query.new_empty(batch, heads, length)  # (B, H, N)
    native_band_forward(query, key_heads, value_heads, values, output, lse, length, scaling)
    return output, lse


def native_backward(grad_output, query, key_heads, value_heads, values, output, lse, scaling: float):
    """dQ, dK, dV `(B, H, N, D)` and d(values) `(H, 2N − 1)` of `native_forward` by `csrc/band.c`, which forms each
    tile's dS in registers and sums it along the diagonals as contiguous runs."""
    length = query.shape[2]
    grad_query = torch.empty_like(rows_contiguous(query))  # the queries' layout, rows contiguous
    grad_key = torch.zeros(key_heads.shape, dtype=query.dtype, device=query.device)  # (B, H, N, D), added to
    grad_value = torch.zeros_like(grad_key)
    by_distance = native_band_backward(
        grad_output,
        query,
        key_heads,
        value_heads,
        output,
        lse,
        values,
        (grad_query, grad_query, grad_key, grad_value),
        length,
        scaling,
    )
    grad_values = torch.zeros_like(values)
    grad_values[:, :length] = by_distance.flip(-1)  # t slots behind: value index N − 1 − t
    return grad_query, grad_key, grad_value, grad_values


class NativeRelativeAttention(torch.autograd.Function):
    """softmax(s · Q Kᵀ + bias + causal mask) V for any relative bias, forward and backward in C (see the module
    docstring).

    Inputs: query `(B, H, N, D)`, key and value `(B, H_kv, N, D)` (fp32, rows of D contiguous), the `RelativeBias`
    values `(H, 2N − 1)` (fp32) of N queries over N keys; returns `(B, H, N, D)`.
    """

    @staticmethod
    def forward(ctx, query, key, value, values, scaling: float):
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        output, lse = native_forward(query, key_heads, value_heads, values.detach().contiguous(), scaling)
        ctx.save_for_backward(query, key, value, values, output, lse)
        ctx.scaling = scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, values, output, lse = ctx.saved_tensors
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        grads = native_backward(
            grad_output, query, key_heads, value_heads, values.detach().contiguous(), output, lse, ctx.scaling
        )
        grad_query, grad_key, grad_value, grad_values = grads
        grad_key, grad_value = sum_over_groups(grad_key, grad_value, groups)  # (B, H_kv, N, D)
        return grad_query, grad_key, grad_value, grad_values if ctx.needs_input_grad[3] else None, None


def native_relative_applies(query, key, value, attention_mask, dropout: float, position_bias, is_causal: bool) -> bool:
    """Whether `NativeRelativeAttention` computes this call of the sdpa kernel: a `RelativeBias` over causal
    self-attention of N tokens from slot 0 with no mask, no attention dropout, on CPU, outside torch.compile / export
    tracing (`kernels.fused_causal_call`), queries, keys, values and bias values in fp32 (not under autocast), heads a
    multiple of 16 wide, where `csrc/band.c` is built (`kernels_band_native.native_band_applies`); a bias constant
    beyond a distance over fewer than `BANDED_FROM` tokens."""
    if not fused_causal_call(query, key, value, attention_mask, dropout, position_bias, is_causal):
        return False
    if position_bias.constant_beyond is not None and query.shape[2] >= BANDED_FROM:
        return False
    return native_band_applies(query, key, value, position_bias.values)


def native_relative_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling: float,
    dropout: float,
    position_bias: RelativeBias,
    is_causal: bool,
) -> torch.Tensor:
    """`NativeRelativeAttention` on a call of the sdpa kernel (the `relative_native` path of
    `kernels_sdpa.SDPA_PATHS`): the output `(B, H, N, D)`."""
    return NativeRelativeAttention.apply(query, key, value, position_bias.values, scaling)
