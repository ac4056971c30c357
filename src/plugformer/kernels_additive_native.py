"""The additive (Bahdanau) kernel's native paths on the CPU: the fused C loops of `csrc/additive.c` (built by
`native.load`), which form tanh(q_ia + k_ja) one (query, key) pair at a time in vector registers where the torch path
materialises a (B, H, c, K, A) tensor and makes several passes over memory through it.

- `NativeAdditiveScores`: the scores s_ij = Σ_a v_a tanh(q_ia + k_ja) and their gradients (the pairs with ds = 0, the
  masked ones, skipped); it keeps the queries and keys only. The chunked kernel uses it where the chunk is
  checkpointed (attention dropout, attention weights returned, a query-dependent bias).
- `NativeAdditiveAttention`: a whole query chunk, softmax(s + bias + mask) V, that keeps no (c, K) tensor and needs no
  checkpoint: its backward recomputes each score in the loop that forms its gradients (p = exp(x − m − l) from the
  forward's row maximum m and log-sum l), so the tanh runs twice per training step instead of three times.

Only fp32 runs here (the C loops are float); a tanh within 1.3 ulp of the exact one (`csrc/additive.c`).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch.autograd.function import once_differentiable

from .biases import RelativeBias
from .kernels import _add_bias_and_mask
from .native import load


# what a profile (`plugformer bench`) names this path by
PROFILER_NAME = "plugformer::additive_native"


@functools.cache
def native_additive() -> ctypes.CDLL | None:
    """The fused C kernel (`csrc/additive.c`, built by `native.load`), or `None` where it is not built."""
    library = load("additive")
    if library is None:
        return None
    pointer, size, count = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.plugformer_additive_scores.argtypes = [
        pointer,
        pointer,
        size,
        pointer,
        pointer,
        size,
        size,
        count,
        pointer,
        *[size] * 5,
        count,
    ]
    library.plugformer_additive_scores_backward.argtypes = [pointer, pointer, size, *[pointer] * 4, *[size] * 4, count]
    library.plugformer_additive_attention_backward.argtypes = [
        pointer,
        pointer,
        size,
        pointer,
        pointer,
        size,
        pointer,
        size,
        size,
        *[pointer] * 9,
        *[size] * 6,
        count,
        count,
    ]
    return library


def native_applies(*tensors: torch.Tensor | None) -> bool:
    """Whether the native kernel computes these tensors (`None` stands for an absent one): fp32 on the CPU, plain
    tensors (no FakeTensor, DTensor) outside torch.compile / export / jit tracing, where the kernel is built."""
    for tensor in tensors:
        if tensor is None:
            continue
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or type(tensor.detach()) is not torch.Tensor:
            return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return native_additive() is not None


def key_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`tensor` `(B, H, K, ·)` detached, as the C loops read keys and values: contiguous rows of K·(last dim) with one
    stride between the (batch, head) pairs, and that stride. A chunk's keys, the first K of a contiguous
    `(B, H, N, ·)` tensor, are read in place (a copy per chunk, kept for its backward, would add up)."""
    tensor = tensor.detach()
    batch, heads, keys, width = tensor.shape
    stride = tensor.stride(1) if heads > 1 else tensor.stride(0)
    rows_fit = tensor.stride(-1) == 1 and (tensor.stride(-2) == width or keys == 1)
    if not rows_fit or (batch > 1 and heads > 1 and tensor.stride(0) != heads * tensor.stride(1)):
        tensor = tensor.contiguous()
        stride = keys * width
    return tensor, stride


def _extra_pointer(extra: torch.Tensor | None) -> tuple[int | None, int, int]:
    """`extra` `(B or 1, H or 1, c, K)` (contiguous) as the C loops read it: its address and the strides between its
    batches and heads, 0 along a broadcast axis."""
    if extra is None:
        return None, 0, 0
    sizes, strides = extra.shape[:2], extra.stride()[:2]
    batch_stride, head_stride = (stride if size > 1 else 0 for size, stride in zip(sizes, strides, strict=True))
    return extra.data_ptr(), batch_stride, head_stride


