/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * A prompt's memory tier on a CPU without gradients, in one call: AarenMixer.memory_candidates and keep_memory in
 * aaren_hf/modeling_aaren.py (the reference) for a memory held in codes.
 *
 * The candidates of a row (batch, kv head) are the memory held (its codes decoded) and then the stream: the window
 * entries held and this call's T tokens, coded as the memory would store them and read back (codes.h) where
 * anything reads them. Their eviction indices come from evict.c's heap, the queries' last eligible candidate from
 * memory_visibility's formula. What the next call holds is the top set after the last query, kept ones first in
 * candidate order, then the others (position -1, score -inf, their codes as they were) and empty slots, M in all:
 * keep_memory's stable sort. Everything is copied or computed as the reference's operations compute it, so the
 * indices, the state and what the queries read are the same bit for bit (tests/test_model.py compares the logits
 * and the state).
 */
#include <stdint.h>
#include <stdlib.h>

#include "codes.h"
#include "memory.h"

/* k_prev, v_prev [B, Wp, Hkv, D] (bfloat16 when prev_bf16, else float32), k, v [B, T, Hkv, D] float32; pos_prev
 * [B, Wp], pos [B, T]; score_prev [B, Wp, Hkv], retention [B, T, Hkv]; the memory held (held = 0 or M entries):
 * mem_k, mem_v [B, Hkv, held, width] codes, mem_ks, mem_vs [B, Hkv, held] bfloat16 scales, mem_pos, mem_score
 * [B, Hkv, held]. Writes cand_k, cand_v [B, Hkv, C, D] (C = held + Wp + T; zeros for a stream token no query and
 * no later call reads), evict [B, Hkv, C], last [T + 1], and with keep the next memory new_* [B, Hkv, M, ...].
 * Returns 1 (nothing written) for widths the codes do not take, 2 when out of memory. */
