/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * A mixer layer's one-token decode step on a CPU, in one call: what AarenMixer.forward does for a decode token
 * between its projections and o_proj (aaren_hf/modeling_aaren.py), for float32 tensors:
 *
 *   1. the Aaren branch (aaren/step.c), which also gives the token's slot scores;
 *   2. the token's retention score: retention_proj(x) as given ("learned") or the best slot score of each kv head
 *      ("aaren"), on the 1/64 grid (round_retention), shared as ranking_score shares it (the layer that shares leaves
 *      its best over kv heads; the layers after it rank by the larger of theirs and that one);
 *   3. the window branch (window/step.c), which offers the oldest window entry to the memory by that score;
 *   4. the two branches mixed by the gate: lerp(aaren, window, sigmoid(gate)).
 *
 * A layer may lack either branch (J = 0: no Aaren branch; W = 0: no window). One call instead of two keeps the
 * wrapper's fixed cost and the small operators of steps 2 and 4 off every layer of every token. The state is what
 * the two branch kernels leave (the Aaren state to float rounding, the rest bit for bit given the same scores),
 * written in place when the caller passes the same buffers in and out (o_new = o_in, new_win_* = win_*); the output
 * equals the reference's to float rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "../aaren/aaren.h"
#include "../window/window.h"
#include "mixer.h"

/* The retention scores of n tokens (a decode step's B, a prompt's B T) into retention [n, Hkv]: retention_proj(x)
 * as given in retention_in [n, Hkv] (rule 1) or the best of each kv head's slot scores s [n, HJ] (rule 2), on the
 * 1/64 grid (round_retention); share 1 writes each token's best over kv heads to shared [n], 2 ranks by the larger
 * of its own and that one (ranking_score). mixer/prefill.c uses it too. */
void aaren_retention_scores(int64_t n, int Hkv, int HJ, int rule, int share, const float *retention_in,
                            const float *s, float *shared, float *retention) {
    const int GJ = HJ / Hkv;
    for (int64_t t = 0; t < n; t++) {
        float best = -INFINITY;
        for (int h = 0; h < Hkv; h++) {
            float r;
            if (rule == 1) {
                r = retention_in[t * Hkv + h];
            } else {
                r = -INFINITY;
                for (int j = 0; j < GJ; j++) { /* NaN propagates, as torch.amax (fmaxf would drop it) */
                    float x = s[t * HJ + h * GJ + j];
                    r = (x != x || r != r) ? NAN : fmaxf(r, x);
                }
            }
            if (r != r) r = -INFINITY; /* a NaN score ranks as -inf, as round_retention has it */
            r = rintf(r * 64.0f) / 64.0f; /* round half to even, as torch.round */
            if (share == 2) r = fmaxf(r, shared[t]);
            retention[t * Hkv + h] = r;
            best = fmaxf(best, r);
        }
        if (share == 1) shared[t] = best;
    }
}

/* out [n, H, D] = lerp(aaren [n, H, D], out, sigmoid(gate)) in place: gate [H], or [n, H] with per_token */
void aaren_gate_mix(int64_t n, int H, int D, const float *gate, int per_token, const float *aaren, float *out) {
    for (int64_t t = 0; t < n; t++)
        for (int h = 0; h < H; h++) {
            const float g = gate[per_token ? t * H + h : h];
            const float w = 1.0f / (1.0f + expf(-g));
            const int64_t at = (t * H + h) * D;
            for (int d = 0; d < D; d++) out[at + d] = lerp(aaren[at + d], out[at + d], w);
        }
}

/* The arguments come packed, n[16] sizes and switches and p[37] pointers (their order: STEP_SIZES and STEP_POINTERS
 * in the wrapper, kernels/mixer/__init__.py): ctypes passes three arguments in a fraction of the time
 * it takes to convert 54, and after a short prompt the Python around a decode step's call is a good part of the
 * layer's time.
 * rule: 1 retention_in [B, Hkv] is retention_proj(x), 2 the best slot score per kv head. share: 0 none, 1 this
 * layer writes its best over kv heads to shared [B], 2 this layer ranks by max(its own, shared). gate [H] per head,
 * or [B, H] with gate_per_token. Returns what a branch kernel returned when it declined (1: nothing of the state
 * written; the caller runs the reference) or 2 when out of memory. */
int aaren_mixer_step(const int *n, float scale, void *const *p) {
    int B = n[0], H = n[1], Hkv = n[2], D = n[3], J = n[4], decay = n[5], rot = n[6], W = n[7], S = n[8], M = n[9];
    int bf16 = n[10], bits = n[11], rotate = n[12], rule = n[13], share = n[14], gate_per_token = n[15];
    const float *q = p[0], *k = p[1], *v = p[2];
    const int64_t *pos = p[3];
    const uint8_t *keep = p[4];
    const float *queries = p[5], *log_decay = p[6], *decay_in = p[7], *o_in = p[8], *lse_in = p[9];
    float *o_new = p[10], *lse_new = p[11];
    const float *cos_t = p[12], *sin_t = p[13], *cos_s = p[14], *sin_s = p[15];
    const void *win_k = p[16], *win_v = p[17];
    const int64_t *win_pos = p[18];
    const float *win_score = p[19];
    void *sink_k = p[20], *sink_v = p[21];
    int64_t *sink_pos = p[22];
    void *mem_k = p[23], *mem_v = p[24];
    uint16_t *mem_k_scale = p[25], *mem_v_scale = p[26];
    int64_t *mem_pos = p[27];
    float *mem_score = p[28];
    const float *retention_in = p[29];
    float *shared = p[30];
    const float *gate = p[31];
    float *out = p[32];
    void *new_win_k = p[33], *new_win_v = p[34];
    int64_t *new_win_pos = p[35];
    float *new_win_score = p[36];
    /* the Aaren branch updates its state in place: a window kernel that declined after it would leave it half done */
    if (W > 0 && !aaren_window_step_takes(H, Hkv, D, rotate)) return 1;
    const int HJ = H * J, BHD = B * H * D;
    /* scratch: slot scores [B, HJ], the Aaren branch's output [B, H, D], the retention scores [B, Hkv] */
    float *scratch = malloc(sizeof(float) * ((size_t)B * HJ + (size_t)BHD + (size_t)B * Hkv + 1));
    if (!scratch) return 2;
    float *s = scratch, *out_a = s + (size_t)B * HJ, *retention = out_a + BHD;
    int rc = 0;
    if (J > 0) {
        rc = aaren_branch_step(B, H, Hkv, D, J, decay, scale, q, k, v, keep, queries, log_decay, decay_in, o_in,
                               lse_in, o_new, lse_new, s, W > 0 ? out_a : out);
        if (rc != 0 || W == 0) goto done;
    }
    if (M > 0) aaren_retention_scores(B, Hkv, HJ, rule, share, retention_in, s, shared, retention);
    rc = aaren_window_step(B, H, Hkv, D, rot, W, S, M, bf16, bits, rotate, scale, q, k, v, pos, cos_t, sin_t, cos_s,
                           sin_s, win_k, win_v, win_pos, win_score, sink_k, sink_v, sink_pos, mem_k, mem_v,
                           mem_k_scale, mem_v_scale, mem_pos, mem_score, retention, out, new_win_k, new_win_v,
                           new_win_pos, new_win_score);
    if (rc == 0 && J > 0) aaren_gate_mix(B, H, D, gate, gate_per_token, out_a, out);
done:
    free(scratch);
    return rc;
}
