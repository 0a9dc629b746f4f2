# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""``aaren-convert``: convert a pretrained Transformer into an Aaren model, evaluate one, list recipes."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Optional

SUBCOMMANDS = ("convert", "eval", "recipes")

CONVERT_EPILOG = """\
examples:
  # the README's conversion: packaged SmolLM2-135M-Instruct, offline, about 30 minutes on 2 CPU cores
  aaren-convert --recipe smollm2-135m

  # a quick look (a few minutes): tiny budget, quick evaluation
  aaren-convert --recipe smollm2-135m --output /tmp/smol-aaren-try --train-windows 16 \\
      --stage1-steps 10 --stage2-steps 4 --quick-eval

  # any supported local teacher, your own text, only the mixers trained end to end
  aaren-convert --teacher ./my-llama --data ./texts/ --trainable mixer --output ./my-llama-aaren

  # continue an interrupted conversion (same options; checkpoints are in OUTPUT.work/)
  aaren-convert --recipe smollm2-135m --resume

  # 2 processes on a CPU (layers of stage 1 are split; stage 2 is data-parallel)
  torchrun --standalone --nproc_per_node 2 -m aaren_hf.conversion.cli --recipe smollm2-135m

  aaren-convert recipes                 # list the named recipes
  aaren-convert eval --model ./SmolLM2-135M-Instruct-aaren

What happens: the teacher's weights are copied into an Aaren model; the new mixer parameters are initialised
from the teacher's attention statistics; stage 1 trains each layer's mixer to reproduce that layer's attention
output; stage 2 distils the teacher's next-token distribution (KL) end to end; the result is evaluated against
the teacher and a StreamingLLM baseline and written, with a model card and a log, to the output folder.
A recipe sets the defaults; every flag given overrides it.
"""


# ----------------------------------------------------------------------------------------------------------------
# Argument types with clear messages
# ----------------------------------------------------------------------------------------------------------------


def _int(minimum: int, maximum: Optional[int] = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    return parse


def _float(low: float, high: float, low_open: bool = True):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
        if not ok:
            lo = f"> {low}" if low_open else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be a number {lo} and <= {high}, got {text}")
        return value

    return parse


def _distances(text: str) -> tuple:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers such as 32,128,512, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}")
    return values


# ----------------------------------------------------------------------------------------------------------------
# Parsers
# ----------------------------------------------------------------------------------------------------------------


def convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aaren-convert [convert]",
        description="Convert a pretrained causal Transformer (Llama family, Qwen2/3, Mistral, GPT-2, GPT-NeoX) into\n"
                    "an Aaren model (constant-memory recurrent attention) by distillation.\n"
                    "Other subcommands: `aaren-convert eval --model DIR`, `aaren-convert recipes`.\n"
                    "Give --recipe NAME (defaults for a known teacher) or --teacher NAME_OR_PATH; flags override.",
        epilog=CONVERT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("what to convert")
    g.add_argument("--recipe", metavar="NAME", help="named recipe giving every default (see `aaren-convert recipes`)")
    g.add_argument("--teacher", metavar="NAME_OR_PATH",
                   help="hub name (needs the hub) or local folder with config.json + weights; default: the recipe's "
                        "teacher (the packaged SmolLM2-135M-Instruct for smollm2-135m)")
    g.add_argument("--output", metavar="DIR", help="output folder (default: ./<teacher name>-aaren); work files go "
                                                   "to DIR.work/ while running")
    g.add_argument("--resume", action="store_true", help="continue an interrupted conversion from DIR.work/")
    g.add_argument("--overwrite", action="store_true",
                   help="replace an existing output folder (only an empty one or an earlier aaren-convert output) or "
                        "an interrupted run")
    g.add_argument("--keep-work", action="store_true", help="keep DIR.work/ (checkpoints) after success")

    g = p.add_argument_group("data")
    g.add_argument("--data", action="append", metavar="SOURCE",
                   help="packaged corpus (python-docs, kernel-docs, perl-docs), local .txt/.jsonl/.parquet file or "
                        "folder, or a datasets name; repeat to mix (default: the recipe's, else python-docs)")
    g.add_argument("--seq-len", type=_int(16, 1 << 20), metavar="N", help="tokens per training window")
    g.add_argument("--train-windows", type=_int(1), metavar="N", help="training windows drawn from the data")
    g.add_argument("--heldout-windows", type=_int(1), metavar="N",
                   help="held-out windows (documents never trained on) for evaluation")
    g.add_argument("--seed", type=_int(0, 2**31 - 1), metavar="N", help="seed of data split, order and init")

    g = p.add_argument_group("student mixer")
    g.add_argument("--num-query-slots", type=_int(1, 256), metavar="J", help="learned queries per head (1: paper)")
    g.add_argument("--decay", choices=("none", "fixed", "learned", "input"), help="recency decay of the state")
    g.add_argument("--window-size", type=_int(0, 1 << 20), metavar="W",
                   help="softmax window branch over the last W tokens (0: none, and then no sinks or memory unless "
                        "given)")
    g.add_argument("--num-sink-tokens", type=_int(0, 1024), metavar="S",
                   help="first S tokens kept visible to the window branch (needs --window-size > 0)")
    g.add_argument("--memory-size", type=_int(0, 1 << 16), metavar="M",
                   help="exact-memory tier: per KV head, M tokens kept after they leave the window (needs "
                        "--window-size > 0; 0: none, and then no --memory-shared-layer unless given)")
    g.add_argument("--memory-shared-layer", type=layer_or_none, metavar="L",
                   help="the layers after layer L also keep in their memory what layer L's retention score ranks "
                        "high ('none': every layer on its own; the smollm2-135m recipe: 6)")
    g.add_argument("--memory-rule", choices=("learned", "aaren"),
                   help="what the memory keeps: a retention score fitted to the teacher's attention, or the Aaren "
                        "queries' scores")
    g.add_argument("--memory-recency", type=_float(0, 1, low_open=False), metavar="LAMBDA",
                   help="what a token's position adds to its learned retention score, so that old keys leave the "
                        "memory (0: none). Default: RECENCY_SCORE_SPAN (4) / the teacher's context length, which "
                        "keeps kept keys within the distances the teacher saw (SmolLM2: 0.00049)")
    g.add_argument("--kv-cache-dtype", choices=("bfloat16", "float16", "model"),
                   help="the dtype the window, sink and memory keys/values are stored (and computed) in; 'model': "
                        "the model's own dtype. The Aaren state stays float32")
    g.add_argument("--memory-bits", choices=MEMORY_BITS_FLAGS,
                   help="the memory's keys/values as 8- or 4-bit codes with a 16-bit scale per vector (2x or 3.6x "
                        "the tokens per byte at head_dim 64); '16': as the window stores them")
    g.add_argument("--memory-hadamard", choices=("on", "off"),
                   help="code the memory's keys/values after an exact Hadamard rotation, so that a few large key "
                        "channels do not round the others to zero. Default: the recipe's (the packaged teacher's: "
                        "on); with --memory-bits, on with 4-bit codes (the packaged teacher's cache in 4-bit codes: "
                        "1.37x its perplexity without, 1.06x with), off otherwise (at 8 bits it measured no "
                        "difference and only costs decoding time)")
    g.add_argument("--convert-layers", metavar="LAYERS",
                   help="which layers become Aaren layers: 'all', 'none', 'global' (the teacher's full-attention "
                        "layers), or indices like '0,5,11'. Default: 'global' for teachers with local sliding-window "
                        "layers (Gemma-3: those stay exactly the teacher's), 'all' otherwise. Kept layers of other "
                        "teachers become exact sliding-window attention (window + sinks + memory, no Aaren state)")
    g.add_argument("--window-gate", choices=("head", "input"), help="window/Aaren mix: one gate per head, or from "
                                                                     "the input")

    g = p.add_argument_group("initialisation and stage 1 (per-layer attention transfer)")
    g.add_argument("--init-windows", type=_int(1), metavar="N", help="calibration windows for the initialisation")
    g.add_argument("--stage1-steps", type=_int(0), metavar="N", help="optimizer steps per layer (0: skip stage 1)")
    g.add_argument("--stage1-lr", type=_float(0, 1), metavar="LR", help="stage-1 learning rate")
    g.add_argument("--stage1-windows", type=_int(1), metavar="N",
                   help="training windows whose teacher activations are captured for stage 1")
    g.add_argument("--stage1-batch-size", type=_int(1), metavar="N", help="windows per stage-1 step")
    g.add_argument("--freeze-teacher-weights", action="store_true",
                   help="stage 1 trains only the new mixer parameters (slots, decay, gates), not q/k/v/o")

    g = p.add_argument_group("stage 2 (end-to-end distillation)")
    g.add_argument("--stage2-steps", type=_int(0), metavar="N", help="optimizer steps (0: skip stage 2)")
    g.add_argument("--lr", "--stage2-lr", dest="stage2_lr", type=_float(0, 1), metavar="LR",
                   help="stage-2 learning rate")
    g.add_argument("--batch-size", type=_int(1), metavar="N", help="windows per stage-2 optimizer step (all processes)")
    g.add_argument("--micro-batch-size", type=_int(1), metavar="N", help="windows per forward (gradient accumulation)")
    g.add_argument("--trainable", choices=("all", "mixer", "lora"),
                   help="what stage 2 trains: every parameter, only the mixers, or LoRA adapters (+ new mixer params)")
    g.add_argument("--lora-r", type=_int(1, 1024), metavar="R", help="LoRA rank (with --trainable lora)")
    g.add_argument("--ce-weight", type=_float(0, 100, low_open=False), metavar="X",
                   help="weight of next-token cross-entropy added to the KL (default 0)")
    g.add_argument("--temperature", type=_float(0, 100), metavar="T", help="distillation temperature (default 1)")
    g.add_argument("--checkpoint-every", type=_int(0), metavar="N",
                   help="checkpoint every N steps in both stages (0: only at stage ends)")

    g = p.add_argument_group("evaluation and run")
    g.add_argument("--no-eval", action="store_true", help="skip the evaluation (the model card then has no numbers)")
    g.add_argument("--quick-eval", action="store_true", help="4 windows, 2 recall trials up to 512 tokens")
    g.add_argument("--eval-windows", type=_int(1), metavar="N", help="held-out windows scored (default: all)")
    g.add_argument("--recall-trials", type=_int(1), metavar="N", help="passkey trials per distance")
    g.add_argument("--recall-distances", type=_distances, metavar="D,D,...",
                   help="passkey distances in tokens (default: 4, 16 and 32 x the window)")
    g.add_argument("--recall-fraction", type=_float(0.0, 1.0, low_open=False), metavar="F",
                   help="share of training windows that bury keys to recall later (default 0.25)")
    g.add_argument("--long-seq-len", type=_int(16, 1 << 20), metavar="N",
                   help="stage-2 and long evaluation window length (default 2048)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")
    g.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is visible")
    g.add_argument("--threads", type=_int(1, 4096), metavar="N",
                   help="CPU threads per process (torch.set_num_threads); on a busy shared machine 1 can be faster")
    g.add_argument("--debug", action="store_true", help="show the traceback of expected errors too")
    return p


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aaren-convert eval",
        description="Evaluate a converted Aaren model against its teacher and the StreamingLLM baseline on held-out "
                    "windows; prints Markdown tables.",
        epilog="example:\n  aaren-convert eval --model ./SmolLM2-135M-Instruct-aaren --quick\n\nThe teacher, data, "
               "window length and seed default to those recorded in the model's conversion.json, so the held-out "
               "windows are the ones the conversion never trained on. On the conversion's own data the windows "
               "always come from the documents it held out (a longer --seq-len gets fewer of them); on other data "
               "--heldout-windows alone cuts the split.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="DIR", help="converted model folder")
    p.add_argument("--teacher", metavar="NAME_OR_PATH", help="teacher (default: from DIR/conversion.json)")
    p.add_argument("--data", action="append", metavar="SOURCE", help="text source (default: from conversion.json)")
    p.add_argument("--seq-len", type=_int(16, 1 << 20), metavar="N", help="window length")
    p.add_argument("--heldout-windows", type=_int(1), metavar="N", help="held-out windows scored")
    p.add_argument("--seed", type=_int(0, 2**31 - 1), metavar="N", help="seed of the held-out split")
    p.add_argument("--quick", action="store_true", help="4 windows, 2 recall trials up to 512 tokens")
    p.add_argument("--recall-trials", type=_int(1), metavar="N", help="passkey trials per distance")
    p.add_argument("--recall-distances", type=_distances, metavar="D,D,...",
                   help="passkey distances in tokens (default: 4, 16 and 32 x the student's window)")
    p.add_argument("--long-seq-len", type=_int(16, 1 << 20), metavar="N",
                   help="length of the long held-out windows (default: the conversion's, 2048)")
    p.add_argument("--long-windows", type=_int(1), default=4, metavar="N", help="long held-out windows scored")
    p.add_argument("--no-retention", action="store_true",
                   help="skip the TOVA retention baseline (token-by-token decoding of the teacher; the slowest part)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--debug", action="store_true", help="show the traceback of expected errors too")
    return p


