# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The window branch's attention for training and prefill in Triton, forward and backward: each query attends, in one
softmax, over the last W tokens of the stream, the memory candidates it sees and the sink tokens it sees.
Reference: ``window_attention`` in ``aaren_hf/modeling_aaren.py`` (its PyTorch path, which gathers every block's keys
and values and builds its mask before one fused attention call).

Here nothing is gathered and no mask is built: program (query block, sequence x head) reads the window's keys where
they lie in the stream, the memory's through the short list of candidates its block may see (``_memory_blocks``:
at most M + BQ), and decides what each query sees from positions and indices as it goes:

    window    stream row r, query i (stream row P0 + i):  P0 + i - W < r <= P0 + i  and  pos[r] >= 0
    memory    candidate c:                                c <= last[i] < evict[c]          (memory_visibility)
    sinks     sink s: its score (a rotated query's dot with the sink key, computed outside: the query is rotated
              to another position for it) and whether query i sees it

Online softmax in float32 (scores, running max and sum, output); what is saved for backward is the inputs, o and the
per-row log-sum-exp. In a layer with an Aaren branch the output may leave mixed with that branch's (``mix``:
``mix_branches``' lerp and its gradients, autograd's formulas and roundings, formed in the backward kernel): then o
is not kept but rebuilt in backward, in registers, from the mixed output, which the layer's output projection keeps
anyway, and the branches' difference, which the gate's gradient reads: two tensors of the output's size kept, where
the two steps apart keep three (o, the Aaren output, the mixed output). The queries may come as they were projected,
with their rotary angles: each program turns its block as it reads it, so no turned copy is written, nor kept for
training (a layer's largest input). The backward recomputes the probabilities from the lse, writes dq per program and
adds dk and dv of the keys it read with float32 atomics (a key is read by up to two blocks of the window and by every
block of its memory stretch, for each of the G query heads of its kv head).

Loads are converted to float32; dots run as the scan's do (``_dot_precision``: "ieee" for float32 inputs, tf32 for
16-bit ones where the GPU has it).
"""

import torch
import triton
import triton.language as tl

from .. import WINDOW_BLOCK as BQ  # queries per program; the memory's candidate lists are per block of BQ queries
from ..aaren.chunk import _ADD, _MAX, _dot_precision, device_function, get_kernel
from ..memory.codes import _cast, _rounded
from . import checked_angles
from .rotate import _angles, _rotated, rotate_triton
BK = 64  # keys per tile


@device_function
def _softmax_step(m, l_sum, s):
    """One tile of an online softmax: scores s [R, N] (-inf: not seen) against the running max m and sum l_sum [R].
    Returns (new max, the factor earlier sums scale by, the tile's weights [R, N], new sum)."""
    m_new = tl.maximum(m, tl.reduce(s, 1, _MAX))
    base = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing seen yet: never -inf - -inf
    p = tl.exp(s - base[:, None])
    alpha = tl.exp(m - base)
    return m_new, alpha, p, l_sum * alpha + tl.reduce(p, 1, _ADD)


@device_function
def _query_block(q, qpos, cos, sin, T, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                 BQ: tl.constexpr, ROT: tl.constexpr):
    """This program's block of queries: (block, sequence, head, kv head, rows, rows < T, cols, cols < D, their
    positions (-1 past T), real tokens (padding queries see nothing: o = 0), offsets of the rows in [B, T, H], the
    queries in float32, turned by the angles cos, sin [B, T, ROT] where ROT > 0)."""
    i_q = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // H
    h = i_bh % H
    hk = h // (H // HKV)
    rows = i_q * BQ + tl.arange(0, BQ)
    m_q = rows < T
    cols = tl.arange(0, BD)
    m_d = cols < D
    qp = tl.load(qpos + b * T + rows, mask=m_q, other=-1)
    valid = m_q & (qp >= 0)
    row_off = (b.to(tl.int64) * T + rows) * H + h
    if ROT > 0:  # rounded to q's dtype, as rotate_by rounds: the turned queries are never stored
        c, s = _angles(cos, sin, (b.to(tl.int64) * T + rows)[:, None] * ROT, m_q[:, None], cols[None, :], ROT)
        b_q = _rotated(q, row_off[:, None] * D, m_q[:, None], cols[None, :], c, s, D, ROT)
        b_q = _rounded(b_q, q.dtype.element_ty)
    else:
        b_q = tl.load(q + row_off[:, None] * D + cols[None, :], mask=m_q[:, None] & m_d[None, :], other=0)
        b_q = b_q.to(tl.float32)
    return i_q, b, hk, rows, m_q, cols, m_d, qp, valid, row_off, b_q


@device_function
def _attend(b_q, b_k, b_v, seen, m_i, l_i, acc, scale, DOT_PREC: tl.constexpr):
    """The forward's step over one tile of keys [BK, BD] and values, ``seen`` [BQ, BK]: (m_i, l_i, acc) updated."""
    s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision=DOT_PREC) * scale
    m_i, alpha, p, l_i = _softmax_step(m_i, l_i, tl.where(seen, s, float("-inf")))
    acc = acc * alpha[:, None]
    acc += tl.dot(p, b_v.to(tl.float32), input_precision=DOT_PREC)
    return m_i, l_i, acc