def native_scores(
    query: torch.Tensor, key: torch.Tensor, energy: torch.Tensor, extra: torch.Tensor | None = None, add: bool = True
) -> torch.Tensor:
    """The scores `(B, H, c, K)` of queries `(B, H, c, A)` over keys `(B, H, K, A)` with the energy vectors `(H, A)`
    (fp32) from the native kernel, no (B, H, c, K, A) tensor formed. With `extra` (the bias and mask, `(B or 1,
    H or 1, c, K)` contiguous) the pairs it blocks take no tanh: the scores plus `extra`, or with `add=False` the
    scores alone, 0 where `extra` blocks (the mask, applied after, sets them)."""
    query, energy = query.detach().contiguous(), energy.detach().contiguous()
    key, key_stride = key_rows(key)
    batch, heads, rows, attn_dim = query.shape
    scores = query.new_empty(batch, heads, rows, key.shape[2])
    with torch.profiler.record_function(PROFILER_NAME):  # so a profile (`plugformer bench`) names the path
        native_additive().plugformer_additive_scores(
            query.data_ptr(),
            key.data_ptr(),
            key_stride,
            energy.data_ptr(),
            *_extra_pointer(extra),
            int(add),
            scores.data_ptr(),
            batch * heads,
            heads,
            rows,
            key.shape[2],
            attn_dim,
            torch.get_num_threads(),
        )
    return scores


def masked_scores(query: torch.Tensor, key: torch.Tensor, energy: torch.Tensor, mask: torch.Tensor | None):
    """`native_scores` before a `mask` `(B or 1, 1, c, ≥ K)` (bool or float) is applied: 0 without a tanh where it
    blocks."""
    return native_scores(
        query, key, energy, _bias_and_mask(mask, None, None, (0, query.shape[2]), key.shape[2]), add=False
    )


class NativeAdditiveScores(torch.autograd.Function):
    """`native_scores` with the gradients of `kernels_additive.AdditiveScores`, each tanh recomputed in the loop that
    forms them: dv_a = Σ ds_ij t_ija, dq_ia = v_a Σ_j ds_ij (1 − t_ija²), dk_ja = v_a Σ_i ds_ij (1 − t_ija²). Given
    the `mask` applied after it, the pairs it blocks score 0 without their tanh (their value never reaches the
    softmax)."""

    @staticmethod
    def forward(ctx, query, key, energy, mask=None):
        query, key = query.detach().contiguous(), key_rows(key)[0]
        ctx.save_for_backward(query, key, energy)
        return masked_scores(query, key, energy, mask)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_scores):
        query, key, energy = ctx.saved_tensors
        batch, heads, rows, attn_dim = query.shape
        grad_scores = grad_scores.to(torch.float32).contiguous()  # (B, H, c, K)
        grad_query, grad_key = torch.empty_like(query), key.new_empty(key.shape)  # contiguous
        grad_energy = query.new_empty(batch, heads, attn_dim)  # (B, H, A): one row per (batch, head)
        native_additive().plugformer_additive_scores_backward(
            query.data_ptr(),
            key.data_ptr(),
            key_rows(key)[1],
            grad_scores.data_ptr(),
            grad_query.data_ptr(),
            grad_key.data_ptr(),
            grad_energy.data_ptr(),
            batch * heads,
            rows,
            key.shape[2],
            attn_dim,
            torch.get_num_threads(),
        )
        energy_rows = energy.detach()[None, :, None, :]  # (1, H, 1, A)
        return grad_query.mul_(energy_rows), grad_key.mul_(energy_rows), grad_energy.sum(0).to(energy.dtype), None


def _bias_and_mask(mask, values, lengths, rows: tuple[int, int], keys: int) -> torch.Tensor | None:
    """What the chunk's scores are shifted by, `(B or 1, H or 1, c, K)` fp32: the bias rows plus the mask, as
    `_add_bias_and_mask` adds them (blocked entries at the fp32 minimum), or `None` when there is neither."""
    bias = None if values is None else RelativeBias(values.detach(), *lengths).rows(*rows, keys)
    if bias is None and mask is None:
        return None
    zeros = torch.zeros(
        1, 1, rows[1] - rows[0], keys, dtype=torch.float32, device=values.device if mask is None else mask.device
    )
    return _add_bias_and_mask(zeros, mask, bias).contiguous()