def recipes_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="aaren-convert recipes", description="List the named conversion recipes.")


def top_help() -> str:
    return convert_parser().format_help()


# ----------------------------------------------------------------------------------------------------------------
# convert
# ----------------------------------------------------------------------------------------------------------------


def options_from_args(args, parser):
    from .convert import ConvertOptions, apply_overrides, options_from_recipe

    if args.recipe is None and args.teacher is None:
        parser.error("give --recipe NAME (see `aaren-convert recipes`) or --teacher NAME_OR_PATH")
    if args.resume and args.overwrite:
        parser.error("--resume continues an interrupted run and --overwrite discards it: give one of them")
    from .recipes import RECIPES

    if args.recipe is not None:
        if args.recipe not in RECIPES:
            parser.error(f"unknown recipe {args.recipe!r}; available: {', '.join(RECIPES)} "
                         "(`aaren-convert recipes` describes them)")
        opts = options_from_recipe(args.recipe)
    else:
        opts = ConvertOptions()
    mixer = {k: getattr(args, k) for k in ("num_query_slots", "decay", "window_size", "num_sink_tokens", "window_gate",
                                           "memory_size", "memory_rule", "memory_recency", "memory_shared_layer",
                                           "kv_cache_dtype", "memory_bits", "convert_layers")
             if getattr(args, k) is not None}
    if mixer.get("kv_cache_dtype") == "model":
        mixer["kv_cache_dtype"] = None
    if "memory_bits" in mixer:
        mixer["memory_bits"] = memory_bits_from_flag(mixer["memory_bits"])
    if args.memory_hadamard is not None:
        mixer["memory_hadamard"] = args.memory_hadamard == "on"
    if mixer.get("memory_shared_layer") == "none":
        mixer["memory_shared_layer"] = None
    stage1 = {"steps": args.stage1_steps, "lr": args.stage1_lr, "windows": args.stage1_windows,
              "batch_size": args.stage1_batch_size, "checkpoint_every": args.checkpoint_every}
    if args.freeze_teacher_weights:
        stage1["train_teacher_weights"] = False
    stage2 = {"steps": args.stage2_steps, "lr": args.stage2_lr, "batch_size": args.batch_size,
              "micro_batch_size": args.micro_batch_size, "trainable": args.trainable, "lora_r": args.lora_r,
              "ce_weight": args.ce_weight, "temperature": args.temperature, "checkpoint_every": args.checkpoint_every}
    opts = apply_overrides(
        opts,
        teacher=args.teacher, output=args.output, data=tuple(args.data) if args.data else None,
        seq_len=args.seq_len, train_windows=args.train_windows, heldout_windows=args.heldout_windows, seed=args.seed,
        mixer=mixer, init_windows=args.init_windows,
        stage1={k: v for k, v in stage1.items() if v is not None},
        stage2={k: v for k, v in stage2.items() if v is not None},
        eval_windows=args.eval_windows, recall_trials=args.recall_trials, recall_distances=args.recall_distances,
        recall_fraction=args.recall_fraction, long_seq_len=args.long_seq_len,
    )
    opts.resume, opts.overwrite, opts.keep_work = args.resume, args.overwrite, args.keep_work
    opts.eval, opts.eval_quick = not args.no_eval, args.quick_eval
    opts.progress, opts.cpu = not args.no_progress, args.cpu
    validate_options(opts, parser)
    return opts