int aaren_memory_prefill(int B, int Hkv, int D, int M, int held, int Wp, int T, int W, int S, int bits, int rotate,
                         int prev_bf16, int keep, const void *k_prev, const void *v_prev, const float *k,
                         const float *v, const int64_t *pos_prev, const int64_t *pos, const float *score_prev,
                         const float *retention, const uint8_t *mem_k, const uint8_t *mem_v, const uint16_t *mem_ks,
                         const uint16_t *mem_vs, const int64_t *mem_pos, const float *mem_score, float *cand_k,
                         float *cand_v, int64_t *evict, int64_t *last, uint8_t *new_k, uint8_t *new_v,
                         uint16_t *new_ks, uint16_t *new_vs, int64_t *new_pos, float *new_score) {
    if (D < 1 || D > MAX_D || (bits != 4 && bits != 8) || (bits == 4 && D % 2) || (rotate && (D & (D - 1))))
        return 1;
    const int Ls = Wp + T, C = held + Ls;
    const int64_t width = bits == 4 ? D / 2 : D, rows = (int64_t)B * Hkv;
    /* the stream's codes (the kept ones are stored as they are), every candidate's position and score */
    uint8_t *codes = malloc((size_t)(rows * Ls * 2 * width) + 1);
    uint16_t *scales = malloc(sizeof(uint16_t) * (size_t)(rows * Ls * 2) + 1);
    int64_t *cpos = malloc(sizeof(int64_t) * (size_t)(rows * C) + 1);
    float *cscore = malloc(sizeof(float) * (size_t)(rows * C) + 1);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(C > M ? C : M) + 1);
    uint8_t *needed = malloc((size_t)Ls + 1);
    if (!codes || !scales || !cpos || !cscore || !order || !needed) {
        free(codes), free(scales), free(cpos), free(cscore), free(order), free(needed);
        return 2;
    }
    const int P = C - held - T;
    for (int i = 0; i <= T; i++) { /* memory_visibility's last */
        int e = P + i - W + 1;
        last[i] = held - 1 + (e > 0 ? e : 0);
    }
    const int upto = held + (P + T - W + 1 > 0 ? P + T - W + 1 : 0);
    float x[MAX_D];
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hkv; h++) {
            const int64_t row = (int64_t)b * Hkv + h;
            for (int c = 0; c < held; c++) {
                const int64_t e = row * held + c, at = row * C + c;
                decode(mem_k + e * width, mem_ks[e], D, bits, rotate, cand_k + at * D);
                decode(mem_v + e * width, mem_vs[e], D, bits, rotate, cand_v + at * D);
                cpos[at] = mem_pos[e];
                cscore[at] = mem_score[e];
            }
            for (int s = 0; s < Ls; s++) {
                const int64_t at = row * C + held + s;
                cpos[at] = s < Wp ? pos_prev[(int64_t)b * Wp + s] : pos[(int64_t)b * T + s - Wp];
                cscore[at] = s < Wp ? score_prev[((int64_t)b * Wp + s) * Hkv + h]
                                    : retention[((int64_t)b * T + s - Wp) * Hkv + h];
            }
        }
    for (int64_t i = 0; i < rows * C; i++) evict[i] = C;
    int rc = aaren_memory_evict((int)rows, C, upto, M, S, cpos, cscore, evict);
    for (int64_t i = 0; rc == 0 && i < rows * C; i++)
        if (cpos[i] < S) evict[i] = -1; /* never in the memory: sinks and padding */
    uint8_t empty[MAX_D];
    uint16_t empty_scale;
    float zeros[MAX_D] = {0};
    encode(zeros, D, bits, rotate, empty, &empty_scale);
    const int64_t seen = last[T];
    for (int64_t row = 0; rc == 0 && row < rows; row++) {
        const int b = (int)(row / Hkv), h = (int)(row % Hkv);
        const int64_t *ev = evict + row * C;
        int n = 0, kept = 0;
        if (keep) { /* the next memory: the kept ones first, then the others, each group in candidate order */
            for (int c = 0; c < C; c++)
                if (c <= seen && seen < ev[c]) order[n++] = c;
            kept = n;
            for (int c = 0; c < C && n < M; c++)
                if (!(c <= seen && seen < ev[c])) order[n++] = c;
        }
        /* A stream token's codes are read only if it enters the memory before this call's last query (a query may
         * see it; evict past its own index) or if the next memory stores it: the others (never entering, still in
         * the window, padding) stay zeros, to which attention gives weight 0 as it would to their codes. */
        for (int s = 0; s < Ls; s++) needed[s] = held + s < upto && ev[held + s] > held + s;
        for (int m = kept; m < n; m++)
            if (order[m] >= held) needed[order[m] - held] = 1;
        for (int s = 0; s < Ls; s++) {
            const int64_t at = row * C + held + s, e = (row * Ls + s) * 2;
            if (!needed[s]) {
                memset(cand_k + at * D, 0, sizeof(float) * D);
                memset(cand_v + at * D, 0, sizeof(float) * D);
                continue;
            }
            for (int kv = 0; kv < 2; kv++) {
                if (s < Wp)
                    load_row(x, kv ? v_prev : k_prev, prev_bf16, (((int64_t)b * Wp + s) * Hkv + h) * D, D);
                else
                    load_row(x, kv ? v : k, 0, (((int64_t)b * T + s - Wp) * Hkv + h) * D, D);
                encode(x, D, bits, rotate, codes + (e + kv) * width, scales + e + kv);
                decode(codes + (e + kv) * width, scales[e + kv], D, bits, rotate, (kv ? cand_v : cand_k) + at * D);
            }
        }
        for (int m = 0; keep && m < M; m++) {
            const int64_t to = row * M + m;
            const int c = m < n ? (int)order[m] : C; /* C: an empty slot */
            const uint8_t *ck = empty, *cv = empty;
            uint16_t sk = empty_scale, sv = empty_scale;
            if (c < held) {
                const int64_t e = row * held + c;
                ck = mem_k + e * width, cv = mem_v + e * width, sk = mem_ks[e], sv = mem_vs[e];
            } else if (c < C) {
                const int64_t e = (row * Ls + c - held) * 2;
                ck = codes + e * width, cv = codes + (e + 1) * width, sk = scales[e], sv = scales[e + 1];
            }
            memcpy(new_k + to * width, ck, (size_t)width);
            memcpy(new_v + to * width, cv, (size_t)width);
            new_ks[to] = sk, new_vs[to] = sv;
            new_pos[to] = m < kept ? cpos[row * C + c] : -1;
            new_score[to] = m < kept ? cscore[row * C + c] : -INFINITY;
        }
    }
    free(codes), free(scales), free(cpos), free(cscore), free(order), free(needed);
    return rc;
}
