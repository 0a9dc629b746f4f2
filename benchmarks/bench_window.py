# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The window branch by its kernels against the PyTorch paths they replace, in one run, at SmolLM2-135M's attention
shape (9 query heads, 3 kv heads, head size 64) and the default mixer's window (64), sink (1) and memory (448, 4-bit
Hadamard codes in the decode step):

- attention for training and prefill (on a GPU ``kernels/window/chunk.py`` against each block of queries gathering
  its keys, values and mask for one SDPA call; on a CPU ``kernels/window/chunk.c`` against the same gathering in runs
  of blocks): forward, forward + backward, and the peak memory each adds (CUDA). Inputs come from the model's own
  functions (``memory_visibility`` with random retention scores, ``window_attention`` for both);
- the decode step of one layer (``kernels/window/fused_recurrent.py`` against ``AarenMixer.window_step``'s PyTorch
  operators) at batch sizes --steps, after a --step-prompt-token prompt of a random student of that shape (one layer).
  Both paths first take one step from copies of the same state and must agree (output to the dtype's rounding, the
  window and memory exactly).

    python -P benchmarks/bench_window.py                          # CUDA: bf16, 8 x 2K, 2 x 8K, 1 x 32K; steps B = 1, 32
    python -P benchmarks/bench_window.py --device cpu --shapes 1x100,1x1000,2x512 --steps none   # C kernel, CPU
    TRITON_INTERPRET=1 python -P benchmarks/bench_window.py --device cpu --shapes 1x300 --steps 1 --step-prompt 80 \
        --min-time 0                                              # both, slowly
"""

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import fmt_r, fmt_t, print_table, timeit  # noqa: E402
from bench_model import random_teacher_and_student  # noqa: E402

import aaren_hf.modeling_aaren as modeling  # noqa: E402


def inputs(B, T, H=9, Hkv=3, D=64, W=64, S=1, M=448, device="cuda", dtype=torch.bfloat16, seed=0):
    """(args, kwargs) of ``window_attention`` for the first call of a prompt of T tokens: queries, keys (rotated),
    values, positions, no earlier window entries, S sinks among the first tokens, and the memory's candidates (this
    call's tokens) with what each query sees of them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=gen)  # noqa: E731
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))
    pos = torch.arange(T, device=device).expand(B, T).contiguous()
    q, k, v = rnd(B, T, H, D), rnd(B, T, Hkv, D), rnd(B, T, Hkv, D)
    k = modeling.rotate(k, pos, inv_freq)
    cand_pos = pos.unsqueeze(1).expand(B, Hkv, T).contiguous()
    score = modeling.round_retention(torch.randn(B, Hkv, T, device=device, generator=gen))
    last, evict = modeling.memory_visibility(cand_pos, score, 0, W, S, M, T)
    memory = (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), evict, last, M)
    empty = k.new_zeros(B, 0, Hkv, D)
    sinks = (k[:, :S].contiguous(), v[:, :S].contiguous(), pos[:, :S].contiguous())
    return (q, k, v, pos, empty, empty, pos[:, :0], *sinks, W, modeling.Rotary(pos, inv_freq), D ** -0.5, memory)


def run(args_, grad):
    """window_attention's output (forward) or its gradients with respect to q, k and v (forward + backward)."""
    q, k, v = args_[:3]
    out = modeling.window_attention(*args_)
    return out if grad is None else torch.autograd.grad(out, (q, k, v), grad)


def step_inputs(B, prompt, device, dtype, seed=0):
    """(layer 0's mixer, its state after a prompt of ``prompt`` random tokens, (q, k, v, pos, retention) of the next
    token) for ``AarenMixer.window_step``, in a one-layer random student of the benchmark's shape."""
    student = random_teacher_and_student(1)[1].to(device, dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, student.config.vocab_size, (B, prompt), generator=gen).to(device)
    with torch.no_grad():
        state = student(ids, use_cache=True, logits_to_keep=1).past_key_values.layers[0]
    mixer = student.model.layers[0].mixer
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    retention = modeling.round_retention(torch.randn(B, 1, mixer.num_kv_heads, generator=gen)).to(device)
    pos = torch.full((B, 1), prompt, device=device)
    return mixer, state, (rnd(B, 1, 9, 64), rnd(B, 1, 3, 64), rnd(B, 1, 3, 64), pos, retention)


