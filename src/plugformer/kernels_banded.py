"""The causal kernel for a relative bias that is constant beyond a distance (`t5_bias`, `clamped_bias`), split where
the bias stops varying: the far keys in one call of torch's fused causal flash kernel with no mask, the near band by
blocks, the two merged by their log-sum-exps.

T5's buckets and the clamped distance table give every key at least `far_distance` = W slots behind the query one
value per head, c_h. A constant added to every score of a softmax cancels, so the far keys (j ≤ i − W) are plain causal
attention of the queries from slot W over the keys up to N − W (query i' = i − W sees keys 0..i'), their log-sum-exp
raised by c_h: one fused call with its own causal mask, the fastest path torch has, forward and backward. The band
(i − W < j ≤ i) takes the rest:

- forward: the band's own softmax per query, merged with the far keys' by log-sum-exp;
- backward: from the merged log-sum-exp, P = exp(s·QKᵀ + bias − lse), dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)),
  dQ = s·dS K, dK = s·dSᵀ Q, dV = Pᵀ dO added to the far keys' gradients, and the bias gradient, dS summed along the
  band's W diagonals. That of the far keys, which all share c_h, is −(the band's dS sum) of each row, because the
  softmax gradient of a row sums to zero, and is reported at distance −W (the scheme ties every farther distance to
  the same parameter, so the table's gradient is exact).

In fp32 with heads a multiple of 16 wide the forward runs wholly in C (`kernels_relative_native.native_forward`, every
key: as fast as the far keys' fused call alone, without the merge) and the band's backward in C (`kernels_band_native`,
`csrc/band.c`: tiles of 16 queries over their keys, each product a register-blocked loop); otherwise by torch
operations: the band's forward in blocks of `FORWARD_ROWS` rows through the fused flash kernel with the bias as its
mask (a strided view of the band's values, −inf outside the band, the rows reversed: `kernels_relative.hankel`), the
backward by hand in blocks of `BAND_ROWS`. Every score is computed once, with its own bias value: the same numbers as
the materialised softmax's. Where the C band applies, the sdpa entry point gives calls over fewer than
`kernels_relative_native.BANDED_FROM` tokens to `kernels_relative_native` (the backward too in C, faster there); this
kernel takes longer ones, where the far keys' fused backward wins.
"""

from __future__ import annotations

import torch

from .biases import RelativeBias
from .kernels import fused_causal_call, repeat_kv, sum_over_groups
from .kernels_band_native import native_band_applies, native_band_backward, rows_contiguous
from .kernels_fixed import flash_operands
from .kernels_relative import hankel
from .kernels_relative_native import native_forward


# Query rows per block of the torch path's band forward (window FORWARD_ROWS + W − 1 keys) and backward by hand
# (window BAND_ROWS + W − 1; (B, H, rows, window) fp32 temporaries). B=2, H=6, D=64, W=128, fp32, 1 thread, N = 2048:
# the band's forward 22 / 26 / 31 ms with 64 / 128 / 256 rows; the whole backward 239 / 214 / 224 / 246 ms with 16 /
# 32 / 64 / 128 rows. Forward + backward against causal SDPA (7 interleaved repeats): 0.79x at 2048, 0.83x at 4096 on
# this path; with the band in C (queries laid out (B, N, H, D), as the attention projections hand them over)
# 0.89-0.90x at 2048 and 0.93-0.95x at 4096, and with the forward too in C 0.91-0.94x at 2048, 0.92x at 4096 and
# 8192 (one run each).
FORWARD_ROWS = 64
BAND_ROWS = 32
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _near_table(values: torch.Tensor, width: int) -> torch.Tensor:
    """A copy of `values` `(H, 2N − 1)` with −inf outside the band: every distance but −(W − 1)..0 (the far keys and
    the future)."""
    length = (values.shape[-1] + 1) // 2
    near = torch.full_like(values, float("-inf"))
    near[:, length - width : length] = values[:, length - width : length]
    return near


