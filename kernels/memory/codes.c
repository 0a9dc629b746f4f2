/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * MemoryCodes.round_with_codes (aaren_hf/modeling_aaren.py, the reference) for n vectors at once: what the memory
 * would store of each (codes and a bfloat16 scale, codes.h) and what a query reads back from them. Same codes,
 * scales and values bit for bit: the codes are whole numbers, so turning them back by the +-1 matrix is exact in any
 * order, and each value is then one product with its scale, as in the reference.
 */
#include <stdint.h>

#include "codes.h"

/* x [n, D] float32 -> codes [n, D / 2] (4 bits) or [n, D] (8 bits), scale [n] bfloat16, back [n, D] float32.
 * Returns 1, writing nothing, where D is beyond MAX_D, odd at 4 bits, or not a power of 2 with rotate. */
int aaren_memory_round(int64_t n, int D, int bits, int rotate, const float *x, float *back, uint8_t *codes,
                       uint16_t *scale) {
    if (D < 1 || D > MAX_D || (bits == 4 && D % 2) || (rotate && (D & (D - 1)))) return 1;
    const int64_t width = bits == 4 ? D / 2 : D;
    const int half = D / 2;
    float c[MAX_D];
    for (int64_t i = 0; i < n; i++) {
        uint8_t *code = codes + i * width;
        encode(x + i * D, D, bits, rotate, code, scale + i);
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
        const float sc = bf16_to_float(scale[i]);
        float *out = back + i * D;
        for (d = 0; d + 8 <= D; d += 8) store8(out + d, load8(c + d) * sc);
        for (; d < D; d++) out[d] = c[d] * sc;
    }
    return 0;
}