@device_function
def _attend_backward(b_q, b_do, b_k, b_v, seen, b_lse, b_delta, scale, DOT_PREC: tl.constexpr):
    """The backward's weights p and score gradients ds [BQ, BK] of one tile of keys and values (float32)."""
    s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * scale
    p = tl.where(seen, tl.exp(s - b_lse[:, None]), 0.0)
    return p, p * (tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC) - b_delta[:, None]) * scale


def _window_fwd_kernel(
    q, qpos, cos, sin, ks, vs, spos, mk, mv, evict, last, idx, counts, sink_s, sink_v, sink_pos, o, lse,
    T, Ls, P0, W, C, K, NB, scale,
    H: tl.constexpr, HKV: tl.constexpr, S: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BQ: tl.constexpr,
    BK: tl.constexpr, HAS_MEM: tl.constexpr, DOT_PREC: tl.constexpr, ROT: tl.constexpr,
):
    i_q, b, hk, rows, m_q, cols, m_d, qp, valid, row_off, b_q = _query_block(q, qpos, cos, sin, T, H, HKV, D, BD,
                                                                              BQ, ROT)
    m_i = tl.full([BQ], float("-inf"), tl.float32)
    l_i = tl.full([BQ], 0.0, tl.float32)
    acc = tl.full([BQ, BD], 0.0, tl.float32)

    me = P0 + rows  # each query's own stream row
    lo = tl.maximum(P0 + i_q * BQ - W + 1, 0)
    hi = tl.minimum(P0 + i_q * BQ + BQ, Ls)
    for start in range(lo, hi, BK):
        r = start + tl.arange(0, BK)
        m_r = r < hi
        kv_off = (b.to(tl.int64) * Ls + r) * HKV + hk
        kp = tl.load(spos + b.to(tl.int64) * Ls + r, mask=m_r, other=-1)
        b_k = tl.load(ks + kv_off[:, None] * D + cols[None, :], mask=m_r[:, None] & m_d[None, :], other=0)
        b_v = tl.load(vs + kv_off[:, None] * D + cols[None, :], mask=m_r[:, None] & m_d[None, :], other=0)
        seen = valid[:, None] & (r[None, :] <= me[:, None]) & (r[None, :] > me[:, None] - W) & (kp[None, :] >= 0)
        m_i, l_i, acc = _attend(b_q, b_k, b_v, seen, m_i, l_i, acc, scale, DOT_PREC)

    if HAS_MEM:
        l_q = tl.load(last + rows, mask=m_q, other=-1)
        n_k = tl.load(counts + i_q)
        list_off = ((b.to(tl.int64) * NB + i_q) * HKV + hk) * K
        row_c = (b.to(tl.int64) * HKV + hk) * C
        for start in range(0, n_k, BK):
            kk = start + tl.arange(0, BK)
            m_k = kk < n_k
            c = tl.load(idx + list_off + kk, mask=m_k, other=0)
            ends = tl.load(evict + row_c + c, mask=m_k, other=-1)
            b_k = tl.load(mk + (row_c + c)[:, None] * D + cols[None, :], mask=m_k[:, None] & m_d[None, :], other=0)
            b_v = tl.load(mv + (row_c + c)[:, None] * D + cols[None, :], mask=m_k[:, None] & m_d[None, :], other=0)
            seen = valid[:, None] & m_k[None, :] & (c[None, :] <= l_q[:, None]) & (l_q[:, None] < ends[None, :])
            m_i, l_i, acc = _attend(b_q, b_k, b_v, seen, m_i, l_i, acc, scale, DOT_PREC)

    for j in range(S):
        sc = tl.load(sink_s + row_off * S + j, mask=m_q, other=0).to(tl.float32) * scale
        sp = tl.load(sink_pos + b.to(tl.int64) * S + j) + 0 * qp  # per row: the interpreter mishandles a scalar
        seen = valid & (sp >= 0) & (sp <= qp - W)  # a filled sink, outside the query's window
        sv = tl.load(sink_v + ((b.to(tl.int64) * S + j) * HKV + hk) * D + cols, mask=m_d, other=0).to(tl.float32)
        m_i, alpha, p, l_i = _softmax_step(m_i, l_i, tl.where(seen, sc, float("-inf"))[:, None])
        acc = acc * alpha[:, None] + p * sv[None, :]

    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    tl.store(o + row_off[:, None] * D + cols[None, :], (acc / l_safe[:, None]).to(o.dtype.element_ty),
             mask=m_q[:, None] & m_d[None, :])
    tl.store(lse + row_off, tl.where(nonempty, m_i + tl.log(l_safe), 0.0), mask=m_q)