def layer_or_none(text: str):
    """argparse type of a layer index or 'none' (kept as the string, so that None still means 'not given')."""
    if text == "none":
        return "none"
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a layer index (0, 1, ...) or 'none', got {text!r}")
    return int(text)


MEMORY_BITS_FLAGS = ("8", "4", "16")


def memory_bits_from_flag(flag: str):
    """AarenConfig.memory_bits for a --memory-bits choice: '16' stores the memory like the window (None)."""
    return None if flag == "16" else int(flag)


def validate_options(opts, parser) -> None:
    m = opts.mixer
    if m.get("memory_hadamard") and not m.get("memory_bits"):
        parser.error("--memory-hadamard on rotates the memory's codes: give --memory-bits 8 or 4 as well")
    if m.get("memory_size", 0) > 0 and m.get("window_size", 0) == 0:
        parser.error(f"--memory-size {m['memory_size']} needs the window branch: give --window-size > 0 "
                     "(the memory holds tokens that have left the window)")
    if m.get("num_sink_tokens", 0) > 0 and m.get("window_size", 0) == 0:
        parser.error(f"--num-sink-tokens {m['num_sink_tokens']} needs the window branch: give --window-size > 0 "
                     "as well, or --num-sink-tokens 0")
    if m.get("memory_shared_layer") is not None and m.get("memory_size", 0) == 0:
        parser.error(f"--memory-shared-layer {m['memory_shared_layer']} shares a layer's memory, but there is none "
                     "(--memory-size 0): give --memory-shared-layer none as well, or --memory-size > 0")
    if m.get("window_size", 0) + m.get("num_sink_tokens", 0) > opts.seq_len * 64:
        parser.error("--window-size is far beyond --seq-len; the window branch would never be full")
    if opts.init_windows > opts.train_windows:
        parser.error(f"--init-windows {opts.init_windows} exceeds --train-windows {opts.train_windows}")
    if opts.eval_windows is not None and opts.eval_windows > opts.heldout_windows:
        parser.error(f"--eval-windows {opts.eval_windows} exceeds --heldout-windows {opts.heldout_windows}")
    s2 = opts.stage2
    if s2.batch_size % s2.micro_batch_size:
        parser.error(f"--batch-size {s2.batch_size} must be a multiple of --micro-batch-size {s2.micro_batch_size}")
    if opts.teacher is not None:
        from .convert import ConversionError, resolve_teacher

        try:
            resolve_teacher(opts.teacher)
        except ConversionError as error:
            parser.error(str(error))
    from .assets import CORPORA

    for source in opts.data:
        text = str(source)
        if text in CORPORA or Path(text).expanduser().exists():
            continue
        if text.startswith((".", "/", "~")) or text.endswith((".txt", ".md", ".rst", ".jsonl", ".json", ".parquet")):
            parser.error(f"--data {text!r}: no such file or folder (packaged corpora: {', '.join(CORPORA)})")
    if opts.output is not None:
        out = Path(opts.output).expanduser()
        if out.exists() and not out.is_dir():
            parser.error(f"--output {opts.output!r} exists and is not a folder")


