# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Passkey recall and long-context perplexity against memory size: what each retained token per KV head buys.

For each memory size M (tokens per KV head, beside 1 sink and the student's window), on the same trials:

- ``teacher + TOVA``: the untrained teacher whose cache keeps the sink, the window and M tokens chosen by TOVA's
  eviction rule (:mod:`aaren_hf.conversion.retention_baseline`), the training-free bar;
- ``teacher + learned retention``: the teacher's own weights, every layer a sliding-window attention with the
  memory tier, and the retention score the converted model was given in stage 1 (a ridge fit to the teacher's
  beyond-window attention; stage 2 keeps it frozen). This isolates the selection rule from the Aaren state and from
  stage 2: if it does not recall at M, no training of the rest will make the student recall at M;
- ``student``: the converted model itself, its memory resized to M (the memory is read by the same softmax at any M,
  so a larger M is a valid what-if; the model was trained at its own M). M = 0 is the student without its memory
  (and without sharing one across layers); the learned row, with nothing to rank, is left out there.

The teacher with its full KV cache is the ceiling. Everything is teacher-forced greedy exact match, as in
``aaren-convert eval`` (:func:`aaren_hf.conversion.evaluate.recall_probe`), with held-out text as filler.

``--ranks`` says where the memory loses a key: for the student at its own M, per layer, the rank its retention
score gives the key's worst-placed token among the tokens beyond the window when the question is asked (best KV
head; median over the trials). The key survives in that layer iff the rank is below M.

