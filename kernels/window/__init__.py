"""The window branch's one-token decode step on a CPU in C (``step.c``; its reference is ``AarenMixer.window_step``),
compiled with the Aaren branch's into the mixer's one call per layer (``kernels/mixer``)."""
