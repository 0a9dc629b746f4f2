"""The memory tier's kernels; ``modeling_aaren.py`` holds the reference, which runs wherever they do not (no
compiler, ``AAREN_BACKEND=torch``, a checkpoint's own copy of the code; the ranking on CUDA). On a GPU, the codes in
Triton (``codes.py``: ``fused_memory_round`` in ``aaren_hf.kernels``, and the decode step's coding). On a CPU, in C:

- ``memory_evict_cpu`` (``evict.c``): when each candidate leaves the memory, for ``memory_visibility``, whose block
  sweep is the reference. Same indices, exactly (tests/test_model.py runs the brute-force check on both); a heap per
  row instead of ranking blocks of M + block candidates against each other.
- ``memory_round_cpu`` (``codes.c``, ``codes.h``): ``MemoryCodes.round_with_codes``, the codes a vector would be
  stored as and what they read back, one loop over the vectors where the reference takes about forty operators
  over the whole tensor. Same codes, scales and values, bit for bit (tests/test_model.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..cbuild import dense, load

__all__ = ["memory_evict_cpu", "memory_round_cpu"]

SOURCES = (Path(__file__).parent / "evict.c", Path(__file__).parent / "codes.c")
HEADERS = (Path(__file__).parent / "codes.h",)
SIGNATURES = {"aaren_memory_evict": (ctypes.c_int, [ctypes.c_int] * 5 + [ctypes.c_void_p] * 3),
              "aaren_memory_round": (ctypes.c_int, [ctypes.c_int64] + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4)}


def library():
    return load("memory", SOURCES, SIGNATURES, "the PyTorch ranking sweep and coding", HEADERS)


def memory_evict_cpu(cand_pos, cand_score, upto: int, num_sinks: int, memory_size: int):
    """evict [B, Hkv, C] int64 of candidates [B, Hkv, C] (positions int64, scores): for a real candidate before
    ``upto``, the first candidate index at which ``memory_size`` candidates so far rank above it (its own index
    when it never enters); C elsewhere. None where the kernel does not apply (not on a CPU, no compiler)."""
    if cand_pos.is_cuda or cand_pos.dtype != torch.int64:
        return None
    lib = library()
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


def memory_round_cpu(x, bits: int, rotate: bool):
    """``MemoryCodes(bits, rotate).round_with_codes(x)`` without its gradient: (values [..., D] float32, (codes,
    scale [..., 1] bfloat16)) for float32 x [..., D]; None where the kernel does not apply (not on a CPU, not
    float32, a width it does not take, no compiler)."""
    if x.is_cuda or x.dtype != torch.float32 or x.dim() == 0:
        return None
    lib = library()
    if lib is None:
        return None
    D = x.shape[-1]
    x_ = dense(x.detach())
    back = torch.empty(x.shape)
    codes = torch.empty(*x.shape[:-1], D // 2 if bits == 4 else D, dtype=torch.uint8 if bits == 4 else torch.int8)
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.bfloat16)
    rc = lib.aaren_memory_round(x.numel() // max(D, 1), D, bits, int(rotate), x_.data_ptr(), back.data_ptr(),
                                codes.data_ptr(), scale.data_ptr())
    if rc == 1:
        return None
    if rc != 0:
        raise RuntimeError(f"aaren_memory_round failed ({rc}) for shape {tuple(x.shape)}, {bits} bits")
    return back, (codes, scale)
