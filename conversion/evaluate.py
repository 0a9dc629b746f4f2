# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Evaluation of a converted Aaren student against its teacher and a constant-memory StreamingLLM baseline.

Everything here runs on the SAME held-out windows (perplexity is setting-dependent: the same model gives very
different numbers with another window length or stride, so the window length, stride, token count and text source
are part of every result):

- :func:`perplexity`: token-weighted NLL over all predicted tokens, over the positions >= a threshold (the
  long-range part: tokens predicted with at least that much context), and by position bucket
  (:func:`position_buckets`: 0-W, W-4W, 4W-16W, ...). :func:`long_heldout_windows` cuts longer windows (2,048
  tokens) from the run's own held-out documents.
- :func:`streaming_llm_baseline`: the teacher itself, untrained, seeing only the first S tokens (attention sinks)
  and the last W tokens, as a StreamingLLM cache would (Xiao et al. 2023). Implemented as the teacher's ordinary
  forward with a custom 4D attention mask.
- :func:`equal_memory_window`: the baseline window W for which the teacher's KV cache (S + W - 1 tokens held
  between steps) equals the student's whole state (Aaren state + its window keys/values), so both are compared at
  the same memory.
- :class:`~aaren_hf.conversion.retention_baseline.RetentionBaseline` (in :mod:`.retention_baseline`): the teacher
  with sinks + window + tokens kept by TOVA's eviction rule, decoding with that bounded cache; at equal bytes it is
  the training-free bar for recall.
- :func:`recall_probe`: passkey retrieval over distance (exact match of greedy decoding, teacher-forced, trials
  batched), in held-out evaluation wordings that the recall training data (:mod:`.recall`) never uses.
- :func:`state_bytes_table`: the student's measured state bytes (constant) vs the teacher's KV cache (linear).
- :func:`sample_generations`: greedy continuations of a few prompts.
- :func:`evaluate` runs all of them; :func:`format_table` renders the results as Markdown.

All results are plain dicts/lists of str, int, float, bool and None (JSON-serialisable).
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from aaren_hf.modeling_aaren import MemoryCodes

from .recall import _ids

__all__ = [
    "StreamingLLMBaseline",
    "aaren_state_bytes",
    "equal_memory_window",
    "evaluate",
    "format_table",
    "long_heldout_windows",
    "perplexity",
    "position_buckets",
    "recall_probe",
    "sample_generations",
    "state_bytes_table",
    "streaming_llm_baseline",
    "streaming_llm_mask",
    "teacher_kv_bytes_per_token",
    "teacher_local_kv_bytes",
]

DEFAULT_RECALL_DISTANCES = (32, 128, 512, 2048)  # for a student without a window
DEFAULT_RECALL_MULTIPLES = (4, 16, 32)  # recall distances in multiples of the student's window
DEFAULT_PROMPTS = (
    "The capital of France is",
    "In Python, a list comprehension",
    "def fibonacci(n):",
)
GENERIC_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


# ----------------------------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------------------------


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _param_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _kv_dtype(model) -> torch.dtype:
    """The dtype ``model`` caches keys/values in: its ``config.kv_cache_dtype`` where set (an Aaren student storing
    them in 16 bits), else its parameters'. Equal-memory baselines are sized in the student's."""
    name = getattr(model.config, "kv_cache_dtype", None)
    return getattr(torch, name) if name else _param_dtype(model)


@contextlib.contextmanager
def _eval_mode(model):
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        yield model
    finally:
        if was_training:
            model.train()


# What a baseline's cache is counted in when the student's memory holds codes of that many bits (float4_e2m1fn_x2
# packs two elements into a byte)
CODED_COUNT = {8: torch.float8_e4m3fn, 4: torch.float4_e2m1fn_x2}
CODED_ATTENTION = "aaren_coded_sdpa"


def _register_coded_attention() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def coded_sdpa(module, query, key, value, attention_mask, kv_codes=None, kv_exact=None, **kwargs):
        """A baseline whose cache holds codes: every key and value (the current token's too, as it is read from the
        cache) through ``kv_codes`` (the student's memory quantizer), then transformers' SDPA attention. ``kv_exact`` = (sinks, recent):
        query t reads key j exactly where j < sinks or t - j < recent, as codes elsewhere. Whether a key is exact
        depends on who reads it, so each query gets both versions of every key, side by side, and the mask lets it
        see exactly one: one softmax over what that step's cache holds. A hybrid teacher's local layers (Gemma-3)
        read exactly: the student keeps them as the teacher does, so the baseline does too."""
        if kv_codes is None:
            raise RuntimeError(f"attn_implementation {CODED_ATTENTION!r} is driven by StreamingLLMBaseline(codes=...)")
        if getattr(module, "is_sliding", False):
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        coded_key, coded_value = (kv_codes.round(x.detach()).to(x.dtype) for x in (key, value))
        if not kv_exact or not kv_exact[1]:
            return sdpa_attention_forward(module, query, coded_key, coded_value, attention_mask, **kwargs)
        sinks, recent = kv_exact
        exact = streaming_llm_visibility(key.shape[-2], sinks, recent, device=key.device)
        lowest = torch.finfo(attention_mask.dtype).min
        mask = torch.cat([attention_mask.masked_fill(~exact, lowest), attention_mask.masked_fill(exact, lowest)], -1)
        return sdpa_attention_forward(module, query, torch.cat([key, coded_key], -2),
                                      torch.cat([value, coded_value], -2), mask, **kwargs)

    AttentionInterface.register(CODED_ATTENTION, coded_sdpa)


_register_coded_attention()


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """The model's attention implementation set to ``name`` for the block, restored after it, also on error (the
    teacher is shared by every baseline)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield model
    finally:
        config._attn_implementation = previous


def _bytes_of(dtype: torch.dtype) -> float:
    """Bytes per key/value element."""
    size = torch.empty((), dtype=dtype).element_size()
    return size / 2 if dtype == torch.float4_e2m1fn_x2 else size


def format_bytes(n: Optional[float]) -> str:
    """1536 -> '1.50 KiB' (binary units, as memory is counted everywhere in this project); None -> '-'."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _fmt(x, digits=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        return f"{x:.{digits}f}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def _as_windows(windows) -> torch.Tensor:
    windows = torch.as_tensor(windows)
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be a [N, L] tensor of token ids with L >= 2, got shape {tuple(windows.shape)}")
    return windows.long()


def _log_fn(log):
    if log is None:
        return lambda message: print(f"[aaren eval] {message}", file=sys.stderr, flush=True)
    return log if callable(log) else (lambda message: None)


# ----------------------------------------------------------------------------------------------------------------
# Perplexity
# ----------------------------------------------------------------------------------------------------------------


def _token_nll(model, batch: torch.Tensor) -> torch.Tensor:
    """[B, L-1] float64 NLL of tokens 1..L-1 of ``batch``. Models with a ``token_nll`` method (the retention
    baseline, which decodes step by step) compute it themselves without materialising [B, L, vocab] logits."""
    own = getattr(model, "token_nll", None)
    if callable(own):
        return own(batch).double()
    logits = model(input_ids=batch, use_cache=False).logits
    V = logits.shape[-1]
    nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), batch[:, 1:].reshape(-1), reduction="none")
    return nll.view(batch.shape[0], -1).double()


def position_buckets(window: int, length: int) -> list[int]:
    """Bucket edges for perplexity by position: 0, W, 4W, 16W, 64W, ... up to ``length`` (the last edge), so the
    buckets are "inside the window", "1-4 windows back", "4-16 windows back", ... For W < 1 (no window): 0, 64,
    256, ..., the same ladder from 64."""
    step = window if window >= 1 else 64
    edges = [0]
    edge = step
    while edge < length:
        edges.append(edge)
        edge *= 4
    return edges + [length]


