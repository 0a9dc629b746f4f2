#!/usr/bin/env python
# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""This checkout's CPU kernels against a git revision's, in one process: a model's prefill timed with each in turn
(and its teacher's), alternating, as ratios; and whether the two give the same logits.

    python -P benchmarks/compare_kernels.py --rev HEAD~1 --student outputs/SmolLM2-135M-Instruct-aaren
    python -P benchmarks/compare_kernels.py --rev HEAD~1 --layers 2 --prompts 100,1000   # random, SmolLM2's shape
    python -P benchmarks/compare_kernels.py --rev HEAD --shape tiny --prompts 40 --repeats 2

What it swaps: the kernel functions the model's module takes from ``aaren_hf.kernels``' packages (the C kernels'
wrappers: ``mixer_prefill_cpu``, ``window_attention_cpu``, ...) for the revision's, imported from ``git archive REV
kernels`` under a name of their own; they build and call the revision's C (compiled as the model's own are, into the
same cache: the same sources give the same file). The model itself is this checkout's, so the revision's wrappers
must take the arguments it passes: where one is missing or refuses them, it stops and says so (for such a change,
run bench_model.py in two checkouts).

Why one process: runs of bench_model.py minutes apart differ by a few percent on a shared machine, more than most
kernel changes. Here every round runs the teacher and both builds once, in a rotated order, and the medians are
compared; on a 2-core VM, repeated runs of 15 rounds still differed by up to 2% at 300 tokens, so a change smaller
than that needs several runs (or the kernel timed on its own). Prefill only (one forward over the prompt returning
the cache, as generate() starts); with ``--decode N``, N decode steps after each prompt instead, each run continuing
its own cache, one step per round (the same tokens for all), the decode step's wrapper (``mixer_step_cpu``) swapped
as the prefill's are:

    python -P benchmarks/compare_kernels.py --rev HEAD~1 --prompts 5,100 --decode 60 \
        --student outputs/SmolLM2-135M-Instruct-aaren
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import _int_list  # noqa: E402  (also imports aaren_hf before transformers' model code)
from bench_model import SHAPES, mixer_options  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def git(*args) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, timeout=60)
    if done.returncode != 0:
        raise SystemExit(f"compare_kernels: git {' '.join(args)} failed: {done.stderr.decode().strip()} (run it in a "
                         "git checkout of aaren-hf, with a revision that exists there)")
    return done.stdout.decode()


def kernels_at(rev: str, into: Path) -> Path:
    """kernels/ as it is at ``rev``, written below ``into``."""
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit, "kernels"],
                             capture_output=True, check=True, timeout=60).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "kernels"


def wrappers_at(tree: Path, model_code) -> dict:
    """{name: that tree's function} for every name the model's module (``model_code``) takes from this checkout's
    kernel packages (``mixer_prefill_cpu``, ``window_attention_cpu``, ...): the revision's Python wrappers, which build
    and call the revision's C (its own cbuild, the same cache). Its packages are imported under a name of their own."""
    root = f"_aaren_kernels_{abs(hash(str(tree)))}"
    spec = importlib.util.spec_from_file_location(root, tree / "__init__.py", submodule_search_locations=[str(tree)])
    sys.modules[root] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[root])
    wrappers = {}
    for name, ours in vars(model_code).items():
        package = getattr(ours, "__module__", None) or ""
        if package.startswith("aaren_hf.kernels.") and callable(ours):  # (the C wrappers: the GPU's are not swapped)
            theirs = importlib.import_module(root + package[len("aaren_hf.kernels"):])
            if not hasattr(theirs, name):
                raise SystemExit(f"compare_kernels: the revision's {package} has no {name}, which this checkout's "
                                 "model calls: compare it by running bench_model.py in two checkouts")
            wrappers[name] = getattr(theirs, name)
    return wrappers


@contextlib.contextmanager
def serving(model_code, wrappers: dict):
    """The model's module calls these wrappers inside the block (its own again after it)."""
    held = {name: getattr(model_code, name) for name in wrappers}
    for name, function in wrappers.items():
        setattr(model_code, name, _first_call_checked(model_code, name, function))
    try:
        yield
    finally:
        for name, function in held.items():
            setattr(model_code, name, function)


def _first_call_checked(model_code, name, function):
    """``function``, whose first call stops with a reason where its signature does not take the arguments the model
    passes (only that: a TypeError from inside a kernel or from the model stays what it is); from then on the model
    calls ``function`` itself, so that the revision's side is timed without a layer of Python of its own."""
    signature = inspect.signature(function)

    def first_call(*args, **kwargs):
        try:
            signature.bind(*args, **kwargs)
        except TypeError as error:
            raise SystemExit(f"compare_kernels: the revision's {name} does not take the arguments this checkout's "
                             f"model passes ({error}): compare it by running bench_model.py in two "
                             "checkouts") from error
        setattr(model_code, name, function)
        return function(*args, **kwargs)

    return first_call


