"""A mixer layer on a CPU as one C call, for ``AarenMixer.forward``: a decode token (``mixer_step_cpu``) and, for a
layer with a window, a prompt without gradients (``mixer_prefill_cpu``).

``step.c`` composes the two branch kernels, compiled with it into one library (``kernels/cbuild.py``):
``aaren/step.c`` (the Aaren branch: slot scores, the slots' mix, the decay, the scan's step) and ``window/step.c``
(the window branch: rotary, one softmax over window, sinks and memory, the memory's update), with the retention score
and the gate between them. The reference is the PyTorch code of ``AarenMixer.forward`` for a decode token (the
decode paths of ``aaren_output`` and ``window_step``; what a checkpoint's own copy of the code runs). The kernel
leaves the same state: the Aaren state to float rounding (exp and log by polynomials, products in another order), the
rest bit for bit (window, sinks, the memory's choices and codes; with ``memory_rule="aaren"`` the ranking reads the
kernel's slot scores, so a score within rounding of a 1/64 grid line could rank otherwise); and the same output to
float rounding (tests/test_mixer_step_kernel.py).

``prefill.c`` does the same for a prompt with the prompt's kernels (``aaren/step.c``'s prefill, ``window/prefill.c``,
``memory/prefill.c``, ``window/chunk.c``): the calls ``AarenMixer.forward`` otherwise makes one by one, in one, so the
same state bit for bit and the output to float rounding (the gate's sigmoid); tests/test_mixer_step_kernel.py too.
Without a compiler, or with ``AAREN_BACKEND=torch`` (or ``naive``), both return None and the mixer runs the
reference.
"""

from __future__ import annotations

import ctypes
import operator
import weakref
from functools import lru_cache
from pathlib import Path

import torch

from ..aaren import DECAYS
from ..cbuild import dense, load
from ..state import writable

__all__ = ["mixer_prefill_cpu", "mixer_step_cpu", "library"]

KERNELS = Path(__file__).parent.parent
SOURCES = tuple(KERNELS / name for name in (
    "aaren/step.c", "window/step.c", "window/rotate.c", "window/prefill.c", "window/chunk.c", "memory/evict.c",
    "memory/codes.c", "memory/prefill.c", "mixer/step.c", "mixer/prefill.c"))
SIGNATURES = {"aaren_mixer_step": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int), ctypes.c_float,
                                                  ctypes.POINTER(ctypes.c_void_p)]),
              "aaren_mixer_prefill": (ctypes.c_int, [ctypes.c_int] * 21 + [ctypes.c_float, ctypes.c_void_p,
                                                                         ctypes.c_int64] + [ctypes.c_void_p] * 46),
              "aaren_mixer_prefill_scratch": (ctypes.c_int64, [ctypes.c_int] * 11)}
RULE = {"learned": 1, "aaren": 2}
MEMORY_PARTS = ("k", "v", "k_scale", "v_scale", "pos", "score")  # the state's memory_* tensors, in the calls' order
# A decode step's call takes its arguments packed (mixer/step.c unpacks them in these orders): 16 sizes and switches,
# then 37 pointers.
STEP_SIZES = ("B", "H", "Hkv", "D", "J", "decay", "rot", "W", "S", "M", "bf16", "bits", "rotate", "rule", "share",
              "gate_per_token")
STEP_POINTERS = ("q", "k", "v", "pos", "keep", "queries", "log_decay", "decay_in", "o_in", "lse_in", "o_new", "lse_new",
                 "cos_t", "sin_t", "cos_s", "sin_s", "win_k", "win_v", "win_pos", "win_score", "sink_k", "sink_v",
                 "sink_pos", "mem_k", "mem_v", "mem_k_scale", "mem_v_scale", "mem_pos", "mem_score", "retention_in",
                 "shared", "gate", "out", "new_win_k", "new_win_v", "new_win_pos", "new_win_score")
