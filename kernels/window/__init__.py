"""The window branch's one-token decode step on a CPU as one C call (``step.c``), for ``AarenMixer.window_step``.

The reference is ``AarenMixer.window_step`` in ``aaren_hf/modeling_aaren.py`` (plain PyTorch, what a checkpoint's
own copy of the code runs): this kernel leaves the same state bit for bit and the same output to float rounding
(tests/test_window_kernel.py). On a CPU that step is about 170 small operators per layer, most of a decode step's
time; here it is one call.

``step.c`` is compiled on first use (``kernels/cbuild.py``). Without a compiler, or with ``AAREN_BACKEND=torch``
(or ``naive``), ``window_step_cpu`` returns None and the mixer runs the reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..cbuild import dense, load

__all__ = ["window_step_cpu", "library"]

SOURCE = Path(__file__).with_name("step.c")
SIGNATURES = {"aaren_window_step": (ctypes.c_int, [ctypes.c_int] * 11 + [ctypes.c_float] + [ctypes.c_void_p] * 27)}


def library():
    """The compiled step (ctypes), built on first use; None when disabled or when no compiler can build it."""
    return load(SOURCE, SIGNATURES, "the PyTorch window step, about twice slower")


def _writable(state, name):
    """State tensor ``name`` contiguous and writable in place (a tensor made under inference_mode cannot be written
    outside it: copied once)."""
    t = getattr(state, name)
    if not t.is_contiguous() or (t.is_inference() and not torch.is_inference_mode_enabled()):
        t = t.contiguous() if not t.is_inference() else t.clone(memory_format=torch.contiguous_format)
        setattr(state, name, t)
    return t


def window_step_cpu(q, k, v, pos, at_token, sink_turn, state, retention, *, sinks, memory_size, bits, rotate, scale):
    """``AarenMixer.window_step``: q [B, 1, H, D], k and v [B, 1, Hkv, D] float32 before rotary; ``at_token`` and
    ``sink_turn``: the (cos, sin) of ``AarenMixer.step_angles``; the state is updated (window shifted, memory
    offered, a sink slot filled by a token among the first S, those three in place) and the output [B, 1, H, D]
    float32 returned (0 for a padding token). None (nothing touched) where this kernel does not apply: not a CPU
    float32 step, a float16 cache, head size or query group too large, no compiler."""
    B, _, H, D = q.shape
    Hkv = k.shape[2]
    stored = state.window_k.dtype
    M = memory_size
    if (q.device.type != "cpu" or not q.dtype == k.dtype == v.dtype == torch.float32 or pos.dtype != torch.int64
            or stored not in (torch.float32, torch.bfloat16) or H % Hkv
            or (M > 0 and bits is None and state.memory_k.dtype != stored)):
        return None
    lib = library()
    if lib is None:
        return None
    q, k, v, pos = dense(q), dense(k), dense(v), dense(pos)
    W = state.window_k.shape[1] + 1
    rot = at_token[0].shape[-1]
    # [B, 1, 1, rot] float32 angles and [B, 1] positions are laid out as [B, rot] and [B]: passed as they are
    cos_t, sin_t = (dense(a) for a in at_token)
    cos_s, sin_s = (cos_t, sin_t) if sink_turn is None else (dense(a) for a in sink_turn)
    win_k, win_v = dense(state.window_k), dense(state.window_v)
    new_k, new_v, new_pos = torch.empty_like(win_k), torch.empty_like(win_v), torch.empty_like(state.window_pos)
    out = torch.empty(B, H, D, dtype=torch.float32)
    memory = [0] * 6
    win_score = new_score = ret = 0
    if M > 0:
        names = ("memory_k", "memory_v", "memory_k_scale", "memory_v_scale") if bits else ("memory_k", "memory_v")
        memory = [_writable(state, n) for n in names] + ([] if bits else [0, 0])
        memory += [_writable(state, "memory_pos"), _writable(state, "memory_score")]
        win_score = dense(state.window_score)
        new_score = torch.empty_like(win_score)
        ret = dense(retention)  # [B, 1, Hkv] float32
    # a token among the first S fills a sink slot in place
    sink_state = [_writable(state, n) for n in ("sink_k", "sink_v", "sink_pos")]
    tensors = (q, k, v, pos, cos_t, sin_t, cos_s, sin_s, win_k, win_v, dense(state.window_pos), win_score,
               *sink_state, *memory, ret, out, new_k, new_v, new_pos, new_score)
    rc = lib.aaren_window_step(B, H, Hkv, D, rot, W, sinks, M, int(stored == torch.bfloat16), bits or 0,
                               int(bool(rotate)), float(scale),
                               *(t.data_ptr() if isinstance(t, torch.Tensor) else None for t in tensors))
    if rc == 1:  # a shape step.c does not take (head or query group beyond MAX_D / MAX_G): it wrote nothing
        return None
    if rc != 0:
        raise RuntimeError(f"aaren_window_step failed ({rc}) for B={B} H={H} Hkv={Hkv} D={D} W={W} M={M}")
    state.window_k, state.window_v, state.window_pos = new_k, new_v, new_pos
    if M > 0:
        state.window_score = new_score
    return out.view(B, 1, H, D)