@torch.no_grad()
def perplexity(model, windows, batch_size: int = 4, from_position: int = 0,
               buckets: Optional[Sequence[int]] = None) -> dict:
    """Token-weighted perplexity of ``model`` on ``windows`` ([N, L] token ids, each window scored on its own).

    Every window predicts its tokens 1..L-1 from the tokens before them (no context carried across windows), and the
    NLL is summed over all predicted tokens before averaging (token-weighted, so this equals exp of the mean NLL over
    N * (L - 1) tokens). ``from_position`` restricts a second number to targets at index >= from_position in their
    window, i.e. tokens predicted with at least ``from_position`` tokens of context: with a threshold beyond a
    student's or a baseline's window, that is the long-range part. ``buckets``: increasing edges (e.g. from
    :func:`position_buckets`); ``by_position`` then gives the perplexity of the targets at index in [edge_i,
    edge_i+1) (edges beyond L are clipped, empty buckets dropped).

    Works for any causal LM returning ``.logits`` (teacher, AarenForCausalLM, :class:`StreamingLLMBaseline`) or
    having a ``token_nll(input_ids)`` method (:class:`~aaren_hf.conversion.retention_baseline.RetentionBaseline`).
    Returns ``{"ppl", "nll", "tokens", "from_position", "ppl_from_position", "nll_from_position",
    "tokens_from_position", "windows", "window_length", "by_position": [{"from", "to", "ppl", "tokens"}]}``.
    """
    windows = _as_windows(windows)
    N, L = windows.shape
    if buckets is not None and any(b >= a for a, b in zip(buckets[1:], buckets[:-1])):
        raise ValueError(f"buckets must be increasing edges, got {list(buckets)}")
    device = _device(model)
    target_pos = torch.arange(1, L)
    edges = sorted({min(max(int(e), 0), L) for e in (buckets or [])})
    spans = [(a, b) for a, b in zip(edges[:-1], edges[1:]) if ((target_pos >= a) & (target_pos < b)).any()]
    sums = torch.zeros(L - 1, dtype=torch.float64)  # NLL summed over windows, per target position
    with _eval_mode(model):
        for start in range(0, N, max(1, batch_size)):
            batch = windows[start : start + batch_size].to(device)
            sums += _token_nll(model, batch).sum(0).cpu()

    def part(mask: torch.Tensor):
        count = int(mask.sum()) * N
        return (float(sums[mask].sum()) / count, count) if count else (None, 0)

    mean, n_tok = part(torch.ones(L - 1, dtype=torch.bool))
    tail_mean, tail_tok = part(target_pos >= from_position)
    by_position = []
    for a, b in spans:
        nll, count = part((target_pos >= a) & (target_pos < b))
        by_position.append({"from": a, "to": b, "ppl": math.exp(nll), "nll": nll, "tokens": count})
    return {
        "ppl": math.exp(mean),
        "nll": mean,
        "tokens": n_tok,
        "from_position": from_position,
        "ppl_from_position": math.exp(tail_mean) if tail_mean is not None else None,
        "nll_from_position": tail_mean,
        "tokens_from_position": tail_tok,
        "windows": N,
        "window_length": L,
        "by_position": by_position,
    }


# ----------------------------------------------------------------------------------------------------------------
# StreamingLLM baseline: the teacher with a sink + sliding-window attention mask
# ----------------------------------------------------------------------------------------------------------------


def streaming_llm_visibility(length: int, sinks: int, window: int, device=None) -> torch.Tensor:
    """[length, length] bool, True where query t may attend key j: causal, and j within the last ``window`` tokens
    (t - window < j <= t, the current token included) or j among the first ``sinks`` tokens. Same visible set as the
    Aaren window branch (``window_size`` = W, ``num_sink_tokens`` = S)."""
    if window < 1:
        raise ValueError(f"window must be >= 1 (the current token is always visible), got {window}")
    t = torch.arange(length, device=device).view(-1, 1)
    j = torch.arange(length, device=device).view(1, -1)
    return (j <= t) & ((t - j < window) | (j < sinks))


