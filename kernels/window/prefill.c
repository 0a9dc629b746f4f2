/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * The window branch's attention over a prompt on a CPU, without gradients: window_attention_triton's arguments and
 * results (kernels/window/chunk.py, whose docstring states what a query sees) in one C call. Reference: the PyTorch
 * path of window_attention in aaren_hf/modeling_aaren.py, which gathers every block's keys and values into padded
 * tensors, builds an additive mask and calls fused attention; here each block of QB queries reads the keys some query
 * of it sees (the window rows of the block, the memory candidates in the memory between its first and last query),
 * decides per query and key what is seen from positions and indices, and scores them in small register tiles:
 *
 *    window    stream row r, query i (stream row P0 + i):  P0 + i - W < r <= P0 + i  and  spos[r] >= 0
 *    memory    candidate c:                                c <= last[i] < evict[c]
 *    sinks     sink s: its score (computed outside: the query is rotated to another position for it) where seen
 *
 * Each query's own keys (64 of the window, what the memory holds) instead of the widest block's: at 1,000 tokens
 * about 0.7x the keys the PyTorch path scores. A float32 softmax in another order than the reference's (and exp by a
 * polynomial, relative error about 1e-7): equal to rounding. The score and value products contract to fused
 * multiply-adds here (the files that must round as PyTorch does are built without them; this one's results are
 * compared to rounding only).
 */
#pragma GCC optimize("fp-contract=fast")

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

#define QB 16  /* queries per block: each reads QB + W - 1 window rows, so fewer means less waste, more passes */
#define KT 32  /* keys per score tile (4 vectors) */
#define RT 4   /* rows (query, head) per tile */
#define MAX_G 16
#define MAX_THREADS 256

static inline v8f load8(const float *p) {
    v8f x;
    memcpy(&x, p, sizeof(x));
    return x;
}

static inline void store8(float *p, v8f x) { memcpy(p, &x, sizeof(x)); }

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* exp of x <= 0 (-inf included) for 8 floats: Cephes' expf (x = n ln 2 + r, a degree-6 polynomial in r, 2^n in the
 * exponent bits); 0 below -80, where a weight no longer moves a float32 sum that holds the row's top weight 1 */
static inline v8f exp8(v8f x) {
    v8i live = x > splat(-80.0f);
    x = (v8f)(((v8i)x & live) | ((v8i)splat(-80.0f) & ~live));
    v8f n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f); /* round to nearest */
    v8f r = (x - n * splat(0.693359375f)) + n * splat(2.12194440e-4f);
    v8f p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    return (v8f)((v8i)(p * (v8f)e) & live);
}

/* S[r][k0 .. k0 + KT) = <Q[r], key k> for RT rows: Q [rows][D], Kt [D][ldk] (keys transposed) */
static inline void score_tile(const float *Q, int D, const float *Kt, int64_t ldk, int k0, float *S, int64_t lds) {
    v8f acc[RT][4];
    memset(acc, 0, sizeof(acc));
    for (int d = 0; d < D; d++) {
        const float *kt = Kt + (int64_t)d * ldk + k0;
        v8f k_0 = load8(kt), k_1 = load8(kt + 8), k_2 = load8(kt + 16), k_3 = load8(kt + 24);
        for (int r = 0; r < RT; r++) {
            v8f qv = splat(Q[(int64_t)r * D + d]);
            acc[r][0] += qv * k_0;
            acc[r][1] += qv * k_1;
            acc[r][2] += qv * k_2;
            acc[r][3] += qv * k_3;
        }
    }
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < 4; j++) store8(S + r * lds + k0 + 8 * j, acc[r][j]);
}

