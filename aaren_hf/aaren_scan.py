# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The Aaren scan in plain PyTorch: the path that runs everywhere (CPU, any GPU, no Triton).

This file is copied next to ``modeling_aaren.py`` when a checkpoint is saved, so it must stay self-contained.

Op, shared by every implementation (here and in ``aaren_hf.kernels``)::

    o, final_state = op(s, v, g=None, initial_state=None, output_final_state=False, cu_seqlens=None)

    s  [B, T, H]      scores <q_h, k_t> * scale; -inf marks a token that must not count (padding)
    v  [B, T, Hv, D]  values; Hv divides H, op head h reads value head h // (H / Hv) (op heads that share their
                      values, as a kv head's query heads and slots do, are not handed H / Hv copies)
    g  [B, T, H]      log-decay <= 0, applied to the carried state before token t is added (None: no decay)
    state = (o [B, H, D], lse [B, H]), float32: the running softmax-weighted mean of the values and the
            log of its normaliser. lse = -inf is the empty state (o = 0 there).
    o  [B, T, H, D]   o_t = sum_{i<=t} exp(s_i + G_it) v_i / sum_{i<=t} exp(s_i + G_it), G_it = g_{i+1} + ... + g_t;
                      0 while nothing has been seen.

The state is kept in the normalised form (o, lse) rather than (m, w, u): o is a convex combination of values, so
it never overflows, and every weight formed below is exp(x - max) <= 1.

Maxima used only as stabilisers are detached: the results do not depend on them, and detaching keeps the
gradient exactly the softmax gradient without routing anything through argmax.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

State = Tuple[torch.Tensor, torch.Tensor]


def empty_state(batch: int, heads: int, head_dim: int, device=None) -> State:
    o = torch.zeros(batch, heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.full((batch, heads), float("-inf"), dtype=torch.float32, device=device)
    return o, lse


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> State:
    """Combine two disjoint sets of tokens given as (mean value, log normaliser). Empty sets have lse = -inf; the
    first one's mean must then be 0 (two empty sets give o_a)."""
    m = torch.maximum(lse_a, lse_b).detach()
    m_safe = m.clamp(min=torch.finfo(m.dtype).min)  # both empty: weights exp(-inf - finite) = 0, not -inf - -inf
    w_a = torch.exp(lse_a - m_safe)
    w_b = torch.exp(lse_b - m_safe)
    # the larger side weighs exp(0) = 1, so w >= 1 unless both are empty (w = 0: divide by 1, lse = m = -inf)
    w = (w_a + w_b).clamp(min=1.0)
    # o_a + (w_b / w) (o_b - o_a): one op for the mixture (a share of 1, the empty a, gives o_b exactly)
    return torch.lerp(o_a, o_b, (w_b / w).unsqueeze(-1)), m + torch.log(w)


def aaren_step(state: State, s: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor] = None):
    """One token: s [B, H], v [B, H, D], g [B, H] or None. Returns (o_t [B, H, D] float32, new state)."""
    o, lse = state
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    if g is not None:
        lse = lse + g.to(acc)
    o, lse = merge_states(o.to(acc), lse.to(acc), v.to(acc), s.to(acc))
    return o, (o, lse)