def streaming_llm_mask(length: int, sinks: int, window: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Additive 4D mask [1, 1, length, length] for :func:`streaming_llm_visibility`: 0 where visible, the dtype's
    most negative value elsewhere. Transformers 5.23 passes a 4D mask given as ``attention_mask`` through unchanged
    (``masking_utils._preprocess_mask_arguments``) and both the eager and the SDPA attention add it to the scores."""
    visible = streaming_llm_visibility(length, sinks, window, device=device)
    mask = torch.zeros(length, length, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(1, 1, length, length)


def check_codes(codes) -> None:
    """The ``codes`` argument of a baseline held in the student's memory codes: a MemoryCodes, or None."""
    if codes is not None and not isinstance(codes, MemoryCodes):
        raise ValueError(f"codes must be a MemoryCodes (e.g. MemoryCodes(4, rotate=True)) or None, got {codes!r}")


class StreamingLLMBaseline(nn.Module):
    """The teacher, untrained, seeing only the first ``sinks`` tokens and the last ``window`` tokens.

    It is what a StreamingLLM cache (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks")
    holds: S sink tokens + a rolling window, constant in the
    context. Implemented for scoring as the teacher's ordinary full-sequence forward with a custom 4D additive mask
    (:func:`streaming_llm_mask`); every query sees exactly the keys such a cache would hold at its step, so
    perplexity and teacher-forced scores equal those of token-by-token decoding with that cache.

    Positions: each token keeps its natural position. StreamingLLM re-assigns positions inside the cache (sinks at
    0..S-1, the window right after them) so that positions never exceed what the model was trained on; within the
    teacher's trained context (here: every evaluation window, max_position_embeddings = 8192 for SmolLM2) natural
    positions are the ones the model saw in training, and the re-positioning only matters past the trained length.
    One difference remains: a re-positioned sink is seen at relative distance <= S + W - 1 (as the Aaren window
    branch does), here at its true distance. Measured on SmolLM2-135M (16 Python-docs windows of 512 tokens, S=1,
    W=64): perplexity 18.36 with natural positions vs 18.28 with the sink re-positioned (the Aaren window branch
    with all weights from the teacher and its gate at 1); without a sink the two agree exactly (65.40), which
    also checks that this mask and the Aaren window branch see the same tokens. Past the trained length this baseline is not defined (a learned position
    table such as GPT-2's has no entries there; RoPE models would extrapolate): :func:`recall_probe` skips those.

    Needs ``attn_implementation`` "eager" or "sdpa" (flash attention takes no arbitrary mask). Teachers whose config
    already has a sliding window (Mistral, Gemma 2 local layers) get this mask instead of their own.
    ``generate()`` is not provided: the probe and perplexity score with teacher forcing.

    ``codes`` (a :class:`~aaren_hf.modeling_aaren.MemoryCodes`, the student's memory quantizer: 8 or 4 bits, one
    bfloat16 scale per vector, Hadamard-rotated or not): the cache holds its keys and values so, the current token's
    included (a hybrid teacher's local layers excepted: the student keeps them exact); attention then runs in SDPA.
    What a user who also quantizes a StreamingLLM cache would get from this quantizer (better ones exist, e.g.
    per-channel keys as in KIVI; so it is a bar, not a ceiling).
    ``exact_recent`` (with ``codes``): the sinks and the last ``exact_recent`` tokens (the current one included) stay
    exact, only the tokens between them are codes, as KIVI keeps its most recent tokens in full precision and as the
    student keeps its window; 0 codes everything.
    """

    def __init__(self, teacher, sinks: int, window: int, codes: Optional[MemoryCodes] = None, exact_recent: int = 0):
        super().__init__()
        if sinks < 0 or window < 1:
            raise ValueError(f"need sinks >= 0 and window >= 1, got sinks={sinks}, window={window}")
        impl = getattr(teacher.config, "_attn_implementation", None)
        if impl not in (None, "eager", "sdpa"):
            raise ValueError(
                f"The StreamingLLM baseline passes a custom 4D attention mask, which attn_implementation={impl!r} does "
                "not take. Load the teacher with attn_implementation='sdpa' (or 'eager'), or call "
                "teacher.set_attn_implementation('sdpa')."
            )
        check_codes(codes)
        if (exact_recent and not codes) or not 0 <= exact_recent <= window:
            raise ValueError(f"exact_recent must be in [0, window={window}] and needs codes (the rest held in them), "
                             f"got exact_recent={exact_recent!r}, codes={codes!r}")
        self.teacher = teacher
        self.sinks = int(sinks)
        self.window = int(window)
        self.codes = codes
        self.exact_recent = int(exact_recent)

    @property
    def config(self):
        return self.teacher.config

    @property
    def kv_tokens(self) -> int:
        """Tokens held between decoding steps: S sinks + the W - 1 tokens before the next one (which computes its own
        key and value on the fly and sees W tokens in all), the same convention as the AarenCache window."""
        return self.sinks + self.window - 1

    def kv_bytes(self, dtype: Optional[torch.dtype] = None, exact_dtype: Optional[torch.dtype] = None) -> int:
        """Bytes of the StreamingLLM cache (``kv_tokens`` = S + W - 1 tokens, per sequence), in ``dtype`` (default:
        the teacher's); for a hybrid teacher, of its global layers plus its local layers' own windows, which are
        never codes and count in ``exact_dtype`` (default ``dtype``). With ``exact_recent`` R, the sinks and the
        R - 1 tokens before the next one count in ``exact_dtype`` too."""
        dtype = dtype or _param_dtype(self.teacher)
        exact = self.sinks + self.exact_recent - 1 if self.exact_recent else 0
        return ((self.kv_tokens - exact) * teacher_kv_bytes_per_token(self.teacher.config, dtype)
                + exact * teacher_kv_bytes_per_token(self.teacher.config, exact_dtype or dtype)
                + teacher_local_kv_bytes(self.teacher.config, exact_dtype or dtype))

    def forward(self, input_ids=None, labels=None, attention_mask=None, **kwargs):
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
            raise ValueError("StreamingLLMBaseline scores unpadded sequences only (no padding mask)")
        kwargs.pop("use_cache", None)
        kwargs.pop("past_key_values", None)
        B, T = input_ids.shape
        dtype = _param_dtype(self.teacher)
        mask = streaming_llm_mask(T, self.sinks, self.window, dtype=dtype, device=input_ids.device).expand(B, 1, T, T)
        local = _teacher_local_window(self.teacher.config)
        if local:  # a hybrid teacher (Gemma-3): only the global layers get the StreamingLLM cache
            own = streaming_llm_mask(T, 0, local, dtype=dtype, device=input_ids.device).expand(B, 1, T, T)
            mask = {"full_attention": mask, "sliding_attention": own}
        if self.codes is None:
            return self.teacher(input_ids=input_ids, attention_mask=mask, labels=labels, use_cache=False, **kwargs)
        with attention_implementation(self.teacher, CODED_ATTENTION):
            return self.teacher(input_ids=input_ids, attention_mask=mask, labels=labels, use_cache=False,
                                kv_codes=self.codes, kv_exact=(self.sinks, self.exact_recent), **kwargs)


def streaming_llm_baseline(teacher, sinks: int, window: int, codes: Optional[MemoryCodes] = None,
                           exact_recent: int = 0) -> StreamingLLMBaseline:
    """The teacher with a StreamingLLM-style cache (first ``sinks`` + last ``window`` tokens visible, no training),
    usable wherever a causal LM is scored here (:func:`perplexity`, :func:`recall_probe`). See
    :class:`StreamingLLMBaseline` for the positions, what the mask implies and the codes."""
    return StreamingLLMBaseline(teacher, sinks, window, codes, exact_recent)


# ----------------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------------


def _teacher_geometry(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a Hugging Face decoder config (Llama, Qwen, GPT-2, GPT-NeoX, ...)."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads)
    if not (layers and kv_heads and head_dim):
        raise ValueError(f"cannot read layers / kv heads / head_dim from {type(config).__name__}")
    return int(layers), int(kv_heads), int(head_dim)


def _teacher_local_window(config) -> int:
    """The local layers' window of a hybrid teacher (Gemma-3: "sliding_attention" layers), else 0."""
    from .adapters import teacher_attention_types

    if getattr(config, "model_type", None) != "gemma3_text" or "sliding_attention" not in teacher_attention_types(config):
        return 0
    return int(config.sliding_window)


def teacher_kv_bytes_per_token(teacher_config, dtype: torch.dtype = torch.float32) -> int:
    """KV-cache bytes per token of context and sequence: 2 (K and V) * layers * kv_heads * head_dim * bytes per
    element. A hybrid teacher's local layers hold a fixed window (:func:`teacher_local_kv_bytes`); only its global
    layers count here."""
    layers, kv_heads, head_dim = _teacher_geometry(teacher_config)
    if _teacher_local_window(teacher_config):
        from .adapters import teacher_attention_types

        layers = teacher_attention_types(teacher_config).count("full_attention")
    return int(2 * layers * kv_heads * head_dim * _bytes_of(dtype))


def teacher_local_kv_bytes(teacher_config, dtype: torch.dtype = torch.float32, context: Optional[int] = None) -> int:
    """Bytes a hybrid teacher's local layers hold (each its window - 1 tokens, fewer while ``context`` is shorter);
    0 for other teachers."""
    window = _teacher_local_window(teacher_config)
    if not window:
        return 0
    from .adapters import teacher_attention_types

    _, kv_heads, head_dim = _teacher_geometry(teacher_config)
    tokens = window - 1 if context is None else min(window - 1, context)
    local = teacher_attention_types(teacher_config).count("sliding_attention")
    return int(2 * local * kv_heads * head_dim * _bytes_of(dtype) * tokens)


def aaren_state_bytes(student_config, kv_dtype: torch.dtype = torch.float32, layers=None) -> int:
    """Bytes of one sequence's full AarenCache once the window is full (batch 1), asked of the cache itself rather
    than restated from the layer's shapes: a copy of the model that keeps everything the state depends on (layers and
    their types, heads, head size, slots, window, sinks, memory) and shrinks what it does not (vocabulary, hidden
    and MLP widths) runs in ``kv_dtype``, the dtype its window and memory keys/values take (the Aaren part is
    float32 whatever the model's dtype), and is measured as :func:`state_bytes_table` measures a student.
    ``layers``: count only those layers' state (default: all)."""
    from aaren_hf.modeling_aaren import AarenForCausalLM

    # a learned position table only shifts the input embeddings; without it no window is too long for the table
    shrunk = type(student_config).from_dict({
        **student_config.to_dict(), "vocab_size": 8, "hidden_size": 8, "intermediate_size": 1,
        "head_dim": student_config.head_dim, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "position_embedding_type": "none", "max_position_embeddings": None})
    with torch.random.fork_rng(devices=[]):  # building draws initial weights: the caller's random stream stays put
        model = AarenForCausalLM(shrunk).to(kv_dtype)
    return _filled_state_bytes(model, layers)["bytes"]


def _filled_state_bytes(model, layers=None) -> dict:
    """Feed ``model`` random tokens through an ``AarenCache`` until its window (if any) is full, then as many again,
    and read the cache's size after each: ``{"bytes", "first", "tokens": [after first, after second]}``; ``layers``:
    only those layers' state (default: all)."""
    from aaren_hf.modeling_aaren import AarenCache

    cfg = model.config
    first = max(16, *(sum(cfg.layer_window(i)[:2]) + 1 for i in range(cfg.num_hidden_layers)))
    chosen = range(cfg.num_hidden_layers) if layers is None else layers

    def held():
        return sum(t.numel() * t.element_size() for i in chosen for t in cache.layers[i].tensors().values())

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 2 * first), generator=generator).to(_device(model))
    cache = AarenCache(cfg)
    with torch.no_grad(), _eval_mode(model):
        model(input_ids=ids[:, :first], past_key_values=cache, use_cache=True)
        measured_first = held()
        model(input_ids=ids[:, first:], past_key_values=cache, use_cache=True)
    return {"bytes": held(), "first": measured_first, "tokens": [first, 2 * first]}


