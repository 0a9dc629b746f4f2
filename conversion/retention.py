# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The memory tier's retention score, fitted to the teacher, and how much of the teacher's attention it keeps.

A token earns a place in the memory if queries that come after it has left the window still attend to it. On the
teacher's own attention (stage 1 captures its input), the target of token j for KV head h is

    log(1e-4 + max over queries t >= j + W, and heads of h's group, of attn[t, j])

the largest weight any query out of the window's reach gives it (max, not sum: one question that needs a passkey
counts as much as many queries that glance at a heading). A linear map of the mixer's input onto that target is
solved in closed form (ridge regression): no steps, no learning rate, a few milliseconds per layer.

``coverage`` is the measurement that chooses between rules: of the attention mass each query of the teacher puts
on tokens beyond its window (sinks excluded), the share that falls on the M tokens the rule keeps, computed with
the model's own selection (:func:`aaren_hf.modeling_aaren.memory_visibility`), so it is exactly what the student
will see.
"""

from __future__ import annotations

import torch

from aaren_hf.modeling_aaren import memory_seen, memory_visibility, rotate, round_retention

from .adapters import teacher_attention_scale, teacher_qkv

__all__ = ["beyond_window_mass", "coverage", "fit_retention", "rule_scores", "teacher_attention", "visible_share"]

FLOOR = 1e-4  # attention below this is noise for ranking purposes


@torch.no_grad()
def teacher_attention(teacher_layer, x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The teacher's causal attention probabilities [B, H, T, T] (float32) on attention inputs x [B, T, E]."""
    q, k, _ = teacher_qkv(teacher_layer, x.float())
    B, T, H, D = q.shape
    pos = torch.arange(T).expand(B, T)
    q, k = rotate(q, pos, inv_freq).float(), rotate(k, pos, inv_freq).float()
    k = k.repeat_interleave(H // k.shape[2], dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * teacher_attention_scale(teacher_layer, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)


def beyond_window_mass(attn: torch.Tensor, window: int, num_kv_heads: int) -> torch.Tensor:
    """[B, T, Hkv]: for each key, the largest weight a query at distance >= window gives it (max over the heads of
    the KV group); 0 where no query is that far."""
    B, H, T, _ = attn.shape
    t = torch.arange(T).view(-1, 1)
    far = (t - torch.arange(T).view(1, -1)) >= window
    mass = attn.masked_fill(~far, 0.0).amax(2)  # [B, H, T(key)]
    return mass.view(B, num_kv_heads, H // num_kv_heads, T).amax(2).transpose(1, 2)


@torch.no_grad()
def fit_retention(mixer, x: torch.Tensor, attn: torch.Tensor, ridge: float = 1e-3) -> dict:
    """Set ``mixer.retention_proj`` to the ridge-regression fit of log(FLOOR + beyond-window mass) on x.

    x [N, T, E] (the mixer's input), attn [N, H, T, T] (the teacher's attention on it). Keys that no query sees
    from beyond the window (the last W) and sinks are left out of the fit. Returns the fit's R^2."""
    W, S = mixer.window, mixer.num_sinks
    N, T, E = x.shape
    target = torch.log(FLOOR + beyond_window_mass(attn, W, mixer.num_kv_heads))  # [N, T, Hkv]
    rows = torch.zeros(T, dtype=torch.bool)
    rows[S : max(S, T - W)] = True
    X = x[:, rows].reshape(-1, E).double()
    X = torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], 1)
    Y = target[:, rows].reshape(X.shape[0], -1).double()
    gram = X.T @ X
    gram += ridge * gram.diagonal().mean() * torch.eye(E + 1, dtype=X.dtype)
    solution = torch.linalg.solve(gram, X.T @ Y)  # [E + 1, Hkv]
    proj = mixer.retention_proj
    proj.weight.copy_(solution[:E].T.to(proj.weight.dtype))
    proj.bias.copy_(solution[E].to(proj.bias.dtype))
    residual = (Y - X @ solution).pow(2).sum()
    total = (Y - Y.mean(0)).pow(2).sum()
    return {"r2": float(1 - residual / total), "tokens": int(X.shape[0])}


@torch.no_grad()
def rule_scores(mixer, x: torch.Tensor, rule: str) -> torch.Tensor:
    """[B, T, Hkv] retention scores of a rule for the mixer's input x: "learned" (the model's), "aaren" (the
    learned queries' highest score), "recent" (all equal: the memory extends the window), "random"."""
    B, T, _ = x.shape
    Hkv = mixer.num_kv_heads
    if rule == "recent":
        return torch.zeros(B, T, Hkv)
    if rule == "random":
        return torch.rand(B, T, Hkv, generator=torch.Generator().manual_seed(0))
    x = x.to(mixer.k_proj.weight.dtype)
    if rule == "learned":  # with the mixer's recency, at the positions of a window that starts the sequence
        return mixer.learned_retention(x, torch.arange(T).expand(B, T)).float()
    return mixer.slot_scores(mixer.keys(x)).view(B, T, Hkv, -1).amax(-1)


def _kept_by_memory(attn: torch.Tensor, scores: torch.Tensor, window: int, num_sinks: int,
                    memory_size: int) -> torch.Tensor:
    """[B, H, T, T] bool: the keys each query of ``attn`` sees in the memory under ``scores`` [B, T, Hkv], selected
    (and rounded) as the model selects them."""
    B, H, T, _ = attn.shape
    Hkv = scores.shape[-1]
    pos = torch.arange(T).expand(B, Hkv, T)
    last, evict = memory_visibility(pos, round_retention(scores).transpose(1, 2), 0, window, num_sinks, memory_size, T)
    kept = memory_seen(evict, last[:T])
    return kept.repeat_interleave(H // Hkv, dim=1)


@torch.no_grad()
def coverage(attn: torch.Tensor, scores: torch.Tensor, window: int, num_sinks: int, memory_size: int) -> float:
    """Share of the teacher's attention beyond the window (sinks excluded) that lands on the tokens the memory keeps
    under ``scores`` [B, T, Hkv] (rounded as the model rounds them)."""
    T = attn.shape[-1]
    visible = _kept_by_memory(attn, scores, window, num_sinks, memory_size)
    t, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    beyond = ((t - j) >= window) & (j >= num_sinks)
    total = attn.masked_fill(~beyond, 0.0).sum()
    return float(attn.masked_fill(~visible, 0.0).sum() / total) if total > 0 else float("nan")


@torch.no_grad()
def visible_share(attn: torch.Tensor, scores: torch.Tensor, window: int, num_sinks: int,
                  memory_size: int) -> torch.Tensor:
    """[H]: per head, the share of the teacher's attention (mean over queries) that falls on what the window branch
    sees: the last ``window`` tokens, the sinks, and the ``memory_size`` tokens kept under ``scores`` [B, T, Hkv]."""
    T = attn.shape[-1]
    t, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    seen = _kept_by_memory(attn, scores, window, num_sinks, memory_size) | ((t - j) < window) | (j < num_sinks)
    return attn.masked_fill(~seen, 0.0).sum(-1).mean((0, 2))
