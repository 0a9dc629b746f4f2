# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Evaluation of a converted Aaren student against its teacher and a constant-memory StreamingLLM baseline.

Everything here runs on the SAME held-out windows (perplexity is setting-dependent: the same model gives very
different numbers with another window length or stride, so the window length, stride, token count and text source
are part of every result):

- :func:`perplexity`: token-weighted NLL over all predicted tokens, and over the positions >= a threshold (the
  long-range part: tokens predicted with at least that much context).
- :func:`streaming_llm_baseline`: the teacher itself, untrained, seeing only the first S tokens (attention sinks)
  and the last W tokens, as a StreamingLLM cache would (Xiao et al. 2023). Implemented as the teacher's ordinary
  forward with a custom 4D attention mask.
- :func:`equal_memory_window`: the baseline window W for which the teacher's KV cache (S + W - 1 tokens held
  between steps) equals the student's whole state (Aaren state + its window keys/values), so both are compared at
  the same memory.
- :func:`recall_probe`: passkey retrieval over distance (exact match of greedy decoding, computed in one forward).
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

__all__ = [
    "StreamingLLMBaseline",
    "aaren_state_bytes",
    "equal_memory_window",
    "evaluate",
    "format_table",
    "perplexity",
    "recall_probe",
    "sample_generations",
    "state_bytes_table",
    "streaming_llm_baseline",
    "streaming_llm_mask",
    "teacher_kv_bytes_per_token",
]

DEFAULT_RECALL_DISTANCES = (32, 128, 512, 2048)
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


@contextlib.contextmanager
def _eval_mode(model):
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        yield model
    finally:
        if was_training:
            model.train()


def _bytes_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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


