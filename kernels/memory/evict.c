/* When each memory candidate leaves the memory (aaren_memory_evict): the rule of memory_visibility in
 * modeling_aaren.py, which is the reference (its block sweep computes the same indices in PyTorch).
 *
 * Per row (batch, kv head), candidates 0..upto-1 in order; a candidate is real when its position >= num_sinks.
 * A candidate ranks above another by score, then by newer position. The top set (the memory) is the M best real
 * candidates so far, kept in a min-heap by rank: a new real candidate that beats the weakest evicts it at the new
 * candidate's index; one that does not beat it leaves as it enters (evict = its own index), as every candidate does
 * with M = 0. Every other entry of evict is left as the caller set it. O(upto log M) per row, where the sweep ranks
 * blocks against each other.
 */
#include <stdint.h>
#include <stdlib.h>

#include "memory.h"

typedef struct { float score; int64_t pos; int64_t index; } entry;

static int beats(const entry *a, const entry *b) {
    return a->score > b->score || (a->score == b->score && a->pos > b->pos);
}

static void sift_down(entry *heap, int n, int i) {
    for (;;) {
        int low = i, l = 2 * i + 1, r = l + 1;
        if (l < n && beats(&heap[low], &heap[l])) low = l;
        if (r < n && beats(&heap[low], &heap[r])) low = r;
        if (low == i) return;
        entry t = heap[i]; heap[i] = heap[low]; heap[low] = t;
        i = low;
    }
}

static void sift_up(entry *heap, int i) {
    while (i > 0) {
        int parent = (i - 1) / 2;
        if (!beats(&heap[parent], &heap[i])) return;
        entry t = heap[i]; heap[i] = heap[parent]; heap[parent] = t;
        i = parent;
    }
}

/* pos, score, evict: [rows, C]. Returns 0, or 2 when out of memory (nothing written). */
int aaren_memory_evict(int rows, int C, int upto, int M, int num_sinks, const int64_t *pos, const float *score,
                       int64_t *evict) {
    entry *heap = malloc(sizeof(entry) * (size_t)(M > 0 ? M : 1));
    if (!heap) return 2;
    for (int row = 0; row < rows; row++) {
        const int64_t *p = pos + (int64_t)row * C;
        const float *s = score + (int64_t)row * C;
        int64_t *ev = evict + (int64_t)row * C;
        int n = 0;
        for (int c = 0; c < upto; c++) {
            if (p[c] < num_sinks) continue;
            entry e = {s[c], p[c], c};
            if (n < M) {
                heap[n] = e;
                sift_up(heap, n++);
            } else if (n > 0 && beats(&e, &heap[0])) {
                ev[heap[0].index] = c;
                heap[0] = e;
                sift_down(heap, n, 0);
            } else {
                ev[c] = c;
            }
        }
    }
    free(heap);
    return 0;
}