# the state's tensors among them, for (Aaren branch, window, memory, memory codes): the step writes them in place (the
# same tensor in and out: o_new = o_in, new_win_* = win_*)
_STATE_PARTS = (
    (0, {"o_in": "aaren_o", "lse_in": "aaren_lse", "o_new": "aaren_o", "lse_new": "aaren_lse"}),
    (1, {"win_k": "window_k", "win_v": "window_v", "win_pos": "window_pos", "sink_k": "sink_k", "sink_v": "sink_v",
         "sink_pos": "sink_pos", "new_win_k": "window_k", "new_win_v": "window_v", "new_win_pos": "window_pos"}),
    (2, {"win_score": "window_score", "new_win_score": "window_score", "mem_k": "memory_k", "mem_v": "memory_v",
         "mem_pos": "memory_pos", "mem_score": "memory_score"}),
    (3, {"mem_k_scale": "memory_k_scale", "mem_v_scale": "memory_v_scale"}))
_HELD = weakref.WeakKeyDictionary()  # layer state -> its call's arrays (_held_call)
_INPUTS = tuple(STEP_POINTERS.index(name) for name in (
    "q", "k", "v", "pos", "keep", "queries", "log_decay", "decay_in", "cos_t", "sin_t", "cos_s", "sin_s",
    "retention_in", "shared", "gate", "out"))


def library():
    """The compiled calls (ctypes), built on first use; None when disabled or when no compiler can build them."""
    return load("mixer", SOURCES, SIGNATURES, "the PyTorch steps, about half as fast")


def _float32_cpu(*tensors) -> bool:
    for t in tensors:  # (a loop, not all() over a generator: a decode step asks this of each layer)
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu):
            return False
    return True


@lru_cache(maxsize=None)
def _state_places(parts: tuple):
    """((place among STEP_POINTERS, state tensor name), ...) for the parts a layer has (``_STATE_PARTS``' flags), and
    a getter of those tensors."""
    places = tuple((STEP_POINTERS.index(arg), name) for flag, args in _STATE_PARTS if parts[flag]
                   for arg, name in args.items())
    return places, operator.attrgetter(*(name for _, name in places))


def _held_call(state, parts: tuple, sizes: tuple, inference: bool):
    """The call's packed sizes and pointers (ctypes arrays) with the state's tensors' pointers in their places, each
    tensor the state's own, contiguous and writable in place (``writable``). A step writes them in place, so the
    arrays are kept for the state (``_HELD``) with the tensors they point into, and serve each step while the state
    holds those same tensors (a prompt or a beam's reorder puts new ones there): a step's Python then checks the
    state's tensors by identity, not each one's layout and pointer again. Kept beside the state, not on it: a copy of
    the state (``AarenLayerState.copy``, ``copy.deepcopy``) has tensors of its own, which the pointers of the
    original's would not reach."""
    places, tensors = _state_places(parts)
    held = _HELD.get(state)
    if (held is not None and held[0] == (parts, sizes, inference)
            and all(map(operator.is_, tensors(state), held[1]))):
        return held[2], held[3]
    pointers = (ctypes.c_void_p * len(STEP_POINTERS))()
    for i, name in places:
        pointers[i] = writable(state, name, inference).data_ptr()
    held = _HELD[state] = ((parts, sizes, inference), tensors(state), (ctypes.c_int * len(STEP_SIZES))(*sizes),
                           pointers)
    return held[2], held[3]


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
    cos_t = sin_t = cos_s = sin_s = None
    if window:
        cos_t, sin_t = angles
        cos_s, sin_s = angles if sink_turn is None else sink_turn
    sizes = (B, H, Hkv, D, J, DECAYS[decay], 0 if cos_t is None else cos_t.shape[-1], window, sinks, M,
             int(stored == torch.bfloat16), bits or 0, int(bool(rotate)), RULE.get(rule, 0), share,
             int(gate is not None and gate.dim() > 1))
    n, pointers = _held_call(state, (J > 0, window > 0, M > 0, bool(bits)), sizes, torch.is_inference_mode_enabled())
    out = torch.empty(B, 1, H, D)
    copies = []  # held here until the call returns: a contiguous copy made on the way would otherwise be freed first
    for i, t in zip(_INPUTS, (q, k, v, pos, mask, queries, log_decay, decay_in, cos_t, sin_t, cos_s, sin_s, retention,
                              shared_retention, gate, out)):
        if t is not None and not t.is_contiguous():
            t = t.contiguous()
            copies.append(t)
        pointers[i] = None if t is None else t.data_ptr()
    rc = lib.aaren_mixer_step(n, float(scale), pointers)
    if rc == 1:  # a shape a branch kernel does not take: none of the state written
        return None
    if rc != 0:
        raise RuntimeError(f"aaren_mixer_step failed ({rc}) for B={B} H={H} Hkv={Hkv} D={D} J={J} W={window} M={M}")
    return out


