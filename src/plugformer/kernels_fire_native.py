"""Causal attention with FIRE's bias computed inside the C kernel (`csrc/fire.c`), forward and backward: the tiles and
online softmax of `csrc/band.c`, each score's bias f_θ(ψ(i − j)·inv(b, i)) evaluated there from small tables.

A bias recipe that offers piecewise `tables` (FIRE's: `FireBias.piecewise_tables`) describes its bias as a function
of one scalar per score, x = psi[i − j]·inv_norm[b, i], piecewise linear per head (f_θ, a ReLU MLP of one input, by
`piecewise.relu_mlp_pieces`). The tables are built in torch under autograd, the C kernel takes them detached and
returns their gradients (the score gradients dS summed per piece, per distance and per query), and autograd carries
those to θ, c and L through the torch code that built the tables. No (B, H, N, N) tensor exists, forward or backward.

It takes causal training or prefill of N tokens from slot 0 with no mask and no dropout, in fp32 (queries, keys,
values, the scheme's parameters and the bias's dtype), heads a multiple of 16 wide, where the library builds
(`kernels_band_native.tiles_take`); every other call keeps `kernels_query_bias` or the blockwise kernel.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from .biases import QueryPositionBias
from .kernels import repeat_kv, sum_over_groups, symbolic_sizes
from .kernels_band_native import _rows, rows_contiguous, tiles_take
from .native import load


# what a profile (`plugformer bench`) names the C calls by
PROFILER_NAME = "plugformer::fire_native_c"


@functools.cache
def native_fire() -> ctypes.CDLL | None:
    """FIRE's attention forward and backward in C (`csrc/fire.c`, built by `native.load`), or `None` where it is not
    built."""
    library = load("fire")
    if library is not None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        library.plugformer_fire_forward.argtypes = [*[pointer] * 8, *[size] * 6, ctypes.c_float, ctypes.c_int]
        library.plugformer_fire_backward.argtypes = [*[pointer] * 12, *[size] * 6, ctypes.c_float, ctypes.c_int]
    return library


def _tables(psi, inv_norm, kinks, slope, intercept) -> list[torch.Tensor]:
    """The tables as `csrc/fire.c` reads them: psi reversed, all detached and contiguous (held by the caller while
    the C code reads them)."""
    tables = (psi.flip(0), inv_norm, kinks, slope, intercept)
    return [table.detach().contiguous() for table in tables]


class FireNativeAttention(torch.autograd.Function):
    """softmax(s · Q Kᵀ + FIRE's bias + causal mask) V, forward and backward in C (see the module docstring).

    Inputs: query `(B, H, N, D)`, key and value `(B, H_kv, N, D)` (fp32, rows of D contiguous); the tables of
    `piecewise_tables`: psi `(N,)`, inv_norm `(B or 1, N)`, kinks `(P − 1,)`, slope and intercept `(H, P)` (fp32;
    kinks get no gradient); the scaling. Returns `(B, H, N, D)`.
    """

    @staticmethod
    def forward(ctx, query, key, value, psi, inv_norm, kinks, slope, intercept, scaling: float):
        batch, heads, length, dim = query.shape
        groups = heads // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        inputs = [rows_contiguous(tensor) for tensor in (query, key_heads, value_heads)]
        output = query.new_empty(batch, heads, length, dim)  # (B, H, N, D), contiguous
        lse = query.new_empty(batch, heads, length)  # (B, H, N)
        pointers, strides = _rows([*inputs, output])
        tables = _tables(psi, inv_norm, kinks, slope, intercept)
        with torch.profiler.record_function(PROFILER_NAME):
            native_fire().plugformer_fire_forward(
                pointers,
                strides.data_ptr(),
                *(table.data_ptr() for table in tables),
                lse.data_ptr(),
                batch * heads,
                heads,
                length,
                dim,
                slope.shape[1],
                inv_norm.shape[0] == 1,
                scaling,
                torch.get_num_threads(),
            )
        ctx.save_for_backward(query, key, value, psi, inv_norm, kinks, slope, intercept, output, lse)
        ctx.scaling = scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, psi, inv_norm, kinks, slope, intercept, output, lse = ctx.saved_tensors
        batch, heads, length, dim = query.shape
        pieces, groups = slope.shape[1], heads // key.shape[1]
        key_heads, value_heads = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, N, D)
        inputs = [rows_contiguous(tensor) for tensor in (query, key_heads, value_heads, grad_output, output)]
        grad_query = torch.empty_like(inputs[0])  # the queries' layout, rows contiguous
        grad_key = torch.zeros(key_heads.shape, dtype=query.dtype)  # (B, H, N, D), added to
        grad_value = torch.zeros_like(grad_key)
        pointers, strides = _rows([*inputs, grad_query, grad_key, grad_value])
        tables = _tables(psi, inv_norm, kinks, slope, intercept)
        # per (batch, head) pair, summed here in a fixed order
        grad_slope, grad_intercept = (torch.empty(batch, heads, pieces, dtype=torch.float64) for _ in range(2))
        grad_inv = torch.empty(batch, heads, length, dtype=torch.float64)
        grad_psi = torch.empty(batch, heads, length, dtype=torch.float32)  # reversed: distance N − 1 − m at m
        with torch.profiler.record_function(PROFILER_NAME):
            native_fire().plugformer_fire_backward(
                pointers,
                strides.data_ptr(),
                lse.data_ptr(),
                *(table.data_ptr() for table in tables),
                grad_slope.data_ptr(),
                grad_intercept.data_ptr(),
                grad_inv.data_ptr(),
                grad_psi.data_ptr(),
                batch * heads,
                heads,
                length,
                dim,
                pieces,
                inv_norm.shape[0] == 1,
                ctx.scaling,
                torch.get_num_threads(),
            )
        grad_key, grad_value = sum_over_groups(grad_key, grad_value, groups)  # (B, H_kv, N, D)
        grad_inv = grad_inv.sum(1)  # (B, N)
        grad_inv = grad_inv.sum(0, keepdim=True) if inv_norm.shape[0] == 1 else grad_inv
        grads = (
            grad_psi.sum((0, 1)).flip(0),
            grad_inv.to(inv_norm.dtype),
            None,
            grad_slope.sum(0).to(slope.dtype),
            grad_intercept.sum(0).to(intercept.dtype),
        )
        return grad_query, grad_key, grad_value, *grads, None


def fire_native_applies(query, key, value, attention_mask, dropout: float, position_bias, is_causal: bool) -> bool:
    """Whether `fire_native_attention` computes this call of the sdpa kernel: a `QueryPositionBias` whose recipe
    offers piecewise `tables`, over causal self-attention of N tokens from slot 0 (Q = K) with no mask and no
    attention dropout, values as wide as the queries, outside torch.compile / export tracing; queries, keys, values,
    the recipe's parameters and its dtype fp32, on CPU, heads a multiple of 16 wide, where `csrc/fire.c` is built."""
    recipe = getattr(position_bias, "recipe", None)
    if recipe is None or getattr(recipe, "tables", None) is None:
        return False
    if torch.compiler.is_compiling() or symbolic_sizes(query, key):
        return False
    batch, _, length, _ = query.shape
    same = length == key.shape[2] == recipe.shape[2] == recipe.shape[3] and value.shape[-1] == query.shape[-1]
    if not (same and is_causal and attention_mask is None and dropout == 0.0 and recipe.shape[0] in (1, batch)):
        return False
    if int(recipe.query_slots[0]) != 0 or int(recipe.key_slots[0]) != 0:  # a cache offset: not slot 0
        return False
    if recipe.dtype != torch.float32 or any(parameter.dtype != torch.float32 for parameter in recipe.parameters):
        return False
    return tiles_take(query, key, value) and native_fire() is not None


def fire_native_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float,
    position_bias: QueryPositionBias,
    is_causal: bool,
) -> torch.Tensor:
    """`FireNativeAttention` on a call of the sdpa kernel (the `fire_native` path of `kernels_sdpa.SDPA_PATHS`): the
    tables from the recipe, under autograd; returns the output `(B, H, N, D)`."""
    recipe = position_bias.recipe
    psi, inv_norm, kinks, slope, intercept = recipe.piecewise_tables()
    return FireNativeAttention.apply(query, key, value, psi, inv_norm, kinks, slope, intercept, scaling)
