# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Aaren scan one token per loop iteration (the decode path: T is usually 1, the batch large).

Per head the state is (o [D], lse); token t does, with every weight exp(x - max) <= 1::

    l = lse + g_t;  M = max(l, s_t);  a = exp(l - M), b = exp(s_t - M)
    o <- (a * o + b * v_t) / (a + b),  lse <- M + log(a + b)

Backward: the forward is recomputed by the chunked kernel, whose backward then runs (same math, docs/aaren_math.md
section 3). Decoding needs no gradient, so this costs nothing there.
"""

import torch
import triton.language as tl

from .chunk import _block_d, chunk_bwd, chunk_fwd, check_inputs, get_kernel, prepare


def _aaren_fused_recurrent_fwd_kernel(
    s, v, g, o, h0_o, h0_lse, ht_o, ht_lse, cu_seqlens,
    T,
    H: tl.constexpr, GV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    HAS_G: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    L = (eos - bos).to(tl.int32)
    cols = tl.arange(0, BD)
    mask_d = cols < D
    i_nh = i_n.to(tl.int64) * H + i_h
    if HAS_H0:
        st_o = tl.load(h0_o + i_nh * D + cols, mask=mask_d, other=0).to(tl.float32)
        st_lse = tl.load(h0_lse + i_nh).to(tl.float32)
    else:
        st_o = tl.full([BD], 0.0, tl.float32)
        st_lse = tl.full([], float("-inf"), tl.float32)
    for t in range(0, L):
        off = (bos + t) * H + i_h
        s_t = tl.load(s + off).to(tl.float32)
        off_v = (bos + t) * (H // GV) + i_h // GV  # op heads i_h of one value head read the same values
        v_t = tl.load(v + off_v * D + cols, mask=mask_d, other=0).to(tl.float32)
        if HAS_G:
            st_lse = st_lse + tl.load(g + off).to(tl.float32)
        mx = tl.maximum(st_lse, s_t)
        mx = tl.where(mx > float("-inf"), mx, 0.0)  # nothing seen yet: never form -inf - -inf
        a = tl.exp(st_lse - mx)
        b = tl.exp(s_t - mx)
        w = a + b
        w_safe = tl.where(w > 0, w, 1.0)
        st_o = (a * st_o + b * v_t) / w_safe
        st_lse = tl.where(w > 0, mx + tl.log(w_safe), float("-inf"))
        tl.store(o + off * D + cols, st_o.to(o.dtype.element_ty), mask=mask_d)
    tl.store(ht_o + i_nh * D + cols, st_o, mask=mask_d)
    tl.store(ht_lse + i_nh, st_lse)


def fused_recurrent_fwd(s, v, g, h0, cu_seqlens):
    B, T, H, D, n_seq, GV = check_inputs(s, v, g, h0, cu_seqlens)
    o = v.new_empty(B, T, H, D)
    ht_o = torch.empty(n_seq, H, D, dtype=torch.float32, device=v.device)
    ht_lse = torch.empty(n_seq, H, dtype=torch.float32, device=v.device)
    get_kernel(_aaren_fused_recurrent_fwd_kernel, key=("BD",))[(n_seq, H)](
        s, v, g if g is not None else s, o,
        h0[0] if h0 is not None else ht_o, h0[1] if h0 is not None else ht_lse,
        ht_o, ht_lse, cu_seqlens if cu_seqlens is not None else ht_lse,
        T, H=H, GV=GV, D=D, BD=_block_d(D),
        HAS_G=g is not None, HAS_H0=h0 is not None, IS_VARLEN=cu_seqlens is not None,
    )
    return o, (ht_o, ht_lse)


class FusedRecurrentAarenFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, v, g, h0_o, h0_lse, cu_seqlens):
        h0 = (h0_o, h0_lse) if h0_o is not None else None
        o, ht = fused_recurrent_fwd(s, v, g, h0, cu_seqlens)
        ctx.save_for_backward(s, v, g, h0_o, h0_lse, cu_seqlens)
        ctx.set_materialize_grads(False)
        return o, ht[0], ht[1]

    @staticmethod
    def backward(ctx, do, dht_o, dht_lse):
        s, v, g, h0_o, h0_lse, cu_seqlens = ctx.saved_tensors
        h0 = (h0_o, h0_lse) if h0_o is not None else None
        _, lse, ht, cs = chunk_fwd(s, v, g, h0, cu_seqlens, 64, save_cs=True)  # recompute what backward needs
        ds, dv, dg, dh0, _ = chunk_bwd(s, v, g, h0, lse, cs, ht, do, (dht_o, dht_lse), cu_seqlens, 64)
        return ds, dv, dg, dh0[0] if dh0 else None, dh0[1] if dh0 else None, None


def fused_recurrent_aaren_triton(
    s: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor = None,
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor = None,
    chunk_size: int = 64,
):
    """Token-by-token Triton Aaren scan; same op as ``aaren_hf.aaren_scan.recurrent_aaren_torch``.
    ``chunk_size`` is accepted for the shared signature and ignored."""
    s, v, g, (h0_o, h0_lse) = prepare(s, v, g, initial_state)
    o, ht_o, ht_lse = FusedRecurrentAarenFunction.apply(s, v, g, h0_o, h0_lse, cu_seqlens)
    return o, ((ht_o, ht_lse) if output_final_state else None)
