/* Copyright 2026 The aaren-hf authors. Apache-2.0.
 *
 * The window branch's attention over a whole sequence on a CPU, forward and backward: window_attention_triton's
 * arguments and results (chunk.py, the same in Triton, whose docstring states what a query sees) in one C call each
 * way. Reference: the PyTorch path of window_attention in aaren_hf/modeling_aaren.py, which gathers every block's
 * keys and values into padded tensors, builds an additive mask and calls fused attention (and autograd's backward of
 * all that); here each block of QB queries reads the keys some query of it sees (the window rows of the block, the
 * memory candidates in the memory between its first and last query), decides per query and key what is seen from
 * positions and indices, and computes in small register tiles:
 *
 *    window    stream row r, query i (stream row P0 + i):  P0 + i - W < r <= P0 + i  and  spos[r] >= 0
 *    memory    candidate c:                                c <= last[i] < evict[c]
 *    sinks     sink s: its score (computed outside, by autograd's ops when training, by aaren_window_queries below for
 *              a prompt: the query is rotated to another position for it) where seen
 *
 * Each query's own keys (64 of the window, what the memory holds) instead of the widest block's. A float32 softmax
 * in another order than the reference's (and exp by a polynomial, relative error about 1e-7): equal to rounding. The
 * products contract to fused multiply-adds here (the files that must round as PyTorch does are built without them;
 * this one's results are compared to rounding only).
 *
 * The backward recomputes each block's weights P and, with D_r = sum_k P_rk dP_rk (= <dO_r, O_r>), forms
 * dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO: the same tiles, on transposed operands. A key is
 * read by several blocks of its row (sequence, kv head), so each thread takes whole rows: no two threads add to one
 * key.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#pragma GCC optimize("fp-contract=fast") /* products to fused multiply-adds, exp8's polynomial too */

#include "../vec8.h"
#include "window.h"

#define QB 16  /* queries per block: each gathers QB + W - 1 window rows (its row tiles compute with those they see) */
#define KT 32  /* key columns come padded to a multiple of this */
#define RT 4   /* rows (query, head) per tile */
/* vectors per tile row: a tile's RT x TV accumulators, its TV key or value vectors and one broadcast fill the vector
 * registers (32 with AVX-512, 16 with AVX2) without reloading a vector for each row */
#ifdef __AVX512VL__
#define TV 4
#else
#define TV 3
#endif
#define MAX_G 16
#define MAX_THREADS 256

/* out[d][i] = rows[i][d] for 8 rows of D floats (D a multiple of 8; a NULL row reads as zeros) into columns
 * 0 .. 7 of out [D][ld]: 8 x 8 blocks transposed in registers, not 8 D strided stores of one float */
