# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The window branch's one-token decode step in Triton: one launch per layer where ``AarenMixer.window_step`` (the
reference, aaren_hf/modeling_aaren.py) runs about 140 small operators, each a launch on a GPU, which at batch 1 cost
more than the arithmetic. The algorithm is ``step.c``'s (the CPU's step); per sequence b, for each kv head:

  1. the token's query and key rotated at its position (angles computed by the caller, as the reference computes
     them, so the stored key is the same bit for bit), its key and value rounded as the window stores them; a token
     among the first S positions also fills its sink slot;
  2. one softmax over the window (its W - 1 entries and the token), the sinks (keys turned by p - (S + W - 1)) and
     the memory (codes read back; with Hadamard codes the query is turned instead and the memory's part of the
     output turned back once);
  3. the oldest window entry offered to the memory: it takes the weakest slot (lowest score, then oldest) if it
     ranks (offer_to_memory's rule), coded as ``MemoryCodes.encode`` codes it (the same butterflies, the bfloat16
     scale by integer arithmetic, round-half-even codes: the same bytes); the token's retention score ranked as
     ``ranking_score`` ranks it (the 1/64 grid; the layers' shared best, which one program holds for its sequence);
  4. the window shifted by one, in place;
  5. in a layer with an Aaren branch, the output mixed with that branch's (``mix_branches``: the gate's sigmoid and
     torch.lerp's two formulas in the output's dtype), so the layer's step launches nothing between the two kernels
     and o_proj.

