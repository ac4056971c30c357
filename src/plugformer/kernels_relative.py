"""Causal attention with any relative bias (a Toeplitz matrix per head) through torch's fused CPU flash kernel, its
mask a strided view of the per-distance values: no (H, r, keys) bias is built, forward or backward.

A relative bias of query i on key j is f(j − i), constant along the diagonals; with the query rows of a block taken in
reverse order it is constant along the anti-diagonals instead, f(j − c − r + 1 + t') for reversed row t', a Hankel
matrix: a view of the values with strides (1, 1), which the flash kernel reads as its mask (it honours a mask's
strides). The rows go in blocks of `ROWS` from slot c, each in two parts merged by their log-sum-exps (as
`kernels_alibi`):

- the keys before the block (j < c): one fused call on the block's queries reversed, the Hankel view as the mask;
- the block's own keys (c ≤ j ≤ i): the fused causal call with the (1, H, ROWS, ROWS) bias of the square, the same
  for every block, built once per call.

Every bias number is one of the values, added once: the same scores as the materialised softmax's. The bias gradient
needs the score gradient dS summed along the diagonals, which no fused kernel returns: `hand_backward` computes dS per
block of `HAND_ROWS` reversed rows from the saved log-sum-exp (P = exp(s·QKᵀ + bias − lse), the bias again a Hankel
view) and with it dQ, dK, dV. In fp32 with heads a multiple of 16 wide the sdpa entry point gives the call to
`kernels_relative_native` instead (all in C); this kernel keeps fp64 and other head sizes. `kernels_banded` (a bias
constant beyond a distance) calls the fused backward for its far keys and computes dS on the band only.
"""

from __future__ import annotations

import torch
from torch import nn

from .biases import RelativeBias
from .kernels import fused_causal_call, merge_by_lse, repeat_kv, sum_over_groups
from .kernels_fixed import flash_operands


# Query rows per fused block. Forward + backward with the fused backward against causal SDPA (B=2, H=6, D=64, fp32,
# 1 thread, shared machine): 256 rows 0.98-0.99x at N = 2048; 128: 0.92x (the pattern of `kernels_alibi.ROWS`).
ROWS = 256
# Query rows per block of the hand backward: (B, H, rows, keys) weights in fp32. Forward + backward with bias gradient
# against causal SDPA (same setting, dK/dV not yet accumulated in place): 64 rows 0.75x at N = 2048, 0.66x at 4096;
# 32: 0.65x, 0.56x; 128: 0.74x.
HAND_ROWS = 64
# Block order: the backward loops walk the query blocks from the last. A block's temporaries grow with the keys before
# it; glibc's allocator reuses a freed larger block, where growing sizes map fresh pages every block, and their first
# touch costs more than the arithmetic on them. Forward + backward against causal SDPA (B=2, H=6, D=64, fp32, 1 thread,
# 5 repeats interleaved, 2-4 runs): hand backward 0.74-0.85x -> 0.79-0.88x at N = 2048, 0.63-0.75x -> 0.74-0.80x at
# 4096 (64 rows still the best of 32, 64, 128); fused backward 0.92 -> 0.96x at 2048, 0.96 -> 0.97x at 4096 (one run).
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def hankel(table: torch.Tensor, start: int, rows: int, keys: int) -> torch.Tensor:
    """The view `(1, H, rows, keys)` of `table` (H, M) whose entry (t, j) is `table[h, start + t + j]`."""
    if table.stride(-1) != 1:  # the view steps one value per key: a table laid out (M, H) (T5's lookup) is copied
        table = table.contiguous()
    offset = table.storage_offset() + start
    return table.as_strided((1, table.shape[0], rows, keys), (0, table.stride(0), 1, 1), offset)


def _reversed_rows(values: torch.Tensor, stop: int, rows: int, keys: int) -> torch.Tensor:
    """The bias `(1, H, rows, keys)` of queries stop − 1, stop − 2, .. (rows reversed) over keys 0..keys − 1: a view.
    Reversed row t' is query i = stop − 1 − t'; key j has distance j − i, value index j − i + N − 1."""
    length = (values.shape[-1] + 1) // 2
    return hankel(values, length - stop, rows, keys)


def flash_forward(query, key_heads, value_heads, values, scaling: float):
    """The output `(B, H, N, D)` and log-sum-exp `(B, H, N)` (fp32 at least) of causal attention with the relative
    bias `values` `(H, 2N − 1)` (contiguous, fp32 at least), by blocks of `ROWS` (see the module docstring)."""
    length = query.shape[2]
    side = min(ROWS, length)
    square = _reversed_rows(values, side, side, side).flip(2)  # (1, H, ROWS, ROWS): f(u − t), a copy
    output = torch.empty_like(query)
    lse = query.new_empty(query.shape[:3], dtype=values.dtype)  # (B, H, N)
    for start in range(0, length, ROWS):
        rows = slice(start, min(start + ROWS, length))
        count = rows.stop - start
        block, block_lse = _flash(
            query[:, :, rows],
            key_heads[:, :, rows],
            value_heads[:, :, rows],
            0.0,
            True,
            attn_mask=square[..., :count, :count],
            scale=scaling,
        )
        if start:  # the keys before the block, the queries reversed so that their bias is a view
            far, far_lse = _flash(
                query[:, :, rows].flip(2),
                key_heads[:, :, :start],
                value_heads[:, :, :start],
                0.0,
                False,
                attn_mask=_reversed_rows(values, rows.stop, count, start),
                scale=scaling,
            )
            far, far_lse = far.flip(2), far_lse.flip(2)
            block, block_lse = merge_by_lse(far, far_lse, block, block_lse, lse.dtype)
        output[:, :, rows] = block
        lse[:, :, rows] = block_lse
    return output, lse


