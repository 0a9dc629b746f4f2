# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Passkey recall against memory size: how many retained tokens a rule needs before a 5-digit key survives.

For each memory size M (tokens per KV head, beside 1 sink and the student's window), on the same trials:

- ``teacher + TOVA``: the untrained teacher whose cache keeps the sink, the window and M tokens chosen by TOVA's
  eviction rule (:mod:`aaren_hf.conversion.retention_baseline`), the training-free bar;
- ``teacher + learned retention``: the teacher's own weights, every layer a sliding-window attention with the
  memory tier, and the retention score the converted model was given in stage 1 (a ridge fit to the teacher's
  beyond-window attention; stage 2 keeps it frozen). This isolates the selection rule from the Aaren state and from
  stage 2: if it does not recall at M, no training of the rest will make the student recall at M;
- ``student``: the converted model itself, its memory resized to M (the memory is read by the same softmax at any M,
  so a larger M is a valid what-if; the model was trained at its own M).

The teacher with its full KV cache is the ceiling. Everything is teacher-forced greedy exact match, as in
``aaren-convert eval`` (:func:`aaren_hf.conversion.evaluate.recall_probe`), with held-out text as filler.

    .venv/bin/python -P benchmarks/recall_vs_memory.py --model outputs/SmolLM2-135M-Instruct-aaren \
        --memory-sizes 32,128,512 --distances 1000,2000 --trials 10
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative integers, got {text!r}")
    return values


def _learned_retention_teacher(teacher, student_dir: Path, mixer: dict, memory: int):
    """The teacher as sliding-window layers with the memory tier and the student's fitted retention score."""
    from safetensors import safe_open

    from aaren_hf.conversion.convert import build_student

    options = {**mixer, "memory_size": memory, "memory_rule": "learned", "convert_layers": "none"}
    model = build_student(teacher, options).eval()
    params = dict(model.named_parameters())
    with safe_open(student_dir / "model.safetensors", "pt") as f:
        names = [k for k in f.keys() if ".retention_proj." in k]
        if not names:
            raise SystemExit(f"{student_dir} has no retention_proj weights (converted with --memory-size 0?)")
        with torch.no_grad():
            for name in names:
                params[name].copy_(f.get_tensor(name))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a converted model folder with a memory tier")
    parser.add_argument("--memory-sizes", type=_ints, default=[32, 128, 512])
    parser.add_argument("--distances", type=_ints, default=[1000, 2000], help="filler tokens between key and question")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--rows", default="tova,learned,student", help="which rows besides the teacher")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    import aaren_hf  # noqa: F401
    from aaren_hf.conversion.convert import load_teacher, resolve_teacher
    from aaren_hf.conversion.data import load_token_windows, text_tokens
    from aaren_hf.conversion.evaluate import recall_probe
    from aaren_hf.conversion.retention_baseline import retention_baseline

    model_dir = Path(args.model)
    record = json.loads((model_dir / "conversion.json").read_text())
    options = record["options"]
    tokenizer, teacher = load_teacher(resolve_teacher(None, options.get("recipe")) if options.get("recipe")
                                      else record["teacher"])
    windows = load_token_windows(tokenizer, list(options["data"]), seq_len=options["seq_len"], num_train=None,
                                 num_heldout=options["heldout_windows"], seed=options["seed"])
    filler = text_tokens(windows.heldout, tokenizer)
    mixer = options["mixer"]
    sinks, window = mixer["num_sink_tokens"], mixer["window_size"]
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]

    def probe(name, model, memory):
        start = time.perf_counter()
        out = recall_probe(model, tokenizer, args.distances, args.trials, options["seed"], filler_ids=filler)
        accuracy = [r["accuracy"] for r in out["results"]]
        tokens = [r["token_accuracy"] for r in out["results"]]
        result = {"name": name, "memory": memory, "accuracy": accuracy, "token_accuracy": tokens,
                  "seconds": time.perf_counter() - start}
        cells = " | ".join(f"{a:.1f} ({t:.2f})" for a, t in zip(accuracy, tokens))
        print(f"| {name} | {memory if memory is not None else 'all'} | {cells} |", flush=True)
        return result

    print(f"passkey, 5 digits, {args.trials} trials per distance, S={sinks} W={window}; cells: exact match "
          "(fraction of key tokens right)\n")
    print("| model | M | " + " | ".join(f"{d} back" for d in args.distances) + " |")
    print("|---|---|" + "---|" * len(args.distances))
    results = [probe("teacher (full KV cache)", teacher, None)]
    for memory in args.memory_sizes:
        if "tova" in rows:
            results.append(probe("teacher + TOVA", retention_baseline(teacher, sinks, window, memory), memory))
        if "learned" in rows:
            model = _learned_retention_teacher(teacher, model_dir, mixer, memory)
            results.append(probe("teacher + learned retention", model, memory))
            del model
        if "student" in rows:
            student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, memory_size=memory).eval()
            results.append(probe("student", student, memory))
            del student
    if args.json:
        Path(args.json).write_text(json.dumps({"distances": args.distances, "trials": args.trials,
                                               "rows": results}, indent=1))


if __name__ == "__main__":
    main()
