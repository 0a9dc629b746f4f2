"""Aaren scan kernels: ``naive_aaren`` (reference, plain PyTorch) and the Triton kernels.

The Triton ones are imported on first use, so that this package imports without triton installed.
"""

from .naive import naive_aaren

__all__ = ["naive_aaren", "chunk_aaren_triton", "fused_recurrent_aaren_triton"]


def __getattr__(name):
    if name == "chunk_aaren_triton":
        from .chunk import chunk_aaren_triton

        return chunk_aaren_triton
    if name == "fused_recurrent_aaren_triton":
        from .fused_recurrent import fused_recurrent_aaren_triton

        return fused_recurrent_aaren_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
