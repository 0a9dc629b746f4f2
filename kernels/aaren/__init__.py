"""Aaren scan kernels: ``naive_aaren`` (reference, plain PyTorch) and the Triton kernels.

The Triton ones are imported on first use, so that this package imports without triton installed.

``aaren_scan_cpu``: the model's read of the scan (slots mixed, values shared per kv head) over a prompt on a CPU
without gradients, token after token in C (``step.c``); reference ``aaren_scan.chunk_aaren_mixed``.
"""

import ctypes
from pathlib import Path

import torch

from ..cbuild import dense, load
from .naive import naive_aaren

__all__ = ["naive_aaren", "chunk_aaren_triton", "fused_recurrent_aaren_triton", "aaren_scan_cpu"]

SOURCES = (Path(__file__).parent / "step.c",)
SIGNATURES = {"aaren_scan_mixed": (ctypes.c_int, [ctypes.c_int] * 6 + [ctypes.c_void_p] * 7)}


def aaren_scan_cpu(s, v, mix, g=None, initial_state=None, output_final_state=False):
    """``chunk_aaren_mixed(s, v, mix, g, initial_state, output_final_state)`` (same arguments and results, to float
    rounding) as one C call: s [B, T, H*J] with -inf at padding, v [B, T, Hkv, D], mix [B, T, H, J], g like s or
    None (0 at padding), state per op head. None where it does not apply: gradients wanted, not on a CPU, float64,
    no compiler (then the caller runs the reference)."""
    tensors = (s, v, mix, g, *(initial_state or ()))
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if wants_grad or v.is_cuda or torch.float64 in (s.dtype, v.dtype):
        return None
    lib = load("aaren_scan", SOURCES, SIGNATURES, "the chunked PyTorch scan")
    if lib is None:
        return None
    B, T, Hkv, D = v.shape
    H, J = mix.shape[2], mix.shape[3]
    if initial_state is None:
        from aaren_hf.aaren_scan import empty_state  # on first use, as chunk.py does: see kernels/__init__.py

        o, lse = empty_state(B, H * J, D)
    else:  # the caller's state is left as it was
        o, lse = (t.float().clone(memory_format=torch.contiguous_format) for t in initial_state)
    s_, v_, mix_ = dense(s.float()), dense(v.float()), dense(mix.float())
    g_ = None if g is None else dense(g.float())
    out = torch.empty(B, T, H, D)
    rc = lib.aaren_scan_mixed(B, T, H, Hkv, D, J, s_.data_ptr(), None if g_ is None else g_.data_ptr(),
                              v_.data_ptr(), mix_.data_ptr(), o.data_ptr(), lse.data_ptr(), out.data_ptr())
    if rc == 1:  # more slots than the kernel takes
        return None
    if rc != 0:
        raise RuntimeError(f"aaren_scan_mixed failed ({rc}) for B={B} T={T} H={H} Hkv={Hkv} D={D} J={J}")
    return out.to(v.dtype), ((o, lse) if output_final_state else None)


def __getattr__(name):
    if name == "chunk_aaren_triton":
        from .chunk import chunk_aaren_triton

        return chunk_aaren_triton
    if name == "fused_recurrent_aaren_triton":
        from .fused_recurrent import fused_recurrent_aaren_triton

        return fused_recurrent_aaren_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
