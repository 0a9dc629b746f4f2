"""The memory tier's ranking on a CPU: when each candidate leaves the memory, in C (``evict.c``), for
``memory_visibility`` in ``modeling_aaren.py``, whose block sweep is the reference and runs everywhere else (CUDA, no
compiler, ``AAREN_BACKEND=torch``, a checkpoint's own copy of the code). Same indices, exactly
(tests/test_model.py runs the brute-force check on both); a heap per row instead of ranking blocks of
M + block candidates against each other.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..cbuild import dense, load

__all__ = ["memory_evict_cpu"]

SOURCES = (Path(__file__).parent / "evict.c",)
SIGNATURES = {"aaren_memory_evict": (ctypes.c_int, [ctypes.c_int] * 5 + [ctypes.c_void_p] * 3)}


def memory_evict_cpu(cand_pos, cand_score, upto: int, num_sinks: int, memory_size: int):
    """evict [B, Hkv, C] int64 of candidates [B, Hkv, C] (positions int64, scores): for a real candidate before
    ``upto``, the first candidate index at which ``memory_size`` candidates so far rank above it (its own index
    when it never enters); C elsewhere. None where the kernel does not apply (not on a CPU, no compiler)."""
    if cand_pos.is_cuda or cand_pos.dtype != torch.int64:
        return None
    lib = load("memory_evict", SOURCES, SIGNATURES, "the PyTorch ranking sweep")
    if lib is None:
        return None
    B, Hkv, C = cand_pos.shape
    pos, score = dense(cand_pos), dense(cand_score.float())
    evict = torch.full((B, Hkv, C), C, dtype=torch.int64)
    rc = lib.aaren_memory_evict(B * Hkv, C, upto, memory_size, num_sinks, pos.data_ptr(), score.data_ptr(),
                                evict.data_ptr())
    if rc != 0:
        raise RuntimeError(f"aaren_memory_evict failed ({rc}) for B={B} Hkv={Hkv} C={C} M={memory_size}")
    return evict
