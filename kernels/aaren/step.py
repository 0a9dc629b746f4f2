"""The Aaren branch's one-token decode step on a CPU as one C call (``step.c``), for ``AarenMixer.aaren_output``.

The reference is the PyTorch decode path of ``AarenMixer.aaren_output`` (``slot_scores``, the slots' mix, the decay
and ``aaren_scan.aaren_step``; what a checkpoint's own copy of the code runs): this kernel leaves the same state and
output to float rounding (tests/test_aaren_step_kernel.py). On a CPU that is about 50 small operators per layer;
here it is one call. Compiled on first use (``kernels/cbuild.py``); None where it does not apply, and the mixer runs
the reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..cbuild import dense, load

__all__ = ["aaren_step_cpu", "library"]

SOURCE = Path(__file__).with_name("step.c")
SIGNATURES = {"aaren_branch_step": (ctypes.c_int, [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_void_p] * 13)}
DECAY = {"none": 0, "fixed": 1, "learned": 1, "input": 2}


def library():
    """The compiled step (ctypes), built on first use; None when disabled or when no compiler can build it."""
    return load(SOURCE, SIGNATURES, "the PyTorch Aaren step")


def aaren_step_cpu(q, k, v, mask, queries, log_decay, decay_in, state, *, decay: str, scale: float):
    """The Aaren branch for one token from ``state`` (``aaren_o`` [B, H*J, D], ``aaren_lse`` [B, H*J] float32):
    q [B, 1, H, D] (None with one slot), k and v [B, 1, Hkv, D], mask [B, 1] bool (False: padding), queries [H, J, D],
    log_decay [H, J] (None without decay), decay_in [B, 1, H*J] (``decay_proj(x)`` with input decay, else None).

    Returns (out [B, 1, H, D], scores [B, 1, H*J]) float32 and replaces the state's two tensors with new ones (the
    old ones may be shared, as ``AarenAttention`` shares its caller's); None, touching nothing, where it does not
    apply: not CPU float32, or more slots than step.c takes."""
    tensors = (q, k, v, queries, log_decay, decay_in, state.aaren_o, state.aaren_lse)
    if mask.dtype != torch.bool or any(t is not None and (t.device.type != "cpu" or t.dtype != torch.float32)
                                       for t in tensors):
        return None
    lib = library()
    if lib is None:
        return None
    B, _, Hkv, D = v.shape
    H, J = queries.shape[:2]
    o_new, lse_new = torch.empty(B, H * J, D), torch.empty(B, H * J)
    scores, out = torch.empty(B, 1, H * J), torch.empty(B, 1, H, D)
    # held here until the call returns: a contiguous copy made on the way would otherwise be freed before it
    inputs = [None if t is None else dense(t) for t in (q, k, v, mask, queries, log_decay, decay_in, state.aaren_o,
                                                         state.aaren_lse)]
    rc = lib.aaren_branch_step(B, H, Hkv, D, J, DECAY[decay], float(scale),
                               *(None if t is None else t.data_ptr() for t in inputs),
                               o_new.data_ptr(), lse_new.data_ptr(), scores.data_ptr(), out.data_ptr())
    if rc != 0:  # more slots than step.c's MAX_J: it wrote nothing
        return None
    state.aaren_o, state.aaren_lse = o_new, lse_new
    return out, scores
