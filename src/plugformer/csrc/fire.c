/* Causal attention with FIRE's bias computed per score (Li et al. 2023, §3), forward and backward, in the tiles of
 * `band.c` with every key up to the query (its whole-attention case): the bias of query i on key j <= i is
 *
 *   x_ij = psi[i - j] * inv[b][i],   bias_h = slope[h][p] * x_ij + intercept[h][p],   p = piece of x_ij
 *
 * psi[d] = log1p(c d), inv[b][i] = 1 / (log1p(c max(L, pos_b(i))) + eps), and f_theta, a ReLU MLP of one input, as
 * the piecewise-linear function it is: p = the number of its sorted kinks below x (`piecewise.relu_mlp_pieces`: x
 * on a kink takes the piece on its left, as torch.searchsorted does). The callers build those tables in torch, under
 * autograd (`kernels_fire_native`); this returns their gradients, sums of dS:
 *
 *   gslope[h][p] = sum dS x,  gintercept[h][p] = sum dS,  gpsi[d] = sum_i dS slope inv[b][i],
 *   ginv[b][i] = sum_j dS slope psi[i - j]
 *
 * with P, dS, dQ, dK and dV as in `band.c`. psi grows with d and inv > 0, so along a row x only grows with the
 * distance, and its pieces are runs of consecutive keys: each row finds where each kink is crossed once (a binary
 * search per kink) and then adds slope * x + intercept over each run, vectorised, with no per-score search. The
 * gradients are written per (batch, head) pair (the caller sums them: the order, and so the result, does not depend
 * on the threads); the sums over a run are float, across runs double.
 *
 * Tensors as in `band.c`: float32 (batch, heads, rows, dim), rows of dim contiguous (a multiple of 16). Built by
 * `plugformer.native` at first use.
 */
#include "tiles.h" /* gemm, exp_weight, the tile copies; FMA contraction on */

/* band.c's tiling and its measured chunk sizes: the same products, the bias aside */
#define GROUP 16
#define KEYS 64
#define FORWARD_GROUP 16
#define FORWARD_KEYS 1024

enum { Q, K, V, GRAD_OUT, OUT, GQ, GK, GV, TENSORS };

typedef struct {
    float *tensors[TENSORS];
    const int64_t *strides; /* per tensor: between batches, heads, rows */
    const float *lse;       /* backward: (batch * heads, length), the forward's */
    float *lse_out;         /* forward: written */
    const float *psi_rev;   /* (length,): psi[length - 1 - m] at m, so a row's keys read it forwards */
    const float *inv;       /* (1 or batch, length) */
    const float *kinks;     /* (pieces - 1,), sorted, +inf for a kink never reached */
    const float *slope, *intercept; /* (heads, pieces) */
    double *gslope, *gintercept, *ginv; /* (batch * heads, pieces), twice, and (batch * heads, length): written */
    float *gpsi_rev;                    /* (batch * heads, length), reversed as psi_rev: written */
    int64_t heads, length, dim, pieces, shared, first, last; /* shared: one row of inv for the whole batch */
    float scaling;
} Work;

#include "parallel.h" /* parallel(): the split over threads, for this Work */

static float *rows_of(const Work *w, int t, int64_t b, int64_t *row_stride) {
    const int64_t *s = w->strides + 3 * t;
    *row_stride = s[2];
    return w->tensors[t] + (b / w->heads) * s[0] + (b % w->heads) * s[1];
}

/* The first distance d < n whose x = psi[d] * inv exceeds `kink` (n if none), searched outwards from `hint`, then
 * halved: x only grows with d (psi does, inv > 0), and a row's crossings lie a few distances from the previous row's
 * (inv changes slowly along the rows), so a search costs a few products where one over all n took log2(n). The
 * product is the one the score loops form, so a distance's piece is the one its x falls in. */
