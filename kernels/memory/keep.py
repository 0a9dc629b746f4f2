# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The memory a prefill piece leaves, in Triton, for a GPU: ``AarenMixer.keep_memory`` (with ``fill_memory``) in
aaren_hf/modeling_aaren.py is the reference, ``prefill.c`` the CPU's counterpart. The memory after the piece is the
top set of the next query: the candidates it would see. The reference tests every candidate (``memory_seen``), sorts
the kept ones first, gathers keys, values, scales, positions and scores into the M slots and clears what was not
kept, about twenty operators. Here the candidate list kernel (``lists.py``) orders the candidates as that sort does,
the kept ones first, each group in candidate order, and one launch copies them into the slots: the reference's state
bit for bit.
"""

import torch
import triton
import triton.language as tl

from ..aaren.chunk import device_function, get_kernel
from .lists import candidate_lists


@device_function
def _copy_rows(x, out, src, dst, has, m_m, m_e, EMPTY):
    # keys and values stored in another dtype are on its grid already (round_to_cache): the cast is exact
    val = tl.load(x + src, mask=has[:, None] & m_e, other=0)
    tl.store(out + dst, tl.where(has[:, None], val, EMPTY).to(out.dtype.element_ty), mask=m_m[:, None] & m_e)


def _keep_kernel(idx, kept, k, v, k_scale, v_scale, pos, score, new_k, new_v, new_k_scale, new_v_scale, new_pos,
                 new_score, C, M, K, EMPTY, pos_b, pos_h, pos_c, score_b, score_h, score_c, HKV: tl.constexpr,
                 E: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, HAS_SCALE: tl.constexpr):
    # slot m of row (sequence, kv head) takes candidate idx[m] (the first `kept` of them are kept); slots past the
    # K = min(C, M) candidates stay empty, as the reference's padding leaves them
    row = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    m_m = m < M
    has = m < K
    c = tl.load(idx + row * K + m, mask=has, other=0)
    keep = m < tl.load(kept + row)
    e = tl.arange(0, BE)[None, :]
    m_e = e < E
    src = (row * C + c)[:, None] * E + e
    dst = (row * M + m)[:, None] * E + e
    _copy_rows(k, new_k, src, dst, has, m_m, m_e, EMPTY)
    _copy_rows(v, new_v, src, dst, has, m_m, m_e, EMPTY)
    if HAS_SCALE:  # an empty slot's scale is 0
        tl.store(new_k_scale + row * M + m, tl.load(k_scale + row * C + c, mask=has, other=0), mask=m_m)
        tl.store(new_v_scale + row * M + m, tl.load(v_scale + row * C + c, mask=has, other=0), mask=m_m)
    # what was not kept: position -1, score -inf (its key and value stay, as the reference leaves them). Positions
    # and scores are read where they lie: a first piece's are views (broadcast over the heads; transposed)
    b, h = row // HKV, row % HKV
    p = tl.load(pos + b * pos_b + h * pos_h + c * pos_c, mask=has & keep, other=-1)
    tl.store(new_pos + row * M + m, p, mask=m_m)
    s = tl.load(score + b * score_b + h * score_h + c * score_c, mask=has & keep, other=float("-inf"))
    tl.store(new_score + row * M + m, s, mask=m_m)


def keep_memory_triton(evict, last, M: int, k, v, pos, score, k_scale=None, v_scale=None, stored=None, empty=0):
    """The memory's M slots after a piece: evict [B, Hkv, C] (where each candidate leaves the memory, -1 for those
    never in it), ``last`` [1] (the next query's last eligible candidate index); k, v [B, Hkv, C, E] (codes, with
    k_scale and v_scale [B, Hkv, C, 1]; or keys and values, stored in ``stored``), pos [B, Hkv, C] int64, score
    [B, Hkv, C] float32. ``empty``: what an empty slot's keys and values hold (a zero vector's code byte). Returns
    {"k", "v", "pos", "score"[, "k_scale", "v_scale"]}, each [B, Hkv, M, ...]; None where the kernel does not take
    the inputs."""
    B, Hkv, C = evict.shape
    coded = k_scale is not None
    out_dtype = k.dtype if coded else (stored or k.dtype)
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if (C == 0 or M < 1 or v.shape != k.shape or v.dtype != k.dtype or k.shape[:3] != (B, Hkv, C)
            or pos.shape != evict.shape or score.shape != evict.shape or pos.dtype != torch.int64
            or score.dtype != torch.float32 or last.numel() != 1
            or (coded and (k_scale.shape != (B, Hkv, C, 1) or v_scale.shape != k_scale.shape
                           or v_scale.dtype != k_scale.dtype))
            or (not coded and (k.dtype not in floats or out_dtype not in floats))):
        return None
    E, K, device = k.shape[-1], min(C, M), k.device
    idx, kept = candidate_lists(evict, last, 1, 1, 1, K)
    new_k, new_v = (torch.empty(B, Hkv, M, E, dtype=out_dtype, device=device) for _ in range(2))
    out = {"k": new_k, "v": new_v, "pos": torch.empty(B, Hkv, M, dtype=torch.int64, device=device),
           "score": torch.empty(B, Hkv, M, dtype=torch.float32, device=device)}
    scales = (pos,) * 4  # placeholders: HAS_SCALE keeps them unread
    if coded:
        out["k_scale"], out["v_scale"] = (torch.empty(B, Hkv, M, 1, dtype=k_scale.dtype, device=device)
                                          for _ in range(2))
        scales = (k_scale.contiguous(), v_scale.contiguous(), out["k_scale"], out["v_scale"])
    if B * Hkv:
        BE = triton.next_power_of_2(E)
        BM = max(1, min(64, 8192 // BE))
        get_kernel(_keep_kernel, key=("E", "BM"), warps=(4,), stages=(1,))[(B * Hkv, triton.cdiv(M, BM))](
            idx, kept, k.contiguous(), v.contiguous(), scales[0], scales[1], pos, score, new_k, new_v, scales[2],
            scales[3], out["pos"], out["score"], C, M, K, empty, *pos.stride(), *score.stride(), HKV=Hkv, E=E, BE=BE,
            BM=BM, HAS_SCALE=coded)
    return out
