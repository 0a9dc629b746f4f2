"""The window branch: its attention for training and prefill in Triton (``chunk.py``; reference: the PyTorch path of
``window_attention`` in modeling_aaren.py) and, for a prompt on a CPU without gradients, in C (``prefill.c``,
``window_attention_cpu``; the same reference); its one-token decode step (reference: ``AarenMixer.window_step``) in
Triton for a GPU (``fused_recurrent.py``) and in C for a CPU (``step.c``, the same algorithm), the C one compiled
with the Aaren branch's into the mixer's one call per layer (``kernels/mixer``)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..cbuild import dense, load

__all__ = ["window_attention_cpu"]

SOURCES = (Path(__file__).parent / "prefill.c",)
SIGNATURES = {"aaren_window_prefill": (ctypes.c_int, [ctypes.c_int] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_int]
                                       + [ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int]
                                       + [ctypes.c_void_p] * 13)}


def window_attention_cpu(q, qpos, ks, vs, spos, P0, window, scale, memory=None, sinks=None):
    """``window_attention_triton``'s arguments and results (``chunk.py``), float32, to float rounding, as one C call;
    ``memory`` without the block lists: (keys, values [B, Hkv, C, D], evict [B, Hkv, C], last [T + 1]). None where it
    does not apply: gradients wanted, not on a CPU, float64, a head width or grouping it does not take, no compiler
    (then the caller runs the reference). Runs on torch.get_num_threads() threads, as PyTorch's operators would."""
    tensors = (q, ks, vs) + tuple(memory[:2] if memory else ()) + tuple(sinks[:2] if sinks else ())
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if wants_grad or q.is_cuda or any(t.dtype == torch.float64 for t in tensors):
        return None
    lib = load("window", SOURCES, SIGNATURES, "the PyTorch window attention")
    if lib is None:
        return None
    B, T, H, D = q.shape
    Hkv, Ls = ks.shape[2], ks.shape[1]
    f32 = lambda x: dense(x.float())  # noqa: E731
    if memory is None:
        mk = mv = q.new_zeros(0, dtype=torch.float32)
        evict = last = torch.zeros(0, dtype=torch.int64)
        C = 0
    else:
        mk, mv, evict, last = f32(memory[0]), f32(memory[1]), dense(memory[2]), dense(memory[3])
        C = mk.shape[2]
    if sinks is None:
        sink_s = sink_v = q.new_zeros(0, dtype=torch.float32)
        seen, S = torch.zeros(0, dtype=torch.uint8), 0
    else:
        sink_s, sink_v, seen, S = f32(sinks[0]), f32(sinks[1]), dense(sinks[2].to(torch.uint8)), sinks[1].shape[1]
    q_, ks_, vs_ = f32(q), f32(ks), f32(vs)
    qpos_, spos_ = dense(qpos.long()), dense(spos.long())
    out = torch.empty(B, T, H, D)
    rc = lib.aaren_window_prefill(
        B, T, H, Hkv, D, Ls, int(P0), int(window), C, S, float(scale), torch.get_num_threads(),
        *(t.data_ptr() for t in (q_, qpos_, ks_, vs_, spos_, mk, mv, evict, last, sink_s, sink_v, seen, out)))
    if rc == 1:  # a head width or grouping the kernel does not take
        return None
    if rc != 0:
        raise RuntimeError(f"aaren_window_prefill failed ({rc}) for B={B} T={T} H={H} Hkv={Hkv} D={D} C={C}")
    return out.to(q.dtype)
