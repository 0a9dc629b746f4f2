#!/usr/bin/env python
# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Bytes a training forward keeps for backward, per layer, teacher against student, counted on the CPU as a GPU runs
the student (``modeling_aaren.launch_bound`` answering yes, the scan through the Triton kernels in Triton's
interpreter, window attention in the model's 16-bit dtype as on CUDA): the activation memory of a train step, which
on a GPU is most of its peak. Deterministic: every distinct storage a ``saved_tensors_hooks`` pack sees, parameters
excluded, summed per source line of the model code that saved it. The embedding and the logits are left out (the
same in both models). What it cannot see: temporaries freed within the forward, the backward's own peak.

    python -P benchmarks/saved_memory.py                          # SmolLM2-135M's shape, 1 layer, 1 x 2,048, bf16
    python -P benchmarks/saved_memory.py --tokens 8192 --attention-dtype float32
    python -P benchmarks/saved_memory.py --window pytorch        # window attention as before aa87c5d
"""

import argparse
import collections
import contextlib
import os
import sys
import traceback
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_model  # noqa: E402  (imports aaren_hf before transformers' model code)

import aaren_hf.modeling_aaren as modeling  # noqa: E402

OUTSIDE_LAYERS = ("lm_head", "embed_tokens")  # in both models alike


def saved_by_line(model, ids):
    """{source line: bytes} of the storages saved for backward by one forward of ``model`` (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, by_line = set(), collections.Counter()

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            frames = [f for f in traceback.extract_stack()[:-1] if "modeling_" in f.filename or "aaren" in f.filename]
            frame = frames[-1] if frames else None
            where = "?" if frame is None else f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.line}"
            by_line[where] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, use_cache=False)
    return by_line


def per_layer(by_line, layers):
    return sum(n for where, n in by_line.items() if not any(name in where for name in OUTSIDE_LAYERS)) / layers


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=1, help="layers of the SmolLM2-135M shape (random weights)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--attention-dtype", default="model", choices=["model", "float32"],
                   help="window attention as CUDA runs it (the model's dtype) or in float32 (as before 582595d)")
    p.add_argument("--window", default="kernel", choices=["kernel", "pytorch"],
                   help="window attention by its Triton kernel, or by the PyTorch path that gathers each block's "
                   "keys and builds its mask (as before aa87c5d)")
    p.add_argument("--top", type=int, default=12, help="student source lines to list")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    teacher, student = bench_model.random_teacher_and_student(args.layers)
    ids = torch.randint(3, teacher.config.vocab_size, (args.batch, args.tokens))
    # as a GPU runs it (launch_bound below), window attention takes the model's 16-bit dtype; the scan's Triton
    # kernels (interpreted) save what they save on a GPU
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(modeling, "launch_bound", lambda device: True))
        patches.enter_context(mock.patch.dict(os.environ, TRITON_INTERPRET="1"))
        if args.attention_dtype == "float32":
            patches.enter_context(mock.patch.object(modeling, "_attention_dtype", lambda q: torch.float32))
        if args.window == "pytorch":
            patches.enter_context(mock.patch.object(modeling, "fused_window_attention", None))
        result = {name: saved_by_line(model.to(dtype).train(), ids)
                  for name, model in (("teacher", teacher), ("student", student))}
    mib = {name: per_layer(by_line, args.layers) / 2**20 for name, by_line in result.items()}
    print(f"kept for backward per layer, {args.batch} x {args.tokens} tokens, {args.dtype}, window attention by "
          f"{'its Triton kernel' if args.window == 'kernel' else 'the PyTorch path'} in {args.attention_dtype}: teacher {mib['teacher']:.1f} MiB, student {mib['student']:.1f} MiB "
          f"({mib['student'] / mib['teacher']:.2f}x)")
    for where, n in result["student"].most_common(args.top):
        if not any(name in where for name in OUTSIDE_LAYERS):
            print(f"  {n / args.layers / 2**20:8.1f} MiB  {where[:110]}")
    return mib, result


if __name__ == "__main__":
    main()