static inline void transpose8(const float *const rows[8], int D, float *out, int64_t ld) {
    for (int d = 0; d < D; d += 8) {
        v8f r[8], t[8], u[8];
        for (int i = 0; i < 8; i++) r[i] = rows[i] ? load8(rows[i] + d) : splat8(0.0f);
        for (int i = 0; i < 8; i += 2) {
            t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
            t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
        }
        for (int i = 0; i < 8; i += 4)
            for (int h = 0; h < 2; h++) {
                u[i + 2 * h] = __builtin_shufflevector(t[i + h], t[i + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
                u[i + 2 * h + 1] = __builtin_shufflevector(t[i + h], t[i + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
            }
        for (int c = 0; c < 4; c++) { /* lower halves: dims d + c; upper halves: dims d + c + 4 */
            store8(out + (int64_t)(d + c) * ld, __builtin_shufflevector(u[c], u[c + 4], 0, 1, 2, 3, 8, 9, 10, 11));
            store8(out + (int64_t)(d + c + 4) * ld,
                   __builtin_shufflevector(u[c], u[c + 4], 4, 5, 6, 7, 12, 13, 14, 15));
        }
    }
}

/* S[r][k0 .. k0 + 8 nk) = <Q[r], key k> for RT rows (nk = 1 .. TV, a constant where inlined): Q [rows][D], Kt
 * [D][ldk] (keys transposed) */
static inline __attribute__((always_inline)) void score_tile(const float *Q, int D, const float *Kt, int64_t ldk,
                                                             int k0, int nk, float *S, int64_t lds) {
    v8f acc[RT][TV];
    for (int r = 0; r < RT; r++)
        for (int n = 0; n < nk; n++) acc[r][n] = splat8(0.0f); /* in registers: a memset went through the stack */
    for (int d = 0; d < D; d++) {
        const float *kt = Kt + (int64_t)d * ldk + k0;
        v8f kv[TV];
        for (int n = 0; n < nk; n++) {
            kv[n] = load8(kt + 8 * n);
            IN_REGISTER(kv[n]);
        }
        for (int r = 0; r < RT; r++) {
            v8f qv = splat8(Q[(int64_t)r * D + d]);
            for (int n = 0; n < nk; n++) acc[r][n] += qv * kv[n];
        }
    }
    for (int r = 0; r < RT; r++)
        for (int n = 0; n < nk; n++) store8(S + r * lds + k0 + 8 * n, acc[r][n]);
}

/* score_tile over the keys [k0, k1) (multiples of 8) */
static void scores(const float *Q, int D, const float *Kt, int64_t ldk, int k0, int k1, float *S, int64_t lds) {
    for (; k0 + 8 * TV <= k1; k0 += 8 * TV) score_tile(Q, D, Kt, ldk, k0, TV, S, lds);
    switch ((k1 - k0) / 8) {
    case 3: score_tile(Q, D, Kt, ldk, k0, 3, S, lds); break;
    case 2: score_tile(Q, D, Kt, ldk, k0, 2, S, lds); break;
    case 1: score_tile(Q, D, Kt, ldk, k0, 1, S, lds); break;
    }
}

/* O[r] += sum over keys k in [k0, k1) of P[r][k] V[k] for RT rows, dims [d0, d0 + 8 nv) (nv = 1 .. TV, a constant
 * where inlined) */
static inline __attribute__((always_inline)) void value_tile(const float *P, int64_t ldp, const float *V, int D,
                                                             int k0, int k1, int d0, int nv, float *O) {
    v8f acc[RT][TV];
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = load8(O + (int64_t)r * D + d0 + 8 * j);
    for (int k = k0; k < k1; k++) {
        const float *vk = V + (int64_t)k * D + d0;
        v8f v[TV];
        for (int j = 0; j < nv; j++) {
            v[j] = load8(vk + 8 * j);
            IN_REGISTER(v[j]);
        }
        for (int r = 0; r < RT; r++) {
            v8f p = splat8(P[r * ldp + k]);
            for (int j = 0; j < nv; j++) acc[r][j] += p * v[j];
        }
    }
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < nv; j++) store8(O + (int64_t)r * D + d0 + 8 * j, acc[r][j]);
}

/* inlined where called: a call per row tile cost about 1% of a 1,000-token prompt (compare_kernels) */
static inline __attribute__((always_inline)) void values(const float *P, int64_t ldp, const float *V, int D, int k0,
                                                         int k1, float *O) {
    int d0 = 0;
    for (; d0 + 8 * TV <= D; d0 += 8 * TV) value_tile(P, ldp, V, D, k0, k1, d0, TV, O);
    switch ((D - d0) / 8) {
    case 3: value_tile(P, ldp, V, D, k0, k1, d0, 3, O); break;
    case 2: value_tile(P, ldp, V, D, k0, k1, d0, 2, O); break;
    case 1: value_tile(P, ldp, V, D, k0, k1, d0, 1, O); break;
    }
}


/* A prompt's queries as the kernels take them, without gradients (the kernels take the sinks' scores computed, as
 * the Triton one does). Reference: _window_attention_fused and _sink_scores in modeling_aaren.py.
 *   qr [B, T, H, D]     q rotated at its position (cos, sin [B, T, rot]), rotate_cpu's bits;
 *   scores [B, T, H, S] <q[b, t, h], R(-c) sink_k[b, s, h / G]>, c = min(max(qpos, 0), S + W - 1): the query read
 *                       at c, written as the sink key turned back by c (back_cos, back_sin [S + W, rot], row i at
 *                       -i) as the reference turns it; the sums in another order than its matmul: equal to rounding.
 * S may be 0 (then only qr). Which sinks a query sees, the attention decides from the positions. */
int aaren_window_queries(int B, int T, int H, int Hkv, int D, int S, int W, int rot, const float *q,
                         const int64_t *qpos, const float *cos, const float *sin, const float *sink_k,
                         const int64_t *sink_pos, const float *back_cos, const float *back_sin, float *qr,
                         float *scores) {
    if (D % 8 || H % Hkv || D > 512) return 1;
    if (aaren_rotate((int64_t)B * T, H, D, rot, 0, q, cos, sin, qr)) return 1;
    const int G = H / Hkv;
    float turned[512];
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const int64_t bt = (int64_t)b * T + t, p = qpos[bt];
            const int64_t c = p < 0 ? 0 : p > S + W - 1 ? S + W - 1 : p;
            for (int s = 0; s < S; s++) {
                for (int hk = 0; hk < Hkv; hk++) {
                    aaren_rotate(1, 1, D, rot, 0, sink_k + (((int64_t)b * S + s) * Hkv + hk) * D, back_cos + c * rot,
                                 back_sin + c * rot, turned);
                    for (int h = hk * G; h < (hk + 1) * G; h++) {
                        const float *qh = q + (bt * H + h) * D;
                        v8f acc = splat8(0.0f);
                        for (int d = 0; d < D; d += 8) acc += load8(qh + d) * load8(turned + d);
                        scores[(bt * H + h) * S + s] = sum8(acc);
                    }
                }
            }
        }
    return 0;
}

/* whether the kernels take these shapes (where not, they return 1 and write nothing) */
int aaren_window_attention_takes(int H, int Hkv, int D) { return D % 8 == 0 && H % Hkv == 0 && H / Hkv <= MAX_G; }

typedef struct {
    int B, T, H, Hkv, D, W, S;
    int64_t Ls, P0, C;
    float scale;
    const float *q, *ks, *vs, *mk, *mv, *sink_s, *sink_v;
    const int64_t *qpos, *spos, *evict, *last;
    const int64_t *sink_pos;
    float *out;                                          /* forward: the output; backward: NULL */
    const float *dout;                                   /* backward: what flows back, and the gradients: */
    float *dq, *dks, *dvs, *dmk, *dmv, *dsink_s, *dsink_v; /* dq, dsink_s written, the others added to (zeroed) */
    int threads, rc;
    int64_t *next; /* the next unclaimed item, shared by the call's threads */
} job;

typedef struct {     /* one thread's buffers, sized for the widest block */
    int64_t kpad;
    float *Kt, *V, *Q, *O, *P;    /* keys transposed, values (then the sinks'), rows, their outputs, weights */
    float *Kr, *Vt, *dO, *dS, *T1, *dK, *dV; /* backward: keys as rows, values transposed, dO rows, dS, a transpose,
                                                and the block's key gradients */
    int64_t *cand;
    int32_t *seen; /* [QB][ld] per query and key of the block (then the sinks'): -1 where seen, else 0 */
    int32_t *key_index, *key_evict; /* per key of the block: a window row's 0 (a token) or -1 (none), a memory
                                       candidate's index and eviction: what decides who sees it (gather) */
    int64_t row, scanned;         /* the (sequence, kv head) whose memory candidates cand holds, and up to where */
    int km;
} buffers;

static int alloc_buffers(buffers *m, const job *j, int backward) {
    int G = j->H / j->Hkv, rows_p = (QB * G + RT - 1) / RT * RT, S8 = (j->S + 7) / 8 * 8, D = j->D;
    int64_t kmax = QB + j->W - 1 + j->C;
    memset(m, 0, sizeof(*m));
    m->kpad = (kmax + KT - 1) / KT * KT;
    m->row = -1;
    int64_t ld = m->kpad + S8;
    m->Kt = malloc(sizeof(float) * D * m->kpad);
    m->V = malloc(sizeof(float) * ld * D);
    m->Q = malloc(sizeof(float) * rows_p * D);
    m->O = malloc(sizeof(float) * rows_p * D);
    m->P = malloc(sizeof(float) * rows_p * ld);
    m->cand = malloc(sizeof(int64_t) * (j->C + 1));
    m->seen = malloc(sizeof(int32_t) * QB * ld);
    m->key_index = malloc(sizeof(int32_t) * m->kpad);
    m->key_evict = malloc(sizeof(int32_t) * m->kpad);
    int ok = m->Kt && m->V && m->Q && m->O && m->P && m->cand && m->seen && m->key_index && m->key_evict;
    if (backward) {
        m->Kr = malloc(sizeof(float) * m->kpad * D);
        m->Vt = malloc(sizeof(float) * D * m->kpad);
        m->dO = malloc(sizeof(float) * rows_p * D);
        m->dS = malloc(sizeof(float) * rows_p * ld);
        m->T1 = malloc(sizeof(float) * ld * rows_p);
        m->dK = malloc(sizeof(float) * m->kpad * D);
        m->dV = malloc(sizeof(float) * m->kpad * D);
        ok = ok && m->Kr && m->Vt && m->dO && m->dS && m->T1 && m->dK && m->dV;
    }
    return ok;
}

static void free_buffers(buffers *m) {
    free(m->Kt); free(m->V); free(m->Q); free(m->O); free(m->P); free(m->cand); free(m->seen);
    free(m->key_index); free(m->key_evict);
    free(m->Kr); free(m->Vt); free(m->dO); free(m->dS); free(m->T1); free(m->dK); free(m->dV);
}

typedef struct { /* one block: its queries t0 .. t0 + nq - 1 of row (b, h), its keys */
    int b, h, t0, nq, kw, K, nr;
    int64_t w0, Kp, ld;
} block;

/* where key k of a block lies: its element offset in the stream (ks, vs) for the first kw, else in the memory's
 * candidates (mk, mv) */
static inline int64_t key_offset(const job *j, const buffers *m, const block *k_, int k) {
    if (k < k_->kw) return (((int64_t)k_->b * j->Ls + k_->w0 + k) * j->Hkv + k_->h) * j->D;
    return (((int64_t)k_->b * j->Hkv + k_->h) * j->C + m->cand[k - k_->kw]) * j->D;
}

/* the block's keys (window rows w0 .. P0 + t0 + nq - 1, then its memory candidates) into m->Kt (and, backward,
 * m->Kr and m->Vt), values into m->V (forward only), the sinks' values after them; its rows (query i, head g of the
 * kv head's group) into m->Q */
static block gather(const job *j, buffers *m, int b, int h, int t0, int backward) {
    int T = j->T, H = j->H, Hkv = j->Hkv, D = j->D, W = j->W, S = j->S, G = H / Hkv;
    int64_t P0 = j->P0, C = j->C;
    const int64_t *ev = j->evict + ((int64_t)b * Hkv + h) * C;
    block k_ = {b, h, t0, T - t0 < QB ? T - t0 : QB, 0, 0, 0, 0, 0, 0};
    k_.w0 = P0 + t0 - W + 1 < 0 ? 0 : P0 + t0 - W + 1;
    k_.kw = (int)(P0 + t0 + k_.nq - k_.w0);
    if (C > 0) {
        /* the candidates in the memory at some query of the block: c <= hi and evict[c] > lo. A thread takes a row's
         * blocks in order and lo never decreases, so one evicted by lo never returns: the list of the previous
         * block, kept where evict > lo, and the candidates after it (the row's lists cost O(C), not O(C) per
         * block); in increasing order, as a scan of all would give them */
        int64_t lo = j->last[t0], hi = j->last[t0 + k_.nq - 1];
        if (m->row != (int64_t)b * Hkv + h) m->row = (int64_t)b * Hkv + h, m->scanned = -1, m->km = 0;
        int kept = 0;
        for (int k = 0; k < m->km; k++)
            if (ev[m->cand[k]] > lo) m->cand[kept++] = m->cand[k];
        m->km = kept;
        for (int64_t c = m->scanned + 1; c <= hi && c < C; c++)
            if (ev[c] > lo) m->cand[m->km++] = c;
        m->scanned = hi > m->scanned ? hi : m->scanned;
    }
    k_.K = k_.kw + (C > 0 ? m->km : 0);
    k_.Kp = (k_.K + KT - 1) / KT * KT;
    for (int k = 0; k < k_.Kp; k++) {
        if (k < k_.kw) {
            m->key_index[k] = j->spos[(int64_t)b * j->Ls + k_.w0 + k] >= 0 ? 0 : -1, m->key_evict[k] = 0;
        } else if (k < k_.K) {
            m->key_index[k] = (int32_t)m->cand[k - k_.kw], m->key_evict[k] = (int32_t)ev[m->cand[k - k_.kw]];
        } else {
            m->key_index[k] = 0, m->key_evict[k] = 0;
        }
    }
    k_.ld = k_.Kp + (S + 7) / 8 * 8;
    for (int k0 = 0; k0 < k_.Kp; k0 += 8) { /* Kp is a multiple of KT, so of 8; columns past the last key: 0 */
        const float *key[8], *val[8];
        for (int i = 0; i < 8; i++) {
            const int k = k0 + i;
            const int64_t at = k < k_.K ? key_offset(j, m, &k_, k) : 0;
            key[i] = k >= k_.K ? NULL : (k < k_.kw ? j->ks : j->mk) + at;
            val[i] = k >= k_.K ? NULL : (k < k_.kw ? j->vs : j->mv) + at;
            if (key[i] && !backward) memcpy(m->V + (int64_t)k * D, val[i], sizeof(float) * D); /* backward: Vt */
            if (key[i] && backward) memcpy(m->Kr + (int64_t)k * D, key[i], sizeof(float) * D);
        }
        transpose8(key, D, m->Kt + k0, k_.Kp);
        if (backward) transpose8(val, D, m->Vt + k0, k_.Kp);
    }
    for (int s = 0; s < S; s++)
        memcpy(m->V + (k_.Kp + s) * D, j->sink_v + (((int64_t)b * S + s) * Hkv + h) * D, sizeof(float) * D);
    k_.nr = k_.nq * G;
    int nr_p = (k_.nr + RT - 1) / RT * RT;
    for (int i = 0; i < k_.nq; i++)
        memcpy(m->Q + (int64_t)i * G * D, j->q + (((int64_t)b * T + t0 + i) * H + (int64_t)h * G) * D,
               sizeof(float) * G * D);
    memset(m->Q + (int64_t)k_.nr * D, 0, sizeof(float) * (nr_p - k_.nr) * D);
    return k_;
}

/* The key columns [lo, hi) rows r0 .. r0 + RT - 1 of a block can see, 8-aligned: from the first query's oldest
 * window row to the memory's last candidate (or, without one, the last query's newest row). Each query sees W of its
 * block's QB + W - 1 window rows, so the columns outside (up to QB - 1 of them, and about half while the window fills)
 * hold zero weight: left out of the products, whose sums are the same without them (a product with weight 0 adds
 * 0). The sinks' columns follow at Kp. */
static void tile_keys(const job *j, const block *k_, int r0, int *lo, int *hi) {
    int G = j->H / j->Hkv, i0 = r0 / G, i1 = (r0 + RT - 1) / G;
    i1 = i1 < k_->nq - 1 ? i1 : k_->nq - 1;
    int64_t first = j->P0 + k_->t0 + i0 - j->W + 1 - k_->w0, last = j->P0 + k_->t0 + i1 - k_->w0;
    first = first < 0 ? 0 : first > last ? last : first; /* (rows only past the last query: any) */
    *lo = (int)(first / 8 * 8);
    *hi = k_->K > k_->kw ? (k_->K + 7) / 8 * 8 : (int)((last + 8) / 8 * 8);
}

/* the block's weights into m->P [rows][ld]: its keys' columns, then S8 of the sinks'; 0 for what a row does not see,
 * for every column of a padding query and for the rows past the last */
static void weights(const job *j, buffers *m, const block *k_) {
    int T = j->T, H = j->H, Hkv = j->Hkv, D = j->D, W = j->W, S = j->S, G = H / Hkv, S8 = (S + 7) / 8 * 8;
    int64_t Kp = k_->Kp, ld = k_->ld, C = j->C;
    int nr_p = (k_->nr + RT - 1) / RT * RT;
    float *P = m->P;
    for (int i = 0; i < k_->nq; i++) {
        /* what query i sees, 8 keys at a time (m->seen row i): window rows w0 + k in (stream - W, stream] that hold a
         * token, the memory candidates c (key kw + n) with c <= last[t] < evict[c], the sinks it sees */
        int32_t *seen = m->seen + (int64_t)i * ld;
        int64_t t = k_->t0 + i, stream = j->P0 + t, lt = C > 0 ? j->last[t] : -1;
        if (j->qpos[(int64_t)k_->b * T + t] < 0) continue; /* padding: its rows are zeros below, seeing nothing */
        v8i32 iota = {0, 1, 2, 3, 4, 5, 6, 7};
        int32_t lo = (int32_t)(stream - W + 1 - k_->w0), hi = (int32_t)(stream - k_->w0), l32 = (int32_t)lt;
        for (int k = 0; k < Kp; k += 8) {
            v8i32 kk = iota + k, a, e;
            memcpy(&a, m->key_index + k, sizeof(a));
            memcpy(&e, m->key_evict + k, sizeof(e));
            v8i32 win = (kk >= lo) & (kk <= hi) & (a >= 0) & (kk < k_->kw);
            v8i32 mem = (kk >= k_->kw) & (kk < k_->K) & (a <= l32) & (l32 < e);
            v8i32 out = win | mem;
            memcpy(seen + k, &out, sizeof(out));
        }
        const int64_t *sp = j->sink_pos + (int64_t)k_->b * S, p = j->qpos[(int64_t)k_->b * T + t];
        for (int s = 0; s < S8; s++) seen[Kp + s] = -(s < S && sp[s] >= 0 && sp[s] <= p - W); /* outside the window */
    }
    for (int r0 = 0; r0 < nr_p; r0 += RT) {
        int k0, k1;
        tile_keys(j, k_, r0, &k0, &k1);
        scores(m->Q + (int64_t)r0 * D, D, m->Kt, Kp, k0, k1, P + r0 * ld, ld);
        for (int r = r0; r < r0 + RT; r++) {
            float *row = P + (int64_t)r * ld;
            int64_t t = k_->t0 + r / G;
            if (r >= k_->nr || j->qpos[(int64_t)k_->b * T + t] < 0) { /* padding: sees nothing, output 0 */
                memset(row, 0, sizeof(float) * ld);
                continue;
            }
            const int32_t *seen = m->seen + (int64_t)(r / G) * ld;
            const float *ss = j->sink_s + (((int64_t)k_->b * T + t) * H + (int64_t)k_->h * G + r % G) * S;
            for (int s = 0; s < S8; s++) row[Kp + s] = seen[Kp + s] ? ss[s] : 0.0f;
            memset(row, 0, sizeof(float) * k0);
            memset(row + k1, 0, sizeof(float) * (Kp - k1));
            /* scaled where seen, -inf where not (8 at a time), and the row's largest; over the tile's keys and the
             * sinks (n = 0, 1) */
            const int64_t from[2] = {k0, Kp}, to[2] = {k1, ld};
            v8f top8 = splat8(-INFINITY), scale = splat8(j->scale), none = splat8(-INFINITY);
            for (int n = 0; n < 2; n++)
                for (int64_t k = from[n]; k < to[n]; k += 8) {
                    v8i32 in;
                    memcpy(&in, seen + k, sizeof(in));
                    v8f x = select8(in, load8(row + k) * scale, none);
                    store8(row + k, x);
                    top8 = select8(x > top8, x, top8);
                }
            float top = -INFINITY;
            for (int e = 0; e < 8; e++) top = top8[e] > top ? top8[e] : top;
            v8f total8 = splat8(0.0f);
            for (int n = 0; n < 2; n++)
                for (int64_t k = from[n]; k < to[n]; k += 8) {
                    v8f w = exp8(load8(row + k) - splat8(top));
                    store8(row + k, w);
                    total8 += w;
                }
            float sum = sum8_pairs(total8);
            v8f inv = splat8(1.0f / sum);
            for (int n = 0; n < 2; n++)
                for (int64_t k = from[n]; k < to[n]; k += 8) store8(row + k, load8(row + k) * inv);
        }
    }
}

static void forward_block(const job *j, buffers *m, int b, int h, int t0) {
    int H = j->H, D = j->D, S = j->S, G = H / j->Hkv;
    block k_ = gather(j, m, b, h, t0, 0);
    weights(j, m, &k_);
    int nr_p = (k_.nr + RT - 1) / RT * RT;
    memset(m->O, 0, sizeof(float) * nr_p * D);
    for (int r0 = 0; r0 < nr_p; r0 += RT) {
        int k0, k1;
        tile_keys(j, &k_, r0, &k0, &k1);
        /* (not the columns past the last key: they hold 0, their values nothing) */
        values(m->P + r0 * k_.ld, k_.ld, m->V, D, k0, k1 < k_.K ? k1 : k_.K, m->O + (int64_t)r0 * D);
        if (S > 0) values(m->P + r0 * k_.ld, k_.ld, m->V, D, k_.Kp, k_.Kp + S, m->O + (int64_t)r0 * D);
    }
    for (int i = 0; i < k_.nq; i++)
        memcpy(j->out + (((int64_t)b * j->T + t0 + i) * H + (int64_t)h * G) * D, m->O + (int64_t)i * G * D,
               sizeof(float) * G * D);
}

/* out[k][r] = in[r][k] for r < rows, k < cols (the other rows of out: 0 up to rows_p) */
static void transpose(const float *in, int64_t ld_in, int rows, int rows_p, int64_t cols, float *out) {
    for (int64_t k = 0; k < cols; k++) {
        for (int r = 0; r < rows; r++) out[k * rows_p + r] = in[(int64_t)r * ld_in + k];
        for (int r = rows; r < rows_p; r++) out[k * rows_p + r] = 0.0f;
    }
}

static void backward_block(const job *j, buffers *m, int b, int h, int t0) {
    int T = j->T, H = j->H, Hkv = j->Hkv, D = j->D, S = j->S, G = H / Hkv;
    block k_ = gather(j, m, b, h, t0, 1);
    weights(j, m, &k_);
    int nr = k_.nr, nr_p = (nr + RT - 1) / RT * RT;
    int64_t Kp = k_.Kp, ld = k_.ld;
    for (int i = 0; i < k_.nq; i++)
        memcpy(m->dO + (int64_t)i * G * D, j->dout + (((int64_t)b * T + t0 + i) * H + (int64_t)h * G) * D,
               sizeof(float) * G * D);
    memset(m->dO + (int64_t)nr * D, 0, sizeof(float) * (nr_p - nr) * D);
    /* dP = dO V^T (keys by tiles, sinks by dots), then dS = P (dP - D_r) in place */
    float *dS = m->dS;
    for (int r0 = 0; r0 < nr_p; r0 += RT)
        scores(m->dO + (int64_t)r0 * D, D, m->Vt, Kp, 0, (int)Kp, dS + r0 * ld, ld);
    for (int r = 0; r < nr; r++) {
        float *ds = dS + (int64_t)r * ld, *p = m->P + (int64_t)r * ld;
        for (int s = 0; s < (S + 7) / 8 * 8; s++) {
            float dot = 0.0f;
            if (s < S)
                for (int d = 0; d < D; d++) dot += m->dO[(int64_t)r * D + d] * m->V[(Kp + s) * D + d];
            ds[Kp + s] = dot;
        }
        v8f acc = splat8(0.0f);
        for (int64_t k = 0; k < ld; k += 8) acc += load8(p + k) * load8(ds + k);
        float delta = sum8_pairs(acc);
        for (int64_t k = 0; k < ld; k += 8) store8(ds + k, load8(p + k) * (load8(ds + k) - splat8(delta)));
    }
    memset(dS + (int64_t)nr * ld, 0, sizeof(float) * (nr_p - nr) * ld);
    /* dQ = scale dS K (keys only), dsink_s = scale dS at the sinks' columns */
    memset(m->O, 0, sizeof(float) * nr_p * D);
    for (int r0 = 0; r0 < nr_p; r0 += RT) values(dS + r0 * ld, ld, m->Kr, D, 0, k_.K, m->O + (int64_t)r0 * D);
    for (int i = 0; i < k_.nq; i++)
        for (int g = 0; g < G; g++) {
            int r = i * G + g;
            int64_t at = ((int64_t)b * T + t0 + i) * H + (int64_t)h * G + g;
            for (int d = 0; d < D; d++) j->dq[at * D + d] = j->scale * m->O[(int64_t)r * D + d];
            for (int s = 0; s < S; s++) j->dsink_s[at * S + s] = j->scale * dS[(int64_t)r * ld + Kp + s];
        }
    /* dK = scale dS^T Q, dV = P^T dO, 4 keys at a time; sinks' values: P^T dO at their columns */
    transpose(dS, ld, nr, nr_p, Kp, m->T1);
    memset(m->dK, 0, sizeof(float) * Kp * D);
    for (int64_t k0 = 0; k0 < Kp; k0 += RT) values(m->T1 + k0 * nr_p, nr_p, m->Q, D, 0, nr, m->dK + k0 * D);
    transpose(m->P, ld, nr, nr_p, Kp + S, m->T1);
    memset(m->dV, 0, sizeof(float) * Kp * D);
    for (int64_t k0 = 0; k0 < Kp; k0 += RT) values(m->T1 + k0 * nr_p, nr_p, m->dO, D, 0, nr, m->dV + k0 * D);
    for (int s = 0; s < S; s++) {
        float *dv = j->dsink_v + (((int64_t)b * S + s) * Hkv + h) * D;
        const float *w = m->T1 + (Kp + s) * nr_p;
        for (int r = 0; r < nr; r++)
            if (w[r] != 0.0f)
                for (int d = 0; d < D; d++) dv[d] += w[r] * m->dO[(int64_t)r * D + d];
    }
    for (int k = 0; k < k_.K; k++) {
        int64_t at = key_offset(j, m, &k_, k);
        float *dk = (k < k_.kw ? j->dks : j->dmk) + at, *dv = (k < k_.kw ? j->dvs : j->dmv) + at;
        for (int d = 0; d < D; d++) {
            dk[d] += j->scale * m->dK[(int64_t)k * D + d];
            dv[d] += m->dV[(int64_t)k * D + d];
        }
    }
}

/* Items claimed one at a time from a shared counter, so that a thread the OS does not run (a busy machine) holds up
 * at most the item it has, not a fixed share. Forward, an item is a block (sequence, kv head, block of QB queries);
 * backward, a whole row (sequence, kv head), whose blocks add to the same keys. A thread claims items in increasing
 * order, which the carried candidate lists need (gather); every item is computed the same whichever thread takes it,
 * so results do not depend on the threads. */
static void run(job *j) {
    buffers m;
    int nblk = (j->T + QB - 1) / QB, backward = j->out == NULL;
    int64_t items = (int64_t)j->B * j->Hkv * (backward ? 1 : nblk);
    if (!alloc_buffers(&m, j, backward)) {
        j->rc = 2;
    } else {
        for (int64_t item; (item = __atomic_fetch_add(j->next, 1, __ATOMIC_RELAXED)) < items;) {
            if (!backward)
                forward_block(j, &m, (int)(item / ((int64_t)j->Hkv * nblk)), (int)(item / nblk % j->Hkv),
                              (int)(item % nblk) * QB);
            else
                for (int n = 0; n < nblk; n++) backward_block(j, &m, (int)(item / j->Hkv), (int)(item % j->Hkv), n * QB);
        }
    }
    free_buffers(&m);
}

/* The threads are OpenMP's: built with -fopenmp, this library needs libgomp.so.1, which in a process that imported
 * torch is torch's own (the loader finds that soname loaded), so a call runs on the pool that runs PyTorch's
 * operators. Threads of our own (pthreads, until 2026-12-05) competed with that pool's waiting workers for the cores:
 * on two idle cores 1.1-3.8x slower than now. Built without OpenMP, one thread. */
static int launch(job *proto, int items) {
    int threads = proto->threads;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads > items ? items : threads;
    int64_t next = 0;
    job jobs[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        jobs[t] = *proto;
        jobs[t].rc = 0, jobs[t].next = &next;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    run(&jobs[omp_get_thread_num()]); /* a smaller team than asked for leaves its items to the others */
#else
    run(&jobs[0]);
#endif
    int rc = 0;
    for (int t = 0; t < threads; t++) rc = rc ? rc : jobs[t].rc;
    return rc;
}

#define ARGS                                                                                                          \
    int B, int T, int H, int Hkv, int D, int64_t Ls, int64_t P0, int W, int64_t C, int S, float scale, int threads,   \
        const float *q, const int64_t *qpos,                /* [B, T, H, D] rotated, [B, T] (-1: padding) */          \
        const float *ks, const float *vs, const int64_t *spos, /* the stream [B, Ls, Hkv, D], [B, Ls] */              \
        const float *mk, const float *mv,                  /* memory candidates [B, Hkv, C, D] */                    \
        const int64_t *evict, const int64_t *last,         /* [B, Hkv, C], [T + 1] */                                \
        const float *sink_s, const float *sink_v, const int64_t *sink_pos /* [B, T, H, S], [B, S, Hkv, D], [B, S] */
#define JOB                                                                                                           \
    (job) {                                                                                                           \
        B, T, H, Hkv, D, W, S, Ls, P0, C, scale, q, ks, vs, mk, mv, sink_s, sink_v, qpos, spos, evict, last,          \
            sink_pos, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, threads, 0, NULL                         \
    }

int aaren_window_attention(ARGS, float *out /* [B, T, H, D] */) {
    if (!aaren_window_attention_takes(H, Hkv, D)) return 1;
    job proto = JOB;
    proto.out = out;
    return launch(&proto, B * Hkv * ((T + QB - 1) / QB));
}

int aaren_window_attention_backward(ARGS, const float *dout, float *dq, float *dks, float *dvs, float *dmk, float *dmv,
                                    float *dsink_s, float *dsink_v) {
    if (!aaren_window_attention_takes(H, Hkv, D)) return 1;
    job proto = JOB;
    proto.dout = dout, proto.dq = dq, proto.dks = dks, proto.dvs = dvs, proto.dmk = dmk, proto.dmv = dmv;
    proto.dsink_s = dsink_s, proto.dsink_v = dsink_v;
    return launch(&proto, B * Hkv);
}
