/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * The one-token decode step of the window branch on a CPU, in one call: what AarenMixer.window_step (the PyTorch
 * reference, aaren_hf/modeling_aaren.py) does in about 170 small operators per layer, for any token: one among
 * the first S positions also fills its sink slot (in place), a padding token (position -1) gets output 0.
 *
 *   1. the token's query and key rotated at its position; its key and value stored as the window stores them;
 *   2. one softmax over the window (W - 1 entries + the token), the sinks (keys turned by p - (S + W - 1)) and the
 *      memory (codes read back), each kv head's G query heads over its keys;
 *   3. the oldest window entry offered to the memory (it takes the weakest slot if it beats it) and coded;
 *   4. the window shifted by one into the new_win_* buffers (the state the reference leaves, bit for bit); they may
 *      be the win_* buffers themselves (the window updated in place).
 *
 * Every value the state keeps is computed with the reference's float32 operations in its order (rotary as two
 * products and a sum, the Hadamard butterflies, the bfloat16 rounding of scales and keys, round-half-even codes),
 * so the state is the same bit for bit; built with -ffp-contract=off and without -ffast-math for that. The
 * attention output is a float32 sum in another order: equal to rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../memory/codes.h" /* MAX_D, bfloat16, 8-float vectors, the memory's codes */
#include "window.h"

#define MAX_G 16

static inline void store(void *p, int bf16, int64_t i, float x) {
    if (bf16) ((uint16_t *)p)[i] = float_to_bf16(x);
    else ((float *)p)[i] = x;
}

static inline float dot(const float *a, const float *b, int D) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int d = 0;
    for (; d + 8 <= D; d += 8) acc += load8(a + d) * load8(b + d);
    float s = sum8_pairs(acc);
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

static inline void axpy(float *y, float w, const float *x, int D) {
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        v8f r = load8(y + d) + w * load8(x + d);
        memcpy(y + d, &r, sizeof(r));
    }
    for (; d < D; d++) y[d] += w * x[d];
}

/* rotate-half rotary on the first rot channels, as modeling_aaren.rotate_by: x * cos + rotate_half(x) * sin */
static void rotary(const float *x, const float *c, const float *s, int rot, int D, float *out) {
    int half = rot / 2;
    for (int d = 0; d < rot; d++) {
        float partner = d < half ? -x[d + half] : x[d - half];
        float a = x[d] * c[d];
        float b = partner * s[d];
        out[d] = a + b;
    }
    for (int d = rot; d < D; d++) out[d] = x[d];
}

/* whether aaren_window_step takes these shapes (where not, it returns 1 and writes nothing) */
int aaren_window_step_takes(int H, int Hkv, int D, int rotate) {
    return D <= MAX_D && H / Hkv <= MAX_G && !(rotate && (D & (D - 1)));
}

