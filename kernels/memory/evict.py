# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The memory's ranking sweep in Triton, for a GPU: the steps of ``_evict_sweep`` in aaren_hf/modeling_aaren.py (the
reference; ``evict.c`` is the CPU's heap). First the candidates' ranks as numbers in one launch: where the reference
sorts (two sorts, gathers, a scatter and masks: ten operators), each candidate's (score, position) packs into one
int64 whose order is the ranking's (``_ranks_kernel``). Then, given per block of candidates the top set before it (the
M best real candidates so far, which one top-K over the ranks gives for every block at once), each program (block,
row) finds where the members of its top set and of its block drop out of the top set:

    above(x, e) = #{d in top set: rank d > rank x} + #{d in block, d <= e: rank d > rank x}
    x leaves at the first e with above(x, e) >= M (never before x itself enters)

The reference builds [blocks, M + block, M + block] comparisons and their running sums (a gigabyte at a 32K-token
piece) in about twenty operators; here they stay in registers, one launch. Each candidate drops out in one block
at most, so no two programs write one entry: the same indices as the reference, exactly.

The scores it ranks lie on a grid of 1/64 (``round_retention``; here ``_on_grid``, the same bits, which the decode
step's kernel ranks on too, and ``round_retention_triton``, one launch for a prefill's or a train step's scores).
"""

import torch
import triton
import triton.language as tl

from ..aaren.chunk import _ADD, device_function, get_kernel

DB = 64  # top-set members compared at a time
TILE = 16384  # running sums held at once, [candidates, block]: 32 candidates at M = 448, fewer for a larger M


def _ranks_kernel(pos, score, rank, evict, C, HKV, num_sinks, pos_b, pos_h, pos_c, score_b, score_h, score_c,
                  BC: tl.constexpr):
    i = tl.program_id(0) * BC + tl.arange(0, BC)
    row = tl.program_id(1).to(tl.int64)  # (sequence, kv head)
    b, h = row // HKV, row % HKV
    inside = i < C
    # read where they lie: the stream's positions are one row for every kv head, its scores [B, C, Hkv]
    p = tl.load(pos + b * pos_b + h * pos_h + i * pos_c, mask=inside, other=-1)
    s = tl.load(score + b * score_b + h * score_h + i * score_c, mask=inside, other=0).to(tl.float32)
    s = tl.where(s != s, float("-inf"), s)  # NaN ranks as round_retention has it
    s = tl.where(s == 0, 0.0, s)  # -0 ties with +0, as comparisons (the reference's sort, the heap) have it
    u = s.to(tl.int32, bitcast=True)
    u = tl.where(u < 0, u ^ 0x7FFFFFFF, u)  # a negative float's bits count up as it falls: turned, floats and ints
    # order alike; then score above, position below (positions of real candidates lie in 0 .. 2^31 - 1)
    key = ((u.to(tl.int64) + 2147483648) << 31) | p
    real = inside & (p >= num_sinks)
    tl.store(rank + row * (C + 1) + i, tl.where(real, key, -1), mask=i <= C)
    tl.store(evict + row * C + i, tl.where(real, C, -1), mask=inside)


def memory_ranks_triton(cand_pos, cand_score, num_sinks: int):
    """``candidate_ranks`` (modeling_aaren.py, the reference) in one launch: (rank [B, Hkv, C + 1], evict [B, Hkv, C]),
    int64, of candidates' positions [B, Hkv, C] int64 and scores (``round_retention``'s), read with their strides (no
    copy of an expanded or transposed view). rank: a number per real candidate (position >= num_sinks) that is higher
    the higher it ranks (by score, then the newer position), -1 for the others and for column C (an empty slot);
    evict: C (never leaves, so far), -1 for candidates that are not real. The numbers are not the reference's 0..C -
    1, only in its order: all the sweep compares. Positions of real candidates must lie below 2^31 (two billion
    tokens)."""
    B, Hkv, C = cand_pos.shape
    rank = torch.empty((B, Hkv, C + 1), dtype=torch.int64, device=cand_pos.device)
    evict = torch.empty((B, Hkv, C), dtype=torch.int64, device=cand_pos.device)
    BC = 1024
    get_kernel(_ranks_kernel, key=("BC",), warps=(4,), stages=(1,))[(triton.cdiv(C + 1, BC), B * Hkv)](
        cand_pos, cand_score, rank, evict, C, Hkv, num_sinks, *cand_pos.stride(), *cand_score.stride(), BC=BC)
    return rank, evict


def _evict_block_kernel(rank, top, evict, C, K, n, e_first, block, upto, M,
                        BP: tl.constexpr, XB: tl.constexpr, DB: tl.constexpr):
    i_n = tl.program_id(0)  # which block of this pass
    row = tl.program_id(1)  # (sequence, kv head)
    e0 = e_first + i_n * block
    ranks = rank + row.to(tl.int64) * (C + 1)  # column C: -1, an empty slot
    leaves = evict + row.to(tl.int64) * C
    tops = top + (row.to(tl.int64) * n + i_n) * K
    j = tl.arange(0, BP)
    in_block = j < block
    r_block = tl.load(ranks + e0 + j, mask=in_block & (e0 + j < upto), other=-1)
    for x0 in range(0, K + block, XB):
        xs = x0 + tl.arange(0, XB)
        idx = tl.load(tops + xs, mask=xs < K, other=C)
        # a top set's slot at or after the block's first is one top-K filled with a later candidate: empty (which
        # candidate top-K picks among those is the device's choice; the indices must not depend on it)
        idx = tl.where(xs < K, tl.where(idx < e0, idx, C),
                       tl.where((xs < K + block) & (e0 + xs - K < upto), e0 + xs - K, C))
        r_x = tl.load(ranks + idx)
        above = tl.full([XB], 0, tl.int32)
        for d0 in range(0, K, DB):
            ds = d0 + tl.arange(0, DB)
            d = tl.load(tops + ds, mask=ds < K, other=C)
            r_d = tl.load(ranks + tl.where(d < e0, d, C))
            above += tl.reduce((r_d[None, :] > r_x[:, None]).to(tl.int32), 1, _ADD)
        running = tl.associative_scan((r_block[None, :] > r_x[:, None]).to(tl.int32), 1, _ADD)  # [XB, BP]
        # how many of the block's positions x stays through (above grows with e)
        stays = tl.reduce(((above[:, None] + running < M) & in_block[None, :]).to(tl.int32), 1, _ADD)
        # candidates that are not real keep their -1
        tl.store(leaves + idx, tl.maximum(e0 + stays, idx), mask=(stays < block) & (idx < C) & (r_x >= 0))


def memory_evict_triton(rank, top, evict, e_first: int, block: int, upto: int, M: int):
    """``_evict_sweep``'s pass over blocks e_first, e_first + block, ...: rank [B, Hkv, C + 1] (the candidates' order,
    higher above; -1 for those that are not real and for column C), top [B, Hkv, n, K] (each block's top set as
    candidate indices; a slot holding the block's first candidate or a later one, or one of rank -1, is empty), evict
    [B, Hkv, C] written in place where a real candidate leaves."""
    B, Hkv, n, K = top.shape
    C = rank.shape[-1] - 1
    rank, top = rank.contiguous(), top.contiguous()
    assert evict.is_contiguous() and evict.shape == (B, Hkv, C)
    BP = triton.next_power_of_2(block)
    get_kernel(_evict_block_kernel, key=("BP",))[(n, B * Hkv)](
        rank, top, evict, C, K, n, e_first, block, upto, M, BP=BP, XB=max(2, min(32, TILE // BP)), DB=DB)
    return evict


@device_function
def _on_grid(score):
    """``round_retention``: float32 scores on a grid of 1/64, NaN as -inf; the rounding half to even, as torch.round
    (adding 2^23 to a magnitude below it leaves the nearest whole number, ties to even; from 2^23 on every float is
    whole), zeros and the scores that round to zero keeping their sign."""
    y = tl.where(score != score, float("-inf"), score) * 64
    a = tl.abs(y)
    a = tl.where(a < 8388608.0, (a + 8388608.0) - 8388608.0, a)
    return tl.where(y == 0, y, tl.where(y < 0, -a, a)) / 64


def _grid_kernel(x, y, N, BN: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    tl.store(y + i, _on_grid(tl.load(x + i, mask=i < N, other=0).to(tl.float32)), mask=i < N)


def round_retention_triton(score):
    """``round_retention`` (modeling_aaren.py) in one launch, the same bits (the decode step's kernel ranks on the
    same grid, ``_on_grid``): float32 scores on a grid of 1/64 of a float score of any shape, where the reference
    runs five operators (the cast, NaN, the product, the rounding, the quotient)."""
    if score.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    x = score.contiguous()
    y = torch.empty(score.shape, dtype=torch.float32, device=score.device)
    N, BN = x.numel(), 1024
    if N:
        get_kernel(_grid_kernel, key=("BN",), warps=(4,), stages=(1,))[(triton.cdiv(N, BN),)](
            x, y, N, BN=BN, enable_fp_fusion=False)
    return y
