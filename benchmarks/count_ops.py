#!/usr/bin/env python
# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Operators per layer of one prefill, counted on the CPU: what a GPU, where the window and memory branch is
launch-bound, pays in kernel launches. Counts every PyTorch operator that runs except views, bare allocations and
operators that write no element (each of the others runs a kernel on a GPU), through the PyTorch path
(``AAREN_BACKEND=torch``: no C kernels), once as a CPU runs it and once as a GPU does (``modeling_aaren.launch_bound``
answering yes: one prefill piece, the GPU's sweep passes, and, when triton is installed, the scan per op head and window
attention by their Triton kernels, in Triton's interpreter, each launch counted as one operator; without triton, the
chunked PyTorch scan and window path). Then one decode step after a --decode-prompt-token prompt, in bf16 as a GPU runs
it (the scan's step and, with --window kernel, the window branch's step by their Triton kernels, each launch one
operator), against the teacher's (Llama, sdpa, its KV cache): at batch 1 a GPU pays such a step in launches. Then one
train step (forward and backward in bf16) as a GPU runs it, against the teacher's. Beside the operators, the bytes of
the tensors each reads and writes (a Triton launch: its tensor arguments), what a GPU's memory moves where the tensors
are large. Deterministic: no timing.

    python -P benchmarks/count_ops.py                       # 32K tokens, as a CPU and as a GPU runs them
    python -P benchmarks/count_ops.py --tokens 4096 --layers 1 --window pytorch   # window attention as before aa87c5d
    python -P benchmarks/count_ops.py --tokens 4096 --layers 1 --top 30           # which operators, how many
    python -P benchmarks/count_ops.py --tokens 4096 --layers 1 --layer pytorch    # norms and MLP as the teacher's
