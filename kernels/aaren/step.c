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
 * aaren_scan_mixed is the same step over a prompt, token after token, for a prefill without gradients: given the
 * masked scores, decays and slot mix the model computed (what aaren_scan.chunk_aaren_mixed takes, its reference), it
 * costs O(T) small loops where the chunked scan builds C x C weight matrices per chunk and op head.
 * tests/test_kernels.py checks it against that reference.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

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
    const int HJ = H * J, GJ = HJ / Hkv;
    const float ln2 = 0.6931471805599453f; /* math.log(2.0), as the reference divides by it */
    for (int b = 0; b < B; b++) {
        const int real = keep == 0 || keep[b];
        for (int hj = 0; hj < HJ; hj++) {
            const int64_t row = (int64_t)b * HJ + hj;
            const float *vv = v + ((int64_t)b * Hkv + hj / GJ) * D;
            float sc = real ? dot(k + ((int64_t)b * Hkv + hj / GJ) * D, queries + (int64_t)hj * D, D) * scale
                            : -INFINITY;
            float g = 0.0f;
            if (decay && real) {
                g = -expf(log_decay[hj]);
                if (decay == 2) g = g * softplus(decay_in[row]) / ln2;
            }
            fold(o_new + row * D, lse_new + row, o_in + row * D, lse_in[row], vv, sc, g, decay && real, D);
            s[row] = sc;
        }
        for (int h = 0; h < H; h++) {
            float *oh = out + ((int64_t)b * H + h) * D;
            const float *slots = o_new + ((int64_t)b * HJ + (int64_t)h * J) * D;
            if (J == 1) {
                mix_slots(oh, slots, 0, 1, D);
                continue;
            }
            float mix[MAX_J], top = -INFINITY, total = 0.0f;
            for (int j = 0; j < J; j++) {
                mix[j] = dot(q + ((int64_t)b * H + h) * D, queries + ((int64_t)h * J + j) * D, D) * scale;
                top = fmaxf(top, mix[j]);
            }
            for (int j = 0; j < J; j++) total += (mix[j] = expf(mix[j] - top));
            for (int j = 0; j < J; j++) mix[j] = mix[j] / total;
            mix_slots(oh, slots, mix, J, D);
        }
    }
    return 0;
}

/* s and g [B, T, H J] (g NULL: no decay; a padding token has s = -inf, g = 0), v [B, T, Hkv, D], mix [B, T, H, J]
 * (rows summing to 1); the state o [B, H J, D] and lse [B, H J] enters as the carried one and leaves as the final
 * one (written in place); out [B, T, H, D]. Returns 1 (writing nothing) for J > MAX_J. */
int aaren_scan_mixed(int B, int T, int H, int Hkv, int D, int J, const float *s, const float *g, const float *v,
                     const float *mix, float *o, float *lse, float *out) {
    if (J > MAX_J) return 1;
    const int HJ = H * J, GJ = HJ / Hkv;
    for (int b = 0; b < B; b++) {
        float *ob = o + (int64_t)b * HJ * D, *lb = lse + (int64_t)b * HJ;
        for (int t = 0; t < T; t++) {
            const int64_t bt = (int64_t)b * T + t;
            const float *st = s + bt * HJ, *gt = g ? g + bt * HJ : 0, *vt = v + bt * Hkv * D;
            for (int hj = 0; hj < HJ; hj++)
                fold(ob + (int64_t)hj * D, lb + hj, ob + (int64_t)hj * D, lb[hj], vt + (int64_t)(hj / GJ) * D,
                     st[hj], gt ? gt[hj] : 0.0f, gt != 0, D);
            for (int h = 0; h < H; h++) {
                float *oh = out + (bt * H + h) * D;
                mix_slots(oh, ob + (int64_t)h * J * D, mix + (bt * H + h) * J, J, D);
            }
        }
    }
    return 0;
}
