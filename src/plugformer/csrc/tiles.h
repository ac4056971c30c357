/* What the tiled attention kernels share (`band.c`, `fire.c`): the 16-float vector type, register-blocked products
 * (`gemm`), the clamped exponential of a log-weight, and the copies between strided rows and contiguous tiles.
 * Included first: its pragma turns FMA contraction on for the whole source. */
#ifndef PLUGFORMER_TILES_H
#define PLUGFORMER_TILES_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast") /* a * b + c as one FMA (ISO C mode turns contraction off) */
#endif

#include "expf.h" /* after the pragma: its polynomial takes the FMAs too */

typedef float vf __attribute__((vector_size(64), aligned(4))); /* 16 floats; any alignment */

#if defined(__AVX512F__)
#define MB 4 /* rows per micro tile: 4 x 4 vector accumulators fit AVX-512's 32 registers */
#else
#define MB 2 /* AVX2 splits a 16-float vector in two registers of its 16 */
#endif
#define ROWS 16 /* queries per tile: one vector of them */

/* e^x for a log-weight x (at most a rounding above 0): 0 below -87, where fp32 underflows, -inf included */
static inline float exp_weight(float x) {
    return x < -87.0f ? 0.0f : exp_clamped(x > 80.0f ? 80.0f : x);
}

/* C (m x n) = A (m x x) B (x x n), or C += A B (`add`): A(r, t) at a[r sam + t sax], B row-major (rows ldb apart),
 * C rows ldc apart; n a multiple of 16. Micro tiles of MB rows x NV vectors: per t, NV loads of B and MB broadcasts
 * of A feed MB x NV FMAs. */
#define MICRO(R, NV)                                                                                                  \
    static inline void micro_##R##_##NV(int64_t x, const float *a, int64_t sam, int64_t sax, const float *b,        \
                                        int64_t ldb, float *c, int64_t ldc, int add) {                               \
        vf acc[R][NV];                                                                                                \
        for (int r = 0; r < R; r++)                                                                                   \
            for (int v = 0; v < NV; v++) acc[r][v] = add ? *(const vf *)(c + r * ldc + 16 * v) : (vf){0};             \
        for (int64_t t = 0; t < x; t++) {                                                                             \
            vf row[NV];                                                                                               \
            for (int v = 0; v < NV; v++) row[v] = *(const vf *)(b + t * ldb + 16 * v);                                \
            for (int r = 0; r < R; r++) {                                                                             \
                const float s = a[r * sam + t * sax];                                                                 \
                for (int v = 0; v < NV; v++) acc[r][v] += s * row[v];                                                 \
            }                                                                                                         \
        }                                                                                                             \
        for (int r = 0; r < R; r++)                                                                                   \
            for (int v = 0; v < NV; v++) *(vf *)(c + r * ldc + 16 * v) = acc[r][v];                                   \
    }
MICRO(MB, 4)
MICRO(MB, 1)
MICRO(1, 4)
MICRO(1, 1)

static void gemm(int64_t m, int64_t n, int64_t x, const float *a, int64_t sam, int64_t sax, const float *b,
                 int64_t ldb, float *c, int64_t ldc, int add) {
    int64_t r = 0;
    for (; r + MB <= m; r += MB) {
        const float *ar = a + r * sam;
        float *cr = c + r * ldc;
        int64_t col = 0;
        for (; col + 64 <= n; col += 64) micro_MB_4(x, ar, sam, sax, b + col, ldb, cr + col, ldc, add);
        for (; col < n; col += 16) micro_MB_1(x, ar, sam, sax, b + col, ldb, cr + col, ldc, add);
    }
    for (; r < m; r++) {
        const float *ar = a + r * sam;
        float *cr = c + r * ldc;
        int64_t col = 0;
        for (; col + 64 <= n; col += 64) micro_1_4(x, ar, sam, sax, b + col, ldb, cr + col, ldc, add);
        for (; col < n; col += 16) micro_1_1(x, ar, sam, sax, b + col, ldb, cr + col, ldc, add);
    }
}

/* (length x dim) rows `stride` apart -> (dim x padded) columns, zeros after `length`, and (where `rows` is not
 * NULL) contiguous rows */
static void transpose(const float *src, int64_t stride, float *dst, float *rows, int64_t length, int64_t dim,
                      int64_t padded) {
    for (int64_t d = 0; d < dim; d++) memset(dst + d * padded + length, 0, sizeof(float) * (padded - length));
    for (int64_t start = 0; start < length; start += 16) { /* 16 rows at a time: they stay in L1 over the columns */
        const int64_t count = start + 16 <= length ? 16 : length - start;
        for (int64_t d = 0; d < dim; d++)
            for (int64_t j = 0; j < count; j++) dst[d * padded + start + j] = src[(start + j) * stride + d];
    }
    if (rows)
        for (int64_t j = 0; j < length; j++) memcpy(rows + j * dim, src + j * stride, sizeof(float) * dim);
}

/* rows `stride` apart += contiguous rows */
static void add_rows(float *dst, int64_t stride, const float *src, int64_t length, int64_t dim) {
    for (int64_t j = 0; j < length; j++)
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) dst[j * stride + d] += src[j * dim + d];
}

/* `rows` rows `stride` apart -> contiguous (ROWS x dim), zeros after them */
static void gather(const float *src, int64_t stride, float *dst, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) memcpy(dst + r * dim, src + r * stride, sizeof(float) * dim);
    memset(dst + rows * dim, 0, sizeof(float) * (ROWS - rows) * dim);
}


#endif
