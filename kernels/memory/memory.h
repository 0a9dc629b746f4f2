/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * The memory's C calls, declared once (each file that defines or calls one includes this): the coding of vectors
 * (codes.c), the ranking sweep (evict.c) and a prompt's candidates and next memory (prefill.c). codes.h holds the
 * coding itself, inline, for the kernels that code or decode as they go.
 */
#ifndef AAREN_MEMORY_H
#define AAREN_MEMORY_H

#include <stdint.h>

int aaren_memory_round(int64_t n, int D, int bits, int rotate, const float *x, float *back, uint8_t *codes,
                       uint16_t *scale);
int aaren_memory_evict(int rows, int C, int upto, int M, int num_sinks, const int64_t *pos, const float *score,
                       int64_t *evict);
int aaren_memory_prefill(int B, int Hkv, int D, int M, int held, int Wp, int T, int W, int S, int bits, int rotate,
                         int prev_bf16, int keep, const void *k_prev, const void *v_prev, const float *k,
                         const float *v, const int64_t *pos_prev, const int64_t *pos, const float *score_prev,
                         const float *retention, const uint8_t *mem_k, const uint8_t *mem_v, const uint16_t *mem_ks,
                         const uint16_t *mem_vs, const int64_t *mem_pos, const float *mem_score, float *cand_k,
                         float *cand_v, int64_t *evict, int64_t *last, uint8_t *new_k, uint8_t *new_v,
                         uint16_t *new_ks, uint16_t *new_vs, int64_t *new_pos, float *new_score);

#endif