def _window_bwd_kernel(
    q, qpos, cos, sin, ks, vs, spos, mk, mv, evict, last, idx, counts, sink_s, sink_v, sink_pos, lse, do, o,
    diff, mw, da, dmw, dq, dks, dvs, dmk, dmv, dsink_s, dsink_v,
    T, Ls, P0, W, C, K, NB, scale,
    H: tl.constexpr, HKV: tl.constexpr, S: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BQ: tl.constexpr,
    BK: tl.constexpr, HAS_MEM: tl.constexpr, DOT_PREC: tl.constexpr, ROT: tl.constexpr, MIXED: tl.constexpr,
    MW_ROWS: tl.constexpr,
):
    i_q, b, hk, rows, m_q, cols, m_d, qp, valid, row_off, b_q = _query_block(q, qpos, cos, sin, T, H, HKV, D, BD,
                                                                              BQ, ROT)
    m_qd = m_q[:, None] & m_d[None, :]
    at_q = row_off[:, None] * D + cols[None, :]
    b_do = tl.load(do + at_q, mask=m_qd, other=0).to(tl.float32)
    b_lse = tl.load(lse + row_off, mask=m_q, other=0)
    b_o = tl.load(o + at_q, mask=m_qd, other=0).to(tl.float32)
    if MIXED:  # o and do are the mix's: lerp(a, o, w)'s gradients as autograd forms them, rounded as it rounds
        DT: tl.constexpr = do.dtype.element_ty
        if MW_ROWS:
            w = tl.load(mw + row_off, mask=m_q, other=0).to(tl.float32)[:, None]
        else:
            w = tl.load(mw + tl.program_id(1) % H + 0 * row_off).to(tl.float32)[:, None]
        b_diff = tl.load(diff + at_q, mask=m_qd, other=0).to(tl.float32)
        rest = _rounded(1.0 - w, DT)
        tl.store(da + at_q, _cast(b_do * rest, DT), mask=m_qd)
        tl.store(dmw + row_off, _cast(tl.reduce(_rounded(b_do * b_diff, DT), 1, _ADD),
                                      dmw.dtype.element_ty), mask=m_q)
        b_o = _rounded(b_o + b_diff * rest, DT)  # the window's own output, rebuilt
        b_do = _rounded(b_do * w, DT)
    # rowsum(o * do), the softmax's backward term: this program's rows are whole, so no pass before it
    b_delta = tl.reduce(b_o * b_do, 1, _ADD)
    b_dq = tl.full([BQ, BD], 0.0, tl.float32)

    me = P0 + rows
    lo = tl.maximum(P0 + i_q * BQ - W + 1, 0)
    hi = tl.minimum(P0 + i_q * BQ + BQ, Ls)
    for start in range(lo, hi, BK):
        r = start + tl.arange(0, BK)
        m_r = r < hi
        m_rd = m_r[:, None] & m_d[None, :]
        kv_off = (b.to(tl.int64) * Ls + r) * HKV + hk
        kp = tl.load(spos + b.to(tl.int64) * Ls + r, mask=m_r, other=-1)
        b_k = tl.load(ks + kv_off[:, None] * D + cols[None, :], mask=m_rd, other=0).to(tl.float32)
        b_v = tl.load(vs + kv_off[:, None] * D + cols[None, :], mask=m_rd, other=0).to(tl.float32)
        seen = valid[:, None] & (r[None, :] <= me[:, None]) & (r[None, :] > me[:, None] - W) & (kp[None, :] >= 0)
        p, ds = _attend_backward(b_q, b_do, b_k, b_v, seen, b_lse, b_delta, scale, DOT_PREC)
        b_dq += tl.dot(ds, b_k, input_precision=DOT_PREC)
        tl.atomic_add(dks + kv_off[:, None] * D + cols[None, :],
                      tl.dot(tl.trans(ds), b_q, input_precision=DOT_PREC), mask=m_rd)
        tl.atomic_add(dvs + kv_off[:, None] * D + cols[None, :],
                      tl.dot(tl.trans(p), b_do, input_precision=DOT_PREC), mask=m_rd)

    if HAS_MEM:
        l_q = tl.load(last + rows, mask=m_q, other=-1)
        n_k = tl.load(counts + i_q)
        list_off = ((b.to(tl.int64) * NB + i_q) * HKV + hk) * K
        row_c = (b.to(tl.int64) * HKV + hk) * C
        for start in range(0, n_k, BK):
            kk = start + tl.arange(0, BK)
            m_k = kk < n_k
            m_kd = m_k[:, None] & m_d[None, :]
            c = tl.load(idx + list_off + kk, mask=m_k, other=0)
            ends = tl.load(evict + row_c + c, mask=m_k, other=-1)
            at = (row_c + c)[:, None] * D + cols[None, :]
            b_k = tl.load(mk + at, mask=m_kd, other=0).to(tl.float32)
            b_v = tl.load(mv + at, mask=m_kd, other=0).to(tl.float32)
            seen = valid[:, None] & m_k[None, :] & (c[None, :] <= l_q[:, None]) & (l_q[:, None] < ends[None, :])
            p, ds = _attend_backward(b_q, b_do, b_k, b_v, seen, b_lse, b_delta, scale, DOT_PREC)
            b_dq += tl.dot(ds, b_k, input_precision=DOT_PREC)
            tl.atomic_add(dmk + at, tl.dot(tl.trans(ds), b_q, input_precision=DOT_PREC), mask=m_kd)
            tl.atomic_add(dmv + at, tl.dot(tl.trans(p), b_do, input_precision=DOT_PREC), mask=m_kd)

    for j in range(S):
        sc = tl.load(sink_s + row_off * S + j, mask=m_q, other=0).to(tl.float32) * scale
        sp = tl.load(sink_pos + b.to(tl.int64) * S + j) + 0 * qp
        seen = valid & (sp >= 0) & (sp <= qp - W)
        sv_at = ((b.to(tl.int64) * S + j) * HKV + hk) * D + cols
        sv = tl.load(sink_v + sv_at, mask=m_d, other=0).to(tl.float32)
        p = tl.where(seen, tl.exp(sc - b_lse), 0.0)
        dp = tl.reduce(b_do * sv[None, :], 1, _ADD)
        tl.store(dsink_s + row_off * S + j, _cast(p * (dp - b_delta) * scale, dsink_s.dtype.element_ty), mask=m_q)
        tl.atomic_add(dsink_v + sv_at, tl.reduce(p[:, None] * b_do, 0, _ADD), mask=m_d)

    tl.store(dq + at_q, _cast(b_dq, dq.dtype.element_ty), mask=m_qd)


class WindowAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, ks, vs, mk, mv, sink_s, sink_v, qpos, spos, evict, last, idx, counts, sink_pos, cos, sin,
                P0, W, scale, o_aaren=None, weight=None):
        B, T, H, D = q.shape
        Ls, Hkv, S = ks.shape[1], ks.shape[2], sink_v.shape[1]
        C, NB, K = mk.shape[2], idx.shape[1], idx.shape[3]
        o = torch.empty_like(q)
        lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
        args = (T, Ls, P0, W, C, K, NB, scale)
        meta = dict(H=H, HKV=Hkv, S=S, D=D, BD=triton.next_power_of_2(max(D, 16)), BQ=BQ, BK=BK,
                    HAS_MEM=C > 0, DOT_PREC=_dot_precision(q), ROT=cos.shape[-1])
        grid = (triton.cdiv(T, BQ), B * H)
        # no float contraction: the queries' turn rounds as rotate_by's (an fma would round once less)
        get_kernel(_window_fwd_kernel, key=("D", "HAS_MEM", "ROT"))[grid](
            q, qpos, cos, sin, ks, vs, spos, mk, mv, evict, last, idx, counts, sink_s, sink_v, sink_pos, o, lse, *args,
            **meta, enable_fp_fusion=False)
        ctx.args, ctx.meta, ctx.grid = args, meta, grid
        inputs = (q, ks, vs, mk, mv, sink_s, sink_v, qpos, spos, evict, last, idx, counts, sink_pos, cos, sin, lse)
        ctx.mixed = o_aaren is not None
        if not ctx.mixed:
            ctx.save_for_backward(*inputs, o)
            return o
        o = o.to(o_aaren.dtype)
        out = torch.lerp(o_aaren, o, weight)
        ctx.save_for_backward(*inputs, out, o - o_aaren, weight)
        return out

    @staticmethod
    def backward(ctx, do):
        (q, ks, vs, mk, mv, sink_s, sink_v, qpos, spos, evict, last, idx, counts, sink_pos, cos, sin, lse,
         *kept) = ctx.saved_tensors
        do = do.contiguous()
        B, T, H, _ = q.shape
        if ctx.mixed:
            # lerp(a, o, w) = a + w (o - a): the kernel rebuilds o = out + (1 - w) (o - a), rounded once to out's
            # dtype as o was (it reads o for the softmax's row sums only), and writes the Aaren output's gradient
            # and the weight's per row, as autograd forms lerp's (a weight per head: the rows summed here)
            o, diff, weight = kept
            rows = weight.dim() > 2  # [B, T, H, 1] (else [H, 1]); a broadcast one expanded (autograd sums back)
            weight = (weight.expand(B, T, H, 1) if rows else weight.expand(H, 1)).contiguous()
            da = torch.empty_like(do)
            dmw = torch.empty(B, T, H, device=q.device, dtype=weight.dtype if rows else torch.float32)
        else:
            o, = kept
            diff = weight = da = dmw = o  # not read
            rows = False
        # dq and the sinks' score gradients are written once, in their inputs' dtype; the kernel adds into the
        # others (atomics, float32), which share one buffer: one fill, and one cast back where their dtypes agree
        dq, dsink_s = torch.empty_like(q), torch.empty_like(sink_s)
        added = (ks, vs, mk, mv, sink_v)
        sizes = [t.numel() for t in added]
        flat = torch.zeros(sum(sizes), device=q.device, dtype=torch.float32)
        dks, dvs, dmk, dmv, dsink_v = (part.view(t.shape) for part, t in zip(flat.split(sizes), added))
        # one config: autotuning would launch it several times, and its atomics would add up over the runs; 8 warps
        # hold its tiles (q, dO, dq, k, v, scores, their gradients: 64 x 64 each) in registers
        get_kernel(_window_bwd_kernel, key=("D", "HAS_MEM", "ROT"), warps=(8,), stages=(2,))[ctx.grid](
            q, qpos, cos, sin, ks, vs, spos, mk, mv, evict, last, idx, counts, sink_s, sink_v, sink_pos, lse, do, o,
            diff, weight, da, dmw, dq, dks, dvs, dmk, dmv, dsink_s, dsink_v, *ctx.args, **ctx.meta, MIXED=ctx.mixed,
            MW_ROWS=rows, enable_fp_fusion=False)
        mixed = ()
        if ctx.mixed:
            needs = ctx.needs_input_grad
            mixed = (da if needs[19] else None,
                     None if not needs[20] else dmw.unsqueeze(-1) if rows else dmw.sum((0, 1)).view(H, 1).to(
                         weight.dtype))
        if ctx.meta["ROT"]:  # dq is the turned queries' gradient: turned back, as _Rotate's backward turns it
            dq = rotate_triton(dq, cos, sin, inverse=True)
        dtypes = {t.dtype for t in added}
        if len(dtypes) == 1:
            flat = flat.to(dtypes.pop())
        dks, dvs, dmk, dmv, dsink_v = (part.view(t.shape).to(t.dtype) for part, t in zip(flat.split(sizes), added))
        return (dq, dks, dvs, dmk, dmv, dsink_s, dsink_v) + (None,) * 12 + mixed