def equal_memory_window(student_config, teacher_config, sinks: int, kv_dtype: torch.dtype = torch.float32,
                        baseline_dtype: Optional[torch.dtype] = None, exact_recent: int = 0) -> dict:
    """The StreamingLLM window W such that the teacher's KV cache (S + W - 1 tokens held between steps: the sinks and
    the W - 1 tokens before the next one, which sees W tokens with itself) equals (at most) the student's full
    state bytes (Aaren state + its window and sink keys/values + position bookkeeping), both per sequence in
    ``kv_dtype`` for keys/values (the Aaren part is always float32); ``baseline_dtype`` (default ``kv_dtype``) counts
    the teacher's instead, e.g. one byte per key/value element for a baseline sized as if its cache were 8-bit.

    W = floor(student_bytes / teacher_bytes_per_token) - S + 1, at least 1 (``clamped`` says when the student's state is
    smaller than S teacher tokens). ``exact_recent`` R > 0: the sinks and the R - 1 tokens before the next one count
    in ``kv_dtype``, the rest of the window in ``baseline_dtype`` (see :class:`StreamingLLMBaseline`), so
    W = R + floor((student_bytes - (S + R - 1) * exact_bytes_per_token) / teacher_bytes_per_token).
    Returns the window and both byte counts."""
    student_bytes = aaren_state_bytes(student_config, kv_dtype)
    baseline_dtype = baseline_dtype or kv_dtype
    per_token = teacher_kv_bytes_per_token(teacher_config, baseline_dtype)
    local = teacher_local_kv_bytes(teacher_config, kv_dtype)  # never codes: the student keeps them so too
    if local:  # hybrid: both keep the teacher's local layers as they are; the global layers' bytes are compared
        from .adapters import unchanged_layers

        kept = unchanged_layers(teacher_config, student_config)
        budget = student_bytes - aaren_state_bytes(student_config, kv_dtype, layers=kept)
    else:
        budget = student_bytes
    exact = sinks + exact_recent - 1 if exact_recent else 0
    exact_bytes = exact * teacher_kv_bytes_per_token(teacher_config, kv_dtype)
    window = (budget - exact_bytes) // per_token + (exact_recent or 1 - sinks)
    clamped = window < max(1, exact_recent)
    window = max(1, exact_recent, window)
    return {
        "window": int(window),
        "sinks": int(sinks),
        "student_state_bytes": int(student_bytes),
        "baseline_kv_bytes": int((window - 1 + sinks - exact) * per_token + exact_bytes + local),
        "teacher_kv_bytes_per_token": int(per_token),
        "student_window": int(student_config.window_size),
        "student_sinks": int(student_config.num_sink_tokens),
        "kv_dtype": str(kv_dtype).replace("torch.", ""),
        "baseline_dtype": str(baseline_dtype).replace("torch.", ""),
        "clamped": bool(clamped),
        **({"exact_recent": int(exact_recent)} if exact_recent else {}),
    }


@torch.no_grad()
def state_bytes_table(student, teacher_config, contexts: Sequence[int] = (4096, 32768, 131072),
                      kv_dtype: Optional[torch.dtype] = None, baseline: Optional[dict] = None) -> dict:
    """The student's state bytes, measured from an ``AarenCache`` after a forward (and again after more tokens, to
    show it is constant), vs the teacher's KV-cache bytes (2 * layers * kv_heads * head_dim * T * bytes) at
    ``contexts``. ``kv_dtype`` (default: the dtype the student caches keys/values in) is used for the teacher's cache.
    ``baseline``: an :func:`equal_memory_window` result, whose S + W - 1 token cache is added as a column.
    Per sequence (batch 1)."""
    kv_dtype = kv_dtype or _kv_dtype(student)
    measured = _filled_state_bytes(student)
    measured_first, measured_second = measured["first"], measured["bytes"]
    per_token = teacher_kv_bytes_per_token(teacher_config, kv_dtype)
    rows = []
    for T in contexts:
        teacher_bytes = per_token * T + teacher_local_kv_bytes(teacher_config, kv_dtype, context=T)
        row = {
            "context": int(T),
            "teacher_kv_bytes": int(teacher_bytes),
            "student_state_bytes": int(measured_second),
            "teacher_over_student": teacher_bytes / measured_second if measured_second else None,
        }
        if baseline is not None:
            row["baseline_kv_bytes"] = int(baseline["baseline_kv_bytes"])
        rows.append(row)
    return {
        "student_state_bytes": int(measured_second),
        "student_state_bytes_measured_at": measured["tokens"],
        "student_state_bytes_first": int(measured_first),
        "student_state_constant": measured_first == measured_second,
        "student_state_bytes_formula": aaren_state_bytes(student.config, kv_dtype),
        "teacher_kv_bytes_per_token": int(per_token),
        "kv_dtype": str(kv_dtype).replace("torch.", ""),
        "baseline": None if baseline is None else {"sinks": baseline["sinks"], "window": baseline["window"]},
        "rows": rows,
    }


# ----------------------------------------------------------------------------------------------------------------
# Recall over distance: passkey retrieval
# ----------------------------------------------------------------------------------------------------------------


def _max_positions(model) -> Optional[int]:
    """Longest input the model may score: the trained context of a Transformer (max_position_embeddings /
    n_positions), None (unbounded) for an Aaren model without a learned position table."""
    config = model.config
    if getattr(config, "model_type", None) == "aaren":
        if getattr(config, "position_embedding_type", "none") == "learned":
            return int(config.max_position_embeddings)
        return None
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _sinks_of(model) -> int:
    return max(int(getattr(model, "sinks", 0) or 0), int(getattr(model.config, "num_sink_tokens", 0) or 0))


def _scored_positions(tokenizer, target: list[int]) -> list[int]:
    """Indices of the answer tokens that carry the key (some letter or digit), for ``token_accuracy``."""
    keep = [i for i, t in enumerate(target) if any(ch.isalnum() for ch in tokenizer.decode([t]))]
    return keep or list(range(len(target)))


