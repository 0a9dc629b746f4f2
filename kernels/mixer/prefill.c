/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * A mixer layer over a prompt on a CPU without gradients, in one call: what AarenMixer.forward does between its
 * projections and o_proj (aaren_hf/modeling_aaren.py) for a layer with a window, float32 tensors:
 *
 *   1. the Aaren branch (aaren/step.c, aaren_branch_prefill), which also gives the slot scores;
 *   2. the retention scores: retention_proj(x) as given ("learned") or the best slot score of each kv head
 *      ("aaren"), on the 1/64 grid, shared as ranking_score shares it (as mixer/step.c for a decode token);
 *   3. the window's bookkeeping (window/prefill.c: rotation, rounding, sinks, the next window), the memory's
 *      candidates and next state (memory/prefill.c), the queries (window/chunk.c: rotation, sink scores) and the
 *      window attention (window/chunk.c);
 *   4. the two branches mixed by the gate: lerp(aaren, window, sigmoid(gate)).
 *
 * The same C functions the per-part calls run (modeling_aaren.py makes those where this one declines), in the same
 * order on the same data: the same state bit for bit, and the output to float rounding (the gate's sigmoid is
 * expf's). The reference is the PyTorch code of AarenMixer.forward. About ten wrappers and eighty operators a layer
 * fewer than the per-part calls, which at a short prompt cost as much as the attention itself.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../aaren/aaren.h"
#include "../memory/codes.h"
#include "../memory/memory.h"
#include "../window/window.h"
#include "mixer.h"

/* n rows of D values as float32 (from bfloat16 when bf16) */
static void widen(const void *x, int bf16, int64_t n, float *out) {
    if (!bf16) {
        memcpy(out, x, sizeof(float) * (size_t)n);
        return;
    }
    for (int64_t i = 0; i < n; i++) out[i] = bf16_to_float(((const uint16_t *)x)[i]);
}

/* The float32 scratch arrays of one call, in floats each (see aaren_mixer_prefill) */
enum { STATE, SCORES, OUT_A, RETENTION, KR, VR, KS, VS, CAND_K, CAND_V, QR, SINK_S, SINK_K, SINK_V, FLOATS };

static void scratch_sizes(int B, int T, int H, int Hkv, int D, int J, int S, int M, int Wp, int held, int keep,
                          int64_t n[FLOATS]) {
    const int64_t BT = (int64_t)B * T, HD = (int64_t)Hkv * D, HJ = (int64_t)H * J, Ls = (int64_t)Wp + T;
    const int64_t C = M > 0 ? held + Ls : 0, stream = B * Ls * HD, cands = (int64_t)B * Hkv * C * D;
    const int64_t sizes[FLOATS] = {keep ? 0 : B * HJ * (D + 1), BT * HJ, BT * H * D, BT * Hkv, BT * HD, BT * HD, stream,
                                   stream, cands, cands, BT * H * D, BT * H * S, (int64_t)B * S * HD,
                                   (int64_t)B * S * HD};
    for (int i = 0; i < FLOATS; i++) n[i] = (sizes[i] + 15) / 16 * 16; /* 64-byte steps in a pool */
}

/* The floats a pool must hold to serve a call with these shapes (arguments as aaren_mixer_prefill's) */
int64_t aaren_mixer_prefill_scratch(int B, int T, int H, int Hkv, int D, int J, int S, int M, int Wp, int held,
                                    int keep) {
    int64_t n[FLOATS], total = 0;
    scratch_sizes(B, T, H, Hkv, D, J, S, M, Wp, held, keep, n);
    for (int i = 0; i < FLOATS; i++) total += n[i];
    return total;
}

/* The window held: win_k, win_v [B, Wp, Hkv, D] (bfloat16 when bf16), win_pos [B, Wp], win_score [B, Wp, Hkv]
 * (with a memory); the memory held: mem_* [B, Hkv, M, ...] (NULL when held is 0); the sinks: sink_* [B, S, ...]
 * (NULL on a first prompt: none yet).
 * Aaren state o_in [B, H J, D], lse_in [B, H J] (NULL: empty); with keep, the next state into o_new, lse_new,
 * new_sink_*, new_win_* and new_mem_*. rule: 1 retention_in [B, T, Hkv] is retention_proj(x), 2 the best slot
 * score per kv head. share: 0 none, 1 this layer writes its best over kv heads to shared [B, T], 2 it ranks by
 * max(its own, shared). gate [H], or [B, T, H] with gate_per_token. J = 0: no Aaren branch (the window's output
 * alone); M = 0: no memory. Returns 1 where a part does not take these shapes (the caller runs the per-part
 * calls; nothing the caller holds was written), 2 when out of memory. */
int aaren_mixer_prefill(
    int B, int T, int H, int Hkv, int D, int J, int decay, int rot, int W, int S, int M, int Wp, int held, int bf16,
    int bits, int rotate, int rule, int share, int gate_per_token, int keep, int threads, float scale, float *pool,
    int64_t pool_floats,
    const float *q, const float *k, const float *v, const int64_t *pos, const uint8_t *mask,
    const float *queries, const float *log_decay, const float *decay_in, const float *o_in, const float *lse_in,
    const float *cos, const float *sin, const float *back_cos, const float *back_sin,
    const void *win_k, const void *win_v, const int64_t *win_pos, const float *win_score,
    const void *sink_k, const void *sink_v, const int64_t *sink_pos,
    const uint8_t *mem_k, const uint8_t *mem_v, const uint16_t *mem_ks, const uint16_t *mem_vs,
    const int64_t *mem_pos, const float *mem_score, const float *retention_in, float *shared, const float *gate,
    float *out, float *o_new, float *lse_new, void *new_sink_k, void *new_sink_v, int64_t *new_sink_pos,
    void *new_win_k, void *new_win_v, int64_t *new_win_pos, float *new_win_score, uint8_t *new_mem_k,
    uint8_t *new_mem_v, uint16_t *new_mem_ks, uint16_t *new_mem_vs, int64_t *new_mem_pos, float *new_mem_score) {
    if (W < 2 || !aaren_window_attention_takes(H, Hkv, D)) return 1;
    const int HJ = H * J, Ls = Wp + T, C = M > 0 ? held + Ls : 0;
    const int64_t BT = (int64_t)B * T, HD = (int64_t)Hkv * D, sinks = (int64_t)B * S * HD;
    const size_t unit = bf16 ? 2 : 4;
    /* scratch: the Aaren state when not kept, its slot scores and output, the retention scores, the rounded keys
     * and values, the stream, the memory's candidates, the queries and their sink scores, the sinks in float32 (in
     * floats); evict [B, Hkv, C], last [T + 1] and the stream's positions; what each query sees of the sinks. The
     * float arrays from the caller's pool of pool_floats (aaren_mixer_prefill_scratch) when it is large enough: the
     * layers of one pass share one, where each layer's own allocations made a 1,000-token prompt fault its pages in
     * afresh layer after layer; else one allocation each */
    int64_t n[FLOATS], total = 0;
    scratch_sizes(B, T, H, Hkv, D, J, S, M, Wp, held, keep, n);
    for (int i = 0; i < FLOATS; i++) total += n[i];
    const int pooled = pool != NULL && pool_floats >= total;
    float *f[FLOATS];
    int ok = 1;
    int64_t at = 0;
    for (int i = 0; i < FLOATS; at += n[i], i++)
        ok &= (f[i] = pooled ? pool + at : malloc(sizeof(float) * (size_t)n[i] + 1)) != NULL;
    int64_t *ints = malloc(sizeof(int64_t) * ((size_t)B * Hkv * C + T + 1 + (size_t)B * Ls) + 1);
    int rc = ok && ints ? 0 : 2;
    if (rc) goto done;
    float *o = keep ? o_new : f[STATE], *lse = keep ? lse_new : f[STATE] + (int64_t)B * HJ * D;
    float *s = f[SCORES], *out_a = f[OUT_A], *retention = f[RETENTION], *kr = f[KR], *vr = f[VR], *ks = f[KS];
    float *vs = f[VS], *cand_k = f[CAND_K], *cand_v = f[CAND_V], *qr = f[QR], *sink_s = f[SINK_S];
    float *sink_kf = f[SINK_K], *sink_vf = f[SINK_V];
    int64_t *evict = ints, *last = evict + (int64_t)B * Hkv * C, *spos = last + T + 1;

    if (J > 0) {
        if (o_in) {
            memcpy(o, o_in, sizeof(float) * (size_t)B * HJ * D);
            memcpy(lse, lse_in, sizeof(float) * (size_t)B * HJ);
        } else {
            memset(o, 0, sizeof(float) * (size_t)B * HJ * D);
            for (int64_t i = 0; i < (int64_t)B * HJ; i++) lse[i] = -INFINITY;
        }
        rc = aaren_branch_prefill(B, T, H, Hkv, D, J, decay, scale, q, k, v, mask, queries, log_decay, decay_in, o,
                                  lse, s, out_a);
        if (rc != 0) goto done;
    }
    if (M > 0) aaren_retention_scores(BT, Hkv, HJ, rule, share, retention_in, s, shared, retention);
    /* the sinks so far, updated by this prompt's first tokens */
    if (sink_k) {
        memcpy(new_sink_k, sink_k, unit * (size_t)sinks);
        memcpy(new_sink_v, sink_v, unit * (size_t)sinks);
        memcpy(new_sink_pos, sink_pos, sizeof(int64_t) * (size_t)B * S);
    } else { /* a first prompt: no sink yet (zeros, position -1) */
        memset(new_sink_k, 0, unit * (size_t)sinks);
        memset(new_sink_v, 0, unit * (size_t)sinks);
        for (int64_t i = 0; i < (int64_t)B * S; i++) new_sink_pos[i] = -1;
    }
    rc = aaren_window_prefill(B, T, Hkv, D, Wp, W, S, bf16, keep, rot, k, cos, sin, v, pos, win_k, win_v, win_pos,
                              win_score, M > 0 ? retention : NULL, kr, vr, new_sink_k, new_sink_v, new_sink_pos,
                              new_win_k, new_win_v, new_win_pos, M > 0 ? new_win_score : NULL);
    if (rc != 0) goto done;
    if (M > 0) {
        rc = aaren_memory_prefill(B, Hkv, D, M, held, Wp, T, W, S, bits, rotate, bf16, keep, win_k, win_v, kr, vr,
                                  win_pos, pos, win_score, retention, mem_k, mem_v, mem_ks, mem_vs, mem_pos,
                                  mem_score, cand_k, cand_v, evict, last, new_mem_k, new_mem_v, new_mem_ks,
                                  new_mem_vs, new_mem_pos, new_mem_score);
        if (rc != 0) goto done;
    }
    widen(new_sink_k, bf16, sinks, sink_kf);
    widen(new_sink_v, bf16, sinks, sink_vf);
    rc = aaren_window_queries(B, T, H, Hkv, D, S, W, rot, q, pos, cos, sin, sink_kf, new_sink_pos, back_cos, back_sin,
                              qr, sink_s);
    if (rc != 0) goto done;
    for (int b = 0; b < B; b++) { /* the stream: the window held, then this prompt's tokens */
        widen((const char *)win_k + (size_t)b * Wp * HD * unit, bf16, Wp * HD, ks + (int64_t)b * Ls * HD);
        widen((const char *)win_v + (size_t)b * Wp * HD * unit, bf16, Wp * HD, vs + (int64_t)b * Ls * HD);
        memcpy(ks + ((int64_t)b * Ls + Wp) * HD, kr + (int64_t)b * T * HD, sizeof(float) * (size_t)(T * HD));
        memcpy(vs + ((int64_t)b * Ls + Wp) * HD, vr + (int64_t)b * T * HD, sizeof(float) * (size_t)(T * HD));
        memcpy(spos + (int64_t)b * Ls, win_pos + (int64_t)b * Wp, sizeof(int64_t) * (size_t)Wp);
        memcpy(spos + (int64_t)b * Ls + Wp, pos + (int64_t)b * T, sizeof(int64_t) * (size_t)T);
    }
    rc = aaren_window_attention(B, T, H, Hkv, D, Ls, Wp, W, C, S, scale, threads, qr, pos, ks, vs, spos, cand_k,
                                cand_v, evict, last, sink_s, sink_vf, new_sink_pos, out);
    if (rc == 0 && J > 0) aaren_gate_mix(BT, H, D, gate, gate_per_token, out_a, out); /* the window's in out */
done:
    for (int i = 0; i < FLOATS && !pooled; i++) free(f[i]);
    free(ints);
    return rc;
}