def values_per_op_head(s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """v [B, T, Hv, D] as [B, T, H, D], H = s.shape[-1]: the references' reading of shared values (a copy)."""
    return v if v.shape[2] == s.shape[-1] else v.repeat_interleave(s.shape[-1] // v.shape[2], 2)


def recurrent_aaren_torch(
    s: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
):
    """Token by token: the decode path (T is usually 1) and a readable reference."""
    if cu_seqlens is not None:
        return _over_sequences(recurrent_aaren_torch, s, v, g, initial_state, output_final_state, cu_seqlens)
    v = values_per_op_head(s, v)
    B, T, H, D = v.shape
    state = initial_state if initial_state is not None else empty_state(B, H, D, v.device)
    outs = []
    for t in range(T):
        o_t, state = aaren_step(state, s[:, t], v[:, t], None if g is None else g[:, t])
        outs.append(o_t)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, D, dtype=torch.float32)
    return o.to(v.dtype), (state if output_final_state else None)


def chunk_aaren_torch(
    s: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    chunk_size: int = 64,
):
    """Chunked parallel form: C x C weights inside each chunk (all chunks at once); the state entering each chunk
    comes from the same scan run over the chunk summaries, so the number of operations grows with log_C(T), not T.

    Memory is O(B * T * H * C), never T x T.
    """
    if cu_seqlens is not None:
        return _over_sequences(chunk_aaren_torch, s, v, g, initial_state, output_final_state, cu_seqlens, chunk_size)
    v = values_per_op_head(s, v)
    B, T, H, D = v.shape
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32  # float64 only for reference checks
    s_ = s.to(acc).transpose(1, 2)  # [B, H, T]
    v_ = v.to(acc).transpose(1, 2)  # [B, H, T, D]
    g_ = None if g is None else g.to(acc).transpose(1, 2)
    o_init, lse_init = initial_state if initial_state is not None else empty_state(B, H, D, v.device)
    o, lse = scan_states(s_, v_, g_, o_init.to(acc), lse_init.to(acc), chunk_size)
    final = (o[:, :, -1], lse[:, :, -1]) if T > 0 else (o_init.to(acc), lse_init.to(acc))
    return o.transpose(1, 2).to(v.dtype), (final if output_final_state else None)


def chunk_logits(s, g):
    """Log-weights inside each chunk: s, g [..., N, C] -> (logits [..., N, C(t), C(i)], b [..., N, C]), where
    logits = s_i + b_t - b_i for i <= t (-inf above the diagonal) and b is the decay accumulated inside the chunk.
    Built pairwise so that large decays never get added to and subtracted from a score (that would cost fp32
    precision)."""
    C = s.shape[-1]
    b = torch.cumsum(g, dim=-1)
    logits = s.unsqueeze(-2) + (b.unsqueeze(-1) - b.unsqueeze(-2))
    causal = torch.ones(C, C, dtype=torch.bool, device=s.device).tril()
    return logits.masked_fill(~causal, float("-inf")), b


def scan_states(s, v, g, o_init, lse_init, C):
    """Inclusive scan in [B, H, T] layout: returns (o, lse) after every token, both [B, H, T(, D)]."""
    B, H, T, D = v.shape
    N = max(1, -(-T // C))
    pad = N * C - T
    g = torch.zeros_like(s) if g is None else g
    if pad:
        s = F.pad(s, (0, pad), value=float("-inf"))
        v = F.pad(v, (0, 0, 0, pad))
        g = F.pad(g, (0, pad))
    v = v.reshape(B, H, N, C, D)
    logits, b = chunk_logits(s.reshape(B, H, N, C), g.reshape(B, H, N, C))
    m = logits.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    a = torch.exp(logits - m)  # entries <= 1
    w = a.sum(-1)
    nonempty = w > 0
    w_safe = torch.where(nonempty, w, torch.ones_like(w))
    o_loc = (a @ v) / w_safe.unsqueeze(-1)
    lse_loc = torch.where(nonempty, m.squeeze(-1) + torch.log(w_safe), torch.full_like(w, float("-inf")))

    # State entering chunk n. Chunk summaries behave like tokens (score lse, value o) whose carried state decays by
    # the chunk's total log-decay before they are added, so the carry is the same scan over N summaries.
    if N == 1:
        o_in, lse_in = o_init.unsqueeze(2), lse_init.unsqueeze(2)
    else:
        # (chunks of at least 16 summaries, so that the recursion shrinks even for tiny chunk sizes)
        summaries = (lse_loc[..., -1], o_loc[..., -1, :], b[..., -1])
        o_sum, lse_sum = scan_states(*summaries, o_init, lse_init, max(C, 16))
        o_in = torch.cat([o_init.unsqueeze(2), o_sum[:, :, :-1]], 2)
        lse_in = torch.cat([lse_init.unsqueeze(2), lse_sum[:, :, :-1]], 2)
    # the carried state first, as aaren_step merges it with a token: the same rounding
    o, lse = merge_states(o_in.unsqueeze(3).expand_as(o_loc), lse_in.unsqueeze(3) + b, o_loc, lse_loc)
    return o.reshape(B, H, N * C, D)[:, :, :T], lse.reshape(B, H, N * C)[:, :, :T]


def chunk_aaren_mixed(
    s: torch.Tensor,
    v: torch.Tensor,
    mix: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
):
    """The model's read of the scan: per query head, its J slots' outputs mixed by ``mix``, the values shared by the
    query heads of one kv head. Equals ``sum_j mix[..., j] * chunk_aaren_torch(s, v repeated per op head)`` without
    ever forming the per-slot outputs [B, T, H * J, D] or the repeated values: inside a chunk the J slots' weight
    matrices are mixed first (C x C each, no D), then one product per (kv head, chunk) reads v once.

    s [B, T, Hkv * G * J] (op heads ordered kv head, query head in its group, slot), v [B, T, Hkv, D],
    mix [B, T, Hkv * G, J] (rows sum to 1), g like s or None, state as in the op (per op head).
    Returns (out [B, T, Hkv * G, D] in v's dtype, final state or None).
    """
    B, T, Hkv, D = v.shape
    J = mix.shape[-1]
    HJ = s.shape[-1]
    G, C = HJ // (Hkv * J), chunk_size
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    N = max(1, -(-T // C))
    pad = N * C - T
    s_ = F.pad(s.to(acc).transpose(1, 2), (0, pad), value=float("-inf")).view(B, HJ, N, C)
    g_ = torch.zeros_like(s_) if g is None else F.pad(g.to(acc).transpose(1, 2), (0, pad)).view(B, HJ, N, C)
    v_ = F.pad(v.to(acc).permute(0, 2, 1, 3), (0, 0, 0, pad)).view(B, Hkv, N, C, D)
    mix_ = F.pad(mix.to(acc).permute(0, 2, 3, 1), (0, pad)).view(B, Hkv, G, J, N, C)
    o_init, lse_init = initial_state if initial_state is not None else empty_state(B, HJ, D, v.device)
    o_init, lse_init = o_init.to(acc), lse_init.to(acc)

    logits, b = chunk_logits(s_, g_)  # [B, HJ, N, C(t), C(i)], [B, HJ, N, C]

    # State entering each chunk: the scan over the chunks' own summaries (their last token without the carry).
    last = logits[..., -1, :]  # [B, HJ, N, C]
    m_last = last.amax(-1, keepdim=True).detach()
    w_last = torch.exp(last - torch.where(torch.isfinite(m_last), m_last, torch.zeros_like(m_last)))
    z = w_last.sum(-1)
    nonempty = z > 0  # an empty chunk (every score -inf) has lse -inf, and no log(0) in its gradient
    z_safe = torch.where(nonempty, z, torch.ones_like(z))
    lse_sum = torch.where(nonempty, m_last.squeeze(-1) + torch.log(z_safe), torch.full_like(z, float("-inf")))
    w_last = (w_last / z_safe.unsqueeze(-1)).view(B, Hkv, G * J, N, C)
    o_sum = torch.matmul(w_last.transpose(2, 3), v_).transpose(2, 3)  # [B, Hkv, GJ, N, D]
    o_scan, lse_scan = scan_states(lse_sum, o_sum.reshape(B, HJ, N, D), b[..., -1], o_init, lse_init, max(C, 16))
    o_in = torch.cat([o_init.unsqueeze(2), o_scan[:, :, :-1]], 2)  # [B, HJ, N, D]
    lse_in = torch.cat([lse_init.unsqueeze(2), lse_scan[:, :, :-1]], 2).unsqueeze(-1) + b  # [B, HJ, N, C]

    # Token t of chunk n: weights exp(logits - m) on the chunk's tokens, exp(lse_in - m) on the carried state.
    m = torch.maximum(logits.amax(-1), lse_in).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    weights = torch.exp(logits - m.unsqueeze(-1))
    carry = torch.exp(lse_in - m)
    total = (weights.sum(-1) + carry).clamp(min=1.0)  # the largest weight is 1 unless nothing is seen yet
    share = mix_.view(B, HJ, N, C) / total  # [B, HJ, N, C]: slot j's share of query head h, over its normaliser
    mixed = (weights * share.unsqueeze(-1)).view(B, Hkv, G, J, N, C, C).sum(3)  # [B, Hkv, G, N, C, C]
    out = torch.matmul(mixed.transpose(2, 3).reshape(B, Hkv, N, G * C, C), v_)  # [B, Hkv, N, G * C, D]
    carried = (carry * share).view(B, Hkv, G, J, N, C).permute(0, 1, 2, 4, 5, 3)  # [B, Hkv, G, N, C, J]
    out = out.view(B, Hkv, N, G, C, D).transpose(2, 3) + torch.matmul(carried, o_in.view(B, Hkv, G, J, N, D)
                                                                      .transpose(3, 4))
    out = out.reshape(B, Hkv * G, N * C, D)[:, :, :T].transpose(1, 2).to(v.dtype)
    final = (o_scan[:, :, -1], lse_scan[:, :, -1]) if output_final_state else None
    return out, final


def _over_sequences(fn, s, v, g, initial_state, output_final_state, cu_seqlens, *args):
    """Packed variable-length batch (B == 1): run each sequence on its own, each from its own initial state."""
    if s.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a packed batch of size 1, got batch size {s.shape[0]}")
    outs, finals_o, finals_lse = [], [], []
    bounds = cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = None if initial_state is None else (initial_state[0][i : i + 1], initial_state[1][i : i + 1])
        o, final = fn(
            s[:, start:end], v[:, start:end], None if g is None else g[:, start:end], init, True, None, *args
        )
        outs.append(o)
        finals_o.append(final[0])
        finals_lse.append(final[1])
    o = torch.cat(outs, dim=1)
    final = (torch.cat(finals_o), torch.cat(finals_lse)) if output_final_state else None
    return o, final
