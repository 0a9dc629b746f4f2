/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * Rotary embedding on a CPU, one pass: rotate_by in aaren_hf/modeling_aaren.py is the reference, which takes five
 * passes over the tensor (a negation, a concatenation, two products broadcast over the heads, a sum). The same
 * float32 operations per element (two rounded products, then their rounded sum: this file is built without fused
 * multiply-adds), so the same bits.
 */
#include <stdint.h>
#include <string.h>

#include "window.h"

/* out[n, h, :rot] = x * cos + rotate_half(x) * sin, out[n, h, rot:] = x (n tokens, H heads, width D; cos and sin
 * [n, rot] with equal halves, as rotary_angles gives them); with inverse, by -sin (a gradient turned back: the sign
 * is exact, so the same bits as the reference handed -sin). Returns 1, writing nothing, for an odd rot or rot > D. */
int aaren_rotate(int64_t n, int H, int D, int rot, int inverse, const float *x, const float *cos,
                 const float *sin, float *out) {
    if (rot % 2 || rot > D || rot < 0) return 1;
    const int half = rot / 2;
    const float sign = inverse ? -1.0f : 1.0f;
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos + t * rot, *s = sin + t * rot;
        for (int h = 0; h < H; h++) {
            const float *xi = x + (t * H + h) * D;
            float *o = out + (t * H + h) * D;
            for (int d = 0; d < half; d++) o[d] = xi[d] * c[d] + -xi[d + half] * (sign * s[d]);
            for (int d = half; d < rot; d++) o[d] = xi[d] * c[d] + xi[d - half] * (sign * s[d]);
            if (rot < D) memcpy(o + rot, xi + rot, sizeof(float) * (D - rot));
        }
    }
    return 0;
}

