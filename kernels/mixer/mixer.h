/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * What the mixer's two calls share (defined in step.c, used by prefill.c too): the retention scores on their grid
 * and the gate's mix of the two branches. Declared once, so that both files compile against one signature.
 */
#ifndef AAREN_MIXER_H
#define AAREN_MIXER_H

#include <stdint.h>

void aaren_retention_scores(int64_t n, int Hkv, int HJ, int rule, int share, const float *retention_in,
                            const float *s, float *shared, float *retention);
void aaren_gate_mix(int64_t n, int H, int D, const float *gate, int per_token, const float *aaren, float *out);

#endif
