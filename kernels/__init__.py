"""Aaren scan ops: PyTorch references and Triton kernels behind one dispatch point; the window branch's attention for
training and prefill in Triton (``window/chunk.py``, ``fused_window_attention``; reference: the PyTorch path of
``window_attention`` in modeling_aaren.py, which takes it where ``select_backend`` says Triton on a launch-bound
device) and its decode step in Triton (``window/fused_recurrent.py``, ``fused_window_step``; reference:
``AarenMixer.window_step``, likewise); the scan with the slots mixed (``fused_chunk_aaren_mixed``; reference:
``aaren_scan.chunk_aaren_mixed``, likewise) and the Aaren branch's decode step (``fused_aaren_step``; reference:
``AarenMixer.aaren_output``, likewise) and what its scan reads of a block of tokens (``aaren/scores.py``,
``fused_scan_inputs``; reference: ``AarenMixer.scan_inputs``, likewise); the memory's codes in Triton
(``memory/codes.py``, ``fused_memory_round``; reference: ``MemoryCodes.round_with_codes``, likewise) and its ranking
sweep (``memory/evict.py``, ``fused_memory_ranks`` and ``fused_memory_evict``; references: ``candidate_ranks`` and
the loop of ``_evict_sweep``, likewise;
and the grid it ranks on, ``fused_round_retention``; reference: ``round_retention``, likewise) and each block's list of
candidates for window attention (``memory/lists.py``, ``fused_memory_lists``; reference: ``_memory_lists``, likewise)
and the slots a prefill piece leaves (``memory/keep.py``, ``fused_keep_memory``; reference:
``AarenMixer.keep_memory``); rotary embedding in one launch (``window/rotate.py``, ``fused_rotate``; reference:
``rotate_by``, likewise); what a piece of tokens carries into the window's state (``window/carry.py``): the sinks'
slots (``fused_sinks``; reference: ``fill_sinks``, likewise) and the window the next piece continues from
(``fused_next_window``; reference: ``next_window``, likewise); the decoder layer's RMSNorm and a gated MLP's
act(gate) * up (``layer/``: ``fused_rms_norm``, ``fused_glu``; references ``AarenRMSNorm`` and ``AarenMLP``,
likewise).

    o, final_state = chunk_aaren(s, v, g=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                                 chunk_size=64)
    (fused_recurrent_aaren: same signature; the token-by-token decode path)

Backend: Triton for CUDA tensors (and for CPU tensors when TRITON_INTERPRET=1, which runs the kernels in Triton's
interpreter), PyTorch otherwise and while torch.compile traces. AAREN_BACKEND=triton|torch|naive overrides. Triton
is optional.

The one-token decode step on a CPU is one C call per layer (``mixer/``; reference: ``AarenMixer.forward``'s PyTorch
decode path), compiled on first use (``cbuild.py``) from ``aaren/step.c`` (the Aaren branch: slot scores, mix, decay
and the scan's step; reference: the PyTorch step in ``AarenMixer.aaren_output``), ``window/step.c`` (the window
branch; reference: ``AarenMixer.window_step``) and ``mixer/step.c`` (the retention score and the gate between them).
In a prefill without gradients the Aaren branch runs token after token in C (``aaren.aaren_prefill_cpu``,
``aaren/step.c``; reference: ``AarenMixer.aaren_output``'s PyTorch path and ``aaren_scan.chunk_aaren_mixed``), the
window's bookkeeping around its attention is ``window/prefill.c`` and the memory's candidates and next state
``memory/prefill.c`` (reference: ``AarenMixer.window_branch``, ``memory_candidates`` and ``keep_memory``), whose
ranking is ``memory/evict.c`` (reference: the block sweep of ``memory_visibility``). The window's attention on a
CPU, for training and prefill alike, forward and backward, is ``window/chunk.c`` (``window.window_attention_cpu``;
reference: the PyTorch path of ``window_attention``), which also prepares a prompt's queries without gradients
(``window.window_queries_cpu``: rotation, sink scores; reference: ``_window_attention_fused`` and ``_sink_scores``).
In a layer with a window, ``mixer/prefill.c`` runs all of a prompt's parts in one call (``mixer.mixer_prefill_cpu``;
reference: ``AarenMixer.forward``). ``vec8.h`` holds the 8-float vectors (and their exp and log) that every C file
uses.
"""

import functools
import importlib.util
import os

import torch

from .aaren.naive import naive_aaren


def _torch_ops():
    # Imported on first use, not at import time: from the repository root this folder is also reachable as a
    # top-level `kernels` (a name transformers probes for while it imports), and importing aaren_hf from there
    # would re-enter transformers half-way through its own import.
    from aaren_hf.aaren_scan import chunk_aaren_torch, recurrent_aaren_torch

    return chunk_aaren_torch, recurrent_aaren_torch