/* O[r] += sum over keys k in [k0, k1) of P[r][k] V[k] for RT rows, dims [d0, d0 + 8 nv) (nv = 4 or 1) */
static inline void value_tile(const float *P, int64_t ldp, const float *V, int D, int k0, int k1, int d0, int nv,
                              float *O) {
    v8f acc[RT][4];
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = load8(O + (int64_t)r * D + d0 + 8 * j);
    for (int k = k0; k < k1; k++) {
        const float *vk = V + (int64_t)k * D + d0;
        if (nv == 4) {
            v8f v_0 = load8(vk), v_1 = load8(vk + 8), v_2 = load8(vk + 16), v_3 = load8(vk + 24);
            for (int r = 0; r < RT; r++) {
                v8f p = splat(P[r * ldp + k]);
                acc[r][0] += p * v_0;
                acc[r][1] += p * v_1;
                acc[r][2] += p * v_2;
                acc[r][3] += p * v_3;
            }
        } else {
            v8f v_0 = load8(vk);
            for (int r = 0; r < RT; r++) acc[r][0] += splat(P[r * ldp + k]) * v_0;
        }
    }
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < nv; j++) store8(O + (int64_t)r * D + d0 + 8 * j, acc[r][j]);
}

static inline void values(const float *P, int64_t ldp, const float *V, int D, int k0, int k1, float *O) {
    int d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) value_tile(P, ldp, V, D, k0, k1, d0, 4, O);
    for (; d0 < D; d0 += 8) value_tile(P, ldp, V, D, k0, k1, d0, 1, O);
}

/* whether aaren_window_prefill takes these shapes (where not, it returns 1 and writes nothing) */
int aaren_window_prefill_takes(int H, int Hkv, int D) { return D % 8 == 0 && H % Hkv == 0 && H / Hkv <= MAX_G; }

typedef struct {
    int B, T, H, Hkv, D, W, S;
    int64_t Ls, P0, C;
    float scale;
    const float *q, *ks, *vs, *mk, *mv, *sink_s, *sink_v;
    const int64_t *qpos, *spos, *evict, *last;
    const uint8_t *sink_seen;
    float *out;
    int threads, tid, rc;
} job;

/* the blocks tid, tid + threads, ... of all (sequence, kv head, block of QB queries): later blocks read more of the
 * memory, so interleaving them shares the work evenly */
