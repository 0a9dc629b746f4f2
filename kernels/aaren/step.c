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
 * The reference's operations in its order, but expf/logf here are not PyTorch's vectorised exp/log, which differ in
 * the last bit now and then: the state equals the reference's to float rounding, not bit for bit (nothing here is
 * ranked, unlike the window step's memory). tests/test_mixer_step_kernel.py checks it.
 *
 * aaren_branch_prefill is the same step over a prompt, token after token, for a prefill without gradients (its
 * reference: aaren_output's slot scores, mix and decays, then aaren_scan.chunk_aaren_mixed): O(T) small loops where
 * the chunked scan builds C x C weight matrices per chunk and op head, and no operator per part of the branch.
 * tests/test_kernels.py checks it against that reference.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "../memory/codes.h" /* the 8-float vectors */

#define MAX_J 64

static float dot(const float *a, const float *b, int D) {
    float acc = 0.0f;
    for (int d = 0; d < D; d++) acc += a[d] * b[d];
    return acc;
}

/* torch.lerp's formula: exact at both ends */
static inline float lerp(float a, float b, float w) {
    return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

/* torch.nn.functional.softplus (beta 1, threshold 20) */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* One op head takes a token: its state (o [D], lse), decayed by g where `decayed`, and the token's value v [D] with
 * score sc, merged: l = lse + g; m = max(l, sc); o <- lerp(o, v, b / w), lse <- m + log(w). In place when
 * o_new = o. */
static inline void fold(float *o_new, float *lse_new, const float *o, float lse, const float *v, float sc, float g,
                        int decayed, int D) {
    const float l = decayed ? lse + g : lse;
    const float m = fmaxf(l, sc);
    const float m_safe = fmaxf(m, -FLT_MAX); /* both empty: exp(-inf) = 0, never -inf - -inf */
    const float wa = expf(l - m_safe), wb = expf(sc - m_safe);
    const float w = fmaxf(wa + wb, 1.0f);
    const float share = wb / w;
    for (int d = 0; d < D; d++) o_new[d] = lerp(o[d], v[d], share);
    *lse_new = m + logf(w);
}

/* out [D] = sum_j share[j] * slots[j] ([J, D]); the one slot as it is for J = 1 (share unread) */
static inline void mix_slots(float *out, const float *slots, const float *share, int J, int D) {
    if (J == 1) {
        for (int d = 0; d < D; d++) out[d] = slots[d];
        return;
    }
    for (int d = 0; d < D; d++) out[d] = 0.0f;
    for (int j = 0; j < J; j++)
        for (int d = 0; d < D; d++) out[d] += share[j] * slots[(int64_t)j * D + d];
}

/* One token of one sequence through the branch: q [H, D] (unread when J = 1), k and v [Hkv, D], real (0: padding),
 * decay_in [H J]; the state o_in [H J, D], lse_in [H J] goes to o_new, lse_new (in place when the same); writes the
 * masked scores s [H J] and out [H, D]. `dot` gives the products (scalar for the decode step, eight lanes for a
 * prompt: other rounding, the same to float precision). */
static inline void branch_token(int H, int Hkv, int D, int J, int decay, float scale, const float *q, const float *k,
                                const float *v, int real, const float *queries, const float *log_decay,
                                const float *decay_in, const float *o_in, const float *lse_in, float *o_new,
                                float *lse_new, float *s, float *out, float (*dot)(const float *, const float *, int)) {
    const int HJ = H * J, GJ = HJ / Hkv;
    const float ln2 = 0.6931471805599453f; /* math.log(2.0), as the reference divides by it */
    for (int hj = 0; hj < HJ; hj++) {
        const float *vv = v + (int64_t)(hj / GJ) * D;
        float sc = real ? dot(k + (int64_t)(hj / GJ) * D, queries + (int64_t)hj * D, D) * scale : -INFINITY;
        float g = 0.0f;
        if (decay && real) {
            g = -expf(log_decay[hj]);
            if (decay == 2) g = g * softplus(decay_in[hj]) / ln2;
        }
        fold(o_new + (int64_t)hj * D, lse_new + hj, o_in + (int64_t)hj * D, lse_in[hj], vv, sc, g, decay && real, D);
        s[hj] = sc;
    }
    for (int h = 0; h < H; h++) {
        float *oh = out + (int64_t)h * D;
        const float *slots = o_new + (int64_t)h * J * D;
        if (J == 1) {
            mix_slots(oh, slots, 0, 1, D);
            continue;
        }
        float mix[MAX_J], top = -INFINITY, total = 0.0f;
        for (int j = 0; j < J; j++) {
            mix[j] = dot(q + (int64_t)h * D, queries + ((int64_t)h * J + j) * D, D) * scale;
            top = fmaxf(top, mix[j]);
        }
        for (int j = 0; j < J; j++) total += (mix[j] = expf(mix[j] - top));
        for (int j = 0; j < J; j++) mix[j] = mix[j] / total;
        mix_slots(oh, slots, mix, J, D);
    }
}

/* decay: 0 none, 1 a rate per op head (exp(log_decay)), 2 that rate times softplus(decay_in) / log 2.
 * q [B, H, D] (NULL when J = 1), k and v [B, Hkv, D], keep [B] (1: a real token; NULL: all are), queries [H, J, D],
 * log_decay [H J], decay_in [B, H J], state o_in [B, H J, D] and lse_in [B, H J]; writes o_new, lse_new, the masked
 * scores s [B, H J] and out [B, H, D]. Returns 1 (writing nothing) for J > MAX_J. */
int aaren_branch_step(int B, int H, int Hkv, int D, int J, int decay, float scale,
                      const float *q, const float *k, const float *v, const uint8_t *keep,
                      const float *queries, const float *log_decay, const float *decay_in,
                      const float *o_in, const float *lse_in,
                      float *o_new, float *lse_new, float *s, float *out) {
    if (J > MAX_J) return 1;
    const int HJ = H * J;
    for (int b = 0; b < B; b++) {
        const int64_t row = (int64_t)b * HJ;
        branch_token(H, Hkv, D, J, decay, scale, J > 1 ? q + (int64_t)b * H * D : 0, k + (int64_t)b * Hkv * D,
                     v + (int64_t)b * Hkv * D, keep == 0 || keep[b], queries, log_decay,
                     decay_in ? decay_in + row : 0, o_in + row * D, lse_in + row, o_new + row * D, lse_new + row,
                     s + row, out + (int64_t)b * H * D, dot);
    }
    return 0;
}

/* a D-wide product in eight lanes (D a multiple of 8) */
static float dot8(const float *a, const float *b, int D) {
    if (D % 8) return dot(a, b, D);
    v8f acc = splat8(0.0f);
    for (int d = 0; d < D; d += 8) acc += load8(a + d) * load8(b + d);
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* aaren_branch_step over a prompt, token after token, for a prefill without gradients: q [B, T, H, D] (NULL when
 * J = 1), k and v [B, T, Hkv, D], keep [B, T] (NULL: all real), decay_in [B, T, H J]; the state o [B, H J, D] and
 * lse [B, H J] enters as the carried one and leaves as the final one (written in place); writes s [B, T, H J] and
 * out [B, T, H, D]. Returns 1 (writing nothing) for J > MAX_J. */
int aaren_branch_prefill(int B, int T, int H, int Hkv, int D, int J, int decay, float scale, const float *q,
                         const float *k, const float *v, const uint8_t *keep, const float *queries,
                         const float *log_decay, const float *decay_in, float *o, float *lse, float *s, float *out) {
    if (J > MAX_J) return 1;
    const int HJ = H * J;
    for (int b = 0; b < B; b++) {
        float *ob = o + (int64_t)b * HJ * D, *lb = lse + (int64_t)b * HJ;
        for (int t = 0; t < T; t++) {
            const int64_t bt = (int64_t)b * T + t;
            branch_token(H, Hkv, D, J, decay, scale, J > 1 ? q + bt * H * D : 0, k + bt * Hkv * D, v + bt * Hkv * D,
                         keep == 0 || keep[bt], queries, log_decay, decay_in ? decay_in + bt * HJ : 0, ob, lb, ob, lb,
                         s + bt * HJ, out + bt * H * D, dot8);
        }
    }
    return 0;
}