class NativeAdditiveAttention(torch.autograd.Function):
    """softmax(v·tanh(q_i + k_j) + bias + mask) V over one chunk of query rows `(B, H, c, A)` and the keys, values
    `(B, H, K, ·)` it sees, without attention dropout. The bias, if any, is a `RelativeBias` given by its `values` and
    `lengths` (query and key length), its rows `rows`: their gradient, dS summed over the batch, is folded along the
    diagonals into the values (`RelativeBias.fold_rows`). Keeps the inputs, the output and two numbers per row."""

    @staticmethod
    def forward(ctx, query, key, value, energy, values, mask, lengths, rows, keys):
        extra = _bias_and_mask(mask, values, lengths, rows, keys)  # (B | 1, H | 1, c, K)
        scores = native_scores(query, key, energy, extra)  # (B, H, c, K)
        row_max = scores.amax(-1, keepdim=True)  # (B, H, c, 1)
        shifted = scores.sub_(row_max)
        row_log = torch.logsumexp(shifted, -1)  # (B, H, c)
        value, key = key_rows(value)[0], key_rows(key)[0]
        output = torch.matmul(shifted.softmax(-1), value)  # (B, H, c, D)
        query = query.detach().contiguous()
        ctx.save_for_backward(query, key, value, energy, values, mask, output, row_max.squeeze(-1), row_log)
        ctx.lengths, ctx.rows, ctx.keys = lengths, rows, keys
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        query, key, value, energy, values, mask, output, row_max, row_log = ctx.saved_tensors
        batch, heads, count, attn_dim = query.shape
        grad_output = grad_output.to(torch.float32).contiguous()  # (B, H, c, D)
        delta = (grad_output * output).sum(-1)  # (B, H, c): rowsum(dO ⊙ O)
        extra = _bias_and_mask(mask, values, ctx.lengths, ctx.rows, ctx.keys)  # (B | 1, H | 1, c, K)
        grad_query = torch.empty_like(query)
        grad_key, grad_value = (tensor.new_empty(tensor.shape) for tensor in (key, value))  # contiguous
        grad_energy = query.new_empty(batch, heads, attn_dim)  # (B, H, A): one row per (batch, head)
        wants_bias = values is not None and ctx.needs_input_grad[4]
        d_scores = query.new_empty(batch, heads, count, key.shape[2]) if wants_bias else None  # (B, H, c, K)
        inputs = [
            query.data_ptr(),
            key.data_ptr(),
            key_rows(key)[1],
            energy.detach().contiguous().data_ptr(),
            value.data_ptr(),
            key_rows(value)[1],
            *_extra_pointer(extra),
        ]
        outputs = [
            tensor.data_ptr() if tensor is not None else None
            for tensor in (grad_query, grad_key, grad_energy, grad_value, d_scores)
        ]
        native_additive().plugformer_additive_attention_backward(
            *inputs,
            row_max.data_ptr(),
            row_log.data_ptr(),
            delta.data_ptr(),
            grad_output.data_ptr(),
            *outputs,
            batch * heads,
            heads,
            count,
            key.shape[2],
            attn_dim,
            value.shape[-1],
            int(mask is not None and mask.dtype in (torch.bool, torch.float16)),
            torch.get_num_threads(),
        )
        energy_rows = energy.detach()[None, :, None, :]  # (1, H, 1, A)
        grad_values = None
        if wants_bias:  # the bias is shared by the batch; blocked entries have zero weight, so zero dS
            grad_values = RelativeBias(values.detach(), *ctx.lengths).fold_rows(d_scores.sum(0), ctx.rows[0])
            grad_values = grad_values.to(values.dtype)
        return (
            grad_query.mul_(energy_rows),
            grad_key.mul_(energy_rows),
            grad_value,
            grad_energy.sum(0).to(energy.dtype),
            grad_values,
            None,
            None,
            None,
            None,
        )