static void *attend(void *arg) {
    job *j = arg;
    int B = j->B, T = j->T, H = j->H, Hkv = j->Hkv, D = j->D, W = j->W, S = j->S;
    int64_t Ls = j->Ls, P0 = j->P0, C = j->C;
    int G = H / Hkv;
    int rows = QB * G, rows_p = (rows + RT - 1) / RT * RT;
    int64_t kmax = QB + W - 1 + C, kpad = (kmax + KT - 1) / KT * KT;
    int S8 = (S + 7) / 8 * 8;
    int64_t ldp = kpad + S8;
    float *Kt = malloc(sizeof(float) * D * kpad);           /* the block's keys, transposed */
    float *V = malloc(sizeof(float) * (kpad + S8) * D);    /* its values, then the sinks' */
    float *Q = malloc(sizeof(float) * rows_p * D);
    float *O = malloc(sizeof(float) * rows_p * D);
    float *P = malloc(sizeof(float) * rows_p * ldp);       /* scores, then weights: keys, then S8 sink columns */
    int64_t *cand = malloc(sizeof(int64_t) * (C + 1));      /* the block's memory candidates */
    uint8_t *seen = malloc(kpad);
    int nblk = (T + QB - 1) / QB;
    if (!Kt || !V || !Q || !O || !P || !cand || !seen) {
        j->rc = 2;
        goto done;
    }
    int64_t row = -1, scanned = -1; /* the (sequence, kv head) whose candidates cand holds, and up to which index */
    int km = 0;
    for (int64_t item = j->tid; item < (int64_t)B * Hkv * nblk; item += j->threads) {
        int b = (int)(item / ((int64_t)Hkv * nblk)), h = (int)(item / nblk % Hkv), t0 = (int)(item % nblk) * QB;
        const int64_t *ev = j->evict + ((int64_t)b * Hkv + h) * C;
        int nq = T - t0 < QB ? T - t0 : QB;
        /* the keys: window rows w0 .. P0 + t0 + nq - 1, then the memory candidates of the block */
        int64_t w0 = P0 + t0 - W + 1 < 0 ? 0 : P0 + t0 - W + 1;
        int kw = (int)(P0 + t0 + nq - w0);
        if (C > 0) {
            /* the candidates in the memory at some query of the block: c <= hi and evict[c] > lo. A thread takes a
             * row's blocks in order and lo never decreases, so one evicted by lo never returns: the list of the
             * previous block, kept where evict > lo, and the candidates after it (the row's list costs O(C), not
             * O(C) per block); in increasing order, as a scan of all would give them */
            int64_t lo = j->last[t0], hi = j->last[t0 + nq - 1];
            if (row != (int64_t)b * Hkv + h) row = (int64_t)b * Hkv + h, scanned = -1, km = 0;
            int kept = 0;
            for (int k = 0; k < km; k++)
                if (ev[cand[k]] > lo) cand[kept++] = cand[k];
            km = kept;
            for (int64_t c = scanned + 1; c <= hi && c < C; c++)
                if (ev[c] > lo) cand[km++] = c;
            scanned = hi > scanned ? hi : scanned;
        }
        int K = kw + km;
        int64_t Kp = (K + KT - 1) / KT * KT, ld = Kp + S8;
        for (int k = 0; k < K; k++) {
            const float *key, *val;
            if (k < kw) {
                int64_t at = (((int64_t)b * Ls + w0 + k) * Hkv + h) * D;
                key = j->ks + at, val = j->vs + at;
            } else {
                int64_t at = (((int64_t)b * Hkv + h) * C + cand[k - kw]) * D;
                key = j->mk + at, val = j->mv + at;
            }
            for (int d = 0; d < D; d++) Kt[(int64_t)d * Kp + k] = key[d];
            memcpy(V + (int64_t)k * D, val, sizeof(float) * D);
        }
        for (int d = 0; d < D; d++)
            for (int64_t k = K; k < Kp; k++) Kt[(int64_t)d * Kp + k] = 0.0f;
        for (int s = 0; s < S; s++)
            memcpy(V + (Kp + s) * D, j->sink_v + (((int64_t)b * S + s) * Hkv + h) * D, sizeof(float) * D);
        /* rows (query i, head g of this kv head's group) */
        int nr = nq * G, nr_p = (nr + RT - 1) / RT * RT;
        for (int i = 0; i < nq; i++)
            memcpy(Q + (int64_t)i * G * D, j->q + (((int64_t)b * T + t0 + i) * H + (int64_t)h * G) * D,
                   sizeof(float) * G * D);
        memset(Q + (int64_t)nr * D, 0, sizeof(float) * (nr_p - nr) * D);
        for (int r0 = 0; r0 < nr_p; r0 += RT)
            for (int k0 = 0; k0 < Kp; k0 += KT) score_tile(Q + (int64_t)r0 * D, D, Kt, Kp, k0, P + r0 * ld, ld);
        memset(P + (int64_t)nr * ld, 0, sizeof(float) * (nr_p - nr) * ld); /* rows past the last: weight 0 */
        memset(O, 0, sizeof(float) * nr_p * D);
        for (int i = 0; i < nq; i++) {
            int64_t t = t0 + i, p = j->qpos[(int64_t)b * T + t];
            if (p < 0) { /* padding: sees nothing, output 0 */
                for (int g = 0; g < G; g++) memset(P + (int64_t)(i * G + g) * ld, 0, sizeof(float) * ld);
                continue;
            }
            int64_t stream = P0 + t, lt = C > 0 ? j->last[t] : -1;
            for (int k = 0; k < kw; k++) {
                int64_t r = w0 + k;
                seen[k] = r > stream - W && r <= stream && j->spos[(int64_t)b * Ls + r] >= 0;
            }
            for (int k = 0; k < km; k++) seen[kw + k] = cand[k] <= lt && lt < ev[cand[k]];
            const uint8_t *sseen = j->sink_seen + ((int64_t)b * T + t) * S;
            for (int g = 0; g < G; g++) {
                float *row = P + (int64_t)(i * G + g) * ld;
                for (int k = 0; k < K; k++) row[k] = seen[k] ? row[k] * j->scale : -INFINITY;
                for (int64_t k = K; k < Kp; k++) row[k] = -INFINITY;
                const float *ss = j->sink_s + (((int64_t)b * T + t) * H + (int64_t)h * G + g) * S;
                for (int s = 0; s < S8; s++) row[Kp + s] = s < S && sseen[s] ? ss[s] * j->scale : -INFINITY;
                v8f top8 = splat(-INFINITY);
                for (int64_t k = 0; k < ld; k += 8) {
                    v8f x = load8(row + k);
                    top8 = (v8f)(((v8i)x & (x > top8)) | ((v8i)top8 & ~(x > top8)));
                }
                float top = -INFINITY;
                for (int e = 0; e < 8; e++) top = top8[e] > top ? top8[e] : top;
                v8f sum8 = splat(0.0f);
                for (int64_t k = 0; k < ld; k += 8) {
                    v8f w = exp8(load8(row + k) - splat(top));
                    store8(row + k, w);
                    sum8 += w;
                }
                float sum = ((sum8[0] + sum8[1]) + (sum8[2] + sum8[3])) + ((sum8[4] + sum8[5]) + (sum8[6] + sum8[7]));
                v8f inv = splat(1.0f / sum);
                for (int64_t k = 0; k < ld; k += 8) store8(row + k, load8(row + k) * inv);
            }
        }
        for (int r0 = 0; r0 < nr_p; r0 += RT) {
            values(P + r0 * ld, ld, V, D, 0, K, O + (int64_t)r0 * D);
            if (S > 0) values(P + r0 * ld, ld, V, D, Kp, Kp + S, O + (int64_t)r0 * D);
        }
        for (int i = 0; i < nq; i++)
            memcpy(j->out + (((int64_t)b * T + t0 + i) * H + (int64_t)h * G) * D, O + (int64_t)i * G * D,
                   sizeof(float) * G * D);
    }
done:
    free(Kt); free(V); free(Q); free(O); free(P); free(cand); free(seen);
    return NULL;
}

