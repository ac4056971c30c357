/* Causal attention with a bias per distance over each query's W latest keys (j = i - W + 1 .. i), in tiles of ROWS
 * queries over their keys, every product a register-blocked loop over (rows x 16 columns) vector accumulators (what a
 * GEMM's micro-kernel does: the torch path's small matmuls per block spend more time on dispatch and memory than on
 * arithmetic). Callers: `kernels_relative_native` (W = N, every key up to the query: whole attention, forward and
 * backward) and `kernels_banded` (its forward with W = N; the backward of its near band, a bias constant beyond W,
 * whose far keys' gradients come from torch's fused kernel).
 *
 *   forward (the band's own softmax):  out_i = sum_j p_ij v_j / l_i,  lse_i = m_i + log l_i
 *   backward, from the merged softmax's lse (the far keys' gradients already in gq_far, gk, gv):
 *     P_ij = exp(s q_i.k_j + bias[h][i - j] - lse_i),  dS_ij = P_ij (dO_i.v_j - dO_i.O_i)
 *     gq_i = gq_far_i + s sum_j dS_ij k_j,  gk_j += s sum_i dS_ij q_i,  gv_j += sum_i P_ij dO_i,
 *     gbias[b][t] = sum_i dS_i,i-t
 *
 * Tensors are float32 (batch, heads, rows, dim) with rows of dim contiguous (a multiple of 16) and any strides
 * between batches, heads and rows; the work is split over POSIX threads by (batch, head), whose rows of gk, gv and
 * gbias one thread owns. Built by `plugformer.native` at first use.
 */
#include "tiles.h" /* gemm, exp_weight, the tile copies; FMA contraction on */

/* the backward's: GROUP tiles sweep their keys together, KEYS (a multiple of 16) at a time, so that a chunk's rows of
 * dK and dV, which every tile's products add to, stay in L1. A band as wide as the sequence, B=2, H=6, D=64, fp32,
 * 1 thread, against torch's causal flash backward: 16 x 64 0.98-1.02x of its time at N = 2048, 1.07-1.10x at 4096;
 * 8 x 256 1.03-1.04x, 1.18-1.23x */
#define GROUP 16
#define KEYS 64
/* the forward's: FORWARD_GROUP tiles over FORWARD_KEYS keys at a time. B=2, H=6, D=64, fp32, 1 thread, a band as
 * wide as the sequence, against torch's causal flash forward: 16 x 1024 0.94x of its time at N = 2048, 1.05x at
 * 4096; 8 x 256 1.12x, 1.12x (K^T and V stream from memory at 4096 without the chunks: 1.4x) */
#define FORWARD_GROUP 16
#define FORWARD_KEYS 1024

/* the (batch, heads, rows, dim) tensors, rows contiguous; GQ_FAR: the far keys' dQ of the queries from slot W */
enum { Q, K, V, GRAD_OUT, OUT, GQ_FAR, GQ, GK, GV, TENSORS };

typedef struct {
    float *tensors[TENSORS];
    const int64_t *strides; /* per tensor: between batches, heads, rows */
    const float *lse, *bias;
    float *gbias, *lse_out;
    int64_t heads, length, dim, width, first, last;
    float scaling;
} Work;

#include "parallel.h" /* parallel(): the split over threads, for this Work */

/* the rows of tensor `t` for (batch, head) pair b, and the stride between them */
static float *rows_of(const Work *w, int t, int64_t b, int64_t *row_stride) {
    const int64_t *s = w->strides + 3 * t;
    *row_stride = s[2];
    return w->tensors[t] + (b / w->heads) * s[0] + (b % w->heads) * s[1];
}

/* ext[u] = the bias `top` - u slots behind the query, -inf outside 0 .. width - 1 (the band's mask), for u < extent:
 * a row's bias over consecutive keys is then a contiguous run of it */
