"""The causal kernel for a relative bias that is constant beyond a distance (`t5_bias`, `clamped_bias`): the far keys
through torch's fused causal kernel with no mask, the near band of keys explicit.

T5's buckets and the clamped distance table give every key at least `far_distance` slots behind the query one value
per head, c_h. Softmax ignores a constant shared by a row, so a causal row splits into two parts merged by their
log-sum-exps (as FlashAttention-2 merges key blocks):

- far keys (j ≤ i − W): the fused CPU flash kernel, `is_causal` on the queries W.. against the keys ..N − W − 1
  (torch aligns a rectangular causal mask top-left: query i − W sees keys 0..i − W), its log-sum-exp shifted by c_h;
- the band (i − W < j ≤ i): blocks of `BAND_ROWS` query rows, each against its window of `BAND_ROWS + W − 1` keys
  (an unfold of the keys, a view), with the bias of the band's W distances.

Nothing of size N² exists, forward or backward: the band's scores are O(N · W), computed in groups of blocks of at
most `kernels.BIAS_BLOCK_BYTES`. The backward calls the fused flash backward for the far part with the merged output
and log-sum-exp (so its weights are the merged softmax's), and recomputes the band's scores. The bias gradient of the
band folds into its W distances through autograd; that of the far keys, which all share c_h, is −(the band's
score-gradient sum) of each row, because the softmax gradient of a row sums to zero, and is reported at distance −W
(the scheme ties every farther distance to the same parameter, so the table's gradient is exact).
"""

from __future__ import annotations

import torch
from torch import nn

from .biases import RelativeBias
from .kernels import BIAS_BLOCK_BYTES, repeat_kv, symbolic_sizes


