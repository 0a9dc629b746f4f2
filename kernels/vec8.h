/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * 8 floats at a time for the C kernels (GCC/Clang vector extension): the compilers do not vectorise a float sum on
 * their own without -ffast-math, which these files must not use. exp8 and log8 round as the files that include
 * this are built: with fused multiply-adds where a file asks for them (window/chunk.c), else without.
 */
#ifndef AAREN_VEC8_H
#define AAREN_VEC8_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i32 __attribute__((vector_size(32)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));
typedef int8_t v8i8 __attribute__((vector_size(8)));

static inline v8f load8(const float *p) {
    v8f x;
    memcpy(&x, p, sizeof(x));
    return x;
}

static inline void store8(float *p, v8f x) { memcpy(p, &x, sizeof(x)); }

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* x held in a register: where a loop reads one loaded vector for several rows, GCC folds the load into each
 * multiply-add as a memory operand, and the loads (two a cycle), not the multiply-adds, bound the loop. The loop's
 * vectors must then fit the registers (window/chunk.c sizes its tiles so). Changes no result. */
#ifdef __AVX__
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) ((void)0)
#endif

/* the sum of the 8 lanes, lanes d and d + 4 first */
static inline float sum8(v8f x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* the sum of the 8 lanes, adjacent pairs first (another order: other bits) */
static inline float sum8_pairs(v8f x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

/* where mask (-1 lanes) a, else b: C's vector extension has no ?: */
static inline v8f select8(v8i32 mask, v8f a, v8f b) { return (v8f)(((v8i32)a & mask) | ((v8i32)b & ~mask)); }

/* exp of x <= 0 (-inf included) for 8 floats: Cephes' expf (x = n ln 2 + r, a degree-6 polynomial in r, 2^n in the
 * exponent bits), relative error about 1e-7; 0 below -80, where a weight no longer moves a float32 sum that holds
 * a top weight of 1 (every caller subtracts its largest first) */
static inline v8f exp8(v8f x) {
    v8i32 live = x > splat8(-80.0f);
    x = select8(live, x, splat8(-80.0f));
    v8f n = (x * splat8(1.44269504088896341f) + splat8(12582912.0f)) - splat8(12582912.0f); /* round to nearest */
    v8f r = (x - n * splat8(0.693359375f)) + n * splat8(2.12194440e-4f);
    v8f p = splat8(1.9875691500e-4f);
    p = p * r + splat8(1.3981999507e-3f);
    p = p * r + splat8(8.3334519073e-3f);
    p = p * r + splat8(4.1665795894e-2f);
    p = p * r + splat8(1.6666665459e-1f);
    p = p * r + splat8(5.0000001201e-1f);
    p = p * (r * r) + r + splat8(1.0f);
    v8i32 e = (__builtin_convertvector(n, v8i32) + 127) << 23;
    return (v8f)((v8i32)(p * (v8f)e) & live);
}

/* log of w in [1, 2] for 8 floats: Cephes' logf (w = 2^e x with x in [sqrt(1/2), sqrt(2)), a degree-9 polynomial
 * in x - 1), relative error about 1e-7. The Aaren fold's log(a + b) only sees [1, 2]: one of its weights is 1. */
static inline v8f log8(v8f w) {
    v8i32 big = w > splat8(1.41421356237f);
    v8f x = select8(big, w * splat8(0.5f), w) - splat8(1.0f);
    v8f e = select8(big, splat8(1.0f), splat8(0.0f));
    v8f z = x * x;
    v8f y = splat8(7.0376836292e-2f);
    y = y * x - splat8(1.1514610310e-1f);
    y = y * x + splat8(1.1676998740e-1f);
    y = y * x - splat8(1.2420140846e-1f);
    y = y * x + splat8(1.4249322787e-1f);
    y = y * x - splat8(1.6668057665e-1f);
    y = y * x + splat8(2.0000714765e-1f);
    y = y * x - splat8(2.4999993993e-1f);
    y = y * x + splat8(3.3333331174e-1f);
    y = y * x * z - e * splat8(2.12194440e-4f) - splat8(0.5f) * z;
    return x + y + e * splat8(0.693359375f);
}

#endif