``--perplexity N`` adds the quality side of the same curve: for each M, the student's state per sequence and its
perplexity on N held-out windows of ``--long-seq-len`` tokens (the run's own held-out documents, as ``aaren-convert
eval`` cuts them), beside the teacher and the teacher with a StreamingLLM cache of the same bytes (keys/values
counted in the student's dtype).

    .venv/bin/python -P benchmarks/recall_vs_memory.py --model outputs/SmolLM2-135M-Instruct-aaren \
        --memory-sizes 32,128,512 --distances 1000,2000 --trials 10 --perplexity 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch

from aaren_hf.conversion.cli import MEMORY_BITS_FLAGS, layer_or_none, memory_bits_from_flag
from aaren_hf.conversion.recipes import override_mixer


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative integers, got {text!r}")
    return values


def _learned_retention_teacher(teacher, student_dir: Path, mixer: dict, memory: int):
    """The teacher as sliding-window layers with the memory tier and the student's fitted retention score."""
    from safetensors import safe_open

    from aaren_hf.conversion.convert import build_student

    given = {"memory_size": memory, "memory_rule": "learned", "convert_layers": "none"}
    model = build_student(teacher, override_mixer(mixer, given)).eval()
    params = dict(model.named_parameters())
    with safe_open(student_dir / "model.safetensors", "pt") as f:
        names = [k for k in f.keys() if ".retention_proj." in k]
        if not names:
            raise SystemExit(f"{student_dir} has no retention_proj weights (converted with --memory-size 0?)")
        with torch.no_grad():
            for name in names:
                params[name].copy_(f.get_tensor(name))
    return model


@contextlib.contextmanager
def torch_backend():
    """The model on its PyTorch reference path (``AAREN_BACKEND=torch``, read at every call) for the block."""
    before = os.environ.get("AAREN_BACKEND")
    os.environ["AAREN_BACKEND"] = "torch"
    try:
        yield
    finally:
        if before is None:
            del os.environ["AAREN_BACKEND"]
        else:
            os.environ["AAREN_BACKEND"] = before


@torch.no_grad()
def key_ranks(model, tokenizer, filler: list, distances: list, trials: int, seed: int) -> dict:
    """{distance: [median rank per layer]}: the retention rank of the key's worst-placed letter/digit token at the
    last token of the question (0 = kept first), on the same passkey trials as ``recall_probe`` (wording
    "passkey", 5 digits). Layers without a memory get None."""
    import random

    from aaren_hf.conversion.evaluate import _ids, _recall_sequences, _recall_trials, _sinks_of
    from aaren_hf.conversion.recall import EVAL_WORDINGS, start_ids

    template = EVAL_WORDINGS["passkey"]
    sinks = _sinks_of(model)
    intro = _ids(tokenizer, template.intro)
    if len(intro) < sinks + 1:  # as recall_probe places the key: never in a sink
        intro = (filler * (sinks // len(filler) + 2))[: sinks + 1 - len(intro)] + intro
    intro = start_ids(tokenizer) + intro
    drawn = _recall_trials(tokenizer, template, random.Random(seed), trials, "digits", 5, len(filler))
    mixers = [layer.mixer for layer in model.model.layers]
    scores = {}
    for i, mixer in enumerate(mixers):
        if mixer.memory_size > 0:
            def record(score, shared, i=i, rank=mixer.ranking_score):
                scores[i] = rank(score, shared)  # what the memory ranks by: recency, grid and sharing included
                return scores[i]
            mixer.ranking_score = record  # this instance only: the model is discarded after the benchmark
    out = {}
    for distance in distances:
        ranks = {i: [] for i, mixer in enumerate(mixers) if mixer.memory_size > 0}
        row = {"key_to_answer": None, "length": None, "skipped": None}
        built = _recall_sequences(tokenizer, drawn, intro, filler, distance, None, row)
        for (seq, n_context, _), (_, before_key, key_ids, _, _) in zip(built, drawn):
            start = len(intro) + len(before_key)
            key = [start + j for j, t in enumerate(key_ids) if any(c.isalnum() for c in tokenizer.decode([t]))]
            with torch_backend():  # the PyTorch path ranks through ranking_score; the C and Triton kernels inside
                model(input_ids=torch.tensor([seq[:n_context]]), use_cache=False, logits_to_keep=1)
            for i, score in scores.items():
                mixer = mixers[i]
                last = n_context - 1
                pos = torch.arange(mixer.num_sinks, last - mixer.window + 1)  # what has left the window
                cand = score[0, pos]  # [candidates, Hkv], rounded as the model ranks them
                worst = []
                for h in range(cand.shape[1]):
                    c = cand[:, h]
                    worst.append(max(int(((c > c[p - pos[0]]) | ((c == c[p - pos[0]]) & (pos > p))).sum())
                                     for p in key))
                ranks[i].append(min(worst))
        out[distance] = [int(torch.tensor(ranks[i]).median()) if i in ranks else None for i in range(len(mixers))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a converted model folder with a memory tier")
    parser.add_argument("--memory-sizes", type=_ints, default=[32, 128, 512])
    parser.add_argument("--distances", type=_ints, default=[1000, 2000], help="filler tokens between key and question")
    parser.add_argument("--trials", type=int, default=10, help="passkey trials per distance (0: perplexity only)")
    parser.add_argument("--rows", default="tova,learned,student", help="which rows besides the teacher")
    parser.add_argument("--perplexity", type=int, default=0, metavar="N",
                        help="also score N held-out windows of --long-seq-len tokens at each M (0: recall only)")
    parser.add_argument("--long-seq-len", type=int, default=2048)
    parser.add_argument("--memory-shared-layer", type=layer_or_none, default=None, metavar="L",
                        help="override the student's memory_shared_layer (a layer index, or 'none': every layer "
                             "ranks on its own); default: the student's own")
    parser.add_argument("--memory-bits", choices=MEMORY_BITS_FLAGS, default=None,
                        help="override how the student's memory stores keys/values (8- or 4-bit codes; '16': as its "
                             "window); default: the student's own")
    parser.add_argument("--memory-hadamard", choices=("on", "off"), default=None,
                        help="override whether the memory codes Hadamard-rotated keys/values; default: on when "
                             "--memory-bits 4 is given (as aaren-convert does), else the student's own")
    parser.add_argument("--ranks", action="store_true", help="also print where each layer ranks the key (see above)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.perplexity < 0 or args.trials < 0 or args.long_seq_len < 2:
        parser.error("--perplexity and --trials must be >= 0 and --long-seq-len >= 2")
    if not (args.perplexity or args.trials or args.ranks):
        parser.error("nothing to measure: give --trials > 0, --perplexity > 0 or --ranks")
    if args.threads:
        torch.set_num_threads(args.threads)
    override = {}
    if args.memory_shared_layer is not None:
        override["memory_shared_layer"] = None if args.memory_shared_layer == "none" else args.memory_shared_layer
    if args.memory_bits is not None:
        override["memory_bits"] = memory_bits_from_flag(args.memory_bits)
    if args.memory_hadamard is not None:
        override["memory_hadamard"] = args.memory_hadamard == "on"

    from transformers import AutoModelForCausalLM

    import aaren_hf  # noqa: F401
    from aaren_hf.conversion.convert import ConversionError, conversion_record, load_teacher, teacher_of
    from aaren_hf.conversion.data import load_token_windows, text_tokens
    from aaren_hf.conversion.evaluate import (_kv_dtype, equal_memory_window, format_bytes, long_heldout_windows,
                                              perplexity, recall_probe, streaming_llm_baseline)
    from aaren_hf.conversion.retention_baseline import retention_baseline

    model_dir = Path(args.model)
    try:  # the teacher, data and recipe of the conversion that made the model
        record = conversion_record(model_dir)
        teacher_name = teacher_of(model_dir, record)
    except ConversionError as err:
        parser.error(f"--model: {err}")
    options = record["options"]
    tokenizer, teacher = load_teacher(teacher_name)
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

    results = []
    if args.trials > 0:
        print(f"passkey, 5 digits, {args.trials} trials per distance, S={sinks} W={window}; cells: exact match "
              "(fraction of key tokens right)\n")
        print("| model | M | " + " | ".join(f"{d} back" for d in args.distances) + " |")
        print("|---|---|" + "---|" * len(args.distances))
        results.append(probe("teacher (full KV cache)", teacher, None))
        for memory in args.memory_sizes:
            if "tova" in rows:
                results.append(probe("teacher + TOVA", retention_baseline(teacher, sinks, window, memory), memory))
            if "learned" in rows and memory > 0:  # without a memory there is nothing to rank: TOVA's row
                model = _learned_retention_teacher(teacher, model_dir, mixer, memory)
                results.append(probe("teacher + learned retention", model, memory))
                del model
            if "student" in rows:
                at_memory = override_mixer({}, {**override, "memory_size": memory})
                student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **at_memory).eval()
                results.append(probe("student", student, memory))
                del student
    ranks = None
    if args.ranks:
        student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                       **override_mixer({}, override)).eval()
        memory = [layer.mixer.memory_size for layer in student.model.layers]
        ranks = key_ranks(student, tokenizer, filler.reshape(-1).tolist(), args.distances, args.trials or 10,
                          options["seed"])
        del student
        print(f"\nretention rank of the key's worst-placed token at the question (best KV head, median of "
              f"{args.trials or 10} trials; the layer keeps the key iff rank < M)\n")
        print("| layer | M | " + " | ".join(f"{d} back" for d in args.distances) + " |")
        print("|---|---|" + "---|" * len(args.distances))
        for i, m in enumerate(memory):
            if m > 0:
                print(f"| {i} | {m} | " + " | ".join(str(ranks[d][i]) for d in args.distances) + " |")
    curve = []
    if args.perplexity:
        long = long_heldout_windows(tokenizer, list(options["data"]), seq_len=options["seq_len"],
                                    num_heldout=options["heldout_windows"], seed=options["seed"],
                                    long_length=args.long_seq_len)[: args.perplexity]
        print(f"\nperplexity on {long.shape[0]} held-out windows of {long.shape[1]} tokens; state per sequence; "
              "StreamingLLM: the untrained teacher with a cache of the same bytes (1 sink + W tokens)\n")
        print("| M | state | student ppl | ratio | StreamingLLM W | StreamingLLM ppl | ratio |")
        print("|---|---|---|---|---|---|---|")
        base = perplexity(teacher, long, batch_size=1)["ppl"]
        print(f"| teacher (full KV cache) | | {base:.3f} | 1.00x | | | |", flush=True)
        for memory in args.memory_sizes:
            at_memory = override_mixer({}, {**override, "memory_size": memory})
            student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **at_memory).eval()
            equal = equal_memory_window(student.config, teacher.config, sinks, _kv_dtype(student))
            ppl = perplexity(student, long, batch_size=1)["ppl"]
            del student
            stream = perplexity(streaming_llm_baseline(teacher, sinks, equal["window"]), long, batch_size=1)["ppl"]
            curve.append({"memory": memory, "state_bytes": equal["student_state_bytes"], "ppl": ppl,
                          "streaming_window": equal["window"], "streaming_ppl": stream, "teacher_ppl": base})
            print(f"| {memory} | {format_bytes(equal['student_state_bytes'])} | {ppl:.3f} | {ppl / base:.2f}x | "
                  f"{equal['window']} | {stream:.3f} | {stream / base:.2f}x |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"distances": args.distances, "trials": args.trials,
                                               "rows": results, "perplexity": curve,
                                               "ranks": ranks}, indent=1))


if __name__ == "__main__":
    main()