"""

import argparse
import collections
import contextlib
import importlib
import os
import pkgutil
import sys
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_model  # noqa: E402  (imports aaren_hf before transformers' model code)

import aaren_hf.modeling_aaren as modeling  # noqa: E402
from aaren_hf.kernels import triton_available  # noqa: E402

VIEWS = {"view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "expand", "permute",
         "transpose", "t", "detach", "alias", "reshape", "split", "split_with_sizes", "unbind", "lift_fresh",
         "unfold", "diagonal", "narrow", "chunk",
         # allocations without a fill: on a GPU the caching allocator hands memory out without a launch
         "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


def tensor_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class CountOps(TorchDispatchMode):
    """Operators, and the bytes of the tensors they read and write (each tensor counted whole, once per operator
    that takes or makes it): what a GPU launches, and what its memory moves for them."""

    def __init__(self):
        super().__init__()
        self.n = self.bytes = 0
        self.names = collections.Counter()  # operators by name (a Triton launch by its kernel's)

    def add(self, name: str, moved: int):
        self.n += 1
        self.bytes += moved
        self.names[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if made and all(t.numel() == 0 for t in made):
            return out  # writes no element: a GPU launches nothing for it (an empty state's tensors, say)
        if func.overloadpacket.__name__ not in VIEWS:
            self.add(func.overloadpacket.__name__, tensor_bytes((args, kwargs, out)))
        return out

    def top(self, label: str, most: int, layers: int):
        if most:
            print(f"  {label}, operators per layer by name: " + ", ".join(
                f"{name} {n / layers:g}" for name, n in self.names.most_common(most)))


COUNTER = [None]  # the CountOps in use, for the Triton kernels' launches


def triton_kernels_as_a_gpu_runs_them(window_kernel: bool):
    """Patches that send the scan (and, with ``window_kernel``, window attention) through their Triton kernels in
    Triton's interpreter, each launch counted as one operator (the interpreter's own PyTorch calls, which a GPU does
    not make, uncounted); the operators around them are counted as they run. The C kernels stay off."""
    import aaren_hf.kernels as kernels
    from aaren_hf.kernels.aaren import chunk as scan_chunk

    real = scan_chunk.get_kernel
    # every module that launches a kernel through get_kernel, found rather than listed (a kernel left off a list
    # went uncounted): each imported its own name for it
    modules = [importlib.import_module(info.name)
               for info in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + ".") if not info.ispkg]
    launching = [m for m in modules if getattr(m, "get_kernel", None) is real]

    def get_kernel(fn, **kwargs):
        kernel = real(fn, **kwargs)

        def launch(grid):
            def run(*args, **kw):
                COUNTER[0].add(fn.__name__, tensor_bytes((args, kw)))  # inputs and outputs alike are arguments
                with _disable_current_modes():
                    return kernel[grid](*args, **kw)
            return run
        return type("Launch", (), {"__getitem__": lambda self, grid: launch(grid)})()

    triton = lambda x: "triton"  # noqa: E731
    return ([mock.patch.object(kernels, "select_backend", triton), mock.patch.dict(os.environ, TRITON_INTERPRET="1")]
            + [mock.patch.object(m, "get_kernel", get_kernel) for m in launching]
            + ([mock.patch.object(modeling, "select_backend", triton)] if window_kernel else []))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--layers", type=int, default=2, help="layers of the SmolLM2-135M shape (random weights)")
    p.add_argument("--decode-prompt", type=int, default=1024, help="prompt before the counted decode step (past the "
                   "window and the memory's size, so the step does all its work)")
    p.add_argument("--train-tokens", type=int, default=2048, help="tokens of the counted train step (forward and "
                   "backward, bf16, as a GPU runs it; 0: none)")
    p.add_argument("--window", default="kernel", choices=["kernel", "pytorch"],
                   help="the window branch as a GPU runs it: its Triton kernels (when triton is installed; attention "
                   "and the decode step) or the PyTorch paths (window attention gathering each block's keys)")
    p.add_argument("--layer", default="kernel", choices=["kernel", "pytorch"],
                   help="the student's RMSNorm and gated MLP as a GPU runs them: their Triton kernels, or their "
                   "PyTorch code, as the teacher runs its own (the mixer's difference alone)")
    p.add_argument("--top", type=int, default=0, help="also list each count's most frequent operators, this many "
                   "(a Triton launch by its kernel's name)")
    args = p.parse_args(argv)
    if args.tokens <= args.decode_prompt:
        p.error(f"--tokens {args.tokens} leaves no token to decode after --decode-prompt {args.decode_prompt}: give "
                "more tokens, or a shorter --decode-prompt")
    triton = modeling.fused_window_attention is not None and triton_available()
    kernel = triton and args.window == "kernel"
    teacher, student = bench_model.random_teacher_and_student(args.layers)
    teacher, student = teacher.eval(), student.eval()
    ids = torch.randint(3, teacher.config.vocab_size, (1, args.tokens))
    counts, first, moved = [], None, {"prefill": [], "train": {}}  # moved: MB read and written per layer
    with mock.patch.dict(os.environ, AAREN_BACKEND="torch"), contextlib.ExitStack() as layer:  # no C kernels
        if args.layer == "pytorch":
            layer.enter_context(bench_model.layer_in_pytorch())
        for label, as_gpu in (("as a CPU runs it", False), ("as a GPU runs it", True)):
            with mock.patch.object(modeling, "launch_bound", lambda device: as_gpu), torch.no_grad(), \
                    contextlib.ExitStack() as patches:
                if as_gpu and triton:
                    for patch in triton_kernels_as_a_gpu_runs_them(kernel):
                        patches.enter_context(patch)
                piece = modeling.prefill_piece(1, ids.device)
                counter = COUNTER[0] = CountOps()
                with counter:
                    logits = student(ids, use_cache=True, logits_to_keep=1).logits
            first = logits if first is None else first
            per_layer, diff = counter.n / args.layers, float((logits - first).abs().max())
            counts.append((per_layer, diff))
            moved["prefill"].append(counter.bytes / args.layers / 2**20)
            if as_gpu:
                label += (", the scan by its Triton kernel" if triton else ", the scan by the chunked PyTorch scan") + \
                    ", window attention by " + ("its Triton kernel" if kernel else "the PyTorch path")
            print(f"{label} ({piece}-token pieces): {per_layer:,.0f} operators per layer for {args.tokens:,} tokens "
                  f"({moved['prefill'][-1]:,.0f} MB read and written); logits differ from the first by {diff:.1e}")
            counter.top("prefill", args.top, args.layers)
        decode = {}
        prompt, token = ids[:, :args.decode_prompt], ids[:, args.decode_prompt:args.decode_prompt + 1]
        teacher, student = teacher.to(torch.bfloat16), student.to(torch.bfloat16)  # as a GPU serves them
        for name, model in (("teacher", teacher), ("student", student)):
            with mock.patch.object(modeling, "launch_bound", lambda device: True), torch.no_grad(), \
                    contextlib.ExitStack() as patches:
                if triton and name == "student":
                    for patch in triton_kernels_as_a_gpu_runs_them(kernel):
                        patches.enter_context(patch)
                cache = model(prompt, use_cache=True, logits_to_keep=1).past_key_values
                extra = {"position_ids": torch.full_like(token, prompt.shape[1])} if name == "teacher" else {}
                counter = COUNTER[0] = CountOps()
                with counter:
                    model(token, past_key_values=cache, use_cache=True, **extra)
            decode[name] = counter.n / args.layers
            counter.top(f"decode step, {name}", args.top, args.layers)
        print(f"a decode step as a GPU runs it, after {prompt.shape[1]:,} tokens: {decode['student']:,.0f} operators "
              f"per layer, the teacher's {decode['teacher']:,.0f} ({decode['student'] / decode['teacher']:.1f}x)")
        train = {}
        for name, model in (("teacher", teacher), ("student", student)) if args.train_tokens else ():
            model = model.train()  # last: the models are not used after this
            tokens = torch.randint(3, teacher.config.vocab_size, (1, args.train_tokens))
            with mock.patch.object(modeling, "launch_bound", lambda device: True), contextlib.ExitStack() as patches:
                if triton and name == "student":
                    for patch in triton_kernels_as_a_gpu_runs_them(kernel):
                        patches.enter_context(patch)
                counter = COUNTER[0] = CountOps()
                with counter:
                    model(tokens, use_cache=False).logits.float().square().mean().backward()
            train[name] = counter.n / args.layers
            counter.top(f"train step, {name}", args.top, args.layers)
            moved["train"][name] = counter.bytes / args.layers / 2**20
        if train:
            mb = moved["train"]
            print(f"a train step (forward and backward, 1 x {args.train_tokens:,} tokens, bf16) as a GPU runs it: "
                  f"{train['student']:,.0f} operators per layer, the teacher's {train['teacher']:,.0f} "
                  f"({train['student'] / train['teacher']:.1f}x); {mb['student']:,.0f} MB read and written per "
                  f"layer, the teacher's {mb['teacher']:,.0f} (both with the embedding, the LM head and the loss: "
                  f"{mb['student'] - mb['teacher']:,.0f} MB more per layer)")
    return {"prefill": counts, "decode": decode, "train": train, "MB": moved}


if __name__ == "__main__":
    main()