def run_convert(argv: list[str]) -> int:
    parser = convert_parser()
    args = parser.parse_args(argv)
    opts = options_from_args(args, parser)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    from .convert import convert

    output = convert(opts)
    if output is not None:
        print(f"\nConverted model: {output}\n  load it with AutoModelForCausalLM.from_pretrained({str(output)!r}, "
              "trust_remote_code=True)\n  model card: " + str(Path(output) / "README.md"))
    return 0


# ----------------------------------------------------------------------------------------------------------------
# eval, recipes
# ----------------------------------------------------------------------------------------------------------------


def run_eval(argv: list[str]) -> int:
    parser = eval_parser()
    args = parser.parse_args(argv)
    model_dir = Path(args.model).expanduser()
    if not (model_dir / "config.json").is_file():
        parser.error(f"--model {args.model!r} is not a model folder (no config.json); give a converted model folder")
    from .convert import ConversionError, conversion_record, load_teacher, long_length, resolve_teacher, teacher_of

    try:
        record = conversion_record(model_dir)
        teacher = resolve_teacher(args.teacher) if args.teacher else teacher_of(model_dir, record)
    except ConversionError as error:
        parser.error(str(error) if args.teacher else f"--teacher is needed: {error}")
    recorded = record.get("options", {})
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    import torch
    from transformers import AutoModelForCausalLM

    import aaren_hf  # noqa: F401

    from .data import load_token_windows
    from .evaluate import evaluate, format_table

    tokenizer, teacher_model = load_teacher(teacher)
    student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    trained = [_from_model_dir(model_dir, d) for d in recorded.get("data") or ["python-docs"]]
    data = [str(d) for d in args.data] if args.data else trained
    seq_len = args.seq_len or recorded.get("seq_len") or 512
    heldout = args.heldout_windows or recorded.get("eval_windows") or recorded.get("heldout_windows") or 16
    seed = args.seed if args.seed is not None else recorded.get("seed", 0)
    split = _heldout_split(parser, recorded, data, trained, seq_len, heldout, seed)
    windows = load_token_windows(tokenizer, list(data), seq_len=seq_len, num_train=None, num_heldout=split, seed=seed)
    kwargs = {}
    if args.recall_trials:
        kwargs["recall_trials"] = args.recall_trials
    if args.recall_distances:
        kwargs["recall_distances"] = args.recall_distances
    from .evaluate import long_heldout_windows

    long_len = long_length(args.long_seq_len or recorded.get("long_seq_len") or 2048, student.config)
    if long_len > seq_len:
        try:
            kwargs["long_windows"] = long_heldout_windows(
                tokenizer, list(data), seq_len=seq_len, num_heldout=split, long_length=long_len, seed=seed)
        except ValueError as error:
            print(f"aaren-convert eval: no long windows ({error})", file=sys.stderr)
    results = evaluate(student, teacher_model, tokenizer, windows.heldout[:heldout],
                       sinks=max(1, student.config.num_sink_tokens), quick=args.quick, seed=seed,
                       text_source=", ".join(map(str, data)), max_long_windows=args.long_windows, window=[],
                       retention=not args.no_retention, **kwargs)
    print(format_table(results))
    if args.json:
        from .train_state import atomic_write_json

        atomic_write_json(args.json, results)
    return 0