static void bias_runs(float *ext, int64_t extent, int64_t top, const float *bias, int64_t width) {
    for (int64_t u = 0; u < extent; u++) {
        const int64_t behind = top - u;
        ext[u] = behind >= 0 && behind < width ? bias[behind] : -INFINITY;
    }
}

/* the keys of chunk [c0, c1) in the band of the tile of `rows` queries from `start`: [*a, *e) (empty where *a >= *e),
 * *a on a multiple of 16 (the keys before the band that this adds are masked by their bias) */
static inline void tile_keys(int64_t start, int64_t rows, int64_t width, int64_t c0, int64_t c1, int64_t *a,
                             int64_t *e) {
    const int64_t first = start - width + 1 > 0 ? (start - width + 1) / 16 * 16 : 0;
    *a = first > c0 ? first : c0;
    *e = start + rows < c1 ? start + rows : c1;
}

/* the first key of a group of queries from g0 in the band, on a multiple of 16 */
static inline int64_t band_start(int64_t g0, int64_t width) {
    return g0 - width + 1 > 0 ? (g0 - width + 1) / 16 * 16 : 0;
}

/* the backward, one (batch, head) pair at a time: the queries in groups of GROUP tiles that sweep their keys together
 * in chunks of KEYS, so that a chunk's columns of K^T and V^T and rows of K, dK and dV stay in cache over the group
 * (a band as wide as the sequence sweeps every earlier key) */
