# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Aaren causal language model ("Attention as an RNN", Feng et al. 2024) for Hugging Face Transformers.

Read top to bottom: cache, building blocks, the Aaren mixer (the part that replaces softmax attention), the decoder
layer, the model, the LM head. Self-contained: this file, ``configuration_aaren.py`` and ``aaren_scan.py`` are
copied next to the weights when a checkpoint is saved, so ``trust_remote_code=True`` loads it without this package.

Each mixer keeps a fixed-size state: per head and query slot a float32 (mean value, log normaliser) pair, plus, when
the window branch is on, the keys and values of the last ``window_size`` tokens and of ``num_sink_tokens`` sinks.
Nothing grows with the context.
"""

import copy
import math
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .aaren_scan import aaren_step, chunk_aaren_mixed, chunk_aaren_torch, recurrent_aaren_torch
from .configuration_aaren import AarenConfig

try:  # Triton kernels on CUDA and the C kernels on CPUs, when this package is installed; the PyTorch code in this
    # file serves everywhere else (a checkpoint's own copy of it: nothing else to install)
    from aaren_hf.kernels import (WINDOW_BLOCK, chunk_aaren, fused_aaren_step, fused_chunk_aaren_mixed, fused_glu,
                                  fused_keep_memory, fused_memory_evict, fused_memory_lists, fused_memory_ranks,
                                  fused_memory_round, fused_next_window, fused_recurrent_aaren, fused_rms_norm,
                                  fused_rotate, fused_round_retention, fused_scan_inputs, fused_sinks,
                                  fused_window_attention, fused_window_step, select_backend)
    from aaren_hf.kernels.aaren import aaren_prefill_cpu
    from aaren_hf.kernels.memory import memory_evict_cpu, memory_prefill_cpu, memory_round_cpu
    from aaren_hf.kernels.mixer import mixer_prefill_cpu, mixer_step_cpu
    from aaren_hf.kernels.window import (rotate_cpu, window_attention_cpu, window_cpu_takes, window_prefill_cpu,
                                         window_queries_cpu)
except ImportError:
    chunk_aaren, fused_recurrent_aaren = chunk_aaren_torch, recurrent_aaren_torch
    aaren_prefill_cpu = memory_evict_cpu = memory_prefill_cpu = memory_round_cpu = None
    mixer_prefill_cpu = mixer_step_cpu = None
    rotate_cpu = window_attention_cpu = window_queries_cpu = None
    fused_aaren_step = fused_chunk_aaren_mixed = fused_keep_memory = fused_memory_evict = fused_memory_lists = None
    fused_memory_ranks = fused_memory_round = None
    fused_next_window = fused_rotate = fused_round_retention = fused_scan_inputs = fused_sinks = None
    fused_glu = fused_rms_norm = fused_window_attention = None
    fused_window_step = window_cpu_takes = window_prefill_cpu = None


# With a cache kept (prefill), prompts longer than this go through the model in pieces of this many tokens on a CPU.
# On a GPU a pass through the stack costs about the same whatever its length (launch-bound: on one H200, bf16, the
# default mixer took 232 ms for one 2,048-token piece and 24.4 s for sixty-four), so there a piece holds as many
# tokens per sequence as PREFILL_TOKENS_GPU allows for the whole batch, and never fewer than on a CPU.
PREFILL_CHUNK = 2048
PREFILL_TOKENS_GPU = 32768
# The memory's ranking sweep (without the C kernel) ranks several blocks of candidates in one pass, as many as keep
# its comparisons within this many (sweep_plan): on a CPU a few blocks at a time; on a GPU, where each pass is tens
# of launches, every block of a 32K-token piece at once (about 1.5 GB of temporaries at most).
SWEEP_PAIRS = 1 << 24
SWEEP_PAIRS_GPU = 1 << 28


def launch_bound(device: torch.device) -> bool:
    """Whether work on ``device`` costs per operator rather than per element, and reading a value back on the host
    waits for every operator before it: a GPU, not a CPU. The one place the model asks; it decides the prefill's
    pieces (:func:`prefill_piece`), the ranking sweep's passes (:func:`sweep_plan`), whether window attention runs as
    one call or as runs of blocks, and the scan's path (the Triton kernels per op head, or the CPU's mixed scan and
    C)."""
    return device.type != "cpu"


def takes_triton(kernel, x: torch.Tensor) -> bool:
    """Whether ``kernel`` (one of this package's Triton kernels, None without the package) serves tensors like x:
    a launch-bound device whose backend is Triton (CUDA; a CPU in Triton's interpreter when tests say so)."""
    return kernel is not None and launch_bound(x.device) and select_backend(x) == "triton"


def takes_c(kernel, x: torch.Tensor) -> bool:
    """Whether ``kernel`` (one of this package's C kernels, None without the package) may serve tensors like x: where
    work is not launch-bound (a CPU, unless tests say it is a GPU: then what a GPU runs runs here). The kernel still
    returns None where it does not take its inputs (gradients wanted, float64, ``AAREN_BACKEND=torch``)."""
    return kernel is not None and not launch_bound(x.device)


def prefill_piece(batch: int, device: torch.device) -> int:
    """Tokens per sequence in each piece of a prefill: activations stay bounded at any prompt length."""
    return max(PREFILL_CHUNK, PREFILL_TOKENS_GPU // batch) if launch_bound(device) else PREFILL_CHUNK


# ----------------------------------------------------------------------------------------------------------------
# Cache: fixed-size state per layer
# ----------------------------------------------------------------------------------------------------------------


class AarenLayerState:
    """One layer's state. Aaren part in float32; window, sink and memory keys/values in ``config.kv_cache_dtype`` or
    else the model dtype, like a KV cache.

    Tensors are None until the first forward fills them, so a cache made before the batch is known (as
    ``generate`` does) needs no sizes. A decode step writes the state's tensors in place on every path (the C and
    Triton step kernels, the PyTorch step through :meth:`write`), so it keeps the whole state at fixed addresses, as a
    CUDA graph of the step replays it; a prompt replaces them. :meth:`copy` a state to keep it.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self):
        self.reset()

    def reset(self):
        self.aaren_o = None  # [B, H*J, D] float32
        self.aaren_lse = None  # [B, H*J] float32, -inf when empty
        self.window_k = None  # [B, <=W-1, Hkv, D] rotated keys of the last W-1 tokens (padding included: see pos)
        self.window_v = None
        self.window_pos = None  # [B, <=W] position of each entry, -1 for padding
        self.sink_k = None  # [B, S, Hkv, D] keys of the first S real tokens, rotated at their own position
        self.sink_v = None
        self.sink_pos = None  # [B, S], -1 while the slot is unfilled
        self.window_score = None  # [B, <=W-1, Hkv] float32 retention scores of the window entries (memory tier)
        self.memory_k = None  # [B, Hkv, M, D] rotated keys of the tokens kept after leaving the window
        self.memory_v = None  # (with memory_bits: integer codes, [B, Hkv, M, D] int8 or [B, Hkv, M, D/2] uint8)
        self.memory_k_scale = None  # [B, Hkv, M, 1] bfloat16, with memory_bits only
        self.memory_v_scale = None
        self.memory_pos = None  # [B, Hkv, M], -1 for an empty slot
        self.memory_score = None  # [B, Hkv, M] float32

    def tensors(self):
        names = ("aaren_o", "aaren_lse", "window_k", "window_v", "window_pos", "sink_k", "sink_v", "sink_pos",
                 "window_score", "memory_k", "memory_v", "memory_k_scale", "memory_v_scale", "memory_pos",
                 "memory_score")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def write(self, **new):
        """A decode step's new tensors, copied into the ones held where those match them in shape and dtype."""
        for name, t in new.items():
            _write(self, name, t)

    def copy(self):
        """A state to continue from that leaves this one as it is: every tensor cloned (a decode step writes the
        state in place)."""
        new = copy.copy(self)
        for name, tensor in self.tensors().items():
            setattr(new, name, tensor.clone())
        return new

    def _apply(self, fn):
        for name, tensor in self.tensors().items():
            setattr(self, name, fn(tensor))

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor):
        self._apply(lambda t: t[indices])

    def crop(self, max_length: int):
        raise NotImplementedError("An Aaren state summarises the whole past and cannot be rolled back (crop).")

    def get_max_length(self) -> int:
        return -1

    def get_seq_length(self) -> int:
        raise NotImplementedError("ask the AarenCache, which counts positions for all layers")


class AarenCache(Cache):
    """Recurrent cache for ``AarenForCausalLM``: replaces ``past_key_values`` and never grows with the context.

    ``get_seq_length()`` counts positions consumed (padding included), which ``generate`` uses to slice inputs when a
    user continues from a returned cache. ``real_tokens`` counts non-padding tokens per row: the next position.

    ``static=True`` (what ``generate(..., cache_implementation="static")`` makes) marks the state's tensors as fixed
    addresses after each call outside torch.compile, and says ``is_compileable``, on which ``generate`` compiles its
    decode step (on a GPU, inductor with CUDA graphs): the step writes every tensor in place and reads no Python
    number that changes from step to step, so one graph serves every step.
    """

    is_compileable = False

    def __init__(self, config=None, num_layers: Optional[int] = None, static: bool = False):
        if num_layers is None:
            num_layers = config.num_hidden_layers
        super().__init__(layers=[AarenLayerState() for _ in range(num_layers)])
        self.is_compileable = static
        self._seen = 0  # positions fed by calls outside torch.compile
        self._seen_in_graph = None  # 0-d int64 on the device: positions fed by compiled calls
        self.real_tokens = None  # [B] int64

    @property
    def seen_tokens(self) -> int:
        """Positions fed so far, padding included (read from the device once compiled steps have run)."""
        return self._seen + (0 if self._seen_in_graph is None else int(self._seen_in_graph))

    @seen_tokens.setter
    def seen_tokens(self, n: int):
        self._seen = n
        if self._seen_in_graph is not None:
            self._seen_in_graph.zero_()

    def count(self, T: int, device: torch.device):
        """T more positions fed. A compiled call counts on the device: a Python int read there would be an input of
        the graph that changes every step, and CUDA graphs record one graph per value of such an input."""
        if not _compiling():
            self._seen += T
            return
        if self._seen_in_graph is None:
            self._seen_in_graph = torch.zeros((), dtype=torch.long, device=device)
        self._seen_in_graph.add_(T)

    def hold_still(self, device: torch.device):
        """After a call outside torch.compile: mark every tensor a compiled step writes as a fixed address (without
        it, CUDA graphs skip a graph that writes its inputs). Each is made contiguous (a prompt leaves views whose
        strides follow its length: the compiled step would recompile for each prompt length) and a normal tensor
        (one made under inference_mode takes no write from a compiled step outside it)."""
        with torch.inference_mode(False):
            if self._seen_in_graph is None:
                self._seen_in_graph = torch.zeros((), dtype=torch.long, device=device)
            held = [(self, "_seen_in_graph"), (self, "real_tokens")]
            held += [(layer, name) for layer in self.layers for name in layer.tensors()]
            for holder, name in held:
                t = getattr(holder, name)
                if t is None or hasattr(t, "_dynamo_static_input_type"):  # held still since an earlier call
                    continue
                if t.is_inference() or not _dense(t):
                    t = t.clone(memory_format=torch.contiguous_format)
                    setattr(holder, name, t)
                torch._dynamo.mark_static_address(t)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.seen_tokens + query_length, 0

    @property
    def is_sliding(self):
        return [False] * len(self.layers)

    def has_previous_state(self, layer_idx: Optional[int] = None, state_idx: Optional[int] = None) -> bool:
        return self.seen_tokens > 0

    def reorder_cache(self, beam_idx: torch.LongTensor):
        for layer in self.layers:
            layer.reorder_cache(beam_idx)
        if self.real_tokens is not None:
            self.real_tokens = self.real_tokens.index_select(0, beam_idx.to(self.real_tokens.device))

    def batch_repeat_interleave(self, repeats: int):
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)
        if self.real_tokens is not None:
            self.real_tokens = self.real_tokens.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor):
        for layer in self.layers:
            layer.batch_select_indices(indices)
        if self.real_tokens is not None:
            self.real_tokens = self.real_tokens[indices]

    def reset(self):
        for layer in self.layers:
            layer.reset()
        self.seen_tokens = 0
        self.real_tokens = None

    def crop(self, max_length: int):
        raise NotImplementedError(
            "An Aaren state summarises the whole past and cannot be rolled back, so decoding modes that crop the "
            "cache (assisted decoding, prompt lookup) are not supported."
        )

    def state_bytes(self) -> int:
        """Bytes held by the cache now: constant in the context once the window (if any) is full."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors().values())


# ----------------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------------


class AarenRMSNorm(nn.Module):
    """RMSNorm. ``unit_offset`` (Gemma): scale by (1 + weight), in float32, cast after the product; the weight is then
    0 for the identity. Otherwise (Llama): scale by weight, after casting back to the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        if takes_triton(fused_rms_norm, hidden_states):
            # one launch each way, keeping x and its scale for backward, not a float32 copy of x and the product
            out = fused_rms_norm(hidden_states, self.weight, self.variance_epsilon, self.unit_offset)
            if out is not None:
                return out
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def make_norm(config, size):
    if config.norm_type == "rmsnorm":
        return AarenRMSNorm(size, eps=config.rms_norm_eps, unit_offset=config.rms_norm_unit_offset)
    return nn.LayerNorm(size, eps=config.layer_norm_eps)


class AarenMLP(nn.Module):
    """Gated (Llama: down(act(gate(x)) * up(x))) or plain (GPT-2/NeoX: fc_out(act(fc_in(x))))."""

    def __init__(self, config):
        super().__init__()
        self.gated = config.mlp_type == "gated"
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        if self.gated:
            self.gate_proj = nn.Linear(h, i, bias=bias)
            self.up_proj = nn.Linear(h, i, bias=bias)
            self.down_proj = nn.Linear(i, h, bias=bias)
        else:
            self.fc_in = nn.Linear(h, i, bias=bias)
            self.fc_out = nn.Linear(i, h, bias=bias)
        self.hidden_act = config.hidden_act
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        if self.gated:
            gate, up = self.gate_proj(x), self.up_proj(x)
            if takes_triton(fused_glu, gate):
                # one launch each way, keeping gate and up for backward, not act(gate) besides (None: an
                # activation the kernel does not compute)
                h = fused_glu(gate, up, self.hidden_act)
                if h is not None:
                    return self.down_proj(h)
            return self.down_proj(self.act_fn(gate) * up)
        return self.fc_out(self.act_fn(self.fc_in(x)))


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, angles=None) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) on the first 2 * len(inv_freq) channels. x [B, T, h, D], pos [B, T];
    ``angles``: ``rotary_angles(pos, inv_freq)`` where the caller has them already."""
    if inv_freq.shape[0] == 0:
        return x
    cos, sin = angles or rotary_angles(pos, inv_freq)
    if _trains(x):
        return _Rotate.apply(x, cos, sin)
    return rotate_by(x, cos, sin)


class _Rotate(torch.autograd.Function):
    """:func:`rotate_by` whose backward turns the gradient back by the same angles: the transpose of the rotation is
    the rotation by -angle, so the same gradient bit for bit as autograd's through the products, in one pass. It
    keeps the angles rather than computing them again (five operators a call): the layers of a pass share them
    (:class:`Rotary`), so a train step keeps one set, as the teacher keeps its cos and sin."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate_by(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rotate_by(grad, cos, sin, inverse=True), None, None