@torch.no_grad()
def perplexity(model, windows, batch_size: int = 4, from_position: int = 0) -> dict:
    """Token-weighted perplexity of ``model`` on ``windows`` ([N, L] token ids, each window scored on its own).

    Every window predicts its tokens 1..L-1 from the tokens before them (no context carried across windows), and the
    NLL is summed over all predicted tokens before averaging (token-weighted, so this equals exp of the mean NLL over
    N * (L - 1) tokens). ``from_position`` restricts a second number to targets at index >= from_position in their
    window, i.e. tokens predicted with at least ``from_position`` tokens of context: with a threshold beyond a
    student's or a baseline's window, that is the long-range part.

    Works for any causal LM returning ``.logits`` (teacher, AarenForCausalLM, :class:`StreamingLLMBaseline`).
    Returns ``{"ppl", "nll", "tokens", "from_position", "ppl_from_position", "nll_from_position",
    "tokens_from_position", "windows", "window_length"}``.
    """
    windows = _as_windows(windows)
    N, L = windows.shape
    device = _device(model)
    target_pos = torch.arange(1, L, device=device)
    tail = target_pos >= from_position
    nll_sum, n_tok, tail_sum, tail_tok = 0.0, 0, 0.0, 0
    with _eval_mode(model):
        for start in range(0, N, max(1, batch_size)):
            batch = windows[start : start + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits
            V = logits.shape[-1]
            nll = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, V), batch[:, 1:].reshape(-1), reduction="none"
            ).view(batch.shape[0], L - 1).double()
            nll_sum += float(nll.sum())
            n_tok += nll.numel()
            tail_sum += float(nll[:, tail].sum())
            tail_tok += int(tail.sum()) * batch.shape[0]
    mean = nll_sum / n_tok
    tail_mean = tail_sum / tail_tok if tail_tok else None
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
    """

    def __init__(self, teacher, sinks: int, window: int):
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
        self.teacher = teacher
        self.sinks = int(sinks)
        self.window = int(window)

    @property
    def config(self):
        return self.teacher.config

    @property
    def kv_tokens(self) -> int:
        """Tokens held between decoding steps: S sinks + the W - 1 tokens before the next one (which computes its own
        key and value on the fly and sees W tokens in all), the same convention as the AarenCache window."""
        return self.sinks + self.window - 1

    def kv_bytes(self, dtype: Optional[torch.dtype] = None) -> int:
        """Bytes of the StreamingLLM cache (``kv_tokens`` = S + W - 1 tokens, per sequence), in ``dtype`` (default:
        the teacher's)."""
        dtype = dtype or _param_dtype(self.teacher)
        return self.kv_tokens * teacher_kv_bytes_per_token(self.teacher.config, dtype)

    def forward(self, input_ids=None, labels=None, attention_mask=None, **kwargs):
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
            raise ValueError("StreamingLLMBaseline scores unpadded sequences only (no padding mask)")
        kwargs.pop("use_cache", None)
        kwargs.pop("past_key_values", None)
        B, T = input_ids.shape
        dtype = _param_dtype(self.teacher)
        mask = streaming_llm_mask(T, self.sinks, self.window, dtype=dtype, device=input_ids.device)
        return self.teacher(
            input_ids=input_ids, attention_mask=mask.expand(B, 1, T, T), labels=labels, use_cache=False, **kwargs
        )


def streaming_llm_baseline(teacher, sinks: int, window: int) -> StreamingLLMBaseline:
    """The teacher with a StreamingLLM-style cache (first ``sinks`` + last ``window`` tokens visible, no training),
    usable wherever a causal LM is scored here (:func:`perplexity`, :func:`recall_probe`). See
    :class:`StreamingLLMBaseline` for the positions and what the mask implies."""
    return StreamingLLMBaseline(teacher, sinks, window)


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


def teacher_kv_bytes_per_token(teacher_config, dtype: torch.dtype = torch.float32) -> int:
    """KV-cache bytes per token and sequence: 2 (K and V) * layers * kv_heads * head_dim * bytes per element."""
    layers, kv_heads, head_dim = _teacher_geometry(teacher_config)
    return 2 * layers * kv_heads * head_dim * _bytes_of(dtype)


def aaren_state_bytes(student_config, kv_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one sequence's full AarenCache once the window is full, from the config (matches
    ``AarenCache.state_bytes()`` measured after a forward of >= window_size tokens, batch 1):

    per layer, Aaren state in float32: (mean value [H*J, D] + log normaliser [H*J]) * 4 bytes; with the window
    branch, keys + values of the W - 1 window tokens kept between steps (the next token adds its own) and of the S
    sinks in ``kv_dtype`` (2 * (W-1+S) * Hkv * D), and their positions (int64, W - 1 + S)."""
    c = student_config
    H, J, D, Hkv = c.num_attention_heads, c.num_query_slots, c.head_dim, c.num_key_value_heads
    aaren = (H * J * D + H * J) * 4
    per_layer = 0
    if c.window_size > 0:
        tokens = c.window_size - 1 + c.num_sink_tokens
        per_layer += 2 * tokens * Hkv * D * _bytes_of(kv_dtype) + tokens * 8
    M = getattr(c, "memory_size", 0)
    if M > 0:  # memory keys/values, positions (int64) and scores (float32); window entries' scores (float32)
        per_layer += 2 * M * Hkv * D * _bytes_of(kv_dtype) + M * Hkv * 12 + (c.window_size - 1) * Hkv * 4
    aaren_layers = sum(c.layer_type(i) == "linear_attention" for i in range(c.num_hidden_layers))
    return c.num_hidden_layers * per_layer + aaren_layers * aaren


def equal_memory_window(student_config, teacher_config, sinks: int, kv_dtype: torch.dtype = torch.float32) -> dict:
    """The StreamingLLM window W such that the teacher's KV cache (S + W - 1 tokens held between steps: the sinks and
    the W - 1 tokens before the next one, which sees W tokens with itself) equals (at most) the student's full
    state bytes (Aaren state + its window and sink keys/values + position bookkeeping), both per sequence in
    ``kv_dtype`` for keys/values (the Aaren part is always float32).

    W = floor(student_bytes / teacher_bytes_per_token) - S + 1, at least 1 (``clamped`` says when the student's state is
    smaller than S teacher tokens). Returns the window and both byte counts."""
    student_bytes = aaren_state_bytes(student_config, kv_dtype)
    per_token = teacher_kv_bytes_per_token(teacher_config, kv_dtype)
    tokens = student_bytes // per_token
    window = tokens - sinks + 1
    clamped = window < 1
    window = max(1, window)
    return {
        "window": int(window),
        "sinks": int(sinks),
        "student_state_bytes": int(student_bytes),
        "baseline_kv_bytes": int((window - 1 + sinks) * per_token),
        "teacher_kv_bytes_per_token": int(per_token),
        "student_window": int(student_config.window_size),
        "student_sinks": int(student_config.num_sink_tokens),
        "kv_dtype": str(kv_dtype).replace("torch.", ""),
        "clamped": bool(clamped),
    }


@torch.no_grad()
def state_bytes_table(student, teacher_config, contexts: Sequence[int] = (4096, 32768, 131072),
                      kv_dtype: Optional[torch.dtype] = None, baseline: Optional[dict] = None) -> dict:
    """The student's state bytes, measured from an ``AarenCache`` after a forward (and again after more tokens, to
    show it is constant), vs the teacher's KV-cache bytes (2 * layers * kv_heads * head_dim * T * bytes) at
    ``contexts``. ``kv_dtype`` (default: the student's parameter dtype) is used for the teacher's cache.
    ``baseline``: an :func:`equal_memory_window` result, whose S + W - 1 token cache is added as a column.
    Per sequence (batch 1)."""
    from aaren_hf.modeling_aaren import AarenCache

    cfg = student.config
    kv_dtype = kv_dtype or _param_dtype(student)
    device = _device(student)
    # fill the window (if any) so that the cache has its final size, then feed as much again
    first = max(16, cfg.window_size + cfg.num_sink_tokens + 1)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 2 * first), generator=generator).to(device)
    cache = AarenCache(cfg)
    with _eval_mode(student):
        student(input_ids=ids[:, :first], past_key_values=cache, use_cache=True)
        measured_first = cache.state_bytes()
        student(input_ids=ids[:, first:], past_key_values=cache, use_cache=True)
        measured_second = cache.state_bytes()
    per_token = teacher_kv_bytes_per_token(teacher_config, kv_dtype)
    rows = []
    for T in contexts:
        teacher_bytes = per_token * T
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
        "student_state_bytes_measured_at": [int(first), int(2 * first)],
        "student_state_bytes_first": int(measured_first),
        "student_state_constant": measured_first == measured_second,
        "student_state_bytes_formula": aaren_state_bytes(cfg, kv_dtype),
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


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _sinks_of(model) -> int:
    return max(int(getattr(model, "sinks", 0) or 0), int(getattr(model.config, "num_sink_tokens", 0) or 0))


@torch.no_grad()
def recall_probe(model, tokenizer, distances: Sequence[int] = DEFAULT_RECALL_DISTANCES, n_trials: int = 5,
                 seed: int = 0, *, filler_ids=None, key_digits: int = 5) -> dict:
    """Passkey retrieval at several distances: can the model copy a random number it saw ``distance`` tokens ago?

    Each trial is ``intro + " The pass key is <key>. Remember it.\\n" + <distance filler
    tokens> + "\\nWhat is the pass key? The pass key is" + " <key>"``. The filler is ``distance`` tokens of held-out
    text (``filler_ids``, a 1D token sequence; a random slice per trial) or, without it, a generic repeated filler
    ("The grass is green. ..."). Keys and filler slices depend only on ``seed``, so teacher, student and baseline see
    the same trials. The key is placed after the first ``S`` tokens of the sequence (S: the model's sinks), so a
    sink never holds it: beyond the window only the recurrent state (student) could carry it.

    Scoring is teacher-forced, in ONE forward per trial: ``accuracy`` is the exact match of greedy decoding (greedy
    decoding emits the key iff at each key token the argmax given the true prefix is that token, which is what is
    checked), ``token_accuracy`` the fraction of key digits predicted, ``key_logprob`` the mean log-probability of the
    whole key. This is the honest way for the StreamingLLM baseline too: the masked forward is exactly what its cache
    would compute at each step, no generation loop with a custom cache is needed. Tokens that are pure whitespace at
    the start of the key (byte-level BPE splits " 48213" into " " + digits) belong to the question, not the score.

    Distances whose sequence exceeds the model's trained context (``max_position_embeddings`` / ``n_positions`` of a
    Transformer) are skipped (``skipped`` says why). Returns ``{"task", "filler", "n_trials", "seed", "results":
    [{"distance", "key_to_answer", "length", "accuracy", "token_accuracy", "key_logprob", "skipped"}]}``; scores in
    [0, 1] (``key_logprob`` <= 0).
    """
    rng = random.Random(seed)
    device = _device(model)
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
    intro = _ids(tokenizer, "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n")
    if len(intro) < sinks + 1:  # keep the key out of the sinks
        intro = (filler * (sinks // len(filler) + 2))[: sinks + 1 - len(intro)] + intro
    before_key = _ids(tokenizer, " The pass key is")
    question = _ids(tokenizer, "\nWhat is the pass key? The pass key is")

    trials = []  # same keys and filler offsets for every distance, drawn once
    for _ in range(n_trials):
        key = str(rng.randint(10 ** (key_digits - 1), 10**key_digits - 1))
        trials.append((key, rng.randrange(len(filler))))

    results = []
    with _eval_mode(model):
        for distance in distances:
            row = {"distance": int(distance), "key_to_answer": None, "length": None, "accuracy": None,
                   "token_accuracy": None, "key_logprob": None, "skipped": None}
            exact, tok_acc, logprob = [], [], []
            for key, offset in trials:
                key_ids = _ids(tokenizer, " " + key)
                lead = 0
                while lead < len(key_ids) - 1 and tokenizer.decode(key_ids[: lead + 1]).strip() == "":
                    lead += 1
                after_key = _ids(tokenizer, ". Remember it.\n")  # one occurrence of the key only
                stretch = (filler[offset:] + filler * (distance // len(filler) + 2))[:distance]
                context = intro + before_key + key_ids + after_key + stretch + question + key_ids[:lead]
                target = key_ids[lead:]
                seq = context + target
                if max_len is not None and len(seq) > max_len:
                    row["skipped"] = f"{len(seq)} tokens > trained context {max_len}"
                    break
                # relative distance at which the first answer step sees the first key digit of the statement
                key_start = len(intro) + len(before_key) + lead
                row["key_to_answer"] = len(context) - 1 - key_start
                row["length"] = len(seq)
                input_ids = torch.tensor([seq], device=device)
                logits = model(input_ids=input_ids, use_cache=False).logits[0, len(context) - 1 : -1].float()
                tgt = torch.tensor(target, device=device)
                pred = logits.argmax(-1)
                exact.append(float(bool((pred == tgt).all())))
                digit_pos = [i for i, t in enumerate(target) if any(ch.isdigit() for ch in tokenizer.decode([t]))]
                digit_pos = digit_pos or list(range(len(target)))
                tok_acc.append(float((pred == tgt)[digit_pos].float().mean()))
                logprob.append(float(torch.log_softmax(logits, -1).gather(-1, tgt[:, None]).mean()))
            if row["skipped"] is None and exact:
                row["accuracy"] = sum(exact) / len(exact)
                row["token_accuracy"] = sum(tok_acc) / len(tok_acc)
                row["key_logprob"] = sum(logprob) / len(logprob)
            results.append(row)
    return {
        "task": f"passkey ({key_digits} digits), exact match of greedy decoding, teacher-forced",
        "filler": filler_name,
        "n_trials": int(n_trials),
        "seed": int(seed),
        "results": results,
    }


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


@torch.no_grad()
def evaluate(student, teacher, tokenizer, heldout_windows, *, sinks: int = 1, window=None,
             recall_distances: Sequence[int] = DEFAULT_RECALL_DISTANCES, recall_trials: int = 5,
             batch_size: int = 4, long_range_from: int = 256, prompts: Sequence[str] = DEFAULT_PROMPTS,
             max_new_tokens: int = 32, contexts: Sequence[int] = (4096, 32768, 131072), text_source: Optional[str] = None,
             stride: Optional[int] = None, quick: bool = False, seed: int = 0, log=None) -> dict:
    """Teacher vs student vs StreamingLLM baseline(s), all on the same held-out windows.

    ``heldout_windows``: [N, L] token ids (non-overlapping windows of held-out text), or a dict with ``input_ids`` (or
    ``windows``) and optionally ``source`` / ``stride``. ``text_source`` and ``stride`` (default L: non-overlapping)
    are reported with the numbers.

    Baselines (teacher + ``sinks`` sink tokens + a window, untrained): always the equal-memory window
    (:func:`equal_memory_window`, the student's state bytes); plus ``window`` (an int or a list of ints) when given,
    else the student's own ``window_size`` when it has one and it differs.

    ``quick``: at most 4 windows, 2 recall trials at distances <= 512, one sample prompt of 16 tokens.
    ``log``: None (stderr), a callable taking a message, or False (silent).
    Returns a JSON-serialisable dict; render it with :func:`format_table`.
    """
    say = _log_fn(log)
    started = time.time()
    if isinstance(heldout_windows, dict):
        text_source = text_source or heldout_windows.get("source") or heldout_windows.get("text_source")
        stride = stride or heldout_windows.get("stride")
        heldout_windows = heldout_windows.get("input_ids", heldout_windows.get("windows"))
    windows = _as_windows(heldout_windows)
    if quick:
        windows = windows[:4]
        recall_trials = min(recall_trials, 2)
        recall_distances = [d for d in recall_distances if d <= 512] or list(recall_distances)[:1]
        prompts = list(prompts)[:1]
        max_new_tokens = min(max_new_tokens, 16)
    N, L = windows.shape
    long_range_from = min(long_range_from, L - 1)
    kv_dtype = _param_dtype(student)

    results = {
        "setup": {
            "windows": int(N),
            "window_length": int(L),
            "stride": int(stride or L),
            "tokens": int(N * L),
            "predicted_tokens": int(N * (L - 1)),
            "text_source": text_source or "unspecified",
            "long_range_from": int(long_range_from),
            "teacher": _model_name(teacher),
            "student": _model_name(student),
            "student_window": int(student.config.window_size),
            "student_sinks": int(student.config.num_sink_tokens),
            "kv_dtype": str(kv_dtype).replace("torch.", ""),
            "quick": bool(quick),
            "seed": int(seed),
        }
    }

    equal = equal_memory_window(student.config, teacher.config, sinks, kv_dtype)
    results["equal_memory"] = equal
    extra = [window] if isinstance(window, int) else list(window or [])
    if window is None and student.config.window_size > 0:
        extra = [student.config.window_size]
    baseline_windows = [equal["window"]] + [w for w in extra if w != equal["window"]]
    if quick:
        baseline_windows = baseline_windows[:1]
    per_token = teacher_kv_bytes_per_token(teacher.config, kv_dtype)

    say(f"perplexity on {N} x {L} tokens: teacher")
    models = [{"name": "teacher", "kind": "teacher", "memory_bytes": per_token * L, "memory_note": f"KV at {L} tokens, grows"}]
    models[0]["ppl"] = perplexity(teacher, windows, batch_size, long_range_from)
    say("perplexity: student")
    memory = state_bytes_table(student, teacher.config, contexts, kv_dtype=kv_dtype, baseline=equal)
    models.append({"name": "student (Aaren)", "kind": "student", "memory_bytes": memory["student_state_bytes"],
                   "memory_note": "constant", "ppl": perplexity(student, windows, batch_size, long_range_from)})
    baselines = {}
    for w in baseline_windows:
        base = streaming_llm_baseline(teacher, sinks, w)
        tag = ("equal memory" if w == equal["window"] else
               "student's window" if w == student.config.window_size else "chosen window")
        say(f"perplexity: StreamingLLM baseline S={sinks} W={w} ({tag})")
        entry = {"name": f"teacher, StreamingLLM S={sinks} W={w} ({tag})", "kind": "baseline", "sinks": sinks,
                 "window": w, "memory_bytes": base.kv_bytes(kv_dtype), "memory_note": "constant",
                 "ppl": perplexity(base, windows, batch_size, long_range_from)}
        models.append(entry)
        baselines[entry["name"]] = base
    teacher_ppl = models[0]["ppl"]["ppl"]
    for m in models:
        m["ratio_to_teacher"] = m["ppl"]["ppl"] / teacher_ppl
    results["perplexity"] = models
    results["memory"] = memory

    filler = windows.reshape(-1)
    results["recall"] = []
    for name, model in [("teacher", teacher), ("student (Aaren)", student)] + list(baselines.items()):
        say(f"recall probe: {name}")
        probe = recall_probe(model, tokenizer, recall_distances, recall_trials, seed, filler_ids=filler)
        probe["name"] = name
        if isinstance(model, StreamingLLMBaseline):
            probe["window"], probe["sinks"] = model.window, model.sinks
        results["recall"].append(probe)

    say("samples")
    results["samples"] = {
        "max_new_tokens": int(max_new_tokens),
        "teacher": sample_generations(teacher, tokenizer, prompts, max_new_tokens),
        "student": sample_generations(student, tokenizer, prompts, max_new_tokens),
    }
    results["seconds"] = round(time.time() - started, 1)
    say(f"evaluation done in {results['seconds']} s")
    return results


# ----------------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------------


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def format_table(results: dict) -> str:
    """Markdown tables of an :func:`evaluate` result: setup, perplexity (teacher vs student vs baselines), recall
    over distance, memory vs context, samples."""
    out = []
    s = results.get("setup", {})
    if s:
        out.append(
            f"Held-out text: {s.get('text_source')}; {s.get('windows')} windows of {s.get('window_length')} tokens, "
            f"stride {s.get('stride')} (non-overlapping when equal to the length), {s.get('tokens')} tokens "
            f"({s.get('predicted_tokens')} predicted). Each window is scored on its own, no context carried over. "
            f"Memory per sequence, keys/values in {s.get('kv_dtype')}."
        )
        out.append("")

    if results.get("perplexity"):
        lr = results["perplexity"][0]["ppl"]["from_position"]
        out.append("### Perplexity")
        out.append("")
        out.append(f"| model | ppl | ratio to teacher | ppl at positions >= {lr} | state / KV bytes |")
        out.append("|---|---|---|---|---|")
        for m in results["perplexity"]:
            p = m["ppl"]
            out.append(
                f"| {_md_cell(m['name'])} | {_fmt(p['ppl'])} | {_fmt(m['ratio_to_teacher'])}x | "
                f"{_fmt(p['ppl_from_position'])} | {format_bytes(m['memory_bytes'])} ({m['memory_note']}) |"
            )
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
        out.append("")

    if results.get("recall"):
        probes = results["recall"]
        out.append("### Recall over distance (passkey)")
        out.append("")
        first = probes[0]
        out.append(
            f"{first['task']}; {first['n_trials']} trials per distance; filler: {first['filler']}. "
            "Cells: exact-match accuracy (fraction of key digits right). Distance: filler tokens between the key and "
            "the question; key to answer: how far back the first answer step must look to see the key's first "
            "digit (a window needs W > this)."
        )
        out.append("")
        names = [p["name"] for p in probes]
        out.append("| distance | key to answer | " + " | ".join(_md_cell(n) for n in names) + " |")
        out.append("|---|---|" + "---|" * len(names))
        for i, row in enumerate(first["results"]):
            gap = next((p["results"][i]["key_to_answer"] for p in probes if p["results"][i]["key_to_answer"]), None)
            cells = []
            for p in probes:
                r = p["results"][i]
                if r["skipped"]:
                    cells.append("n/a (beyond context)")
                else:
                    cells.append(f"{_fmt(r['accuracy'])} ({_fmt(r['token_accuracy'])})")
            out.append(f"| {row['distance']} | {_fmt(gap)} | " + " | ".join(cells) + " |")
        out.append("")

    mem = results.get("memory")
    if mem:
        out.append("### Memory vs context (per sequence)")
        out.append("")
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

    samples = results.get("samples")
    if samples:
        out.append(f"### Samples (greedy, {samples['max_new_tokens']} new tokens)")
        out.append("")
        out.append("| prompt | teacher | student |")
        out.append("|---|---|---|")
        for t, st in zip(samples["teacher"], samples["student"]):
            out.append(f"| {_md_cell(t['prompt'])} | {_md_cell(t['completion'])} | {_md_cell(st['completion'])} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
