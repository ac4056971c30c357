"""The causal kernel for a bias linear in the distance (ALiBi's m_h · (j − i)): torch's fused CPU flash kernel with a
(1, H, 1, keys) mask per block of query rows, no (B, H, r, keys) mask built, forward or backward.

Softmax ignores a constant shared by a row, and a linear bias splits as f(j − i) = f(j − c) + f(c − i) for any slot c:
against a fixed c the bias is a function of the key alone, a mask that broadcasts over the queries. With c = 0 for
the whole sequence the scores would carry m_h · j (thousands at N = 4096), whose fp32 rounding (2.4e-4 at 2048)
reaches the weights. So the rows go in blocks of `ROWS` from slot c, each in two parts merged by their log-sum-exps
(as FlashAttention-2 merges key blocks, and `kernels_banded` its band and far keys):

- the keys before the block (j < c): one fused call with the key row f(j − c) (the bias of the block's first row,
  small where its weights are large) as a mask broadcast over the block's rows; its log-sum-exp then gets the row's
  f(c − i) (at most `ROWS` distances);
- the block's own keys (c ≤ j ≤ i): the fused causal call (the square's top-left causal mask is the right one) with
  the (1, H, ROWS, ROWS) bias of the square, the same for every block, built once per call.

Every bias number is one of the bias values (the (H, 2N − 1) table the scheme computed); the only difference from
adding f(j − i) is the rounding of f(j − c) + f(c − i), at the size of the values near the block. The backward calls
the fused flash backward on both parts with the merged output and log-sum-exp (so their weights are the merged
softmax's). ALiBi's slopes are fixed: no bias gradient.
"""

from __future__ import annotations

import torch

from .biases import RelativeBias
from .kernels import fused_causal_call, merge_by_lse, repeat_kv, sum_over_groups
from .kernels_fixed import flash_operands


# Query rows per block. Forward + backward against causal SDPA (B=2, H=6, D=64, fp32, 1 thread, CPU time, shared
# machine): 256 rows 0.96-0.99x at N = 2048, 0.89-0.96x at 4096; 128: 0.94x, 0.86x; 512: 0.88x, 0.90x; 1024: 0.81x,
# 0.90x (the square's mask, H·ROWS² numbers, is read for each block).
ROWS = 256
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _before(values: torch.Tensor, start: int) -> torch.Tensor:
    """The mask `(1, H, 1, start)` of the keys before slot `start`: f(j − start), the bias of the query at `start`."""
    length = (values.shape[-1] + 1) // 2
    return values[None, :, None, length - 1 - start : length - 1]


def _row_offsets(values: torch.Tensor, rows: int) -> torch.Tensor:
    """f(−t) `(1, H, rows)` for t = 0..rows − 1: what row c + t adds to the bias of a key before slot c."""
    length = (values.shape[-1] + 1) // 2
    return values[None, :, length - rows : length].flip(-1)


class LinearBiasAttention(torch.autograd.Function):
    """softmax(s · Q Kᵀ + bias + causal mask) V for a bias linear in the distance (see the module docstring).

    Inputs: query `(B, H, N, D)`, key and value `(B, H_kv, N, D)`, the `RelativeBias` values `(H, 2N − 1)` of N
    queries over N keys (no gradient); returns `(B, H, N, D)`.
    """

    @staticmethod
    def forward(ctx, query, key, value, values, scaling: float):
        query, key, value = flash_operands(query, key, value)
        length = query.shape[2]
        accumulate = torch.promote_types(query.dtype, torch.float32)
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        values = values.detach().to(accumulate).contiguous()
        side = min(ROWS, length)
        square = RelativeBias(values, length, length).rows(0, side, side)  # (1, H, ROWS, ROWS): f(u − t)
        output, lse = torch.empty_like(query), query.new_empty(query.shape[:3], dtype=accumulate)  # (B, H, N)
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
            if start:  # the keys before the block, their lse shifted by each row's f(c − i)
                far, far_lse = _flash(
                    query[:, :, rows],
                    key_heads[:, :, :start],
                    value_heads[:, :, :start],
                    0.0,
                    False,
                    attn_mask=_before(values, start),
                    scale=scaling,
                )
                far_lse = far_lse + _row_offsets(values, count)
                block, block_lse = merge_by_lse(far, far_lse, block, block_lse, accumulate)
            output[:, :, rows] = block
            lse[:, :, rows] = block_lse
        ctx.save_for_backward(query, key, value, values, output, lse)
        ctx.scaling = scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, values, output, lse = ctx.saved_tensors
        length, scaling = query.shape[2], ctx.scaling
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        grad_output = grad_output.contiguous()
        side = min(ROWS, length)
        square = RelativeBias(values, length, length).rows(0, side, side)  # (1, H, ROWS, ROWS)
        # every key gathers gradient from each later block: summed in fp32 at least (bf16 sums would round each time)
        grad_query = torch.empty_like(query)
        grad_key = torch.zeros(key_heads.shape, dtype=lse.dtype, device=query.device)  # (B, H, N, D)
        grad_value = torch.zeros_like(grad_key)
        for start in reversed(range(0, length, ROWS)):  # largest temporaries first (`kernels_relative`, Block order)
            rows = slice(start, min(start + ROWS, length))
            count = rows.stop - start
            block_args = (grad_output[:, :, rows], query[:, :, rows])
            d_query, d_key, d_value = _flash_backward(
                *block_args,
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
            if start:  # the keys before the block: the merged lse, less each row's f(c − i), as their forward's
                far_lse = (lse[:, :, rows] - _row_offsets(values, count)).contiguous()
                far_query, far_key, far_value = _flash_backward(
                    *block_args,
                    key_heads[:, :, :start],
                    value_heads[:, :, :start],
                    output[:, :, rows],
                    far_lse,
                    0.0,
                    False,
                    attn_mask=_before(values, start),
                    scale=scaling,
                )
                d_query = d_query.to(lse.dtype) + far_query
                grad_key[:, :, :start] += far_key
                grad_value[:, :, :start] += far_value
            grad_query[:, :, rows] = d_query
        grad_key, grad_value = sum_over_groups(grad_key, grad_value, groups)  # (B, H_kv, N, D)
        return grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype), None, None


def linear_bias_applies(query, key, value, attention_mask, dropout: float, position_bias, is_causal: bool) -> bool:
    """Whether `LinearBiasAttention` computes this call of the sdpa kernel: a `RelativeBias` declared `linear`
    (ALiBi) whose values need no gradient and are fp32 or fp64, causal self-attention over N tokens from slot 0 (no
    cache offset: Q = K) with no mask (no padding, packing or window: transformers then leaves the mask out), no
    attention dropout, on CPU (torch's CPU flash kernel, which wants values as wide as the queries), outside
    torch.compile / export tracing, in fp32, bf16 or fp64 (fp16 scores can overflow in the fused kernel). Any other
    call takes the blockwise kernel (`kernels.sdpa_relative_bias_forward`), which computes all of them."""
    if not fused_causal_call(query, key, value, attention_mask, dropout, position_bias, is_causal):
        return False
    values = position_bias.values
    if not position_bias.linear or values.requires_grad or values.dtype not in (torch.float32, torch.float64):
        return False
    return query.dtype in (torch.float32, torch.bfloat16, torch.float64)


def linear_bias_attention(
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
    """`LinearBiasAttention` on a call of the sdpa kernel (the `linear_bias` path of `kernels_sdpa.SDPA_PATHS`):
    the output `(B, H, N, D)`."""
    return LinearBiasAttention.apply(query, key, value, position_bias.values, scaling)
