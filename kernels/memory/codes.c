/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * MemoryCodes.round_with_codes (aaren_hf/modeling_aaren.py, the reference) for n vectors at once: what the memory
 * would store of each (codes and a bfloat16 scale, codes.h) and what a query reads back from them. Same codes,
 * scales and values bit for bit: the codes are whole numbers, so turning them back by the +-1 matrix is exact in any
 * order, and each value is then one product with its scale, as in the reference.
 */
#include <stdint.h>

#include "codes.h"
#include "memory.h"

/* x [n, D] float32 -> codes [n, D / 2] (4 bits) or [n, D] (8 bits), scale [n] bfloat16, back [n, D] float32.
 * Returns 1, writing nothing, where D is beyond MAX_D, odd at 4 bits, or not a power of 2 with rotate. */
int aaren_memory_round(int64_t n, int D, int bits, int rotate, const float *x, float *back, uint8_t *codes,
                       uint16_t *scale) {
    if (D < 1 || D > MAX_D || (bits == 4 && D % 2) || (rotate && (D & (D - 1)))) return 1;
    const int64_t width = bits == 4 ? D / 2 : D;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *code = codes + i * width;
        encode(x + i * D, D, bits, rotate, code, scale + i);
        decode(code, scale[i], D, bits, rotate, back + i * D);
    }
    return 0;
}
