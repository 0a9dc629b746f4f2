/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * The memory's codes in C, for the kernels that read or write them (window/step.c, memory/codes.c): MemoryCodes in
 * aaren_hf/modeling_aaren.py is the reference. Every value is the reference's float32 operations in its order (the
 * Hadamard butterflies, the bfloat16 rounding of the scale, round-half-even codes), so codes, scales and decoded
 * values are the same bit for bit; the files that include this are built with -ffp-contract=off and without
 * -ffast-math for that.
 */
#ifndef AAREN_MEMORY_CODES_H
#define AAREN_MEMORY_CODES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../vec8.h"

#define MAX_D 256

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, as c10::BFloat16 */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* row of D elements at element offset off of a float32 or bfloat16 array, as float32 */
static inline void load_row(float *dst, const void *src, int bf16, int64_t off, int D) {
    if (!bf16) {
        memcpy(dst, (const float *)src + off, sizeof(float) * D);
        return;
    }
    const uint16_t *h = (const uint16_t *)src + off;
    for (int d = 0; d < D; d++) {
        uint32_t u = (uint32_t)h[d] << 16;
        memcpy(dst + d, &u, 4);
    }
}

/* load_row's inverse: D float32 values to element offset off of a float32 or bfloat16 array (rounded to nearest
 * even, as c10::BFloat16) */
static inline void store_row(void *dst, int bf16, int64_t off, const float *x, int D) {
    if (!bf16) {
        memcpy((float *)dst + off, x, sizeof(float) * D);
        return;
    }
    uint16_t *h = (uint16_t *)dst + off;
    for (int d = 0; d < D; d++) h[d] = float_to_bf16(x[d]);
}

/* x times the +-1 Sylvester-Hadamard matrix, as modeling_aaren.hadamard's butterflies (without its 1 / D): the top
 * bit of the index is paired each round and becomes the lowest. For D a multiple of 16, eight pairs at a time: the
 * same sums of the same pairs, so the same bits; with D known when compiled (the common head widths) the rounds run
 * in registers. */
static inline __attribute__((always_inline)) void butterflies_by_8(float *x, const int D) {
    v8f r[MAX_D / 8], t[MAX_D / 8];
    for (int i = 0; i < D / 8; i++) r[i] = load8(x + 8 * i);
    for (int n = D; n > 1; n >>= 1) {
        for (int i = 0; i < D / 16; i++) {
            v8f a = r[i], b = r[i + D / 16], s = a + b, d = a - b;
            t[2 * i] = __builtin_shuffle(s, d, (v8i32){0, 8, 1, 9, 2, 10, 3, 11});
            t[2 * i + 1] = __builtin_shuffle(s, d, (v8i32){4, 12, 5, 13, 6, 14, 7, 15});
        }
        for (int i = 0; i < D / 8; i++) r[i] = t[i];
    }
    for (int i = 0; i < D / 8; i++) store8(x + 8 * i, r[i]);
}

static inline void butterflies(float *x, int D) {
    switch (D) {
    case 64: butterflies_by_8(x, 64); return;
    case 128: butterflies_by_8(x, 128); return;
    case 32: butterflies_by_8(x, 32); return;
    case 256: butterflies_by_8(x, 256); return;
    case 16: butterflies_by_8(x, 16); return;
    }
    float t[MAX_D];
    for (int n = D; n > 1; n >>= 1) {
        int half = D / 2;
        for (int i = 0; i < half; i++) {
            t[2 * i] = x[i] + x[i + half];
            t[2 * i + 1] = x[i] - x[i + half];
        }
        memcpy(x, t, sizeof(float) * D);
    }
}

/* the largest |x[d]|, NaN if any is (the scale then codes nothing) */
static inline float largest_magnitude(const float *x, int D) {
    float amax = 0.0f;
    int d = 0;
    if (D % 8 == 0) {
        v8f m = splat8(0.0f);
        v8i32 nan = {0};
        for (; d < D; d += 8) {
            v8f a = (v8f)((v8i32)load8(x + d) & 0x7fffffff);
            nan |= a != a;
            m = select8(a > m, a, m);
        }
        for (int l = 0; l < 8; l++) {
            if (nan[l]) return NAN;
            if (m[l] > amax) amax = m[l];
        }
        return amax;
    }
    for (; d < D; d++) {
        float a = fabsf(x[d]);
        if (a > amax || isnan(a)) amax = a;
    }
    return amax;
}

/* MemoryCodes.encode of one vector: codes (D / 2 bytes at 4 bits, D at 8) and a bfloat16 scale. Eight channels at a
 * time where the widths allow and the scale is finite: there |x / den| <= top (1 + 2^-8), where adding and taking
 * away 1.5 * 2^23 rounds half to even as rintf does. */
