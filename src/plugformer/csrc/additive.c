/* Additive (Bahdanau) attention scores and their gradients, fused: the (rows, keys, A) tanh tensor that the torch
 * path materialises is formed one (query, key) pair at a time in vector registers.
 *
 *   s[b][i][j] = sum_a v[h][a] tanh(q[b][i][a] + k[b][j][a])            (b = batch * heads + h)
 *   gq[b][i][a] = sum_j ds[b][i][j] (1 - t^2),  gk[b][j][a] = sum_i ds[b][i][j] (1 - t^2)   (times v by the caller)
 *   gv[b][a] = sum_ij ds[b][i][j] t                                       (summed over the batch by the caller)
 *
 * and the whole attention backward of a query chunk (`plugformer_additive_attention_backward`), the scores
 * recomputed pair by pair, so that the forward keeps no (rows, keys) tensor: with x = s + extra (bias and mask) and
 * the forward's row maximum m and log-sum l, p = exp(x - m - l), ds = p (dO.V_j - delta_i), dV_j += p dO_i.
 *
 * All arrays are float32, contiguous but for the keys' and values' rows (see the backward's arguments). The work
 * is split over POSIX threads (no OpenMP runtime, so no second thread pool beside torch's): the forward by (b, i)
 * rows, the backwards by b, whose key, value and energy gradients one thread owns. Built by `plugformer.native`
 * at first use. Pairs that a mask blocks skip their tanh (see BLOCKED).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "expf.h"

/* tanh in float, branch-free so that the loops below vectorise it inline (a libm call per element, or per vector
 * with glibc's libmvec, costs more than the arithmetic). |x| < 0.625: x + x^3 P(x^2), P of degree 4 fitted to the
 * relative error (max 9e-9 in double); above: 1 - 2 / (e^{2|x|} + 1) (`exp_clamped`); |x| is clamped at 10, where
 * tanh rounds to +-1.
 * Within 1.3 ulp of tanh in double over 2^21 points of [-12, 12]; exact at 0, +-inf; NaN stays NaN (tests). */
static inline float tanh_float(float x) {
    const float a = fabsf(x);
    const float z = x * x;
    float p = -5.903565919041124e-3f;
    p = p * z + 2.082832347198153e-2f;
    p = p * z - 5.380187804631125e-2f;
    p = p * z + 1.3332246723389857e-1f;
    p = p * z - 3.333331426588648e-1f;
    const float small = x + x * z * p;
    const float large = copysignf(1.0f - 2.0f / (exp_clamped(2.0f * (a < 10.0f ? a : 10.0f)) + 1.0f), x);
    const float t = a < 0.625f ? small : large;
    return x != x ? x : t; /* NaN stays NaN (the clamp above turned it into 10) */
}

typedef struct {
    const float *q, *k, *energy, *value, *extra, *row_max, *row_log, *delta, *grad_out, *ds_in;
    float *scores, *gq, *gk, *genergy, *gvalue, *ds_out;
    int64_t heads, rows, keys, dim, value_dim, extra_batch, extra_head, key_stride, value_stride;
    int64_t first, last;
    int blocked_stops_gradient, add_extra;
} Work;

#include "parallel.h" /* parallel(): the split over threads, for this Work */

/* A pair whose extra (bias + mask) is at most BLOCKED is a blocked one (masks block with -FLT_MAX, the fp32
 * minimum): s + extra rounds to extra whenever |s| <= sum_a |v_a| lies below 2^102 (half an ulp of such values), so
 * its logit is extra without its tanh, and its weight exp(extra - m - l) is exactly 0 in a row that has a key above
 * BLOCKED. Skipping those pairs computes the same numbers and leaves out a causal chunk's future. */
#define BLOCKED (-0.5f * FLT_MAX)
#define SKIP_BOUND 1e30f

static float energy_norm(const float *energy, int64_t dim) {
    float sum = 0.0f;
    for (int64_t a = 0; a < dim; a++) sum += fabsf(energy[a]);
    return sum == sum ? sum : INFINITY;
}

