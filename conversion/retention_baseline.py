# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Training-free retention baseline: the teacher with S sinks + a W-token window + M tokens kept by TOVA.

What a user could pick instead of a converted model when they want constant memory AND some recall: the untrained
teacher whose KV cache holds, per layer,

- the first ``sinks`` tokens (attention sinks, never evicted),
- the last ``window`` tokens (the current one included, never evicted), and
- up to ``memory`` tokens that have left the window, chosen by TOVA's rule (Oren et al. 2024, "Transformers are
  Multi-State RNNs", arXiv 2401.06104): whenever a token leaves the window and the memory is full, the candidate
  (memory tokens + the leaving token) with the LOWEST attention weight from the current query, averaged over all
  the layer's query heads, is evicted. One choice per layer, shared by its KV heads, as in the paper (it found the
  layer-wise average better than a per-head choice).

Why TOVA rather than H2O (Zhang et al. 2023, accumulated attention): TOVA needs no state beyond the kept keys and
values (H2O keeps a running score per cached token), and H2O's accumulated score favours old tokens simply because
they have been scored more often, which is the opposite of what a passkey needs; TOVA reported better long-range
perplexity and retrieval than H2O at equal cache sizes. Both are heuristics on the same signal, so one of them is
enough as the bar.

Between two steps the cache holds S + (W - 1) + M tokens (the next token brings its own key and value, the same
convention as the StreamingLLM baseline and the AarenCache window), so its bytes are :meth:`kv_bytes`; at equal
bytes to a student, :func:`equal_memory_retention` keeps the student's S and W and gives the rest to M.