def window_attention_triton(q, qpos, ks, vs, spos, P0, window, scale, memory=None, sinks=None, angles=None,
                            mix=None):
    """Softmax attention of each query over its window, the memory candidates it sees and the sinks it sees.

    q [B, T, H, D] rotated at its position, or with ``angles`` (cos, sin [B, T, 1, rot] float32, as
    ``rotary_angles`` gives them) turned by them as the kernel reads it (``rotate_by``'s bits: float32, rounded to
    q's dtype; training keeps q, not a turned copy, and q's gradient comes back turned back); qpos [B, T] (-1:
    padding, whose output is 0); ks, vs [B, Ls, Hkv, D] the stream (the window entries held, then this call's T
    tokens: query i is stream row P0 + i), spos [B, Ls]; ``window``: W. ``memory``: None or (keys, values [B, Hkv,
    C, D], evict [B, Hkv, C], last [T + 1], idx [B, NB, Hkv, K] the candidates each block of BQ queries may see,
    seen ones first, counts [NB] how many of them the block needs at most) as ``_memory_blocks`` gives them with Q =
    BQ. ``sinks``: None or (scores [B, T, H, S], values [B, S, Hkv, D], positions [B, S], -1 where empty: a query at
    p sees a sink at s <= p - W). ``mix``: None or (the Aaren branch's output a [B, T, H, D], the window's share w
    [H, 1] or [B, T, H, 1] in a's dtype): then lerp(a, o, w) (``mix_branches``). Returns [B, T, H, D] in q's dtype
    (mixed: a's); gradients flow to q, ks, vs, the memory's keys and values, the sinks' scores and values, a and w.
    """
    B, T, H, D = q.shape
    Hkv = ks.shape[2]
    dev = q.device
    if memory is None:
        mk = mv = q.new_zeros(B, Hkv, 0, D)
        evict = torch.zeros(B, Hkv, 0, dtype=torch.long, device=dev)
        last = torch.zeros(T + 1, dtype=torch.long, device=dev)
        idx = torch.zeros(B, triton.cdiv(T, BQ), Hkv, 0, dtype=torch.long, device=dev)
        counts = torch.zeros(triton.cdiv(T, BQ), dtype=torch.long, device=dev)
    else:
        mk, mv, evict, last, idx, counts = memory
    if sinks is None:
        sink_s, sink_v = q.new_zeros(B, T, H, 0), q.new_zeros(B, 0, Hkv, D)
        sink_pos = torch.zeros(B, 0, dtype=torch.long, device=dev)
    else:
        sink_s, sink_v, sink_pos = sinks
    cos, sin = checked_angles(angles, q) or (torch.zeros(B, T, 1, 0, device=dev),) * 2
    c = lambda x: x.contiguous()  # noqa: E731
    return WindowAttentionFunction.apply(
        c(q), c(ks), c(vs), c(mk), c(mv), c(sink_s), c(sink_v), c(qpos), c(spos), c(evict), c(last), c(idx),
        c(counts), c(sink_pos), cos, sin, int(P0), int(window), float(scale), *(mix or ()))