def _band_layout(length: int, width: int, rows: int, device: torch.device):
    """The band's value index `(r, L)` of distance u − t − W + 1 for row t, window column u (clamped: entries outside
    the band are masked) and the entries `(r, L)` inside the band (0..W−1 slots behind the query)."""
    window = rows + width - 1
    t = torch.arange(rows, device=device)[:, None]
    u = torch.arange(window, device=device)[None, :]
    behind = t + width - 1 - u  # (r, L): query slot − key slot
    index = (length - 1 - behind).clamp(0, 2 * length - 2)  # value index of distance −behind
    return index, (behind >= 0) & (behind < width)


def _shifted(gradient: torch.Tensor, length: int, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """`gradient` `(B, H, M, D)` as rows offset..offset + M − 1 of a `(B, H, length, D)` tensor in `dtype`, zeros in
    the other rows: written once (a zero-filled pad would write every row twice)."""
    rows = gradient.shape[2]
    full = gradient.new_empty((*gradient.shape[:2], length, gradient.shape[3]), dtype=dtype)
    full[:, :, offset : offset + rows] = gradient
    full[:, :, :offset].zero_()
    full[:, :, offset + rows :].zero_()
    return full


def _band_forward(query, key_heads, value_heads, values, output, lse, width: int, scaling: float) -> None:
    """The band's own output and log-sum-exp into `output` `(B, H, N, D)` and `lse` `(B, H, N)` by torch's fused
    flash kernel, blocks of `FORWARD_ROWS` rows with their bias as a strided mask (the rows reversed)."""
    length = query.shape[2]
    near = _near_table(values, width)
    for start in range(0, length, FORWARD_ROWS):
        stop = min(start + FORWARD_ROWS, length)
        first = max(0, start - width + 1)  # the block's first band key
        # reversed row t' is query stop − 1 − t'; window column u is key first + u: value index first − stop + N + t' + u
        mask = hankel(near, first - stop + length, stop - start, stop - first)  # (1, H, r, window)
        block, block_lse = _flash(
            query[:, :, start:stop].flip(2),
            key_heads[:, :, first:stop],
            value_heads[:, :, first:stop],
            0.0,
            False,
            attn_mask=mask,
            scale=scaling,
        )
        output[:, :, start:stop] = block.flip(2)
        lse[:, :, start:stop] = block_lse.flip(2)


def banded_forward(query, key_heads, value_heads, values, width: int, scaling: float):
    """The output `(B, H, N, D)` (input dtype) and log-sum-exp `(B, H, N)` (fp32 at least) of causal attention with
    the relative bias `values` `(H, 2N − 1)` (contiguous, fp32 at least), constant beyond `width` (see the module
    docstring)."""
    length = query.shape[2]
    if native_band_applies(query, key_heads, value_heads, values):  # every key in C: no far call, no merge
        return native_forward(query, key_heads, value_heads, values, scaling)
    output = query.new_empty(query.shape, dtype=values.dtype)  # (B, H, N, D), merged in fp32 at least
    lse = query.new_empty(query.shape[:3], dtype=values.dtype)  # (B, H, N)
    _band_forward(query, key_heads, value_heads, values, output, lse, width, scaling)
    far, far_lse = _flash(
        query[:, :, width:],
        key_heads[:, :, : length - width],
        value_heads[:, :, : length - width],
        0.0,
        True,
        scale=scaling,
    )
    far_lse = far_lse.to(lse.dtype) + values[:, length - 1 - width, None]  # (B, H, N − W): + c_h
    # `kernels.merge_by_lse` in place on views of the outputs (its copies cost ~10 ms a call at N = 2048)
    near_output, near_lse = output[:, :, width:], lse[:, :, width:]
    merged_lse = torch.logaddexp(far_lse, near_lse)  # (B, H, N − W)
    near_output.mul_(near_lse.sub_(merged_lse).exp_()[..., None])
    near_output.addcmul_(far, far_lse.sub_(merged_lse).exp_()[..., None])
    near_lse.copy_(merged_lse)
    return output.to(query.dtype), lse


def banded_backward(
    grad_output,
    query,
    key_heads,
    value_heads,
    values,
    output,
    lse,
    width: int,
    scaling: float,
    bias_gradient: bool = True,
):
    """dQ (input dtype), dK, dV `(B, H, N, D)` (fp32 at least) and d(values) `(H, 2N − 1)` (fp32 at least, `None`
    unless `bias_gradient`) of `banded_forward`, from its merged output and log-sum-exp: the far keys through the fused
    backward, the band in C or by hand (see the module docstring)."""
    length = query.shape[2]
    accumulate = lse.dtype
    far = slice(width, length)
    far_lse = lse[:, :, far] - values[:, length - 1 - width, None]  # the far part's own: its bias c_h taken out
    # over all N keys (query i sees keys ≤ i − W): dK and dV come out whole, 0 for the last W keys
    d_query, grad_key, grad_value = _flash_backward(
        grad_output[:, :, far],
        query[:, :, far],
        key_heads,
        value_heads,
        output[:, :, far],
        far_lse,
        0.0,
        True,
        scale=scaling,
    )
    grad_key, grad_value = grad_key.to(accumulate), grad_value.to(accumulate)  # the band adds in place
    if native_band_applies(query, key_heads, value_heads, grad_output, output, values):
        grad_key, grad_value = rows_contiguous(grad_key), rows_contiguous(grad_value)
        grad_query = torch.empty_like(rows_contiguous(query), dtype=accumulate)  # the queries' layout
        band_gradient = native_band_backward(
            grad_output,
            query,
            key_heads,
            value_heads,
            output,
            lse,
            values,
            (d_query, grad_query, grad_key, grad_value),
            width,
            scaling,
        )
    else:
        grad_query = _shifted(d_query, length, width, accumulate)  # (B, H, N, D): 0 for the first W queries
        band_gradient = _band_backward(
            grad_output,
            query,
            key_heads,
            value_heads,
            values,
            output,
            lse,
            (grad_query, grad_key, grad_value),
            width,
            scaling,
        )
    grad_values = None
    if bias_gradient:  # the band's distances 0..W − 1 behind (value indices N − 1 .. N − W); the far keys' share
        grad_values = torch.zeros(values.shape, dtype=accumulate, device=values.device)
        grad_values[:, length - width : length] = band_gradient.flip(-1)
        grad_values[:, length - 1 - width] = -band_gradient.sum(-1)
    return grad_query.to(query.dtype), grad_key, grad_value, grad_values


def _band_backward(
    grad_output, query, key_heads, value_heads, values, output, lse, grads, width: int, scaling: float
) -> torch.Tensor:
    """The band's share of the gradients by torch operations in blocks of `BAND_ROWS` rows, added to `grads` (dQ, dK,
    dV `(B, H, N, D)`, fp32 at least); returns the band's bias gradient `(H, W)` (summed dS at 0..W − 1 behind)."""
    length, accumulate = query.shape[2], lse.dtype
    grad_query, grad_key, grad_value = grads
    keys, vals = (tensor.to(accumulate) for tensor in (key_heads, value_heads))
    index, inside = _band_layout(length, width, BAND_ROWS, query.device)
    bias = values.detach()[:, index].to(accumulate).masked_fill(~inside, float("-inf"))  # (H, r, L)
    grad_bias = torch.zeros_like(bias)  # (H, r, L), summed over the batch and the blocks
    for start in range(0, length, BAND_ROWS):
        stop = min(start + BAND_ROWS, length)
        rows, count = slice(start, stop), stop - start
        first = max(0, start - width + 1)  # the block's first key; its window starts W − 1 before `start`
        band = slice(first - (start - width + 1), stop - (start - width + 1))  # window columns of keys first..stop−1
        block_query, block_grad = query[:, :, rows].to(accumulate), grad_output[:, :, rows].to(accumulate)
        # D_i = rowsum(dO ⊙ O) of the block's rows only: a (B, H, N, D) product would fault in fresh pages every call
        delta = (block_grad * output[:, :, rows].to(accumulate)).sum(-1, keepdim=True)  # (B, H, r, 1)
        weights = torch.matmul(block_query, keys[:, :, first:stop].transpose(-1, -2)).mul_(scaling)  # (B, H, r, ≤L)
        weights.add_(bias[:, :count, band]).sub_(lse[:, :, rows, None]).exp_()  # P, 0 outside the band
        d_scores = torch.matmul(block_grad, vals[:, :, first:stop].transpose(-1, -2))  # dP
        d_scores.sub_(delta).mul_(weights)  # dS
        # separate products added in place: baddbmm_ into these strided windows runs one addmm per (batch, head)
        grad_value[:, :, first:stop] += torch.matmul(weights.transpose(-1, -2), block_grad)  # Pᵀ dO
        grad_key[:, :, first:stop].add_(torch.matmul(d_scores.transpose(-1, -2), block_query), alpha=scaling)
        grad_query[:, :, rows].add_(torch.matmul(d_scores, keys[:, :, first:stop]), alpha=scaling)
        grad_bias[:, :count, band] += d_scores.sum(dim=0)
    # window column u of row t is t + W − 1 − u behind the query: fold the (r, L) sums to distances
    behind = (
        torch.arange(BAND_ROWS, device=query.device)[:, None]
        + width
        - 1
        - torch.arange(grad_bias.shape[-1], device=query.device)[None, :]
    )
    band_gradient = grad_bias.new_zeros(grad_bias.shape[0], width)
    band_gradient.index_add_(1, behind.clamp(0, width - 1).flatten(), grad_bias.masked_fill(~inside, 0).flatten(1))
    return band_gradient


class BandedBiasAttention(torch.autograd.Function):
    """softmax(s · Q Kᵀ + bias + causal mask) V for a bias constant beyond `far_distance` (see the module docstring).

    Inputs: query `(B, H, N, D)`, key and value `(B, H_kv, N, D)`, the `RelativeBias` values `(H, 2N − 1)` of N
    queries over N keys (N > `far_distance`); returns `(B, H, N, D)`.
    """

    @staticmethod
    def forward(ctx, query, key, value, values, far_distance: int, scaling: float):
        query, key, value = flash_operands(query, key, value)
        length = query.shape[2]
        if not 0 < far_distance < length:
            raise ValueError(f"far_distance={far_distance} must lie in 1..{length - 1} (the sequence length less 1)")
        accumulate = torch.promote_types(query.dtype, torch.float32)
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        table = values.detach().to(accumulate).contiguous()
        output, lse = banded_forward(query, key_heads, value_heads, table, far_distance, scaling)
        ctx.save_for_backward(query, key, value, values, output, lse)
        ctx.width, ctx.scaling = far_distance, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, values, output, lse = ctx.saved_tensors
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        table = values.detach().to(lse.dtype).contiguous()
        operands = (grad_output.contiguous(), query, key_heads, value_heads, table, output, lse)
        # autocast (a backward called inside it) would round the band's fp32 products to bf16
        with torch.autocast(query.device.type, enabled=False):
            grads = banded_backward(*operands, ctx.width, ctx.scaling, bias_gradient=ctx.needs_input_grad[3])
        grad_query, grad_key, grad_value, grad_values = grads
        if grad_values is not None:
            grad_values = grad_values.to(values.dtype)
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


def banded_bias_attention(
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
    """`BandedBiasAttention` on a call of the sdpa kernel (the `banded_bias` path of `kernels_sdpa.SDPA_PATHS`):
    the output `(B, H, N, D)`."""
    return BandedBiasAttention.apply(query, key, value, position_bias.values, position_bias.constant_beyond, scaling)