static int64_t crossing(const float *psi_rev, int64_t n, float inv, float kink, int64_t hint) {
#define ABOVE(d) (psi_rev[n - 1 - (d)] * inv > kink)
    if (n == 0) return 0;
    int64_t low, high, step = 1; /* the crossing lies in [low, high]; high == n or ABOVE(high) */
    hint = hint < 0 ? 0 : hint > n - 1 ? n - 1 : hint;
    if (ABOVE(hint)) { /* at or before the hint */
        high = hint;
        while (high - step >= 0 && ABOVE(high - step)) high -= step, step *= 2;
        low = high - step + 1 > 0 ? high - step + 1 : 0;
    } else { /* after it */
        low = hint;
        while (low + step < n && !ABOVE(low + step)) low += step, step *= 2;
        high = low + step < n ? low + step : n;
        low += 1;
    }
    while (low < high) {
        const int64_t mid = low + (high - low) / 2;
        if (ABOVE(mid)) high = mid;
        else low = mid + 1;
    }
    return low;
#undef ABOVE
}

/* crossed[u] = the first distance whose x exceeds kinks[u] (n if none), for `count` sorted kinks: piece p holds the
 * distances crossed[p - 1] .. crossed[p] - 1. `hints`: a nearby row's crossings, or NULL. */
static void crossings(const float *psi_rev, int64_t n, float inv, const float *kinks, int64_t count,
                      const int64_t *hints, int64_t *crossed) {
    for (int64_t u = 0; u < count; u++)
        crossed[u] = crossing(psi_rev, n, inv, kinks[u], hints ? hints[u] : u ? crossed[u - 1] : 0);
}

/* the piece of distance d: the number of crossings at or before it (a binary search: they are sorted) */
static inline int64_t piece_of(const int64_t *crossed, int64_t count, int64_t d) {
    int64_t low = 0, high = count;
    while (low < high) {
        const int64_t mid = low + (high - low) / 2;
        if (crossed[mid] <= d) low = mid + 1;
        else high = mid;
    }
    return low;
}

/* the columns [*c0, *c1] of piece p in a row whose column 0 is distance d0 and whose last key is column `last` */
static inline int piece_columns(const int64_t *crossed, int64_t p, int64_t pieces, int64_t n, int64_t d0, int64_t last,
                                int64_t *c0, int64_t *c1) {
    const int64_t low = p == 0 ? 0 : crossed[p - 1], high = p == pieces - 1 ? n : crossed[p]; /* distances */
    *c0 = d0 - high + 1 > 0 ? d0 - high + 1 : 0;
    *c1 = d0 - low < last ? d0 - low : last;
    return *c0 <= *c1;
}