int aaren_window_prefill(
    int B, int T, int H, int Hkv, int D, int64_t Ls, int64_t P0, int W, int64_t C, int S, float scale, int threads,
    const float *q, const int64_t *qpos,                     /* [B, T, H, D] rotated, [B, T] (-1: padding) */
    const float *ks, const float *vs, const int64_t *spos,  /* the stream [B, Ls, Hkv, D], [B, Ls] */
    const float *mk, const float *mv,                       /* memory candidates [B, Hkv, C, D] */
    const int64_t *evict, const int64_t *last,              /* [B, Hkv, C], [T + 1] */
    const float *sink_s, const float *sink_v, const uint8_t *sink_seen, /* [B, T, H, S], [B, S, Hkv, D], [B, T, S] */
    float *out) {                                           /* [B, T, H, D] */
    if (!aaren_window_prefill_takes(H, Hkv, D)) return 1;
    int items = B * Hkv * ((T + QB - 1) / QB);
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads > items ? items : threads;
    job jobs[MAX_THREADS];
    pthread_t started[MAX_THREADS];
    int running[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job){B, T, H, Hkv, D, W, S, Ls, P0, C, scale, q, ks, vs, mk, mv, sink_s, sink_v, qpos, spos,
                        evict, last, sink_seen, out, threads, t, 0};
        /* the caller takes share 0, and any share whose thread could not start */
        if (t > 0) running[t] = pthread_create(&started[t], NULL, attend, &jobs[t]) == 0;
    }
    attend(&jobs[0]);
    int rc = jobs[0].rc;
    for (int t = 1; t < threads; t++) {
        if (running[t]) pthread_join(started[t], NULL);
        else attend(&jobs[t]);
        rc = rc ? rc : jobs[t].rc;
    }
    return rc;
}
