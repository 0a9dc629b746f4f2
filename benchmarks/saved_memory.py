#!/usr/bin/env python
# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Bytes a training forward keeps for backward, per layer, teacher against student, counted on the CPU as a GPU runs
the student (``modeling_aaren.launch_bound`` answering yes, the scan through the Triton kernels in Triton's
interpreter, window attention in the model's 16-bit dtype as on CUDA): the activation memory of a train step, which
on a GPU is most of its peak; ``--as-cpu``: as a CPU trains it (a conversion: float32, the C window kernel, the
chunked PyTorch scan). Deterministic: every distinct storage the graph still holds for backward when the forward
returns (a ``saved_tensors_hooks`` pack per saved tensor, counted if it is still alive then), parameters excluded,
summed per source line of the model code that saved it. The embedding and the logits are left out (the same in both
models). What it cannot see: temporaries freed within the forward, the backward's own peak.

    python -P benchmarks/saved_memory.py                          # SmolLM2-135M's shape, 1 layer, 1 x 2,048, bf16
    python -P benchmarks/saved_memory.py --tokens 8192 --attention-dtype float32
    python -P benchmarks/saved_memory.py --window pytorch        # window attention as before aa87c5d
    python -P benchmarks/saved_memory.py --layer pytorch         # norms and MLP as the teacher's: the mixer alone
    python -P benchmarks/saved_memory.py --as-cpu --dtype float32
"""

import argparse
import collections
import contextlib
import gc
import os
import sys
import traceback
import weakref
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_model  # noqa: E402  (imports aaren_hf before transformers' model code)

import aaren_hf.modeling_aaren as modeling  # noqa: E402

OUTSIDE_LAYERS = ("lm_head", "embed_tokens")  # in both models alike


class _Kept:
    """A saved tensor as the graph holds it, with the source line that saved it."""

    def __init__(self, t, where):
        self.t, self.where = t, where


def saved_by_line(model, ids):
    """{source line: bytes} of the storages the graph of one forward of ``model`` still holds for backward when the
    forward returns (parameters excluded): a node whose output was detached (a running max, say) is freed with its
    saved tensors, which are then not counted. A storage saved from several lines counts once, at the first."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed = []  # weak references, in the order of saving: the graph alone keeps each alive

    def pack(t):
        frames = [f for f in traceback.extract_stack()[:-1] if "modeling_" in f.filename or "aaren" in f.filename]
        where = "?" if not frames else f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].line}"
        # detached: holding a saved output itself would hold its node too (a cycle autograd never frees)
        kept = _Kept(t.detach(), where)
        packed.append(weakref.ref(kept))
        return kept

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda kept: kept.t):
        out = model(ids, use_cache=False)  # holds the graph until the count is done
    gc.collect()
    seen, by_line = set(), collections.Counter()
    for kept in filter(None, (ref() for ref in packed)):
        storage = kept.t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            by_line[kept.where] += storage.nbytes()
    del out
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
    p.add_argument("--layer", default="kernel", choices=["kernel", "pytorch"],
                   help="the student's RMSNorm and gated MLP by their Triton kernels (as a GPU runs them), or by "
                   "their PyTorch code, as the teacher runs its own (the mixer's difference alone)")
    p.add_argument("--as-cpu", action="store_true", help="as a CPU trains the student (else as a GPU does)")
    p.add_argument("--top", type=int, default=12, help="student source lines to list")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    teacher, student = bench_model.random_teacher_and_student(args.layers)
    ids = torch.randint(3, teacher.config.vocab_size, (args.batch, args.tokens))
    # as a GPU runs it (launch_bound below), window attention takes the model's 16-bit dtype; the scan's Triton
    # kernels (interpreted) save what they save on a GPU
    with contextlib.ExitStack() as patches:
        if not args.as_cpu:
            patches.enter_context(mock.patch.object(modeling, "launch_bound", lambda device: True))
            patches.enter_context(mock.patch.dict(os.environ, TRITON_INTERPRET="1"))
        if args.attention_dtype == "float32":
            patches.enter_context(mock.patch.object(modeling, "_attention_dtype", lambda q: torch.float32))
        if args.window == "pytorch":
            patches.enter_context(mock.patch.object(modeling, "fused_window_attention", None))
        if args.layer == "pytorch":
            patches.enter_context(bench_model.layer_in_pytorch())
        result = {name: saved_by_line(model.to(dtype).train(), ids)
                  for name, model in (("teacher", teacher), ("student", student))}
    mib = {name: per_layer(by_line, args.layers) / 2**20 for name, by_line in result.items()}
    window = "its C kernel" if args.as_cpu else "its Triton kernel" if args.window == "kernel" else "the PyTorch path"
    layer = "their Triton kernels" if args.layer == "kernel" else "PyTorch"
    layer = "" if args.as_cpu else f", norms and MLP by {layer}"
    print(f"kept for backward per layer, {args.batch} x {args.tokens} tokens, {args.dtype}, as a "
          f"{'CPU' if args.as_cpu else 'GPU'} trains it, window attention by {window} in {args.attention_dtype}"
          f"{layer}: "
          f"teacher {mib['teacher']:.1f} MiB, student {mib['student']:.1f} MiB "
          f"({mib['student'] / mib['teacher']:.2f}x)")
    for where, n in result["student"].most_common(args.top):
        if not any(name in where for name in OUTSIDE_LAYERS):
            print(f"  {n / args.layers / 2**20:8.1f} MiB  {where[:110]}")
    return mib, result


if __name__ == "__main__":
    main()
