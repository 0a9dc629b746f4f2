/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * The Aaren branch's one-token decode step on a CPU, in one call: what AarenMixer.aaren_output does for a decode
 * token (aaren_hf/modeling_aaren.py: slot_scores, the slots' mix, log_decay_per_token, aaren_scan.aaren_step and the
 * mixed output) in about 50 small operators per layer, for float32 tensors.
 *
 * Per op head hj = (kv head, query head in its group, slot), with kv head hj / (G J) and query head hj / J:
 *
 *   s   = <k, c_hj> * scale                       (-inf for a padding token: it leaves the state as it was)
 *   g   = -exp(log_decay_hj) [* softplus(decay_in) / log 2]      (0 for a padding token)
 *   l   = lse + g;  m = max(l, s);  a = exp(l - m),  b = exp(s - m);  w = max(a + b, 1)
 *   o  <- lerp(o, v, b / w),  lse <- m + log(w)
 *   out_h = sum_j softmax_j(<q_h, c_hj> * scale) o_hj      (J = 1: out_h = o_h)
 *
 * Eight op heads at a time for the merge (exp8 and log8 from vec8.h, Cephes' polynomials) and the mix's softmax,
 * eight lanes of d for the products, four products sharing one read of k or q: the state equals the reference's
 * to float rounding, not bit for bit (nothing here is ranked, unlike the window step's memory).
 * tests/test_mixer_step_kernel.py checks it.
 *
 * aaren_branch_prefill is the same step over a prompt, token after token, for a prefill without gradients (its
 * reference: aaren_output's slot scores, mix and decays, then aaren_scan.chunk_aaren_mixed): O(T) small loops where
 * the chunked scan builds C x C weight matrices per chunk and op head, and no operator per part of the branch.
 * One per-token code serves both, so a prompt gives the same bits in one call, in pieces or token after token
 * through the decode step. tests/test_kernels.py checks it against that reference and against the step.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../vec8.h"
#include "aaren.h"

#define MAX_J 64

static float dot(const float *a, const float *b, int D) {
    float acc = 0.0f;
    for (int d = 0; d < D; d++) acc += a[d] * b[d];
    return acc;
}

/* torch.nn.functional.softplus (beta 1, threshold 20) */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* a D-wide product in eight lanes (D a multiple of 8) */
static float dot8(const float *a, const float *b, int D) {
    if (D % 8) return dot(a, b, D);
    v8f acc = splat8(0.0f);
    for (int d = 0; d < D; d += 8) acc += load8(a + d) * load8(b + d);
    return sum8(acc);
}

/* out[r] = <a, rows[r]> for n rows of D ([n, D]), each as dot8 sums it; four rows at a time share a's loads and
 * overlap their sums' latencies */
static inline void rows_dot(const float *a, const float *rows, int n, int D, float scale, float *out) {
    int r = 0;
    if (D % 8 == 0)
        for (; r + 4 <= n; r += 4) {
            const float *b = rows + (int64_t)r * D;
            v8f acc[4] = {splat8(0.0f), splat8(0.0f), splat8(0.0f), splat8(0.0f)};
            for (int d = 0; d < D; d += 8) {
                const v8f x = load8(a + d);
                for (int i = 0; i < 4; i++) acc[i] += x * load8(b + (int64_t)i * D + d);
            }
            for (int i = 0; i < 4; i++) out[r + i] = sum8(acc[i]) * scale;
        }
    for (; r < n; r++) out[r] = dot8(a, rows + (int64_t)r * D, D) * scale;
}

/* out [D] = sum_j share[j] * slots[j] ([J, D]), summed in j's order. Eight columns at a time in registers: one
 * store per column instead of one per slot. */
static inline void mix_slots(float *out, const float *slots, const float *share, int J, int D) {
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        v8f acc = splat8(0.0f);
        for (int j = 0; j < J; j++) acc += splat8(share[j]) * load8(slots + (int64_t)j * D + d);
        store8(out + d, acc);
    }
    for (; d < D; d++) {
        float acc = 0.0f;
        for (int j = 0; j < J; j++) acc += share[j] * slots[(int64_t)j * D + d];
        out[d] = acc;
    }
}

/* The per-call constants and per-token scratch of branch_token, HJ rounded up to 8 floats each */
typedef struct {
    float *rate; /* exp(log_decay) per op head */
    float *g, *share, *mix;
} scratch;

static int scratch_alloc(scratch *w, int HJ) {
    const int n = (HJ + 7) / 8 * 8;
    float *p = calloc((size_t)4 * n, sizeof(float));
    if (!p) return 2;
    *w = (scratch){p, p + n, p + 2 * n, p + 3 * n};
    return 0;
}

static void scratch_rates(scratch *w, int HJ, const float *log_decay) {
    for (int hj = 0; hj < HJ; hj++) w->rate[hj] = log_decay ? expf(log_decay[hj]) : 0.0f;
}

/* One token of one sequence through the branch: q [H, D] (unread when J = 1), k and v [Hkv, D], real (0: padding),
 * decay_in [H J]; the state o_in [H J, D], lse_in [H J] goes to o_new, lse_new (in place when the same); writes the
 * masked scores s [H J] and out [H, D]. Op head hj with score sc and decay g (0 for padding) merges the token:
 * l = lse + g; m = max(l, sc); o <- lerp(o, v, b / w), lse <- m + log(w), with a = exp(l - m), b = exp(sc - m),
 * w = max(a + b, 1), eight op heads at a time. */
static inline void branch_token(int H, int Hkv, int D, int J, int decay, float scale, const float *q, const float *k,
                                const float *v, int real, const float *queries, const float *decay_in,
                                const float *o_in, const float *lse_in, float *o_new, float *lse_new, float *s,
                                float *out, scratch *w) {
    const int HJ = H * J, GJ = HJ / Hkv;
    const float ln2 = 0.6931471805599453f; /* math.log(2.0), as the reference divides by it */
    for (int kh = 0; kh < Hkv; kh++)
        if (real)
            rows_dot(k + (int64_t)kh * D, queries + (int64_t)kh * GJ * D, GJ, D, scale, s + (int64_t)kh * GJ);
        else
            for (int hj = kh * GJ; hj < (kh + 1) * GJ; hj++) s[hj] = -INFINITY;
    for (int hj = 0; hj < HJ; hj++) {
        float g = 0.0f;
        if (decay && real) {
            g = -w->rate[hj];
            if (decay == 2) g = g * softplus(decay_in[hj]) / ln2;
        }
        w->g[hj] = g;
    }
    for (int h0 = 0; h0 < HJ; h0 += 8) {
        const int n = HJ - h0 < 8 ? HJ - h0 : 8;
        float lse8[8] = {0}, sc8[8] = {0}, g8[8] = {0}, out8[8];
        memcpy(lse8, lse_in + h0, sizeof(float) * n);
        memcpy(sc8, s + h0, sizeof(float) * n);
        memcpy(g8, w->g + h0, sizeof(float) * n);
        const v8f l = load8(lse8) + load8(g8), sc = load8(sc8);
        const v8f m = select8(l > sc, l, sc);
        const v8f m_safe = select8(m > splat8(-FLT_MAX), m, splat8(-FLT_MAX)); /* both empty: never -inf - -inf */
        const v8f wa = exp8(l - m_safe), wb = exp8(sc - m_safe);
        v8f total = wa + wb;
        total = select8(total > splat8(1.0f), total, splat8(1.0f));
        store8(out8, wb / total);
        memcpy(w->share + h0, out8, sizeof(float) * n);
        store8(out8, m + log8(total));
        memcpy(lse_new + h0, out8, sizeof(float) * n);
    }
    for (int hj = 0; hj < HJ; hj++) {
        const float *o = o_in + (int64_t)hj * D, *vv = v + (int64_t)(hj / GJ) * D;
        float *on = o_new + (int64_t)hj * D;
        const float share = w->share[hj];
        for (int d = 0; d < D; d++) on[d] = lerp(o[d], vv[d], share);
    }
    if (J == 1) { /* each head's one slot as it is */
        memcpy(out, o_new, sizeof(float) * (size_t)H * D);
        return;
    }
    float *mix = w->mix;
    for (int h = 0; h < H; h++) {
        float top = -INFINITY;
        rows_dot(q + (int64_t)h * D, queries + (int64_t)h * J * D, J, D, scale, mix + (int64_t)h * J);
        for (int j = 0; j < J; j++) top = fmaxf(top, mix[h * J + j]);
        for (int j = 0; j < J; j++) mix[h * J + j] -= top;
    }
    for (int h0 = 0; h0 < HJ; h0 += 8) store8(mix + h0, exp8(load8(mix + h0))); /* scratch is padded to 8 */
    for (int h = 0; h < H; h++) {
        float total = 0.0f, *mh = mix + (int64_t)h * J;
        for (int j = 0; j < J; j++) total += mh[j];
        for (int j = 0; j < J; j++) mh[j] = mh[j] / total;
        mix_slots(out + (int64_t)h * D, o_new + (int64_t)h * J * D, mh, J, D);
    }
}

/* decay: 0 none, 1 a rate per op head (exp(log_decay)), 2 that rate times softplus(decay_in) / log 2.
 * q [B, H, D] (NULL when J = 1), k and v [B, Hkv, D], keep [B] (1: a real token; NULL: all are), queries [H, J, D],
 * log_decay [H J], decay_in [B, H J], state o_in [B, H J, D] and lse_in [B, H J]; writes o_new, lse_new, the masked
 * scores s [B, H J] and out [B, H, D]. Returns 1 (writing nothing) for J > MAX_J, 2 when out of memory. */
int aaren_branch_step(int B, int H, int Hkv, int D, int J, int decay, float scale,
                      const float *q, const float *k, const float *v, const uint8_t *keep,
                      const float *queries, const float *log_decay, const float *decay_in,
                      const float *o_in, const float *lse_in,
                      float *o_new, float *lse_new, float *s, float *out) {
    if (J > MAX_J) return 1;
    const int HJ = H * J;
    scratch w;
    if (scratch_alloc(&w, HJ)) return 2;
    scratch_rates(&w, HJ, decay ? log_decay : 0);
    for (int b = 0; b < B; b++) {
        const int64_t row = (int64_t)b * HJ;
        branch_token(H, Hkv, D, J, decay, scale, J > 1 ? q + (int64_t)b * H * D : 0, k + (int64_t)b * Hkv * D,
                     v + (int64_t)b * Hkv * D, keep == 0 || keep[b], queries, decay_in ? decay_in + row : 0,
                     o_in + row * D, lse_in + row, o_new + row * D, lse_new + row, s + row, out + (int64_t)b * H * D,
                     &w);
    }
    free(w.rate);
    return 0;
}

/* aaren_branch_step over a prompt, token after token, for a prefill without gradients: q [B, T, H, D] (NULL when
 * J = 1), k and v [B, T, Hkv, D], keep [B, T] (NULL: all real), decay_in [B, T, H J]; the state o [B, H J, D] and
 * lse [B, H J] enters as the carried one and leaves as the final one (written in place); writes s [B, T, H J] and
 * out [B, T, H, D]. Returns 1 (writing nothing) for J > MAX_J, 2 when out of memory. */
int aaren_branch_prefill(int B, int T, int H, int Hkv, int D, int J, int decay, float scale, const float *q,
                         const float *k, const float *v, const uint8_t *keep, const float *queries,
                         const float *log_decay, const float *decay_in, float *o, float *lse, float *s, float *out) {
    if (J > MAX_J) return 1;
    const int HJ = H * J;
    scratch w;
    if (scratch_alloc(&w, HJ)) return 2;
    scratch_rates(&w, HJ, decay ? log_decay : 0);
    for (int b = 0; b < B; b++) {
        float *ob = o + (int64_t)b * HJ * D, *lb = lse + (int64_t)b * HJ;
        for (int t = 0; t < T; t++) {
            const int64_t bt = (int64_t)b * T + t;
            branch_token(H, Hkv, D, J, decay, scale, J > 1 ? q + bt * H * D : 0, k + bt * Hkv * D, v + bt * Hkv * D,
                         keep == 0 || keep[bt], queries, decay_in ? decay_in + bt * HJ : 0, ob, lb, ob, lb, s + bt * HJ,
                         out + bt * H * D, &w);
        }
    }
    free(w.rate);
    return 0;
}
