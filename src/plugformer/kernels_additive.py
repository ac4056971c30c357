"""The query-chunked additive (Bahdanau) attention kernel, with the signature of `kernels` (transformers').

Each chunk of query rows i scores the keys j as s_ij = Σ_a v_a tanh(q_ia + k_ja): a (B, H, c, K, A) tanh tensor that
no GEMM forms, so its elementwise passes are the cost. `AdditiveScores` computes them with one allocation, an in-place
tanh and one contraction, and its backward forms the gradients directly from the kept tanh t (sums of ds·t and of
ds·t²: one (c, K, A) temporary, where autograd's graph made several). On the CPU the contraction with v runs in numpy
(its gemv beats torch's bmm on one thread), and so does the tanh where numpy's is clearly the faster of the two on the
machine (`numpy_tanh_is_faster`): its SIMD tanh runs on one thread and is faithfully rounded (< 1 ulp, against torch's
correctly rounded one); which one wins depends on the CPU (model_cards/BENCHMARKS.md, "Design measurements").
Elsewhere the kernel runs in torch.

Where the fp32 CPU tensors meet the native kernel (`kernels_additive_native`, built at first use), it computes
instead: no (c, K, A) tensor, chunks sized by their (B, H, c, K) scores (`NATIVE_CHUNK_BYTES`), and in training
without dropout, attention weights or a query-dependent bias, no checkpoint (`NativeAdditiveAttention`).
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from .biases import RelativeBias
from .kernels import (
    _add_bias_and_mask,
    _softmax_dropout_values,
    _wants_weights,
    bias_rows,
    causal_keys,
    mask_blocks_the_future,
    repeat_kv,
    symbolic_sizes,
)
from .kernels_additive_native import NativeAdditiveAttention, NativeAdditiveScores, masked_scores, native_applies


# Bytes of (B, H, chunk, K, A) tanh activations the additive kernel may hold at once: larger chunks are slower, as
# glibc maps and unmaps their buffers afresh for every chunk (BENCHMARKS.md, "Design measurements").
ADDITIVE_CHUNK_BYTES = 16 * 2**20
# Bytes of (B, H, chunk, K) fp32 scores a chunk of `NativeAdditiveAttention` may hold (its forward makes about three)
NATIVE_CHUNK_BYTES = 4 * 2**20


def _numpy_view(tensor: torch.Tensor) -> np.ndarray | None:
    """`tensor`'s memory as a numpy array where numpy may compute on it: a contiguous fp32/fp64 CPU tensor outside
    torch.compile / torch.export / jit tracing (which see torch ops only); else `None`."""
    if tensor.device.type != "cpu" or tensor.dtype not in (torch.float32, torch.float64):
        return None
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or type(tensor) is not torch.Tensor:
        return None
    return tensor.detach().numpy() if tensor.is_contiguous() else None


# Elements of the buffer `numpy_tanh_is_faster` times (64 KiB: in the L2 cache)
TIMED_ELEMENTS = 2**14


@functools.cache
def numpy_tanh_is_faster(threads: int) -> bool:
    """Whether numpy's tanh (one thread) takes under half the time of torch's on `threads` threads, judged from both
    timed on one thread (a 64 KiB fp32 buffer; the best of 15 interleaved samples of 20 calls each, ~3 ms once per
    process and thread count) with torch's time divided by `threads`. Timed on one thread, the two are properties of
    the CPU that other work on the machine moves alike, and the wide margin keeps torch's tanh wherever the two are
    anywhere near, so a rerun on the same machine takes the same path (the two differ by at most an ulp)."""
    values = torch.randn(TIMED_ELEMENTS, generator=torch.Generator().manual_seed(0), device="cpu")  # any default
    result = torch.empty_like(values)
    source, target = values.numpy(), result.numpy()
    torch_tanh, numpy_tanh = lambda: torch.tanh(values, out=result), lambda: np.tanh(source, out=target)

    def timed(tanh) -> float:
        start = time.perf_counter()
        for _ in range(20):
            tanh()
        return time.perf_counter() - start

    # torch's on one thread: even a 64 KiB tanh enters its thread pool, whose threads wait for a busy core when
    # another process runs; the count is restored at once
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch_tanh(), numpy_tanh()  # the first calls set things up
        # interleaved, so that whatever else runs on the machine slows both alike; the best sample of each
        samples = [(timed(torch_tanh), timed(numpy_tanh)) for _ in range(15)]
    finally:
        torch.set_num_threads(before)
    torch_time, numpy_time = (min(column) for column in zip(*samples, strict=True))
    return numpy_time < 0.5 * torch_time / threads


def tanh_scores(query: torch.Tensor, key: torch.Tensor, energy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores s_ij = Σ_a v_a tanh(q_ia + k_ja) `(B, H, c, K)` of queries `(B, H, c, A)` over keys `(B, H, K, A)`
    with the energy vectors v `(H, A)`, and the tanh tensor t `(B, H, c, K, A)`."""
    batch, heads, rows, attn_dim = query.shape
    # contiguous whatever the inputs' layout (`add` would follow a permuted one, e.g. an einsum's output)
    hidden = query.new_empty(batch, heads, rows, key.shape[2], attn_dim)  # (B, H, c, K, A)
    torch.add(query[:, :, :, None, :], key[:, :, None, :, :], out=hidden)
    flat = hidden.view(batch, heads, -1, attn_dim)  # (B, H, c·K, A)
    array, vector = _numpy_view(hidden), _numpy_view(energy.detach().contiguous())  # a Parameter: a plain tensor
    if array is not None and vector is not None and vector.dtype == array.dtype:
        if numpy_tanh_is_faster(torch.get_num_threads()):
            np.tanh(array, out=array)
        else:
            hidden.tanh_()  # the array's memory
        scores = torch.from_numpy(np.matmul(array.reshape(flat.shape), vector.reshape(1, heads, attn_dim, 1)))
    else:
        hidden.tanh_()
        scores = torch.matmul(flat, energy[None, :, :, None])  # (B, H, c·K, 1)
    return scores.view(batch, heads, rows, key.shape[2]), hidden


