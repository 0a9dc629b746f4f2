# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Chunked Aaren scan in Triton: forward and backward (docs/aaren_math.md sections 2-4).

One program per (sequence, head) walks its chunks of C tokens in order (forward) or in reverse (backward), carrying
the state across chunks. Inside a chunk every weight is exp(x - max) <= 1:

    b_t       = g_{t0} + ... + g_t                  chunk-local cumulative decay (never a global cumsum)
    A[t, i]   = exp(s_i + (b_t - b_i) - m_t)        i <= t, built pairwise so big decays never touch a score
    A0[t]     = exp(lse_in + b_t - m_t)             the carried state, decayed to row t
    o_t       = (A @ V + A0 * o_in) / (sum_i A[t, i] + A0[t]),  lse_t = m_t + log(...)

The forward saves the per-token lse [B, T, H] and the state at each chunk start ([N_chunks, H, D], 1/C of the
values); the backward recomputes the weights from them (P = exp(logit - lse_t) <= 1) and runs the reverse
recurrence of section 3 one chunk at a time. With R (vector) and rho (scalar) the gradient flowing into the
state at the end of the chunk, and W_i = exp(s_i + b_e - b_i - lse_e), W0 = exp(lse_in + b_e - lse_e):

    delta_t = <dO_t, o_t> = sum_i P[t, i] <dO_t, v_i> + P0[t] <dO_t, o_in>
    dv_i    = sum_t P[t, i] dO_t + W_i R
    ds_i    = sum_t P[t, i] (<dO_t, v_i> - delta_t) + W_i (<v_i, R> - rho)
    R      <- sum_t P0[t] dO_t + W0 R,    rho <- sum_t P0[t] delta_t + W0 rho
    dg_k    = dlse_final - sum_{i >= k} ds_i        (shifted-score identity, section 4; see below)

