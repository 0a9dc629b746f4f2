# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""A gated MLP's silu(gate) * up in Triton, one launch forward and one backward (reference: ``AarenMLP.forward`` in
modeling_aaren.py, with ``hidden_act="silu"``, whose roundings it follows: silu(gate) is rounded to the inputs'
dtype before the product, as the two eager operators round it).

In eager PyTorch autograd keeps gate, up and silu(gate) for backward, three tensors of the MLP's width (18 MiB of a
2,048-token SmolLM2-shaped layer); here the forward keeps gate and up, and the backward recomputes silu(gate), in one
launch where autograd runs three.
"""

import torch
import triton
import triton.language as tl

from ..aaren.chunk import device_function, get_kernel
from ..memory.codes import _cast

_BLOCK = 1024


@device_function
def _load(gate, up, N, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = at < N
    b_g = tl.load(gate + at, mask=m, other=0).to(tl.float32)
    e = tl.exp(-tl.abs(b_g))  # no overflow: sigmoid(g) = 1 / (1 + e) or e / (1 + e)
    sig = tl.where(b_g >= 0, 1.0, e) / (1.0 + e)
    # silu(gate) as the eager operator leaves it: in the inputs' dtype
    return at, m, b_g, sig, _cast(b_g * sig, gate.dtype.element_ty).to(tl.float32), tl.load(up + at, mask=m,
                                                                                             other=0).to(tl.float32)


def _swiglu_fwd_kernel(gate, up, h, N, BLOCK: tl.constexpr):
    at, m, b_g, sig, act, b_u = _load(gate, up, N, BLOCK)
    tl.store(h + at, _cast(act * b_u, h.dtype.element_ty), mask=m)


def _swiglu_bwd_kernel(gate, up, dh, dgate, dup, N, BLOCK: tl.constexpr):
    at, m, b_g, sig, act, b_u = _load(gate, up, N, BLOCK)
    b_dh = tl.load(dh + at, mask=m, other=0).to(tl.float32)
    dact = _cast(b_dh * b_u, gate.dtype.element_ty).to(tl.float32)  # the product's gradient, rounded as autograd's
    tl.store(dup + at, _cast(b_dh * act, dup.dtype.element_ty), mask=m)
    tl.store(dgate + at, _cast(dact * sig * (1.0 + b_g * (1.0 - sig)), dgate.dtype.element_ty), mask=m)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        h = torch.empty_like(gate)
        N = gate.numel()
        get_kernel(_swiglu_fwd_kernel, key=("BLOCK",), warps=(4,), stages=(1,))[(triton.cdiv(N, _BLOCK),)](
            gate, up, h, N, BLOCK=_BLOCK)
        ctx.save_for_backward(gate, up)
        return h

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        N = gate.numel()
        get_kernel(_swiglu_bwd_kernel, key=("BLOCK",), warps=(4,), stages=(1,))[(triton.cdiv(N, _BLOCK),)](
            gate, up, dh.contiguous(), dgate, dup, N, BLOCK=_BLOCK)
        return dgate, dup


def swiglu_triton(gate, up):
    """silu(gate) * up, with its gradients; None where the kernel does not take the inputs (float64, different
    shapes or dtypes)."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype == torch.float64:
        return None
    return SwiGLUFunction.apply(gate, up)