def step(mixer, state, token):
    q, k, v, pos, retention = token
    with torch.no_grad():
        return mixer.window_step(q, k, v, pos, state, retention)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 on a CPU")
    p.add_argument("--shapes", default="8x2048,2x8192,1x32768", help="B x T, comma-separated (attention)")
    p.add_argument("--steps", default="1,32", help="batch sizes of the decode step, comma-separated, or none")
    p.add_argument("--step-prompt", type=int, default=1024, help="tokens before the timed decode steps")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of repeats per measurement")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    # the Triton kernel where window_attention takes it, a backend of Triton (CUDA tensors, or a CPU's with
    # TRITON_INTERPRET=1: Triton's interpreter, slow, a check), both paths as a GPU runs them (one attention call for
    # all blocks); else a CPU's C kernel, both paths as a CPU runs them (the PyTorch one in runs of blocks)
    triton = (modeling.fused_window_attention is not None
              and modeling.select_backend(torch.zeros(1, device=args.device)) == "triton")
    patched = "fused_window_attention" if triton else "window_attention_cpu"
    paths = {"pytorch": None}
    if getattr(modeling, patched) is not None:
        paths["kernel"] = getattr(modeling, patched)
    as_run = mock.patch.object(modeling, "launch_bound", lambda device: True) if triton else contextlib.nullcontext()
    kernel_file = "kernels/window/chunk.py" if triton else "kernels/window/chunk.c"
    rows, results = [], []
    for shape in [] if args.shapes == "none" else args.shapes.split(","):
        B, T = (int(x) for x in shape.lower().split("x"))
        args_ = inputs(B, T, device=args.device, dtype=dtype)
        for a in args_[:3]:
            a.requires_grad_(True)
        grad = torch.randn(B, T, 9, 64, device=args.device, dtype=dtype)
        measured = {}
        for name, fn in paths.items():
            with mock.patch.object(modeling, patched, fn), as_run:
                fwd = timeit(lambda: run(args_, None).detach(), args.device, args.min_time)
                both = timeit(lambda: run(args_, grad), args.device, args.min_time)
                peak = None
                if args.device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    run(args_, grad)
                    torch.cuda.synchronize()
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            measured[name] = dict(forward_s=fwd, forward_backward_s=both, peak_mib=peak)
        if "kernel" in measured:  # the same attention, to the dtype's rounding
            with as_run:
                want = mock.patch.object(modeling, patched, None)(run)(args_, None)
                torch.testing.assert_close(run(args_, None), want, atol=3e-2, rtol=3e-2)
        results.append(dict(B=B, T=T, dtype=str(dtype), **measured))
        ref, new = measured["pytorch"], measured.get("kernel")
        rows.append([f"{B} x {T}", fmt_t(ref["forward_s"]), fmt_t(new and new["forward_s"]),
                     fmt_r(new and ref["forward_s"] / new["forward_s"]), fmt_t(ref["forward_backward_s"]),
                     fmt_t(new and new["forward_backward_s"]),
                     fmt_r(new and ref["forward_backward_s"] / new["forward_backward_s"]),
                     "-" if ref["peak_mib"] is None else f"{ref['peak_mib']:.0f} MiB",
                     "-" if not new or new["peak_mib"] is None else f"{new['peak_mib']:.0f} MiB"])
    if rows:
        print(f"window attention, {args.device}, {dtype}: H=9, Hkv=3, D=64, window 64, 1 sink, memory 448; "
              f"pytorch = gather + SDPA, kernel = {kernel_file}; ratios = pytorch time / kernel time")
        print_table(["B x T", "pytorch fwd", "kernel fwd", "speed-up", "pytorch fwd+bwd", "kernel fwd+bwd", "speed-up",
                     "pytorch peak", "kernel peak"], rows)

    step_kernel = modeling.fused_window_step if triton else None
    rows, steps = [], []
    for B in [] if args.steps == "none" else [int(b) for b in args.steps.split(",")]:
        mixer, state, token = step_inputs(B, args.step_prompt, args.device, dtype)
        measured, first = {}, {}
        for name, fn in (("pytorch", None), ("kernel", step_kernel)):
            if name == "kernel" and fn is None:
                continue
            with mock.patch.object(modeling, "fused_window_step", fn), \
                    mock.patch.object(modeling, "launch_bound", lambda device: True):
                once = state.copy()
                first[name] = step(mixer, once, token), once.tensors()
                mine = state.copy()  # the kernel writes its state in place: each path steps its own copy
                measured[name] = timeit(lambda: step(mixer, mine, token), args.device, args.min_time)
        if "kernel" in first:
            (want, want_state), (got, got_state) = first["pytorch"], first["kernel"]
            torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
            for key in ("window_k", "window_v", "window_pos", "sink_k", "memory_k", "memory_k_scale", "memory_pos"):
                assert torch.equal(got_state[key], want_state[key]), key
        steps.append(dict(B=B, prompt=args.step_prompt, dtype=str(dtype), pytorch_s=measured["pytorch"],
                          kernel_s=measured.get("kernel")))
        new = measured.get("kernel")
        rows.append([str(B), fmt_t(measured["pytorch"]), fmt_t(new), fmt_r(new and measured["pytorch"] / new)])
    if rows:
        print(f"window branch decode step (one layer), {args.device}, {dtype}, after {args.step_prompt} tokens: "
              "pytorch = AarenMixer.window_step's operators, kernel = kernels/window/fused_recurrent.py")
        print_table(["B", "pytorch step", "kernel step", "speed-up"], rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"attention": results, "step": steps}, indent=2))
    return {"attention": results, "step": steps}


if __name__ == "__main__":
    main()
