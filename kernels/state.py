# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""What the decode steps that write a layer's state in place (the C step on a CPU, the Triton steps on a GPU) ask of
its tensors."""

import torch


def writable(state, name, in_inference_mode: bool):
    """State tensor ``name`` contiguous and writable in place (a tensor made under inference_mode cannot be written
    outside it: copied once, and the copy kept in the state)."""
    t = getattr(state, name)
    if not t.is_contiguous() or (not in_inference_mode and t.is_inference()):
        t = t.contiguous() if not t.is_inference() else t.clone(memory_format=torch.contiguous_format)
        setattr(state, name, t)
    return t

