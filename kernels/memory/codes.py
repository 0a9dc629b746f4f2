# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The memory's codes in Triton, for a GPU: ``MemoryCodes`` in aaren_hf/modeling_aaren.py is the reference (and
``codes.h`` the CPU's C). Device functions the window branch's decode step shares (``window/fused_recurrent.py``), and
``round_with_codes`` (what a vector is stored as, and what it reads back) in one launch where the reference runs
about seventy operators over the prefill's or training step's keys and values.

The same codes, scales and values as the reference, bit for bit: x / D then the butterflies in their order, the
largest magnitude over the largest code with a correctly rounded division, rounded to bfloat16 by integer
arithmetic, the codes rounded half to even; reading back, the codes (whole numbers) are turned by the butterflies,
exact in any order, then scaled.
"""

import torch
import triton
import triton.language as tl

from ..aaren.chunk import _MAX, device_function, get_kernel


@device_function
def _bfloat16_grid(x):
    """Float32 x rounded to the nearest bfloat16 (ties to even), kept in float32, by integer arithmetic (as
    ``bfloat16_grid``; any sign); a NaN stays a NaN."""
    u = x.to(tl.int32, bitcast=True)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@device_function
def _cast(x, DTYPE: tl.constexpr):
    """Float32 x in DTYPE, rounded to nearest even as torch's .to() rounds (for bfloat16 by integer arithmetic
    first: Triton's interpreter truncates where a GPU rounds)."""
    if DTYPE == tl.bfloat16:
        x = _bfloat16_grid(x)
    return x.to(DTYPE)


@device_function
def _rounded(x, DTYPE: tl.constexpr):
    """Float32 x rounded to DTYPE (as ``_cast``) and kept in float32: a value as torch leaves it between two
    operators in that dtype."""
    return _cast(x, DTYPE).to(tl.float32)


@device_function
def _butterflies(y, R: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    """y [R, D] times the +-1 Sylvester-Hadamard matrix, by the butterflies of ``hadamard`` in their order (D =
    2^LOG_D): pairs (i, i + h) within blocks of 2h, h from D / 2 down to 1."""
    for i in tl.static_range(LOG_D):  # h = D >> (i + 1); 2^i blocks
        a, b = tl.split(tl.permute(tl.reshape(y, (R, 1 << i, 2, D >> (i + 1))), (0, 1, 3, 2)))
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, D))
    return y


@device_function
def _codes(x, R: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr, BITS: tl.constexpr, ROTATE: tl.constexpr):
    """``MemoryCodes.encode`` of the float32 rows x [R, D]: (codes as float32 whole numbers [R, D], scale [R, 1] on
    bfloat16's grid)."""
    TOP: tl.constexpr = 2 ** (BITS - 1) - 1
    if ROTATE:
        x = _butterflies(x * (1.0 / D), R, D, LOG_D)  # exact, as the reference's x / D (D a power of 2)
    scale = _bfloat16_grid(tl.math.div_rn(tl.reduce(tl.abs(x), 1, _MAX), tl.full([R], TOP, tl.float32)))[:, None]
    y = tl.math.div_rn(x, tl.maximum(scale, 1.1754943508222875e-38))
    return tl.minimum(tl.maximum((y + 12582912.0) - 12582912.0, -TOP), TOP), scale  # + 1.5 * 2^23: half to even


@device_function
def _store_codes(codes, at, mask, R: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Codes [R, D] stored at ``at`` [R, 1] (each row's first element) where ``mask`` [R, 1]: int8, or 4 bits as
    codes + 8 two to a byte, the first half of the vector in the low nibbles."""
    if BITS == 8:
        tl.store(at + tl.arange(0, D)[None, :], codes.to(tl.int8), mask=mask)
    else:
        lo, hi = tl.split(tl.permute(tl.reshape((codes + 8).to(tl.int32), (R, 2, D // 2)), (0, 2, 1)))
        tl.store(at + tl.arange(0, D // 2)[None, :], (lo | (hi << 4)).to(tl.uint8), mask=mask)


def _round_kernel(x, back, codes, scale, N, D: tl.constexpr, LOG_D: tl.constexpr, BITS: tl.constexpr,
                  ROTATE: tl.constexpr, SATURATE: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)[:, None]
    m_n = rows < N
    cols = tl.arange(0, D)[None, :]
    c, s = _codes(tl.load(x + rows * D + cols, mask=m_n, other=0).to(tl.float32), BN, D, LOG_D, BITS, ROTATE)
    tl.store(scale + rows, s.to(tl.bfloat16), mask=m_n)
    _store_codes(c, codes + rows * (D // 2 if BITS == 4 else D), m_n, BN, D, BITS)
    if ROTATE:
        c = _butterflies(c, BN, D, LOG_D)
    y = c * s
    if SATURATE:  # float16 at its largest finite value, as the cache stores it (a NaN stays a NaN)
        y = tl.where(y > 65504.0, 65504.0, tl.where(y < -65504.0, -65504.0, y))
    tl.store(back + rows * D + cols, _cast(y, back.dtype.element_ty), mask=m_n)


def memory_round_triton(x, bits: int, rotate: bool, dtype: torch.dtype = torch.float32):
    """``MemoryCodes(bits, rotate).round_with_codes(x, dtype)`` without its gradient, in one launch: (values [..., D]
    in ``dtype``, float16 saturating, (codes, scale [..., 1] bfloat16)) for float x [..., D] (16-bit read as it
    lies, float32 inside); None where the kernel does not take x (a width that is not a power of 2)."""
    D = x.shape[-1]
    if x.dim() == 0 or D < 2 or D & (D - 1) or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    x = x.detach()
    x = (x if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else x.float()).contiguous()
    N = x.numel() // D
    back = torch.empty(x.shape, dtype=dtype, device=x.device)
    codes = torch.empty(*x.shape[:-1], D // 2 if bits == 4 else D, dtype=torch.uint8 if bits == 4 else torch.int8,
                        device=x.device)
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.bfloat16, device=x.device)
    if N:
        BN = max(1, min(64, 4096 // D))
        get_kernel(_round_kernel, key=("D", "BITS", "ROTATE"), warps=(4,), stages=(1,))[(triton.cdiv(N, BN),)](
            x, back, codes, scale, N, D=D, LOG_D=D.bit_length() - 1, BITS=bits, ROTATE=bool(rotate),
            SATURATE=dtype == torch.float16, BN=BN)
    return back, (codes, scale)
