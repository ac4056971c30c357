/* What the tiled attention kernels share (`band.c`, `fire.c`): the vector type, register-blocked products
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

/* The vector type of the products: one register. GCC lowers a vector wider than the CPU's through the stack (16-float
 * products on AVX2 ran at 3 GFLOP/s where 8-float ones reach 52 on a Zen 2 core, 60-78 in micro tiles of 6 rows), so
 * LANES follows the widest vectors the compiler targets; a micro tile keeps MB rows x WIDE columns of sums in
 * registers. */
#if defined(__AVX512F__)
#define LANES 16
#define MB 4
#define WIDE 64 /* 4 x 4 vectors of AVX-512's 32 registers */
#elif defined(__AVX__)
#define LANES 8
#define MB 6
#define WIDE 16 /* 6 x 2 vectors of AVX's 16: enough independent sums to hide the FMA latency */
#else
#define LANES 4 /* SSE, NEON */
#define MB 2
#define WIDE 16 /* 2 x 4 vectors of SSE's 16 (NEON has 32) */
#endif
typedef float vf __attribute__((vector_size(4 * LANES), aligned(4))); /* any alignment */
#define ROWS 16 /* queries per tile; a tile's columns come in multiples of 16, whole vectors on every width */

/* e^x for a log-weight x (at most a rounding above 0): 0 below -87, where fp32 underflows, -inf included. Both
 * sides are computed and one picked (a select, which vectorises), the exponential's input clamped either way. */
static inline float exp_weight(float x) {
    const float clamped = x < -87.0f ? -87.0f : x > 80.0f ? 80.0f : x;
    const float weight = exp_clamped(clamped);
    return x < -87.0f ? 0.0f : weight;
}

/* C (m x n) = A (m x x) B (x x n), or C += A B (`add`): A(r, t) at a[r sam + t sax], B row-major (rows ldb apart),
 * C rows ldc apart; n a multiple of 16. Micro tiles of R rows x NV vectors: per t, NV loads of B and R broadcasts
 * of A feed R x NV FMAs. */
#define MICRO(NAME, R, NV)                                                                                            \
    static inline void NAME(int64_t x, const float *a, int64_t sam, int64_t sax, const float *b, int64_t ldb,        \
                            float *c, int64_t ldc, int add) {                                                         \
        vf acc[R][NV];                                                                                                \
        for (int r = 0; r < R; r++)                                                                                   \
            for (int v = 0; v < NV; v++) acc[r][v] = add ? *(const vf *)(c + r * ldc + LANES * v) : (vf){0};          \
        for (int64_t t = 0; t < x; t++) {                                                                             \
            vf row[NV];                                                                                               \
            for (int v = 0; v < NV; v++) row[v] = *(const vf *)(b + t * ldb + LANES * v);                             \
            for (int r = 0; r < R; r++) {                                                                             \
                const float s = a[r * sam + t * sax];                                                                 \
                for (int v = 0; v < NV; v++) acc[r][v] += s * row[v];                                                 \
            }                                                                                                         \
        }                                                                                                             \
        for (int r = 0; r < R; r++)                                                                                   \
            for (int v = 0; v < NV; v++) *(vf *)(c + r * ldc + LANES * v) = acc[r][v];                                \
    }
MICRO(micro_rows_wide, MB, WIDE / LANES)
MICRO(micro_rows_16, MB, 16 / LANES)
MICRO(micro_four_16, 4, 16 / LANES) /* the rows after the last MB, 4 at a time (a tile's 16 rows: 6 + 6 + 4 on AVX) */
MICRO(micro_row_wide, 1, WIDE / LANES)
MICRO(micro_row_16, 1, 16 / LANES)

static void gemm(int64_t m, int64_t n, int64_t x, const float *a, int64_t sam, int64_t sax, const float *b,
                 int64_t ldb, float *c, int64_t ldc, int add) {
    int64_t r = 0;
    for (; r + MB <= m; r += MB) {
        const float *ar = a + r * sam;
        float *cr = c + r * ldc;
        int64_t col = 0;
        for (; col + WIDE <= n; col += WIDE) micro_rows_wide(x, ar, sam, sax, b + col, ldb, cr + col, ldc, add);
        for (; col < n; col += 16) micro_rows_16(x, ar, sam, sax, b + col, ldb, cr + col, ldc, add);
    }
    for (; MB > 4 && r + 4 <= m; r += 4)
        for (int64_t col = 0; col < n; col += 16)
            micro_four_16(x, a + r * sam, sam, sax, b + col, ldb, c + r * ldc + col, ldc, add);
    for (; r < m; r++) {
        const float *ar = a + r * sam;
        float *cr = c + r * ldc;
        int64_t col = 0;
        for (; col + WIDE <= n; col += WIDE) micro_row_wide(x, ar, sam, sax, b + col, ldb, cr + col, ldc, add);
        for (; col < n; col += 16) micro_row_16(x, ar, sam, sax, b + col, ldb, cr + col, ldc, add);
    }
}

/* K^T and V^T as the products read them: in blocks of BLOCK keys (a multiple of WIDE on every target), each block dim
 * rows of BLOCK contiguous floats, so that a chunk of keys is one contiguous run. A row-major (dim x length) copy put
 * each of a chunk's dim rows on its own 4 KB page (rows length floats apart), where the prefetchers stop, and the
 * products waited on those loads at long sequences (model_cards/BENCHMARKS.md, "Design measurements"). */
#define BLOCK 64
static inline int64_t blocked_columns(int64_t length) { return (length + BLOCK - 1) / BLOCK * BLOCK; }

/* where column `column` (a multiple of 16) of a blocked copy with `dim` rows starts: BLOCK floats between its rows */
static inline int64_t block_column(int64_t column, int64_t dim) {
    return column / BLOCK * dim * BLOCK + column % BLOCK;
}

/* (length x dim) rows `stride` apart -> the blocked (dim x blocked_columns(length)) copy, zeros after `length`, and
 * (where `rows` is not NULL) contiguous rows */
static void transpose(const float *src, int64_t stride, float *dst, float *rows, int64_t length, int64_t dim) {
    const int64_t tail = length / BLOCK * BLOCK; /* the last block, zeroed first where `length` ends inside it */
    if (tail < blocked_columns(length)) memset(dst + tail * dim, 0, sizeof(float) * dim * BLOCK);
    for (int64_t start = 0; start < length; start += 16) { /* 16 rows at a time: they stay in L1 over the columns */
        const int64_t count = start + 16 <= length ? 16 : length - start;
        float *block = dst + block_column(start, dim);
        for (int64_t d = 0; d < dim; d++)
            for (int64_t j = 0; j < count; j++) block[d * BLOCK + j] = src[(start + j) * stride + d];
    }
    if (rows)
        for (int64_t j = 0; j < length; j++) memcpy(rows + j * dim, src + j * stride, sizeof(float) * dim);
}

/* C (m x n) = A (m x x) B, B the columns column .. column + n - 1 of a blocked copy with x rows (n and column
 * multiples of 16): one product per block the columns cross */
static void gemm_blocked(int64_t m, int64_t n, int64_t x, const float *a, int64_t sam, int64_t sax,
                         const float *blocked, int64_t column, float *c, int64_t ldc) {
    for (int64_t done = 0; done < n;) {
        const int64_t at = column + done, run = BLOCK - at % BLOCK < n - done ? BLOCK - at % BLOCK : n - done;
        gemm(m, run, x, a, sam, sax, blocked + block_column(at, x), BLOCK, c + done, ldc, 0);
        done += run;
    }
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