class AdditiveScores(torch.autograd.Function):
    """`tanh_scores` with its gradients by hand, from the tanh t it keeps (recomputed per chunk by the checkpoint):

        dL/dv_a = Σ_bij ds_ij t_ija,  dL/dq_ia = v_a Σ_j ds_ij (1 − t_ija²),  dL/dk_ja = v_a Σ_i ds_ij (1 − t_ija²)

    with Σ_j ds_ij (1 − t²) formed as Σ_j ds_ij − Σ_j ds_ij t² from one tensor ds·t² (its rounding error, ~eps·Σ|ds|,
    is that of 1 − t² from a rounded t). The kept t is left as it is (a graph kept with `retain_graph` backpropagates
    again); the backward is not differentiable itself (`once_differentiable`: a double backward is refused).
    """

    @staticmethod
    def forward(ctx, query, key, energy):
        scores, hidden = tanh_scores(query, key, energy)
        ctx.save_for_backward(hidden, energy)
        return scores

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_scores):
        hidden, energy = ctx.saved_tensors  # t (B, H, c, K, A), v (H, A)
        batch, heads, rows, keys, attn_dim = hidden.shape
        grad_scores = grad_scores.to(hidden.dtype)
        grad_energy = None
        if ctx.needs_input_grad[2]:
            flat = hidden.view(batch, heads, rows * keys, attn_dim)
            grad_energy = torch.matmul(grad_scores.reshape(batch, heads, 1, rows * keys), flat)  # (B, H, 1, A)
            grad_energy = grad_energy.sum(0).view(heads, attn_dim).to(energy.dtype)
        squares = torch.mul(hidden, hidden).mul_(grad_scores[..., None])  # ds_ij t_ija² (B, H, c, K, A)
        energy_rows = energy.to(hidden.dtype)[None, :, None, :]  # (1, H, 1, A)
        grad_query = grad_key = None
        if ctx.needs_input_grad[0]:
            grad_query = (grad_scores.sum(3, keepdim=True) - squares.sum(3)) * energy_rows  # (B, H, c, A)
        if ctx.needs_input_grad[1]:
            grad_key = (grad_scores.sum(2)[..., None] - squares.sum(2)) * energy_rows  # (B, H, K, A)
        return grad_query, grad_key, grad_energy


