"""A mixer layer's one-token decode step on a CPU as one C call, for ``AarenMixer.forward``.

``step.c`` composes the two branch kernels, compiled with it into one library (``kernels/cbuild.py``):
``aaren/step.c`` (the Aaren branch: slot scores, the slots' mix, the decay, the scan's step) and ``window/step.c``
(the window branch: rotary, one softmax over window, sinks and memory, the memory's update), with the retention score
and the gate between them. The reference is the PyTorch code of ``AarenMixer.forward`` for a decode token (the
decode paths of ``aaren_output`` and ``window_step``; what a checkpoint's own copy of the code runs). The kernel
leaves the same state: the Aaren state to float rounding (exp and log by polynomials, products in another order), the
rest bit for bit (window, sinks, the memory's choices and codes; with ``memory_rule="aaren"`` the ranking reads the
kernel's slot scores, so a score within rounding of a 1/64 grid line could rank otherwise); and the same output to
float rounding (tests/test_mixer_step_kernel.py). Without a compiler, or with ``AAREN_BACKEND=torch`` (or
``naive``), ``mixer_step_cpu`` returns None and the mixer runs the reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..aaren import DECAYS
from ..cbuild import dense, load
from ..state import writable

__all__ = ["mixer_step_cpu", "library"]

KERNELS = Path(__file__).parent.parent
SOURCES = (KERNELS / "aaren" / "step.c", KERNELS / "window" / "step.c", KERNELS / "mixer" / "step.c")
HEADERS = (KERNELS / "memory" / "codes.h", KERNELS / "vec8.h")  # the memory's codes, which window/step.c uses
SIGNATURES = {"aaren_mixer_step": (ctypes.c_int, [ctypes.c_int] * 16 + [ctypes.c_float] + [ctypes.c_void_p] * 37)}
RULE = {"learned": 1, "aaren": 2}


def library():
    """The compiled step (ctypes), built on first use; None when disabled or when no compiler can build it."""
    return load("mixer_step", SOURCES, SIGNATURES, "the PyTorch steps, about half as fast", HEADERS)


def _float32_cpu(*tensors) -> bool:
    return all(t is None or (t.is_cpu and t.dtype == torch.float32) for t in tensors)


def mixer_step_cpu(q, k, v, pos, mask, state, *, queries, log_decay, decay_in, decay, angles, sink_turn, window,
                   sinks, memory_size, bits, rotate, retention, rule, share, shared_retention, gate, scale):
    """``AarenMixer.forward`` for one token between its projections and ``o_proj``: q [B, 1, H, D] (None without
    q_proj), k and v [B, 1, Hkv, D] float32 before rotary, pos [B, 1] int64 (-1: padding), mask [B, 1] bool.

    Aaren branch (``queries`` [H, J, D], None without one): ``log_decay`` [H, J] or None, ``decay_in`` [B, 1, H*J]
    (``decay_proj(x)``) with input decay. Window branch (``window`` 0: none): ``angles`` and ``sink_turn`` from
    ``AarenMixer.step_angles``. Memory (``memory_size`` > 0): ``retention`` [B, 1, Hkv] (``retention_proj(x)``) with
    ``rule`` "learned"; ``share`` 1 writes this layer's best score to ``shared_retention`` [B, 1, 1], 2 ranks by
    the larger of its own and that one. ``gate``: the window gate's logits, [H] or [B, 1, H].

    Returns the mixed output [B, 1, H, D] float32 and leaves the new state, written in place (a state tensor that is
    not contiguous, or was made under inference mode and is used outside it, is first replaced by a copy: the
    state's tensors are its own, ``AarenLayerState.copy`` clones them all); None, touching nothing, where the kernel
    does not apply: not CPU float32, a float16 cache, a head size, query group or slot count beyond the kernels'
    limits.
    """
    B, _, Hkv, D = k.shape
    H = q.shape[2] if q is not None else queries.shape[0]
    J = 0 if queries is None else queries.shape[1]
    M = memory_size if window else 0
    stored = state.window_k.dtype if window else torch.float32
    # (more slots than aaren/step.c takes is left to the C call: it returns 1 before writing anything)
    if (mask.dtype != torch.bool or pos.dtype != torch.int64 or stored not in (torch.float32,
            torch.bfloat16) or H % Hkv or (window and q is None)
            or not _float32_cpu(q, k, v, queries, log_decay, decay_in, retention, gate, state.aaren_o if J else None)
            or (M > 0 and bits is None and state.memory_k.dtype != stored)):
        return None
    lib = library()
    if lib is None:
        return None
    # held here until the call returns: a contiguous copy made on the way would otherwise be freed before it
    inputs = [None if t is None else dense(t) for t in (q, k, v, pos, mask, queries, log_decay, decay_in)]
    # the state is written in place: each tensor contiguous and the state's own (a copy, where it was not)
    inference = torch.is_inference_mode_enabled()
    aaren = [None] * 4
    if J:
        aaren = [writable(state, n, inference) for n in ("aaren_o", "aaren_lse")] * 2  # o_new = o_in
    win = [None] * 11
    memory = [None] * 6
    new_win = [None] * 4
    rot = 0
    if window:
        cos_t, sin_t = (dense(a) for a in angles)
        cos_s, sin_s = (cos_t, sin_t) if sink_turn is None else (dense(a) for a in sink_turn)
        rot = cos_t.shape[-1]
        names = ("window_k", "window_v", "window_pos") + (("window_score",) if M > 0 else ())
        new_win = [writable(state, n, inference) for n in names] + ([] if M > 0 else [None])
        win = [cos_t, sin_t, cos_s, sin_s, *new_win]  # new_win_* = win_*
        win += [writable(state, n, inference) for n in ("sink_k", "sink_v", "sink_pos")]
        if M > 0:
            names = ("memory_k", "memory_v", "memory_k_scale", "memory_v_scale") if bits else ("memory_k", "memory_v")
            memory = [writable(state, n, inference) for n in names] + ([] if bits else [None, None])
            memory += [writable(state, n, inference) for n in ("memory_pos", "memory_score")]
    if retention is not None:
        retention = dense(retention)
    if gate is not None:
        gate = dense(gate)
    out = torch.empty(B, 1, H, D)
    tensors = (*inputs, *aaren, *win, *memory, retention, shared_retention, gate, out, *new_win)
    rc = lib.aaren_mixer_step(B, H, Hkv, D, J, DECAYS[decay], rot, window, sinks, M, int(stored == torch.bfloat16),
                              bits or 0, int(bool(rotate)), RULE.get(rule, 0), share,
                              int(gate is not None and gate.dim() > 1), float(scale),
                              *(None if t is None else t.data_ptr() for t in tensors))
    if rc == 1:  # a shape a branch kernel does not take: none of the state written
        return None
    if rc != 0:
        raise RuntimeError(f"aaren_mixer_step failed ({rc}) for B={B} H={H} Hkv={Hkv} D={D} J={J} W={window} M={M}")
    return out
