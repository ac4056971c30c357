"""The C tiles' products (`csrc/tiles.h`'s `gemm`, and `gemm_blocked` over a blocked K^T) at every vector width this
machine can run, against torch.

`tiles.h` picks its vector type and micro-tile shape from the compiler's target (16 floats on AVX-512, 8 on AVX, 4 on
SSE and NEON), so the kernels built on one machine exercise one of them only. Here a small driver around `gemm` is
built once per target this CPU runs, with the project's flags, and its products are compared with torch's on shapes
that reach every micro tile and its remainders (rows not a multiple of the tile's, columns 16 at a time after the wide
tiles, the transposed reads of the backward; chunks of keys that start inside a block, cross blocks, end in the zeros
after the last key).
"""

from __future__ import annotations

import ctypes
import itertools
import platform

import pytest
import torch
from c_drivers import build_driver

from plugformer import native


DRIVER = r"""
#include "tiles.h"
void product(int64_t m, int64_t n, int64_t x, const float *a, int64_t sam, int64_t sax, const float *b, int64_t ldb,
             float *c, int64_t ldc, int add) {
    gemm(m, n, x, a, sam, sax, b, ldb, c, ldc, add);
}
/* q (m x x) . keys[column .. column + n - 1]^T through the blocked copy the kernels make of the keys (length x x,
 * rows `stride` apart); `rows` gets their contiguous copy */
void scores(int64_t m, int64_t n, int64_t x, const float *q, const float *keys, int64_t stride, int64_t length,
            int64_t column, float *c, int64_t ldc, float *rows) {
    float *blocked = malloc(sizeof(float) * x * blocked_columns(length));
    transpose(keys, stride, blocked, rows, length, x);
    gemm_blocked(m, n, x, q, x, 1, blocked, column, c, ldc);
    free(blocked);
}
int lanes(void) { return LANES; }
"""
# -march value -> (the /proc/cpuinfo flag the CPU needs to run its code, None for any x86-64; the floats per vector)
TARGETS = {"x86-64": (None, 4), "x86-64-v3": ("avx2", 8), "x86-64-v4": ("avx512f", 16)}
RUNNABLE = [
    target
    for target, (needed, _) in TARGETS.items()
    if platform.machine() in ("x86_64", "AMD64") and (needed is None or needed in native.cpu_flags())
]


@pytest.fixture(scope="module", params=RUNNABLE or [None], ids=RUNNABLE or ["no-x86-target"])
def library(request, tmp_path_factory):
    if native.compiler() is None or request.param is None:
        pytest.skip("an x86 CPU and a C compiler")
    try:
        library = build_driver(tmp_path_factory.mktemp(f"tiles-{request.param}"), DRIVER, march=request.param)
    except RuntimeError as error:
        pytest.skip(f"the compiler does not build -march={request.param}: {error}")
    assert library.lanes() == TARGETS[request.param][1]  # this width's vector type and micro tiles are the ones run
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.product.argtypes = [size, size, size, pointer, size, size, pointer, size, pointer, size, ctypes.c_int]
    library.scores.argtypes = [size, size, size, pointer, pointer, size, size, size, pointer, size, pointer]
    return library


SHAPES = list(itertools.product((1, 4, 6, 7, 16, 19), (16, 48, 64, 80), (1, 16, 37)))


@pytest.mark.parametrize(("rows", "columns", "inner"), SHAPES)
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("add", [0, 1], ids=["set", "add"])
def test_the_products_equal_torchs_at_every_vector_width(library, rows, columns, inner, transposed, add):
    generator = torch.Generator().manual_seed(rows * 1000 + columns * 10 + inner)
    a = torch.randn(rows, inner, generator=generator)
    stored = a.t().contiguous() if transposed else a  # the backward reads A column-major (P^T dO)
    step_row, step_inner = (1, rows) if transposed else (inner, 1)
    b = torch.randn(inner, columns + 5, generator=generator)  # rows further apart than the columns read
    c = torch.randn(rows, columns + 3, generator=generator)
    expected = (c[:, :columns] if add else 0) + a.double() @ b[:, :columns].double()
    library.product(
        rows,
        columns,
        inner,
        stored.data_ptr(),
        step_row,
        step_inner,
        b.data_ptr(),
        b.stride(0),
        c.data_ptr(),
        c.stride(0),
        add,
    )
    torch.testing.assert_close(c[:, :columns].double(), expected, rtol=1e-5, atol=1e-5 * inner)


# (keys, first column, columns): the kernels read columns in 16s from a multiple of 16, up to 15 past the last key
CHUNKS = [
    (length, column, count)
    for length, column, count in itertools.product((5, 16, 64, 70, 150), (0, 16, 48, 64, 80, 128), (16, 32, 64, 96))
    if column + count <= (length + 15) // 16 * 16
]


@pytest.mark.parametrize(("length", "column", "count"), CHUNKS)
def test_products_over_a_blocked_copy_of_the_keys_equal_torchs(library, length, column, count):
    """`transpose` to the blocked layout and `gemm_blocked` on a chunk of its columns: q·kᵀ over those keys, the
    columns past the last key 0 (keys strided as a (batch, tokens, heads, dim) view's are), and the contiguous copy."""
    generator = torch.Generator().manual_seed(length * 1000 + column * 10 + count)
    query = torch.randn(7, 32, generator=generator)
    keys = torch.randn(length, 3, 32, generator=generator)[:, 1]  # rows 96 floats apart
    c = torch.full((7, count + 5), float("nan"))
    rows = torch.empty(length, 32)
    library.scores(
        7,
        count,
        32,
        query.data_ptr(),
        keys.data_ptr(),
        keys.stride(0),
        length,
        column,
        c.data_ptr(),
        c.stride(0),
        rows.data_ptr(),
    )
    padded = torch.cat([keys, torch.zeros(count + column, 32)])[column : column + count]
    torch.testing.assert_close(c[:, :count].double(), query.double() @ padded.double().t(), rtol=1e-5, atol=1e-5 * 32)
    assert c[:, count:].isnan().all()  # nothing written past the chunk's columns
    assert torch.equal(rows, keys)
