"""The window branch: its attention for training and prefill in Triton (``chunk.py``; reference: the PyTorch path of
``window_attention`` in modeling_aaren.py), and its one-token decode step (reference: ``AarenMixer.window_step``)
in Triton for a GPU (``fused_recurrent.py``) and in C for a CPU (``step.c``, the same algorithm), the C one compiled
with the Aaren branch's into the mixer's one call per layer (``kernels/mixer``)."""