def _heldout_split(parser, recorded: dict, data: list, trained: list, seq_len: int, heldout: int, seed: int) -> int:
    """How many windows of ``seq_len`` tokens the held-out split is cut for (``load_token_windows`` holds out a
    prefix of the seed's document order just long enough for that many; the evaluation reads the first ``heldout``).

    On the conversion's own sources, the prefix must stay inside the one the conversion held out (its held-out
    windows x its window length): a longer --seq-len with the recorded count would reach into documents it trained
    on. On other sources the command's own count cuts the split, so two students evaluated by the same command read
    the same windows whatever their conversions recorded. Sources partly trained on are refused."""
    budget = (recorded.get("heldout_windows") or 0) * (recorded.get("seq_len") or 0)
    same = [_source_key(d) for d in data] == [_source_key(d) for d in trained]
    if same and budget:
        if seed != recorded.get("seed", 0):
            parser.error(f"--seed {seed} differs from the conversion's ({recorded.get('seed', 0)}): on its sources "
                         "that split would hold out documents it trained on; drop --seed or evaluate on other data")
        if budget // seq_len < heldout:
            parser.error(f"the conversion held out {budget} tokens of {', '.join(map(str, trained))}: at most "
                         f"{budget // seq_len} windows of {seq_len} tokens; lower --heldout-windows or --seq-len, or "
                         "evaluate on data it did not train on")
        return budget // seq_len
    if {_source_key(d) for d in data} & {_source_key(d) for d in trained}:
        parser.error(f"--data {' '.join(data)} shares sources with the conversion's ({' '.join(trained)}) but is not "
                     "the same list: the split would differ and could hold out documents it trained on; give exactly "
                     "its sources, in that order, or only sources it did not train on")
    return heldout


