"""The window branch: its attention for training and prefill in Triton (``chunk.py``; reference: the PyTorch path of
``window_attention`` in modeling_aaren.py), and its one-token decode step on a CPU in C (``step.c``; reference:
``AarenMixer.window_step``), compiled with the Aaren branch's into the mixer's one call per layer
(``kernels/mixer``)."""