@torch.no_grad()
def recall_probe(model, tokenizer, distances: Sequence[int] = DEFAULT_RECALL_DISTANCES, n_trials: int = 5,
                 seed: int = 0, *, filler_ids=None, key_digits: int = 5, wording: str = "passkey",
                 key_format: str = "digits", batch_size: int = 8) -> dict:
    """Passkey retrieval at several distances: can the model copy a random key it saw ``distance`` tokens ago?

    Each trial is ``[intro] + statement + <distance filler tokens> + question + " <key>"`` in one of the held-out
    EVALUATION wordings of :data:`aaren_hf.conversion.recall.EVAL_WORDINGS`, which no training template of
    :mod:`.recall` shares a phrase with. The default ``"passkey"`` is the classic test, token for token what this
    probe always built: ``intro + " The pass key is <key>. Remember it.\\n" + filler + "\\nWhat is the pass key? The
    pass key is" + " <key>"``, so earlier numbers stay comparable. ``key_format``: ``digits`` (``key_digits`` long,
    the default and the issue's aim), ``words``, ``hex``, ``mixed`` (see :func:`~aaren_hf.conversion.recall.make_key`).
    The filler is ``distance`` tokens of held-out text (``filler_ids``, a 1D token sequence; a random slice per
    trial) or, without it, a generic repeated filler ("The grass is green. ..."). Keys, names and filler slices
    depend only on ``seed``, so teacher, student and baselines see the same trials. The key is placed after the
    first ``S`` tokens of the sequence (S: the model's sinks), so a sink never holds it: beyond the window only the
    model's state or memory could carry it.

    Scoring is teacher-forced, ``batch_size`` trials of equal length per forward, with logits for the answer
    positions only: ``accuracy`` is the exact match of greedy decoding (greedy decoding emits the key iff at each
    key token the argmax given the true prefix is that token, which is what is checked), ``token_accuracy`` the
    fraction of the key's letter/digit tokens predicted, ``key_logprob`` the mean log-probability of the whole key.
    This is exact for the baselines too: the StreamingLLM mask is what its cache computes at each step, and the
    retention baseline's forward is its bounded-cache decoding. Tokens that are pure whitespace at the start of the
    key (byte-level BPE splits " 48213" into " " + digits) belong to the question, not the score.

    Distances whose sequence exceeds the model's trained context (``max_position_embeddings`` / ``n_positions`` of a
    Transformer) are skipped (``skipped`` says why). Returns ``{"task", "wording", "key_format", "filler",
    "n_trials", "seed", "results": [{"distance", "key_to_answer", "length", "accuracy", "token_accuracy",
    "key_logprob", "skipped"}]}``; scores in [0, 1] (``key_logprob`` <= 0).
    """
    from .recall import EVAL_WORDINGS, start_ids

    if wording not in EVAL_WORDINGS:
        raise ValueError(f"unknown wording {wording!r}; the evaluation wordings are {', '.join(EVAL_WORDINGS)}")
    if n_trials < 1 or batch_size < 1:
        raise ValueError(f"need n_trials >= 1 and batch_size >= 1, got {n_trials}, {batch_size}")
    template = EVAL_WORDINGS[wording]
    sinks = _sinks_of(model)
    max_len = _max_positions(model)
    if filler_ids is not None:
        filler = torch.as_tensor(filler_ids).reshape(-1).tolist()
        filler_name = "held-out text"
    else:
        filler = _ids(tokenizer, GENERIC_FILLER * 8)
        filler_name = "generic (The grass is green. ...)"
    if len(filler) == 0:
        raise ValueError("filler_ids is empty")
    intro = _ids(tokenizer, template.intro)
    if len(intro) < sinks + 1:  # keep the key out of the sinks
        intro = (filler * (sinks // len(filler) + 2))[: sinks + 1 - len(intro)] + intro
    intro = start_ids(tokenizer) + intro
    trials = _recall_trials(tokenizer, template, random.Random(seed), n_trials, key_format, key_digits, len(filler))

    results = []
    with _eval_mode(model):
        for distance in distances:
            row = {"distance": int(distance), "key_to_answer": None, "length": None, "accuracy": None,
                   "token_accuracy": None, "key_logprob": None, "skipped": None}
            built = _recall_sequences(tokenizer, trials, intro, filler, int(distance), max_len, row)
            if row["skipped"] is None:
                row.update(_score_recall(model, tokenizer, built, batch_size))
            results.append(row)
    key_desc = f"{key_digits} digits" if key_format == "digits" else key_format
    return {
        "task": f"passkey ({key_desc}), wording {wording!r}, exact match of greedy decoding, teacher-forced",
        "wording": wording,
        "key_format": key_format,
        "filler": filler_name,
        "n_trials": int(n_trials),
        "seed": int(seed),
        "results": results,
    }


def _recall_trials(tokenizer, template, rng: random.Random, n_trials: int, key_format: str, key_digits: int,
                   filler_length: int) -> list[tuple]:
    """Per trial: (filler offset, statement before the key, key ids, statement after the key, question), drawn once
    and used at every distance (keys and offsets first, then names: the order this probe always drew them in)."""
    from .recall import make_key

    drawn = []
    for _ in range(n_trials):
        key = make_key(rng, key_format, key_digits)
        drawn.append((key, rng.randrange(filler_length)))
    names = [rng.choice(template.names) for _ in drawn] if template.keyed else [None] * n_trials
    trials = []
    for (key, offset), name in zip(drawn, names):
        fill = (lambda s: s.format(name=name)) if template.keyed else (lambda s: s)
        trials.append((offset, _ids(tokenizer, fill(template.before)), _ids(tokenizer, " " + key),
                       _ids(tokenizer, fill(template.after)), _ids(tokenizer, fill(template.question))))
    return trials


def _recall_sequences(tokenizer, trials: list, intro: list, filler: list, distance: int, max_len: Optional[int],
                      row: dict) -> list[tuple]:
    """The trials' token sequences at ``distance``: [(sequence, context length, target)]. Fills ``row``'s
    ``key_to_answer`` and ``length``, or its ``skipped`` when a sequence exceeds ``max_len``."""
    built = []
    for offset, before_key, key_ids, after_key, question in trials:
        lead = 0  # whitespace-only tokens at the start of the key belong to the question
        while lead < len(key_ids) - 1 and tokenizer.decode(key_ids[: lead + 1]).strip() == "":
            lead += 1
        stretch = (filler[offset:] + filler * (distance // len(filler) + 2))[:distance]
        context = intro + before_key + key_ids + after_key + stretch + question + key_ids[:lead]
        target = key_ids[lead:]
        seq = context + target
        if max_len is not None and len(seq) > max_len:
            row["skipped"] = f"{len(seq)} tokens > trained context {max_len}"
            return []
        if row["key_to_answer"] is None:
            # relative distance at which the first answer step sees the first key token of the statement
            row["key_to_answer"] = len(context) - 1 - (len(intro) + len(before_key) + lead)
            row["length"] = len(seq)
        built.append((seq, len(context), target))
    return built


def _score_recall(model, tokenizer, built: list, batch_size: int) -> dict:
    """Teacher-forced scores of the sequences of :func:`_recall_sequences`, ``batch_size`` of equal length per
    forward, logits for the answer positions only."""
    device = _device(model)
    exact, tok_acc, logprob = [], [], []
    by_length: dict[int, list] = {}
    for item in built:
        by_length.setdefault(len(item[0]), []).append(item)
    for length, group in by_length.items():
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            keep = max(len(target) for _, _, target in chunk) + 1
            input_ids = torch.tensor([seq for seq, _, _ in chunk], device=device)
            logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=keep).logits
            logits = logits[:, -keep:].float()  # models that ignore logits_to_keep return all positions
            for i, (seq, n_context, target) in enumerate(chunk):
                first = keep - 1 - (length - n_context)  # index of the step that predicts target[0]
                lg = logits[i, first : first + len(target)]
                tgt = torch.tensor(target, device=device)
                pred = lg.argmax(-1)
                exact.append(float(bool((pred == tgt).all())))
                scored = _scored_positions(tokenizer, target)
                tok_acc.append(float((pred == tgt)[scored].float().mean()))
                logprob.append(float(torch.log_softmax(lg, -1).gather(-1, tgt[:, None]).mean()))
    return {"accuracy": sum(exact) / len(exact), "token_accuracy": sum(tok_acc) / len(tok_acc),
            "key_logprob": sum(logprob) / len(logprob)}


# ----------------------------------------------------------------------------------------------------------------
# Samples
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def sample_generations(model, tokenizer, prompts: Iterable[str] = DEFAULT_PROMPTS, max_new_tokens: int = 32) -> list:
    """Greedy continuations (``generate(do_sample=False)``, the model's own cache: an AarenCache for the student) of
    each prompt, one at a time. Returns ``[{"prompt", "completion"}]``."""
    device = _device(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    with _eval_mode(model):
        for prompt in prompts:
            enc = tokenizer(prompt, return_tensors="pt").to(device)
            generated = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                temperature=None, top_p=None, top_k=None,
            )
            completion = tokenizer.decode(generated[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            out.append({"prompt": prompt, "completion": completion})
    return out


# ----------------------------------------------------------------------------------------------------------------
# Everything, on the same windows
# ----------------------------------------------------------------------------------------------------------------


def _model_name(model) -> str:
    return str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or
               type(model).__name__)


def long_heldout_windows(tokenizer, sources, *, seq_len: int, num_heldout: int, long_length: int = 2048,
                         seed: int = 0, **load_kwargs) -> torch.Tensor:
    """Held-out windows of ``long_length`` tokens cut from the SAME held-out documents as
    ``load_token_windows(tokenizer, sources, seq_len=seq_len, num_heldout=num_heldout, seed=seed)`` (the run's
    evaluation windows), so they were never trained on either: :func:`~aaren_hf.conversion.data.load_token_windows`
    holds out a prefix of the seed's document order just long enough for ``num_heldout * seq_len`` tokens, and
    asking for ``num_heldout * seq_len // long_length`` windows of ``long_length`` asks for no more tokens, hence
    the same prefix or a shorter one (checked). Returns [n, long_length]; pass it as ``evaluate(long_windows=...)``.
    ``load_kwargs`` go to ``load_token_windows`` (``cache_dir``, ``add_bos``, ...), the same as the run's."""
    from .data import load_token_windows

    if long_length < 2 or seq_len < 2 or num_heldout < 1:
        raise ValueError(f"need long_length >= 2, seq_len >= 2 and num_heldout >= 1, got {long_length}, {seq_len}, "
                         f"{num_heldout}")
    n = num_heldout * seq_len // long_length
    if n < 1:
        raise ValueError(f"{num_heldout} held-out windows of {seq_len} tokens hold less than one window of "
                         f"{long_length}: raise the number of held-out windows to at least "
                         f"{-(-long_length // seq_len)}")
    run = load_token_windows(tokenizer, sources, seq_len=seq_len, num_train=0, num_heldout=num_heldout, seed=seed,
                             **load_kwargs)
    long = load_token_windows(tokenizer, sources, seq_len=long_length, num_train=0, num_heldout=n, seed=seed,
                              **load_kwargs)
    if not set(long.heldout_documents) <= set(run.heldout_documents):  # never happens with the prefix rule
        raise RuntimeError("the long held-out windows would include training documents")
    return long.heldout


def _unpack_windows(windows, text_source=None, stride=None):
    """(tensor [N, L], text_source, stride) from a tensor or a dict with ``input_ids``/``windows`` and optionally
    ``source``/``text_source`` and ``stride``."""
    if isinstance(windows, dict):
        text_source = text_source or windows.get("source") or windows.get("text_source")
        stride = stride or windows.get("stride")
        windows = windows.get("input_ids", windows.get("windows"))
    return _as_windows(windows), text_source, stride


class _Timer:
    """Seconds spent per part, reported with the results (the evaluation has to fit the main command's budget)."""

    def __init__(self):
        self.seconds: dict = {}

    @contextlib.contextmanager
    def part(self, section: str, name: str):
        t0 = time.time()
        try:
            yield
        finally:
            self.seconds.setdefault(section, {})[name] = round(time.time() - t0, 1)


@torch.no_grad()
def evaluate(student, teacher, tokenizer, heldout_windows, *, sinks: int = 1, window=None,
             recall_distances: Optional[Sequence[int]] = None, recall_trials: int = 5, batch_size: int = 4,
             long_range_from: int = 256, prompts: Sequence[str] = DEFAULT_PROMPTS, max_new_tokens: int = 32,
             contexts: Sequence[int] = (4096, 32768, 131072), text_source: Optional[str] = None,
             stride: Optional[int] = None, quick: bool = False, seed: int = 0, log=None,
             long_windows=None, max_long_windows: Optional[int] = None, buckets: Optional[Sequence[int]] = None,
             recall_multiples: Sequence[int] = DEFAULT_RECALL_MULTIPLES, recall_wordings: Sequence[str] = ("passkey",),
             retention: bool = False) -> dict:
    """Teacher vs student vs constant-memory baselines, all on the same held-out windows.

    ``heldout_windows``: [N, L] token ids (non-overlapping windows of held-out text), or a dict with ``input_ids`` (or
    ``windows``) and optionally ``source`` / ``stride``. ``text_source`` and ``stride`` (default L: non-overlapping)
    are reported with the numbers. ``long_windows`` (same forms, e.g. 2,048-token windows of the same held-out
    documents): every model is also scored on them, at most ``max_long_windows`` of them (the cost grows with their
    number: bound it here). ``buckets``: position edges for perplexity by position (default
    :func:`position_buckets` of the student's window: 0, W, 4W, 16W, ...).

    Models: the teacher; the student; StreamingLLM baselines (teacher + ``sinks`` sink tokens + a window,
    untrained): always the equal-memory window (:func:`equal_memory_window`, the student's state bytes from
    :func:`aaren_state_bytes`); plus ``window`` (an int or a list of ints) when given, else the student's own
    ``window_size`` when it has one and it differs; and, with ``retention``, the training-free retention baseline at
    equal memory (:mod:`.retention_baseline`: the same sinks, the student's window, TOVA-kept tokens with the rest
    of the bytes; it costs about one more teacher pass per window set, and is off by default only so that callers
    written before it see the same models).

    Recall: passkeys at ``recall_distances`` tokens, by default ``recall_multiples`` (4, 16, 32) times the
    student's window (:data:`DEFAULT_RECALL_DISTANCES` for a student without one), ``recall_trials`` each, in each
    of ``recall_wordings`` (held-out evaluation wordings, :data:`aaren_hf.conversion.recall.EVAL_WORDINGS`).

    ``quick``: at most 4 windows and 1 long window, 2 recall trials at distances <= 512, one sample prompt of 16
    tokens. ``log``: None (stderr), a callable taking a message, or False (silent).
    Returns a JSON-serialisable dict (``seconds_by_part`` says where the time went); render it with
    :func:`format_table`.
    """
    say = _log_fn(log)
    started = time.time()
    timer = _Timer()
    windows, text_source, stride = _unpack_windows(heldout_windows, text_source, stride)
    long = _bounded_long_windows(long_windows, max_long_windows)
    if recall_trials < 1:
        raise ValueError(f"recall_trials must be >= 1, got {recall_trials}")
    student_window = int(student.config.window_size)
    recall_distances = _recall_distances(recall_distances, student_window, recall_multiples)
    if quick:
        windows = windows[:4]
        long = long[:1] if long is not None else None
        recall_trials = min(recall_trials, 2)
        recall_distances = [d for d in recall_distances if d <= 512] or recall_distances[:1]
        prompts = list(prompts)[:1]
        max_new_tokens = min(max_new_tokens, 16)
    from .data import text_tokens

    N, L = windows.shape
    long_range_from = min(long_range_from, L - 1)
    kv_dtype = _kv_dtype(student)
    if buckets is None:
        buckets = position_buckets(student_window, max(L, long.shape[1] if long is not None else 0))

    results = {
        "setup": {
            "windows": int(N),
            "window_length": int(L),
            "stride": int(stride or L),
            "tokens": int(N * L),
            "predicted_tokens": int(N * (L - 1)),
            "long_windows": int(long.shape[0]) if long is not None else 0,
            "long_window_length": int(long.shape[1]) if long is not None else None,
            "text_source": text_source or "unspecified",
            "long_range_from": int(long_range_from),
            "position_buckets": [int(b) for b in buckets],
            "teacher": _model_name(teacher),
            "student": _model_name(student),
            "student_window": student_window,
            "student_sinks": int(student.config.num_sink_tokens),
            "kv_dtype": str(kv_dtype).replace("torch.", ""),
            "quick": bool(quick),
            "seed": int(seed),
        }
    }
    models = _compared_models(student, teacher, results, sinks=sinks, window=window, kv_dtype=kv_dtype, length=L,
                              contexts=contexts, quick=quick, retention=retention, say=say)
    # long windows in batches of about as many tokens as the main ones (memory: [batch, L, vocab] logits)
    long_batch = max(1, batch_size * L // long.shape[1]) if long is not None else None
    _score_perplexity(models, windows, long, batch_size, long_batch, long_range_from, buckets, timer, say)
    results["perplexity"] = [entry for entry, _ in models]
    results["recall"] = [
        _recall_of(entry, model, tokenizer, text_tokens(windows, tokenizer), recall_distances, recall_trials, seed, wording,
                   batch_size, student_window, timer, say)
        for wording in recall_wordings for entry, model in models
    ]

    say("samples")
    with timer.part("samples", "teacher and student"):
        results["samples"] = {
            "max_new_tokens": int(max_new_tokens),
            "teacher": sample_generations(teacher, tokenizer, prompts, max_new_tokens),
            "student": sample_generations(student, tokenizer, prompts, max_new_tokens),
        }
    results["seconds_by_part"] = timer.seconds
    results["seconds"] = round(time.time() - started, 1)
    say(f"evaluation done in {results['seconds']} s")
    return results


def _bounded_long_windows(long_windows, max_long_windows: Optional[int]) -> Optional[torch.Tensor]:
    if long_windows is None:
        return None
    long, _, _ = _unpack_windows(long_windows)
    if max_long_windows is not None:
        if max_long_windows < 0:
            raise ValueError(f"max_long_windows must be >= 0, got {max_long_windows}")
        long = long[:max_long_windows]
    return long if long.shape[0] else None


def _recall_distances(recall_distances, student_window: int, recall_multiples: Sequence[int]) -> list:
    if recall_distances is None:
        if student_window >= 1:
            recall_distances = [int(m) * student_window for m in recall_multiples]
        else:
            recall_distances = list(DEFAULT_RECALL_DISTANCES)
    recall_distances = list(recall_distances)
    if not recall_distances or any(int(d) < 0 for d in recall_distances):
        raise ValueError(f"recall distances must be a non-empty list of tokens >= 0, got {recall_distances}")
    return recall_distances


def _compared_models(student, teacher, results: dict, *, sinks: int, window, kv_dtype: torch.dtype, length: int,
                     contexts: Sequence[int], quick: bool, retention: bool, say) -> list[tuple[dict, nn.Module]]:
    """[(entry, model)] of the teacher, the student and the baselines (see :func:`evaluate`); records the memory
    comparisons (``equal_memory``, ``memory``, ``equal_memory_retention``) in ``results``."""
    from .retention_baseline import equal_memory_retention

    student_window = int(student.config.window_size)
    equal = equal_memory_window(student.config, teacher.config, sinks, kv_dtype)
    results["equal_memory"] = equal
    extra = [window] if isinstance(window, int) else list(window or [])
    if window is None and student_window > 0:
        extra = [student_window]
    baseline_windows = [equal["window"]] + [w for w in extra if w != equal["window"]]
    if quick:
        baseline_windows = baseline_windows[:1]
    per_token = teacher_kv_bytes_per_token(teacher.config, kv_dtype)
    memory = state_bytes_table(student, teacher.config, contexts, kv_dtype=kv_dtype, baseline=equal)
    results["memory"] = memory

    models = [
        ({"name": "teacher", "kind": "teacher",
          "memory_bytes": per_token * length + teacher_local_kv_bytes(teacher.config, kv_dtype, context=length),
          "memory_note": f"KV at {length} tokens, grows"}, teacher),
        ({"name": "student (Aaren)", "kind": "student", "memory_bytes": memory["student_state_bytes"],
          "memory_note": "constant"}, student),
    ]
    for w in baseline_windows:
        tag = ("equal memory" if w == equal["window"] else
               "student's window" if w == student_window else "chosen window")
        models.append(_streaming_entry(teacher, sinks, w, kv_dtype, tag))
    if retention and _teacher_local_window(teacher.config):
        say("retention baseline (TOVA): skipped, it does not model a hybrid teacher's local layers yet")
        retention = False
    if retention:
        kept = equal_memory_retention(student.config, teacher.config, sinks, kv_dtype=kv_dtype)
        results["equal_memory_retention"] = kept
        models.append(_retention_entry(teacher, kept, kv_dtype, "equal memory"))
    codes = MemoryCodes.of(student.config)
    if codes is not None:
        # The student's memory holds 8- or 4-bit codes: the baselines again, their whole cache held in codes of that
        # many bits (2 or 4 times the tokens; their scales not counted, which favours them), the student's quantizer
        bits = codes.bits
        coded = CODED_COUNT[bits]
        tag = f"equal memory, {codes}"
        results["equal_memory_coded"] = {**equal_memory_window(student.config, teacher.config, sinks, kv_dtype,
                                                               baseline_dtype=coded), "bits": bits,
                                         "held_in_codes": True, "hadamard": codes.rotate}
        models.append(_streaming_entry(teacher, sinks, results["equal_memory_coded"]["window"], coded, tag, codes,
                                       exact_dtype=kv_dtype))
        if student_window > 0:
            # ... and with the student's own layout: sinks and its window exact, codes only beyond it (KIVI's
            # full-precision recent tokens), so the codes cost the baseline no more than they cost the student
            exact = equal_memory_window(student.config, teacher.config, sinks, kv_dtype, baseline_dtype=coded,
                                        exact_recent=student_window)
            results["equal_memory_coded_exact_recent"] = {**exact, "bits": bits}
            models.append(_streaming_entry(teacher, sinks, exact["window"], coded,
                                           f"{tag} beyond the last {student_window}", codes, student_window, kv_dtype))
        if retention:
            kept = equal_memory_retention(student.config, teacher.config, sinks, kv_dtype=kv_dtype,
                                          baseline_dtype=coded)
            results["equal_memory_retention_coded"] = {**kept, "bits": bits}
            models.append(_retention_entry(teacher, kept, coded, tag, codes))
    return models


def _streaming_entry(teacher, sinks: int, window: int, dtype: torch.dtype, tag: str,
                     codes: Optional[MemoryCodes] = None, exact_recent: int = 0,
                     exact_dtype: Optional[torch.dtype] = None):
    base = streaming_llm_baseline(teacher, sinks, window, codes, exact_recent)
    return ({"name": f"teacher, StreamingLLM S={sinks} W={window} ({tag})", "kind": "baseline", "sinks": sinks,
             "window": window, "memory_bytes": base.kv_bytes(dtype, exact_dtype), "memory_note": "constant"}, base)


def _retention_entry(teacher, kept: dict, dtype: torch.dtype, tag: str, codes: Optional[MemoryCodes] = None):
    from .retention_baseline import retention_baseline

    base = retention_baseline(teacher, kept["sinks"], kept["window"], kept["memory"], codes)
    return ({"name": f"teacher, TOVA S={kept['sinks']} W={kept['window']} M={kept['memory']} ({tag})",
             "kind": "retention", "sinks": kept["sinks"], "window": kept["window"], "memory": kept["memory"],
             "memory_bytes": base.kv_bytes(dtype), "memory_note": "constant"}, base)


def _score_perplexity(models: list, windows: torch.Tensor, long: Optional[torch.Tensor], batch_size: int,
                      long_batch: Optional[int], long_range_from: int, buckets, timer: _Timer, say) -> None:
    """Each entry's ``ppl`` (and ``ppl_long``) and its ratios to the teacher's (the first entry)."""
    N, L = windows.shape
    for entry, model in models:
        # the retention baseline holds no [batch, L, vocab] logits, and its step-by-step scan is mostly per-step
        # overhead (measured: 16 sequences cost 3.2x one): it takes up to 16 windows at a time
        wide = 16 if entry["kind"] == "retention" else 1
        say(f"perplexity on {N} x {L} tokens: {entry['name']}")
        with timer.part("perplexity", entry["name"]):
            entry["ppl"] = perplexity(model, windows, max(batch_size, wide), long_range_from, buckets)
        entry["ppl_long"] = None
        if long is not None:
            say(f"perplexity on {long.shape[0]} x {long.shape[1]} tokens: {entry['name']}")
            with timer.part("perplexity_long", entry["name"]):
                entry["ppl_long"] = perplexity(model, long, max(long_batch, wide), long_range_from, buckets)
    teacher_ppl = models[0][0]["ppl"]["ppl"]
    teacher_long = models[0][0]["ppl_long"]["ppl"] if long is not None else None
    for entry, _ in models:
        entry["ratio_to_teacher"] = entry["ppl"]["ppl"] / teacher_ppl
        entry["ratio_to_teacher_long"] = entry["ppl_long"]["ppl"] / teacher_long if long is not None else None


def _recall_of(entry: dict, model, tokenizer, filler: torch.Tensor, distances: list, trials: int, seed: int,
               wording: str, batch_size: int, student_window: int, timer: _Timer, say) -> dict:
    """One model's :func:`recall_probe` in one wording, labelled with the model's name, window, sinks and memory."""
    say(f"recall probe ({wording}): {entry['name']}")
    with timer.part("recall", f"{entry['name']} / {wording}"):
        probe = recall_probe(model, tokenizer, distances, trials, seed, filler_ids=filler, wording=wording,
                             batch_size=batch_size)
    probe["name"] = entry["name"]
    for field in ("window", "sinks", "memory"):
        if field in entry:
            probe[field] = entry[field]
    probe["window_multiple"] = [d / student_window if student_window else None for d in distances]
    return probe


# ----------------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------------


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _position_table(models: list) -> list:
    """Perplexity by position (on the long windows when there are some): rows models, columns position buckets."""
    key = "ppl_long" if models[0].get("ppl_long") else "ppl"
    spans = models[0][key].get("by_position") or []
    if not spans:
        return []
    teacher = models[0][key]["by_position"]
    out = [f"### Perplexity by position ({models[0][key]['window_length']}-token windows)", "",
           "Targets grouped by their position in the window (= tokens of context). Cells: ppl (ratio to the "
           "teacher's ppl in the same positions).", "",
           "| model | " + " | ".join(f"positions {b['from']}-{b['to'] - 1}" for b in spans) + " |",
           "|---|" + "---|" * len(spans)]
    for m in models:
        cells = [f"{_fmt(b['ppl'])} ({_fmt(b['ppl'] / t['ppl'])}x)" for b, t in zip(m[key]["by_position"], teacher)]
        out.append(f"| {_md_cell(m['name'])} | " + " | ".join(cells) + " |")
    return out + [""]


def _recall_tables(probes: list, student_window: Optional[int]) -> list:
    """One table per wording: rows distances, columns models."""
    out = []
    wordings = list(dict.fromkeys(p.get("wording", "passkey") for p in probes))
    for wording in wordings:
        group = [p for p in probes if p.get("wording", "passkey") == wording]
        first = group[0]
        out.append(f"### Recall over distance ({first.get('wording', 'passkey')})")
        out.append("")
        out.append(
            f"{first['task']}; {first['n_trials']} trials per distance; filler: {first['filler']}. "
            "Cells: exact-match accuracy (fraction of key tokens right). Distance: filler tokens between the key and "
            "the question; key to answer: how far back the first answer step must look to see the key's first "
            "token (a window needs W > this)."
        )
        out.append("")
        names = [p["name"] for p in group]
        per_w = bool(student_window)
        out.append("| distance | " + ("x student window | " if per_w else "") + "key to answer | "
                   + " | ".join(_md_cell(n) for n in names) + " |")
        out.append("|---|" + ("---|" if per_w else "") + "---|" + "---|" * len(names))
        for i, row in enumerate(first["results"]):
            gap = next((p["results"][i]["key_to_answer"] for p in group if p["results"][i]["key_to_answer"]), None)
            cells = []
            for p in group:
                r = p["results"][i]
                if r["skipped"]:
                    cells.append("n/a (beyond context)")
                else:
                    cells.append(f"{_fmt(r['accuracy'])} ({_fmt(r['token_accuracy'])})")
            multiple = f"{_fmt(row['distance'] / student_window, 1)} | " if per_w else ""
            out.append(f"| {row['distance']} | {multiple}{_fmt(gap)} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def _timing_lines(results: dict) -> list:
    parts = results.get("seconds_by_part")
    if not parts:
        return []
    text = "; ".join(f"{section.replace('_', ' ')} {sum(v.values()):.0f} s" for section, v in parts.items())
    slowest = max(((s, n, sec) for s, v in parts.items() for n, sec in v.items()), key=lambda x: x[2])
    return [f"Evaluation time: {results.get('seconds')} s ({text}; slowest part: {slowest[0].replace('_', ' ')} of "
            f"{slowest[1]}, {slowest[2]:.0f} s).", ""]


def format_table(results: dict) -> str:
    """Markdown tables of an :func:`evaluate` result: setup, perplexity (teacher vs student vs baselines), recall
    over distance, memory vs context, samples."""
    out = _setup_lines(results.get("setup", {}))
    if results.get("perplexity"):
        out.extend(_perplexity_lines(results))
    if results.get("recall"):
        out.extend(_recall_tables(results["recall"], results.get("setup", {}).get("student_window")))
    if results.get("memory"):
        out.extend(_memory_lines(results["memory"]))
    out.extend(_timing_lines(results))
    if results.get("samples"):
        out.extend(_sample_lines(results["samples"]))
    return "\n".join(out).rstrip() + "\n"


def _setup_lines(s: dict) -> list:
    if not s:
        return []
    return [
        f"Held-out text: {s.get('text_source')}; {s.get('windows')} windows of {s.get('window_length')} tokens, "
        f"stride {s.get('stride')} (non-overlapping when equal to the length), {s.get('tokens')} tokens "
        f"({s.get('predicted_tokens')} predicted). Each window is scored on its own, no context carried over. "
        f"Memory per sequence, keys/values in {s.get('kv_dtype')}.",
        "",
    ]


def _perplexity_lines(results: dict) -> list:
    """The perplexity table, what the baselines' equal memory means, and perplexity by position."""
    models = results["perplexity"]
    lr = models[0]["ppl"]["from_position"]
    long = models[0].get("ppl_long")
    out = ["### Perplexity", ""]
    length = models[0]["ppl"]["window_length"]
    head = f"| model | ppl ({length} tokens) | ratio to teacher | ppl at positions >= {lr} |"
    rule = "|---|---|---|---|"
    if long:
        head += f" ppl ({long['window_length']} tokens) | ratio to teacher |"
        rule += "---|---|"
    out.append(head + " state / KV bytes |")
    out.append(rule + "---|")
    for m in models:
        p = m["ppl"]
        line = (f"| {_md_cell(m['name'])} | {_fmt(p['ppl'])} | {_fmt(m['ratio_to_teacher'])}x | "
                f"{_fmt(p['ppl_from_position'])} |")
        if long:
            line += f" {_fmt(m['ppl_long']['ppl'])} | {_fmt(m['ratio_to_teacher_long'])}x |"
        out.append(line + f" {format_bytes(m['memory_bytes'])} ({m['memory_note']}) |")
    eq = results.get("equal_memory")
    if eq:
        out.append("")
        out.append(
            f"Equal memory: the student's state is {format_bytes(eq['student_state_bytes'])}; the teacher needs "
            f"{format_bytes(eq['teacher_kv_bytes_per_token'])} per token, so the baseline with {eq['sinks']} sink(s) "
            f"gets a window of {eq['window']} tokens ({format_bytes(eq['baseline_kv_bytes'])})"
            + (" (clamped to 1: the student's state is smaller than that)" if eq.get("clamped") else "") + "."
            " The baseline is the teacher, untrained, with a StreamingLLM attention mask at natural positions."
        )
    kept = results.get("equal_memory_retention")
    if kept:
        out.append(
            f"The retention baseline (TOVA) has the same bytes at most ({format_bytes(kept['baseline_kv_bytes'])}):"
            f" {kept['sinks']} sink(s) + the student's window of {kept['window']} + {kept['memory']} tokens kept, "
            "per layer, by TOVA's rule (when a token leaves the window and the memory is full, the one with the "
            "lowest attention weight from the current query, averaged over the layer's heads, is dropped); the "
            "teacher untrained, decoding token by token with that cache."
        )
    coded = results.get("equal_memory_coded")
    if not coded and results.get("equal_memory_8bit"):  # written before the count followed the student's bits
        coded = {**results["equal_memory_8bit"], "bits": 8}
    if coded:
        # an evaluation.json written before the baselines held codes: they were only counted at the bits
        held = coded.get("held_in_codes")
        rotated = " (of the Hadamard-rotated vectors)" if coded.get("hadamard") else ""
        how = (f"held in {coded['bits']}-bit codes{rotated} by the student's quantizer" if held else
               f"counted at {coded['bits']} bits per key/value element")
        favour = "are not counted" if held else "are not counted and they compute in float32"
        out.append(
            f"The student keeps its memory as {coded['bits']}-bit codes, so the baselines appear again with their "
            f"whole cache {how} ({format_bytes(coded['teacher_kv_bytes_per_token'])} per token: about "
            f"{16 // coded['bits']} times the tokens; the codes' scales {favour}, which can only favour them)."
        )
    exact = results.get("equal_memory_coded_exact_recent")
    if exact:
        out.append(
            f"The row \"beyond the last {exact['exact_recent']}\" holds its cache as the student holds its own: the "
            f"sink(s) and the last {exact['exact_recent']} tokens exact ({exact['kv_dtype']}), only the older ones in "
            f"{exact['bits']}-bit codes (KIVI's full-precision recent tokens), {exact['window']} tokens in all."
        )
    out.append("")
    return out + _position_table(models)


def _memory_lines(mem: dict) -> list:
    out = ["### Memory vs context (per sequence)", ""]
    has_base = mem.get("baseline") is not None
    head = "| context | teacher KV cache | student state | "
    head += f"StreamingLLM S={mem['baseline']['sinks']} W={mem['baseline']['window']} | " if has_base else ""
    out.append(head + "teacher / student |")
    out.append("|---|---|---|" + ("---|" if has_base else "") + "---|")
    for r in mem["rows"]:
        line = f"| {r['context']} | {format_bytes(r['teacher_kv_bytes'])} | {format_bytes(r['student_state_bytes'])} | "
        if has_base:
            line += f"{format_bytes(r.get('baseline_kv_bytes'))} | "
        out.append(line + f"{_fmt(r['teacher_over_student'], 1)}x |")
    out.append("")
    a, b = mem["student_state_bytes_measured_at"]
    out.append(
        f"Student state measured from its AarenCache after {a} and after {b} tokens: "
        f"{'identical' if mem['student_state_constant'] else 'NOT identical'} "
        f"({mem['student_state_bytes']} bytes). Teacher KV: 2 x layers x kv_heads x head_dim x tokens x bytes "
        f"= {mem['teacher_kv_bytes_per_token']} bytes per token."
    )
    out.append("")
    return out


def _sample_lines(samples: dict) -> list:
    out = [f"### Samples (greedy, {samples['max_new_tokens']} new tokens)", "", "| prompt | teacher | student |",
           "|---|---|---|"]
    for t, st in zip(samples["teacher"], samples["student"]):
        out.append(f"| {_md_cell(t['prompt'])} | {_md_cell(t['completion'])} | {_md_cell(st['completion'])} |")
    out.append("")
    return out