int aaren_window_step(
    int B, int H, int Hkv, int D, int rot, int W, int S, int M, int bf16, int bits, int rotate, float scale,
    const float *q, const float *k, const float *v, const int64_t *pos,              /* [B, H|Hkv, D], [B] */
    const float *cos_t, const float *sin_t, const float *cos_s, const float *sin_s,  /* [B, rot] */
    const void *win_k, const void *win_v, const int64_t *win_pos, const float *win_score, /* W - 1 entries */
    void *sink_k, void *sink_v, int64_t *sink_pos, /* a token among the first S is written into its slot */
    void *mem_k, void *mem_v, uint16_t *mem_k_scale, uint16_t *mem_v_scale, int64_t *mem_pos, float *mem_score,
    const float *retention,                                                           /* [B, Hkv] */
    float *out, void *new_win_k, void *new_win_v, int64_t *new_win_pos, float *new_win_score) {
    int G = H / Hkv;
    if (!aaren_window_step_takes(H, Hkv, D, rotate)) return 1; /* not this kernel's: the caller falls back */
    int Wp = W - 1, N = W + S + M;
    int64_t code_width = bits == 4 ? D / 2 : D; /* per memory entry, in elements of its array */
    float qr[MAX_G][MAX_D], qs[MAX_G][MAX_D], acc[MAX_G][MAX_D], accm[MAX_G][MAX_D];
    float key[MAX_D], val[MAX_D], knew[MAX_D], vnew[MAX_D], x[MAX_D], y[MAX_D];
    /* [G, N]: scores, then weights; then the token's stored keys and values [Hkv, D] each, written into the window
     * once it has shifted (in place, the shift would otherwise move them); then the filled memory slots' indices */
    float *scores = malloc(sizeof(float) * ((size_t)G * N + 2 * (size_t)Hkv * D) + sizeof(int64_t) * (size_t)M);
    if (!scores) return 2;
    float *tok_k = scores + (size_t)G * N, *tok_v = tok_k + (size_t)Hkv * D;
    int64_t *filled = (int64_t *)(tok_v + (size_t)Hkv * D);
    for (int b = 0; b < B; b++) {
        int64_t p = pos[b];
        const float *ct = cos_t + (int64_t)b * rot, *st = sin_t + (int64_t)b * rot;
        const float *cs = cos_s + (int64_t)b * rot, *ss = sin_s + (int64_t)b * rot;
        for (int h = 0; h < Hkv; h++) {
            int64_t row = (int64_t)b * Hkv + h;
            /* the token: key rotated and stored as the window stores it (rounded), value stored */
            rotary(k + row * D, ct, st, rot, D, x);
            for (int d = 0; d < D; d++) {
                knew[d] = bf16 ? bf16_to_float(float_to_bf16(x[d])) : x[d];
                vnew[d] = bf16 ? bf16_to_float(float_to_bf16(v[row * D + d])) : v[row * D + d];
            }
            if (p >= 0 && p < S) { /* the token fills sink slot p (it is also the window's newest entry) */
                for (int d = 0; d < D; d++) {
                    store(sink_k, bf16, (((int64_t)b * S + p) * Hkv + h) * D + d, knew[d]);
                    store(sink_v, bf16, (((int64_t)b * S + p) * Hkv + h) * D + d, vnew[d]);
                }
            }
            if (p < 0) { /* a padding token sees nothing: output 0; it still enters the window (position -1) */
                memset(out + ((int64_t)b * H + h * G) * D, 0, sizeof(float) * G * D);
                goto leave;
            }
            for (int g = 0; g < G; g++) {
                rotary(q + ((int64_t)b * H + h * G + g) * D, ct, st, rot, D, qr[g]);
                memcpy(qs[g], qr[g], sizeof(float) * D);
                if (rotate && M > 0) butterflies(qs[g], D); /* <q S, k S / D> = <q, k> */
            }
            /* scores: window (oldest first, then the token), sinks, memory; -INFINITY where nothing is there */
            int n = 0;
            for (int j = 0; j < W; j++, n++) {
                int64_t kp = j < Wp ? win_pos[(int64_t)b * Wp + j] : p;
                const float *kk = knew;
                if (j < Wp) {
                    load_row(key, win_k, bf16, (((int64_t)b * Wp + j) * Hkv + h) * D, D);
                    kk = key;
                }
                for (int g = 0; g < G; g++) scores[g * N + n] = kp >= 0 ? dot(qr[g], kk, D) * scale : -INFINITY;
            }
            for (int i = 0; i < S; i++, n++) {
                int64_t sp = sink_pos[(int64_t)b * S + i];
                if (sp > p - W) sp = -1; /* still inside the window: seen there, not as a sink */
                load_row(x, sink_k, bf16, (((int64_t)b * S + i) * Hkv + h) * D, D);
                rotary(x, cs, ss, rot, D, key);
                for (int g = 0; g < G; g++) scores[g * N + n] = sp >= 0 ? dot(qr[g], key, D) * scale : -INFINITY;
            }
            /* the filled slots only: an empty one's weight is 0, which adds nothing to the sum (the same bits), while
             * its score would cost a pass over the whole memory in each loop below until the memory fills. The list is
             * built without a branch (a branch per slot in both loops measured slower); a full memory is read by slot
             * number, not through the list (loading each index cost that step about 8%) */
            int n_filled = 0;
            for (int m = 0; m < M; m++) {
                filled[n_filled] = row * M + m;
                n_filled += mem_pos[row * M + m] >= 0;
            }
            for (int f = 0; f < n_filled; f++, n++) {
                read_entry(mem_k, mem_k_scale, n_filled == M ? row * M + f : filled[f], D, bits, bf16, key);
                for (int g = 0; g < G; g++) scores[g * N + n] = dot(qs[g], key, D) * scale;
            }
            int used = n;
            /* softmax and the weighted values; the memory's rotated values are turned back once, at the end */
            for (int g = 0; g < G; g++) {
                float top = -INFINITY, sum = 0.0f;
                for (int j = 0; j < used; j++) top = scores[g * N + j] > top ? scores[g * N + j] : top;
                for (int j = 0; j < used; j++) {
                    float w = scores[g * N + j] == -INFINITY ? 0.0f : expf(scores[g * N + j] - top);
                    scores[g * N + j] = w;
                    sum += w;
                }
                for (int j = 0; j < used; j++) scores[g * N + j] /= sum;
                memset(acc[g], 0, sizeof(float) * D);
                memset(accm[g], 0, sizeof(float) * D);
            }
            n = 0;
            for (int j = 0; j < W; j++, n++) {
                const float *vv = vnew;
                if (j < Wp) {
                    load_row(val, win_v, bf16, (((int64_t)b * Wp + j) * Hkv + h) * D, D);
                    vv = val;
                }
                for (int g = 0; g < G; g++) if (scores[g * N + n] != 0.0f) axpy(acc[g], scores[g * N + n], vv, D);
            }
            for (int i = 0; i < S; i++, n++) {
                load_row(val, sink_v, bf16, (((int64_t)b * S + i) * Hkv + h) * D, D);
                for (int g = 0; g < G; g++) if (scores[g * N + n] != 0.0f) axpy(acc[g], scores[g * N + n], val, D);
            }
            for (int f = 0; f < n_filled; f++, n++) {
                read_entry(mem_v, mem_v_scale, n_filled == M ? row * M + f : filled[f], D, bits, bf16, val);
                for (int g = 0; g < G; g++) if (scores[g * N + n] != 0.0f) axpy(accm[g], scores[g * N + n], val, D);
            }
            for (int g = 0; g < G; g++) {
                if (rotate && M > 0) butterflies(accm[g], D);
                float *o = out + ((int64_t)b * H + h * G + g) * D;
                for (int d = 0; d < D; d++) o[d] = acc[g][d] + accm[g][d];
            }

        leave:
            /* the oldest window entry leaves: into the weakest memory slot if it ranks (offer_to_memory's rule) */
            if (M > 0) {
                float s0 = win_score[((int64_t)b * Wp) * Hkv + h];
                int64_t p0 = win_pos[(int64_t)b * Wp];
                float low = INFINITY;
                for (int m = 0; m < M; m++) low = mem_score[row * M + m] < low ? mem_score[row * M + m] : low;
                if (s0 >= low && p0 >= S) {
                    int slot = -1;
                    for (int m = 0; m < M; m++)
                        if (mem_score[row * M + m] == low && (slot < 0 || mem_pos[row * M + m] < mem_pos[row * M + slot]))
                            slot = m;
                    int64_t e = row * M + slot;
                    load_row(x, win_k, bf16, (((int64_t)b * Wp) * Hkv + h) * D, D);
                    load_row(y, win_v, bf16, (((int64_t)b * Wp) * Hkv + h) * D, D);
                    if (bits == 0) {
                        for (int d = 0; d < D; d++) {
                            store(mem_k, bf16, e * D + d, x[d]);
                            store(mem_v, bf16, e * D + d, y[d]);
                        }
                    } else {
                        encode(x, D, bits, rotate, (uint8_t *)mem_k + e * code_width, mem_k_scale + e);
                        encode(y, D, bits, rotate, (uint8_t *)mem_v + e * code_width, mem_v_scale + e);
                    }
                    mem_pos[e] = p0;
                    mem_score[e] = s0;
                }
            }
            memcpy(tok_k + (size_t)h * D, knew, sizeof(float) * D);
            memcpy(tok_v + (size_t)h * D, vnew, sizeof(float) * D);
        }
        /* the window shifted by one: entries 1 .. W - 2 of row b are contiguous ([B, W - 1, Hkv, D]); memmove, as
         * new_win_* may be win_* */
        size_t width = bf16 ? 2 : 4, entry = (size_t)Hkv * D * width, first = (size_t)b * Wp * entry;
        if (Wp > 1) {
            memmove((char *)new_win_k + first, (const char *)win_k + first + entry, (size_t)(Wp - 1) * entry);
            memmove((char *)new_win_v + first, (const char *)win_v + first + entry, (size_t)(Wp - 1) * entry);
            if (M > 0)
                memmove(new_win_score + (int64_t)b * Wp * Hkv, win_score + ((int64_t)b * Wp + 1) * Hkv,
                        sizeof(float) * (Wp - 1) * Hkv);
        }
        /* then the token, last in the shifted window */
        for (int h = 0; h < Hkv; h++) {
            for (int d = 0; d < D; d++) {
                int64_t to = (((int64_t)b * Wp + Wp - 1) * Hkv + h) * D + d;
                store(new_win_k, bf16, to, tok_k[(size_t)h * D + d]);
                store(new_win_v, bf16, to, tok_v[(size_t)h * D + d]);
            }
            if (M > 0) new_win_score[((int64_t)b * Wp + Wp - 1) * Hkv + h] = retention[(int64_t)b * Hkv + h];
        }
        if (p >= 0 && p < S) sink_pos[(int64_t)b * S + p] = p;
        for (int j = 0; j + 1 < Wp; j++) new_win_pos[(int64_t)b * Wp + j] = win_pos[(int64_t)b * Wp + j + 1];
        new_win_pos[(int64_t)b * Wp + Wp - 1] = p;
    }
    free(scores);
    return 0;
}
