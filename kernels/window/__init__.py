"""The window branch: its attention for training and prefill in Triton for a GPU (``chunk.py``) and in C for a CPU
(``chunk.c``, ``window_attention_cpu``, forward and backward), both with the reference in the PyTorch path of
``window_attention`` in modeling_aaren.py; its rotary embedding in one pass, in C for a CPU (``rotate.c``,
``rotate_cpu``) and in Triton for a GPU (``rotate.py``, ``fused_rotate``), reference ``rotate_by``, bit for bit; the
sinks' slots and a prefill's next window in Triton for a GPU (``carry.py``: ``fused_sinks``, forward and backward,
and ``fused_next_window``; references ``fill_sinks`` and ``next_window``); its one-token decode step (reference:
``AarenMixer.window_step``) in Triton for a GPU (``fused_recurrent.py``) and in C for a CPU (``step.c``, the same
algorithm), the C one compiled with the Aaren branch's into the mixer's one call per layer (``kernels/mixer``); and a
prompt's bookkeeping around the attention without gradients on a CPU (``prefill.c``, ``window_prefill_cpu``:
rounding, sinks, the window's next state), whose reference is ``AarenMixer.window_branch``, bit for bit, and the
queries' side of the attention (``chunk.c``, ``window_queries_cpu``: rotation, the sinks' scores and what each query
sees of them; reference ``_window_attention_fused``'s PyTorch lines and ``_sink_scores``, to float rounding)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..cbuild import dense, load, records_grad

__all__ = ["checked_angles", "rotate_cpu", "window_attention_cpu", "window_cpu_takes", "window_prefill_cpu",
           "window_queries_cpu"]

SOURCES = tuple(Path(__file__).parent / name for name in ("chunk.c", "rotate.c", "prefill.c"))
_ARGS = [ctypes.c_int] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                                                      ctypes.c_int] + [ctypes.c_void_p] * 12
SIGNATURES = {"aaren_window_attention_takes": (ctypes.c_int, [ctypes.c_int] * 3),
              "aaren_window_attention": (ctypes.c_int, _ARGS + [ctypes.c_void_p]),
              "aaren_window_attention_backward": (ctypes.c_int, _ARGS + [ctypes.c_void_p] * 8),
              "aaren_rotate": (ctypes.c_int, [ctypes.c_int64] + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 4),
              "aaren_window_prefill": (ctypes.c_int, [ctypes.c_int] * 10 + [ctypes.c_void_p] * 19),
              "aaren_window_queries": (ctypes.c_int, [ctypes.c_int] * 8 + [ctypes.c_void_p] * 10)}


def _library():
    return load("window", SOURCES, SIGNATURES, "the PyTorch window attention")


def rotate_cpu(x, cos, sin, inverse: bool = False):
    """``rotate_by(x, cos, sin, inverse)`` (modeling_aaren.py) in one pass, the same bits: float32 x [B, T, h, D] on
    a CPU, cos and sin [B, T, 1, rot] float32 as ``rotary_angles`` gives them. None where it does not apply (other
    dtypes or shapes, not on a CPU: the meta device too, no compiler); no gradient (the caller's autograd Function,
    or no_grad, provides that)."""
    if (any(t.device.type != "cpu" for t in (x, cos, sin)) or x.dim() != 4 or torch.float32 != x.dtype
            or torch.float32 != cos.dtype or sin.dtype != cos.dtype or cos.shape != sin.shape
            or cos.shape != (*x.shape[:2], 1, cos.shape[-1])):
        return None
    lib = _library()
    if lib is None:
        return None
    B, T, h, D = x.shape
    ins = [dense(t) for t in (x, cos, sin)]  # held until the call returns (a copy made in the call would be freed)
    out = torch.empty(x.shape)
    if lib.aaren_rotate(B * T, h, D, cos.shape[-1], int(inverse), *(t.data_ptr() for t in ins),
                        out.data_ptr()) != 0:
        return None
    return out


def window_queries_cpu(q, qpos, angles, sink_k, sink_pos, back_angles, window: int):
    """A prompt's queries as ``window_attention_cpu`` takes them, without gradients: (q rotated at its position, the
    rotate_cpu bits; the sinks' scores [B, T, H, S] float32, ``_sink_scores``' to float rounding), the PyTorch lines
    of ``_window_attention_fused`` (modeling_aaren.py) in one call.
    q [B, T, H, D] float32 (not rotated) at qpos [B, T]; ``angles``: (cos, sin) [B, T, 1, rot] at the queries'
    positions; sink_k [B, S, Hkv, D], sink_pos [B, S]; ``back_angles``: (cos, sin) [B, S + window, 1, rot], row i at
    -i (None without sinks). None where it does not apply (gradients wanted, not on a CPU, other dtypes or widths,
    no compiler)."""
    B, T, H, D = q.shape
    S, Hkv = sink_k.shape[1], sink_k.shape[2]
    turns = back_angles or ()
    if ((S > 0 and back_angles is None) or records_grad(q, sink_k)
            or any(t.device.type != "cpu" for t in (q, sink_k, *angles, *turns))
            or any(t.dtype != torch.float32 for t in (q, *angles, *turns)) or qpos.dtype != torch.int64):
        return None
    lib = _library()
    if lib is None:
        return None
    rot = angles[0].shape[-1]
    # held until the call returns: a contiguous copy made inside the call's arguments would be freed before it runs
    ins = [dense(t.detach()) for t in (q, qpos, *angles, sink_k.float(), sink_pos)]
    ins += [dense(t[0]) for t in turns] or [None, None]  # the same rows in every sequence
    qr, scores = torch.empty(q.shape), torch.empty(B, T, H, S)
    pointers = (None if t is None else t.data_ptr() for t in ins + [qr, scores])
    if lib.aaren_window_queries(B, T, H, Hkv, D, S, window, rot, *pointers):
        return None
    return qr, scores


def window_prefill_cpu(k, v, pos, angles, k_prev, v_prev, pos_prev, sinks, window: int, stored: torch.dtype,
                       keep: bool, score_prev=None, retention=None):
    """``AarenMixer.window_branch`` around its attention, without gradients: k (not rotated), v [B, T, Hkv, D]
    float32, k rotated by ``angles`` ((cos, sin) [B, T, 1, rot] float32, ``rotate_cpu``'s bits), both rounded to the
    cache (``stored``: bfloat16, or float32 for none); ``sinks`` (sink_k, sink_v [B, S, Hkv, D],
    sink_pos [B, S]) updated with this call's tokens into new tensors; with ``keep`` the window the next call
    continues from. The window held: k_prev, v_prev [B, Wp, Hkv, D] in ``stored``, pos_prev [B, Wp]; with a memory,
    score_prev [B, Wp, Hkv] and retention [B, T, Hkv]. Returns (k, v, (sink_k, sink_v, sink_pos), {"k", "v", "pos",
    "score"} or None); None where the kernel does not apply (gradients wanted, not on a CPU, other dtypes, no
    compiler)."""
    if retention is None:
        score_prev = None
    scores = [t for t in (score_prev, retention) if t is not None]
    tensors = (k, v, *angles, k_prev, v_prev, *sinks[:2], *scores)
    if ((retention is not None and score_prev is None and k_prev.shape[1] > 0)  # a held window without its scores
            or torch.is_grad_enabled() or any(t.device.type != "cpu" for t in tensors)
            or any(t.dtype != torch.float32 for t in (k, v, *angles)) or stored not in (torch.float32, torch.bfloat16)
            or any(t.dtype != stored for t in (k_prev, v_prev, *sinks[:2]))
            or any(t.dtype != torch.float32 for t in scores) or pos.dtype != torch.int64):
        return None
    lib = _library()
    if lib is None:
        return None
    B, T, Hkv, D = k.shape
    Wn = window - 1
    kr, vr = torch.empty(k.shape), torch.empty(v.shape)
    sink_k, sink_v, sink_pos = (t.clone(memory_format=torch.contiguous_format) for t in sinks)
    state = None
    if keep:
        state = {"k": torch.empty(B, Wn, Hkv, D, dtype=stored), "v": torch.empty(B, Wn, Hkv, D, dtype=stored),
                 "pos": torch.empty(B, Wn, dtype=torch.int64),
                 "score": torch.empty(B, Wn, Hkv) if retention is not None else None}
    ins = [dense(t.detach()) for t in (k, *angles, v, pos, k_prev, v_prev, pos_prev)] + [
        None if t is None else dense(t) for t in (score_prev, retention)]
    outs = [kr, vr, sink_k, sink_v, sink_pos] + ([None] * 4 if state is None else list(state.values()))
    rc = lib.aaren_window_prefill(B, T, Hkv, D, k_prev.shape[1], window, sink_k.shape[1],
                                  int(stored == torch.bfloat16), int(keep), angles[0].shape[-1],
                                  *(None if t is None else t.data_ptr() for t in ins + outs))
    if rc == 1:
        return None
    if rc != 0:
        raise RuntimeError(f"aaren_window_prefill failed ({rc}) for B={B} T={T} Hkv={Hkv} D={D}")
    return kr, vr, (sink_k, sink_v, sink_pos), state


def _call(name, shape, tensors, P0, window, scale, *extra):
    """``name`` on contiguous tensors (q, qpos, ks, vs, spos, mk, mv, evict, last, sink_s, sink_v, sink_pos, then
    ``extra``: float32 but the positions and indices)."""
    B, T, H, D, Hkv, Ls, C, S = shape
    rc = getattr(_library(), name)(B, T, H, Hkv, D, Ls, P0, window, C, S, scale, torch.get_num_threads(),
                                   *(t.data_ptr() for t in tensors + extra))
    if rc != 0:
        raise RuntimeError(f"{name} failed ({rc}) for B={B} T={T} H={H} Hkv={Hkv} D={D} C={C} S={S}")


def checked_angles(angles, q):
    """The window attention kernels' ``angles`` for queries q [B, T, H, D] (float32, bfloat16 or float16: what the
    turns, and the turn back of q's gradient, take): (cos, sin) [B, T, 1, rot] float32 with rot even and at most D,
    contiguous; None stays None. Anything else is the caller's mistake: ValueError (where the turn back would
    decline, q's gradient would otherwise be lost)."""
    if angles is None:
        return None
    cos, sin = angles
    B, T, _, D = q.shape
    rot = cos.shape[-1]
    if (rot % 2 or rot > D or tuple(cos.shape) != (B, T, 1, rot) or sin.shape != cos.shape
            or {cos.dtype, sin.dtype} != {torch.float32} or cos.device != q.device or sin.device != q.device
            or q.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"angles: cos and sin [B, T, 1, rot] float32 on the queries' device with rot even and at "
                         f"most D = {D} (rotary_angles of the queries' positions), for float32 or 16-bit queries "
                         f"{tuple(q.shape)} {q.dtype}; got {tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} "
                         f"{sin.dtype}")
    return dense(cos), dense(sin)


def _turned(q, angles, dtype, inverse=False):
    """Float32 q turned by ``angles`` (cos, sin; None or rot 0: as it is), rounded to ``dtype`` as ``rotate_by``
    rounds the queries of that dtype; ``inverse``: a gradient turned back, from its ``dtype`` rounding, as
    ``_Rotate``'s backward turns it."""
    if angles is None or angles[0].shape[-1] == 0:
        return q
    return rotate_cpu(q.to(dtype).float() if inverse else q, *angles, inverse).to(dtype).float()


def _forward(q, ks, vs, mk, mv, sink_s, sink_v, indices, angles, shape, P0, window, scale, dtype):
    qpos, spos, evict, last, sink_pos = indices
    out = torch.empty(q.shape)
    _call("aaren_window_attention", shape, (_turned(q, angles, dtype), qpos, ks, vs, spos, mk, mv, evict, last, sink_s,
                                            sink_v, sink_pos), P0, window, scale, out)
    return out


class _WindowAttention(torch.autograd.Function):
    """Keeps q as it came, not its turned copy (turned again for the backward: one pass over q)."""

    @staticmethod
    def forward(ctx, q, ks, vs, mk, mv, sink_s, sink_v, indices, angles, shape, P0, window, scale, dtype):
        # indices and angles: no gradients
        out = _forward(q, ks, vs, mk, mv, sink_s, sink_v, indices, angles, shape, P0, window, scale, dtype)
        ctx.save_for_backward(q, ks, vs, mk, mv, sink_s, sink_v, *indices, *(angles or ()))
        ctx.args = (shape, P0, window, scale)
        ctx.dtype = dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, ks, vs, mk, mv, sink_s, sink_v, qpos, spos, evict, last, sink_pos, *angles = ctx.saved_tensors
        angles = tuple(angles) or None
        grads = [torch.empty(q.shape), torch.zeros(ks.shape), torch.zeros(vs.shape), torch.zeros(mk.shape),
                 torch.zeros(mv.shape), torch.empty(sink_s.shape), torch.zeros(sink_v.shape)]
        _call("aaren_window_attention_backward", ctx.args[0], (_turned(q, angles, ctx.dtype), qpos, ks, vs, spos, mk,
                                                              mv, evict, last, sink_s, sink_v, sink_pos),
              *ctx.args[1:], dense(dout.float()), *grads)
        grads[0] = _turned(grads[0], angles, ctx.dtype, inverse=True)
        return (*grads, None, None, None, None, None, None, None)


def window_cpu_takes(q, k, v) -> bool:
    """Whether :func:`window_attention_cpu` serves queries q [B, T, H, D] with keys and values k, v [B, T, Hkv, D]:
    a CPU, no float64, a head width and grouping the kernel takes, a compiler (and the C kernels not turned off).
    Asked before the inputs are prepared, so that a caller that gets no prepares nothing."""
    if q.device.type != "cpu" or torch.float64 in (q.dtype, k.dtype, v.dtype) or _library() is None:
        return False
    return bool(_library().aaren_window_attention_takes(q.shape[2], k.shape[2], q.shape[3]))


def window_attention_cpu(q, qpos, ks, vs, spos, P0, window, scale, memory=None, sinks=None, angles=None):
    """``window_attention_triton``'s arguments and results (``chunk.py``), to float rounding, in C, forward and
    backward (float32 inside; results and gradients in the inputs' dtypes; ``angles`` turn q in one C pass, which the
    backward runs again rather than keep the turned copy); ``memory`` without the block lists:
    (keys, values [B, Hkv, C, D], evict [B, Hkv, C], last [T + 1]). None where it does not apply: not on a CPU,
    float64, a head width or grouping it does not take, no compiler (then the caller runs the reference). Runs on
    torch.get_num_threads() threads, as PyTorch's operators would."""
    if not window_cpu_takes(q, ks, vs):
        return None
    B, T, H, D = q.shape
    Hkv, Ls = ks.shape[2], ks.shape[1]
    if memory is None:
        mk = mv = q.new_zeros(B, Hkv, 0, D)
        evict, last = torch.zeros(B, Hkv, 0, dtype=torch.int64), torch.zeros(T + 1, dtype=torch.int64)
    else:
        mk, mv, evict, last = memory
    if sinks is None:
        sink_s, sink_v, sink_pos = q.new_zeros(B, T, H, 0), q.new_zeros(B, 0, Hkv, D), torch.zeros(B, 0)
    else:
        sink_s, sink_v, sink_pos = sinks
    f32 = lambda x: dense(x.float())  # noqa: E731
    indices = (dense(qpos.long()), dense(spos.long()), dense(evict.long()), dense(last.long()), dense(sink_pos.long()))
    shape = (B, T, H, D, Hkv, Ls, mk.shape[2], sink_v.shape[1])
    inputs = (f32(q), f32(ks), f32(vs), f32(mk), f32(mv), f32(sink_s), f32(sink_v))
    # autograd's Function only where a gradient is wanted: it costs more than the call at a short prompt
    wanted = records_grad(*inputs)
    angles = checked_angles(angles, q)
    out = (_WindowAttention.apply if wanted else _forward)(*inputs, indices, angles, shape, int(P0), int(window),
                                                           float(scale), q.dtype)
    return out.to(q.dtype)