# Query rows per band block: the window is BAND_ROWS + W − 1 keys, of which W are scored per row. 64 measured
# fastest (fwd + bwd, B=2, H=6, D=64, W=128, 2 CPU threads: 1.24x causal SDPA at N=2048, 1.20x at 4096; 32: 1.45x,
# 1.25x; 128: 1.36x, 1.26x).
BAND_ROWS = 64
# what a profile (`plugformer bench`) names this path by
PROFILER_NAME = "plugformer::banded_bias"
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _band_layout(length: int, width: int, rows: int, device: torch.device):
    """The band's value index `(r, L)` of distance u − t − W + 1 for row t, window column u (clamped: entries outside
    the band are masked), the entries `(r, L)` inside the band (0..W−1 slots behind), the number of leading blocks
    whose windows start before slot 0, and the entries `(lead, r, L)` of those blocks on a key slot ≥ 0."""
    window = rows + width - 1
    t = torch.arange(rows, device=device)[:, None]
    u = torch.arange(window, device=device)[None, :]
    behind = t + width - 1 - u  # (r, L): query slot − key slot
    index = (length - 1 - behind).clamp(0, 2 * length - 2)  # value index of distance −behind
    lead = min(-(-(width - 1) // rows), -(-length // rows))  # blocks b with b·r − W + 1 < 0
    key_slot = torch.arange(lead, device=device)[:, None, None] * rows - width + 1 + u  # (lead, 1, L)
    return index, (behind >= 0) & (behind < width), lead, (key_slot >= 0).expand(lead, rows, window)


def _windows(tensor: torch.Tensor, width: int, rows: int, blocks: int) -> torch.Tensor:
    """(B, H, N, D) -> the key windows `(B, H, nb, L, D)` of the band blocks: block b's keys b·r − W + 1 ..
    (b + 1)·r − 1, zero-padded before slot 0 and after N − 1 (a view of one padded copy)."""
    length = tensor.shape[2]
    padded = nn.functional.pad(tensor, (0, 0, width - 1, blocks * rows - length))  # (B, H, W − 1 + nb·r, D)
    return padded.unfold(2, rows + width - 1, rows).transpose(-1, -2)  # (B, H, nb, L, D)


def _fold_windows(windows: torch.Tensor, width: int, length: int) -> torch.Tensor:
    """The adjoint of `_windows`: (B, H, nb, L, D) -> (B, H, N, D), each window's rows added back at its key slots."""
    batch, heads, blocks, window, dim = windows.shape
    rows = window - width + 1
    padded = windows.new_zeros(batch, heads, (blocks + -(-window // rows)) * rows, dim)
    for first in range(0, window, rows):  # window rows first.. land in block b + first / r of the padded keys
        part = windows[:, :, :, first : first + rows]  # (B, H, nb, ≤r, D)
        target = padded[:, :, first : first + blocks * rows].unflatten(2, (blocks, rows))  # (B, H, nb, r, D)
        target[:, :, :, : part.shape[3]] += part
    return padded[:, :, width - 1 : width - 1 + length]


def _band_scores(query_blocks, key_windows, bias, layout, group: slice) -> torch.Tensor:
    """Scores `(B, H, g, r, L)` (fp32 at least) of the band blocks `group`: (scaled query) · key + bias, −inf outside
    the band and before slot 0."""
    accumulate = bias.dtype
    scores = torch.matmul(query_blocks[:, :, group], key_windows[:, :, group].transpose(-1, -2)).to(accumulate)
    scores += bias[:, None]  # (H, 1, r, L), −inf outside the band
    lead, before = layout[2], layout[3]
    if group.start < lead:  # windows that start before slot 0: their zero-padded keys are blocked
        stop = min(lead, group.stop)
        scores[:, :, : stop - group.start].masked_fill_(~before[group.start : stop], float("-inf"))
    return scores


def _group_slices(batch: int, heads: int, blocks: int, rows: int, window: int):
    per_block = batch * heads * rows * window * 4
    step = max(1, BIAS_BLOCK_BYTES // per_block)
    return [slice(start, min(start + step, blocks)) for start in range(0, blocks, step)]


def _band_operands(query, key, value, values, width, scaling, layout):
    """The scaled query blocks `(B, H, nb, r, D)`, key and value windows `(B, H, nb, L, D)` and the band's bias
    `(H, r, L)` (fp32 at least; −inf outside the band)."""
    length = query.shape[2]
    blocks = -(-length // BAND_ROWS)
    query_blocks = nn.functional.pad(query * scaling, (0, 0, 0, blocks * BAND_ROWS - length))
    query_blocks = query_blocks.unflatten(2, (blocks, BAND_ROWS))  # (B, H, nb, r, D)
    accumulate = torch.promote_types(query.dtype, torch.float32)
    index, inside = layout[0], layout[1]
    bias = values.detach()[:, index].to(accumulate).masked_fill(~inside, float("-inf"))  # (H, r, L)
    windows = [_windows(tensor, width, BAND_ROWS, blocks) for tensor in (key, value)]
    return query_blocks, *windows, bias


class BandedBiasAttention(torch.autograd.Function):
    """softmax(s · Q Kᵀ + bias + causal mask) V for a bias constant beyond `far_distance` (see the module docstring).

    Inputs: query `(B, H, N, D)`, key and value `(B, H_kv, N, D)`, the `RelativeBias` values `(H, 2N − 1)` of N
    queries over N keys; returns `(B, H, N, D)`.
    """

    @staticmethod
    def forward(ctx, query, key, value, values, far_distance: int, scaling: float):
        length = query.shape[2]
        width = min(far_distance, length)
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        layout = _band_layout(length, width, BAND_ROWS, query.device)
        output, lse = _band_forward(query, key_heads, value_heads, values, width, scaling, layout)
        if length > width:  # the far keys, shifted by their shared bias c_h
            far = values[:, length - 1 - width].to(lse.dtype)[None, :, None]  # (1, H, 1)
            far_out, far_lse = _flash(query[:, :, width:], key_heads[:, :, : length - width],
                                      value_heads[:, :, : length - width], 0.0, True, scale=scaling)  # fmt: skip
            far_lse = far_lse + far
            near_lse = lse[:, :, width:]
            merged = torch.logaddexp(far_lse, near_lse)  # (B, H, N − W)
            tail = (far_out.to(lse.dtype) * (far_lse - merged).exp()[..., None]
                    + output[:, :, width:].to(lse.dtype) * (near_lse - merged).exp()[..., None])  # fmt: skip
            output[:, :, width:] = tail.to(output.dtype)
            lse[:, :, width:] = merged
        ctx.save_for_backward(query, key, value, values, output, lse)
        ctx.width, ctx.scaling, ctx.layout = width, scaling, layout
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, values, output, lse = ctx.saved_tensors
        width, scaling, layout = ctx.width, ctx.scaling, ctx.layout
        length = query.shape[2]
        groups = query.shape[1] // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        grad_output = grad_output.contiguous()
        grad_query, grad_key, grad_value, grad_values, far_grad = _band_backward(
            grad_output, query, key_heads, value_heads, values, output, lse, width, scaling, layout
        )
        if length > width:
            far = values[:, length - 1 - width].to(lse.dtype)[None, :, None]  # (1, H, 1)
            rest = length - width
            d_query, d_key, d_value = _flash_backward(
                grad_output[:, :, width:], query[:, :, width:], key_heads[:, :, :rest], value_heads[:, :, :rest],
                output[:, :, width:], (lse[:, :, width:] - far).contiguous(), 0.0, True, scale=scaling,
            )  # fmt: skip
            grad_query[:, :, width:] += d_query
            grad_key[:, :, :rest] += d_key
            grad_value[:, :, :rest] += d_value
            grad_values[:, length - 1 - width] -= far_grad
        if groups > 1:  # each key/value head served `groups` query heads: sum their gradients
            grad_key = grad_key.unflatten(1, (-1, groups)).sum(2)  # (B, H_kv, N, D)
            grad_value = grad_value.unflatten(1, (-1, groups)).sum(2)
        return grad_query, grad_key, grad_value, grad_values.to(values.dtype), None, None


def _band_forward(query, key, value, values, width, scaling, layout):
    """The band's output `(B, H, N, D)` (input dtype) and log-sum-exp `(B, H, N)` (fp32 at least)."""
    batch, heads, length, _ = query.shape
    query_blocks, key_windows, value_windows, bias = _band_operands(query, key, value, values, width, scaling, layout)
    blocks, window = key_windows.shape[2], key_windows.shape[3]
    outputs, lses = [], []
    for group in _group_slices(batch, heads, blocks, BAND_ROWS, window):
        weights = _band_scores(query_blocks, key_windows, bias, layout, group)  # (B, H, g, r, L)
        peak = weights.amax(dim=-1, keepdim=True)  # (B, H, g, r, 1)
        weights.sub_(peak).exp_()  # unnormalised
        total = weights.sum(dim=-1, keepdim=True)
        output = torch.matmul(weights.to(value.dtype), value_windows[:, :, group])  # (B, H, g, r, D)
        outputs.append(output / total.to(output.dtype))
        lses.append((peak + total.log())[..., 0])  # (B, H, g, r)
    output = torch.cat(outputs, dim=2).flatten(2, 3)[:, :, :length]  # (B, H, N, D)
    return output.contiguous(), torch.cat(lses, dim=2).flatten(2, 3)[:, :, :length].contiguous()


def _band_backward(grad_output, query, key, value, values, output, lse, width, scaling, layout):
    """Gradients through the band's scores, with the merged output and log-sum-exp: (dQ, dK, dV) `(B, H, N, D)` each,
    d(values) `(H, 2N − 1)`, and the per-head sum `(H,)` of the band's score gradients (the far keys' is its
    negative)."""
    batch, heads, length, _ = query.shape
    query_blocks, key_windows, value_windows, bias = _band_operands(query, key, value, values, width, scaling, layout)
    blocks, window = key_windows.shape[2], key_windows.shape[3]
    pad = blocks * BAND_ROWS - length
    delta = (grad_output.to(lse.dtype) * output.to(lse.dtype)).sum(-1)  # (B, H, N): rowsum(dO ⊙ O)
    delta = nn.functional.pad(delta, (0, pad)).unflatten(2, (blocks, BAND_ROWS))[..., None]  # (B, H, nb, r, 1)
    lse = nn.functional.pad(lse, (0, pad)).unflatten(2, (blocks, BAND_ROWS))[..., None]
    grad_blocks = nn.functional.pad(grad_output, (0, 0, 0, pad)).unflatten(2, (blocks, BAND_ROWS))  # (B,H,nb,r,D)
    grad_query, grad_key_windows, grad_value_windows = [], [], []
    grad_bias = torch.zeros_like(bias)  # (H, r, L)
    for group in _group_slices(batch, heads, blocks, BAND_ROWS, window):
        weights = _band_scores(query_blocks, key_windows, bias, layout, group)
        weights.sub_(lse[:, :, group]).exp_()  # P (B, H, g, r, L), the merged softmax's
        grad_rows = grad_blocks[:, :, group]
        d_scores = torch.matmul(grad_rows, value_windows[:, :, group].transpose(-1, -2)).to(weights.dtype)  # dP
        d_scores.sub_(delta[:, :, group]).mul_(weights)  # dS = P ⊙ (dP − rowsum(dO ⊙ O))
        grad_bias += d_scores.sum(dim=(0, 2))  # (H, r, L)
        d_cast = d_scores.to(query.dtype)
        grad_query.append(torch.matmul(d_cast, key_windows[:, :, group]))  # (B, H, g, r, D)
        grad_key_windows.append(torch.matmul(d_cast.transpose(-1, -2), query_blocks[:, :, group]))  # (B,H,g,L,D)
        grad_value_windows.append(torch.matmul(weights.to(value.dtype).transpose(-1, -2), grad_rows))
    grad_query = torch.cat(grad_query, dim=2).flatten(2, 3)[:, :, :length] * scaling  # (B, H, N, D)
    grad_key = _fold_windows(torch.cat(grad_key_windows, dim=2), width, length)
    grad_value = _fold_windows(torch.cat(grad_value_windows, dim=2), width, length)
    grad_values = torch.zeros(values.shape, dtype=grad_bias.dtype, device=values.device)
    grad_values.index_add_(1, layout[0].flatten(), grad_bias.flatten(1))  # entries outside the band carry dS = 0
    return grad_query.contiguous(), grad_key, grad_value, grad_values, grad_bias.sum(dim=(1, 2))


def banded_bias_applies(query, key, value, attention_mask, dropout: float, position_bias, is_causal: bool) -> bool:
    """Whether `BandedBiasAttention` computes this call of the sdpa kernel: a `RelativeBias` with `constant_beyond`
    W, causal self-attention over N > W tokens from slot 0 (no cache offset) with no mask (no padding, packing or
    window: transformers then leaves the mask out), no attention dropout, on CPU (the fused kernel it calls is
    torch's CPU flash attention, which also wants values as wide as the queries), outside torch.compile / export
    tracing, in fp32, bf16 or fp64 (float16 scores can overflow in the fused kernel, where the blockwise kernel
    keeps them finite). Any other call takes the blockwise kernel
    (`kernels.sdpa_relative_bias_forward`), which computes all of them."""
    if not isinstance(position_bias, RelativeBias) or position_bias.constant_beyond is None:
        return False
    if torch.compiler.is_compiling() or symbolic_sizes(query, key):
        return False
    length = query.shape[2]
    same = length == key.shape[2] == position_bias.query_length == position_bias.key_length
    same = same and value.shape[-1] == query.shape[-1]
    simple = is_causal and attention_mask is None and dropout == 0.0 and query.device.type == "cpu"
    simple = simple and query.dtype != torch.float16
    return simple and same and length > position_bias.constant_beyond


def banded_bias_attention_forward(query, key, value, scaling: float, position_bias: RelativeBias):
    """`BandedBiasAttention` as the sdpa kernel returns it: `(output (B, N, H, D), None)` (no attention weights)."""
    with torch.profiler.record_function(PROFILER_NAME):  # so a profile (`plugformer bench`) names the path
        output = BandedBiasAttention.apply(query, key, value, position_bias.values, position_bias.constant_beyond,
                                           scaling)  # fmt: skip
    return output.transpose(1, 2).contiguous(), None  # (B, N, H, D)