The state is written in place (same addresses every step, as a CUDA graph needs). One program per sequence, because
positions are per sequence and every kv head moves them; a padding token (position -1) gets output 0 and still
enters the window. Float contraction is off (``enable_fp_fusion=False``): an fma would round the rotary products
otherwise than the reference does. The output is a float32 sum in another order than the reference's: equal to
rounding.
"""

import torch
import triton
import triton.language as tl

from ..aaren.chunk import _ADD, _MAX, _MIN, device_function, get_kernel
from ..memory.codes import _butterflies, _cast, _codes, _rounded, _store_codes
from ..memory.evict import _on_grid
from ..state import writable
from .chunk import _softmax_step
from .rotate import _angles, _rotated


@device_function
def _read_entries(mem, mem_scale, e, cols, m_e, D: tl.constexpr, BITS: tl.constexpr):
    """Memory entries e [N, 1] as float32 [N, BD]: stored values, or codes times their scale (``MemoryCodes.decode``
    leaving Hadamard codes rotated): 4 bits two to a byte, the first half of the vector in the low nibbles."""
    m_d = cols < D
    if BITS == 4:
        byte = tl.load(mem + e * (D // 2) + cols % (D // 2), mask=m_e & m_d, other=0).to(tl.int32)
        code = ((byte >> tl.where(cols >= D // 2, 4, 0)) & 15) - 8
        return code.to(tl.float32) * tl.load(mem_scale + e, mask=m_e, other=0).to(tl.float32)
    if BITS == 8:
        code = tl.load(mem + e * D + cols, mask=m_e & m_d, other=0).to(tl.float32)
        return code * tl.load(mem_scale + e, mask=m_e, other=0).to(tl.float32)
    return tl.load(mem + e * D + cols, mask=m_e & m_d, other=0).to(tl.float32)


def _window_step_kernel(
    q, k, v, pos, cos_t, sin_t, cos_s, sin_s, retention, shared, out, aaren_o, gate, gate_b,
    win_k, win_v, win_pos, win_score, sink_k, sink_v, sink_pos,
    mem_k, mem_v, mem_k_scale, mem_v_scale, mem_pos, mem_score,
    scale,
    H: tl.constexpr, HKV: tl.constexpr, BHKV: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr,
    BD: tl.constexpr, LOG_BD: tl.constexpr, ROT: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, S: tl.constexpr,
    M: tl.constexpr, BM: tl.constexpr, MP: tl.constexpr, BITS: tl.constexpr, ROTATE: tl.constexpr,
    SATURATE: tl.constexpr, MIX: tl.constexpr, SHARE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    WP: tl.constexpr = W - 1  # window entries held
    p = tl.load(pos + b)
    cols = tl.arange(0, BD)[None, :]
    m_d = cols < D
    # conditions on the token's position as tensors ([1, BD]): Triton's interpreter mishandles a scalar condition
    # combined with a tensor one
    pc = p + 0 * cols
    a_sink = (pc >= 0) & (pc < S)  # the token fills sink slot p
    ct, st = _angles(cos_t, sin_t, b * ROT, m_d, cols, ROT)  # the token's angles
    cs, ss = _angles(cos_s, sin_s, b * ROT, m_d, cols, ROT)  # the sink keys' turn
    j = tl.arange(0, BW)[:, None]  # window rows: W - 1 held, then the token
    held = j < WP
    old_pos = tl.load(win_pos + b * WP + j, mask=held, other=-1)
    key_pos = tl.where(j == WP, p, old_pos)
    next_pos = tl.load(win_pos + b * WP + j + 1, mask=j + 1 < WP, other=-1)
    g = tl.arange(0, BG)[:, None]
    m_g = g < G
    stored = win_k.dtype.element_ty
    if SHARE == 1:  # this layer's best ranking score over kv heads, for the layers after it
        heads = tl.arange(0, BHKV)
        own = tl.load(retention + b * HKV + heads, mask=heads < HKV, other=float("-inf")).to(tl.float32)
        tl.store(shared + b, tl.reduce(_on_grid(own), 0, _MAX))
    if SHARE == 2:
        best = tl.load(shared + b)

    for hk in range(HKV):
        row = b * HKV + hk
        # 1. the token: query and key rotated at its position, rounded to the model's dtype (rotate_by); key and
        # value as the window stores them (float16: saturated, as to_cache does)
        kr = _rounded(_rotated(k, row * D, True, cols, ct, st, D, ROT), k.dtype.element_ty)
        vr = tl.load(v + row * D + cols, mask=m_d, other=0).to(tl.float32)
        if SATURATE:
            kr, vr = tl.minimum(tl.maximum(kr, -65504.0), 65504.0), tl.minimum(tl.maximum(vr, -65504.0), 65504.0)
        k_new, v_new = _cast(kr, stored), _cast(vr, stored)
        qr = _cast(_rotated(q, (b * H + hk * G + g) * D, m_g, cols, ct, st, D, ROT), q.dtype.element_ty)
        qr = qr.to(tl.float32)
        qr = tl.where(m_g, qr, 0.0)  # [BG, BD]

        # 2. window: its entries where they lie, the token as its last row
        at = ((b * WP + j) * HKV + hk) * D + cols
        keys = tl.where(j == WP, k_new.to(tl.float32), tl.load(win_k + at, mask=held & m_d, other=0).to(tl.float32))
        vals = tl.where(j == WP, v_new.to(tl.float32), tl.load(win_v + at, mask=held & m_d, other=0).to(tl.float32))
        s = tl.reduce(qr[:, None, :] * keys[None, :, :], 2, _ADD) * scale  # [BG, BW]
        s = tl.where(tl.reshape(key_pos >= 0, (1, BW)), s, float("-inf"))
        m_i, _, w, l_i = _softmax_step(tl.full([BG], float("-inf"), tl.float32), tl.full([BG], 0.0, tl.float32), s)
        acc = tl.reduce(w[:, :, None] * vals[None, :, :], 1, _ADD)  # [BG, BD]

        # sinks: seen from min(p, S + W - 1), i.e. their keys turned by p - (S + W - 1); not while in the window
        for i in tl.static_range(S):
            at_s = ((b * S + i) * HKV + hk) * D
            sp = tl.where(p == i, p, tl.load(sink_pos + b * S + i))
            sk = _rotated(sink_k, at_s, True, cols, cs, ss, D, ROT)
            sv = tl.load(sink_v + at_s + cols, mask=m_d, other=0).to(tl.float32)
            sv = tl.where(p == i, v_new.to(tl.float32), sv)
            s_i = tl.reduce(qr * sk, 1, _ADD) * scale
            spg = sp + 0 * g
            s_i = tl.where((spg >= 0) & (spg <= p - W), s_i[:, None], float("-inf"))
            m_i, alpha, w_i, l_i = _softmax_step(m_i, l_i, s_i)
            acc = acc * alpha[:, None] + w_i * sv

        # memory: codes read back; Hadamard codes are in the turned basis: <q S, k S / D> = <q, k>
        acc_m = tl.full([BG, BD], 0.0, tl.float32)
        if M > 0:
            qm = qr
            if ROTATE:
                qm = _butterflies(qr, BG, BD, LOG_BD)
            for m0 in range(0, M, BM):
                e = m0 + tl.arange(0, BM)[:, None]
                m_e = e < M
                e = row * M + e
                seen = tl.load(mem_pos + e, mask=m_e, other=-1) >= 0
                mk = _read_entries(mem_k, mem_k_scale, e, cols, m_e, D, BITS)
                s_m = tl.reduce(qm[:, None, :] * mk[None, :, :], 2, _ADD) * scale
                s_m = tl.where(tl.reshape(seen, (1, BM)), s_m, float("-inf"))
                m_i, alpha, w_m, l_i = _softmax_step(m_i, l_i, s_m)
                mv = _read_entries(mem_v, mem_v_scale, e, cols, m_e, D, BITS)
                acc = acc * alpha[:, None]
                acc_m = acc_m * alpha[:, None] + tl.reduce(w_m[:, :, None] * mv[None, :, :], 1, _ADD)
            if ROTATE:
                acc_m = _butterflies(acc_m, BG, BD, LOG_BD)
        o = tl.where(p + 0 * g >= 0, (acc + acc_m) / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)  # padding sees nothing
        o = _cast(o, out.dtype.element_ty)  # as the reference returns it
        at_o = (b * H + hk * G + g) * D + cols
        if MIX:  # mix_branches: lerp(Aaren's, the window's, sigmoid(gate)) in the output's dtype, torch.lerp's formulas
            a = tl.load(aaren_o + at_o, mask=m_g & m_d, other=0).to(tl.float32)
            z = tl.load(gate + b * gate_b + hk * G + g, mask=m_g, other=0).to(tl.float32)
            w = _rounded(1.0 / (1.0 + tl.exp(-z)), out.dtype.element_ty)
            e = o.to(tl.float32)
            o = _cast(tl.where(w < 0.5, a + w * (e - a), e - (e - a) * (1.0 - w)), out.dtype.element_ty)
        tl.store(out + at_o, o, mask=m_g & m_d)

        # 3. the oldest window entry offered to the memory: the weakest slot (lowest score, then oldest, then first)
        # takes it if it ranks and is a real token past the sinks
        if M > 0:
            slots = tl.arange(0, MP)
            m_s = slots < M
            score = tl.load(mem_score + row * M + slots, mask=m_s, other=float("inf"))
            spos = tl.load(mem_pos + row * M + slots, mask=m_s, other=0)
            low = tl.reduce(score, 0, _MIN)
            oldest = tl.reduce(tl.where((score == low) & m_s, spos, 0x7FFFFFFFFFFFFFFF), 0, _MIN)
            slot = tl.reduce(tl.where((score == low) & (spos == oldest) & m_s, slots, M), 0, _MIN)
            s0 = tl.load(win_score + (b * WP) * HKV + hk)
            p0 = tl.load(win_pos + b * WP)
            two = tl.arange(0, 2)[:, None]  # row 0 the key, row 1 the value
            enters = ((s0 + 0 * two) >= low) & ((p0 + 0 * two) >= S)  # [2, 1], the same in both rows
            first = ((b * WP) * HKV + hk) * D + cols
            leaving = tl.load(tl.where(two == 0, win_k, win_v) + first, mask=m_d & (two < 2), other=0)
            e = row * M + slot
            tl.debug_barrier()  # every thread past its reads of the memory before the slot is written
            if BITS == 0:
                tl.store(tl.where(two == 0, mem_k, mem_v) + e * D + cols, leaving, mask=enters & m_d)
            else:  # key and value coded together, as encode codes stack([k, v])
                c, sc = _codes(leaving.to(tl.float32), 2, D, LOG_BD, BITS, ROTATE)
                tl.store(tl.where(two == 0, mem_k_scale, mem_v_scale) + e, sc.to(tl.bfloat16), mask=enters)
                _store_codes(c, tl.where(two == 0, mem_k, mem_v) + e * (D // 2 if BITS == 4 else D), enters, 2, D,
                             BITS)
            tl.store(mem_pos + e + 0 * two, p0 + 0 * two, mask=enters & (two == 0))
            tl.store(mem_score + e + 0 * two, s0 + 0 * two, mask=enters & (two == 0))
            next_score = tl.load(win_score + (b * WP + j + 1) * HKV + hk, mask=j + 1 < WP, other=0)
            ranked = _on_grid(tl.load(retention + row).to(tl.float32))
            if SHARE == 2:
                ranked = tl.maximum(ranked, best)
            next_score = tl.where(j + 1 == WP, ranked, next_score)

        # 4. the window shifted by one (every row read before any is written), the token last; its sink slot
        at_next = ((b * WP + j + 1) * HKV + hk) * D + cols
        next_k = tl.where(j + 1 == WP, k_new, tl.load(win_k + at_next, mask=(j + 1 < WP) & m_d, other=0))
        next_v = tl.where(j + 1 == WP, v_new, tl.load(win_v + at_next, mask=(j + 1 < WP) & m_d, other=0))
        tl.debug_barrier()
        tl.store(win_k + at, next_k, mask=held & m_d)
        tl.store(win_v + at, next_v, mask=held & m_d)
        if M > 0:
            tl.store(win_score + (b * WP + j) * HKV + hk, next_score, mask=held)
        at_sink = ((b * S + p) * HKV + hk) * D + cols
        tl.store(sink_k + at_sink, k_new, mask=a_sink & m_d)
        tl.store(sink_v + at_sink, v_new, mask=a_sink & m_d)
        tl.debug_barrier()

    tl.store(win_pos + b * WP + j, tl.where(j + 1 == WP, p, next_pos), mask=held)
    tl.store(sink_pos + b * S + pc, pc, mask=a_sink & (cols == 0))


def window_step_triton(q, k, v, pos, angles, sink_turn, state, retention, share, window, sinks, memory_size, bits,
                       rotate, kv_cache_dtype, scale, mix=None):
    """``AarenMixer.window_step`` in one launch: q [B, 1, H, D], k and v [B, 1, Hkv, D] before rotary, pos [B, 1];
    ``angles`` and ``sink_turn`` from ``step_angles``; where there is a memory, ``retention`` [B, 1, Hkv] (the score
    as ``retention_score`` computes it: the kernel ranks it) and ``share`` (``AarenMixer.sharing``'s mode and tensor).
    Returns the output [B, 1, H, D] in q's dtype, with ``mix`` (the Aaren branch's output in q's dtype, the gate
    logits [H] or [B, 1, H]) mixed with it as ``mix_branches`` mixes them, and leaves the new state in ``state``
    (written in place); None, touching nothing, where the kernel does not take the inputs (a head size that is not a
    power of 2 with memory codes, a window held in another dtype than the step stores, a query group over 64 heads,
    an Aaren output in another dtype than q's)."""
    B, _, H, D = q.shape
    Hkv, W, S, M = k.shape[2], window, sinks, memory_size
    stored = kv_cache_dtype or k.dtype
    if (state.window_k.dtype != stored or H % Hkv or H // Hkv > 64 or W < 2
            or (bits and (D & (D - 1) or D < 4)) or (M > 0 and not bits and state.memory_k.dtype != stored)
            or (mix is not None and mix[0].dtype != q.dtype)):
        return None
    inference = torch.is_inference_mode_enabled()
    names = ["window_k", "window_v", "window_pos", "sink_k", "sink_v", "sink_pos"]
    if M > 0:
        names += ["window_score", "memory_k", "memory_v", "memory_pos", "memory_score"]
        names += ["memory_k_scale", "memory_v_scale"] if bits else []
    t = {name: writable(state, name, inference) for name in names}
    cos_t, sin_t = (a.reshape(B, -1).float().contiguous() for a in angles)
    cos_s, sin_s = (cos_t, sin_t) if sink_turn is None else (a.reshape(B, -1).float().contiguous() for a in sink_turn)
    out = torch.empty(B, 1, H, D, device=q.device, dtype=q.dtype)
    dummy = out  # for the pointers a configuration does not read
    aaren_o, gate = (dummy, dummy) if mix is None else (mix[0].contiguous(), mix[1].contiguous())
    G, BD = H // Hkv, triton.next_power_of_2(D)
    get_kernel(_window_step_kernel, key=("D", "M", "BITS"), warps=(4,), stages=(1,))[(B,)](
        q.contiguous(), k.contiguous(), v.contiguous(), pos.reshape(B).contiguous(), cos_t, sin_t, cos_s, sin_s,
        dummy if retention is None else retention.contiguous(), dummy if share[1] is None else share[1], out,
        aaren_o, gate,
        H if gate.dim() == 3 else 0,
        t["window_k"], t["window_v"], t["window_pos"], t.get("window_score", dummy), t["sink_k"], t["sink_v"],
        t["sink_pos"], t.get("memory_k", dummy), t.get("memory_v", dummy), t.get("memory_k_scale", dummy),
        t.get("memory_v_scale", dummy), t.get("memory_pos", dummy), t.get("memory_score", dummy), float(scale),
        H=H, HKV=Hkv, BHKV=triton.next_power_of_2(Hkv), G=G, BG=triton.next_power_of_2(G), D=D, BD=BD,
        LOG_BD=BD.bit_length() - 1, ROT=cos_t.shape[-1],
        W=W, BW=triton.next_power_of_2(W), S=S, M=M, BM=min(64, triton.next_power_of_2(max(M, 1))),
        MP=triton.next_power_of_2(max(M, 1)), BITS=bits or 0, ROTATE=bool(rotate and bits),
        SATURATE=stored == torch.float16 and k.dtype != torch.float16, MIX=mix is not None, SHARE=share[0],
        enable_fp_fusion=False)
    return out
