/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * The window branch's C calls, declared once (each file that defines or calls one includes this): the rotary
 * embedding (rotate.c), a prompt's window bookkeeping (prefill.c), a prompt's queries and the window attention
 * forward and backward (chunk.c), and the one-token decode step (step.c). Each file says what its calls compute.
 */
#ifndef AAREN_WINDOW_H
#define AAREN_WINDOW_H

#include <stdint.h>

int aaren_rotate(int64_t n, int H, int D, int rot, int inverse, const float *x, const float *cos, const float *sin,
                 float *out);

int aaren_window_prefill(int B, int T, int Hkv, int D, int Wp, int W, int S, int bf16, int keep, int rot,
                         const float *k, const float *cos, const float *sin, const float *v, const int64_t *pos,
                         const void *k_prev, const void *v_prev, const int64_t *pos_prev, const float *score_prev,
                         const float *retention, float *kr, float *vr, void *sink_k, void *sink_v,
                         int64_t *sink_pos, void *new_k, void *new_v, int64_t *new_pos, float *new_score);

int aaren_window_queries(int B, int T, int H, int Hkv, int D, int S, int W, int rot, const float *q,
                         const int64_t *qpos, const float *cos, const float *sin, const float *sink_k,
                         const int64_t *sink_pos, const float *back_cos, const float *back_sin, float *qr,
                         float *scores);
int aaren_window_attention_takes(int H, int Hkv, int D);
int aaren_window_attention(int B, int T, int H, int Hkv, int D, int64_t Ls, int64_t P0, int W, int64_t C, int S,
                           float scale, int threads, const float *q, const int64_t *qpos, const float *ks,
                           const float *vs, const int64_t *spos, const float *mk, const float *mv,
                           const int64_t *evict, const int64_t *last, const float *sink_s, const float *sink_v,
                           const int64_t *sink_pos, float *out);
int aaren_window_attention_backward(int B, int T, int H, int Hkv, int D, int64_t Ls, int64_t P0, int W, int64_t C,
                                    int S, float scale, int threads, const float *q, const int64_t *qpos,
                                    const float *ks, const float *vs, const int64_t *spos, const float *mk,
                                    const float *mv, const int64_t *evict, const int64_t *last, const float *sink_s,
                                    const float *sink_v, const int64_t *sink_pos, const float *dout, float *dq,
                                    float *dks, float *dvs, float *dmk, float *dmv, float *dsink_s, float *dsink_v);

int aaren_window_step_takes(int H, int Hkv, int D, int rotate);
int aaren_window_step(
    int B, int H, int Hkv, int D, int rot, int W, int S, int M, int bf16, int bits, int rotate, float scale,
    const float *q, const float *k, const float *v, const int64_t *pos,
    const float *cos_t, const float *sin_t, const float *cos_s, const float *sin_s,
    const void *win_k, const void *win_v, const int64_t *win_pos, const float *win_score,
    void *sink_k, void *sink_v, int64_t *sink_pos,
    void *mem_k, void *mem_v, uint16_t *mem_k_scale, uint16_t *mem_v_scale, int64_t *mem_pos, float *mem_score,
    const float *retention,
    float *out, void *new_win_k, void *new_win_v, int64_t *new_win_pos, float *new_win_score);

#endif