def flash_backward(grad_output, query, key_heads, value_heads, values, output, lse, scaling: float):
    """dQ `(B, H, N, D)` (input dtype) and dK, dV `(B, H, N, D)` (fp32 at least) of `flash_forward` through the fused
    flash backward, given the merged output and log-sum-exp (so each part's weights are the merged softmax's)."""
    length = query.shape[2]
    side = min(ROWS, length)
    square = _reversed_rows(values, side, side, side).flip(2)  # (1, H, ROWS, ROWS)
    # every key gathers gradient from each later block: summed in fp32 at least (bf16 sums would round each time)
    grad_query = torch.empty_like(query)
    grad_key = torch.zeros(key_heads.shape, dtype=lse.dtype, device=query.device)  # (B, H, N, D)
    grad_value = torch.zeros_like(grad_key)
    for start in reversed(range(0, length, ROWS)):  # the largest temporaries first (see Block order)
        rows = slice(start, min(start + ROWS, length))
        count = rows.stop - start
        d_query, d_key, d_value = _flash_backward(
            grad_output[:, :, rows],
            query[:, :, rows],
            key_heads[:, :, rows],
            value_heads[:, :, rows],
            output[:, :, rows],
            lse[:, :, rows],
            0.0,
            True,
            attn_mask=square[..., :count, :count],
            scale=scaling,
        )
        grad_key[:, :, rows] += d_key
        grad_value[:, :, rows] += d_value
        if start:  # the keys before the block, on the reversed rows as their forward
            reverse = [tensor[:, :, rows].flip(2) for tensor in (grad_output, query)]
            far_query, far_key, far_value = _flash_backward(
                *reverse,
                key_heads[:, :, :start],
                value_heads[:, :, :start],
                output[:, :, rows].flip(2),
                lse[:, :, rows].flip(2),
                0.0,
                False,
                attn_mask=_reversed_rows(values, rows.stop, count, start),
                scale=scaling,
            )
            d_query = d_query.to(lse.dtype) + far_query.flip(2)
            grad_key[:, :, :start] += far_key
            grad_value[:, :, :start] += far_value
        grad_query[:, :, rows] = d_query
    return grad_query, grad_key, grad_value


def _fold_reversed(grad: torch.Tensor) -> torch.Tensor:
    """(H, r, keys) of reversed rows -> `(H, keys + r − 1)`: the sums along its anti-diagonals t' + j (one distance
    each). Row t' shifts right by t' when the rows, padded by r, are re-read one column shorter."""
    heads, rows, keys = grad.shape
    skewed = nn.functional.pad(grad, (0, rows)).flatten(1)[:, : rows * (keys + rows - 1)]  # (H, r·(keys + r − 1))
    return skewed.view(heads, rows, keys + rows - 1).sum(dim=1)


def hand_backward(grad_output, query, key_heads, value_heads, values, output, lse, scaling: float):
    """dQ (input dtype), dK, dV `(B, H, N, D)` (fp32 at least) and d(values) `(H, 2N − 1)` of `flash_forward`, by hand
    per block of `HAND_ROWS` reversed query rows over the keys up to the block's end: P = exp(s·QKᵀ + bias − lse),
    dV = Pᵀ dO, dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)), dQ = s·dS K, dK = s·dSᵀ Q, and dS summed along the diagonals.
    `values` (fp32 at least) hold −inf at the future distances, so a block's keys after a row weigh nothing."""
    batch, heads, length, dim = query.shape
    accumulate = lse.dtype
    delta = (grad_output.to(accumulate) * output.to(accumulate)).sum(-1, keepdim=True)  # (B, H, N, 1)
    lse = lse[..., None]  # (B, H, N, 1)
    keys, vals = key_heads.to(accumulate), value_heads.to(accumulate)
    grad_query = torch.empty_like(query)
    grad_key = torch.zeros(keys.shape, dtype=accumulate, device=keys.device)  # (B, H, N, D), contiguous: viewed
    grad_value = torch.zeros_like(grad_key)
    grad_values = torch.zeros_like(values)
    for start in reversed(range(0, length, HAND_ROWS)):  # the largest temporaries first (see Block order)
        stop = min(start + HAND_ROWS, length)
        rows, count = slice(start, stop), stop - start
        scaled = query[:, :, rows].flip(2).to(accumulate) * scaling  # (B, H, r, D), rows reversed
        grad_rows = grad_output[:, :, rows].flip(2).to(accumulate)
        weights = torch.matmul(scaled, keys[:, :, :stop].transpose(-1, -2))  # (B, H, r, stop)
        weights.add_(_reversed_rows(values, stop, count, stop)).sub_(lse[:, :, rows].flip(2)).exp_()  # P
        d_scores = torch.matmul(grad_rows, vals[:, :, :stop].transpose(-1, -2))  # dP
        d_scores.sub_(delta[:, :, rows].flip(2)).mul_(weights)  # dS
        # dV += Pᵀ dO, dK += dSᵀ (s·Q) in place (a matmul then `+=` is one more pass over the keys per block: 0.76x
        # instead of 0.83-0.85x at N = 2048)
        merged = (batch * heads, stop, dim)  # (B·H, stop, D): a view of the keys' rows
        flat = [tensor.reshape(batch * heads, count, -1) for tensor in (weights, d_scores, grad_rows, scaled)]
        grad_value[:, :, :stop].view(merged).baddbmm_(flat[0].transpose(-1, -2), flat[2])
        grad_key[:, :, :stop].view(merged).baddbmm_(flat[1].transpose(-1, -2), flat[3])
        grad_query[:, :, rows] = (torch.matmul(d_scores, keys[:, :, :stop]) * scaling).flip(2).to(query.dtype)
        # reversed row t', key j: value index j + t' + N − stop (anti-diagonals); the bias is shared by the batch
        grad_values[:, length - stop : length + count - 1] += _fold_reversed(d_scores.sum(dim=0))
    return grad_query, grad_key, grad_value, grad_values