static void band_backward_range(const Work *w) {
    const int64_t n = w->length, dim = w->dim, width = w->width, padded = blocked_columns(n);
    const int64_t group = GROUP * ROWS;
    /* the bias by distance read as contiguous runs: entry u holds the value `top` - u slots behind (-inf outside the
     * band: the mask), so row i's columns c from key a read entries top - (i - a) + c, and their dS sums go to the
     * same entries of `gext`; i - a lies in -15 .. W + 30 (a: the chunk's first key, on a multiple of 16) */
    const int64_t top = ROWS + width + 16, extent = top + KEYS + 32;
    float *kt = malloc(sizeof(float) * dim * padded), *vt = malloc(sizeof(float) * dim * padded);
    float *p = malloc(sizeof(float) * ROWS * KEYS), *ds = malloc(sizeof(float) * ROWS * KEYS);
    float *qs = malloc(sizeof(float) * group * dim), *go = malloc(sizeof(float) * group * dim);
    float *gq = malloc(sizeof(float) * group * dim), *delta = malloc(sizeof(float) * group);
    /* the keys' rows, and the band's dK and dV, contiguous: the strided rows of a (batch, rows, heads, dim) layout
     * cost more in the tile loops than one pass to copy or add them */
    float *kc = malloc(sizeof(float) * n * dim), *gkc = malloc(sizeof(float) * n * dim);
    float *gvc = malloc(sizeof(float) * n * dim);
    float *ext = malloc(sizeof(float) * extent), *gext = malloc(sizeof(float) * extent);
    if (!kt || !vt || !p || !ds || !qs || !go || !gq || !delta || !kc || !gkc || !gvc || !ext || !gext) abort();
    for (int64_t b = w->first; b < w->last; b++) {
        int64_t sq, sk, sv, sg, so, sf, sgq, sgk, sgv;
        const float *q = rows_of(w, Q, b, &sq), *k = rows_of(w, K, b, &sk), *v = rows_of(w, V, b, &sv);
        const float *dout = rows_of(w, GRAD_OUT, b, &sg), *out = rows_of(w, OUT, b, &so), *lse = w->lse + b * n;
        const float *far = rows_of(w, GQ_FAR, b, &sf), *bias = w->bias + (b % w->heads) * width;
        float *gq_rows = rows_of(w, GQ, b, &sgq), *gk = rows_of(w, GK, b, &sgk), *gv = rows_of(w, GV, b, &sgv);
        float *gbias = w->gbias + b * width;
        bias_runs(ext, extent, top, bias, width);
        memset(gext, 0, sizeof(float) * extent);
        transpose(k, sk, kt, kc, n, dim);
        transpose(v, sv, vt, NULL, n, dim);
        memset(gkc, 0, sizeof(float) * n * dim);
        memset(gvc, 0, sizeof(float) * n * dim);
        for (int64_t g0 = 0; g0 < n; g0 += group) {
            const int64_t group_rows = g0 + group <= n ? group : n - g0;
            for (int64_t t = 0; t * ROWS < group_rows; t++) {
                const int64_t rows = group_rows - t * ROWS < ROWS ? group_rows - t * ROWS : ROWS;
                gather(q + (g0 + t * ROWS) * sq, sq, qs + t * ROWS * dim, rows, dim);
                gather(dout + (g0 + t * ROWS) * sg, sg, go + t * ROWS * dim, rows, dim);
            }
            for (int64_t r = 0; r < group_rows; r++) {
                const int64_t i = g0 + r;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t d = 0; d < dim; d++) sum += go[r * dim + d] * out[i * so + d];
                delta[r] = sum; /* dO_i . O_i */
                /* dQ starts from the far keys' (none before slot W) */
                if (i >= width) memcpy(gq + r * dim, far + (i - width) * sf, sizeof(float) * dim);
                else memset(gq + r * dim, 0, sizeof(float) * dim);
            }
            const int64_t end = g0 + group_rows;
            for (int64_t c0 = band_start(g0, width); c0 < end; c0 += KEYS) {
                const int64_t c1 = c0 + KEYS < end ? c0 + KEYS : end;
                for (int64_t t = 0; t * ROWS < group_rows; t++) {
                    const int64_t start = g0 + t * ROWS, rows = n - start < ROWS ? n - start : ROWS;
                    int64_t a, e;
                    tile_keys(start, rows, width, c0, c1, &a, &e);
                    if (a >= e) continue;
                    const int64_t keys = e - a, columns = (keys + 15) / 16 * 16;
                    float *qt = qs + t * ROWS * dim, *got = go + t * ROWS * dim, *gqt = gq + t * ROWS * dim;
                    gemm_blocked(rows, columns, dim, qt, dim, 1, kt, a, p, columns);   /* q.k */
                    gemm_blocked(rows, columns, dim, got, dim, 1, vt, a, ds, columns); /* dO.v */
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t i = start + r;
                        float *pr = p + r * columns, *dr = ds + r * columns;
                        const float row_lse = lse[i], row_delta = delta[i - g0], scaling = w->scaling;
                        const float *bias_row = ext + top - (i - a); /* column c: i - a - c behind */
                        float *grad_row = gext + top - (i - a);
#pragma omp simd
                        for (int64_t c = 0; c < columns; c++) {
                            /* 0 off the band and in the future (their bias is -inf) */
                            const float weight = exp_weight(scaling * pr[c] + bias_row[c] - row_lse);
                            const float score_grad = weight * (dr[c] - row_delta);
                            pr[c] = weight;
                            grad_row[c] += score_grad;
                            dr[c] = scaling * score_grad; /* what dQ and dK take */
                        }
                    }
                    gemm(keys, dim, rows, p, 1, columns, got, dim, gvc + a * dim, dim, 1); /* dV += P^T dO */
                    gemm(keys, dim, rows, ds, 1, columns, qt, dim, gkc + a * dim, dim, 1); /* dK += s dS^T Q */
                    gemm(rows, dim, keys, ds, columns, 1, kc + a * dim, dim, gqt, dim, 1); /* dQ += s dS K */
                }
            }
            for (int64_t r = 0; r < group_rows; r++)
                memcpy(gq_rows + (g0 + r) * sgq, gq + r * dim, sizeof(float) * dim);
        }
        add_rows(gk, sgk, gkc, n, dim);
        add_rows(gv, sgv, gvc, n, dim);
        for (int64_t t = 0; t < width; t++) gbias[t] = gext[top - t];
    }
    free(kt), free(vt), free(p), free(ds), free(qs), free(go), free(gq), free(delta);
    free(kc), free(gkc), free(gvc), free(ext), free(gext);
}

