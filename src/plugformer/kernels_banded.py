"""The causal kernel for a relative bias that is constant beyond a distance (`t5_bias`, `clamped_bias`): forward and
dQ, dK, dV through torch's fused flash kernel with the bias as a strided view (`kernels_relative`), and only the
bias gradient of the near band of keys explicit.

T5's buckets and the clamped distance table give every key at least `far_distance` = W slots behind the query one
value per head, c_h. The gradient of a bias value is its score gradient dS summed along its diagonal; the fused
backward does not return dS, so it is computed for the band (i − W < j ≤ i) alone, in blocks of `BAND_ROWS` query
rows against their `BAND_ROWS + W − 1` keys from the saved log-sum-exp: P = exp(s·QKᵀ + bias − lse),
dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)). That of the far keys, which all share c_h, is −(the band's dS sum) of each row,
because the softmax gradient of a row sums to zero, and is reported at distance −W (the scheme ties every farther
distance to the same parameter, so the table's gradient is exact).
"""

from __future__ import annotations

import torch

from .biases import RelativeBias
from .kernels import fused_causal_call, repeat_kv, sum_over_groups
from .kernels_relative import flash_backward, flash_forward


# Query rows per block of the band's bias gradient: the window is BAND_ROWS + W − 1 keys, of which W are scored per
# row. Forward + backward against causal SDPA (B=2, H=6, D=64, W=128, fp32, 1 thread, shared machine): 32 rows
# 0.83-0.90x at N = 2048, 0.87x at 4096; 64: 0.83-0.87x, 0.87x.
BAND_ROWS = 32
# what a profile (`plugformer bench`) names this path by
PROFILER_NAME = "plugformer::banded_bias"


def _band_layout(length: int, width: int, rows: int, device: torch.device):
    """The band's value index `(r, L)` of distance u − t − W + 1 for row t, window column u (clamped: entries outside
    the band are masked) and the entries `(r, L)` inside the band (0..W−1 slots behind the query)."""
    window = rows + width - 1
    t = torch.arange(rows, device=device)[:, None]
    u = torch.arange(window, device=device)[None, :]
    behind = t + width - 1 - u  # (r, L): query slot − key slot
    index = (length - 1 - behind).clamp(0, 2 * length - 2)  # value index of distance −behind
    return index, (behind >= 0) & (behind < width)


def band_bias_gradient(grad_output, query, key_heads, value_heads, values, output, lse, width: int, scaling: float):
    """d(values) `(H, 2N − 1)` (fp32 at least): the band's dS summed along its W diagonals, and the far keys' (minus
    the band's total per head) at distance −W, from the merged output and log-sum-exp."""
    length = query.shape[2]
    accumulate = lse.dtype
    delta = (grad_output.to(accumulate) * output.to(accumulate)).sum(-1, keepdim=True)  # (B, H, N, 1)
    lse = lse[..., None]  # (B, H, N, 1)
    scaled = query.to(accumulate) * scaling
    keys, vals, grad_output = (tensor.to(accumulate) for tensor in (key_heads, value_heads, grad_output))
    index, inside = _band_layout(length, width, BAND_ROWS, query.device)
    bias = values.detach()[:, index].to(accumulate).masked_fill(~inside, float("-inf"))  # (H, r, L)
    grad_bias = torch.zeros_like(bias)  # (H, r, L), summed over the batch and the blocks
    for start in range(0, length, BAND_ROWS):
        stop = min(start + BAND_ROWS, length)
        rows, count = slice(start, stop), stop - start
        first = max(0, start - width + 1)  # the block's first key; its window starts W − 1 before `start`
        band = slice(first - (start - width + 1), stop - (start - width + 1))  # window columns of keys first..stop−1
        weights = torch.matmul(scaled[:, :, rows], keys[:, :, first:stop].transpose(-1, -2))  # (B, H, r, ≤L)
        weights.add_(bias[:, :count, band]).sub_(lse[:, :, rows]).exp_()  # P, 0 outside the band
        d_scores = torch.matmul(grad_output[:, :, rows], vals[:, :, first:stop].transpose(-1, -2))  # dP
        d_scores.sub_(delta[:, :, rows]).mul_(weights)  # dS
        grad_bias[:, :count, band] += d_scores.sum(dim=0)
    grad_values = torch.zeros(values.shape, dtype=accumulate, device=values.device)
    grad_values.index_add_(1, index.flatten(), grad_bias.flatten(1))  # entries outside the band carry dS = 0
    grad_values[:, length - 1 - width] -= grad_bias.sum(dim=(1, 2))
    return grad_values


