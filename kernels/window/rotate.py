# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Rotary embedding in Triton, for a GPU: ``rotate_by`` in aaren_hf/modeling_aaren.py is the reference (and
``rotate.c`` the CPU's one pass). The reference runs five to eight operators per call (a float32 copy of the rotated
channels, a negation, a concatenation, two products, a sum, the cast back, the concatenation with the channels left
as they are), each a launch and a pass over the tensor; a prefill turns the queries, the keys and the sink keys, and
training turns each gradient back again. Here one launch reads x once and writes the result once.

The same bits as the reference: ``_rotated`` below (which the decode step's kernel and the window attention kernels
turn their keys and queries with as they read them) in float32, two rounded products and their rounded sum (float
contraction off: an fma would round otherwise), then the cast to x's dtype as ``.to()`` rounds.
"""

import torch
import triton
import triton.language as tl

from ..aaren.chunk import device_function, get_kernel
from ..memory.codes import _cast


@device_function
def _rotated(x, at, rows, cols, cos, sin, D: tl.constexpr, ROT: tl.constexpr):
    """Float32 rows x[at + cols] rotated (rotate-half rotary on the first ROT channels; as ``rotate_by``:
    x * cos + rotate_half(x) * sin); ``at`` [R, 1] row offsets, ``rows`` [R, 1] which of them to read, ``cols``
    [1, BD], cos and sin [1, BD]."""
    half: tl.constexpr = ROT // 2
    m_d = rows & (cols < D)
    v = tl.load(x + at + cols, mask=m_d, other=0).to(tl.float32)
    partner = tl.load(x + at + tl.where(cols < half, cols + half, cols - half), mask=m_d & (cols < ROT), other=0)
    partner = partner.to(tl.float32)
    partner = tl.where(cols < half, -partner, partner)
    return tl.where(cols < ROT, v * cos + partner * sin, v)


@device_function
def _angles(cos, sin, at, rows, cols, ROT: tl.constexpr):
    """The angles' cos and sin at ``at`` + cols (``at`` a token's row of ROT), ``rows`` which tokens to read: 1 and 0
    past ROT and where not read, so that ``_rotated`` leaves those channels as they are."""
    m = rows & (cols < ROT)
    return tl.load(cos + at + cols, mask=m, other=1.0), tl.load(sin + at + cols, mask=m, other=0.0)


def _rotate_kernel(x, cos, sin, out, NH, T, stride_b, stride_t, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                   ROT: tl.constexpr, BR: tl.constexpr, INVERSE: tl.constexpr):
    # one program per BR rows of D channels (a token's head each); the angles are the token's, shared by its heads.
    # x's token rows may be strided (the sink keys, one copy broadcast over the turns they take)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)[:, None]
    m_r = rows < NH
    cols = tl.arange(0, BD)[None, :]
    token = rows // H
    c, s = _angles(cos, sin, token * ROT, m_r, cols, ROT)
    if INVERSE:  # -sin, as the reference negates it: exact
        s = -s
    y = _rotated(x, (token // T) * stride_b + (token % T) * stride_t + (rows % H) * D, m_r, cols, c, s, D, ROT)
    tl.store(out + rows * D + cols, _cast(y, out.dtype.element_ty), mask=m_r & (cols < D))


def rotate_triton(x, cos, sin, inverse=False):
    """``rotate_by(x, cos, sin, inverse)`` in one launch, the same bits: x [B, T, h, D] (float32, bfloat16 or float16)
    on a GPU, cos and sin [B, T, 1, rot] float32 as ``rotary_angles`` gives them (``inverse`` turns back). None where
    the kernel does not take the inputs (other shapes or dtypes: the reference serves). No gradient: ``_Rotate`` (or
    no_grad) provides it."""
    rot = cos.shape[-1]
    if (x.dim() != 4 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or rot % 2 or rot > x.shape[-1]
            or cos.dtype != torch.float32 or sin.dtype != cos.dtype or cos.shape != sin.shape
            or cos.shape != (*x.shape[:2], 1, rot) or x.device != cos.device or x.device != sin.device):
        return None
    B, T, H, D = x.shape
    if x.stride(3) != 1 or x.stride(2) != D:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    NH = B * T * H
    if NH:
        BD = triton.next_power_of_2(D)
        BR = max(1, 4096 // BD)
        get_kernel(_rotate_kernel, key=("H", "D", "ROT"), warps=(4,), stages=(1,))[(triton.cdiv(NH, BR),)](
            x, cos, sin, out, NH, T, x.stride(0), x.stride(1), H=H, D=D, BD=BD, ROT=rot, BR=BR,
            INVERSE=bool(inverse), enable_fp_fusion=False)
    return out
