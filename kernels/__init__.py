"""Aaren scan ops: PyTorch references and Triton kernels behind one dispatch point."""
