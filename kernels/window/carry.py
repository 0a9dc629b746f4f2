# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""What a piece of tokens carries into the window branch's state, in Triton, for a GPU: the sinks' slots (which the
piece's own attention reads, so filled in training too, with a backward) and the window the next piece continues
from (prefill). ``fill_sinks`` and ``next_window`` in aaren_hf/modeling_aaren.py are the references, and
``prefill.c`` their CPU counterpart. The sinks' reference compares every position with every slot number, reduces,
gathers and selects (about twelve operators in a prefill or a training forward, ten more in backward) for S rows per
sequence; here one program per (sequence, slot) finds the token at that position and copies its key and value into
the slot (or keeps the slot's own), and backward writes the slots' gradients back to those tokens and zeros to every
other token (no fill before it). The next window's reference concatenates the held window with the piece's keys,
values, positions and scores, cuts and pads them (about nine operators); here one program per (sequence, window row)
copies the row from where it lies. The same bits.
"""

import torch
import triton
import triton.language as tl

from ..aaren.chunk import _MAX, get_kernel
from ..memory.codes import _cast


def _sinks_fwd_kernel(k, v, pos, old_k, old_v, old_pos, new_k, new_v, new_pos, at, T,
                      S: tl.constexpr, E: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    # the token at position s (positions are unique in a row, padding is -1), or -1
    found = tl.full([], -1, tl.int64)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        p = tl.load(pos + b * T + t, mask=t < T, other=-1)
        found = tl.maximum(found, tl.reduce(tl.where(p == s, t.to(tl.int64), -1), 0, _MAX))
    e = tl.arange(0, BE)
    m_e = e < E
    slot = (b * S + s) * E + e
    if found >= 0:
        tl.store(new_k + slot, _cast(tl.load(k + (b * T + found) * E + e, mask=m_e).to(tl.float32),
                                     new_k.dtype.element_ty), mask=m_e)
        tl.store(new_v + slot, _cast(tl.load(v + (b * T + found) * E + e, mask=m_e).to(tl.float32),
                                     new_v.dtype.element_ty), mask=m_e)
        tl.store(new_pos + b * S + s, s.to(tl.int64))
    else:
        tl.store(new_k + slot, tl.load(old_k + slot, mask=m_e), mask=m_e)
        tl.store(new_v + slot, tl.load(old_v + slot, mask=m_e), mask=m_e)
        tl.store(new_pos + b * S + s, tl.load(old_pos + b * S + s))
    tl.store(at + b * S + s, found)


def _sinks_bwd_kernel(dnew_k, dnew_v, at, dk, dv, T, S: tl.constexpr, E: tl.constexpr, BE: tl.constexpr,
                      BT: tl.constexpr):
    # every row of dk and dv, so nothing zeroes them first: a found slot's gradient at its token (one token per slot,
    # one slot per token), zero elsewhere
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    e = tl.arange(0, BE)
    m = (t < T)[:, None] & (e < E)[None, :]
    grad_k = tl.full([BT, BE], 0.0, tl.float32)
    grad_v = tl.full([BT, BE], 0.0, tl.float32)
    for s in range(S):
        hit = (t == tl.load(at + b * S + s))[:, None] & (e < E)[None, :]
        slot = (b * S + s) * E + e
        grad_k = tl.where(hit, tl.load(dnew_k + slot, mask=e < E, other=0).to(tl.float32)[None, :], grad_k)
        grad_v = tl.where(hit, tl.load(dnew_v + slot, mask=e < E, other=0).to(tl.float32)[None, :], grad_v)
    rows = (b * T + t)[:, None] * E + e[None, :]
    tl.store(dk + rows, _cast(grad_k, dk.dtype.element_ty), mask=m)
    tl.store(dv + rows, _cast(grad_v, dv.dtype.element_ty), mask=m)


class SinksFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, pos, old_k, old_v, old_pos):
        B, T, Hkv, D = k.shape
        S, E = old_k.shape[1], Hkv * D
        k, v, pos = k.contiguous(), v.contiguous(), pos.contiguous()
        old_k, old_v, old_pos = old_k.contiguous(), old_v.contiguous(), old_pos.contiguous()
        new_k, new_v, new_pos = torch.empty_like(old_k), torch.empty_like(old_v), torch.empty_like(old_pos)
        at = torch.empty(B, S, dtype=torch.int64, device=k.device)
        get_kernel(_sinks_fwd_kernel, key=("S", "E"), warps=(4,), stages=(1,))[(B, S)](
            k, v, pos, old_k, old_v, old_pos, new_k, new_v, new_pos, at, T, S=S, E=E,
            BE=triton.next_power_of_2(E), BT=min(1024, triton.next_power_of_2(max(T, 1))))
        ctx.save_for_backward(at)
        ctx.shape, ctx.dtypes = k.shape, (k.dtype, v.dtype)
        ctx.mark_non_differentiable(new_pos)
        return new_k, new_v, new_pos

    @staticmethod
    def backward(ctx, dnew_k, dnew_v, _):
        (at,) = ctx.saved_tensors
        B, T, Hkv, D = ctx.shape
        S = at.shape[1]
        dk = dv = dold_k = dold_v = None
        if dnew_k is None:
            dnew_k = torch.zeros(B, S, Hkv, D, dtype=ctx.dtypes[0], device=at.device)
        if dnew_v is None:
            dnew_v = torch.zeros(B, S, Hkv, D, dtype=ctx.dtypes[1], device=at.device)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dk = torch.empty(ctx.shape, dtype=ctx.dtypes[0], device=at.device)
            dv = torch.empty(ctx.shape, dtype=ctx.dtypes[1], device=at.device)
            BE = triton.next_power_of_2(Hkv * D)
            BT = max(1, 4096 // BE)
            get_kernel(_sinks_bwd_kernel, key=("S", "E"), warps=(4,), stages=(1,))[(B, triton.cdiv(T, BT))](
                dnew_k.contiguous(), dnew_v.contiguous(), at, dk, dv, T, S=S, E=Hkv * D, BE=BE, BT=BT)
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
            kept = (at < 0).view(B, S, 1, 1)  # the slots that kept their old key and value
            dold_k = torch.where(kept, dnew_k, 0) if ctx.needs_input_grad[3] else None
            dold_v = torch.where(kept, dnew_v, 0) if ctx.needs_input_grad[4] else None
        return (dk if ctx.needs_input_grad[0] else None, dv if ctx.needs_input_grad[1] else None, None,
                dold_k, dold_v, None)


def sinks_triton(k, v, pos, sink_k, sink_v, sink_pos):
    """The sinks after this piece: slot s takes the key and value (in the slots' dtype) of the token at position s
    where the piece has one, else keeps its own; its position becomes s. k, v [B, T, Hkv, D] (k rotated and rounded
    as the window stores it), pos [B, T] int64 (-1: padding), sink_k, sink_v [B, S, Hkv, D], sink_pos [B, S]. New
    tensors (sink_k, sink_v, sink_pos); gradients flow to k, v and the old slots. None where the kernel does not take
    the inputs."""
    B, T, Hkv, D = k.shape
    S = sink_k.shape[1]
    if (S == 0 or v.shape != k.shape or sink_k.shape != (B, S, Hkv, D) or sink_v.shape != sink_k.shape
            or sink_pos.shape != (B, S) or pos.shape != (B, T) or pos.dtype != torch.int64
            or sink_pos.dtype != torch.int64
            or any(t.dtype not in (torch.float32, torch.bfloat16, torch.float16) for t in (k, v, sink_k, sink_v))):
        return None
    return SinksFunction.apply(k, v, pos, sink_k, sink_v, sink_pos)


def _next_window_kernel(k_prev, v_prev, pos_prev, k, v, pos, score, win_k, win_v, win_pos, win_score, Wp, T, first,
                        short, W1, HKV: tl.constexpr, E: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr,
                        HAS_SCORE: tl.constexpr):
    # row i of the new window: padding (its first `short` rows), else row first + i - short of the stream (the held
    # window's Wp rows, then this piece's T tokens)
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    e = tl.arange(0, BE)
    m_e = e < E
    h = tl.arange(0, BH)
    m_h = h < HKV
    row = b * W1 + i
    j = (first + i - short).to(tl.int64)
    if i < short:
        tl.store(win_k + row * E + e, tl.full([BE], 0.0, tl.float32).to(win_k.dtype.element_ty), mask=m_e)
        tl.store(win_v + row * E + e, tl.full([BE], 0.0, tl.float32).to(win_v.dtype.element_ty), mask=m_e)
        tl.store(win_pos + row, tl.full([], -1, tl.int64))
    elif j < Wp:
        tl.store(win_k + row * E + e, tl.load(k_prev + (b * Wp + j) * E + e, mask=m_e), mask=m_e)
        tl.store(win_v + row * E + e, tl.load(v_prev + (b * Wp + j) * E + e, mask=m_e), mask=m_e)
        tl.store(win_pos + row, tl.load(pos_prev + b * Wp + j))
    else:
        t = j - Wp
        tl.store(win_k + row * E + e, _cast(tl.load(k + (b * T + t) * E + e, mask=m_e).to(tl.float32),
                                            win_k.dtype.element_ty), mask=m_e)
        tl.store(win_v + row * E + e, _cast(tl.load(v + (b * T + t) * E + e, mask=m_e).to(tl.float32),
                                            win_v.dtype.element_ty), mask=m_e)
        tl.store(win_pos + row, tl.load(pos + b * T + t))
    if HAS_SCORE:
        got = tl.load(score + (b * (Wp + T) + j) * HKV + h, mask=m_h & (h * 0 + i >= short), other=float("-inf"))
        tl.store(win_score + row * HKV + h, got, mask=m_h)


def next_window_triton(k_prev, v_prev, pos_prev, k, v, pos, window, stream_score=None):
    """The window after this piece: its last W - 1 stream rows (the held window k_prev, v_prev [B, Wp, Hkv, D] in
    the cache's dtype, pos_prev [B, Wp], then this piece's k, v [B, T, Hkv, D] in the cache's dtype's values and pos
    [B, T]), fewer than W - 1 padded at the front (zeros, position -1, score -inf); with ``stream_score`` [B, Wp + T,
    Hkv] float32 their scores too. {"k", "v", "pos"[, "score"]}, no gradient; None where the kernel does not take the
    inputs."""
    B, Wp, Hkv, D = k_prev.shape
    T = k.shape[1]
    if (window < 2 or k.shape != (B, T, Hkv, D) or v.shape != k.shape or v_prev.shape != k_prev.shape
            or pos_prev.shape != (B, Wp) or pos.shape != (B, T) or pos.dtype != torch.int64
            or pos_prev.dtype != torch.int64
            or (stream_score is not None and (stream_score.shape != (B, Wp + T, Hkv)
                                              or stream_score.dtype != torch.float32))
            or any(t.dtype not in (torch.float32, torch.bfloat16, torch.float16) for t in (k, v, k_prev, v_prev))):
        return None
    W1, held = window - 1, Wp + T
    first, short = max(0, held - W1), max(0, W1 - held)
    dev = k.device
    out = {"k": torch.empty(B, W1, Hkv, D, dtype=k_prev.dtype, device=dev),
           "v": torch.empty(B, W1, Hkv, D, dtype=v_prev.dtype, device=dev),
           "pos": torch.empty(B, W1, dtype=torch.int64, device=dev)}
    if stream_score is not None:
        out["score"] = torch.empty(B, W1, Hkv, dtype=torch.float32, device=dev)
    if B:
        args = [t.detach().contiguous() for t in (k_prev, v_prev, pos_prev, k, v, pos)]
        score = stream_score.contiguous() if stream_score is not None else out["pos"]  # not read without scores
        get_kernel(_next_window_kernel, key=("HKV", "E", "HAS_SCORE"), warps=(4,), stages=(1,))[(B, W1)](
            *args, score, out["k"], out["v"], out["pos"], out.get("score", out["pos"]), Wp, T, first, short, W1,
            HKV=Hkv, E=Hkv * D, BE=triton.next_power_of_2(Hkv * D), BH=triton.next_power_of_2(Hkv),
            HAS_SCORE=stream_score is not None)
    return out