def additive_scores(
    query: torch.Tensor, key: torch.Tensor, energy: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`(B, H, c, K)` scores: from the native kernel where it applies (`native_applies`; the pairs the `mask` applied
    after blocks are left out there), else through `AdditiveScores` when a gradient is wanted, else `tanh_scores`."""
    wants_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or energy.requires_grad)
    if native_applies(query, key, energy):
        return (NativeAdditiveScores.apply if wants_grad else masked_scores)(query, key, energy, mask)
    return AdditiveScores.apply(query, key, energy) if wants_grad else tanh_scores(query, key, energy)[0]


def _additive_chunk(*args) -> torch.Tensor:
    """The output rows `(B, H, c, D)` of one query chunk (`_additive_chunk_weights`' arguments): the checkpoint's
    function, which must return tensors that need their gradient only."""
    return _additive_chunk_weights(*args)[0]


def _additive_chunk_weights(
    module: nn.Module,
    query_chunk: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    energy: torch.Tensor,
    mask_chunk: torch.Tensor | None,
    position_bias: RelativeBias | None,
    rows: slice,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output rows `(B, H, c, D)` and weights `(B, H, c, K)` of one query chunk."""
    # e_ij = vᵀ tanh(W1 q_i + W2 k_j): the projections were applied by the score function, so here the
    # (B, H, c, K, A) tanh tensor exists for one query chunk only. fp16 is scored in fp32 (as in the eager kernel):
    # vᵀ tanh(.) reaches sum |v|, which overflows 65504 when the energies are large; bf16/fp32 keep their dtype.
    compute_dtype = torch.float32 if query_chunk.dtype == torch.float16 else query_chunk.dtype
    query_chunk, key, energy = query_chunk.to(compute_dtype), key.to(compute_dtype), energy.to(compute_dtype)
    scores = additive_scores(query_chunk, key, energy, mask_chunk).float()  # (B, H, c, K)
    # the chunk's bias rows are made here, inside the checkpoint: recomputed in the backward, not kept
    scores = _add_bias_and_mask(scores, mask_chunk, bias_rows(position_bias, rows, key.shape[2]))
    return _softmax_dropout_values(module, scores, value, dropout)


def _native_chunk(module, query_chunk, key, value, energy, mask_chunk, position_bias, rows: slice, dropout: float):
    """`_additive_chunk` through `NativeAdditiveAttention` (no checkpoint: it keeps no (c, K) tensor); no dropout."""
    values = lengths = None
    if position_bias is not None:
        values, lengths = position_bias.values, (position_bias.query_length, position_bias.key_length)
    rows = (rows.start, rows.start + query_chunk.shape[2])
    return NativeAdditiveAttention.apply(
        query_chunk, key, value, energy, values, mask_chunk, lengths, rows, key.shape[2]
    )


def _native_chunks_apply(value, position_bias, dropout: float) -> bool:
    """Whether `NativeAdditiveAttention` computes the chunks in training, where the native kernel takes the queries,
    keys and energy: no attention dropout, fp32 CPU values, and no bias or a `RelativeBias` (whose gradient folds
    into its values) the kernel takes."""
    if dropout or not (position_bias is None or isinstance(position_bias, RelativeBias)):
        return False
    return native_applies(value, None if position_bias is None else position_bias.values)


def additive_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float = 1.0,
    dropout: float = 0.0,
    position_bias: RelativeBias | None = None,
    energy: torch.Tensor | None = None,
    chunk_size: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bahdanau et al. (2015) additive attention, processed in query chunks so peak memory stays bounded.

    `query` and `key` arrive already projected (`W1 q`, `W2 k`, last dim A); `energy` is the per-head vector v
    `(H, A)`. Each chunk holds a `(B, H, chunk, K, A)` tanh tensor of at most `ADDITIVE_CHUNK_BYTES`; in training
    each chunk is checkpointed so the backward recomputes it instead of storing every chunk's activations. A causal
    chunk scores only the keys up to its last query (`causal_keys`): about half the work of a causal sequence.
    `scaling` is ignored: the score has no dot product to scale.
    """
    key = repeat_kv(key, module.num_key_value_groups)  # (B, H, K, A)
    value = repeat_kv(value, module.num_key_value_groups)  # (B, H, K, D)
    batch, heads, q_len, attn_dim = query.shape
    key_length = key.shape[2]
    symbolic = symbolic_sizes(query, key)
    recompute = module.training and torch.is_grad_enabled()
    wants_weights = _wants_weights(module, kwargs)
    native = not symbolic and native_applies(query, key, energy)
    fused = native and recompute and not wants_weights and _native_chunks_apply(value, position_bias, dropout)
    if native:  # one copy of the keys and values: the chunks read theirs in place (`key_rows`)
        key, value = key.contiguous(), value.contiguous()
    if chunk_size is None and native:  # no (c, K, A) tensor: the chunk's (B, H, c, K) scores are what it holds
        chunk_size = max(1, NATIVE_CHUNK_BYTES // (batch * heads * key_length * 4))
    elif symbolic:  # traced with dynamic shapes: one chunk of every query over every key (see `symbolic_sizes`)
        chunk_size = q_len
    elif chunk_size is None:
        element_size = 4 if query.dtype == torch.float16 else query.element_size()  # fp16 is scored in fp32
        per_query = batch * heads * key_length * attn_dim * element_size
        chunk_size = max(1, ADDITIVE_CHUNK_BYTES // per_query)
    # the mask holds the causal pattern within a chunk; the keys dropped after it are blocked for every row
    causal = not symbolic and attention_mask is not None and q_len > 1
    causal = causal and kwargs.get("is_causal", getattr(module, "is_causal", False))
    causal = causal and mask_blocks_the_future(attention_mask, q_len, key_length)
    outputs, weights = [], []
    # `split`'s backward joins the chunks' query gradients in one `cat` (a slice's writes each into a zero tensor)
    starts, query_chunks = (
        (range(0, q_len, chunk_size), query.split(chunk_size, dim=2)) if not symbolic else ((0,), (query,))
    )
    for start, query_chunk in zip(starts, query_chunks, strict=True):
        rows = slice(start, start + chunk_size)
        keys = causal_keys(q_len, key_length, rows.stop) if causal else key_length
        mask_chunk = None if attention_mask is None else attention_mask[:, :, rows, :keys]
        args = (
            module,
            query_chunk,
            key[:, :, :keys],
            value[:, :, :keys],
            energy,
            mask_chunk,
            position_bias,
            rows,
            dropout,
        )
        chunk = _additive_chunk_weights if wants_weights else _native_chunk if fused else _additive_chunk
        result = checkpoint(chunk, *args, use_reentrant=False) if recompute and not fused else chunk(*args)
        if wants_weights:
            weights.append(nn.functional.pad(result[1], (0, key_length - keys)))  # (B, H, c, K): the future weighs 0
        else:
            outputs.append(result)
    if wants_weights:
        # The output is computed from the very weights returned, so they stay in the autograd graph (as eager's do:
        # transformers' tests take their gradient); the (B, H, Q, K) weights are materialised anyway.
        attn_weights = torch.cat(weights, dim=2)  # (B, H, Q, K)
        output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()  # (B, Q, H, D)
        return output, attn_weights
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None  # (B, Q, H, D)