Exactness: the forward gives the numbers of token-by-token decoding with that bounded cache (B sequences in
lock-step, the same position in all of them, no padding), so perplexity and teacher-forced recall scores are those
of a user running it. It is computed layer by layer: a layer's projections, rotary embedding, output projection and
MLP act on each position alone, and its keys depend only on the layer's input, so they go through all positions at
once (the teacher's own forward, ``use_cache=False``, natural positions); only the attention with its evictions runs
step by step (:meth:`TOVAState.scan`), in an attention function registered with transformers'
``AttentionInterface`` under the name ``"aaren_tova"``. Keys are kept already rotated at their own positions, so no
position bookkeeping is needed to attend to them (positions are recorded only to report what was kept). A test
checks it against a naive loop that re-runs the whole prefix at every step with per-layer masks. Any teacher whose
attention modules call ``ALL_ATTENTION_FUNCTIONS`` (Llama, Mistral, Qwen2/3, GPT-NeoX, ...) works. Cost on SmolLM2-135M
(1 thread): the teacher's own forward plus the scan, about 0.67 s of CPU per layer for 16 x 1,024 tokens (measured
on tensors of those shapes; 20 s for the 30 layers, against about 60 s for the teacher's forward itself).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from aaren_hf.modeling_aaren import MemoryCodes

from .evaluate import check_codes

__all__ = ["ATTENTION_NAME", "RetentionBaseline", "TOVAState", "equal_memory_retention", "retention_baseline"]

ATTENTION_NAME = "aaren_tova"


class TOVAState:
    """Settings of one :class:`RetentionBaseline` forward, and what each layer retained at its end."""

    def __init__(self, sinks: int, window: int, memory: int, codes: Optional[MemoryCodes] = None):
        self.sinks, self.window, self.memory = int(sinks), int(window), int(memory)
        self.codes = codes  # the cache's keys and values held in these codes (see StreamingLLMBaseline)
        self.memory_positions: dict[int, torch.Tensor] = {}  # layer -> [B, m] positions in the memory at the end

    @torch.no_grad()
    def scan(self, layer_idx: int, query, key, value, scaling: float) -> torch.Tensor:
        """A layer's attention for every position, step by step with the bounded cache.

        ``query`` [B, H, T, D], ``key``/``value`` [B, Hkv, T, D]: the layer's projections of all T positions, already
        rotated at their own positions (a layer's projections depend on the layer's input only, so computing them
        for all positions at once gives the same numbers as computing them one step at a time). Step t's query
        sees the sinks (positions < S), the memory, and the window (t - W, t]; after the step, the window's oldest
        token leaves: it joins the memory while there is room, else TOVA drops the candidate with the lowest
        weight from query t. Returns [B, T, H, D]."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the steps are tiny ops: intra-op threads only add waits (ms each on a busy CPU)
        try:
            return self._scan(layer_idx, query, key, value, scaling)
        finally:
            torch.set_num_threads(threads)

    def _scan(self, layer_idx: int, query, key, value, scaling: float) -> torch.Tensor:
        B, H, T, D = query.shape
        Hkv = key.shape[1]
        G = H // Hkv
        S, W, M = self.sinks, self.window, self.memory
        q = query.reshape(B, Hkv, G, T, D)  # grouped-query heads share their KV head
        mem_k = key.new_zeros(B, Hkv, M, D)
        mem_v = value.new_zeros(B, Hkv, M, D)
        mem_pos = torch.full((B, M), -1, dtype=torch.long, device=key.device)
        m = 0  # memory slots in use (the same in every sequence: lock-step decoding, no padding)
        out = query.new_empty(B, T, H, D)
        for t in range(T):
            lo = max(S, t - W + 1)  # first window position
            qt = q[:, :, :, t]  # [B, Hkv, G, D]: the G query heads of a KV head as rows, so keys are never copied
            parts_k = [key[:, :, : min(S, t + 1)], mem_k[:, :, :m], key[:, :, lo : t + 1]]
            parts_v = [value[:, :, : min(S, t + 1)], mem_v[:, :, :m], value[:, :, lo : t + 1]]
            sizes = [p.shape[2] for p in parts_k]
            scores = torch.cat([torch.matmul(qt, p.transpose(-1, -2)) for p in parts_k if p.shape[2]], -1)
            # softmax in float32, as transformers' eager attention does
            weights = torch.softmax(scores.float() * scaling, -1)  # [B, Hkv, G, n]
            o = sum(torch.matmul(w.to(value.dtype), p) for w, p in zip(weights.split(sizes, -1), parts_v) if p.shape[2])
            out[:, t] = o.reshape(B, H, D)
            leaving = t - W + 1  # leaves the window after this step (a sink never does)
            if leaving < S or M == 0:
                continue
            if m < M:  # room left: it joins the memory
                mem_k[:, :, m], mem_v[:, :, m], mem_pos[:, m] = key[:, :, leaving], value[:, :, leaving], leaving
                m += 1
                continue
            # TOVA: among the memory and the leaving token (first window key: index sizes[0] + M), evict the lowest
            # weight averaged over the layer's query heads; ties go to the first slot, the leaving token last
            score = weights[..., sizes[0] : sizes[0] + M + 1].mean((1, 2))  # [B, M + 1]
            victim = score.argmin(-1)  # [B]; M means the leaving token itself is dropped
            keep = victim == M
            slot = victim.clamp(max=M - 1)
            rows = torch.arange(B, device=key.device)
            new_k = torch.where(keep[:, None, None], mem_k[rows, :, slot], key[:, :, leaving])
            new_v = torch.where(keep[:, None, None], mem_v[rows, :, slot], value[:, :, leaving])
            mem_k[rows, :, slot], mem_v[rows, :, slot] = new_k, new_v
            mem_pos[rows, slot] = torch.where(keep, mem_pos[rows, slot], torch.full_like(slot, leaving))
        self.memory_positions[layer_idx] = mem_pos[:, :m]
        return out


def _tova_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, tova_state=None,
                    **kwargs):
    """``AttentionInterface`` entry: the whole sequence of one layer, scanned by ``tova_state`` (passed through the
    model's kwargs by :class:`RetentionBaseline`)."""
    if tova_state is None:
        raise RuntimeError(f"attn_implementation {ATTENTION_NAME!r} is driven by RetentionBaseline only")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if tova_state.codes is not None:
        key, value = (tova_state.codes.round(x.detach()).to(x.dtype) for x in (key, value))
    return tova_state.scan(module.layer_idx, query, key, value, scaling), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _tova_attention)


_register()


class _Output:
    """What the scorers read: ``.logits`` (and ``.loss`` for symmetry with transformers' outputs)."""

    def __init__(self, logits, loss=None):
        self.logits, self.loss = logits, loss


class RetentionBaseline(nn.Module):
    """The teacher, untrained, decoding token by token with S sinks + a W window + M TOVA-retained tokens per layer.

    ``forward(input_ids)`` returns ``.logits`` computed by that decoding (teacher-forced: each step reads the true
    token), so :func:`~aaren_hf.conversion.evaluate.recall_probe` scores it as is; ``logits_to_keep=k`` keeps only
    the last k positions (the other steps skip the LM head). :meth:`token_nll` gives per-token NLLs without holding
    [B, T, vocab] logits, which :func:`~aaren_hf.conversion.evaluate.perplexity` uses. Natural positions, as in the
    StreamingLLM baseline. ``memory=0`` is that baseline, computed by decoding instead of a mask. ``codes``: the cache
    holds its keys and values in these codes (as :class:`~aaren_hf.conversion.evaluate.StreamingLLMBaseline` does).
    """

    def __init__(self, teacher, sinks: int, window: int, memory: int, codes: Optional[MemoryCodes] = None):
        super().__init__()
        if sinks < 0 or window < 1 or memory < 0:
            raise ValueError(f"need sinks >= 0, window >= 1 and memory >= 0, got sinks={sinks}, window={window}, "
                             f"memory={memory}")
        check_codes(codes)
        self.teacher = teacher
        self.sinks, self.window, self.memory = int(sinks), int(window), int(memory)
        self.codes = codes
        self.last_state: Optional[TOVAState] = None  # the cache after the latest forward, for inspection

    @property
    def config(self):
        return self.teacher.config

    @property
    def kv_tokens(self) -> int:
        """Tokens held between steps: S sinks + W - 1 window tokens + M retained tokens."""
        return self.sinks + self.window - 1 + self.memory

    def kv_bytes(self, dtype: Optional[torch.dtype] = None) -> int:
        """Bytes of the bounded cache per sequence (``kv_tokens`` of the teacher's keys and values, in ``dtype``,
        default the teacher's). Positions are not counted: the kept keys are already rotated, the decoding needs
        none (they are kept here only for inspection)."""
        from .evaluate import teacher_kv_bytes_per_token

        dtype = dtype or next(self.teacher.parameters()).dtype
        return self.kv_tokens * teacher_kv_bytes_per_token(self.teacher.config, dtype)

    def _hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, T, hidden] (before the LM head) of the bounded-cache decoding, with a fresh
        :class:`TOVAState` (kept as ``last_state``)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        from .evaluate import attention_implementation

        state = TOVAState(self.sinks, self.window, self.memory, self.codes)
        self.last_state = state
        with attention_implementation(self.teacher, ATTENTION_NAME):
            # natural positions 0..T-1 (transformers' default without a cache); no mask: the scan is the mask
            return self.teacher.base_model(input_ids=input_ids, use_cache=False, tova_state=state).last_hidden_state

    @torch.no_grad()
    def forward(self, input_ids=None, labels=None, attention_mask=None, logits_to_keep: int = 0, **kwargs):
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
            raise ValueError("RetentionBaseline scores unpadded sequences only (no padding mask)")
        if labels is not None:
            raise ValueError("RetentionBaseline computes no loss; use evaluate.perplexity or token_nll")
        hidden = self._hidden(input_ids)
        if logits_to_keep:
            hidden = hidden[:, -int(logits_to_keep) :]
        return _Output(self.teacher.get_output_embeddings()(hidden))

    @torch.no_grad()
    def token_nll(self, input_ids: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """[B, T - 1] float64: -log p(token t+1 | tokens <= t) under the bounded-cache decoding, with the LM head
        applied ``chunk`` positions at a time (full [B, T, vocab] logits would take 3 GiB at 16 x 1024 tokens with
        a 49K vocabulary)."""
        hidden = self._hidden(input_ids[:, :-1])
        head = self.teacher.get_output_embeddings()
        nll = []
        for start in range(0, hidden.shape[1], chunk):
            logits = head(hidden[:, start : start + chunk]).float()  # float32, as perplexity() scores the others
            target = input_ids[:, start + 1 : start + 1 + chunk]
            nll.append(F.cross_entropy(logits.transpose(1, 2), target, reduction="none").double())
        return torch.cat(nll, 1)


def retention_baseline(teacher, sinks: int, window: int, memory: int,
                       codes: Optional[MemoryCodes] = None) -> RetentionBaseline:
    """The teacher with S sinks + a W window + M TOVA-retained tokens per layer; see :class:`RetentionBaseline`."""
    return RetentionBaseline(teacher, sinks, window, memory, codes)


def equal_memory_retention(student_config, teacher_config, sinks: int, window: Optional[int] = None,
                           kv_dtype: torch.dtype = torch.float32, baseline_dtype: Optional[torch.dtype] = None) -> dict:
    """S, W and M of a retention baseline whose cache (S + W - 1 + M teacher tokens) is at most the student's state
    bytes (:func:`~aaren_hf.conversion.evaluate.aaren_state_bytes`, whatever the student holds: Aaren state, window,
    memory tier). W defaults to the student's own window (so the baseline differs from the student only in what it
    keeps beyond the window), or, for a student without one, to half of the tokens the bytes buy; M takes the rest.
    When S + W - 1 alone exceed the bytes, W shrinks (``clamped``) and M is 0. ``baseline_dtype``: as in
    :func:`~aaren_hf.conversion.evaluate.equal_memory_window`."""
    from .evaluate import aaren_state_bytes, teacher_kv_bytes_per_token

    student_bytes = aaren_state_bytes(student_config, kv_dtype)
    per_token = teacher_kv_bytes_per_token(teacher_config, baseline_dtype or kv_dtype)
    tokens = student_bytes // per_token  # S + W - 1 + M at most
    if window is None:
        window = int(getattr(student_config, "window_size", 0) or 0) or max(1, (tokens - sinks) // 2 + 1)
    clamped = sinks + window - 1 > tokens
    if clamped:
        window = max(1, tokens - sinks + 1)
    memory = max(0, tokens - sinks - window + 1)
    return {
        "sinks": int(sinks),
        "window": int(window),
        "memory": int(memory),
        "student_state_bytes": int(student_bytes),
        "baseline_kv_bytes": int((sinks + window - 1 + memory) * per_token),
        "teacher_kv_bytes_per_token": int(per_token),
        "clamped": bool(clamped),
    }