/* the band's own softmax, out_i = sum_j p_ij v_j / l_i and lse_i = m_i + log l_i over the band's keys, online as
 * FlashAttention's forward: the queries in groups of FORWARD_GROUP tiles that sweep their keys in chunks of
 * FORWARD_KEYS (so a chunk's columns of K^T and rows of V stay in cache over the group: a band as wide as the sequence
 * would otherwise stream K and V from memory for every tile), each row's running maximum m_i and sum l_i rescaling its
 * output on the way */
static void band_forward_range(const Work *w) {
    const int64_t n = w->length, dim = w->dim, width = w->width, padded = blocked_columns(n);
    const int64_t group = FORWARD_GROUP * ROWS;
    /* the bias read as contiguous runs, as in the backward: i - a lies in -15 .. W + 30 */
    const int64_t top = ROWS + width + 16, extent = top + FORWARD_KEYS + 32;
    float *kt = malloc(sizeof(float) * dim * padded), *p = malloc(sizeof(float) * ROWS * FORWARD_KEYS);
    float *qs = malloc(sizeof(float) * group * dim), *acc = malloc(sizeof(float) * group * dim);
    float *high = malloc(sizeof(float) * group), *total = malloc(sizeof(float) * group);
    float *ext = malloc(sizeof(float) * extent);
    if (!kt || !p || !qs || !acc || !high || !total || !ext) abort();
    for (int64_t b = w->first; b < w->last; b++) {
        int64_t sq, sk, sv, so;
        const float *q = rows_of(w, Q, b, &sq), *k = rows_of(w, K, b, &sk), *v = rows_of(w, V, b, &sv);
        const float *bias = w->bias + (b % w->heads) * width;
        float *out = rows_of(w, OUT, b, &so), *lse = w->lse_out + b * n;
        bias_runs(ext, extent, top, bias, width);
        transpose(k, sk, kt, NULL, n, dim);
        for (int64_t g0 = 0; g0 < n; g0 += group) {
            const int64_t group_rows = g0 + group <= n ? group : n - g0;
            for (int64_t t = 0; t * ROWS < group_rows; t++) {
                const int64_t rows = group_rows - t * ROWS < ROWS ? group_rows - t * ROWS : ROWS;
                gather(q + (g0 + t * ROWS) * sq, sq, qs + t * ROWS * dim, rows, dim);
            }
            memset(acc, 0, sizeof(float) * group_rows * dim);
            for (int64_t r = 0; r < group_rows; r++) high[r] = -INFINITY, total[r] = 0.0f;
            const int64_t end = g0 + group_rows;
            for (int64_t c0 = band_start(g0, width); c0 < end; c0 += FORWARD_KEYS) {
                const int64_t c1 = c0 + FORWARD_KEYS < end ? c0 + FORWARD_KEYS : end;
                for (int64_t t = 0; t * ROWS < group_rows; t++) {
                    const int64_t start = g0 + t * ROWS, rows = n - start < ROWS ? n - start : ROWS;
                    int64_t a, e;
                    tile_keys(start, rows, width, c0, c1, &a, &e);
                    if (a >= e) continue;
                    /* columns past `keys` are later keys: in the future of every row, so masked */
                    const int64_t keys = e - a, columns = (keys + 15) / 16 * 16;
                    float *acct = acc + t * ROWS * dim;
                    gemm_blocked(rows, columns, dim, qs + t * ROWS * dim, dim, 1, kt, a, p, columns); /* q.k */
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t i = start + r, row = t * ROWS + r;
                        float *pr = p + r * columns, chunk_high = -INFINITY, sum = 0.0f;
                        const float *bias_row = ext + top - (i - a), scaling = w->scaling; /* column c: i - a - c */
#pragma omp simd reduction(max : chunk_high)
                        for (int64_t c = 0; c < columns; c++) {
                            pr[c] = scaling * pr[c] + bias_row[c];
                            chunk_high = pr[c] > chunk_high ? pr[c] : chunk_high;
                        }
                        if (chunk_high == -INFINITY) { /* no key of this chunk in the row's band */
                            memset(pr, 0, sizeof(float) * columns);
                            continue;
                        }
                        const float was = high[row], now = chunk_high > was ? chunk_high : was;
#pragma omp simd reduction(+ : sum)
                        for (int64_t c = 0; c < columns; c++) {
                            pr[c] = exp_weight(pr[c] - now); /* 0 off the band */
                            sum += pr[c];
                        }
                        if (now > was) { /* the row's earlier keys weigh e^(was - now) of what they did */
                            const float rescale = expf(was - now); /* 0 before the row's first key */
                            total[row] *= rescale;
                            for (int64_t d = 0; d < dim; d++) acct[r * dim + d] *= rescale;
                            high[row] = now;
                        }
                        total[row] += sum;
                    }
                    gemm(rows, dim, keys, p, columns, 1, v + a * sv, sv, acct, dim, 1); /* acc += P V */
                }
            }
            for (int64_t r = 0; r < group_rows; r++) {
                const float inverse = 1.0f / total[r];
                float *row_out = out + (g0 + r) * so;
                for (int64_t d = 0; d < dim; d++) row_out[d] = acc[r * dim + d] * inverse;
                lse[g0 + r] = high[r] + logf(total[r]);
            }
        }
    }
    free(kt), free(p), free(qs), free(acc), free(high), free(total), free(ext);
}

