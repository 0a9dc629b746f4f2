# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Aaren scan one token per loop iteration (the decode path: T is usually 1, the batch large).

Per head the state is (o [D], lse); token t does, with every weight exp(x - max) <= 1::

    l = lse + g_t;  M = max(l, s_t);  a = exp(l - M), b = exp(s_t - M)
    o <- (a * o + b * v_t) / (a + b),  lse <- M + log(a + b)

Backward: the forward is recomputed by the chunked kernel, whose backward then runs (same math, docs/aaren_math.md
section 3). Decoding needs no gradient, so this costs nothing there.
"""

import torch
import triton
import triton.language as tl

from ..memory.codes import _cast
from ..state import writable
from .chunk import _ADD, _MAX, _block_d, chunk_bwd, chunk_fwd, check_inputs, device_function, get_kernel, prepare
from .scores import input_decay


@device_function
def _step_weights(lse, s):
    """The scan's step for a state of log-normaliser ``lse`` (decayed) and a token of score ``s`` (docstring above):
    (a, b, w_safe, new lse), every weight exp(x - max) <= 1; the new o is (a * o + b * v) / w_safe."""
    mx = tl.maximum(lse, s)
    mx = tl.where(mx > float("-inf"), mx, 0.0)  # nothing seen yet: never form -inf - -inf
    a = tl.exp(lse - mx)
    b = tl.exp(s - mx)
    w = a + b
    w_safe = tl.where(w > 0, w, 1.0)
    return a, b, w_safe, tl.where(w > 0, mx + tl.log(w_safe), float("-inf"))


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
        a, b, w_safe, st_lse = _step_weights(st_lse, s_t)
        st_o = (a * st_o + b * v_t) / w_safe
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


def _aaren_step_kernel(
    q, k, v, queries, log_decay, decay_in, mask, o_state, lse_state, out, s_out, scale,
    H: tl.constexpr, HKV: tl.constexpr, J: tl.constexpr, BJ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    DECAY: tl.constexpr, MIX: tl.constexpr,
):
    """The Aaren branch of one decode token for one (sequence, query head): its J slots' scores, decay and scan
    step (the state written in place), their mix by the query, and the mixed output."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    cols = tl.arange(0, BD)
    m_d = cols < D
    js = tl.arange(0, BJ)
    m_j = js < J
    m_jd = m_j[:, None] & m_d[None, :]
    kv = i_b * HKV + i_h // (H // HKV)
    b_k = tl.load(k + kv * D + cols, mask=m_d, other=0).to(tl.float32)
    b_v = tl.load(v + kv * D + cols, mask=m_d, other=0).to(tl.float32)
    b_c = tl.load(queries + (i_h * J + js[:, None]) * D + cols[None, :], mask=m_jd, other=0).to(tl.float32)
    real = (tl.load(mask + i_b + 0 * js) != 0) & m_j  # [BJ]: a padding token changes no state
    b_s = tl.where(real, tl.reduce(b_c * b_k[None, :], 1, _ADD) * scale, float("-inf"))
    op = i_b * H * J + i_h * J + js  # op head (query head, slot) of this sequence
    tl.store(s_out + op, b_s, mask=m_j)
    lse = tl.load(lse_state + op, mask=m_j, other=float("-inf"))
    if DECAY > 0:  # g = -exp(log_decay), times softplus(decay_in) / log 2 with an input-dependent decay
        g = -tl.exp(tl.load(log_decay + i_h * J + js, mask=m_j, other=0).to(tl.float32))
        if DECAY == 2:
            g = input_decay(g, tl.load(decay_in + op, mask=m_j, other=0).to(tl.float32))[0]
        lse = lse + tl.where(real, g, 0.0)
    a, b, w_safe, lse = _step_weights(lse, b_s)
    o = tl.load(o_state + op[:, None] * D + cols[None, :], mask=m_jd, other=0)
    o = (a[:, None] * o + b[:, None] * b_v[None, :]) / w_safe[:, None]
    tl.store(o_state + op[:, None] * D + cols[None, :], o, mask=m_jd)
    tl.store(lse_state + op, lse, mask=m_j)
    if MIX:  # how much the query head reads of each slot: softmax over the slots of <q, c_j> / sqrt(D)
        b_q = tl.load(q + (i_b * H + i_h) * D + cols, mask=m_d, other=0).to(tl.float32)
        z = tl.where(m_j, tl.reduce(b_c * b_q[None, :], 1, _ADD) * scale, float("-inf"))
        p = tl.exp(z - tl.reduce(z, 0, _MAX))
        p = p / tl.reduce(p, 0, _ADD)
    else:
        p = tl.where(m_j, 1.0, 0.0)
    # in the output's dtype as .to() rounds it: no launch to cast it
    tl.store(out + (i_b * H + i_h) * D + cols, _cast(tl.reduce(p[:, None] * o, 0, _ADD), out.dtype.element_ty),
             mask=m_d)


def aaren_step_triton(q, k, v, mask, state, queries, log_decay, decay_in, scale):
    """The Aaren branch of a decode step (``AarenMixer.aaren_output`` for one token with a state) in one launch: q
    [B, 1, H, D] (None with one slot), k and v [B, 1, Hkv, D], mask [B, 1] (False: padding), queries [H, J, D],
    log_decay [H, J] or None (no decay), decay_in [B, 1, H * J] (the input-dependent decay's projection) or None.
    Returns (the output [B, 1, H, D] in v's dtype, the slot scores [B, 1, H * J] float32, -inf at padding) and
    leaves the new state in ``state.aaren_o`` / ``state.aaren_lse``, written in place; None, touching nothing, past
    64 slots or off float32 state."""
    B, _, Hkv, D = k.shape
    H, J = queries.shape[:2]
    if J > 64 or H % Hkv or state.aaren_o.dtype != torch.float32 or v.dtype == torch.float64:
        return None
    inference = torch.is_inference_mode_enabled()
    o_state, lse_state = writable(state, "aaren_o", inference), writable(state, "aaren_lse", inference)
    out = torch.empty(B, 1, H, D, device=v.device, dtype=v.dtype)
    s = torch.empty(B, 1, H * J, device=v.device, dtype=torch.float32)
    decay = 0 if log_decay is None else 1 if decay_in is None else 2
    get_kernel(_aaren_step_kernel, key=("D", "J"), warps=(4,), stages=(1,))[(B, H)](
        v if q is None else q.contiguous(), k.contiguous(), v.contiguous(), queries.contiguous(),
        out if log_decay is None else log_decay.contiguous(), out if decay_in is None else decay_in.contiguous(),
        mask.reshape(B).contiguous(), o_state, lse_state, out, s, float(scale),
        H=H, HKV=Hkv, J=J, BJ=max(2, triton.next_power_of_2(J)), D=D, BD=_block_d(D), DECAY=decay, MIX=J > 1,
    )
    return out, s