static void scores_range(const Work *w) {
    for (int64_t row = w->first; row < w->last; row++) {
        const int64_t b = row / w->rows, i = row % w->rows;
        const float *qi = w->q + row * w->dim;
        const float *eh = w->energy + (b % w->heads) * w->dim;
        const float *kb = w->k + b * w->key_stride;
        const float *extra = w->extra ? w->extra + (b / w->heads) * w->extra_batch + (b % w->heads) * w->extra_head
                                            + i * w->keys
                                      : NULL;
        const int skips = extra != NULL && energy_norm(eh, w->dim) < SKIP_BOUND;
        float *si = w->scores + row * w->keys;
        for (int64_t j = 0; j < w->keys; j++) {
            if (skips && extra[j] <= BLOCKED) {
                si[j] = w->add_extra ? extra[j] : 0.0f; /* a blocked score's value never reaches its softmax */
                continue;
            }
            const float *kj = kb + j * w->dim;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t a = 0; a < w->dim; a++) acc += eh[a] * tanh_float(qi[a] + kj[a]);
            si[j] = extra && w->add_extra ? acc + extra[j] : acc;
        }
    }
}

/* gq_i += u, gk_j += u with u = g (1 - t^2), genergy += g t, from the pair's t = tanh(q_i + k_j) */
static inline void add_tanh_gradients(const float *t, float g, float *gqi, float *gkj, float *genergy, int64_t dim) {
#pragma omp simd
    for (int64_t a = 0; a < dim; a++) {
        const float u = g - g * t[a] * t[a];
        genergy[a] += g * t[a];
        gqi[a] += u;
        gkj[a] += u;
    }
}

static void scores_backward_range(const Work *w) {
    const int64_t dim = w->dim;
    float *t = malloc(sizeof(float) * dim);
    if (t == NULL) abort();
    for (int64_t b = w->first; b < w->last; b++) {
        memset(w->gk + b * w->keys * dim, 0, sizeof(float) * w->keys * dim);
        memset(w->genergy + b * dim, 0, sizeof(float) * dim);
        for (int64_t i = 0; i < w->rows; i++) {
            const int64_t row = b * w->rows + i;
            memset(w->gq + row * dim, 0, sizeof(float) * dim);
            for (int64_t j = 0; j < w->keys; j++) {
                const float g = w->ds_in[row * w->keys + j];
                if (g == 0.0f) continue; /* masked pairs (the future, padding) add nothing */
                const float *qi = w->q + row * dim, *kj = w->k + b * w->key_stride + j * dim;
#pragma omp simd
                for (int64_t a = 0; a < dim; a++) t[a] = tanh_float(qi[a] + kj[a]);
                add_tanh_gradients(t, g, w->gq + row * dim, w->gk + (b * w->keys + j) * dim, w->genergy + b * dim,
                                   dim);
            }
        }
    }
    free(t);
}

static void attention_backward_range(const Work *w) {
    const int64_t dim = w->dim, value_dim = w->value_dim;
    float *t = malloc(sizeof(float) * dim); /* the pair's tanh, formed for its score and kept for its gradients */
    if (t == NULL) abort();
    for (int64_t b = w->first; b < w->last; b++) {
        const float *eh = w->energy + (b % w->heads) * dim;
        const float *extra = w->extra ? w->extra + (b / w->heads) * w->extra_batch + (b % w->heads) * w->extra_head
                                      : NULL;
        memset(w->gk + b * w->keys * dim, 0, sizeof(float) * w->keys * dim);
        memset(w->gvalue + b * w->keys * value_dim, 0, sizeof(float) * w->keys * value_dim);
        memset(w->genergy + b * dim, 0, sizeof(float) * dim);
        for (int64_t i = 0; i < w->rows; i++) {
            const int64_t row = b * w->rows + i;
            const float *qi = w->q + row * dim, *doi = w->grad_out + row * value_dim;
            const float shift = w->row_max[row], log_sum = w->row_log[row], delta = w->delta[row];
            float *gqi = w->gq + row * dim;
            memset(gqi, 0, sizeof(float) * dim);
            const int skips = extra != NULL && shift > BLOCKED && energy_norm(eh, dim) < SKIP_BOUND;
            for (int64_t j = 0; j < w->keys; j++) {
                if (skips && extra[i * w->keys + j] <= BLOCKED) {
                    if (w->ds_out) w->ds_out[row * w->keys + j] = 0.0f;
                    continue;
                }
                const float *kj = w->k + b * w->key_stride + j * dim;
                const float *vj = w->value + b * w->value_stride + j * value_dim;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t a = 0; a < dim; a++) {
                    t[a] = tanh_float(qi[a] + kj[a]);
                    s += eh[a] * t[a];
                }
                const float x = extra ? s + extra[i * w->keys + j] : s;
                const float p = expf((x - shift) - log_sum);
                float g = 0.0f;
                if (p != 0.0f) { /* masked pairs (the future, padding) weigh exactly 0 and add nothing */
                    float dp = 0.0f;
                    float *gvj = w->gvalue + (b * w->keys + j) * value_dim;
#pragma omp simd reduction(+ : dp)
                    for (int64_t d = 0; d < value_dim; d++) {
                        dp += doi[d] * vj[d];
                        gvj[d] += p * doi[d];
                    }
                    /* a row with every key blocked weighs them alike; a mask that blocks by masked_fill (bool) passes
                     * no gradient to a blocked score, one added to the scores does */
                    const int stops = w->blocked_stops_gradient && extra[i * w->keys + j] <= BLOCKED;
                    g = stops ? 0.0f : p * (dp - delta);
                    if (g != 0.0f) {
                        add_tanh_gradients(t, g, gqi, w->gk + (b * w->keys + j) * dim, w->genergy + b * dim, dim);
                    }
                }
                if (w->ds_out) w->ds_out[row * w->keys + j] = g;
            }
        }
    }
    free(t);
}

