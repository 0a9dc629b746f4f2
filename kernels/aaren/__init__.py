"""Aaren scan kernels: ``naive_aaren`` (reference, plain PyTorch) and the Triton kernels.

The Triton ones are imported on first use, so that this package imports without triton installed.

``aaren_prefill_cpu``: the model's Aaren branch (slot scores, decays, the scan, the slots' mix) over a prompt on a CPU
without gradients, token after token in C (``step.c``); reference ``AarenMixer.aaren_output``'s PyTorch path, whose
scan is ``aaren_scan.chunk_aaren_mixed``.
"""

import ctypes
from pathlib import Path

import torch

from ..cbuild import as_bytes, dense, load, records_grad
from .naive import naive_aaren

__all__ = ["naive_aaren", "chunk_aaren_triton", "fused_recurrent_aaren_triton", "aaren_prefill_cpu"]

SOURCES = (Path(__file__).parent / "step.c",)
SIGNATURES = {"aaren_branch_prefill": (ctypes.c_int, [ctypes.c_int] * 7 + [ctypes.c_float] + [ctypes.c_void_p] * 11)}
DECAYS = {"none": 0, "fixed": 1, "learned": 1, "input": 2}


def aaren_prefill_cpu(q, k, v, mask, queries, scale: float, decay: str, log_decay=None, decay_in=None,
                      initial_state=None, output_final_state=False):
    """``AarenMixer.aaren_output`` over a prompt (its PyTorch path's results, to float rounding) as one C call:
    q [B, T, H, D] (None with one slot), k, v [B, T, Hkv, D], mask [B, T] (False: padding), the slot queries
    [H, J, D] and ``scale``; ``decay`` as the config names it, with log_decay [H, J] and for "input" decay_in
    [B, T, H*J] (the decay projection of x); the state per op head. Returns (out [B, T, H, D] in v's dtype, the masked
    slot scores s [B, T, H*J] float32, the final state or None). None where it does not apply: gradients wanted, not
    on a CPU, float64, more slots than it takes, no compiler (then the caller runs the reference)."""
    tensors = (q, k, v, queries, log_decay, decay_in, *(initial_state or ()))
    present = [t for t in tensors if t is not None]
    if (records_grad(*present)
            or any(t.device.type != "cpu" or t.dtype == torch.float64 for t in present) or decay not in DECAYS):
        return None
    lib = load("aaren_scan", SOURCES, SIGNATURES, "the chunked PyTorch scan")
    if lib is None:
        return None
    B, T, Hkv, D = v.shape
    H, J = queries.shape[0], queries.shape[1]
    if initial_state is None:
        from aaren_hf.aaren_scan import empty_state  # on first use, as chunk.py does: see kernels/__init__.py

        o, lse = empty_state(B, H * J, D)
    else:  # the caller's state is left as it was
        o, lse = (t.float().clone(memory_format=torch.contiguous_format) for t in initial_state)
    code = DECAYS[decay]
    dtype = v.dtype
    q, k, v, queries, log_decay, decay_in = (
        None if t is None else dense(t.detach().float())
        for t in (None if J == 1 else q, k, v, queries, log_decay if code else None, decay_in if code == 2 else None))
    s, out = torch.empty(B, T, H * J), torch.empty(B, T, H, D)
    ins = [q, k, v, as_bytes(mask), queries, log_decay, decay_in]
    rc = lib.aaren_branch_prefill(B, T, H, Hkv, D, J, code, scale,
                                  *(None if t is None else t.data_ptr() for t in [*ins, o, lse, s, out]))
    if rc == 1:  # more slots than the kernel takes
        return None
    if rc != 0:
        raise RuntimeError(f"aaren_branch_prefill failed ({rc}) for B={B} T={T} H={H} Hkv={Hkv} D={D} J={J}")
    return out.to(dtype), s, ((o, lse) if output_final_state else None)


def __getattr__(name):
    if name == "chunk_aaren_triton":
        from .chunk import chunk_aaren_triton

        return chunk_aaren_triton
    if name == "fused_recurrent_aaren_triton":
        from .fused_recurrent import fused_recurrent_aaren_triton

        return fused_recurrent_aaren_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
