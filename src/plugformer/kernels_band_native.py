"""The relative-bias kernels' band in C (`csrc/band.c`, built by `native.load`): causal attention with a bias per
distance over each query's W latest keys, forward (the band's own softmax, FlashAttention's online softmax over chunks
of keys) and backward (dQ, dK, dV and the bias gradient by distance), in register-blocked tiles of 16 queries.

`kernels_relative_native` runs whole attention here (W = N: every key up to the query, no far part), forward and
backward; `kernels_banded` its forward the same way and its near band's backward (T5's and the clamped bias, W = the
far distance, the far keys' gradients from torch's fused backward). fp32 only, heads a multiple of 16 wide; the
callers keep their torch paths for the rest, which compute the same numbers.

The tiles compute on vectors of the compiler's widest register (`csrc/tiles.h`). They were timed at the speed of the
torch paths on x86 with AVX2 and with AVX-512 (BENCHMARKS.md); elsewhere (Arm, x86 without AVX2) they are untimed, so
the torch paths take the calls there (`tiles_run_here`); `PLUGFORMER_NATIVE_TILES=1` runs the tiles on any CPU (the
tests do), `=0` on none.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from .native import cpu_flags, load


TILES = "PLUGFORMER_NATIVE_TILES"


def tiles_run_here() -> bool:
    """Whether the C tiles take the calls they compute on this machine: `$PLUGFORMER_NATIVE_TILES` `1` or `0` where
    set, else on x86 CPUs with AVX2 or AVX-512 (`avx2`, `avx512f`), where they were timed."""
    setting = os.environ.get(TILES, "").strip().lower()
    if setting in ("1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    return not cpu_flags().isdisjoint({"avx2", "avx512f"})


# what a profile (`plugformer bench`) names this path by
PROFILER_NAME = "plugformer::band_native"


@functools.cache
def native_band() -> ctypes.CDLL | None:
    """The band's forward and backward in C (`csrc/band.c`, built by `native.load`), or `None` where it is not
    built."""
    library = load("band")
    if library is not None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        library.plugformer_band_backward.argtypes = [*[pointer] * 5, *[size] * 5, ctypes.c_float, ctypes.c_int]
        library.plugformer_band_forward.argtypes = [*[pointer] * 4, *[size] * 5, ctypes.c_float, ctypes.c_int]
    return library


def native_band_applies(*tensors: torch.Tensor) -> bool:
    """Whether `csrc/band.c` computes the band of these tensors (the query first): where `tiles_take` them and the
    library is built."""
    return tiles_take(*tensors) and native_band() is not None


def tiles_take(*tensors: torch.Tensor) -> bool:
    """Whether the C tiles (`csrc/tiles.h`: band.c's, fire.c's) compute on these tensors (the query first): fp32 on
    the CPU, plain tensors (no FakeTensor, DTensor) outside torch.compile / jit tracing, one head size for the
    `(B, H, N, D)` ones, a multiple of 16 wide, on a machine where the tiles run fast (`tiles_run_here`)."""
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or type(tensor.detach()) is not torch.Tensor:
            return False
    dim = tensors[0].shape[-1]
    if dim % 16 or any(tensor.dim() == 4 and tensor.shape[-1] != dim for tensor in tensors):
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return tiles_run_here()


def rows_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached, with rows of its last axis contiguous as the C code reads them (copied only if not)."""
    tensor = tensor.detach()
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _rows(tensors) -> tuple[ctypes.Array, torch.Tensor]:
    """`tensors` `(B, H, ·, D)` as `csrc/band.c` reads them: their addresses, and their strides between batches,
    heads and rows `(len, 3)`; each must have rows of D contiguous."""
    pointers = (ctypes.c_void_p * len(tensors))(*(tensor.data_ptr() for tensor in tensors))
    return pointers, torch.tensor([tensor.stride()[:3] for tensor in tensors], dtype=torch.int64)


def _band_table(values: torch.Tensor, width: int) -> torch.Tensor:
    """`(H, W)`: the bias t slots behind the query at [:, t] (value index N − 1 − t)."""
    length = (values.shape[-1] + 1) // 2
    return values.detach()[:, length - width : length].flip(-1).contiguous()


def native_band_forward(query, key_heads, value_heads, values, output, lse, width: int, scaling: float) -> None:
    """`_band_forward` by `csrc/band.c`: the band's own output and log-sum-exp into `output` `(B, H, N, D)` (rows
    contiguous) and `lse` `(B, H, N)` (fp32, contiguous)."""
    batch, heads, length, dim = query.shape
    inputs = [rows_contiguous(tensor) for tensor in (query, key_heads, value_heads)]
    pointers, strides = _rows([*inputs, output])
    band = _band_table(values, width)  # held: the C code reads it
    with torch.profiler.record_function(PROFILER_NAME):
        native_band().plugformer_band_forward(
            pointers,
            strides.data_ptr(),
            band.data_ptr(),
            lse.data_ptr(),
            batch * heads,
            heads,
            length,
            dim,
            width,
            scaling,
            torch.get_num_threads(),
        )


def native_band_backward(
    grad_output, query, key_heads, value_heads, output, lse, values, grads, width: int, scaling: float
) -> torch.Tensor:
    """`_band_backward` by `csrc/band.c`. `grads`: the far keys' dQ of the queries from slot W `(B, H, N − W, D)`,
    then dQ (written: the far part's plus the band's), dK and dV `(B, H, N, D)` (the band's added), all fp32 with
    rows of D contiguous (any layout of the other axes); returns the band's bias gradient `(H, W)`."""
    batch, heads, length, dim = query.shape
    if any(grad.stride(-1) != 1 for grad in grads[1:]):  # written in place: a copy would lose what is written
        raise ValueError("native_band_backward writes dQ, dK and dV in place: their rows must be contiguous")
    tensors = [rows_contiguous(tensor) for tensor in (query, key_heads, value_heads, grad_output, output, grads[0])]
    pointers, strides = _rows([*tensors, *grads[1:]])
    lse = lse.detach().contiguous()
    band = _band_table(values, width)
    grad_band = torch.empty(batch, heads, width, dtype=torch.float32)
    with torch.profiler.record_function(PROFILER_NAME):
        native_band().plugformer_band_backward(
            pointers,
            strides.data_ptr(),
            lse.data_ptr(),
            band.data_ptr(),
            grad_band.data_ptr(),
            batch * heads,
            heads,
            length,
            dim,
            width,
            scaling,
            torch.get_num_threads(),
        )
    return grad_band.sum(0)