static void *run_scores(void *w) { scores_range((const Work *)w); return NULL; }
static void *run_scores_backward(void *w) { scores_backward_range((const Work *)w); return NULL; }
static void *run_attention_backward(void *w) { attention_backward_range((const Work *)w); return NULL; }

/* scores = s + extra (add_extra), or s with 0 for the pairs extra blocks (the mask is applied after); extra as in
 * the attention backward, NULL: the scores alone */
int plugformer_additive_scores(const float *q, const float *k, int64_t key_stride, const float *energy,
                               const float *extra, int64_t extra_batch, int64_t extra_head, int add_extra,
                               float *scores, int64_t batch_heads, int64_t heads, int64_t rows, int64_t keys,
                               int64_t dim, int threads) {
    Work w = {.q = q, .k = k, .key_stride = key_stride, .energy = energy, .extra = extra, .extra_batch = extra_batch,
              .extra_head = extra_head, .add_extra = add_extra, .scores = scores, .heads = heads,
              .rows = rows, .keys = keys, .dim = dim};
    return parallel(w, batch_heads * rows, threads, run_scores);
}

int plugformer_additive_scores_backward(const float *q, const float *k, int64_t key_stride, const float *ds,
                                        float *gq, float *gk, float *genergy, int64_t batch_heads, int64_t rows,
                                        int64_t keys, int64_t dim, int threads) {
    Work w = {.q = q, .k = k, .key_stride = key_stride, .ds_in = ds, .gq = gq, .gk = gk, .genergy = genergy,
              .heads = 1, .rows = rows, .keys = keys, .dim = dim};
    return parallel(w, batch_heads, threads, run_scores_backward);
}

/* k, value: (batch_heads, keys, .) rows `key_stride`, `value_stride` elements apart (a chunk's keys may be the
 * first `keys` of longer rows); extra: NULL, or the bias + mask of (batch, head) at extra + batch * extra_batch +
 * head * extra_head, (rows, keys) contiguous (a stride of 0 broadcasts); blocked_stops_gradient: whether a blocked
 * pair's score gets no gradient (a mask applied by masked_fill; it matters only in a row whose keys are all
 * blocked); ds_out: NULL, or where the score gradients (batch_heads, rows, keys) go. */
int plugformer_additive_attention_backward(const float *q, const float *k, int64_t key_stride, const float *energy,
                                           const float *value, int64_t value_stride, const float *extra,
                                           int64_t extra_batch, int64_t extra_head,
                                           const float *row_max, const float *row_log, const float *delta,
                                           const float *grad_out, float *gq, float *gk, float *genergy,
                                           float *gvalue, float *ds_out, int64_t batch_heads, int64_t heads,
                                           int64_t rows, int64_t keys, int64_t dim, int64_t value_dim,
                                           int blocked_stops_gradient, int threads) {
    Work w = {.q = q, .k = k, .key_stride = key_stride, .energy = energy, .value = value,
              .value_stride = value_stride, .extra = extra, .extra_batch = extra_batch,
              .extra_head = extra_head, .row_max = row_max, .row_log = row_log, .delta = delta,
              .grad_out = grad_out, .gq = gq, .gk = gk, .genergy = genergy, .gvalue = gvalue, .ds_out = ds_out,
              .heads = heads, .rows = rows, .keys = keys, .dim = dim,
              .value_dim = value_dim, .blocked_stops_gradient = blocked_stops_gradient && extra != NULL};
    return parallel(w, batch_heads, threads, run_attention_backward);
}