Decay gradient: the logit of item i (token, or the incoming state as i = 0) seen from row t contains g_k exactly
when i < k <= t. Summed over all items of a row, the logit gradients give that row's lse gradient (0 for all
rows but the final state, and 0 for an empty row), so dg_k = sum_{t >= k} dlse_t - sum_{i >= k} ds_i.
The final state's gradients (d o_T, d lse_T) enter as R = d o_T, rho = <d o_T, o_T> - d lse_T.
After the first chunk, R and <o_0, R> - rho are the gradients of the initial state (o_0, lse_0).
The per-token lse is an output too (the split's summary scan hands it on): a gradient dlse_t enters as delta_t -
dlse_t in place of delta_t, and dg_k gains sum_{t >= k} dlse_t.

Varlen (cu_seqlens) is handled inside the kernel: program n reads its bounds from cu_seqlens.

Grouped values: v may have H / GV heads, each shared by GV consecutive op heads (a GQA model's query heads and slots
of one kv head); program (n, h) reads value head h // GV, so nothing is copied per op head. The backward writes dv
per op head (float32) and the host sums each group.

Mixed slots: the model reads op heads (query head, slot j) through out_t = sum_j mix_tj o_tj. Given the mixed
output's gradient dOut_t, the backward reads it once per query head (op head i_h reads row i_h // J), forms
<dOut_t, o_tj> as it forms delta_t (that is d mix_tj), and goes on with dO_tj = mix_tj dOut_t. Training keeps no
per-slot output.

The kernels are plain functions, wrapped by ``get_kernel`` at launch (compiled, or Triton's interpreter when
TRITON_INTERPRET=1). All loads are converted to fp32 at once (the interpreter gets bf16 arithmetic wrong); the
dots run in fp32 ("ieee") for fp32/fp64 inputs and tf32 for 16-bit inputs.
"""

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction


def _interpreting() -> bool:
    return bool(knobs.runtime.interpret)


# Reductions go through tl.reduce / tl.associative_scan with triton's own combine functions instead of tl.sum,
# tl.max, tl.cumsum (and tl.zeros, tl.cdiv are avoided): those are @jit functions decorated when triton is imported,
# so if triton was imported before TRITON_INTERPRET=1 was set, an interpreted kernel can't call them. The
# interpreter recognises these combine functions and reduces with numpy; compiled code is what tl.sum emits. Helpers
# kernels call are ``device_function``s, for the same reason.
_ADD = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max
_MIN = tl.standard._elementwise_min
_KERNELS = {}


class _DeviceFunction(JITFunction):
    """A function kernels call: compiled kernels inline it like any ``triton.jit`` function; Triton's interpreter,
    which runs a kernel as Python, calls it as Python (a plain JITFunction refuses that call, and ``triton.jit``
    decides interpreted or compiled once, at import, where kernels here are wrapped at launch: ``get_kernel``)."""

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def device_function(fn):
    return _DeviceFunction(fn)


def get_kernel(fn, key=("C", "BD"), warps=(4, 8), stages=(1, 2)):
    """Wrap a raw kernel function for the current mode (triton.jit reads TRITON_INTERPRET when it wraps, so wrap
    at launch time, not import time: tests switch the interpreter on after other modules imported this one).
    Interpreter: one config (multi-config autotune fails there); GPU: a small autotune over warps and stages (one
    warps and one stages value: no autotune, as a kernel that adds into its outputs needs)."""
    interp = _interpreting()
    k = _KERNELS.get((fn, interp))
    if k is None:
        if interp:
            configs = [triton.Config({}, num_warps=4, num_stages=1)]
        else:
            configs = [triton.Config({}, num_warps=w, num_stages=st) for w in warps for st in stages]
        k = _KERNELS[(fn, interp)] = triton.autotune(configs=configs, key=list(key))(triton.jit(fn))
    return k


def _aaren_chunk_fwd_kernel(
    s, v, g, o, lse, h0_o, h0_lse, ht_o, ht_lse, cs_o, cs_lse, cu_seqlens, chunk_offsets,
    T,
    H: tl.constexpr, GV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, C: tl.constexpr,
    HAS_G: tl.constexpr, HAS_H0: tl.constexpr, SAVE_CS: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c_base = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c_base = i_n.to(tl.int64) * ((T + C - 1) // C)
    L = (eos - bos).to(tl.int32)
    rows = tl.arange(0, C)
    cols = tl.arange(0, BD)
    mask_d = cols < D
    causal = rows[:, None] >= rows[None, :]
    i_nh = i_n.to(tl.int64) * H + i_h

    if HAS_H0:
        st_o = tl.load(h0_o + i_nh * D + cols, mask=mask_d, other=0).to(tl.float32)
        st_lse = tl.load(h0_lse + i_nh).to(tl.float32)
    else:
        st_o = tl.full([BD], 0.0, tl.float32)
        st_lse = tl.full([], float("-inf"), tl.float32)

    for i_c in range(0, (L + C - 1) // C):
        t = i_c * C + rows
        m_t = t < L
        off = (bos + t) * H + i_h
        off_v = (bos + t) * (H // GV) + i_h // GV  # op heads i_h of one value head read the same values
        b_s = tl.load(s + off, mask=m_t, other=0).to(tl.float32)
        valid = m_t & (b_s > float("-inf"))  # s = -inf: the token does not count
        if HAS_G:
            b_b = tl.associative_scan(tl.load(g + off, mask=m_t, other=0).to(tl.float32), 0, _ADD)
        else:
            b_b = tl.full([C], 0.0, tl.float32)
        if SAVE_CS:
            tl.store(cs_o + ((c_base + i_c) * H + i_h) * D + cols, st_o, mask=mask_d)
            tl.store(cs_lse + (c_base + i_c) * H + i_h, st_lse)

        keep = causal & valid[None, :]
        logit = tl.where(keep, b_s[None, :] + (b_b[:, None] - b_b[None, :]), float("-inf"))
        c_lse = st_lse + b_b  # carried state decayed to each row; -inf stays -inf
        mx = tl.maximum(tl.reduce(logit, 1, _MAX), c_lse)
        mx = tl.where(mx > float("-inf"), mx, 0.0)  # empty row: never form -inf - -inf
        a = tl.exp(logit - mx[:, None])
        a0 = tl.exp(c_lse - mx)
        w = tl.reduce(a, 1, _ADD) + a0
        m_td = m_t[:, None] & mask_d[None, :]
        b_v = tl.load(v + off_v[:, None] * D + cols[None, :], mask=m_td, other=0).to(tl.float32)
        acc = tl.dot(a, b_v, input_precision=DOT_PREC) + a0[:, None] * st_o[None, :]
        nonempty = w > 0
        w_safe = tl.where(nonempty, w, 1.0)
        b_o = acc / w_safe[:, None]
        b_lse = tl.where(nonempty, mx + tl.log(w_safe), float("-inf"))
        tl.store(o + off[:, None] * D + cols[None, :], b_o.to(o.dtype.element_ty), mask=m_td)
        tl.store(lse + off, b_lse, mask=m_t)
        # Rows past the end hold s = -inf and g = 0, so the last row equals the last real token's state.
        st_o = tl.reduce(tl.where(rows[:, None] == C - 1, b_o, 0.0), 0, _ADD)
        st_lse = tl.reduce(tl.where(rows == C - 1, b_lse, float("-inf")), 0, _MAX)

    tl.store(ht_o + i_nh * D + cols, st_o, mask=mask_d)
    tl.store(ht_lse + i_nh, st_lse)


def _aaren_chunk_bwd_kernel(
    s, v, g, do, dlse, lse, cs_o, cs_lse, h0_o, ht_o, ht_lse, dht_o, dht_lse, mix,
    ds, dv, dg, dh0_o, dh0_lse, dmix, cu_seqlens, chunk_offsets,
    T,
    H: tl.constexpr, GV: tl.constexpr, J: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, C: tl.constexpr,
    HAS_G: tl.constexpr, HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr, HAS_DLSE: tl.constexpr,
    HAS_MIX: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c_base = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c_base = i_n.to(tl.int64) * ((T + C - 1) // C)
    L = (eos - bos).to(tl.int32)
    rows = tl.arange(0, C)
    cols = tl.arange(0, BD)
    mask_d = cols < D
    causal = rows[:, None] >= rows[None, :]
    i_nh = i_n.to(tl.int64) * H + i_h

    if HAS_DHT:
        R = tl.load(dht_o + i_nh * D + cols, mask=mask_d, other=0).to(tl.float32)
        f_o = tl.load(ht_o + i_nh * D + cols, mask=mask_d, other=0).to(tl.float32)
        f_lse = tl.load(ht_lse + i_nh).to(tl.float32)
        dl_fin = tl.load(dht_lse + i_nh).to(tl.float32)
        dl_fin = tl.where(f_lse > float("-inf"), dl_fin, 0.0)  # an empty final state does not move with anything
        rho = tl.reduce(R * f_o, 0, _ADD) - dl_fin
    else:
        R = tl.full([BD], 0.0, tl.float32)
        dl_fin = tl.full([], 0.0, tl.float32)
        rho = tl.full([], 0.0, tl.float32)
    dg_acc = dl_fin  # dlse_final - sum of ds over the tokens after the current chunk

    n_c = (L + C - 1) // C
    for j in range(0, n_c):
        i_c = n_c - 1 - j
        t = i_c * C + rows
        m_t = t < L
        off = (bos + t) * H + i_h
        off_v = (bos + t) * (H // GV) + i_h // GV  # op heads i_h of one value head read the same values
        b_s = tl.load(s + off, mask=m_t, other=0).to(tl.float32)
        valid = m_t & (b_s > float("-inf"))
        if HAS_G:
            b_g = tl.load(g + off, mask=m_t, other=0).to(tl.float32)
            b_b = tl.associative_scan(b_g, 0, _ADD)
            b_e = tl.reduce(b_g, 0, _ADD)  # decay up to the chunk's last real token
        else:
            b_b = tl.full([C], 0.0, tl.float32)
            b_e = tl.full([], 0.0, tl.float32)
        b_l = tl.load(lse + off, mask=m_t, other=0).to(tl.float32)
        row_ok = m_t & (b_l > float("-inf"))
        l_row = tl.where(row_ok, b_l, 0.0)
        l_e = tl.load(lse + (bos + tl.minimum(i_c * C + C, L) - 1) * H + i_h).to(tl.float32)
        e_ok = l_e > float("-inf")
        l_e_s = tl.where(e_ok, l_e, 0.0)
        o_in = tl.load(cs_o + ((c_base + i_c) * H + i_h) * D + cols, mask=mask_d, other=0)
        l_in = tl.load(cs_lse + (c_base + i_c) * H + i_h)

        keep = causal & valid[None, :] & row_ok[:, None]
        P = tl.exp(tl.where(keep, b_s[None, :] + (b_b[:, None] - b_b[None, :]) - l_row[:, None], float("-inf")))
        P0 = tl.exp(tl.where(row_ok, l_in + b_b - l_row, float("-inf")))
        e_ok_c = (tl.full([C], 0.0, tl.float32) + l_e) > float("-inf")  # vector (the interpreter can't & a scalar)
        W = tl.exp(tl.where(valid & e_ok_c, b_s + (b_e - b_b) - l_e_s, float("-inf")))
        W0 = tl.exp(tl.where(e_ok, l_in + b_e - l_e_s, float("-inf")))

        m_td = m_t[:, None] & mask_d[None, :]
        b_v = tl.load(v + off_v[:, None] * D + cols[None, :], mask=m_td, other=0).to(tl.float32)
        off_do = off
        if HAS_MIX:  # do is the mixed output's gradient, one row per query head: its J slots read the same row
            off_do = (bos + t) * (H // J) + i_h // J
        b_do = tl.load(do + off_do[:, None] * D + cols[None, :], mask=m_td, other=0).to(tl.float32)
        DV = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)  # <dO_t, v_i>
        delta = tl.reduce(P * DV, 1, _ADD) + P0 * tl.reduce(b_do * o_in[None, :], 1, _ADD)  # <dO_t, o_t>
        if HAS_MIX:  # <dOut_t, o_t> is the mix weight's gradient; this slot's dO_t is mix_t dOut_t
            tl.store(dmix + off, delta.to(dmix.dtype.element_ty), mask=m_t)
            b_mx = tl.load(mix + off, mask=m_t, other=0).to(tl.float32)
            b_do = b_do * b_mx[:, None]
            DV = DV * b_mx[:, None]
            delta = delta * b_mx
        if HAS_DLSE:  # a row's lse moves with each of its logits by its weight: delta_t - dlse_t in place of delta_t
            b_dl = tl.where(row_ok, tl.load(dlse + off, mask=m_t, other=0).to(tl.float32), 0.0)
            delta = delta - b_dl
        dl = P * (DV - delta[:, None])
        b_ds = tl.reduce(dl, 0, _ADD) + W * (tl.reduce(b_v * R[None, :], 1, _ADD) - rho)
        b_dv = tl.dot(tl.trans(P), b_do, input_precision=DOT_PREC) + W[:, None] * R[None, :]
        tl.store(ds + off, b_ds.to(ds.dtype.element_ty), mask=m_t)
        tl.store(dv + off[:, None] * D + cols[None, :], b_dv.to(dv.dtype.element_ty), mask=m_td)
        b_dlg = b_ds
        if HAS_DLSE:  # dg_k also gathers the lse gradients of the rows t >= k
            b_dlg = b_ds - b_dl
        if HAS_G:
            b_dg = dg_acc - tl.associative_scan(b_dlg, 0, _ADD, reverse=True)
            tl.store(dg + off, b_dg.to(dg.dtype.element_ty), mask=m_t)
        dg_acc = dg_acc - tl.reduce(b_dlg, 0, _ADD)
        R = tl.reduce(P0[:, None] * b_do, 0, _ADD) + W0 * R
        rho = tl.reduce(P0 * delta, 0, _ADD) + W0 * rho

    if HAS_H0:
        o0 = tl.load(h0_o + i_nh * D + cols, mask=mask_d, other=0).to(tl.float32)
        tl.store(dh0_o + i_nh * D + cols, R.to(dh0_o.dtype.element_ty), mask=mask_d)
        tl.store(dh0_lse + i_nh, (tl.reduce(o0 * R, 0, _ADD) - rho).to(dh0_lse.dtype.element_ty))


# ----------------------------------------------------------------------------------------------------------------
# Host side


def check_inputs(s, v, g, initial_state, cu_seqlens):
    """(B, T, H, D, number of sequences, op heads per value head) of valid inputs; a clear error otherwise."""
    B, T, Hv, D = v.shape
    H = s.shape[-1]
    if s.shape != (B, T, H) or (g is not None and g.shape != (B, T, H)) or H % max(Hv, 1):
        g_shape = None if g is None else tuple(g.shape)
        raise ValueError(f"expected s and g of shape {(B, T)} + (H,), H a multiple of v's {Hv} heads, got "
                         f"{tuple(s.shape)} and {g_shape}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs a packed batch of size 1, got batch size {B}")
    n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and (
        initial_state[0].shape != (n_seq, H, D) or initial_state[1].shape != (n_seq, H)
    ):
        raise ValueError(f"initial_state must be ([{n_seq}, {H}, {D}], [{n_seq}, {H}])")
    return B, T, H, D, n_seq, H // max(Hv, 1)


def _layout(T, C, cu_seqlens, n_seq, known=None):
    """Chunk offsets of each sequence (varlen) and the total number of chunks; ``known``: both, from a caller that
    built cu_seqlens itself (reading them off cu_seqlens waits for the device)."""
    if known is not None:
        return known
    if cu_seqlens is None:
        return None, n_seq * triton.cdiv(T, C)
    cu = cu_seqlens.to(torch.int64)
    n_chunks = (cu[1:] - cu[:-1] + C - 1) // C
    offsets = torch.cumsum(n_chunks, 0) - n_chunks
    total, first, last = torch.stack([n_chunks.sum(), cu[0], cu[-1]]).tolist()  # one host sync
    if first != 0 or last != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {first} and {last}")
    return offsets, total


def _dot_precision(v):
    # The interpreter's dot is exact anyway. Compiled: full fp32 for fp32/fp64 inputs, tf32 (10-bit mantissa,
    # more than bf16's 7) for 16-bit inputs where the GPU has it (sm80+).
    if _interpreting() or v.dtype in (torch.float32, torch.float64) or not v.is_cuda:
        return "ieee"
    return "tf32" if torch.cuda.get_device_capability(v.device)[0] >= 8 else "ieee"


def _block_d(D):
    return max(16, triton.next_power_of_2(D))


def chunk_fwd(s, v, g, h0, cu_seqlens, chunk_size, save_cs, layout=None):
    """Returns o, lse per token, final state (o, lse) and the chunk-start states (or None)."""
    B, T, H, D, n_seq, GV = check_inputs(s, v, g, h0, cu_seqlens)
    C = chunk_size
    if C < 16 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {C}")
    offsets, n_chunks = _layout(T, C, cu_seqlens, n_seq, layout)
    dev = v.device
    o = v.new_empty(B, T, H, D)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=dev)
    ht_o = torch.empty(n_seq, H, D, dtype=torch.float32, device=dev)
    ht_lse = torch.empty(n_seq, H, dtype=torch.float32, device=dev)
    cs_o = torch.empty(max(n_chunks, 1) if save_cs else 1, H, D, dtype=torch.float32, device=dev)
    cs_lse = torch.empty(cs_o.shape[:2], dtype=torch.float32, device=dev)
    get_kernel(_aaren_chunk_fwd_kernel)[(n_seq, H)](
        s, v, g if g is not None else s, o, lse,
        h0[0] if h0 is not None else ht_o, h0[1] if h0 is not None else ht_lse,
        ht_o, ht_lse, cs_o, cs_lse,
        cu_seqlens if cu_seqlens is not None else lse, offsets if offsets is not None else lse,
        T, H=H, GV=GV, D=D, BD=_block_d(D), C=C,
        HAS_G=g is not None, HAS_H0=h0 is not None, SAVE_CS=save_cs, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=_dot_precision(v),
    )
    return o, lse, (ht_o, ht_lse), ((cs_o, cs_lse) if save_cs else None)


def chunk_bwd(s, v, g, h0, lse, cs, ht, do, dht, cu_seqlens, chunk_size, dlse=None, layout=None, mix=None):
    """With ``mix`` [B, T, H / J, J], do is the gradient of the mixed output [B, T, H / J, D]; returns mix's too."""
    B, T, H, D, n_seq, GV = check_inputs(s, v, g, h0, cu_seqlens)
    offsets, _ = _layout(T, chunk_size, cu_seqlens, n_seq, layout)
    J = 1 if mix is None else mix.shape[-1]
    if do is None:
        do = v.new_zeros(B, T, H // J, D)
    has_dht = dht is not None and (dht[0] is not None or dht[1] is not None)
    if has_dht:
        dht = (
            dht[0] if dht[0] is not None else torch.zeros_like(ht[0]),
            dht[1] if dht[1] is not None else torch.zeros_like(ht[1]),
        )
        dht = (dht[0].contiguous(), dht[1].contiguous())
    ds = torch.empty_like(s)
    # per op head; with grouped values summed over each group below, in float32
    dv = torch.empty_like(v) if GV == 1 else torch.empty(B, T, H, D, dtype=torch.float32, device=v.device)
    dg = torch.empty_like(g) if g is not None else None
    dh0 = (torch.empty_like(h0[0]), torch.empty_like(h0[1])) if h0 is not None else None
    dmix = None if mix is None else torch.empty(B, T, H, dtype=torch.float32, device=v.device)
    # The backward holds more tiles (V, dO, dV; P, dO V^T): more warps keep it in registers (ptxas, sm90, D=128).
    get_kernel(_aaren_chunk_bwd_kernel, warps=(8, 16))[(n_seq, H)](
        s, v, g if g is not None else s, do.contiguous(), dlse.contiguous() if dlse is not None else lse, lse,
        cs[0], cs[1],
        h0[0] if h0 is not None else lse, ht[0], ht[1],
        dht[0] if has_dht else lse, dht[1] if has_dht else lse, mix if mix is not None else lse,
        ds, dv, dg if dg is not None else ds,
        dh0[0] if dh0 is not None else ds, dh0[1] if dh0 is not None else ds, dmix if mix is not None else ds,
        cu_seqlens if cu_seqlens is not None else lse, offsets if offsets is not None else lse,
        T, H=H, GV=GV, J=J, D=D, BD=_block_d(D), C=chunk_size,
        HAS_G=g is not None, HAS_H0=h0 is not None, HAS_DHT=has_dht, HAS_DLSE=dlse is not None,
        HAS_MIX=mix is not None, IS_VARLEN=cu_seqlens is not None, DOT_PREC=_dot_precision(v),
    )
    if GV > 1:
        dv = dv.view(B, T, H // GV, GV, D).sum(3).to(v.dtype)
    if mix is not None:
        dmix = dmix.view(mix.shape).to(mix.dtype)
    return ds, dv, dg, dh0, dmix


def mix_slots(o, mix):
    """o [B, T, H, D] per op head, mix [B, T, H / J, J] -> [B, T, H / J, D]: one product per query head over its J
    slots, in o's dtype (float32 sums inside), as the model has always mixed them."""
    B, T = o.shape[:2]
    return torch.matmul(mix.to(o.dtype).unsqueeze(-2), o.view(B, T, *mix.shape[2:], o.shape[-1])).squeeze(-2)


class ChunkAarenFunction(torch.autograd.Function):
    """The scan per op head; with ``mix`` its output is the slots' mix (``mix_slots``), and backward, which gets the
    mixed output's gradient, gives mix's from the per-token sums it forms anyway: training keeps no per-slot
    output (J times the mixed one's bytes)."""

    @staticmethod
    def forward(ctx, s, v, g, h0_o, h0_lse, cu_seqlens, chunk_size, layout=None, mix=None):
        h0 = (h0_o, h0_lse) if h0_o is not None else None
        save = any(ctx.needs_input_grad[:5]) or (mix is not None and ctx.needs_input_grad[8])
        o, lse, ht, cs = chunk_fwd(s, v, g, h0, cu_seqlens, chunk_size, save_cs=save, layout=layout)
        if mix is not None:
            o = mix_slots(o, mix)
        if save:
            ctx.save_for_backward(s, v, g, h0_o, h0_lse, lse, cs[0], cs[1], ht[0], ht[1], cu_seqlens, mix)
            ctx.chunk_size, ctx.layout = chunk_size, layout
        ctx.set_materialize_grads(False)
        return o, lse, ht[0], ht[1]

    @staticmethod
    def backward(ctx, do, dlse, dht_o, dht_lse):
        s, v, g, h0_o, h0_lse, lse, cs_o, cs_lse, ht_o, ht_lse, cu_seqlens, mix = ctx.saved_tensors
        h0 = (h0_o, h0_lse) if h0_o is not None else None
        ds, dv, dg, dh0, dmix = chunk_bwd(
            s, v, g, h0, lse, (cs_o, cs_lse), (ht_o, ht_lse), do, (dht_o, dht_lse), cu_seqlens, ctx.chunk_size,
            dlse, ctx.layout, mix,
        )
        return ds, dv, dg, dh0[0] if dh0 else None, dh0[1] if dh0 else None, None, None, None, dmix


def prepare(s, v, g, initial_state):
    c = lambda x: None if x is None else x.contiguous()  # noqa: E731
    h0 = (None, None) if initial_state is None else (c(initial_state[0]), c(initial_state[1]))
    return c(s), c(v), c(g), h0


def chunk_aaren_triton(
    s: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor = None,
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor = None,
    chunk_size: int = 64,
    mix: torch.Tensor = None,
):
    """Chunked Triton Aaren scan; same op as ``aaren_hf.aaren_scan.chunk_aaren_torch`` (see its docstring). With
    ``mix`` [B, T, H / J, J] the output is the slots' mix [B, T, H / J, D] (``chunk_aaren_mixed_triton``)."""
    s, v, g, (h0_o, h0_lse) = prepare(s, v, g, initial_state)
    mix = None if mix is None else mix.contiguous()
    segments = 1 if cu_seqlens is not None else num_segments(*s.shape, chunk_size, v.device)
    if segments > 1:
        return split_chunk_aaren(s, v, g, initial_state, output_final_state, chunk_size, segments, mix)
    o, _, ht_o, ht_lse = ChunkAarenFunction.apply(s, v, g, h0_o, h0_lse, cu_seqlens, chunk_size, None, mix)
    return o, ((ht_o, ht_lse) if output_final_state else None)


def chunk_aaren_mixed_triton(s, v, mix, g=None, initial_state=None, output_final_state=False, chunk_size=64):
    """``aaren_hf.aaren_scan.chunk_aaren_mixed`` (same arguments and results: s [B, T, Hkv * G * J], v [B, T, Hkv,
    D], mix [B, T, Hkv * G, J]) as the Triton scan per op head, its J slots mixed after it and their gradients
    formed inside its backward."""
    return chunk_aaren_triton(s, v, g, initial_state, output_final_state, None, chunk_size, mix)


def num_segments(B, T, H, C, device, min_chunks=128, piece_chunks=16):
    """How many pieces to cut each sequence into so that (sequences x pieces x heads) programs fill the GPU: one
    program per (sequence, head) walks its T / C chunks one after another, so with B * H below the number of SMs
    most of the chip idles. The split costs a second pass, the summaries' scan (a third launch of this kernel) and a
    few small operators. Its first version, whose summary scan was tens of PyTorch operators and whose layout read
    values back from the device, made B=1 H=16 D=128 T=64K 1.9x faster on an H200 but 4K-16K slower, and ran from
    512 chunks on; this one runs from ``min_chunks`` chunks (8K tokens at C = 64), in pieces of at least
    ``piece_chunks`` chunks, at least 4 of them (expected to pay there; not yet measured on a GPU:
    ``bench_kernels.py`` prints it beside the kernel without the split)."""
    if device.type != "cuda" or T < min_chunks * C:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    pieces = min(-(-2 * sms // (B * H)), T // (piece_chunks * C))
    return pieces if pieces >= 4 else 1


def split_chunk_aaren(s, v, g, initial_state, output_final_state, chunk_size, segments, mix=None):
    """The same scan with each sequence cut into ``segments`` pieces that run in parallel (packed as varlen):
    pass 1 gives each piece's own final state; the carry into every piece is the scan of those summaries, each
    piece acting as one token whose score is its lse, whose value is its o and whose decay is its total log-decay,
    run by this same kernel (a few chunks of summaries; its per-token states are the carries); pass 2 reruns the
    pieces from their carries. Twice the work, ``segments`` times the parallelism, three launches; autograd runs
    the three backwards."""
    B, T, H = s.shape
    D, dev, C = v.shape[-1], v.device, chunk_size
    length = -(-T // segments // C) * C
    P = -(-T // length)
    # pieces and their chunk offsets built on the device from host numbers: nothing waits for the device
    cu = torch.cat([(torch.arange(B, device=dev)[:, None] * T + torch.arange(0, T, length, device=dev)).flatten(),
                    torch.full((1,), B * T, device=dev)])
    last_chunks = -(-(T - (P - 1) * length) // C)
    per_piece = torch.full((B, P), length // C, device=dev)
    per_piece[:, -1] = last_chunks
    per_piece = per_piece.flatten()
    layout = (torch.cumsum(per_piece, 0) - per_piece, B * ((P - 1) * (length // C) + last_chunks))
    flat = lambda x: None if x is None else x.reshape(1, B * T, *x.shape[2:])  # noqa: E731
    _, _, seg_o, seg_lse = ChunkAarenFunction.apply(flat(s), flat(v), flat(g), None, None, cu, C, layout)
    seg_g = None
    if g is not None:  # total log-decay of each piece
        seg_g = torch.nn.functional.pad(g.float(), (0, 0, 0, P * length - T)).view(B, P, length, H).sum(2)
    h0_o, h0_lse = (None, None) if initial_state is None else (initial_state[0].float(), initial_state[1].float())
    # the inclusive state after each piece: its o and lse [B, P, H(, D)]
    inc_o, inc_lse, fin_o, fin_lse = ChunkAarenFunction.apply(seg_lse.view(B, P, H), seg_o.view(B, P, H, D), seg_g,
                                                              h0_o, h0_lse, None, chunk_size)
    first_o = v.new_zeros(B, 1, H, D, dtype=torch.float32) if h0_o is None else h0_o.unsqueeze(1)
    first_lse = v.new_full((B, 1, H), float("-inf"), dtype=torch.float32) if h0_lse is None else h0_lse.unsqueeze(1)
    carry_o = torch.cat([first_o, inc_o[:, :-1]], 1).reshape(B * P, H, D)
    carry_lse = torch.cat([first_lse, inc_lse[:, :-1]], 1).reshape(B * P, H)
    o, _, _, _ = ChunkAarenFunction.apply(flat(s), flat(v), flat(g), carry_o, carry_lse, cu, C, layout, flat(mix))
    final = (fin_o, fin_lse) if output_final_state else None
    return o.view(B, T, -1, D), final
