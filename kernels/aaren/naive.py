# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Reference Aaren: the paper's per-token recurrence, written independently of ``aaren_hf.aaren_scan``.

State per head is the paper's ``(m, w, u)``: running max, denominator, numerator. Token t does::

    m <- m + g_t                       (decay the carried state; docs/aaren_math.md section 4)
    M  = max(m, s_t)
    w <- w * exp(m - M) + exp(s_t - M)
    u <- u * exp(m - M) + v_t * exp(s_t - M)
    o_t = u / w

Nothing is detached: autograd differentiates the literal recurrence. Slow (a Python loop over T); tests only.
Computes in float64 when given float64, otherwise in float32. ``chunk_size`` is accepted and ignored.
"""

import torch


def naive_aaren(s, v, g=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64):
    if cu_seqlens is not None:
        assert s.shape[0] == 1, "cu_seqlens needs a packed batch of size 1"
        bounds = cu_seqlens.tolist()
        outs, finals = [], []
        for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            h0 = None if initial_state is None else (initial_state[0][n : n + 1], initial_state[1][n : n + 1])
            o, ht = naive_aaren(s[:, a:b], v[:, a:b], None if g is None else g[:, a:b], h0, True)
            outs.append(o)
            finals.append(ht)
        ht = (torch.cat([f[0] for f in finals]), torch.cat([f[1] for f in finals]))
        return torch.cat(outs, dim=1), (ht if output_final_state else None)

    if v.shape[2] != s.shape[-1]:  # values shared by groups of op heads: op head h reads v head h // group
        v = torch.stack([v[:, :, h * v.shape[2] // s.shape[-1]] for h in range(s.shape[-1])], 2)
    B, T, H, D = v.shape
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    if initial_state is None:  # the empty state: m = -inf, w = 0, u = 0
        m = torch.full((B, H), float("-inf"), dtype=dt, device=v.device)
        w = torch.zeros(B, H, dtype=dt, device=v.device)
        u = torch.zeros(B, H, D, dtype=dt, device=v.device)
    else:  # (o0, lse0) is (m, w, u) = (lse0, 1, o0); exp(-inf - M) = 0 removes an empty one
        u, m = initial_state[0].to(dt), initial_state[1].to(dt)
        w = torch.ones_like(m)
    outs = []
    for t in range(T):
        if g is not None:
            m = m + g[:, t].to(dt)
        s_t = s[:, t].to(dt)
        M = torch.maximum(m, s_t)  # stays -inf while nothing has been seen
        M_safe = torch.where(torch.isfinite(M), M, torch.zeros_like(M))  # never exp(-inf - -inf)
        a_old, a_new = torch.exp(m - M_safe), torch.exp(s_t - M_safe)
        w = w * a_old + a_new
        u = u * a_old.unsqueeze(-1) + v[:, t].to(dt) * a_new.unsqueeze(-1)
        m = M
        outs.append(u / torch.where(w > 0, w, torch.ones_like(w)).unsqueeze(-1))  # 0 while nothing seen
    o = torch.stack(outs, dim=1) if outs else torch.zeros(B, 0, H, D, dtype=dt, device=v.device)
    w_safe = torch.where(w > 0, w, torch.ones_like(w))
    ht = (u / w_safe.unsqueeze(-1), torch.where(w > 0, m + torch.log(w_safe), torch.full_like(w, float("-inf"))))
    return o.to(v.dtype), (ht if output_final_state else None)
