/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * A prompt's window bookkeeping on a CPU without gradients, in one call: what AarenMixer.window_branch in
 * aaren_hf/modeling_aaren.py (the reference) does around its attention and memory calls, about thirty operators:
 *
 *   1. the keys rotated at their positions (rotate.c's aaren_rotate, rotate_cpu's bits) and, with the values,
 *      rounded to the cache's dtype (bfloat16, or float32: unchanged), as every path computes on them;
 *   2. the sinks: the first S real tokens (slot = position) take their slot, the others keep what they held;
 *   3. with keep, the window the next call continues from: the last W - 1 entries of the window held and this
 *      call's tokens, empty entries (zeros, position -1, score -inf) in front while fewer have come.
 *
 * Copies and one rounding (to nearest even, as c10::BFloat16), so the same bits.
 */
#include <stdint.h>
#include <string.h>

#include "../memory/codes.h"
#include "window.h"

/* k, v [B, T, Hkv, D] float32 -> kr (k rotated by cos, sin [B, T, rot]), vr: rounded to bfloat16 and back when
 * bf16. The window held:
 * k_prev, v_prev [B, Wp, Hkv, D] (bfloat16 when bf16, else float32), pos_prev [B, Wp], score_prev [B, Wp, Hkv];
 * retention [B, T, Hkv] (score_prev and retention NULL without a memory). sink_k, sink_v [B, S, Hkv, D] and
 * sink_pos [B, S] hold the sinks so far and are updated. With keep: new_k, new_v [B, W - 1, Hkv, D], new_pos
 * [B, W - 1], new_score [B, W - 1, Hkv] (with a memory). */
int aaren_window_prefill(int B, int T, int Hkv, int D, int Wp, int W, int S, int bf16, int keep, int rot,
                         const float *k, const float *cos, const float *sin, const float *v, const int64_t *pos,
                         const void *k_prev, const void *v_prev,
                         const int64_t *pos_prev, const float *score_prev, const float *retention, float *kr,
                         float *vr, void *sink_k, void *sink_v, int64_t *sink_pos, void *new_k, void *new_v,
                         int64_t *new_pos, float *new_score) {
    if (D < 1 || D > MAX_D) return 1;
    const int64_t HD = (int64_t)Hkv * D;
    if (aaren_rotate((int64_t)B * T, Hkv, D, rot, 0, k, cos, sin, kr)) return 1;
    if (bf16) {
        for (int64_t i = 0; i < (int64_t)B * T * HD; i++) {
            kr[i] = bf16_to_float(float_to_bf16(kr[i]));
            vr[i] = bf16_to_float(float_to_bf16(v[i]));
        }
    } else {
        memcpy(vr, v, sizeof(float) * (size_t)(B * T * HD));
    }
    for (int b = 0; b < B; b++)
        for (int s = 0; s < S; s++)
            for (int t = 0; t < T; t++) /* the first token at position s, as the reference's argmax */
                if (pos[(int64_t)b * T + t] == s) {
                    const int64_t from = ((int64_t)b * T + t) * HD, to = ((int64_t)b * S + s) * HD;
                    for (int h = 0; h < Hkv; h++) {
                        store_row(sink_k, bf16, to + h * D, kr + from + h * D, D);
                        store_row(sink_v, bf16, to + h * D, vr + from + h * D, D);
                    }
                    sink_pos[(int64_t)b * S + s] = s;
                    break;
                }
    if (!keep) return 0;
    const int Wn = W - 1, held = Wp + T;
    const int first = held - Wn > 0 ? held - Wn : 0, shortfall = Wn - held > 0 ? Wn - held : 0;
    const size_t row = (size_t)HD * (bf16 ? 2 : 4);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < Wn; i++) {
            const int64_t to = (int64_t)b * Wn + i;
            const int e = first + i - shortfall; /* entry e of window held ++ tokens, < 0: empty */
            if (e < 0) {
                memset((char *)new_k + to * row, 0, row);
                memset((char *)new_v + to * row, 0, row);
                new_pos[to] = -1;
                if (new_score)
                    for (int h = 0; h < Hkv; h++) new_score[to * Hkv + h] = -INFINITY;
                continue;
            }
            if (e < Wp) {
                const int64_t from = (int64_t)b * Wp + e;
                memcpy((char *)new_k + to * row, (const char *)k_prev + from * row, row);
                memcpy((char *)new_v + to * row, (const char *)v_prev + from * row, row);
                new_pos[to] = pos_prev[from];
                if (new_score) memcpy(new_score + to * Hkv, score_prev + from * Hkv, sizeof(float) * Hkv);
            } else {
                const int64_t from = (int64_t)b * T + e - Wp;
                store_row(new_k, bf16, to * HD, kr + from * HD, (int)HD);
                store_row(new_v, bf16, to * HD, vr + from * HD, (int)HD);
                new_pos[to] = pos[from];
                if (new_score) memcpy(new_score + to * Hkv, retention + from * Hkv, sizeof(float) * Hkv);
            }
        }
    return 0;
}