def mixer_prefill_cpu(q, k, v, pos, mask, state, *, queries, log_decay, decay_in, decay, angles, back_angles, window,
                      sinks, memory_size, bits, rotate, retention, rule, share, shared_retention, gate, scale, stored,
                      pool=None):
    """``AarenMixer.forward`` over a prompt between its projections and ``o_proj``, for a layer with a window,
    without gradients: q [B, T, H, D], k and v [B, T, Hkv, D] float32 before rotary, pos [B, T] int64 (-1: padding),
    mask [B, T] bool. ``state``: the layer's (None: no cache), continued from and left updated (new tensors).

    Aaren branch (``queries`` [H, J, D], None without one): ``log_decay`` [H, J] or None, ``decay_in`` [B, T, H*J]
    (``decay_proj(x)``) with input decay. ``angles``: (cos, sin) [B, T, 1, rot] at the tokens' positions,
    ``back_angles`` the same [B, S + window, 1, rot] at 0, -1, ... (``Rotary``; None without sinks). Memory
    (``memory_size`` > 0, of ``bits``-bit codes): ``retention`` [B, T, Hkv] (``retention_proj(x)``) with ``rule``
    "learned"; ``share`` 1 writes this layer's best score to ``shared_retention`` [B, T, 1], 2 ranks by the larger
    of its own and that one. ``gate``: the window gate's logits, [H] or [B, T, H]. ``stored``: the cache's dtype
    (float32 or bfloat16). ``pool``: a dict the layers of one pass share (the call keeps its scratch there, grown as
    needed), or None.

    Returns the mixed output [B, T, H, D] float32; None, touching nothing, where the kernel does not apply: gradients
    wanted, not CPU float32, a float16 cache, a memory without codes, a head size or grouping beyond the kernels'.
    """
    B, T, Hkv, D = k.shape
    H, S, M = q.shape[2], sinks, memory_size
    J = 0 if queries is None else queries.shape[1]
    continuing = state is not None and state.window_k is not None
    memory = None if not continuing or M == 0 or state.memory_k is None else [
        getattr(state, "memory_" + name) for name in MEMORY_PARTS]
    code = torch.uint8 if bits == 4 else torch.int8
    carried = [None, None] if not J or state is None or state.aaren_o is None else [state.aaren_o, state.aaren_lse]
    if (torch.is_grad_enabled() or mask.dtype != torch.bool or pos.dtype != torch.int64 or window < 2
            or stored not in (torch.float32, torch.bfloat16) or H % Hkv or (M > 0 and bits not in (4, 8))
            or not _float32_cpu(q, k, v, queries, log_decay, decay_in, retention, gate, *angles, *(back_angles or ()),
                                *carried)
            or (continuing and (state.window_k.dtype != stored or state.sink_k.dtype != stored
                          or (J and state.aaren_o is None) or (M > 0 and state.window_score is None)))
            or (memory is not None and (memory[0].dtype != code or memory[1].dtype != code))):
        return None
    lib = library()
    if lib is None:
        return None
    Wp, Wn = (state.window_k.shape[1] if continuing else 0), window - 1
    win, old_sinks = [None] * 4, [None] * 3  # a first prompt: none yet
    if continuing:
        win = [state.window_k, state.window_v, state.window_pos, state.window_score if M > 0 else None]
        old_sinks = [state.sink_k, state.sink_v, state.sink_pos]
    # held here until the call returns: a contiguous copy made on the way would otherwise be freed before it
    turns = [t[0] for t in back_angles] if back_angles else [None, None]  # the same rows in every sequence
    ins = [None if t is None else dense(t) for t in (
        q, k, v, pos, mask.view(torch.uint8), queries, log_decay if DECAYS[decay] else None,
        decay_in if DECAYS[decay] == 2 else None, *carried, *angles, *turns, *win, *old_sinks,
        *(memory or [None] * 6), retention, shared_retention, gate)]
    keep = state is not None
    out = torch.empty(B, T, H, D)
    new = [torch.empty(B, H * J, D), torch.empty(B, H * J)] if keep and J else [None, None]
    new += [torch.empty(B, S, Hkv, D, dtype=stored), torch.empty(B, S, Hkv, D, dtype=stored),
            torch.empty(B, S, dtype=torch.int64)]
    new += [torch.empty(B, Wn, Hkv, D, dtype=stored), torch.empty(B, Wn, Hkv, D, dtype=stored),
            torch.empty(B, Wn, dtype=torch.int64), torch.empty(B, Wn, Hkv) if M > 0 else None] if keep else [None] * 4
    width = D // 2 if bits == 4 else D
    new += [torch.empty(B, Hkv, M, width, dtype=code), torch.empty(B, Hkv, M, width, dtype=code),
            torch.empty(B, Hkv, M, 1, dtype=torch.bfloat16), torch.empty(B, Hkv, M, 1, dtype=torch.bfloat16),
            torch.empty(B, Hkv, M, dtype=torch.int64), torch.empty(B, Hkv, M)] if keep and M > 0 else [None] * 6
    scratch = None
    if pool is not None:  # one per pass: every layer's call would otherwise map and fault in its own
        need = lib.aaren_mixer_prefill_scratch(B, T, H, Hkv, D, J, S, M, Wp, M if memory else 0, int(keep))
        scratch = pool.get("scratch")
        if scratch is None or scratch.numel() < need:
            scratch = pool["scratch"] = torch.empty(need)
    rc = lib.aaren_mixer_prefill(
        B, T, H, Hkv, D, J, DECAYS[decay], angles[0].shape[-1], window, S, M, Wp, M if memory else 0,
        int(stored == torch.bfloat16), bits or 0, int(bool(rotate)), RULE.get(rule, 0), share,
        int(gate is not None and gate.dim() > 1), int(keep), torch.get_num_threads(), float(scale),
        None if scratch is None else scratch.data_ptr(), 0 if scratch is None else scratch.numel(),
        *(None if t is None else t.data_ptr() for t in ins + [out] + new))
    if rc == 1:  # a shape a part does not take
        return None
    if rc != 0:
        raise RuntimeError(f"aaren_mixer_prefill failed ({rc}) for B={B} T={T} H={H} Hkv={Hkv} D={D} J={J} "
                           f"W={window} M={M}")
    if keep:
        if J:
            state.aaren_o, state.aaren_lse = new[:2]
        state.sink_k, state.sink_v, state.sink_pos = new[2:5]
        state.window_k, state.window_v, state.window_pos = new[5:8]
        if M > 0:
            state.window_score = new[8]
            for name, t in zip(MEMORY_PARTS, new[9:]):
                setattr(state, "memory_" + name, t)
    return out