class RelativeBiasAttention(torch.autograd.Function):
    """softmax(s · Q Kᵀ + bias + causal mask) V for any relative bias (see the module docstring); the backward by hand
    (`hand_backward`) when the bias values want their gradient, else the fused one (`flash_backward`).

    Inputs: query `(B, H, N, D)`, key and value `(B, H_kv, N, D)`, the `RelativeBias` values `(H, 2N − 1)` of N
    queries over N keys; returns `(B, H, N, D)`.
    """

    @staticmethod
    def forward(ctx, query, key, value, values, scaling: float):
        query, key, value = flash_operands(query, key, value)
        accumulate = torch.promote_types(query.dtype, torch.float32)
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        table = values.detach().to(accumulate).contiguous()
        output, lse = flash_forward(query, key_heads, value_heads, table, scaling)
        ctx.save_for_backward(query, key, value, values, output, lse)
        ctx.scaling = scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, values, output, lse = ctx.saved_tensors
        length = query.shape[2]
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        grad_output = grad_output.contiguous()
        # a copy (the future distances are overwritten below), laid out (H, 2N − 1) as the Hankel views step
        table = values.detach().to(lse.dtype).clone(memory_format=torch.contiguous_format)
        if ctx.needs_input_grad[3]:
            table[:, length:] = float("-inf")  # the future distances: a block's keys after a row
            grads = hand_backward(grad_output, query, key_heads, value_heads, table, output, lse, ctx.scaling)
            grad_query, grad_key, grad_value, grad_values = grads
            grad_values = grad_values.to(values.dtype)
        else:  # a fixed bias: the fused backward
            grad_query, grad_key, grad_value = flash_backward(
                grad_output, query, key_heads, value_heads, table, output, lse, ctx.scaling
            )
            grad_values = None
        grad_key, grad_value = sum_over_groups(grad_key, grad_value, groups)  # (B, H_kv, N, D)
        return grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype), grad_values, None


def relative_bias_applies(query, key, value, attention_mask, dropout: float, position_bias, is_causal: bool) -> bool:
    """Whether `RelativeBiasAttention` computes this call of the sdpa kernel: a `RelativeBias` (any; the sdpa entry
    point gives the banded and linear kernels their biases first) whose values are fp32 or fp64, causal
    self-attention over N tokens from slot 0 (no cache offset) with no mask (no padding, packing or window), no
    attention dropout, on CPU (torch's CPU flash kernel, which wants values as wide as the queries), outside
    torch.compile / export tracing, in fp32 or fp64. Not bf16: the bias gradient is a sum of dS over all rows, and
    its rowsum(dO ⊙ O) with O rounded to bf16 (twice: each part, then the merge) gave KERPLE's r1, r2 gradients 2-6%
    error under autocast (eager bf16: 0.6-1.2%, the blockwise kernel 1.2-1.5%); nor fp16 (its scores can overflow
    in the fused kernel). Any other call takes the blockwise kernel (`kernels.sdpa_relative_bias_forward`), which
    computes all of them."""
    if not fused_causal_call(query, key, value, attention_mask, dropout, position_bias, is_causal):
        return False
    return position_bias.values.dtype in (torch.float32, torch.float64) and query.dtype in (
        torch.float32,
        torch.float64,
    )


def relative_bias_attention(
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
    """`RelativeBiasAttention` on a call of the sdpa kernel (the `relative_bias` path of `kernels_sdpa.SDPA_PATHS`):
    the output `(B, H, N, D)`."""
    return RelativeBiasAttention.apply(query, key, value, position_bias.values, scaling)