def _source_key(source: str) -> str:
    """A data source as compared with another: a path by what it points to, a packaged corpus by its name."""
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else source


def _from_model_dir(model_dir: Path, source: str) -> str:
    """A data source recorded relative to the model folder (conversion.json), as a path usable from here."""
    candidate = model_dir / source
    return str(candidate) if not Path(source).is_absolute() and candidate.exists() else source


def run_recipes(argv: list[str]) -> int:
    recipes_parser().parse_args(argv)
    from .recipes import RECIPES

    print("Named recipes (aaren-convert --recipe NAME; every flag overrides the recipe):\n")
    for name, r in RECIPES.items():
        b = r.budget
        offline = " (offline copy packaged)" if r.offline_teacher else ""
        print(f"  {name:14s} {r.teacher}{offline} [{r.model_type}]")
        print(f"  {'':14s} mixer {json.dumps(r.mixer)}")
        print(f"  {'':14s} data {', '.join(r.data)}; {b.data_tokens / 1e6:g}M tokens in windows of {b.seq_len}; "
              f"stage 1 {b.stage1_steps} steps/layer (lr {b.stage1_lr:g}); stage 2 {b.stage2_steps} steps x "
              f"{b.batch_size} windows (lr {b.stage2_lr:g})")
        if r.notes:
            print(f"  {'':14s} {r.notes}")
        if getattr(r, "license", None):
            print(f"  {'':14s} teacher licence: {r.license}")
        print()
    from .adapters import RECENCY_SCORE_SPAN

    print(f"A learned memory's memory_recency, unless a recipe or --memory-recency gives it: {RECENCY_SCORE_SPAN:g} / "
          f"the teacher's context length (kept keys stay within the distances the teacher saw).")
    return 0


# ----------------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "convert"
    if argv and argv[0] in SUBCOMMANDS:
        command = argv.pop(0)
    try:
        if command == "eval":
            return run_eval(argv)
        if command == "recipes":
            return run_recipes(argv)
        return run_convert(argv)
    except KeyboardInterrupt:
        print("\ninterrupted; continue later with the same command and --resume", file=sys.stderr)
        return 130
    except Exception as error:  # expected failures get one clear line, not a traceback
        from .convert import expected_errors

        if not isinstance(error, expected_errors()) or "--debug" in argv:
            raise
        print(f"aaren-convert: error: {str(error).replace(chr(10), ' ')}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