def build_models(args):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from aaren_hf.conversion.convert import build_student, teacher_of

    torch.manual_seed(args.seed)
    if args.student:
        teacher = AutoModelForCausalLM.from_pretrained(teacher_of(args.student), dtype=torch.float32,
                                                       attn_implementation="sdpa")
        student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)
    else:
        shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
        teacher = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=1 << 20, attn_implementation="sdpa"))
        student = build_student(teacher, mixer_options("aaren", args.shape))
    return teacher.eval(), student.eval()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", required=True, help="the git revision whose kernels to compare with (e.g. HEAD~1)")
    p.add_argument("--student", metavar="DIR", help="a converted model folder (its teacher is timed beside it)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="random weights of this shape "
                   "(without --student)")
    p.add_argument("--layers", type=int, default=None, help="layers of the random model (default: the shape's)")
    p.add_argument("--prompts", type=_int_list, default=[100, 1000], help="prompt lengths, e.g. 100,1000")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds (each runs teacher and both builds once)")
    p.add_argument("--decode", type=int, default=0, metavar="N", help="time N decode steps after each prompt (one "
                   "step per round, --warmup steps first) instead of the prefill")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first, per prompt")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the kernels use the same pool)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="also write the numbers to this JSON file")
    args = p.parse_args(argv)
    if (args.repeats < 1 or args.warmup < 0 or args.threads < 1 or args.decode < 0
            or (args.layers is not None and args.layers < 1)):
        p.error("--repeats, --threads and --layers must be >= 1, --warmup and --decode >= 0")
    if args.student and not (Path(args.student) / "config.json").is_file():
        p.error(f"--student {args.student}: no config.json there (a folder written by aaren-convert)")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    teacher, student = build_models(args)
    model_code = sys.modules[type(student).__module__]
    with tempfile.TemporaryDirectory() as tmp:  # the revision's wrappers build from these sources on first use
        theirs = wrappers_at(kernels_at(args.rev, Path(tmp)), model_code)
        same = git("diff", "--name-only", args.rev, "--", "kernels").strip() == ""
        runs = {"teacher": (teacher, None), "this checkout": (student, None), args.rev: (student, theirs)}
        rows = []
        for length in args.prompts:
            ids = torch.randint(3, teacher.config.vocab_size, (1, length),
                                generator=torch.Generator().manual_seed(length))
            times, logits, caches = {name: [] for name in runs}, {}, {}
            rounds = args.warmup + (args.decode or args.repeats)
            follow = torch.randint(3, teacher.config.vocab_size, (rounds, 1, 1),
                                   generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                for name, (model, wrappers) in runs.items() if args.decode else ():
                    with serving(model_code, wrappers) if wrappers else contextlib.nullcontext():
                        caches[name] = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
                for r in range(rounds):
                    names = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]  # rotated: load hits all alike
                    for name in names:
                        model, wrappers = runs[name]
                        with serving(model_code, wrappers) if wrappers else contextlib.nullcontext():
                            start = time.perf_counter()
                            if args.decode:  # one step, continuing this run's own cache
                                out = model(input_ids=follow[r], past_key_values=caches[name], use_cache=True)
                            else:
                                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                            seconds = time.perf_counter() - start
                        logits.setdefault(name, out.logits)
                        if r >= args.warmup:
                            times[name].append(seconds)
            median = {name: statistics.median(t) for name, t in times.items()}
            a, b = logits["this checkout"], logits[args.rev]
            rows.append(dict(prompt=length, seconds=median, same_logits=bool(torch.equal(a, b)),
                             max_logit_change=float((a - b).abs().max()),
                             speed_vs_rev=median[args.rev] / median["this checkout"],
                             speed_vs_teacher={n: median["teacher"] / median[n] for n in ("this checkout", args.rev)}))
    work = f"a decode step after the prompt (medians of {args.decode} alternating steps)" if args.decode else \
        f"the prefill (medians of {args.repeats} alternating rounds)"
    print(f"kernels: this checkout ({REPO}) against {args.rev}{' (the same kernels)' if same else ''}; "
          f"{args.threads} thread(s); {work}")
    print(f"| prompt | teacher | this checkout | {args.rev} | this / {args.rev} speed | x teacher: this, {args.rev} "
          "| same logits |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        s, v = row["seconds"], row["speed_vs_teacher"]
        same_logits = "yes" if row["same_logits"] else f"no (max change {row['max_logit_change']:.2e})"
        print(f"| {row['prompt']} | {s['teacher'] * 1e3:.1f} ms | {s['this checkout'] * 1e3:.1f} ms | "
              f"{s[args.rev] * 1e3:.1f} ms | {row['speed_vs_rev']:.3f}x | {v['this checkout']:.3f}x, "
              f"{v[args.rev]:.3f}x | {same_logits} |")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(dict(rev=args.rev, same_kernels=same, decode_steps=args.decode,
                                                        rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
