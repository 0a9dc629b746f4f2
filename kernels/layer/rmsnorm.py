# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""RMSNorm in Triton, one launch forward and one backward (reference: ``AarenRMSNorm.forward`` in
modeling_aaren.py, whose formulas and roundings it follows):

    r = 1 / sqrt(mean(x^2) + eps)              float32, per row
    y = w * (x r, rounded to x's dtype)        (Llama)
    y = x r (1 + w), rounded to x's dtype      (Gemma, ``offset``)

In eager PyTorch a 16-bit norm is eight operators forward and about a dozen backward, and autograd keeps the float32
copy of x (twice the input's bytes) and the rounded x r for backward: two norms a layer kept 13.5 MiB of a 2,048-token
SmolLM2-shaped layer's 55 MiB. Here the forward keeps x as it came and r, and the backward recomputes x r from them.
The weight's gradient is summed per program in float32 and the programs' rows on the host: no atomics, the same bits
every run.
"""

import torch
import triton
import triton.language as tl

from ..aaren.chunk import _ADD, device_function, get_kernel
from ..memory.codes import _cast, _rounded

_BLOCK_ELEMENTS = 4096  # of a program's [rows, hidden] tile
_MAX_HIDDEN = 32768  # wider rows than this stay with PyTorch (a row is one tile)
_BWD_PROGRAMS = 1024  # the backward's programs, each a strided share of the rows: as many weight-gradient rows


@device_function
def _rows(x, start, R, N, BR: tl.constexpr, BN: tl.constexpr):
    """A block of BR rows from ``start``: (their offsets, mask, x in float32)."""
    rows = start + tl.arange(0, BR).to(tl.int64)
    cols = tl.arange(0, BN)
    m = (rows < R)[:, None] & (cols < N)[None, :]
    at = rows[:, None] * N + cols[None, :]
    return rows, at, m, tl.load(x + at, mask=m, other=0).to(tl.float32)


@device_function
def _weight(w, N, BN: tl.constexpr):
    cols = tl.arange(0, BN)
    return tl.load(w + cols, mask=cols < N, other=0).to(tl.float32)


def _rms_norm_fwd_kernel(x, w, y, rstd, R, N, eps, BR: tl.constexpr, BN: tl.constexpr, OFFSET: tl.constexpr):
    rows, at, m, b_x = _rows(x, tl.program_id(0).to(tl.int64) * BR, R, N, BR, BN)
    b_w = _weight(w, N, BN)
    r = tl.rsqrt(tl.reduce(b_x * b_x, 1, _ADD) / N + eps)
    n = b_x * r[:, None]
    if OFFSET:
        out = n * (1.0 + b_w[None, :])
    else:
        out = b_w[None, :] * _rounded(n, x.dtype.element_ty)
    tl.store(y + at, _cast(out, y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, r, mask=rows < R)


def _rms_norm_bwd_kernel(x, w, rstd, dy, dx, dw, R, N, P, BR: tl.constexpr, BN: tl.constexpr,
                         OFFSET: tl.constexpr):
    i_p = tl.program_id(0)
    b_w = _weight(w, N, BN)
    b_dw = tl.full([BR, BN], 0.0, tl.float32)
    for start in range(i_p * BR, R, P * BR):
        rows, at, m, b_x = _rows(x, start, R, N, BR, BN)
        r = tl.load(rstd + rows, mask=rows < R, other=0)
        b_dy = tl.load(dy + at, mask=m, other=0).to(tl.float32)
        n = b_x * r[:, None]
        if OFFSET:
            b_dw += b_dy * n
            dn = b_dy * (1.0 + b_w[None, :])
        else:  # autograd's: the rounded x r's gradient is w dy in x's dtype
            b_dw += b_dy * _rounded(n, x.dtype.element_ty)
            dn = _rounded(b_dy * b_w[None, :], x.dtype.element_ty)
        # d/dx of x r: r (dn - n mean(dn n))
        b_dx = r[:, None] * (dn - n * (tl.reduce(dn * n, 1, _ADD) / N)[:, None])
        tl.store(dx + at, _cast(b_dx, dx.dtype.element_ty), mask=m)
    cols = tl.arange(0, BN)
    tl.store(dw + i_p * N + cols, tl.reduce(b_dw, 0, _ADD), mask=cols < N)


def _blocks(N):
    BN = triton.next_power_of_2(N)
    return BN, max(1, _BLOCK_ELEMENTS // BN)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        N = x.shape[-1]
        x2 = x.reshape(-1, N).contiguous()
        R = x2.shape[0]
        BN, BR = _blocks(N)
        # (promote_types only where the dtypes differ: a GPU runs nothing for it, but it is a dispatched operator)
        y = torch.empty(x.shape, device=x.device, dtype=x.dtype if offset or weight.dtype == x.dtype
                        else torch.promote_types(weight.dtype, x.dtype))
        rstd = torch.empty(R, device=x.device, dtype=torch.float32)
        get_kernel(_rms_norm_fwd_kernel, key=("BN", "OFFSET"), warps=(4, 8), stages=(1,))[(triton.cdiv(R, BR),)](
            x2, weight, y, rstd, R, N, float(eps), BR=BR, BN=BN, OFFSET=bool(offset))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape, ctx.offset = x.shape, bool(offset)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        R, N = x2.shape
        BN, BR = _blocks(N)
        P = max(1, min(triton.cdiv(R, BR), _BWD_PROGRAMS))
        dx = torch.empty_like(x2)
        dw = torch.empty(P, N, device=x2.device, dtype=torch.float32)
        # one config: its programs' shares of the rows, and so the sums' order, do not depend on tuning
        get_kernel(_rms_norm_bwd_kernel, key=("BN", "OFFSET"), warps=(4,), stages=(1,))[(P,)](
            x2, weight, rstd, dy.contiguous(), dx, dw, R, N, P, BR=BR, BN=BN, OFFSET=ctx.offset)
        return dx.view(ctx.shape), dw.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None


def rms_norm_triton(x, weight, eps, offset=False):
    """``AarenRMSNorm`` of x [..., N] with weight [N] (``offset``: scale by 1 + weight, as Gemma's), with its
    gradients; None where the kernel does not take the inputs (float64, rows wider than 32,768)."""
    if (x.shape[-1] > _MAX_HIDDEN or x.shape[-1] == 0 or torch.float64 in (x.dtype, weight.dtype)
            or weight.shape != x.shape[-1:]):
        return None
    return RMSNormFunction.apply(x, weight, eps, offset)
