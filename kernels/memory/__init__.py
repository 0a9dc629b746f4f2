"""The memory tier's kernels; ``modeling_aaren.py`` holds the reference, which runs wherever they do not (no
compiler, ``AAREN_BACKEND=torch``, a checkpoint's own copy of the code). On a GPU, in Triton: the codes
(``codes.py``: ``fused_memory_round`` in ``aaren_hf.kernels``, and the decode step's coding), the ranking sweep's
blocks (``evict.py``: ``fused_memory_evict``), each block of queries' list of candidates for window attention
(``lists.py``: ``fused_memory_lists``) and the slots a prefill piece leaves (``keep.py``: ``fused_keep_memory``, its
order from the lists kernel). On a CPU, in C:

- ``memory_evict_cpu`` (``evict.c``): when each candidate leaves the memory, for ``memory_visibility``, whose block
  sweep is the reference. Same indices, exactly (tests/test_model.py runs the brute-force check on both); a heap per
  row instead of ranking blocks of M + block candidates against each other.
- ``memory_round_cpu`` (``codes.c``, ``codes.h``): ``MemoryCodes.round_with_codes``, the codes a vector would be
  stored as and what they read back, one loop over the vectors where the reference takes about forty operators
  over the whole tensor. Same codes, scales and values, bit for bit (tests/test_model.py).
- ``memory_prefill_cpu`` (``prefill.c``, with the two above): a prompt's ``AarenMixer.memory_candidates`` and
  ``keep_memory`` without gradients, in one call where the reference takes about fifty operators a layer. Same
  indices, state and logits, bit for bit (tests/test_model.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..cbuild import dense, load

__all__ = ["memory_evict_cpu", "memory_prefill_cpu", "memory_round_cpu"]

MEMORY_PARTS = ("k", "v", "k_scale", "v_scale", "pos", "score")  # the state's memory_* tensors, in the C call's order

SOURCES = tuple(Path(__file__).parent / name for name in ("evict.c", "codes.c", "prefill.c"))
SIGNATURES = {"aaren_memory_evict": (ctypes.c_int, [ctypes.c_int] * 5 + [ctypes.c_void_p] * 3),
              "aaren_memory_round": (ctypes.c_int, [ctypes.c_int64] + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4),
              "aaren_memory_prefill": (ctypes.c_int, [ctypes.c_int] * 13 + [ctypes.c_void_p] * 24)}


def library():
    return load("memory", SOURCES, SIGNATURES, "the PyTorch ranking sweep and coding")


def memory_evict_cpu(cand_pos, cand_score, upto: int, num_sinks: int, memory_size: int):
    """evict [B, Hkv, C] int64 of candidates [B, Hkv, C] (positions int64, scores): for a real candidate before
    ``upto``, the first candidate index at which ``memory_size`` candidates so far rank above it (its own index
    when it never enters); -1 for candidates that are not real (position < ``num_sinks``), C for the others. None
    where the kernel does not apply (not on a CPU, no compiler)."""
    if cand_pos.is_cuda or cand_pos.dtype != torch.int64:
        return None
    lib = library()
    if lib is None:
        return None
    B, Hkv, C = cand_pos.shape
    pos, score = dense(cand_pos), dense(cand_score.float())
    evict = torch.where(pos >= num_sinks, C, -1)
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


def memory_prefill_cpu(k, v, pos, retention, k_prev, v_prev, pos_prev, score_prev, state, window: int,
                       num_sinks: int, memory_size: int, bits: int, rotate: bool):
    """``AarenMixer.memory_candidates`` (and with a ``state``, the memory ``keep_memory`` leaves there) for a memory of
    ``bits``-bit codes: k, v [B, T, Hkv, D] float32 (k rotated), pos [B, T], retention [B, T, Hkv]; the window held
    (k_prev, v_prev [B, Wp, Hkv, D] float32 or bfloat16, pos_prev, score_prev) and the layer's state (None: no cache;
    its memory_* tensors, MEMORY_PARTS, hold the memory once filled). Returns (cand_k, cand_v [B, Hkv, C, D], evict
    [B, Hkv, C], last [T + 1], the next memory {part: tensor} or None without a state); None where the kernel does
    not apply (gradients wanted, not on a CPU, other dtypes or widths, no compiler). A stream token that never
    enters the memory before the last query, and is not stored, is neither coded nor read: zeros in cand_k/cand_v,
    which attention weighs 0 as it would its values."""
    tensors = (k, v, k_prev, v_prev, retention, score_prev)
    if (torch.is_grad_enabled() or any(t.device.type != "cpu" for t in tensors) or k.dtype != torch.float32
            or v.dtype != torch.float32 or k_prev.dtype != v_prev.dtype
            or k_prev.dtype not in (torch.float32, torch.bfloat16) or retention.dtype != torch.float32
            or score_prev.dtype != torch.float32 or pos.dtype != torch.int64 or pos_prev.dtype != torch.int64
            or bits not in (4, 8)):
        return None
    lib = library()
    if lib is None:
        return None
    B, T, Hkv, D = k.shape
    Wp, M, keep = k_prev.shape[1], memory_size, state is not None
    memory = None if state is None or state.memory_k is None else {
        name: getattr(state, "memory_" + name) for name in MEMORY_PARTS}
    held = 0 if memory is None else M
    C = held + Wp + T
    width, code = (D // 2, torch.uint8) if bits == 4 else (D, torch.int8)
    if memory is not None and any(memory[name].dtype != want for name, want in (("k", code), ("v", code),
                                                                                 ("pos", torch.int64))):
        return None
    cand_k, cand_v = torch.empty(B, Hkv, C, D), torch.empty(B, Hkv, C, D)
    evict, last = torch.empty(B, Hkv, C, dtype=torch.int64), torch.empty(T + 1, dtype=torch.int64)
    kept = None
    if keep:
        kept = {"k": torch.empty(B, Hkv, M, width, dtype=code), "v": torch.empty(B, Hkv, M, width, dtype=code),
                "k_scale": torch.empty(B, Hkv, M, 1, dtype=torch.bfloat16),
                "v_scale": torch.empty(B, Hkv, M, 1, dtype=torch.bfloat16),
                "pos": torch.empty(B, Hkv, M, dtype=torch.int64), "score": torch.empty(B, Hkv, M)}
    held_parts = [None] * len(MEMORY_PARTS) if memory is None else [dense(memory[name]) for name in MEMORY_PARTS]
    ins = [dense(t.detach()) for t in (k_prev, v_prev, k, v, pos_prev, pos, score_prev, retention)] + held_parts
    outs = [cand_k, cand_v, evict, last] + [None if kept is None else kept[name] for name in MEMORY_PARTS]
    rc = lib.aaren_memory_prefill(B, Hkv, D, M, held, Wp, T, window, num_sinks, bits, int(rotate),
                                  int(k_prev.dtype == torch.bfloat16), int(keep),
                                  *(None if t is None else t.data_ptr() for t in ins + outs))
    if rc == 1:
        return None
    if rc != 0:
        raise RuntimeError(f"aaren_memory_prefill failed ({rc}) for B={B} Hkv={Hkv} D={D} C={C} M={M}")
    return cand_k, cand_v, evict, last, kept
