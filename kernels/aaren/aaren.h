/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * The Aaren branch's C calls (step.c, which says what they compute): one decode token, and a prompt token after token.
 * Their one declaration: step.c includes it, and so do the mixer's calls that compose them (mixer/step.c,
 * mixer/prefill.c), so a signature that drifts fails to compile instead of passing the wrong arguments.
 */
#ifndef AAREN_AAREN_H
#define AAREN_AAREN_H

#include <math.h>
#include <stdint.h>

/* torch.lerp's formula, exact at both ends: the scan's update here and the gate's mix of the branches (mixer/step.c),
 * as the PyTorch code computes both */
static inline float lerp(float a, float b, float w) {
    return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

int aaren_branch_step(int B, int H, int Hkv, int D, int J, int decay, float scale,
                      const float *q, const float *k, const float *v, const uint8_t *keep,
                      const float *queries, const float *log_decay, const float *decay_in,
                      const float *o_in, const float *lse_in,
                      float *o_new, float *lse_new, float *s, float *out);
int aaren_branch_prefill(int B, int T, int H, int Hkv, int D, int J, int decay, float scale, const float *q,
                         const float *k, const float *v, const uint8_t *keep, const float *queries,
                         const float *log_decay, const float *decay_in, float *o, float *lse, float *s, float *out);

#endif