class Rotary:
    """The window branch's rotary angles for a piece of tokens at positions ``pos`` [B, T] (padding, -1, turned as
    position 0): at the tokens' positions (keys and queries), and those by which the sink keys turn (back by
    0..n-1 in :func:`_sink_scores`, on to the window's edge in a decode step). Each is computed when first asked and
    serves every layer of the pass with the same frequencies (:meth:`AarenMixer.rotary`): the same bits, 3 x 6
    operators a layer fewer in a prefill, and in training 2 x 6 in the forward and, with ``_Rotate``, none in the
    backward."""

    def __init__(self, pos: torch.Tensor, inv_freq: torch.Tensor):
        self.pos, self.inv_freq = pos.clamp(min=0), inv_freq
        self._known = {}  # what: (positions, (cos, sin))

    def _at(self, what, positions):
        if what not in self._known:
            positions = positions()
            self._known[what] = positions, rotary_angles(positions, self.inv_freq)
        return self._known[what]

    def angles(self):
        """(cos, sin) [B, T, 1, rot] at the tokens' positions."""
        return self._at("pos", lambda: self.pos)[1]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, h, D] rotated at the tokens' positions."""
        return rotate(x, self.pos, self.inv_freq, self.angles())

    def _back(self, B: int, n: int):
        """(positions [B, n], (cos, sin) [B, n, 1, rot]) with row i at -i."""
        return self._at(("back", B, n), lambda: -torch.arange(n, device=self.pos.device).expand(B, -1))

    def back_angles(self, B: int, n: int):
        """(cos, sin) [B, n, 1, rot] with row i at -i."""
        return self._back(B, n)[1]

    def turn_back(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, n, h, D] with row i turned back by i positions (rotated at -i)."""
        back, angles = self._back(*x.shape[:2])
        return rotate(x, back, self.inv_freq, angles)

    def turn_on(self, edge: int):
        """(cos, sin) [B, T, 1, rot] at max(pos - edge, 0): a decode step turns the sink keys on by that."""
        return self._at(("on", edge), lambda: self._on(edge))[1]

    def _on(self, edge: int):
        return (self.pos - edge).clamp(min=0)

    def with_turn_on(self, edge: int):
        """(:meth:`angles`, :meth:`turn_on` (edge)) as a decode step asks for them: where neither is known yet, from
        one :func:`rotary_angles` call on both sets of positions (the same bits, five operators fewer a pass)."""
        if "pos" not in self._known and ("on", edge) not in self._known:
            B = self.pos.shape[0]
            on = self._on(edge)
            cos, sin = rotary_angles(torch.cat([self.pos, on]), self.inv_freq)
            self._known["pos"] = self.pos, (cos[:B], sin[:B])
            self._known[("on", edge)] = on, (cos[B:], sin[B:])
        return self.angles(), self.turn_on(edge)


def positions(mask: torch.Tensor, before: Optional[torch.Tensor] = None):
    """(pos [B, T]: each real token's position, after the ``before`` [B] real tokens of earlier calls, -1 at padding;
    the real tokens counted at the end of this call [B]) of a keep mask [B, T] (True: a real token). Three operators,
    four with ``before`` (a decode step pays them once a pass)."""
    counted = mask.cumsum(1)  # int64 (a bool mask counts as such)
    if before is not None:
        counted = counted + before.unsqueeze(1)
    if mask.shape[1] == 0:
        after = counted.new_zeros(mask.shape[0]) if before is None else before
    else:
        after = counted[:, -1].contiguous()
    return counted * mask - 1, after


def rotary_angles(pos: torch.Tensor, inv_freq: torch.Tensor):
    """(cos, sin) [B, T, 1, 2 * len(inv_freq)] of the rotary angles at positions pos [B, T]."""
    angles = pos.float().unsqueeze(-1) * inv_freq.float()
    angles = torch.cat([angles, angles], -1).unsqueeze(2)
    return angles.cos(), angles.sin()


def rotate_by(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """:func:`rotate` with the angles' cos and sin from :func:`rotary_angles`; ``inverse``: by their negatives (as
    with -sin). With the aaren_hf package one pass gives the same bits where autograd need not see it (as in
    ``_Rotate``): C on a CPU (``rotate_cpu``), a Triton launch on a GPU (``fused_rotate``, which negates in
    registers; kernels/window); this code is their reference."""
    if not _trains(x):
        rotated = None
        if takes_triton(fused_rotate, x):
            rotated = fused_rotate(x, cos, sin, inverse)
        elif takes_c(rotate_cpu, x):
            rotated = rotate_cpu(x, cos, sin, inverse)
        if rotated is not None:
            return rotated
    if inverse:
        sin = -sin
    rot = cos.shape[-1]
    xr, xp = x[..., :rot].float(), x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    rotated = (xr * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)
    return rotated if rot == x.shape[-1] else torch.cat([rotated, xp], -1)


class _Float32Product(torch.autograd.Function):
    """a @ b computed in float32 from 16-bit a and b; backward keeps a as it is (half the bytes of a float32 copy, and
    often a tensor kept anyway) and b, the small factor (the slots' queries), as its float32 copy: one cast fewer."""

    @staticmethod
    def forward(ctx, a, b):
        b32 = b.float()
        ctx.save_for_backward(a, b32)
        ctx.b_dtype = b.dtype
        return torch.matmul(a.float(), b32)

    @staticmethod
    def backward(ctx, grad):
        a, b32 = ctx.saved_tensors
        grad, da, db = grad.float(), None, None  # 16 bits where autocast ran the forward's product
        if ctx.needs_input_grad[0]:
            da = torch.matmul(grad, b32.transpose(-1, -2)).sum_to_size(a.shape).to(a.dtype)
        if ctx.needs_input_grad[1]:
            db = torch.matmul(a.float().transpose(-1, -2), grad).sum_to_size(b32.shape).to(ctx.b_dtype)
        return da, db


def float32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul(a.float(), b.float()), but training keeps 16-bit inputs in 16 bits for backward, not their float32
    copies (scores whose softmax needs float32: the slots' mix, the slot scores)."""
    if a.element_size() >= 4 and b.element_size() >= 4 or not torch.is_grad_enabled():
        return torch.matmul(a.float(), b.float())
    return _Float32Product.apply(a, b)


def window_attention(q, k, v, pos, k_prev, v_prev, pos_prev, sink_k, sink_v, sink_pos, window, rotary, scale,
                     memory=None, mix=None):
    """Exact softmax attention of each token over the last ``window`` tokens, plus sink tokens outside the window.

    q [B, T, H, D] (not rotated); k, v [B, T, Hkv, D] (k rotated at pos); pos [B, T] (-1: padding); ``rotary``: the
    :class:`Rotary` of pos;
    k_prev, v_prev, pos_prev: up to ``window - 1`` earlier entries (may be empty); sink_*: [B, S, ...] with keys rotated
    at their own position (S may be 0). A sink is seen at distance min(pos, S + W - 1) - i, as in a StreamingLLM
    cache whose sinks sit just before the window, so distances stay within what the window has seen. Sinks still
    inside the window are not counted twice.

    Queries go in blocks of Q = min(window, T); each block sees window - 1 + Q keys: O(T * window) memory, never
    T x T, and a decode step (T = 1) costs O(window).
    ``memory``: None, or the exact-memory tier as (keys [B, Hkv, C, D] rotated at their own positions, values,
    evict [B, Hkv, C], last [T + 1] from :func:`memory_visibility`, its size M); its keys join the same softmax.
    Each block gathers only the candidates some query of the block sees (at most M + Q), so this part costs
    O(T * (M + Q)) too.
    Returns [B, T, H, D]; a token that sees no valid key (padding) gets 0. With ``mix`` that output mixed with the
    Aaren branch's, as :func:`mix_branches` mixes them (on a GPU inside the kernel's autograd Function).
    """
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G, W, S = H // Hkv, window, sink_k.shape[1]
    # a kernel where one takes the inputs: Triton on a GPU, C on a CPU
    if takes_triton(fused_window_attention, q) or (
            takes_c(window_attention_cpu, q) and window_cpu_takes(q, k, v)):
        return _window_attention_fused(q, k, v, pos, k_prev, v_prev, pos_prev, sink_k, sink_v, sink_pos, window,
                                       rotary, scale, memory, mix)
    k_all, v_all, pos_all = after_held(k_prev, k), after_held(v_prev, v), after_held(pos_prev, pos)
    # Re-index keys so that query block n sees keys [n * Q, n * Q + W - 1 + Q): pad or drop on the left.
    shift = (W - 1) - k_prev.shape[1]
    if shift >= 0:
        k_all = F.pad(k_all, (0, 0, 0, 0, shift, 0))
        v_all = F.pad(v_all, (0, 0, 0, 0, shift, 0))
        pos_all = F.pad(pos_all, (shift, 0), value=-1)
    else:
        k_all, v_all, pos_all = k_all[:, -shift:], v_all[:, -shift:], pos_all[:, -shift:]
    Q = min(W, T)
    nblk = -(-T // Q)
    Tp, L = nblk * Q, W - 1 + Q
    right = Tp + W - 1 - k_all.shape[1]
    # keys and values wider by S dimensions, zero there, in which the sinks' scores ride (below); rounded up to a
    # multiple of 8, a width every fused attention kernel takes
    Dx = -(-(D + S) // 8) * 8
    k_all = F.pad(k_all, (0, Dx - D, 0, 0, 0, right))
    v_all = F.pad(v_all, (0, Dx - D, 0, 0, 0, right))
    pos_all = F.pad(pos_all, (0, right), value=-1)
    pb = pos_all.unfold(1, L, Q)  # [B, n, L]
    qpos = F.pad(pos, (0, Tp - T), value=-1)
    qp = F.pad(q, (0, 0, 0, 0, 0, Tp - T))
    # queries [B, n, Hkv, G, Q, Dx]; keys and values of the window, then of the memory, then the sinks
    # [B, n, Hkv, keys, Dx]: one attention call per (block, kv head) serves its G query heads
    attend = _attention_dtype(q)
    qw = q.new_zeros(B, nblk, Hkv, G, Q, Dx, dtype=attend)
    qr = F.pad(rotary.rotate(q), (0, 0, 0, 0, 0, Tp - T))
    qw[..., :D] = qr.view(B, nblk, Q, Hkv, G, D).permute(0, 1, 3, 4, 2, 5)
    # every key and value a block reads is a row of one small table (the window's [B, T', Hkv] rows, the memory's
    # [B, Hkv, C], the sinks' [B, Hkv, S]) that one index_select copies into place: the largest tensors of a prefill
    # are written once, with no per-part copies to concatenate
    arange = partial(torch.arange, device=q.device)
    table_k, table_v = [k_all.to(attend).reshape(-1, Dx)], [v_all.to(attend).reshape(-1, Dx)]
    rows = [(arange(B).view(B, 1, 1, 1) * k_all.shape[1] + arange(nblk).view(1, nblk, 1, 1) * Q
             + arange(L).view(1, 1, 1, L)) * Hkv + arange(Hkv).view(1, 1, Hkv, 1)]
    qpos = qpos.view(B, nblk, Q)
    query_valid = qpos >= 0  # [B, n, Q]
    # a padding query sees every key of the window and the memory, so that its softmax stays finite; its output is
    # zeroed below
    padding = ~query_valid.view(B, nblk, 1, Q, 1)
    band = (arange(L).view(1, L) >= arange(Q).view(Q, 1)) & (arange(L).view(1, L) <= arange(Q).view(Q, 1) + W - 1)
    seen = [(band & (pb.unsqueeze(2) >= 0)).unsqueeze(2) | padding]  # [B, n, 1, Q, L]: the same for every kv head
    if memory is not None:
        mem_keys, mem_values, evict, last, _ = memory
        mem_rows, mem_seen, mem_counts = _memory_blocks(evict, last, T, nblk, Q)
        rows.append(mem_rows + table_k[0].shape[0])
        # decoded codes are float32 and may round past float16's largest value: saturate, as the cache does
        table_k.append(F.pad(to_cache(mem_keys, attend), (0, Dx - D)).reshape(-1, Dx))
        table_v.append(F.pad(to_cache(mem_values, attend), (0, Dx - D)).reshape(-1, Dx))
        seen.append(mem_seen | padding)  # [B, n, Hkv, Q, K]
    if S > 0:
        # sinks are seen from position c = min(p, S + W - 1), by queries rotated there, so their scores are not
        # q . k: computed apart, they ride in S more query dimensions, which only the S sink keys read (one-hot
        # there)
        # float16 queries hold the float32 scores saturated (finite beyond its range, not inf)
        scores = to_cache(_sink_scores(qp, qpos.reshape(B, Tp), sink_k, W, rotary, attend), attend)
        qw[..., D:D + S] = scores.view(B, nblk, Q, Hkv, G, S).permute(0, 1, 3, 4, 2, 5)
        rows.append(arange(B * Hkv * S).view(B, 1, Hkv, S) + sum(part.shape[0] for part in table_k))
        table_k.append(F.pad(torch.eye(S, device=q.device, dtype=attend), (D, Dx - D - S)).repeat(B * Hkv, 1))
        table_v.append(F.pad(sink_v.to(attend).transpose(1, 2), (0, Dx - D)).reshape(-1, Dx))
        sp = sink_pos.view(B, 1, 1, S)
        seen.append(((sp >= 0) & (sp <= qpos.unsqueeze(-1) - W) & query_valid.unsqueeze(-1)).unsqueeze(2))
    table_k, table_v = torch.cat(table_k), torch.cat(table_v)
    zero, minus_inf = (torch.full((), x, device=q.device, dtype=attend) for x in (0.0, float("-inf")))
    # Blocks pad their memory part to the most candidates any block sees; while the memory fills (its first M + W
    # tokens) early blocks see far fewer. On a CPU, where attention costs its keys, runs of blocks get their own
    # width (at W = 64, M = 448: 0.69x the keys at 500 tokens, 0.82x at 1,000, 0.91x at 2,000); on a GPU one call
    # serves all (there launches cost more than keys).
    groups = [(0, nblk, None)]
    if memory is not None and not launch_bound(q.device) and nblk > 1:
        groups = _block_groups(mem_counts.tolist(), W - 1 + Q + S)
    outs = []
    for n0, n1, width in groups:
        nb = n1 - n0
        run = [(r[:, n0:n1] if r.shape[1] > 1 else r, s[:, n0:n1]) for r, s in zip(rows, seen)]  # views
        if width is not None:  # the memory part (seen candidates first in every block) cut to this run's width
            run[1] = (run[1][0][..., :width], run[1][1][..., :width])
        run_rows = torch.cat([r.expand(B, nb, Hkv, -1) for r, _ in run], -1)
        Lk = run_rows.shape[-1]
        kx, vx = (table.index_select(0, run_rows.flatten()) for table in (table_k, table_v))
        # the mask as an additive bias, one for the G query heads of a kv head (-inf, not the lowest float: exp of
        # that underflows to denormals, several times slower on CPUs), written part by part: no mask of the whole
        # [.., Q, Lk] is ever built; fused attention (PyTorch's flash kernel on CPUs)
        bias = torch.empty(B, nb, Hkv, Q, Lk, device=q.device, dtype=attend)
        start = 0
        for _, part in run:
            torch.where(part.expand(B, nb, Hkv, Q, -1), zero, minus_inf, out=bias[..., start:start + part.shape[-1]])
            start += part.shape[-1]
        o = _attention(qw[:, n0:n1].reshape(-1, G, Q, Dx), kx.view(-1, 1, Lk, Dx), vx.view(-1, 1, Lk, Dx),
                       bias.view(-1, 1, Q, Lk), scale)
        outs.append(o.view(B, nb, Hkv, G, Q, Dx))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    out = out[..., :D].permute(0, 1, 4, 2, 3, 5).reshape(B, Tp, H, D)[:, :T]
    # not in place: out may view SDPA's own
    return mix_branches(out.masked_fill((pos < 0).view(B, T, 1, 1), 0.0).to(q.dtype), mix)


def _window_attention_fused(q, k, v, pos, k_prev, v_prev, pos_prev, sink_k, sink_v, sink_pos, window, rotary,
                            scale, memory, mix=None):
    """:func:`window_attention` by a kernel: the Triton one on a GPU (kernels/window/chunk.py), the C one on a CPU
    (kernels/window/chunk.c, where ``window_cpu_takes`` says so). Both have their backward. The window's keys are
    read where they lie, the memory's through each block's list of candidates, the queries are turned as they are
    read, and what a query sees is decided in the kernel, so no block's keys are gathered and no mask is built (on a
    GPU the gathered keys and values were about ten times the window's, kept for backward; on a CPU each query
    scores its own keys rather than its block's widest set)."""
    B, T, H, D = q.shape
    S, attend = sink_k.shape[1], _attention_dtype(q)
    in_triton = takes_triton(fused_window_attention, q)
    queries = None
    if takes_c(window_queries_cpu, q):
        # with the aaren_hf package, on a CPU without gradients: the queries' lines below (rotation, the sinks'
        # scores and what each query sees of them) in one C call (kernels/window/chunk.c), equal to rounding
        queries = window_queries_cpu(q, pos, rotary.angles(), sink_k, sink_pos,
                                     rotary.back_angles(B, S + window) if S > 0 else None, window)
    angles = None
    if queries is None:
        # the kernels turn the queries as they read them (their backward again): no turned copy is written or kept
        # for backward, only q, which the slots' mix keeps too. For a float64 q the Triton kernel takes float32: the
        # same turn, as rotate_by turns in float32.
        q_in, angles = (q.to(attend) if in_triton else q), rotary.angles()
        if S > 0:
            sink_s = _sink_scores(q, pos, sink_k, window, rotary, attend).view(B, T, H, S)
    else:
        q_in, sink_s = queries  # turned already
    ks, vs, spos = after_held(k_prev, k.to(attend)), after_held(v_prev, v.to(attend)), after_held(pos_prev, pos)
    lists = None
    if memory is not None:
        mem_keys, mem_values, evict, last, size = memory
        # decoded codes are float32 and may round past float16's largest value: saturate, as the cache does
        lists = (to_cache(mem_keys, attend), to_cache(mem_values, attend), evict, last)
        if in_triton:  # the kernel reads any order, and as many of each list as its block needs
            nblk = -(-T // WINDOW_BLOCK)
            lists += _memory_lists(evict, last, T, nblk, WINDOW_BLOCK, width=size + WINDOW_BLOCK)
    sinks = None if S == 0 else (sink_s, sink_v.to(attend), sink_pos)  # the kernels decide which a query sees
    if in_triton and mix is not None and mix[0].dtype == q.dtype and _trains(q, k, v, *mix):
        # mixed in the kernel's Function, whose backward rebuilds the window's output from the mixed one (which the
        # output projection keeps anyway) and the branches' difference: training keeps no window output besides
        o, gate = mix
        return fused_window_attention(q_in, pos, ks, vs, spos, k_prev.shape[1], window, scale, lists, sinks, angles,
                                      (o, mix_weight(o, gate)))
    kernel = fused_window_attention if in_triton else window_attention_cpu
    out = kernel(q_in, pos, ks, vs, spos, k_prev.shape[1], window, scale, lists, sinks, angles)
    return mix_branches(out.to(q.dtype), mix)


def fill_sinks(k, v, pos, sink_k, sink_v, sink_pos):
    """The sinks after a piece of tokens: the first S real tokens of a sequence become its sinks (slot = position),
    keys rotated at their own position. k, v [B, T, Hkv, D] as the window stores them, pos [B, T] (-1: padding);
    sink_k, sink_v [B, S, Hkv, D], sink_pos [B, S] (-1: empty). New tensors; gradients flow to k and v. On a GPU one
    Triton launch (``fused_sinks``, kernels/window/carry.py); this code is its reference."""
    if takes_triton(fused_sinks, k):
        sinks = fused_sinks(k, v, pos, sink_k, sink_v, sink_pos)
        if sinks is not None:
            return sinks
    B, T, Hkv, D = k.shape
    S = sink_k.shape[1]
    # found by comparison, not nonzero(), which reads back to the host (a GPU would wait for every launch before)
    slots = torch.arange(S, device=pos.device)
    hit = pos.unsqueeze(-1) == slots  # [B, T, S]
    found = hit.any(1)  # [B, S]
    at = hit.to(torch.uint8).argmax(1).view(B, S, 1, 1).expand(B, S, Hkv, D)  # the token in each slot
    return (torch.where(found.view(B, S, 1, 1), k.gather(1, at).to(sink_k.dtype), sink_k),
            torch.where(found.view(B, S, 1, 1), v.gather(1, at).to(sink_v.dtype), sink_v),
            torch.where(found, slots, sink_pos))


def next_window(k_prev, v_prev, pos_prev, k, v, pos, window, stream_score=None):
    """The window the next call continues from: the last W - 1 entries of the window held (k_prev, v_prev [B, Wp,
    Hkv, D] in the cache's dtype, pos_prev [B, Wp]) and this call's tokens (k, v [B, T, Hkv, D] as the cache stores
    them, pos [B, T]), with ``stream_score`` [B, Wp + T, Hkv] (the memory's) their scores. The next token sees itself
    plus the W - 1 entries before it. Fewer than W - 1 so far: empty entries (position -1, like left padding: never
    seen, never entering the memory; score -inf) fill the front, so the state has its full size from the first call
    and every later token takes the one-token step. {"k", "v", "pos"[, "score"]}, no gradient. On a GPU one Triton
    launch (``fused_next_window``, kernels/window/carry.py); this code is its reference."""
    if takes_triton(fused_next_window, k):
        got = fused_next_window(k_prev, v_prev, pos_prev, k, v, pos, window, stream_score)
        if got is not None:
            return got
    held = k_prev.shape[1] + k.shape[1]
    first, short = max(0, held - (window - 1)), max(0, window - 1 - held)
    win_k = torch.cat([k_prev, k.to(k_prev.dtype)], 1)[:, first:].detach()
    win_v = torch.cat([v_prev, v.to(v_prev.dtype)], 1)[:, first:].detach()
    out = {"k": F.pad(win_k, (0, 0, 0, 0, short, 0)), "v": F.pad(win_v, (0, 0, 0, 0, short, 0)),
           "pos": F.pad(torch.cat([pos_prev, pos], 1)[:, first:], (short, 0), value=-1)}
    if stream_score is not None:
        out["score"] = F.pad(stream_score[:, first:], (0, 0, short, 0), value=float("-inf"))
    return out


def _sink_scores(q, qpos, sink_k, window, rotary, attend):
    """Scores [B, T, Hkv, G, S] of queries q [B, T, H, D] (not rotated) at qpos [B, T] against the S sinks, each query
    rotated to c = min(p, S + W - 1) (:func:`window_attention`): <R(c) q, k> = <q, R(-c) k>, so the sink keys are
    turned back by each of the S + W values of c (a few rows), one of them per query, rather than every query rotated
    a second time. The keys are turned in the attention's dtype where the cache stores them in it (16 bits on a GPU):
    rotation computes in float32 and rounds once, as the float32 turn and its cast did (the same keys and query
    gradients bit for bit; the sink keys' gradient is rounded to 16 bits before the sum over the S + W copies, not
    after), without the casts (four operators in a train step, and half the bytes of the copies). The scores are
    float32 (:class:`_SinkScores`)."""
    B, T, H, D = q.shape
    S, Hkv, W = sink_k.shape[1], sink_k.shape[2], window
    arange = partial(torch.arange, device=q.device)
    keys = sink_k if sink_k.dtype == attend else sink_k.float()
    turned = rotary.turn_back(keys.unsqueeze(1).expand(B, S + W, S, Hkv, D).reshape(B, S + W, S * Hkv, D))
    c = qpos.clamp(min=0, max=S + W - 1) + arange(0, B * (S + W), S + W).view(B, 1)
    return _SinkScores.apply(q.to(attend).view(B, T, Hkv, H // Hkv, D), turned.reshape(B * (S + W), S, Hkv, D),
                             c.flatten())


class _SinkScores(torch.autograd.Function):
    """matmul(q [B, T, Hkv, G, D], each query's sink keys, row ``rows`` of ``turned`` [B (S + W), S, Hkv, D]) in
    float32, as autograd computes it, forward and backward, the same operators, but backward gathers the keys again
    from the S + W turned rows of each sequence rather than keeping every query's copy ([B, T, S, Hkv, D]: as many
    bytes as the keys of the piece, for each sink). Float32 from 16-bit q and keys (a GPU's): these scores are not
    yet scaled, and float16 overflowed to inf from 65504 (a scaled score of 8,188 at D = 64; the window's own scores,
    scaled in the kernels' float32 accumulators, do not), which made the softmax NaN; the products are exact and the
    sums as the kernels' float32 accumulators keep them, the keys' gradient summed over the queries in float32 too.
    A float32 q (a CPU's) computes as before, bit for bit."""

    @staticmethod
    def _folded_keys(q, turned, rows):
        # matmul folds [B, T, Hkv] into one batch and bmm's the keys in the layout the reshape of their transpose gets
        B, T, Hkv, G, D = q.shape
        S = turned.shape[1]
        keys = turned.index_select(0, rows).view(B, T, S, Hkv, D).to(q.dtype).permute(0, 1, 3, 4, 2)
        return keys.reshape(B * T * Hkv, D, S).float()

    @staticmethod
    def forward(ctx, q, turned, rows):
        ctx.save_for_backward(q, turned, rows)
        B, T, Hkv, G, D = q.shape
        return torch.bmm(q.reshape(-1, G, D).float(), _SinkScores._folded_keys(q, turned, rows)).view(B, T, Hkv, G, -1)

    @staticmethod
    def backward(ctx, grad):
        q, turned, rows = ctx.saved_tensors
        B, T, Hkv, G, D = q.shape
        S = turned.shape[1]
        grad = grad.reshape(-1, G, S)
        dq = dturned = None
        if ctx.needs_input_grad[0]:
            dq = torch.bmm(grad, _SinkScores._folded_keys(q, turned, rows).transpose(1, 2)).view(q.shape).to(q.dtype)
        if ctx.needs_input_grad[1]:
            dkeys = torch.bmm(q.reshape(-1, G, D).transpose(1, 2).float(), grad).view(B, T, Hkv, D, S)
            dkeys = dkeys.permute(0, 1, 4, 2, 3).reshape(B * T, S, Hkv, D)
            dturned = dkeys.new_zeros(turned.shape).index_add_(0, rows, dkeys).to(turned.dtype)
        return dq, dturned, None


def _attention_dtype(q: torch.Tensor) -> torch.dtype:
    """What window attention computes in. On a GPU its kernels (the Triton kernel; SDPA's fused ones) take 16-bit
    queries, keys, values and mask and accumulate in float32: in a 16-bit model that halves the largest tensors of a
    prefill (the keys and values each block gathers, about ten times the window's; kept for backward when training)
    and runs on tensor cores. A CPU keeps float32."""
    return q.dtype if launch_bound(q.device) and q.element_size() == 2 else torch.float32


def _attention(q, k, v, bias, scale):
    """Softmax attention of q [N, G, Q, D] over keys and values [N, 1, K, D] shared by the G heads, bias
    [N, 1, Q, K] added to the scaled scores."""
    if _SDPA_SHARES_KEYS and not q.is_cuda:  # PyTorch's CPU flash kernel takes a mask with enable_gqa
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
    # On CUDA a mask with enable_gqa leaves SDPA only its math backend, which holds every score (and softmax) in
    # float32 and, training, keeps them for backward; keys broadcast over the G heads (stride 0: no copy) go to the
    # memory-efficient kernel instead. torch < 2.5 (a Hub user's) has no enable_gqa at all.
    G = q.shape[1]
    return F.scaled_dot_product_attention(q, k.expand(-1, G, -1, -1), v.expand(-1, G, -1, -1), attn_mask=bias,
                                          scale=scale)


_SDPA_SHARES_KEYS = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def after_held(held: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """torch.cat([held, x], 1) in x's dtype, for reading only: x itself where nothing is held (training, a first
    prompt), not a copy of it (on a GPU a launch, and the piece's bytes)."""
    return x if held.shape[1] == 0 else torch.cat([held.to(x.dtype), x], 1)


def to_cache(x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """x as a cache stores it in ``dtype`` (None: unchanged). float16 saturates at its largest finite value rather
    than overflowing to inf."""
    if dtype is None or dtype == x.dtype:
        return x
    if dtype == torch.float16:
        x = x.clamp(-65504.0, 65504.0)
    return x.to(dtype)


def round_to_cache(x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """x as a cache stored in ``dtype`` gives it back (None: unchanged)."""
    return to_cache(x, dtype).to(x.dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a power of 2) times the D x D Sylvester-Hadamard matrix (entries +-1), divided by D: applying
    it to H x gives x back. One butterfly per bit of D, so the sums run in a fixed order whatever the shape (the
    parallel path and decoding code one token in calls of different shapes and must get the same codes, where a
    matmul's order depends on its shape); dividing first keeps even the largest floats finite."""
    D = x.shape[-1]
    y = x / D
    h = D // 2
    while h >= 1:  # the bits of the index from the top: pairs (i, i + h) within blocks of 2h
        a, b = y.unflatten(-1, (D // (2 * h), 2, h)).unbind(-2)
        if _compiling():  # torch.compile takes no strided out= (and fuses the stack)
            y = torch.stack([a + b, a - b], -2).flatten(-3)
        else:
            y = torch.empty_like(y)
            pairs = y.unflatten(-1, (D // (2 * h), 2, h))
            torch.add(a, b, out=pairs[..., 0, :])  # written in place: a stack with a short last dimension is slow
            torch.sub(a, b, out=pairs[..., 1, :])
        h //= 2
    return y


_HADAMARD_SIGNS: dict = {}


def hadamard_signs(D: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The D x D Sylvester-Hadamard matrix (+-1, symmetric), made once per size, device and dtype."""
    key = (D, torch.device(device), dtype)
    if key not in _HADAMARD_SIGNS:
        signs = hadamard(torch.eye(D, dtype=torch.float64, device=device)).mul(D).to(dtype)
        if _compiling():  # kept by a compiled step, the next call would find it and compile again
            return signs
        _HADAMARD_SIGNS[key] = signs
    return _HADAMARD_SIGNS[key]


def bfloat16_grid(x: torch.Tensor) -> torch.Tensor:
    """Float32 x >= 0 rounded to the nearest bfloat16 (ties to even), kept in float32: x.to(bfloat16).float() bit for
    bit (for a NaN, a NaN), by the integer arithmetic of the conversion (as kernels/memory/codes.h does it). A
    compiler fusing .to(bfloat16).float() into one kernel may skip that rounding (inductor does, unless
    emulate_precision_casts), and codes taken against an unrounded scale differ from prefill's; integer arithmetic
    it keeps."""
    u = x.view(torch.int32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) & -0x10000).view(torch.float32)
    return torch.where(x.isnan(), x, rounded)  # a NaN's low payload bits would carry into inf


@dataclass(frozen=True)
class MemoryCodes:
    """How the memory stores its keys and values when ``memory_bits`` is set: ``bits``-bit integer codes with one
    bfloat16 scale per vector, of the vector's :func:`hadamard` rotation when ``rotate`` (``memory_hadamard``).
    The one home of the memory quantizer: the mixer and every baseline held in codes go through it."""

    bits: int
    rotate: bool = False

    def __post_init__(self):
        if self.bits not in (8, 4) or not isinstance(self.rotate, bool):
            raise ValueError(f"memory codes have 8 or 4 bits and rotate True or False, got {self!r}")

    @classmethod
    def of(cls, config) -> Optional["MemoryCodes"]:
        """A config's memory codes (None: the memory stores keys and values as the window does)."""
        bits = getattr(config, "memory_bits", None)
        return cls(bits, bool(getattr(config, "memory_hadamard", False))) if bits else None

    def __str__(self):
        return f"{self.bits}-bit {'Hadamard ' if self.rotate else ''}codes"

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] as codes and one bfloat16 scale per vector (its largest magnitude over the largest code),
        symmetric: (codes, scale [..., 1]). 8 bits: int8 codes; 4 bits: codes + 8 in 1..15, the first half of the
        vector in the low nibbles and the second in the high ones, D / 2 bytes. The scale is rounded before the codes
        are taken, so coding a decoded vector gives back the same codes and scale: memory entries can go back and
        forth between the two forms without drifting. ``rotate``: the codes are of :func:`hadamard` of x, which
        spreads a few large channels (rotary keys have them) over all D, so they no longer set a scale that rounds
        the other channels to zero; still exact back and forth (docs/aaren_math.md, section 4)."""
        top = 2 ** (self.bits - 1) - 1
        x = hadamard(x.float()) if self.rotate else x.float()
        scale = bfloat16_grid(x.abs().amax(-1, keepdim=True) / top)
        codes = torch.round(x / scale.clamp(min=torch.finfo(torch.float32).tiny)).clamp(-top, top)
        scale = scale.to(torch.bfloat16)  # exact: already on bfloat16's grid
        if self.bits == 8:
            return codes.to(torch.int8), scale
        codes = (codes + 8).to(torch.uint8)
        half = x.shape[-1] // 2
        return codes[..., :half] | (codes[..., half:] << 4), scale

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, rotated: bool = False) -> torch.Tensor:
        """Float32 values of :meth:`encode`'s codes (exact: a code has at most 8 significant bits, the scale 8).
        Rotated codes are turned back by the +-1 matrix: a product of whole numbers below 2^13, exact in float32
        (TF32 too: its inputs here have at most 7 bits) whatever the order of the sums. ``rotated``: leave them as
        :func:`hadamard` of the vectors, for a reader that turns its other inputs instead (turning back costs D
        products per entry)."""
        if codes.dtype == torch.uint8:  # 4 bits, two to a byte
            codes = torch.cat([codes & 15, codes >> 4], -1).float() - 8
        if self.rotate and not rotated:
            codes = self.turn(codes)
        return codes.float() * scale.float()

    @staticmethod
    def turn(x: torch.Tensor) -> torch.Tensor:
        """x [..., D] times the +-1 Sylvester-Hadamard matrix S, in float32 (S S = D I, and hadamard(x) = x S / D).
        Under autocast a float32 product would come back in 16 bits, so there it runs in float64, the one dtype
        autocast leaves alone (decoding a step in float64 costs a third more time on a CPU)."""
        wide = torch.float64 if _autocast_on(x.device.type) else torch.float32
        return (x.to(wide) @ hadamard_signs(x.shape[-1], x.device, wide)).float()

    @lru_cache(maxsize=None)
    def empty_code(self, D: int) -> int:
        """The code byte of a zero vector of width D (every byte of it is this one), computed once."""
        return int(self.encode(torch.zeros(D))[0][0])

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """x as the memory stores it gives it back, in float32. Gradients pass straight through to x, as they do
        through :func:`round_to_cache`'s casts."""
        return self.round_with_codes(x)[0]

    def round_with_codes(self, x: torch.Tensor, dtype: Optional[torch.dtype] = None):
        """(:meth:`round` of x in ``dtype`` (float32 where None) as :func:`to_cache` casts it, :meth:`encode` of x):
        for a caller that stores the codes too and reads the values in ``dtype`` (window attention, in 16 bits on a
        GPU). With the aaren_hf package, one C loop on a CPU (``memory_round_cpu``, kernels/memory) or one Triton
        launch on a GPU (``fused_memory_round``, kernels/memory/codes.py, which reads 16-bit x as it lies and writes
        ``dtype``) gives the same codes and values bit for bit; this code is their reference."""
        dtype = dtype or torch.float32
        rounded = None
        if takes_triton(fused_memory_round, x):
            rounded = fused_memory_round(x.detach(), self.bits, self.rotate, dtype)
        elif takes_c(memory_round_cpu, x):
            rounded = memory_round_cpu(x.detach().float(), self.bits, self.rotate)
        if rounded is None:
            coded = self.encode(x.detach())
            rounded = self.decode(*coded), coded
        back, coded = rounded
        back = to_cache(back, dtype)  # (written in dtype already by the Triton kernel)
        return (_StraightThrough.apply(x, back) if x.requires_grad else back), coded


class _StraightThrough(torch.autograd.Function):
    """``values``, made from x without autograd (the memory's rounding), with x's gradient passed straight through
    (autograd casts it to x's dtype): where ``values + (x - x.detach())`` costs two operators forward, and casts
    each way where the dtypes differ, this costs none where they agree."""

    @staticmethod
    def forward(ctx, x, values):
        return values

    @staticmethod
    def backward(ctx, grad):
        return grad, None


_SAME_VALUES = {}  # (id, version, id, version) -> (a, b, equal), for _same_values


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal(a, b), asked of the device once per version of the two (in-place writes bump a tensor's
    version): on a GPU every ask waits for the launches before it. False where the values cannot be read (the meta
    device) or the versions are not kept (inference tensors)."""
    if a is b:
        return True
    if a.device != b.device or a.shape != b.shape or a.dtype != b.dtype or a.is_meta:
        return False
    try:
        key = (id(a), a._version, id(b), b._version)
    except RuntimeError:  # inference tensors keep no version
        return False
    hit = _SAME_VALUES.get(key)
    if hit is None or hit[0] is not a or hit[1] is not b:  # an id reused by another tensor is another tensor
        if len(_SAME_VALUES) > 4096:  # the entries keep their tensors alive: a bounded few
            _SAME_VALUES.clear()
        hit = _SAME_VALUES[key] = (a, b, torch.equal(a, b))
    return hit[2]


def _write(holder, name: str, new: torch.Tensor):
    """``holder.name = new``, copied into the tensor held where that has new's shape and dtype (a decode step's
    fixed addresses); held as given where nothing is held yet or the held tensor takes no writes."""
    held = getattr(holder, name)
    if held is new:
        return
    if held is None or held.shape != new.shape or held.dtype != new.dtype or not _takes_writes(held):
        setattr(holder, name, new)
    else:
        held.copy_(new)


def _takes_writes(t: torch.Tensor) -> bool:
    """Whether t may be written in place: not a tensor made under inference_mode while that is off (inside a graph
    nobody can ask; :meth:`AarenCache.hold_still` keeps a static cache's tensors normal for it)."""
    return _compiling() or not t.is_inference() or torch.is_inference_mode_enabled()


def _dense(t: torch.Tensor) -> bool:
    """Whether t has the strides of a new contiguous tensor of its shape, size-1 dimensions included (which
    ``is_contiguous`` overlooks and torch.compile guards on: a batch-1 prompt leaves such views)."""
    step = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if stride != step:
            return False
        step *= max(size, 1)
    return True


def _compiling() -> bool:
    """Whether torch.compile is tracing this call (torch < 2.3, a Hub user's: never)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 (a Hub user's): no per-device query
        return torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()
    except RuntimeError:  # a device without autocast (meta)
        return False


def mix_branches(o_win: torch.Tensor, mix=None) -> torch.Tensor:
    """A layer's output from its window branch's o_win [B, T, H, D]: as it is, or with ``mix`` = (the Aaren
    branch's output o [B, T, H, D], gate logits [H] or [B, T, H]) lerp(o, o_win, sigmoid(gate)) in o's dtype
    (float32 inside), as the slots are mixed."""
    if mix is None:
        return o_win
    o, gate = mix
    mixed = _Lerp.apply if _trains(o, o_win, gate) else torch.lerp
    return mixed(o, o_win.to(o.dtype), mix_weight(o, gate))


def _trains(*tensors) -> bool:
    """Whether autograd records a step on these tensors (else what a backward would keep is computed for nothing)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def mix_weight(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The window branch's share sigmoid(gate) [H, 1] or [B, T, H, 1] in o's dtype, for :func:`mix_branches`. The
    sigmoid of a gate already in o's dtype is taken in it: torch computes a 16-bit sigmoid in float32 and rounds once,
    the bits of the float32 sigmoid cast (checked on every bfloat16 and float16 value), without two casts each way
    (a 16-bit train step)."""
    return torch.sigmoid(gate if gate.dtype == o.dtype else gate.float()).unsqueeze(-1).to(o.dtype)


class _Lerp(torch.autograd.Function):
    """torch.lerp(start, end, weight) with autograd's formulas for it, the same bits, keeping for backward the
    difference end - start that the weight's gradient reads rather than both ends: one tensor of the output's size,
    not two (the Aaren and window branches' outputs of every layer, in training)."""

    @staticmethod
    def forward(ctx, start, end, weight):
        ctx.save_for_backward(end - start, weight)
        return torch.lerp(start, end, weight)

    @staticmethod
    def backward(ctx, grad):
        diff, weight = ctx.saved_tensors
        # broadcast gradients: autograd sums each to its input's shape, as it does lerp's own
        needs = ctx.needs_input_grad
        return (grad * (1 - weight) if needs[0] else None, grad * weight if needs[1] else None,
                grad * diff if needs[2] else None)


def round_retention(score: torch.Tensor) -> torch.Tensor:
    """Retention scores on a grid of 1/64 (see ``AarenMixer.retention_score``). A NaN score (a broken model's) ranks
    as -inf: comparisons with NaN are false, so each ranking (sweep, heap, decode step) would otherwise treat it
    its own way, and the parallel pass and decoding would keep different tokens. On a GPU one Triton launch
    (``fused_round_retention``, kernels/memory/evict.py), the same bits; this code is its reference."""
    if takes_triton(fused_round_retention, score):
        rounded = fused_round_retention(score)
        if rounded is not None:
            return rounded
    inf = float("inf")
    return torch.round(torch.nan_to_num(score.float(), nan=-inf, posinf=inf, neginf=-inf) * 64) / 64


def memory_visibility(cand_pos, cand_score, first_stream, window, num_sinks, memory_size, T, block=None):
    """When each memory candidate is in the memory: the rule the parallel path and token-by-token decoding share.

    Candidates [B, Hkv, C] are the memory held so far (the first ``first_stream``, always eligible) followed by the
    stream (the window entries held so far, then this call's T tokens, in order). Query i of this call sits at stream
    index P + i (P = C - first_stream - T); the window covers stream indices (P + i - W, P + i], so the tokens before
    it (a prefix of the candidates) have left the window and are memory-eligible. Of the eligible real tokens
    (position >= num_sinks: sinks and padding never enter the memory) the query sees the ``memory_size`` with the
    highest score, ties to the newer. Because a score never changes, a token that drops out of that top set never
    returns, so the top set over (memory held + newly eligible) equals the top set over the whole past: the
    parallel path and token-by-token decoding see the same keys.

    So each candidate c is in the memory for one stretch of eligibility: from when it becomes eligible (candidate
    index c) until ``evict[c]``, the first candidate index e at which M candidates among 0..e rank above it.
    Returns (last [T + 1]: the last eligible candidate index of each query and of the query after this call, -1 for
    none; evict [B, Hkv, C], -1 for candidates that are not real). Query i sees c iff c <= last[i] < evict[c]
    (:func:`memory_seen`).

    ``evict`` comes from a sweep over the candidates in blocks: each block ranks the top set before it (the M best
    so far) and its own candidates against each other, so the cost is O(C * (M + block)), never C x C; one top-M
    over the candidates' order gives every block its top set, so many blocks are ranked in one pass
    (:func:`sweep_plan`). On a CPU with this package, ``memory_evict_cpu`` (kernels/memory) computes the same
    indices with a heap per row.
    """
    B, Hkv, C = cand_pos.shape
    M, device = memory_size, cand_pos.device
    P = C - first_stream - T
    # the offsets folded into the arange's bounds and the clamp: two operators, not six (each a launch on a GPU)
    lo = P - window + first_stream
    last = torch.arange(lo, lo + T + 1, device=device).clamp(min=first_stream - 1)
    upto = first_stream + max(0, P + T - window + 1)  # last[-1] + 1: later candidates are seen by no query of this call
    evict = None
    if takes_c(memory_evict_cpu, cand_pos):
        evict = memory_evict_cpu(cand_pos, cand_score, upto, num_sinks, M)
    if evict is None:
        evict = _evict_sweep(cand_pos, cand_score, num_sinks, upto, M, *sweep_plan(B, Hkv, M, device, block))
    return last, evict


def sweep_plan(B, Hkv, M, device, block=None) -> tuple:
    """(candidates per block, comparisons per pass) of the ranking sweep: blocks of M (at least 64), which makes the
    fewest comparisons in all (a block ranks the M of the top set and its own against each other), and as many of
    them in one pass as SWEEP_PAIRS comparisons allow, or SWEEP_PAIRS_GPU off a CPU (where a pass costs launches:
    one pass for a 32K-token piece of one sequence with 3 kv heads and M = 448)."""
    return block or max(64, M), SWEEP_PAIRS_GPU if launch_bound(device) else SWEEP_PAIRS


def candidate_ranks(cand_pos, cand_score, num_sinks):
    """The start of :func:`_evict_sweep`: (rank, evict), each [B, Hkv, C + 1]. rank: the candidates' order by score,
    then position (the newer above), as numbers, the higher above; -1 for those that are not real (position <
    ``num_sinks``) and for column C, an empty slot of a top set. evict: C so far, -1 for those that are not real
    (column C: where the sweep's scatter drops what it does not write). On a GPU one Triton launch
    (``fused_memory_ranks``, kernels/memory/evict.py) gives other numbers in the same order and evict without column
    C; this code is its reference."""
    B, Hkv, C = cand_pos.shape
    real = cand_pos >= num_sinks
    by_pos = cand_pos.argsort(-1)
    order = by_pos.gather(-1, torch.sort(cand_score.float().gather(-1, by_pos), dim=-1, stable=True).indices)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(C, device=cand_pos.device).expand(B, Hkv, C))
    return F.pad(torch.where(real, rank, -1), (0, 1), value=-1), F.pad(torch.where(real, C, -1), (0, 1), value=C)


def _evict_sweep(cand_pos, cand_score, num_sinks, upto, M, block, pairs):
    """:func:`memory_visibility`'s evict (C where never evicted or after ``upto``, -1 for candidates that are not
    real: position < ``num_sinks``) by the block sweep: each block ranks the top set before it (the M best real
    candidates so far, which a top-M over the candidates' order gives for every block at once) and its own candidates
    against each other, as many blocks per pass as keep the comparisons (and the candidates the top sets are chosen
    from) within ``pairs``. Where Triton serves, one launch numbers the candidates in their order
    (``fused_memory_ranks``, kernels/memory/evict.py, for :func:`candidate_ranks`' sort) and one ranks a pass's blocks
    (``fused_memory_evict``) with no comparison tensors in memory, so only the top sets count against ``pairs``."""
    B, Hkv, C = cand_pos.shape
    kernel = takes_triton(fused_memory_evict, cand_pos)
    at_once = max(1, pairs // (B * Hkv * (C + 1 if kernel else max((M + block) ** 2, C + 1))))
    device = cand_pos.device
    rank, evict = (fused_memory_ranks if kernel else candidate_ranks)(cand_pos, cand_score, num_sinks)
    K, n_blocks = min(M, C), -(-upto // block)
    for first in range(0, n_blocks, at_once):
        # (masked_fill with a number where torch.where would first make the number a tensor: one launch fewer)
        e0 = torch.arange(first * block, min(first + at_once, n_blocks) * block, block, device=device).view(-1, 1)
        # the top set before each block: the K highest ranks among the candidates before its first (none: column C)
        later = torch.arange(C + 1, device=device) >= e0  # [n, C + 1]
        top_rank, top = rank.unsqueeze(2).masked_fill(later, -1).topk(K, dim=-1)  # [B, Hkv, n, K]
        if kernel:  # which takes a slot of rank -1, or of the block or later, as empty
            fused_memory_evict(rank, top, evict, first * block, block, upto, M)
            continue
        top = top.masked_fill_(top_rank < 0, C)
        new = e0 + torch.arange(block, device=device)
        # [B, Hkv, n, K + block]: each block's top set, then the block
        cand = torch.cat([top, torch.where(new < upto, new, C).expand(B, Hkv, -1, -1)], -1)
        r = rank.gather(-1, cand.flatten(2)).view(cand.shape)
        beats = (r.unsqueeze(-1) > r.unsqueeze(-2)) & (r.unsqueeze(-1) >= 0)  # [..., d, c]: d ranks above c
        # above[e, c]: how many of (top set, block up to e) rank above c. Exact for the top set; for a block member
        # the candidates before the block that rank above it are either in the top set or ranked below all of it,
        # in which case the full top set ranks above it already: >= M either way.
        above = (beats[..., :K, :].sum(-2, keepdim=True, dtype=torch.int32)
                 + beats[..., K:, :].cumsum(-2, dtype=torch.int32))
        out = above >= M
        # a candidate leaves in the one block where it drops out of the top set, no earlier than it enters
        at = torch.maximum(e0 + out.to(torch.uint8).argmax(-2), cand)
        evict.scatter_(-1, torch.where(out.any(-2) & (r >= 0), cand, C).flatten(2), at.flatten(2))
    return evict[..., :C]


def memory_seen(evict, last):
    """[B, Hkv, len(last), C] bool: which candidates are in the memory of the queries whose last eligible candidate
    index is ``last`` (:func:`memory_visibility`)."""
    index = torch.arange(evict.shape[-1], device=evict.device)
    last = last.view(-1, 1)
    return (index <= last) & (last < evict.unsqueeze(-2))


def _memory_lists(evict, last, T, nblk, Q, width=None):
    """Per block of Q queries (T in all), the candidates some query of the block sees: at most M + Q of them (the
    block starts with at most M and each query adds at most the one token leaving its window). Returns their indices
    [B, n, Hkv, K] in the candidates and [n] how many of the K the block needs at most (over rows and heads). Without
    ``width``: K is the most any block needs (read back from the device), the seen ones first in candidate order;
    with it (M + Q, a launch-bound device, where that read would wait for every launch before it): K = width, the
    seen ones first in any order; on a GPU one Triton launch (``fused_memory_lists``, kernels/memory/lists.py), of
    which this code is the reference."""
    if width is not None and takes_triton(fused_memory_lists, evict):
        return fused_memory_lists(evict, last, T, nblk, Q, width)
    B, Hkv, C = evict.shape
    last = last[:T]
    # the block's queries have last indices lo..hi (last grows with the query): a candidate in the memory at any
    # index in between is in the block's set, a superset of what its real queries see
    lo, hi = last[::Q], last[(torch.arange(nblk, device=last.device) * Q + Q - 1).clamp(max=T - 1)]
    index = torch.arange(C, device=evict.device)
    seen = (index <= hi.view(-1, 1, 1)) & (evict.unsqueeze(1) > lo.view(-1, 1, 1))  # [B, n, Hkv, C]
    counts = seen.sum(-1).amax((0, 2))  # [n]: the most candidates a block sees (over rows and kv heads)
    if width is not None:  # a top-K keeps K indices per list where a sort returns all C (int64: 8 bytes per candidate)
        return torch.topk(seen.to(torch.uint8), max(1, min(C, width)), dim=-1).indices, counts  # the seen ones first
    K = max(1, min(C, int(counts.max())))
    return torch.sort((~seen).to(torch.uint8), dim=-1, stable=True).indices[..., :K], counts


def _memory_blocks(evict, last, T, nblk, Q):
    """:func:`_memory_lists` as rows [B, n, Hkv, K] of the candidates as rows [B * Hkv * C], with visible
    [B, n, Hkv, Q, K] (padding queries: whatever their position gives) and the counts."""
    B, Hkv, C = evict.shape
    idx, counts = _memory_lists(evict, last, T, nblk, Q)
    K = idx.shape[-1]
    # candidates move as whole rows: index_select copies rows, far faster than a gather
    rows = idx + torch.arange(0, B * Hkv * C, C, device=idx.device).view(B, 1, Hkv, 1)
    q_last = F.pad(last[:T], (0, nblk * Q - T), value=-1).view(nblk, 1, Q, 1)
    ends = evict.reshape(-1).index_select(0, rows.flatten()).view(B, nblk, Hkv, 1, K)
    return rows, (idx.unsqueeze(3) <= q_last) & (q_last < ends), counts


def _block_groups(counts, fixed):
    """Runs of consecutive query blocks, as (first, end, width): a run's blocks read ``fixed`` keys each (window and
    sinks) plus its most memory candidates (``width``). A run ends before a block that needs more than sqrt(2)
    times the keys of the run's first. Blocks need more as the memory fills (one candidate more per token until it
    holds M, then M + what enters), so runs are few (4 for 1,000 tokens at W = 64, M = 448) and each block reads
    about the keys it needs instead of the widest block's."""
    groups, first = [], 0
    for n in range(1, len(counts) + 1):
        if n == len(counts) or fixed + counts[n] > math.sqrt(2) * (fixed + counts[first]):
            groups.append((first, n, max(1, *counts[first:n])))
            first = n
    return groups


# ----------------------------------------------------------------------------------------------------------------
# The Aaren mixer
# ----------------------------------------------------------------------------------------------------------------


class AarenMixer(nn.Module):
    """Replaces softmax attention. Per head h and slot j a learned query c_hj scores every key; the Aaren scan turns
    the scores into a running softmax-weighted mean of the values (paper form: one slot, no decay, no window).

    Options (config): query slots mixed by softmax_j(<q_proj(x)_h, c_hj>); per-token log-decay on the state;
    a sliding-window softmax branch with sinks, gated per head. Keys and values keep the teacher's grouping (GQA).
    """

    # Parameters with no counterpart in a softmax-attention teacher: what a conversion initialises and trains anew.
    NEW_PARAMETERS = ("queries", "log_decay", "decay_proj", "window_gate", "gate_proj", "retention_proj")

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.num_slots = config.num_query_slots
        self.decay = config.decay
        # window branch of this layer: a "sliding_attention" layer may have the teacher's own local window
        self.window, self.num_sinks, self.memory_size = config.layer_window(layer_idx)
        self.chunk_size = config.chunk_size
        self.scale = config.attention_scale
        H, Hkv, D, E = self.num_heads, self.num_kv_heads, self.head_dim, config.hidden_size

        if config.layer_uses_query_projection(layer_idx):
            self.q_proj = nn.Linear(E, H * D, bias=config.attention_bias)
        self.k_proj = nn.Linear(E, Hkv * D, bias=config.attention_bias)
        self.v_proj = nn.Linear(E, Hkv * D, bias=config.attention_bias)
        self.o_proj = nn.Linear(H * D, E, bias=config.attention_out_bias)
        self.qk_norm = config.qk_norm  # (a flag, not hasattr: a missing module costs an exception every call)
        if config.qk_norm:
            self.q_norm = AarenRMSNorm(D, eps=config.rms_norm_eps, unit_offset=config.rms_norm_unit_offset)
            self.k_norm = AarenRMSNorm(D, eps=config.rms_norm_eps, unit_offset=config.rms_norm_unit_offset)
        self.aaren_branch = config.layer_type(layer_idx) == "linear_attention"
        if self.aaren_branch:
            self.build_aaren_branch(config)
        if self.window > 0:
            inv_freq = torch.zeros(config.rotary_dim // 2, dtype=torch.float32)  # float32 in a 16-bit model too
            self.register_buffer("rope_inv_freq", inv_freq, persistent=True)
        self.memory_rule = config.memory_rule
        self.memory_shared_layer = config.memory_shared_layer
        self.memory_recency = config.memory_recency
        self.kv_cache_dtype = getattr(torch, config.kv_cache_dtype) if config.kv_cache_dtype else None
        self.memory_codes = MemoryCodes.of(config) if self.memory_size > 0 else None  # None: stored as the window
        if self.memory_size > 0 and self.memory_rule == "learned":
            self.retention_proj = nn.Linear(E, Hkv, bias=True)

    def _apply(self, fn, recurse=True):
        # a cast of the model (.to(torch.bfloat16), .half()) keeps the rotary frequencies in float32, as loading with
        # from_pretrained(dtype=...) does: rounded to bfloat16, a frequency is off by up to 2^-9 radian per position
        # (SmolLM2's: 1/720): a key 1,000 positions back turns by up to 1.4 radians more or less than it was trained to
        inv_freq = getattr(self, "rope_inv_freq", None)
        super()._apply(fn, recurse)
        if inv_freq is not None and self.rope_inv_freq.dtype != inv_freq.dtype:
            self.rope_inv_freq = inv_freq.to(self.rope_inv_freq.device)
        return self

    @torch.no_grad()
    def init_new_parameters(self, config):
        """How each of :attr:`NEW_PARAMETERS` starts (the conversion overwrites most of them from the teacher's
        statistics); ``rope_inv_freq`` is a buffer, reset with them."""
        starts = {
            "queries": lambda m: init.normal_(m, mean=0.0, std=1.0),
            "log_decay": lambda m: init.constant_(m, math.log(config.decay_init)),
            "decay_proj": lambda m: (init.zeros_(m.weight), init.zeros_(m.bias)),
            "window_gate": lambda m: init.constant_(m, config.window_gate_init),
            "gate_proj": lambda m: (init.zeros_(m.weight), init.constant_(m.bias, config.window_gate_init)),
            "retention_proj": lambda m: (init.zeros_(m.weight), init.zeros_(m.bias)),
        }
        for name in self.NEW_PARAMETERS:
            if hasattr(self, name):
                starts[name](getattr(self, name))
        if hasattr(self, "rope_inv_freq"):
            init.copy_(self.rope_inv_freq, self.default_inv_freq(config))

    def build_aaren_branch(self, config):
        H, D, J, E = self.num_heads, self.head_dim, self.num_slots, config.hidden_size
        self.queries = nn.Parameter(torch.zeros(H, J, D))
        if self.decay != "none":
            # decay rate per head and slot: g = -exp(log_decay) per token (times an input factor in "input" mode)
            self.log_decay = nn.Parameter(torch.zeros(H, J), requires_grad=self.decay != "fixed")
        if self.decay == "input":
            self.decay_proj = nn.Linear(E, H * J, bias=True)
        if self.window > 0:
            if config.window_gate == "head":
                self.window_gate = nn.Parameter(torch.zeros(H))
            else:
                self.gate_proj = nn.Linear(E, H, bias=True)

    def default_inv_freq(self, config):
        rot = config.rotary_dim
        theta = config.layer_rope_theta(self.layer_idx)
        return 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))

    def log_decay_per_token(self, x):
        """g [B, T, H*J] <= 0."""
        rate = self.log_decay.float().exp().reshape(-1)
        if self.decay == "input":
            # softplus(0) / log 2 = 1: at initialisation (zero projection) the rate is exactly exp(log_decay)
            return -rate * F.softplus(self.decay_proj(x).float()) / math.log(2.0)
        return (-rate).expand(*x.shape[:2], -1)

    def forward(self, x, mask, pos, state: Optional[AarenLayerState] = None, shared: Optional[dict] = None):
        """x [B, T, E]; mask [B, T] bool (False: padding); pos [B, T] positions (-1 for padding).

        With ``state`` the layer continues from it and leaves the updated state there. ``shared``: what the layers
        of one pass over these tokens hand on to later ones (the retention score of ``memory_shared_layer``).
        """
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q, k, v = self.project(x)
        step = self.steps_one_token(state, T)
        if takes_c(mixer_step_cpu if step else mixer_prefill_cpu, x) and (
                step or (self.window > 0 and not torch.is_grad_enabled())):
            # with the aaren_hf package: the rest of this method for a decode token, or for a prompt without
            # gradients in a layer with a window, in one C call (kernels/mixer), the same state and output to float
            # rounding; the code below is its reference
            o = self.in_c(x, q, k, v, mask, pos, state, shared, step)
            if o is not None:
                return self.o_proj(o.to(x.dtype).reshape(B, T, H * D))

        s = None
        if self.aaren_branch:
            o, s = self.aaren_output(x, q, k, v, mask, state)
        if self.window > 0:
            retention = self.retention_score(x, s, pos) if self.memory_size > 0 else None
            mix = None
            if self.aaren_branch:
                mix = o, self.window_gate if hasattr(self, "window_gate") else self.gate_proj(x)
            o = self.window_branch(q, k, v, pos, state, retention, shared, mix)
        return self.o_proj(o.to(x.dtype).reshape(B, T, H * D))

    def keys(self, x):
        """Per-head keys [B, T, Hkv, D] of the input x [B, T, E], before rotary (q/k norm applied): what the Aaren
        scores and the retention rules read."""
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        return self.k_norm(k) if self.qk_norm else k

    def project(self, x):
        """(q [B, T, H, D] or None without q_proj, k [B, T, Hkv, D], v [B, T, Hkv, D]) of x [B, T, E], before rotary
        (the window branch rotates q and k at their positions)."""
        B, T, _ = x.shape
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q = None
        if hasattr(self, "q_proj"):
            q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
            q = self.q_norm(q) if self.qk_norm else q
        return q, self.keys(x), v

    def aaren_output(self, x, q, k, v, mask, state):
        """(The Aaren branch [B, T, H, D], its masked slot scores s [B, T, H*J]): per head and slot the running
        softmax(s)-weighted mean of the values (the scan), slots mixed by the real query."""
        B, T, Hkv, D = v.shape
        H, J = self.num_heads, self.num_slots
        carried = None
        if state is not None and state.aaren_o is not None:
            carried = (state.aaren_o, state.aaren_lse)
        decoding = T == 1 and carried is not None and not torch.is_grad_enabled()
        if decoding and takes_triton(fused_aaren_step, v):
            # the whole branch below in one launch, the state written in place
            stepped = fused_aaren_step(q, k, v, mask, state, self.queries, getattr(self, "log_decay", None),
                                       self.decay_proj(x) if self.decay == "input" else None, self.scale)
            if stepped is not None:
                return stepped
        per_op_head = launch_bound(v.device)  # the Triton kernels (or, without them, the PyTorch op) per op head
        decoding_on_cpu = not per_op_head and decoding
        if not decoding_on_cpu and takes_c(aaren_prefill_cpu, v):
            # with the aaren_hf package, a prompt without gradients on a CPU: the rest of this method in one C call,
            # token after token (kernels/aaren/step.c), the same state and output to float rounding
            got = aaren_prefill_cpu(q, k, v, mask, self.queries, self.scale, self.decay,
                                    getattr(self, "log_decay", None),
                                    self.decay_proj(x) if self.decay == "input" else None, carried, state is not None)
            if got is not None:
                o, s, final = got
                if state is not None:
                    state.aaren_o, state.aaren_lse = final
                return o, s
        s, mix, g = self.scan_inputs(x, q, k, mask)
        if not per_op_head and not decoding_on_cpu:
            # slots mixed, each kv head's values read once for its query heads: the chunked PyTorch scan
            if mix is None:
                mix = v.new_ones(B, T, H, 1, dtype=torch.float32)
            o, final = chunk_aaren_mixed(s, v, mix, g, carried, state is not None, chunk_size=self.chunk_size)
        elif mix is not None and T > 1 and takes_triton(fused_chunk_aaren_mixed, v):
            # the Triton scan per op head, the slots mixed as below by its op, whose backward forms the mix's
            # gradient: training keeps no per-slot outputs (J times the mixed output's bytes)
            o, final = fused_chunk_aaren_mixed(s, v, mix, g, carried, state is not None, self.chunk_size)
        else:
            if not per_op_head:
                # decoding on the CPU, where a step costs its number of ops: the scan's step applied to the state,
                # each kv head broadcast over its query heads and slots rather than copied to them
                heads = (B, Hkv, -1)
                o, (o_state, lse) = aaren_step((carried[0].view(*heads, D), carried[1].view(heads)), s.view(heads),
                                               v.view(B, Hkv, 1, D), None if g is None else g.view(heads))
                o, final = o.to(v.dtype), (o_state.view(B, H * J, D), lse.view(B, H * J))
            else:  # the Triton kernels, one op head per (query head, slot), each reading its kv head's values
                if T == 1 and state is not None:
                    o, final = fused_recurrent_aaren(s, v, g, carried, True)
                else:
                    o, final = chunk_aaren(s, v, g, carried, state is not None, chunk_size=self.chunk_size)
            o = o.view(B, T, H, J, D)
            # one product per query head over its J slots, in the outputs' dtype (float32 sums inside): a float32
            # copy of the J outputs would be the largest tensor the branch keeps for backward
            o = o.squeeze(3) if mix is None else torch.matmul(mix.to(o.dtype).unsqueeze(-2), o).squeeze(-2)
        if state is not None and decoding:
            state.write(aaren_o=final[0], aaren_lse=final[1])
        elif state is not None:
            state.aaren_o, state.aaren_lse = final
        return o, s

    def scan_inputs(self, x, q, k, mask):
        """What the scan reads: (the slot scores s [B, T, H*J] float32 of keys k [B, T, Hkv, D], -inf where mask
        [B, T] is False; the slots' mix [B, T, H, J] float32, how much each query head of q [B, T, H, D] reads of its
        slots, None with one slot; the log-decay per token g [B, T, H*J] float32, 0 at padding, None without decay).
        On a GPU one Triton launch, its backward another (``fused_scan_inputs``, kernels/aaren/scores.py); the code
        below is its reference."""
        J = self.num_slots
        log_decay = getattr(self, "log_decay", None)
        if takes_triton(fused_scan_inputs, k):
            got = fused_scan_inputs(q, k, self.queries, mask, log_decay,
                                    self.decay_proj(x) if self.decay == "input" else None, self.scale)
            if got is not None:
                return got
        padding = ~mask.unsqueeze(-1)
        s = self.slot_scores(k).masked_fill(padding, float("-inf"))
        mix = None
        if J > 1:
            mix = float32_product(q.transpose(1, 2), self.queries.transpose(1, 2)).transpose(1, 2)
            mix = torch.softmax(mix * self.scale, -1)
        g = None
        if self.decay != "none":
            g = self.log_decay_per_token(x).masked_fill(padding, 0.0)
        return s, mix, g

    def slot_scores(self, k):
        """Aaren scores <k_t, c_hj> / sqrt(D) [B, T, H*J] float32 of keys k [B, T, Hkv, D]; op heads are (kv head,
        query head in its group, slot), so query head h reads kv head h // G."""
        B, T, Hkv, D = k.shape
        c = self.queries.view(Hkv, -1, D)
        s = float32_product(k.transpose(1, 2), c.transpose(1, 2))  # [B, Hkv, T, G * J]
        return s.transpose(1, 2).reshape(B, T, -1) * self.scale

    def retention_score(self, x, aaren_scores, pos):
        """[B, T, Hkv]: how much each token deserves a place in the memory once it leaves the window, as computed
        (in the projection's dtype, or float32); the memory ranks by :meth:`ranking_score` of it."""
        if self.memory_rule == "learned":
            return self.learned_retention(x, pos).detach()
        B, T = x.shape[:2]
        return aaren_scores.view(B, T, self.num_kv_heads, -1).amax(-1).detach()

    def learned_retention(self, x, pos):
        """``retention_proj``'s score [B, T, Hkv], plus ``memory_recency`` x the token's position (float32, where
        positions far into a stream stay exact to the 1/64 grid)."""
        score = self.retention_proj(x)
        if self.memory_recency:
            score = score.float() + self.memory_recency * pos.unsqueeze(-1).float()
        return score

    def ranking_score(self, score, shared: Optional[dict]):
        """The score [B, T, Hkv] the memory ranks tokens by: ``score`` (:meth:`retention_score`) on a grid of 1/64,
        and in the layers after ``memory_shared_layer`` the larger of that and the best (over KV heads) of layer
        ``memory_shared_layer``, which leaves it in ``shared``. The grid: the same token gets scores that differ in
        the last bits between a parallel pass and a decode step (other matmul shapes), and an exact tie broken one
        way in one and the other way in the other would make the two paths keep different tokens. On the grid ties
        are real (the maximum of two scores on it is on it too) and go to the newer token. The decode step's kernels
        (C and Triton) do the same from the score itself, with :meth:`sharing`'s arguments."""
        score = round_retention(score)
        L = self.memory_shared_layer
        if L is None or shared is None or self.layer_idx < L:
            return score
        if self.layer_idx == L:
            shared["retention"] = score.amax(-1, keepdim=True)
            return score
        return torch.maximum(score, shared["retention"])  # the config guarantees layer L has a memory

    def sharing(self, shared: Optional[dict], x):
        """How a kernel shares the ranking score (:meth:`ranking_score`): (0, None) not at all; (1, a new float32
        [B, T, 1], already left in ``shared``, that the kernel fills with this layer's best over KV heads: where the
        kernel declines, the path that runs instead writes ``shared`` through :meth:`ranking_score`); (2, the best of
        layer ``memory_shared_layer``, which this layer ranks by beside its own)."""
        L = self.memory_shared_layer
        if self.memory_size == 0 or L is None or shared is None or self.layer_idx < L:
            return 0, None
        if self.layer_idx == L:
            shared["retention"] = x.new_empty(*x.shape[:2], 1, dtype=torch.float32)
            return 1, shared["retention"]
        return 2, shared["retention"]

    def window_branch(self, q, k, v, pos, state, retention=None, shared: Optional[dict] = None, mix=None):
        """The window branch's output [B, T, H, D] (window, sinks, memory), leaving the next state in ``state``;
        with ``mix`` (the Aaren branch's output, the gate logits) the layer's: the two branches mixed by
        :func:`mix_branches` (here, so that a decode step's kernel can mix them in its own launch, and training's
        window kernel in its Function). ``retention``: :meth:`retention_score`'s, ranked (:meth:`ranking_score`) here
        or in the step's kernel."""
        B, T, Hkv, D = k.shape
        if self.steps_one_token(state, T):
            return self.window_step(q, k, v, pos, state, retention, shared, mix)
        if retention is not None:
            retention = self.ranking_score(retention, shared)
        rotary = self.rotary(pos, shared)
        stored = self.kv_cache_dtype or k.dtype
        S = self.num_sinks
        if state is not None and state.window_k is not None:
            k_prev, v_prev, pos_prev = state.window_k, state.window_v, state.window_pos
            sink_k, sink_v, sink_pos = state.sink_k, state.sink_v, state.sink_pos
        else:
            k_prev = k.new_zeros(B, 0, Hkv, D, dtype=stored)
            v_prev = v.new_zeros(B, 0, Hkv, D, dtype=stored)
            pos_prev = pos.new_zeros(B, 0)
            sink_k, sink_v = k.new_zeros(B, S, Hkv, D, dtype=stored), v.new_zeros(B, S, Hkv, D, dtype=stored)
            sink_pos = pos.new_full((B, S), -1)
        prefilled = None
        if takes_c(window_prefill_cpu, k):
            # with the aaren_hf package, on a CPU without gradients: the rotation, the rounding, the sinks and the
            # window's next state below in one C call (kernels/window/prefill.c), the same bits; the code below is
            # its reference
            prefilled = window_prefill_cpu(k, v, pos, rotary.angles(), k_prev, v_prev, pos_prev,
                                           (sink_k, sink_v, sink_pos), self.window, stored, state is not None,
                                           None if state is None else state.window_score, retention)
        if prefilled is not None:
            k, v, (sink_k, sink_v, sink_pos), window = prefilled
        else:
            # every path (training, prefill, decoding) computes on the keys/values as the cache stores them
            k = rotary.rotate(k)
            k, v = round_to_cache(k, self.kv_cache_dtype), round_to_cache(v, self.kv_cache_dtype)
            if S > 0:
                sink_k, sink_v, sink_pos = fill_sinks(k, v, pos, sink_k, sink_v, sink_pos)
        memory = None
        if self.memory_size > 0:
            memory, candidates = self.memory_candidates(k, v, pos, retention, k_prev, v_prev, pos_prev, state,
                                                        _attention_dtype(q))
        out = window_attention(q, k, v, pos, k_prev, v_prev, pos_prev, sink_k, sink_v, sink_pos, self.window, rotary,
                               self.scale, memory, mix)
        if state is not None:
            if prefilled is None:
                window = next_window(k_prev, v_prev, pos_prev, k, v, pos, self.window,
                                     None if memory is None else candidates["stream_score"])
            state.window_k, state.window_v, state.window_pos = window["k"], window["v"], window["pos"]
            state.sink_k, state.sink_v, state.sink_pos = sink_k.detach(), sink_v.detach(), sink_pos
            if memory is not None:
                state.window_score = window["score"]
                self.keep_memory(state, candidates, stored)
        return out

    def steps_one_token(self, state, T):
        """Whether this call is a decode step: one token, no gradient (inference), and a carried state (the general
        path leaves the window at W - 1 entries from its first call on); then :meth:`window_step` serves the window
        branch and :meth:`in_c` may serve the whole call."""
        return (T == 1 and state is not None and not torch.is_grad_enabled()
                and (not self.aaren_branch or state.aaren_o is not None)
                and (self.window == 0 or (self.window > 1 and state.window_k is not None)))

    def in_c(self, x, q, k, v, mask, pos, state, shared, step: bool):
        """:meth:`forward` between the projections and ``o_proj`` as one C call: a decode step (``mixer_step_cpu``)
        or a prompt (``mixer_prefill_cpu``); None where the kernel does not apply."""
        if not step and q is None:
            return None
        B, T = x.shape[:2]
        M, S = self.memory_size, self.num_sinks
        share, shared_retention = self.sharing(shared, x)
        gate = None
        if self.aaren_branch and self.window > 0:
            gate = self.window_gate if hasattr(self, "window_gate") else self.gate_proj(x)
        codes = self.memory_codes
        args = dict(
            queries=self.queries if self.aaren_branch else None, log_decay=getattr(self, "log_decay", None),
            decay_in=self.decay_proj(x) if self.decay == "input" else None, decay=self.decay, window=self.window,
            sinks=S, memory_size=M, bits=codes and codes.bits, rotate=bool(codes and codes.rotate),
            retention=self.learned_retention(x, pos) if M > 0 and self.memory_rule == "learned" else None,
            rule=self.memory_rule, share=share, shared_retention=shared_retention, gate=gate, scale=self.scale)
        if step:
            angles, sink_turn = self.step_angles(pos, shared) if self.window > 0 else (None, None)
            out = mixer_step_cpu(q, k, v, pos, mask, state, angles=angles, sink_turn=sink_turn, **args)
        else:
            rotary = self.rotary(pos, shared)
            out = mixer_prefill_cpu(q, k, v, pos, mask, state, angles=rotary.angles(),
                                    back_angles=rotary.back_angles(B, S + self.window) if S else None,
                                    stored=self.kv_cache_dtype or k.dtype, pool=shared, **args)
        return out

    def window_step(self, q, k, v, pos, state, retention=None, shared: Optional[dict] = None, mix=None):
        """:meth:`window_branch` for one token once the window is full (decoding), in far fewer ops: one fused
        attention over [window, token, sinks, memory], the window shifted by one, and the entry leaving it offered to
        the memory. Same outputs (to float rounding) and the same state as the general path, which the tests check
        against this one. On a CPU with the aaren_hf package installed, ``kernels/window/step.c`` does all of it
        inside :meth:`in_c`'s one call, with this method as its reference; on a GPU, one Triton launch
        (``kernels/window/fused_recurrent.py``) with the state written in place."""
        B, _, Hkv, D = k.shape
        H, W, S, M = self.num_heads, self.window, self.num_sinks, self.memory_size
        (cos, sin), sink_angles = self.step_angles(pos, shared)
        if takes_triton(fused_window_step, q):
            codes = self.memory_codes
            share = self.sharing(shared, q)
            out = fused_window_step(q, k, v, pos, (cos, sin), sink_angles, state, retention, share, W, S, M,
                                    codes and codes.bits, bool(codes and codes.rotate), self.kv_cache_dtype,
                                    self.scale, mix)
            if out is not None:
                return out
        if retention is not None:
            retention = self.ranking_score(retention, shared)
        p = pos[:, 0]
        stored = state.window_k.dtype
        qk = rotate_by(torch.cat([q, k], 2), cos, sin)  # q and k at the token's position
        k = to_cache(qk[:, :, H:], self.kv_cache_dtype).to(stored)
        v = to_cache(v, self.kv_cache_dtype).to(stored)
        win_k, win_v = torch.cat([state.window_k, k], 1), torch.cat([state.window_v, v], 1)  # [B, W, Hkv, D]
        win_pos = torch.cat([state.window_pos, pos], 1)
        sink_k, sink_v, sink_pos = state.sink_k, state.sink_v, state.sink_pos
        seen_sink_pos = sink_pos
        if S > 0:
            # A token so early (after left padding) that it fills a sink slot or still has the sinks in its window;
            # for every other token these leave the sinks as they are. Never asked on the host: a step that waits
            # for the device cannot be captured (CUDA graphs) and stalls the launches behind it.
            is_sink = torch.arange(S, device=p.device) == p.unsqueeze(1)  # [B, S]
            sink_k = torch.where(is_sink.view(B, S, 1, 1), k, sink_k)
            sink_v = torch.where(is_sink.view(B, S, 1, 1), v, sink_v)
            sink_pos = torch.where(is_sink, p.unsqueeze(1), sink_pos)
            seen_sink_pos = sink_pos.masked_fill(sink_pos > p.unsqueeze(1) - W, -1)  # still inside the window
        # Visible: every key with a position >= 0 (-1: padding, an empty slot). Every memory entry is among the M
        # best of the tokens that have left the window, as the query needs.
        turned_sink_k = sink_k.transpose(1, 2).float()
        if S > 0:
            # a sink is seen from min(p, S + W - 1): <R(that) q, k> = <R(p) q, R(p - that) k>, so one query serves
            # every key once the sink keys are turned on by p - min(p, S + W - 1)
            turned_sink_k = rotate_by(turned_sink_k, *sink_angles)
        keys = torch.cat([win_k.transpose(1, 2).float(), turned_sink_k], 2)  # [B, Hkv, W + S, D]
        values = torch.cat([win_v, sink_v], 1).transpose(1, 2).float()
        query = qk[:, 0, :H].float().view(B, Hkv, H // Hkv, D)  # each kv head's G query heads as G query rows
        key_pos = torch.cat([win_pos, seen_sink_pos], 1).unsqueeze(1).expand(B, Hkv, W + S)
        # With rotated codes the step attends in their basis: the memory holds hadamard(x) = x S / D, S S = D I, so
        # <q S, k S / D> = <q, k> and a weighted sum of the rotated values turns back as one vector. That turns the
        # W + S window and sink entries instead of the 2 M memory ones.
        turned = M > 0 and self.memory_codes is not None and self.memory_codes.rotate
        if turned:
            turn = self.memory_codes.turn
            keys, values, query = turn(keys) / D, turn(values) / D, turn(query)
        if M > 0:
            memory_k, memory_v = self.memory_entries(state, rotated=turned)
            keys = torch.cat([keys, memory_k.float()], 2)
            values = torch.cat([values, memory_v.float()], 2)
            key_pos = torch.cat([key_pos, state.memory_pos], 2)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=(key_pos >= 0).unsqueeze(2),
                                             scale=self.scale)
        if turned:
            out = turn(out)
        out = out.reshape(B, 1, H, D)  # not view: CUDA's fused kernels return [B, Hkv, G, D] strided as [B, G, Hkv, D]
        out = out.masked_fill((p < 0).view(B, 1, 1, 1), 0.0)  # a padding token sees nothing

        if M > 0:
            self.offer_to_memory(state, stored)
            state.write(window_score=torch.cat([state.window_score, retention], 1)[:, 1:])
        state.write(window_k=win_k[:, 1:], window_v=win_v[:, 1:], window_pos=win_pos[:, 1:], sink_k=sink_k,
                    sink_v=sink_v, sink_pos=sink_pos)
        return mix_branches(out.to(q.dtype), mix)

    def rotary(self, pos, shared: Optional[dict]) -> Rotary:
        """The :class:`Rotary` of this piece's positions for the window branch: one per pass for every layer with the
        same frequencies (``shared``), in training too, where ``_Rotate`` keeps one set of angles for all of them;
        per layer while torch.compile traces, or where the frequencies cannot be compared (the meta device, inference
        tensors). The comparison is asked of the device once per version of the buffers (``_same_values``): once in
        all, or once a step for each layer under a data-parallel wrapper that broadcasts buffers every step (DDP's
        default; they never change, so ``broadcast_buffers=False`` spares those reads)."""
        sharing = shared is not None and not _compiling()
        known = shared.setdefault("rotary", []) if sharing else []
        for rotary in known:
            if _same_values(rotary.inv_freq, self.rope_inv_freq):
                return rotary
        known.append(Rotary(pos, self.rope_inv_freq))
        return known[-1]

    def step_angles(self, pos, shared: Optional[dict]):
        """((cos, sin) at the token's position, (cos, sin) of the turn of the sink keys or None), each [B, 1, 1, rot],
        for :meth:`window_step` and :meth:`in_c`: the first as window_branch computes them, so that the key is
        stored bit for bit the same; once per pass for the layers that share them (:meth:`rotary`)."""
        rotary, S = self.rotary(pos, shared), self.num_sinks
        return (rotary.angles(), None) if S == 0 else rotary.with_turn_on(S + self.window - 1)

    def offer_to_memory(self, state, stored: torch.dtype):
        """The oldest window entry leaves the window (the step of :meth:`window_step`): it enters the memory if it
        ranks among the M best of the tokens that have left (memory_visibility's rule), i.e. if a slot is empty or
        it beats the weakest entry. It is newer than every entry, so it wins ties.

        It takes the weakest slot in place: a decode step writes one entry per row instead of moving the whole
        memory (which cost about as much as the rest of the step). So the step leaves the slots in no particular order,
        where keep_memory leaves them in candidate order; neither the rule (it ranks by score, then position) nor the
        attention depends on the order."""
        mem_pos, mem_score = state.memory_pos, state.memory_score  # [B, Hkv, M]
        B, Hkv, _ = mem_pos.shape
        low = mem_score.amin(-1)  # [B, Hkv], -inf while a slot is empty
        enters = (state.window_score[:, 0] >= low) & (state.window_pos[:, :1] >= self.num_sinks)
        # the weakest slot: lowest score, then oldest (an empty slot: score -inf). Every row writes there, the
        # leaving entry where it enters and the slot's own content where it does not, so that no step asks the host
        # which rows enter (that would wait for the device and keep the step out of a CUDA graph).
        weakest = mem_pos.masked_fill(mem_score != low.unsqueeze(-1), torch.iinfo(mem_pos.dtype).max).argmin(-1)
        entry = self.as_stored(state.window_k[:, 0], state.window_v[:, 0], stored)  # [B, Hkv, D]
        entry.update(pos=state.window_pos[:, :1].expand(B, Hkv), score=state.window_score[:, 0])
        for name, new in entry.items():
            slots = getattr(state, "memory_" + name)
            if not _takes_writes(slots):  # a state made under inference_mode, continued outside it (generate's no_grad)
                slots = slots.clone()
                setattr(state, "memory_" + name, slots)
            rest = (1,) * (slots.dim() - 3)
            slot = weakest.view(B, Hkv, 1, *rest).expand(B, Hkv, 1, *slots.shape[3:])
            kept = slots.gather(2, slot)
            slots.scatter_(2, slot, torch.where(enters.view(B, Hkv, 1, *rest), new.unsqueeze(2).to(slots.dtype), kept))

    def memory_candidates(self, k, v, pos, retention, k_prev, v_prev, pos_prev, state, attend):
        """The memory tier's candidates (memory held + window entries held + this call's tokens) and what each query
        sees of them (:func:`memory_visibility`). k is rotated; keys/values come back as [B, Hkv, C, D], with memory
        codes decoded in ``attend`` (what window attention reads them in)."""
        B, T, Hkv, D = k.shape
        M = self.memory_size
        prev_score = retention.new_zeros(B, 0, Hkv)
        if state is not None and state.window_score is not None:
            prev_score = state.window_score
        if takes_c(memory_prefill_cpu, k) and self.memory_codes is not None:
            # with the aaren_hf package, on a CPU without gradients: this method and the state keep_memory leaves in
            # one C call (kernels/memory/prefill.c), the same bits; the code below is its reference
            got = memory_prefill_cpu(k, v, pos, retention, k_prev, v_prev, pos_prev, prev_score, state, self.window,
                                     self.num_sinks, M, self.memory_codes.bits, self.memory_codes.rotate)
            if got is not None:
                cand_k, cand_v, evict, last, kept = got
                return (cand_k, cand_v, evict, last, M), {"stream_score": torch.cat([prev_score, retention], 1),
                                                          "kept": kept}
        # as the memory would store them: what a query reads of a token that has left the window
        stream_k, stream_v = after_held(k_prev, k).transpose(1, 2), after_held(v_prev, v).transpose(1, 2)
        coded = None
        if self.memory_codes is not None:
            # the codes kept too: keep_memory stores them as they are instead of coding the kept entries again
            (stream_k, stream_v), coded = self.memory_codes.round_with_codes(torch.stack([stream_k, stream_v]),
                                                                             attend)
        stream_pos = after_held(pos_prev, pos).unsqueeze(1).expand(B, Hkv, -1)
        stream_score = torch.cat([prev_score, retention], 1)
        if state is not None and state.memory_k is not None:
            memory_k, memory_v = self.memory_entries(state)
            cand_k = torch.cat([to_cache(memory_k, stream_k.dtype), stream_k], 2)
            cand_v = torch.cat([to_cache(memory_v, stream_v.dtype), stream_v], 2)
            cand_pos = torch.cat([state.memory_pos, stream_pos], 2)
            cand_score = torch.cat([state.memory_score, stream_score.transpose(1, 2)], 2)
            held = M
            if coded is not None:  # the memory's codes, then the stream's (coding a decoded entry gives its codes)
                codes, scales = coded
                coded = (torch.cat([torch.stack([state.memory_k, state.memory_v]), codes], 3),
                         torch.cat([torch.stack([state.memory_k_scale, state.memory_v_scale]), scales], 3))
        else:
            cand_k, cand_v, cand_pos, cand_score, held = stream_k, stream_v, stream_pos, stream_score.transpose(1, 2), 0
        last, evict = memory_visibility(cand_pos, cand_score, held, self.window, self.num_sinks, M, T)
        # "next": the next query's last eligible candidate: the memory it sees is what the state keeps
        candidates = {"k": cand_k, "v": cand_v, "pos": cand_pos, "score": cand_score, "evict": evict,
                      "next": last[T:], "stream_score": stream_score}
        if coded is not None:
            candidates["codes"] = coded
        return (cand_k, cand_v, evict, last, M), candidates

    def keep_memory(self, state, candidates, stored: torch.dtype):
        """Store the top set for the next query in M fixed slots (empty slots: position -1), so the state has the
        same size from the first call on; keys and values in ``stored``. On a GPU two Triton launches
        (``fused_keep_memory``, kernels/memory/keep.py); the code below is their reference."""
        if "kept" in candidates:  # memory_candidates' C call left it
            for name, t in candidates["kept"].items():
                setattr(state, "memory_" + name, t)
            return
        evict, M = candidates.pop("evict"), self.memory_size
        B, Hkv, C = evict.shape
        coded = candidates.pop("codes", None)
        if coded is not None:  # the codes memory_candidates took (what as_stored would give again)
            D = candidates.pop("k").shape[-1]
            del candidates["v"]
            candidates.update(k=coded[0][0], v=coded[0][1], k_scale=coded[1][0], v_scale=coded[1][1])
        if takes_triton(fused_keep_memory, evict):
            kept = fused_keep_memory(evict, candidates["next"], M, candidates["k"], candidates["v"], candidates["pos"],
                                     candidates["score"], candidates.get("k_scale"), candidates.get("v_scale"),
                                     stored, 0 if coded is None or C >= M else self.memory_codes.empty_code(D))
            if kept is not None:
                for name, t in kept.items():
                    setattr(state, "memory_" + name, t)
                return
        keep = memory_seen(evict, candidates["next"])[:, :, 0]
        if C < M:  # fewer candidates than slots: pad with empty ones
            pad = M - C
            keep = F.pad(keep, (0, pad))
            empty = {"k": 0.0, "v": 0.0, "pos": -1, "score": float("-inf")}
            if coded is not None:  # an empty slot holds the codes of a zero vector, scale 0
                code = self.memory_codes.empty_code(D)
                empty.update(k=code, v=code, k_scale=0.0, v_scale=0.0)
            for name, value in empty.items():
                t = candidates[name]
                widths = (0, 0, 0, pad) if t.dim() == 4 else (0, pad)
                candidates[name] = F.pad(t, widths, value=value)
        idx = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :M]  # kept ones first
        if coded is None:
            candidates.update(self.as_stored(candidates.pop("k"), candidates.pop("v"), stored))
        self.fill_memory(state, candidates, idx)
        kept = keep.gather(2, idx)
        state.memory_pos = state.memory_pos.masked_fill(~kept, -1)
        state.memory_score = state.memory_score.masked_fill(~kept, float("-inf"))

    def as_stored(self, k, v, stored: torch.dtype) -> dict:
        """Keys and values [B, Hkv, C, D] as the memory stores them: {"k", "v"} in ``stored``, or with memory_bits
        their codes and {"k_scale", "v_scale"}."""
        if self.memory_codes is None:
            return {"k": k.detach().to(stored), "v": v.detach().to(stored)}
        codes, scale = self.memory_codes.encode(torch.stack([k.detach(), v.detach()]))  # one pass: decoding
        return {"k": codes[0], "v": codes[1], "k_scale": scale[0], "v_scale": scale[1]}

    def memory_entries(self, state, rotated: bool = False):
        """The memory's keys and values as a query reads them (float32 with memory_bits, else as stored);
        ``rotated``: as :meth:`MemoryCodes.decode` leaves them with ``rotated``."""
        if self.memory_codes is None:
            return state.memory_k, state.memory_v
        return (self.memory_codes.decode(state.memory_k, state.memory_k_scale, rotated),
                self.memory_codes.decode(state.memory_v, state.memory_v_scale, rotated))

    @staticmethod
    def fill_memory(state, candidates, idx):
        """Memory slot m of row (b, h) takes candidate idx[b, h, m]; keys and values (codes and scales) as
        :meth:`as_stored` gives them."""
        B, Hkv, M = idx.shape
        C = candidates["k"].shape[2]
        # keys and values move as whole rows of [B * Hkv * C, width]: index_select copies rows, far faster than a
        # gather
        rows = (idx + torch.arange(0, B * Hkv * C, C, device=idx.device).view(B, Hkv, 1)).flatten()
        for name in ("k", "v", "k_scale", "v_scale"):
            if name in candidates:
                t = candidates[name]
                setattr(state, "memory_" + name, t.reshape(B * Hkv * C, -1).index_select(0, rows).view(B, Hkv, M, -1))
        state.memory_pos = candidates["pos"].gather(2, idx)
        state.memory_score = candidates["score"].gather(2, idx)


# ----------------------------------------------------------------------------------------------------------------
# Decoder layer and model
# ----------------------------------------------------------------------------------------------------------------


class AarenDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + mixer(input_layernorm(x)), then + mlp(post_attention_layernorm(.)) (the pre-MLP norm,
    named as in Llama). ``parallel_residual`` (GPT-NeoX): both from x. ``post_norms`` (Gemma): each output is
    normalised again before it joins the residual stream."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.parallel_residual = config.parallel_residual
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.mixer = AarenMixer(config, layer_idx)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.mlp = AarenMLP(config)
        self.post_norms = config.post_norms
        if config.post_norms:
            self.post_mixer_layernorm = make_norm(config, config.hidden_size)
            self.post_mlp_layernorm = make_norm(config, config.hidden_size)

    def forward(self, hidden_states, mask, pos, state=None, shared=None):
        mixed = self.mixer(self.input_layernorm(hidden_states), mask, pos, state, shared)
        if self.parallel_residual:
            return hidden_states + mixed + self.mlp(self.post_attention_layernorm(hidden_states))
        if self.post_norms:
            mixed = self.post_mixer_layernorm(mixed)
        hidden_states = hidden_states + mixed
        out = self.mlp(self.post_attention_layernorm(hidden_states))
        if self.post_norms:
            out = self.post_mlp_layernorm(out)
        return hidden_states + out


class AarenPreTrainedModel(PreTrainedModel):
    config_class = AarenConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AarenDecoderLayer"]
    _is_stateful = True  # assisted decoding / prompt lookup need a cache that can be cropped: fail early

    def save_pretrained(self, save_directory, *args, **kwargs):
        # save_pretrained writes auto_map only for the class being saved; users also load with AutoModel.
        self.config.auto_map = {
            **(getattr(self.config, "auto_map", None) or {}),
            "AutoConfig": "configuration_aaren.AarenConfig",
            "AutoModel": "modeling_aaren.AarenModel",
            "AutoModelForCausalLM": "modeling_aaren.AarenForCausalLM",
        }
        return super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        # transformers only logs weights missing from a checkpoint and initialises them at random: the model would
        # load and generate garbage. Refuse instead. Asking for output_loading_info=True returns the info and lets
        # the caller accept a partial checkpoint on purpose. (Public API only: no private loading hook.)
        wants_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
            )
        except SafetensorError as err:
            raise OSError(
                f"Could not read the weights of {pretrained_model_name_or_path}: {err}. The safetensors file is "
                "corrupt or truncated: download or save it again."
            ) from err
        if wants_info:
            return model, info
        if info["missing_keys"]:
            raise ValueError(
                f"Weights missing from the checkpoint {pretrained_model_name_or_path}: "
                f"{sorted(info['missing_keys'])}. They would stay at random initial values. The checkpoint is "
                "incomplete or was written for another configuration; pass output_loading_info=True to load it "
                "anyway and inspect the returned loading info."
            )
        return model

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        config = self.config
        if isinstance(module, AarenMixer):
            module.init_new_parameters(config)
        elif isinstance(module, AarenRMSNorm):
            (init.zeros_ if module.unit_offset else init.ones_)(module.weight)


class AarenModel(AarenPreTrainedModel):
    def __init__(self, config: AarenConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([AarenDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = make_norm(config, config.hidden_size)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[AarenCache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        **kwargs,
    ):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if (input_ids.shape[-1] if inputs_embeds is None else inputs_embeds.shape[-2]) == 0:
            raise ValueError("The input is empty (0 tokens): give at least one token, e.g. the tokenizer's BOS token")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
            if self.config.embed_scale != 1.0:  # Gemma: sqrt(hidden_size), in the embedding's dtype
                inputs_embeds = inputs_embeds * torch.tensor(self.config.embed_scale, dtype=inputs_embeds.dtype)
        B, T = inputs_embeds.shape[:2]
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if use_cache and past_key_values is None:
            past_key_values = AarenCache(self.config)
        if past_key_values is not None and not isinstance(past_key_values, AarenCache):
            raise TypeError(
                f"past_key_values must be an AarenCache (the recurrent state), got {type(past_key_values).__name__}"
            )
        cache = past_key_values if use_cache else None

        # generate() passes a mask over past + current positions; keep the current ones.
        if attention_mask is None:
            mask = torch.ones(B, T, dtype=torch.bool, device=inputs_embeds.device)
        else:
            if attention_mask.dim() != 2:
                raise ValueError("attention_mask must be a 2D [batch, length] padding mask (1 = token, 0 = padding)")
            mask = attention_mask[:, -T:].to(device=inputs_embeds.device, dtype=torch.bool)
        pos, real_tokens = positions(mask, None if cache is None or cache.real_tokens is None
                                     else cache.real_tokens.to(mask.device))

        hidden_states = inputs_embeds
        if hasattr(self, "embed_positions"):
            limit = self.config.max_position_embeddings
            # every position is below the tokens fed so far (padding included): read pos back (on a GPU, a wait for
            # every launch before it) only when that bound reaches the table's end
            # (a compiled step cannot raise on a value: generate checks max_length for a static cache up front)
            if (not _compiling() and (0 if cache is None else cache.seen_tokens) + T > limit
                    and int(pos.max()) >= limit):
                raise ValueError(
                    f"Input reaches position {int(pos.max())}, but this model's learned position table holds "
                    f"{limit} positions (max_position_embeddings). Shorten the input or the generation length."
                )
            hidden_states = hidden_states + self.embed_positions(pos.clamp(min=0))

        # With a cache, a long prompt goes through the whole stack in pieces that carry the state: activations (and
        # the memory tier's ranking, quadratic in the piece) stay bounded by the piece, whatever the prompt length.
        step = prefill_piece(B, hidden_states.device) if cache is not None else T
        outputs, per_layer = [], [[] for _ in range(len(self.layers) + 1)]
        for start_t in range(0, T, max(step, 1)):
            piece = slice(start_t, start_t + step)
            h = hidden_states[:, piece]
            shared = {}  # handed from layer to layer within this pass (memory_shared_layer)
            for i, layer in enumerate(self.layers):
                per_layer[i].append(h)
                h = layer(h, mask[:, piece], pos[:, piece], None if cache is None else cache.layers[i], shared)
            outputs.append(self.norm(h))
            per_layer[-1].append(outputs[-1])
        hidden_states = outputs[0] if len(outputs) == 1 else torch.cat(outputs, 1)
        all_hidden = None
        if output_hidden_states:
            all_hidden = tuple(parts[0] if len(parts) == 1 else torch.cat(parts, 1) for parts in per_layer)
        if cache is not None:
            cache.count(T, hidden_states.device)
            if _compiling():  # in place, as the layers' states: the addresses a CUDA graph replays
                _write(cache, "real_tokens", real_tokens)
            else:
                cache.real_tokens = real_tokens
            if cache.is_compileable and not _compiling():
                cache.hold_still(hidden_states.device)
        out = BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=cache, hidden_states=all_hidden)
        return out if return_dict is not False else out.to_tuple()


class AarenForCausalLM(AarenPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: AarenConfig):
        super().__init__(config)
        self.model = AarenModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # a DynamicCache would grow with the context; forward makes an AarenCache instead

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            if generation_config.cache_implementation == "static":
                # the state at fixed addresses, and generate compiles the decode step (on a GPU by default)
                limit = self.config.max_position_embeddings
                if hasattr(self.model, "embed_positions") and generation_config.max_length > limit:
                    raise ValueError(
                        f"max_length={generation_config.max_length} passes this model's learned position table "
                        f"({limit} positions), which a compiled step cannot check: lower max_new_tokens."
                    )
                model_kwargs["past_key_values"] = AarenCache(self.config, static=True)
                return
            if generation_config.cache_implementation not in (None, "dynamic"):
                raise ValueError(
                    f"cache_implementation={generation_config.cache_implementation!r} does not apply to Aaren: its "
                    "cache is a fixed-size recurrent state. Leave cache_implementation unset, or 'static' to "
                    "compile the decode step."
                )
            model_kwargs["past_key_values"] = AarenCache(self.config)
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def create_masks_for_generate(self, inputs_embeds, attention_mask=None, **kwargs):
        """What generate passes as the mask with a compileable cache: the new tokens' columns of the 2D padding mask
        (all the model reads), one shape step after step where the whole mask grows by one column a step."""
        return None if attention_mask is None else attention_mask[:, -inputs_embeds.shape[1]:]

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[AarenCache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        logits_to_keep: int = 0,
        **kwargs,
    ):
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states
        )
        return out if return_dict is not False else out.to_tuple()


__all__ = ["AarenCache", "AarenForCausalLM", "AarenModel", "AarenPreTrainedModel", "AarenMixer"]