class BandedBiasAttention(torch.autograd.Function):
    """softmax(s · Q Kᵀ + bias + causal mask) V for a bias constant beyond `far_distance` (see the module docstring).

    Inputs: query `(B, H, N, D)`, key and value `(B, H_kv, N, D)`, the `RelativeBias` values `(H, 2N − 1)` of N
    queries over N keys (N > `far_distance`); returns `(B, H, N, D)`.
    """

    @staticmethod
    def forward(ctx, query, key, value, values, far_distance: int, scaling: float):
        length = query.shape[2]
        if not 0 < far_distance < length:
            raise ValueError(f"far_distance={far_distance} must lie in 1..{length - 1} (the sequence length less 1)")
        accumulate = torch.promote_types(query.dtype, torch.float32)
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        table = values.detach().to(accumulate).contiguous()
        output, lse = flash_forward(query, key_heads, value_heads, table, scaling)
        ctx.save_for_backward(query, key, value, values, output, lse)
        ctx.width, ctx.scaling = far_distance, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, values, output, lse = ctx.saved_tensors
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        grad_output = grad_output.contiguous()
        table = values.detach().to(lse.dtype).contiguous()
        operands = (grad_output, query, key_heads, value_heads, table, output, lse)
        grad_query, grad_key, grad_value = flash_backward(*operands, ctx.scaling)
        grad_values = None
        if ctx.needs_input_grad[3]:
            grad_values = band_bias_gradient(*operands, ctx.width, ctx.scaling).to(values.dtype)
        grad_key, grad_value = sum_over_groups(grad_key, grad_value, groups)  # (B, H_kv, N, D)
        return grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype), grad_values, None, None


def banded_bias_applies(query, key, value, attention_mask, dropout: float, position_bias, is_causal: bool) -> bool:
    """Whether `BandedBiasAttention` computes this call of the sdpa kernel: a `RelativeBias` with `constant_beyond`
    W, causal self-attention over N > W tokens from slot 0 (no cache offset) with no mask (no padding, packing or
    window: transformers then leaves the mask out), no attention dropout, on CPU (the fused kernel it calls is
    torch's CPU flash attention, which also wants values as wide as the queries), outside torch.compile / export
    tracing, in fp32, bf16 or fp64 (float16 scores can overflow in the fused kernel, where the blockwise kernel
    keeps them finite). Any other call takes the blockwise kernel
    (`kernels.sdpa_relative_bias_forward`), which computes all of them."""
    if not fused_causal_call(query, key, value, attention_mask, dropout, position_bias, is_causal):
        return False
    if position_bias.constant_beyond is None or query.dtype == torch.float16:
        return False
    return query.shape[2] > position_bias.constant_beyond


def banded_bias_attention_forward(query, key, value, scaling: float, position_bias: RelativeBias):
    """`BandedBiasAttention` as the sdpa kernel returns it: `(output (B, N, H, D), None)` (no attention weights)."""
    with torch.profiler.record_function(PROFILER_NAME):  # so a profile (`plugformer bench`) names the path
        output = BandedBiasAttention.apply(query, key, value, position_bias.values, position_bias.constant_beyond,
                                           scaling)  # fmt: skip
    return output.transpose(1, 2).contiguous(), None  # (B, N, H, D)
