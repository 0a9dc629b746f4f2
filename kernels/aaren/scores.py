# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""What the Aaren branch's scan reads of a block of tokens, in Triton, forward and backward (reference: the PyTorch
code of ``AarenMixer.scan_inputs`` in modeling_aaren.py):

    s[t, h*J + j]  = <k_t, c_hj> * scale        (-inf where token t is padding; k_t of query head h's kv head)
    mix[t, h, j]   = softmax_j(<q_th, c_hj> * scale)
    g[t, h*J + j]  = -exp(log_decay_hj)         (times softplus(u_t, hj) / log 2 with an input decay; 0 at padding)

One program per (block of tokens, kv head) reads the block's keys once for the G query heads of that kv head, and
their queries, all in float32 whatever the inputs' dtype. Its backward writes dq, dk (and du) in the inputs' dtype
and the slot queries' and decay rates' gradients per block (float32), which the host sums: no atomics, the same bits
every run. A GPU ran this as about fifteen operators forward (16-bit to float32 copies, two batched products, a copy
for the layout, the scale, the padding, the softmax, the decay's exp and fill) and about twenty backward.
"""

import torch
import triton
import triton.language as tl

from ..memory.codes import _cast
from .chunk import _ADD, _MAX, _block_d, device_function, get_kernel

# elements of a program's [tokens, slots, head dim] products: the block of tokens is as long as this allows
_BLOCK_ELEMENTS = 8192


@device_function
def input_decay(rate, u):
    """(g, dg/du) of an input-dependent decay: rate * softplus(u) / log 2 (torch's softplus: u itself above 20), for
    this file's kernels and the decode step's (``fused_recurrent.py``)."""
    softplus = tl.where(u > 20.0, u, tl.log(1.0 + tl.exp(tl.minimum(u, 20.0))))
    # its derivative, the sigmoid, as exp(u - softplus(u)): no exp of a large argument
    return rate * softplus / 0.6931471805599453, rate * tl.exp(tl.minimum(u - softplus, 0.0)) / 0.6931471805599453


@device_function
def _decay(log_decay, decay_in, at, i_h, js, m_j, m_tj, J: tl.constexpr, DECAY: tl.constexpr):
    """(g, dg/du) [BT, BJ] of the log-decay per token: -exp(log_decay) (DECAY 1, where dg/du is g, unused), times
    softplus(u) / log 2 of the decay projection u (DECAY 2)."""
    rate = -tl.exp(tl.load(log_decay + i_h * J + js, mask=m_j, other=0).to(tl.float32))[None, :]
    if DECAY == 2:
        return input_decay(rate, tl.load(decay_in + at, mask=m_tj, other=0).to(tl.float32))
    g = tl.where(m_tj, rate, 0.0)
    return g, g


@device_function
def _block(k, mask, i_b, i_kv, N, HKV: tl.constexpr, J: tl.constexpr, D: tl.constexpr, BJ: tl.constexpr,
           BD: tl.constexpr, BT: tl.constexpr):
    """Block i_b of tokens for kv head i_kv: (rows, cols, slots, their masks, the keys [BT, BD] in float32, which
    rows are real tokens)."""
    rows = i_b * BT + tl.arange(0, BT)
    cols = tl.arange(0, BD)
    js = tl.arange(0, BJ)
    m_t, m_d, m_j = rows < N, cols < D, js < J
    m_td, m_jd, m_tj = m_t[:, None] & m_d[None, :], m_j[:, None] & m_d[None, :], m_t[:, None] & m_j[None, :]
    b_k = tl.load(k + (rows[:, None] * HKV + i_kv) * D + cols[None, :], mask=m_td, other=0).to(tl.float32)
    return rows, cols, js, m_j, m_td, m_jd, m_tj, b_k, tl.load(mask + rows, mask=m_t, other=0) != 0


def _scores_fwd_kernel(q, k, queries, mask, log_decay, decay_in, s, mix, g, N, scale,
                       H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, J: tl.constexpr, BJ: tl.constexpr,
                       D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, MIX: tl.constexpr,
                       DECAY: tl.constexpr):
    i_kv = tl.program_id(1)
    rows, cols, js, m_j, m_td, m_jd, m_tj, b_k, real = _block(k, mask, tl.program_id(0).to(tl.int64), i_kv, N, HKV,
                                                              J, D, BJ, BD, BT)
    for i_g in tl.static_range(G):
        i_h = i_kv * G + i_g
        b_c = tl.load(queries + (i_h * J + js[:, None]) * D + cols[None, :], mask=m_jd, other=0).to(tl.float32)
        b_s = tl.reduce(b_k[:, None, :] * b_c[None, :, :], 2, _ADD) * scale
        at = rows[:, None] * (H * J) + i_h * J + js[None, :]
        tl.store(s + at, tl.where(real[:, None], b_s, float("-inf")), mask=m_tj)
        if DECAY > 0:  # a padding token decays nothing
            tl.store(g + at, tl.where(real[:, None], _decay(log_decay, decay_in, at, i_h, js, m_j, m_tj, J, DECAY)[0],
                                      0.0), mask=m_tj)
        if MIX:
            b_q = tl.load(q + (rows[:, None] * H + i_h) * D + cols[None, :], mask=m_td, other=0).to(tl.float32)
            z = tl.where(m_j[None, :], tl.reduce(b_q[:, None, :] * b_c[None, :, :], 2, _ADD) * scale, float("-inf"))
            p = tl.exp(z - tl.reduce(z, 1, _MAX)[:, None])
            tl.store(mix + at, p / tl.reduce(p, 1, _ADD)[:, None], mask=m_tj)  # [B, T, H, J]: the scores' layout


def _scores_bwd_kernel(q, k, queries, mask, log_decay, decay_in, mix, ds, dmix, dg, dq, dk, dqueries, dlog_decay,
                       ddecay_in, N, scale,
                       H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, J: tl.constexpr, BJ: tl.constexpr,
                       D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, MIX: tl.constexpr,
                       DECAY: tl.constexpr):
    i_kv = tl.program_id(1)
    i_b = tl.program_id(0).to(tl.int64)
    rows, cols, js, m_j, m_td, m_jd, m_tj, b_k, real = _block(k, mask, i_b, i_kv, N, HKV, J, D, BJ, BD, BT)
    b_dk = tl.full([BT, BD], 0.0, tl.float32)
    for i_g in tl.static_range(G):
        i_h = i_kv * G + i_g
        b_c = tl.load(queries + (i_h * J + js[:, None]) * D + cols[None, :], mask=m_jd, other=0).to(tl.float32)
        # a padding token's score and decay are constants (-inf, 0): no gradient reaches its key or decay
        at = rows[:, None] * (H * J) + i_h * J + js[None, :]
        b_ds = tl.load(ds + at, mask=m_tj & real[:, None], other=0) * scale
        if DECAY > 0:
            b_dg = tl.load(dg + at, mask=m_tj & real[:, None], other=0)
            g, dg_du = _decay(log_decay, decay_in, at, i_h, js, m_j, m_tj, J, DECAY)
            tl.store(dlog_decay + (i_b * H + i_h) * J + js, tl.reduce(b_dg * g, 0, _ADD), mask=m_j)
            if DECAY == 2:
                tl.store(ddecay_in + at, _cast(b_dg * dg_du, ddecay_in.dtype.element_ty), mask=m_tj)
        b_dk += tl.reduce(b_ds[:, :, None] * b_c[None, :, :], 1, _ADD)
        b_dc = tl.reduce(b_ds[:, :, None] * b_k[:, None, :], 0, _ADD)
        if MIX:  # the softmax's backward: dz = p (dmix - <dmix, p>), times the scale
            b_q = tl.load(q + (rows[:, None] * H + i_h) * D + cols[None, :], mask=m_td, other=0).to(tl.float32)
            p = tl.load(mix + at, mask=m_tj, other=0)
            b_dm = tl.load(dmix + at, mask=m_tj, other=0)
            dz = p * (b_dm - tl.reduce(b_dm * p, 1, _ADD)[:, None]) * scale
            tl.store(dq + (rows[:, None] * H + i_h) * D + cols[None, :],
                     _cast(tl.reduce(dz[:, :, None] * b_c[None, :, :], 1, _ADD), dq.dtype.element_ty), mask=m_td)
            b_dc += tl.reduce(dz[:, :, None] * b_q[:, None, :], 0, _ADD)
        tl.store(dqueries + ((i_b * H + i_h) * J + js[:, None]) * D + cols[None, :], b_dc, mask=m_jd)
    tl.store(dk + (rows[:, None] * HKV + i_kv) * D + cols[None, :], _cast(b_dk, dk.dtype.element_ty), mask=m_td)


def _shape(k, queries, decay):
    B, T, Hkv, D = k.shape
    H, J = queries.shape[:2]
    BJ = max(2, triton.next_power_of_2(J))
    BD = _block_d(D)
    BT = max(1, min(64, _BLOCK_ELEMENTS // (BJ * BD)))
    return (dict(H=H, HKV=Hkv, G=H // Hkv, J=J, BJ=BJ, D=D, BD=BD, BT=BT, MIX=J > 1, DECAY=decay), B * T,
            -(-(B * T) // BT))


class ScanInputsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, queries, mask, log_decay, decay_in, scale):
        B, T, Hkv, D = k.shape
        H, J = queries.shape[:2]
        decay = 0 if log_decay is None else 1 if decay_in is None else 2
        consts, N, blocks = _shape(k, queries, decay)
        q, k, queries, mask, log_decay, decay_in = (None if t is None else t.contiguous()
                                                    for t in (q, k, queries, mask, log_decay, decay_in))
        s = torch.empty(B, T, H * J, device=k.device, dtype=torch.float32)
        mix = torch.empty(B, T, H, J, device=k.device, dtype=torch.float32) if J > 1 else None
        g = torch.empty_like(s) if decay else None
        get_kernel(_scores_fwd_kernel, key=("D", "J", "G", "DECAY"), warps=(4,), stages=(1,))[(blocks, Hkv)](
            k if q is None else q, k, queries, mask, s if log_decay is None else log_decay,
            s if decay_in is None else decay_in, s, s if mix is None else mix, s if g is None else g, N, float(scale),
            **consts)
        ctx.save_for_backward(q, k, queries, mask, log_decay, decay_in, mix)
        ctx.scale, ctx.decay = scale, decay
        return s, mix, g

    @staticmethod
    def backward(ctx, ds, dmix, dg):
        q, k, queries, mask, log_decay, decay_in, mix = ctx.saved_tensors
        consts, N, blocks = _shape(k, queries, ctx.decay)
        H, J, D = consts["H"], consts["J"], consts["D"]
        dk = torch.empty_like(k)
        dq = None if q is None else torch.empty_like(q)
        part = torch.empty(blocks, H, J, D, device=k.device, dtype=torch.float32)
        part_decay = None if log_decay is None else torch.empty(blocks, H, J, device=k.device, dtype=torch.float32)
        ddecay_in = None if decay_in is None else torch.empty_like(decay_in)
        ds = ds.contiguous()
        dmix = None if mix is None else (torch.zeros_like(mix) if dmix is None else dmix.contiguous())
        dg = None if log_decay is None else (torch.zeros_like(ds) if dg is None else dg.contiguous())
        get_kernel(_scores_bwd_kernel, key=("D", "J", "G", "DECAY"), warps=(4,), stages=(1,))[
            (blocks, consts["HKV"])](
            k if q is None else q, k, queries, mask, ds if log_decay is None else log_decay,
            ds if decay_in is None else decay_in, ds if mix is None else mix, ds, ds if dmix is None else dmix,
            ds if dg is None else dg, dk if dq is None else dq, dk, part, part if part_decay is None else part_decay,
            dk if ddecay_in is None else ddecay_in, N, float(ctx.scale), **consts)
        # frozen parameters (a fixed decay, an adapter's fine-tuning) take no sum
        dqueries = part.sum(0).to(queries.dtype) if ctx.needs_input_grad[2] else None
        dlog_decay = part_decay.sum(0).to(log_decay.dtype) if ctx.needs_input_grad[4] else None
        return dq, dk, dqueries, None, dlog_decay, ddecay_in, None


def scan_inputs_triton(q, k, queries, mask, log_decay, decay_in, scale):
    """What the Aaren branch's scan reads, with their gradients: (s [B, T, H * J] float32, -inf at padding; mix [B,
    T, H, J] float32, None with one slot; g [B, T, H * J] float32, 0 at padding, None without decay) of q [B, T, H,
    D] (None with one slot), k [B, T, Hkv, D] (before rotary), the slot queries [H, J, D], mask [B, T] (False:
    padding), log_decay [H, J] (None: no decay) and decay_in [B, T, H * J] (the input-dependent decay's projection,
    or None). None where the kernel does not take the inputs (float64, more than 64 slots)."""
    J = queries.shape[1]
    if J > 64 or k.dtype == torch.float64 or queries.shape[0] % k.shape[2] or (J > 1 and q is None):
        return None
    return ScanInputsFunction.apply(q if J > 1 else None, k, queries, mask, log_decay,
                                    None if log_decay is None else decay_in, scale)
