# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""A gated MLP's act(gate) * up in Triton, one launch forward and one backward, for silu (Llama's SwiGLU) and the
tanh-approximated GELU (Gemma's GeGLU) (reference: ``AarenMLP.forward`` in modeling_aaren.py, whose roundings it
follows: act(gate) is rounded to the inputs' dtype before the product, as the two eager operators round it; torch's
formulas for both activations and their derivatives, with tanh and the sigmoid taken from exp(-|x|), which never
overflows).

In eager PyTorch autograd keeps gate, up and act(gate) for backward, three tensors of the MLP's width (18 MiB of a
2,048-token SmolLM2-shaped layer); here the forward keeps gate and up, and the backward recomputes act(gate), in one
launch where autograd runs three.
"""

import torch
import triton
import triton.language as tl

from ..aaren.chunk import device_function, get_kernel
from ..memory.codes import _cast, _rounded

# by the names of transformers' ACT2FN, which the model's config gives (hidden_act): silu, and the tanh GELU as
# torch computes it
ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}
_BLOCK = 1024


@device_function
def _activation(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in float32."""
    if ACT == 0:
        e = tl.exp(-tl.abs(g))  # sigmoid(g) = 1 / (1 + e) or e / (1 + e)
        sig = tl.where(g >= 0, 1.0, e) / (1.0 + e)
        return g * sig, sig * (1.0 + g * (1.0 - sig))
    # torch's constants (literals: a kernel reads no module-level float): sqrt(2 / pi) and kappa = 0.044715
    inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
    e = tl.exp(-2.0 * tl.abs(inner))
    t = tl.where(inner >= 0, 1.0, -1.0) * ((1.0 - e) / (1.0 + e))  # tanh(inner)
    left = 0.5 * g
    right = 1.0 + t
    return left * right, 0.5 * right + left * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * (g * g))


@device_function
def _load(gate, up, N, BLOCK: tl.constexpr, ACT: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = at < N
    b_g = tl.load(gate + at, mask=m, other=0).to(tl.float32)
    act, slope = _activation(b_g, ACT)
    # act(gate) as the eager operator leaves it: in the inputs' dtype
    return at, m, _rounded(act, gate.dtype.element_ty), slope, tl.load(up + at, mask=m,
                                                                                   other=0).to(tl.float32)


def _glu_fwd_kernel(gate, up, h, N, BLOCK: tl.constexpr, ACT: tl.constexpr):
    at, m, act, slope, b_u = _load(gate, up, N, BLOCK, ACT)
    tl.store(h + at, _cast(act * b_u, h.dtype.element_ty), mask=m)


def _glu_bwd_kernel(gate, up, dh, dgate, dup, N, BLOCK: tl.constexpr, ACT: tl.constexpr):
    at, m, act, slope, b_u = _load(gate, up, N, BLOCK, ACT)
    b_dh = tl.load(dh + at, mask=m, other=0).to(tl.float32)
    dact = _rounded(b_dh * b_u, gate.dtype.element_ty)  # the product's gradient, rounded as autograd's
    tl.store(dup + at, _cast(b_dh * act, dup.dtype.element_ty), mask=m)
    tl.store(dgate + at, _cast(dact * slope, dgate.dtype.element_ty), mask=m)


class GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act):
        gate, up = gate.contiguous(), up.contiguous()
        h = torch.empty_like(gate)
        N = gate.numel()
        get_kernel(_glu_fwd_kernel, key=("ACT",), warps=(4,), stages=(1,))[(triton.cdiv(N, _BLOCK),)](
            gate, up, h, N, BLOCK=_BLOCK, ACT=act)
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return h

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        N = gate.numel()
        get_kernel(_glu_bwd_kernel, key=("ACT",), warps=(4,), stages=(1,))[(triton.cdiv(N, _BLOCK),)](
            gate, up, dh.contiguous(), dgate, dup, N, BLOCK=_BLOCK, ACT=ctx.act)
        return dgate, dup, None


def glu_triton(gate, up, act):
    """act(gate) * up with its gradients, ``act`` a config's ``hidden_act`` ("silu", "swish" or
    "gelu_pytorch_tanh"); None where the kernel does not take the inputs (another activation, float64, different
    shapes or dtypes)."""
    if act not in ACTIVATIONS or gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype == torch.float64:
        return None
    return GLUFunction.apply(gate, up, ACTIVATIONS[act])
