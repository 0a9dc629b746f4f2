# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Each block of queries' list of memory candidates in Triton, for a GPU: ``_memory_lists`` in
aaren_hf/modeling_aaren.py is the reference. A block of Q queries whose last eligible candidate indices run from lo
to hi sees candidate c if c <= hi and c leaves the memory after lo (``evict[c] > lo``); the window attention kernel
(``window/chunk.py``) reads each block's list and decides per query. The reference builds that test for every
(block, candidate), [B, blocks, Hkv, C] (a 32K-token piece: 512 blocks by 32K candidates per kv head), and a top-K
over it to bring the seen ones first, about fourteen operators. Here one program per (block, sequence x kv head)
counts what its block sees, then writes the seen candidates first, in candidate order, and fills the rest of its K
entries with unseen ones, each once (the attention kernel reads every entry up to the most any block needs, and an
entry it reads twice would count twice; an unseen one counts for none of the block's queries). The reference's sets
and counts, exactly; the order within them is the candidates' (the reference's top-K leaves any order).
"""

import torch
import triton.language as tl

from ..aaren.chunk import _ADD, get_kernel

BC = 1024  # candidates read at a time


def _lists_kernel(evict, last, idx, seen_count, C, T, Q, K, HKV: tl.constexpr, BC: tl.constexpr):
    i_n = tl.program_id(0)  # which block of queries
    row = tl.program_id(1)  # (sequence, kv head)
    n_blk = tl.num_programs(0)
    at_list = (row // HKV).to(tl.int64) * n_blk * HKV + i_n * HKV + row % HKV  # [B, blocks, Hkv] order
    lo = tl.load(last + i_n * Q)
    hi = tl.load(last + tl.minimum(i_n * Q + Q - 1, T - 1))
    ends = evict + row.to(tl.int64) * C
    total = tl.full([], 0, tl.int32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        seen = (c < C) & (c <= hi) & (tl.load(ends + c, mask=c < C, other=-1) > lo)
        total += tl.reduce(seen.to(tl.int32), 0, _ADD)
    out = idx + at_list * K
    n_seen = tl.full([], 0, tl.int32)
    n_unseen = tl.full([], 0, tl.int32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        real = c < C
        seen = real & (c <= hi) & (tl.load(ends + c, mask=real, other=-1) > lo)
        unseen = real & ~seen
        s, u = seen.to(tl.int32), unseen.to(tl.int32)
        at = tl.where(seen, n_seen + tl.associative_scan(s, 0, _ADD) - s,
                      total + n_unseen + tl.associative_scan(u, 0, _ADD) - u)
        tl.store(out + at, c.to(tl.int64), mask=real & (at < K))
        n_seen += tl.reduce(s, 0, _ADD)
        n_unseen += tl.reduce(u, 0, _ADD)
    tl.store(seen_count + at_list, total.to(tl.int64))


def candidate_lists(evict, last, T: int, nblk: int, Q: int, K: int):
    """(indices [B, nblk, Hkv, K]: each block's seen candidates first, then unseen ones, each group in candidate
    order, none twice; seen [B, nblk, Hkv] int64: how many each list sees), K <= C. Also the memory a piece leaves
    (``keep.py``: one block, the next query)."""
    B, Hkv, C = evict.shape
    evict, last = evict.contiguous(), last.contiguous()
    idx = torch.empty(B, nblk, Hkv, K, dtype=torch.int64, device=evict.device)
    seen = torch.empty(B, nblk, Hkv, dtype=torch.int64, device=evict.device)
    if B * Hkv and nblk:
        get_kernel(_lists_kernel, key=("HKV", "BC"), warps=(4,), stages=(1,))[(nblk, B * Hkv)](
            evict, last, idx, seen, C, T, Q, K, HKV=Hkv, BC=BC)
    return idx, seen


def memory_lists_triton(evict, last, T: int, nblk: int, Q: int, width: int):
    """``_memory_lists(evict, last, T, nblk, Q, width)``: evict [B, Hkv, C] (the index at which each candidate leaves
    the memory), last [>= T] (each query's last eligible candidate index). Returns (indices [B, nblk, Hkv, K] with
    K = min(C, width), each block's seen candidates first, then unseen ones, none twice; counts [nblk], the most any
    list of the block sees)."""
    idx, seen = candidate_lists(evict, last, T, nblk, Q, max(1, min(evict.shape[-1], width)))
    return idx, seen.amax((0, 2))