def __getattr__(name):  # chunk_aaren_torch / recurrent_aaren_torch, imported lazily (PEP 562)
    if name == "chunk_aaren_torch":
        return _torch_ops()[0]
    if name == "recurrent_aaren_torch":
        return _torch_ops()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["chunk_aaren", "fused_recurrent_aaren", "naive_aaren", "chunk_aaren_torch", "recurrent_aaren_torch"]
BACKENDS = ("triton", "torch", "naive")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(x) -> str:
    forced = os.environ.get("AAREN_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"AAREN_BACKEND={forced!r}: expected one of {', '.join(BACKENDS)}")
        if forced == "triton" and not triton_available():
            raise ImportError("AAREN_BACKEND=triton but triton is not installed (pip install 'aaren-hf[triton]')")
        if forced == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("AAREN_BACKEND=triton with CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")
        return forced
    if torch.compiler.is_compiling():
        # torch.compile traces the PyTorch op and generates its own kernels from it; ours are wrapped at launch,
        # which it cannot trace
        return "torch"
    if (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and triton_available():
        return "triton"
    return "torch"


def chunk_aaren(s, v, g=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64):
    backend = select_backend(v)
    if backend == "triton":
        from .aaren.chunk import chunk_aaren_triton as fn
    else:
        fn = _torch_ops()[0] if backend == "torch" else naive_aaren
    return fn(s, v, g, initial_state, output_final_state, cu_seqlens, chunk_size)


def fused_recurrent_aaren(s, v, g=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64):
    backend = select_backend(v)
    if backend == "triton":
        from .aaren.fused_recurrent import fused_recurrent_aaren_triton

        return fused_recurrent_aaren_triton(s, v, g, initial_state, output_final_state, cu_seqlens)
    fn = _torch_ops()[1] if backend == "torch" else naive_aaren
    return fn(s, v, g, initial_state, output_final_state, cu_seqlens)


# queries per program of the Triton window attention; the memory's candidate lists it reads are per block of these
WINDOW_BLOCK = 64


def fused_chunk_aaren_mixed(s, v, mix, g=None, initial_state=None, output_final_state=False, chunk_size=64):
    """The scan as the model reads it, slots mixed, in Triton (``aaren/chunk.py``; reference:
    ``aaren_scan.chunk_aaren_mixed``, same arguments and results); its backward forms the mix's gradient itself,
    so training keeps no per-slot output. Callers check ``select_backend(v) == "triton"`` first."""
    from .aaren.chunk import chunk_aaren_mixed_triton

    return chunk_aaren_mixed_triton(s, v, mix, g, initial_state, output_final_state, chunk_size)


def fused_scan_inputs(q, k, queries, mask, log_decay, decay_in, scale):
    """What the Aaren branch's scan reads (slot scores, the slots' mix, the log-decay per token) in one Triton
    launch, with their backward (``aaren/scores.py``; reference: ``AarenMixer.scan_inputs``); None where it does not
    take the inputs. Callers check ``select_backend(k) == "triton"`` first."""
    from .aaren.scores import scan_inputs_triton

    return scan_inputs_triton(q, k, queries, mask, log_decay, decay_in, scale)


def fused_aaren_step(q, k, v, mask, state, queries, log_decay, decay_in, scale):
    """The Aaren branch of a decode step in one Triton launch (``aaren/fused_recurrent.py``; reference:
    ``AarenMixer.aaren_output`` for one token), the state written in place; None where it does not take the inputs.
    Callers check ``select_backend(v) == "triton"`` first."""
    from .aaren.fused_recurrent import aaren_step_triton

    return aaren_step_triton(q, k, v, mask, state, queries, log_decay, decay_in, scale)


def fused_window_attention(q, qpos, ks, vs, spos, P0, window, scale, memory=None, sinks=None, angles=None, mix=None):
    """The window branch's attention in Triton (``window/chunk.py``; reference: ``window_attention``'s PyTorch path
    in modeling_aaren.py), mixed with the Aaren branch's output where ``mix`` says so. Callers check
    ``select_backend(q) == "triton"`` first."""
    from .window.chunk import window_attention_triton

    return window_attention_triton(q, qpos, ks, vs, spos, P0, window, scale, memory, sinks, angles, mix)


def fused_window_step(q, k, v, pos, angles, sink_turn, state, retention, share, window, sinks, memory_size, bits,
                      rotate, kv_cache_dtype, scale, mix=None):
    """The window branch's decode step in one Triton launch (``window/fused_recurrent.py``; reference:
    ``AarenMixer.window_step``), the state written in place, the output mixed with the Aaren branch's where ``mix``
    says so; None where it does not take the inputs. Callers check ``select_backend(q) == "triton"`` first."""
    from .window.fused_recurrent import window_step_triton

    return window_step_triton(q, k, v, pos, angles, sink_turn, state, retention, share, window, sinks, memory_size,
                              bits, rotate, kv_cache_dtype, scale, mix)


def fused_memory_round(x, bits, rotate, dtype):
    """``MemoryCodes.round_with_codes`` without its gradient in one Triton launch (``memory/codes.py``; reference:
    ``MemoryCodes`` in modeling_aaren.py), the values in ``dtype``; None where it does not take x. Callers check
    ``select_backend(x) == "triton"`` first."""
    from .memory.codes import memory_round_triton

    return memory_round_triton(x, bits, rotate, dtype)


def fused_memory_evict(rank, top, evict, e_first, block, upto, memory_size):
    """One pass of the memory's ranking sweep in one Triton launch (``memory/evict.py``; reference: the loop of
    ``_evict_sweep`` in modeling_aaren.py), ``evict`` written in place. Callers check ``select_backend(rank) ==
    "triton"`` first."""
    from .memory.evict import memory_evict_triton

    return memory_evict_triton(rank, top, evict, e_first, block, upto, memory_size)


def fused_memory_ranks(cand_pos, cand_score, num_sinks):
    """The memory's candidates numbered in their order in one Triton launch (``memory/evict.py``; reference:
    ``candidate_ranks`` in modeling_aaren.py, the same order): (rank, evict). Callers check
    ``select_backend(cand_pos) == "triton"`` first."""
    from .memory.evict import memory_ranks_triton

    return memory_ranks_triton(cand_pos, cand_score, num_sinks)


def fused_round_retention(score):
    """``round_retention`` (modeling_aaren.py) in one Triton launch (``memory/evict.py``), the same bits; None where it
    does not take the input. Callers check ``select_backend(score) == "triton"`` first."""
    from .memory.evict import round_retention_triton

    return round_retention_triton(score)


def fused_rotate(x, cos, sin, inverse=False):
    """``rotate_by`` (modeling_aaren.py) in one Triton launch (``window/rotate.py``), the same bits; None where it does
    not take the inputs. No gradient (``_Rotate`` provides it). Callers check ``select_backend(x) == "triton"``
    first."""
    from .window.rotate import rotate_triton

    return rotate_triton(x, cos, sin, inverse)


def fused_sinks(k, v, pos, sink_k, sink_v, sink_pos):
    """The sinks after a piece of tokens in one Triton launch (``window/carry.py``; reference: ``fill_sinks`` in
    modeling_aaren.py), with its backward; None where it does not take the inputs. Callers check
    ``select_backend(k) == "triton"`` first."""
    from .window.carry import sinks_triton

    return sinks_triton(k, v, pos, sink_k, sink_v, sink_pos)


def fused_next_window(k_prev, v_prev, pos_prev, k, v, pos, window, stream_score=None):
    """The window the next piece continues from in one Triton launch (``window/carry.py``; reference:
    ``next_window`` in modeling_aaren.py); None where it does not take the inputs. Callers check
    ``select_backend(k) == "triton"`` first."""
    from .window.carry import next_window_triton

    return next_window_triton(k_prev, v_prev, pos_prev, k, v, pos, window, stream_score)


def fused_keep_memory(evict, last, M, k, v, pos, score, k_scale=None, v_scale=None, stored=None, empty=0):
    """The memory's M slots after a prefill piece in two Triton launches (``memory/keep.py``: the candidates ordered
    by ``lists.py``'s kernel, then copied; reference: ``AarenMixer.keep_memory`` in modeling_aaren.py), the same bits;
    None where it does not take the inputs. Callers check ``select_backend(evict) == "triton"`` first."""
    from .memory.keep import keep_memory_triton

    return keep_memory_triton(evict, last, M, k, v, pos, score, k_scale, v_scale, stored, empty)


def fused_rms_norm(x, weight, eps, offset=False):
    """``AarenRMSNorm`` (modeling_aaren.py) in one Triton launch forward and one backward (``layer/rmsnorm.py``),
    keeping x and its per-row scale for backward; None where it does not take the inputs. Callers check
    ``select_backend(x) == "triton"`` first."""
    from .layer.rmsnorm import rms_norm_triton

    return rms_norm_triton(x, weight, eps, offset)


def fused_glu(gate, up, act):
    """act(gate) * up (``AarenMLP``, modeling_aaren.py; ``act`` the config's ``hidden_act``) in one Triton launch
    forward and one backward (``layer/glu.py``), keeping gate and up for backward; None where it does not take the
    inputs. Callers check ``select_backend(gate) == "triton"`` first."""
    from .layer.glu import glu_triton

    return glu_triton(gate, up, act)


def fused_memory_lists(evict, last, T, nblk, Q, width):
    """Each block of Q queries' list of memory candidates in one Triton launch (``memory/lists.py``; reference:
    ``_memory_lists`` with ``width`` in modeling_aaren.py). Callers check ``select_backend(evict) == "triton"``
    first."""
    from .memory.lists import memory_lists_triton

    return memory_lists_triton(evict, last, T, nblk, Q, width)