static void *run_band_backward(void *w) { band_backward_range((const Work *)w); return NULL; }
static void *run_band_forward(void *w) { band_forward_range((const Work *)w); return NULL; }

/* tensors: q, k, v, grad_out, out, gq_far (the far keys' dQ of queries W..N-1), gq (written), gk, gv (the far
 * keys' gradients, added to): (batch, heads, rows, dim), rows contiguous, `strides` (9 x 3: between batches, heads
 * and rows); lse: (batch * heads, length), the merged softmax's, contiguous; bias: (heads, width), bias[h][t] the
 * value t slots behind the query; gbias: (batch * heads, width), written. dim a multiple of 16. */
int plugformer_band_backward(float *const *tensors, const int64_t *strides, const float *lse, const float *bias,
                             float *gbias, int64_t batch_heads, int64_t heads, int64_t length, int64_t dim,
                             int64_t width, float scaling, int threads) {
    Work w = {.strides = strides, .lse = lse, .bias = bias, .gbias = gbias, .heads = heads, .length = length,
              .dim = dim, .width = width, .scaling = scaling};
    for (int t = 0; t < TENSORS; t++) w.tensors[t] = tensors[t];
    return parallel(w, batch_heads, threads, run_band_backward);
}

/* tensors: q, k, v (as in the backward), out (written): strides 4 x 3; bias as in the backward; lse: (batch *
 * heads, length), written. The band's output and log-sum-exp alone. */
int plugformer_band_forward(float *const *tensors, const int64_t *strides, const float *bias, float *lse,
                            int64_t batch_heads, int64_t heads, int64_t length, int64_t dim, int64_t width,
                            float scaling, int threads) {
    Work w = {.strides = strides, .bias = bias, .lse_out = lse, .heads = heads, .length = length, .dim = dim,
              .width = width, .scaling = scaling};
    w.tensors[Q] = tensors[0], w.tensors[K] = tensors[1], w.tensors[V] = tensors[2];
    /* the output's strides sit in the fourth row: read as OUT's through a copy laid out as the backward's */
    int64_t all[3 * TENSORS] = {0};
    memcpy(all, strides, sizeof(int64_t) * 9);
    memcpy(all + 3 * OUT, strides + 9, sizeof(int64_t) * 3);
    w.tensors[OUT] = tensors[3];
    w.strides = all;
    return parallel(w, batch_heads, threads, run_band_forward);
}