static inline void encode(const float *x_in, int D, int bits, int rotate, uint8_t *codes, uint16_t *scale) {
    float x[MAX_D];
    float top = bits == 8 ? 127.0f : 7.0f;
    int d = 0;
    if (rotate)
        for (; d + 8 <= D; d += 8) store8(x + d, load8(x_in + d) / (float)D);
    for (; d < D; d++) x[d] = rotate ? x_in[d] / (float)D : x_in[d];
    if (rotate) butterflies(x, D);
    float amax = largest_magnitude(x, D);
    uint16_t sc = float_to_bf16(amax / top);
    float den = bf16_to_float(sc);
    if (den < 1.17549435e-38f) den = 1.17549435e-38f; /* clamp(min=finfo(float32).tiny) */
    int half = D / 2;
    if (amax <= 3.40282347e38f && D % (bits == 8 ? 8 : 16) == 0) {
        v8f magic = splat8(12582912.0f), hi = splat8(top), lo = splat8(-top);
        for (d = 0; d < (bits == 8 ? D : half); d += 8) {
            v8f q = (load8(x + d) / den + magic) - magic;
            q = select8(q < lo, lo, select8(q > hi, hi, q));
            if (bits == 8) {
                v8i8 c = __builtin_convertvector(__builtin_convertvector(q, v8i32), v8i8);
                memcpy(codes + d, &c, 8);
                continue;
            }
            v8f q2 = (load8(x + d + half) / den + magic) - magic;
            q2 = select8(q2 < lo, lo, select8(q2 > hi, hi, q2));
            v8i32 packed = __builtin_convertvector(q + 8.0f, v8i32) | (__builtin_convertvector(q2 + 8.0f, v8i32) << 4);
            v8u8 c = __builtin_convertvector(packed, v8u8);
            memcpy(codes + d, &c, 8);
        }
        *scale = sc;
        return;
    }
    float c[MAX_D];
    for (d = 0; d < D; d++) {
        float q = rintf(x[d] / den);
        c[d] = q < -top ? -top : (q > top ? top : q);
    }
    if (bits == 8) {
        for (d = 0; d < D; d++) ((int8_t *)codes)[d] = (int8_t)c[d];
    } else {
        for (d = 0; d < half; d++)
            codes[d] = (uint8_t)((uint8_t)(c[d] + 8.0f) | ((uint8_t)(c[d + half] + 8.0f) << 4));
    }
    *scale = sc;
}

/* MemoryCodes.decode of one vector's codes (4 or 8 bits) and bfloat16 scale: whole numbers turned back by the +-1
 * matrix (exact in any order), then each one product with the scale, as in the reference */
static inline void decode(const uint8_t *code, uint16_t scale, int D, int bits, int rotate, float *out) {
    float c[MAX_D];
    const int half = D / 2;
    int d = 0;
    if (bits == 8) {
        for (; d + 8 <= D; d += 8) {
            v8i8 x8;
            memcpy(&x8, code + d, 8);
            store8(c + d, __builtin_convertvector(x8, v8f));
        }
        for (; d < D; d++) c[d] = (float)((const int8_t *)code)[d];
    } else {
        for (; d + 8 <= half; d += 8) {
            v8u8 x4;
            memcpy(&x4, code + d, 8);
            store8(c + d, __builtin_convertvector(__builtin_convertvector(x4 & 15, v8i32) - 8, v8f));
            store8(c + d + half, __builtin_convertvector(__builtin_convertvector(x4 >> 4, v8i32) - 8, v8f));
        }
        for (; d < half; d++) {
            c[d] = (float)((int)(code[d] & 15) - 8);
            c[d + half] = (float)((int)(code[d] >> 4) - 8);
        }
    }
    if (rotate) butterflies(c, D);
    const float sc = bf16_to_float(scale);
    for (d = 0; d + 8 <= D; d += 8) store8(out + d, load8(c + d) * sc);
    for (; d < D; d++) out[d] = c[d] * sc;
}

/* memory entry e as a query reads it (MemoryCodes.decode, rotated codes left rotated); bits 0: no codes, stored as
 * the window stores keys and values */
static inline void read_entry(const void *mem, const uint16_t *scales, int64_t e, int D, int bits, int bf16, float *out) {
    if (bits == 0) {
        load_row(out, mem, bf16, e * D, D);
        return;
    }
    float sc = bf16_to_float(scales[e]);
    int d = 0;
    if (bits == 8) {
        const int8_t *c = (const int8_t *)mem + e * D;
        for (; d + 8 <= D; d += 8) {
            v8i8 x;
            memcpy(&x, c + d, 8);
            v8f r = __builtin_convertvector(x, v8f) * sc;
            memcpy(out + d, &r, sizeof(r));
        }
        for (; d < D; d++) out[d] = (float)c[d] * sc;
    } else {
        int half = D / 2;
        const uint8_t *c = (const uint8_t *)mem + e * half;
        for (; d + 8 <= half; d += 8) {
            v8u8 x;
            memcpy(&x, c + d, 8);
            v8f lo = __builtin_convertvector(__builtin_convertvector(x & 15, v8i32) - 8, v8f) * sc;
            v8f hi = __builtin_convertvector(__builtin_convertvector(x >> 4, v8i32) - 8, v8f) * sc;
            memcpy(out + d, &lo, sizeof(lo));
            memcpy(out + d + half, &hi, sizeof(hi));
        }
        for (; d < half; d++) {
            out[d] = (float)((int)(c[d] & 15) - 8) * sc;
            out[d + half] = (float)((int)(c[d] >> 4) - 8) * sc;
        }
    }
}

#endif