/* the backward, as band.c's (groups of GROUP tiles sweep chunks of KEYS keys), each row's bias by its pieces */
static void fire_backward_range(const Work *w) {
    const int64_t n = w->length, dim = w->dim, padded = blocked_columns(n), pieces = w->pieces, group = GROUP * ROWS;
    float *kt = malloc(sizeof(float) * dim * padded), *vt = malloc(sizeof(float) * dim * padded);
    float *p = malloc(sizeof(float) * ROWS * KEYS), *ds = malloc(sizeof(float) * ROWS * KEYS);
    float *qs = malloc(sizeof(float) * group * dim), *go = malloc(sizeof(float) * group * dim);
    float *gq = malloc(sizeof(float) * group * dim), *delta = malloc(sizeof(float) * group);
    float *kc = malloc(sizeof(float) * n * dim), *gkc = malloc(sizeof(float) * n * dim);
    float *gvc = malloc(sizeof(float) * n * dim);
    int64_t *crossed = malloc(sizeof(int64_t) * group * pieces);
    if (!kt || !vt || !p || !ds || !qs || !go || !gq || !delta || !kc || !gkc || !gvc || !crossed) abort();
    for (int64_t b = w->first; b < w->last; b++) {
        int64_t sq, sk, sv, sg, so, sgq, sgk, sgv;
        const float *q = rows_of(w, Q, b, &sq), *k = rows_of(w, K, b, &sk), *v = rows_of(w, V, b, &sv);
        const float *dout = rows_of(w, GRAD_OUT, b, &sg), *out = rows_of(w, OUT, b, &so), *lse = w->lse + b * n;
        float *gq_rows = rows_of(w, GQ, b, &sgq), *gk = rows_of(w, GK, b, &sgk), *gv = rows_of(w, GV, b, &sgv);
        const int64_t h = b % w->heads;
        const float *slope = w->slope + h * pieces, *intercept = w->intercept + h * pieces;
        const float *inv = w->inv + (w->shared ? 0 : b / w->heads) * n;
        double *gslope = w->gslope + b * pieces, *gintercept = w->gintercept + b * pieces, *ginv = w->ginv + b * n;
        float *gpsi_rev = w->gpsi_rev + b * n;
        memset(gslope, 0, sizeof(double) * pieces), memset(gintercept, 0, sizeof(double) * pieces);
        memset(ginv, 0, sizeof(double) * n), memset(gpsi_rev, 0, sizeof(float) * n);
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
                memset(gq + r * dim, 0, sizeof(float) * dim);
                crossings(w->psi_rev, n, inv[i], w->kinks, pieces - 1, r ? crossed + (r - 1) * pieces : NULL,
                          crossed + r * pieces);
            }
            const int64_t end = g0 + group_rows;
            for (int64_t c0 = 0; c0 < end; c0 += KEYS) {
                const int64_t c1 = c0 + KEYS < end ? c0 + KEYS : end;
                for (int64_t t = 0; t * ROWS < group_rows; t++) {
                    const int64_t start = g0 + t * ROWS, rows = n - start < ROWS ? n - start : ROWS;
                    const int64_t a = c0, e = start + rows < c1 ? start + rows : c1;
                    if (a >= e) continue;
                    const int64_t keys = e - a, columns = (keys + 15) / 16 * 16;
                    float *qt = qs + t * ROWS * dim, *got = go + t * ROWS * dim, *gqt = gq + t * ROWS * dim;
                    gemm_blocked(rows, columns, dim, qt, dim, 1, kt, a, p, columns);   /* q.k */
                    gemm_blocked(rows, columns, dim, got, dim, 1, vt, a, ds, columns); /* dO.v */
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t i = start + r, d0 = i - a; /* column c: distance d0 - c */
                        const int64_t last = d0 < columns - 1 ? d0 : columns - 1; /* later columns: the future */
                        float *pr = p + r * columns, *dr = ds + r * columns;
                        for (int64_t c = last + 1 > 0 ? last + 1 : 0; c < columns; c++) pr[c] = 0.0f, dr[c] = 0.0f;
                        if (last < 0) continue;
                        const float row_lse = lse[i], row_delta = delta[i - g0], scaling = w->scaling, row_inv = inv[i];
                        const float *psi = w->psi_rev + (n - 1 - d0);        /* psi[d0 - c] at c */
                        float *gpsi = gpsi_rev + (n - 1 - d0);
                        const int64_t *row_crossed = crossed + (i - g0) * pieces;
                        double row_ginv = 0.0;
                        /* the pieces of the row's distances d0 - last .. d0 only */
                        const int64_t low_piece = piece_of(row_crossed, pieces - 1, d0 - last);
                        const int64_t top_piece = piece_of(row_crossed, pieces - 1, d0);
                        for (int64_t piece = low_piece; piece <= top_piece; piece++) {
                            int64_t lo, hi;
                            if (!piece_columns(row_crossed, piece, pieces, n, d0, last, &lo, &hi)) continue;
                            const float sl = slope[piece], ic = intercept[piece], to_psi = sl * row_inv;
                            float sum = 0.0f, sum_x = 0.0f, sum_psi = 0.0f;
#pragma omp simd reduction(+ : sum, sum_x, sum_psi)
                            for (int64_t c = lo; c <= hi; c++) {
                                const float x = psi[c] * row_inv;
                                const float weight = exp_weight(scaling * pr[c] + (sl * x + ic) - row_lse);
                                const float score_grad = weight * (dr[c] - row_delta);
                                pr[c] = weight;
                                dr[c] = scaling * score_grad; /* what dQ and dK take */
                                sum += score_grad, sum_x += score_grad * x, sum_psi += score_grad * psi[c];
                                gpsi[c] += score_grad * to_psi;
                            }
                            gslope[piece] += sum_x, gintercept[piece] += sum;
                            row_ginv += (double)sl * sum_psi;
                        }
                        ginv[i] += row_ginv;
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
    }
    free(kt), free(vt), free(p), free(ds), free(qs), free(go), free(gq), free(delta);
    free(kc), free(gkc), free(gvc), free(crossed);
}

/* the forward, as band.c's (FlashAttention's online softmax, groups of FORWARD_GROUP tiles over chunks of
 * FORWARD_KEYS keys), each row's bias by its pieces */
static void fire_forward_range(const Work *w) {
    const int64_t n = w->length, dim = w->dim, padded = blocked_columns(n), pieces = w->pieces;
    const int64_t group = FORWARD_GROUP * ROWS;
    float *kt = malloc(sizeof(float) * dim * padded), *p = malloc(sizeof(float) * ROWS * FORWARD_KEYS);
    float *qs = malloc(sizeof(float) * group * dim), *acc = malloc(sizeof(float) * group * dim);
    float *high = malloc(sizeof(float) * group), *total = malloc(sizeof(float) * group);
    int64_t *crossed = malloc(sizeof(int64_t) * group * pieces);
    if (!kt || !p || !qs || !acc || !high || !total || !crossed) abort();
    for (int64_t b = w->first; b < w->last; b++) {
        int64_t sq, sk, sv, so;
        const float *q = rows_of(w, Q, b, &sq), *k = rows_of(w, K, b, &sk), *v = rows_of(w, V, b, &sv);
        const int64_t h = b % w->heads;
        const float *slope = w->slope + h * pieces, *intercept = w->intercept + h * pieces;
        const float *inv = w->inv + (w->shared ? 0 : b / w->heads) * n;
        float *out = rows_of(w, OUT, b, &so), *lse = w->lse_out + b * n;
        transpose(k, sk, kt, NULL, n, dim);
        for (int64_t g0 = 0; g0 < n; g0 += group) {
            const int64_t group_rows = g0 + group <= n ? group : n - g0;
            for (int64_t t = 0; t * ROWS < group_rows; t++) {
                const int64_t rows = group_rows - t * ROWS < ROWS ? group_rows - t * ROWS : ROWS;
                gather(q + (g0 + t * ROWS) * sq, sq, qs + t * ROWS * dim, rows, dim);
            }
            memset(acc, 0, sizeof(float) * group_rows * dim);
            for (int64_t r = 0; r < group_rows; r++) {
                high[r] = -INFINITY, total[r] = 0.0f;
                crossings(w->psi_rev, n, inv[g0 + r], w->kinks, pieces - 1, r ? crossed + (r - 1) * pieces : NULL,
                          crossed + r * pieces);
            }
            const int64_t end = g0 + group_rows;
            for (int64_t c0 = 0; c0 < end; c0 += FORWARD_KEYS) {
                const int64_t c1 = c0 + FORWARD_KEYS < end ? c0 + FORWARD_KEYS : end;
                for (int64_t t = 0; t * ROWS < group_rows; t++) {
                    const int64_t start = g0 + t * ROWS, rows = n - start < ROWS ? n - start : ROWS;
                    const int64_t a = c0, e = start + rows < c1 ? start + rows : c1;
                    if (a >= e) continue;
                    const int64_t keys = e - a, columns = (keys + 15) / 16 * 16;
                    float *acct = acc + t * ROWS * dim;
                    gemm_blocked(rows, columns, dim, qs + t * ROWS * dim, dim, 1, kt, a, p, columns); /* q.k */
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t i = start + r, row = t * ROWS + r, d0 = i - a; /* column c: distance d0 - c */
                        const int64_t last = d0 < columns - 1 ? d0 : columns - 1; /* later columns: the future */
                        float *pr = p + r * columns, chunk_high = -INFINITY, sum = 0.0f;
                        if (last < 0) { /* no key of this chunk up to the row's query */
                            memset(pr, 0, sizeof(float) * columns);
                            continue;
                        }
                        const float scaling = w->scaling, row_inv = inv[i];
                        const float *psi = w->psi_rev + (n - 1 - d0); /* psi[d0 - c] at c */
                        const int64_t *row_crossed = crossed + row * pieces;
                        /* the pieces of the row's distances d0 - last .. d0 only */
                        const int64_t low_piece = piece_of(row_crossed, pieces - 1, d0 - last);
                        const int64_t top_piece = piece_of(row_crossed, pieces - 1, d0);
                        for (int64_t piece = low_piece; piece <= top_piece; piece++) {
                            int64_t lo, hi;
                            if (!piece_columns(row_crossed, piece, pieces, n, d0, last, &lo, &hi)) continue;
                            const float sl = slope[piece], ic = intercept[piece];
#pragma omp simd reduction(max : chunk_high)
                            for (int64_t c = lo; c <= hi; c++) {
                                pr[c] = scaling * pr[c] + (sl * (psi[c] * row_inv) + ic);
                                chunk_high = pr[c] > chunk_high ? pr[c] : chunk_high;
                            }
                        }
                        const float was = high[row], now = chunk_high > was ? chunk_high : was;
#pragma omp simd reduction(+ : sum)
                        for (int64_t c = 0; c <= last; c++) {
                            pr[c] = exp_weight(pr[c] - now);
                            sum += pr[c];
                        }
                        for (int64_t c = last + 1; c < columns; c++) pr[c] = 0.0f; /* the future: weight 0 */
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
    free(kt), free(p), free(qs), free(acc), free(high), free(total), free(crossed);
}

static void *run_fire_backward(void *w) { fire_backward_range((const Work *)w); return NULL; }
static void *run_fire_forward(void *w) { fire_forward_range((const Work *)w); return NULL; }

/* The tables of both calls: psi_rev (length,), inv ((shared ? 1 : batch) x length), kinks (pieces - 1,), slope and
 * intercept (heads x pieces), all float32 and contiguous (see the Work fields). */
#define TABLES const float *psi_rev, const float *inv, const float *kinks, const float *slope, const float *intercept
#define TABLE_FIELDS .psi_rev = psi_rev, .inv = inv, .kinks = kinks, .slope = slope, .intercept = intercept

/* tensors: q, k, v, out (written): (batch, heads, rows, dim), rows contiguous, `strides` (4 x 3: between batches,
 * heads and rows); lse: (batch * heads, length), written. */
int plugformer_fire_forward(float *const *tensors, const int64_t *strides, TABLES, float *lse, int64_t batch_heads,
                            int64_t heads, int64_t length, int64_t dim, int64_t pieces, int64_t shared, float scaling,
                            int threads) {
    Work w = {TABLE_FIELDS, .lse_out = lse, .heads = heads, .length = length, .dim = dim, .pieces = pieces,
              .shared = shared, .scaling = scaling};
    /* the output's strides sit in the fourth row: read as OUT's through a copy laid out as the backward's */
    int64_t all[3 * TENSORS] = {0};
    memcpy(all, strides, sizeof(int64_t) * 9);
    memcpy(all + 3 * OUT, strides + 9, sizeof(int64_t) * 3);
    w.tensors[Q] = tensors[0], w.tensors[K] = tensors[1], w.tensors[V] = tensors[2], w.tensors[OUT] = tensors[3];
    w.strides = all;
    return parallel(w, batch_heads, threads, run_fire_forward);
}

/* tensors: q, k, v, grad_out, out, gq (written), gk, gv (added to): (batch, heads, rows, dim), rows contiguous,
 * `strides` (8 x 3); lse: the forward's; the gradients per (batch, head) pair, written: gslope and gintercept
 * (batch * heads x pieces, double), ginv (batch * heads x length, double), gpsi_rev (batch * heads x length, float,
 * reversed as psi_rev). */
int plugformer_fire_backward(float *const *tensors, const int64_t *strides, const float *lse, TABLES, double *gslope,
                             double *gintercept, double *ginv, float *gpsi_rev, int64_t batch_heads, int64_t heads,
                             int64_t length, int64_t dim, int64_t pieces, int64_t shared, float scaling, int threads) {
    Work w = {TABLE_FIELDS, .strides = strides, .lse = lse, .gslope = gslope, .gintercept = gintercept, .ginv = ginv,
              .gpsi_rev = gpsi_rev, .heads = heads, .length = length, .dim = dim, .pieces = pieces, .shared = shared,
              .scaling = scaling};
    for (int t = 0; t < TENSORS; t++) w.tensors[t] = tensors[t];
    return parallel(w, batch_heads, threads, run_fire_backward);
}
