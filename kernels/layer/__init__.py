"""The decoder layer's parts around the mixer, in Triton for a GPU: RMSNorm (``rmsnorm.py``; reference ``AarenRMSNorm``)
and a gated MLP's act(gate) * up for silu and GELU-tanh (``glu.py``; reference ``AarenMLP``), forward and backward,
one launch each. Both keep for backward only what they were given, and recompute the rest. Imported on first use
(``kernels/__init__.py``), so that this package imports without triton installed."""
