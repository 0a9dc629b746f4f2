#!/usr/bin/env python
# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""This checkout's C kernels against a git revision's, in one process: a model's prefill timed with each build in
turn (and its teacher's), alternating, as ratios; and whether the two builds give the same logits.

    python -P benchmarks/compare_kernels.py --rev HEAD~1 --student outputs/SmolLM2-135M-Instruct-aaren
    python -P benchmarks/compare_kernels.py --rev HEAD~1 --layers 2 --prompts 100,1000   # random, SmolLM2's shape
    python -P benchmarks/compare_kernels.py --rev HEAD --shape tiny --prompts 40 --repeats 2

What it swaps: the libraries ``kernels/cbuild.py`` builds (each kernel package's ``LIBRARY``), compiled from
``git archive REV kernels`` with this machine's compiler and flags. The Python around them is this checkout's, so
the revision's C functions must take the same arguments: its kernel packages' SIGNATURES are compared first, and it
stops where they differ (for such a change, alternate two checkouts with bench_model.py).

Why one process: runs of bench_model.py minutes apart differ by a few percent on a shared machine, more than most
kernel changes. Here every round runs the teacher and both builds once, in a rotated order, and the medians are
compared; on a 2-core VM, repeated runs of 15 rounds still differed by up to 2% at 300 tokens, so a change smaller
than that needs several runs (or the kernel timed on its own). Prefill only (one forward over the prompt returning
the cache, as generate() starts); decode steps are bench_decode.py's and bench_model.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
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

from aaren_hf.kernels import aaren, cbuild, memory, mixer, window  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PACKAGES = (mixer, aaren, window, memory)  # every kernel package with a C build (its LIBRARY, SOURCES, ...)


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


def packages_at(tree: Path) -> dict:
    """{library name: that tree's kernel package} (its SOURCES, HEADERS and SIGNATURES), imported under a name of
    its own. Stops where a C function takes other arguments than this checkout's wrappers pass (they call it)."""
    name = f"_aaren_kernels_{abs(hash(str(tree)))}"
    spec = importlib.util.spec_from_file_location(name, tree / "__init__.py", submodule_search_locations=[str(tree)])
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])
    theirs = {p.LIBRARY: importlib.import_module(f"{name}.{p.__name__.rsplit('.', 1)[1]}") for p in PACKAGES}
    for package in PACKAGES:
        other = theirs[package.LIBRARY].SIGNATURES
        differ = sorted(f for f in set(other) | set(package.SIGNATURES) if other.get(f) != package.SIGNATURES.get(f))
        if differ:
            raise SystemExit(f"compare_kernels: at that revision {', '.join(differ)} take other arguments than this "
                             "checkout's wrappers pass: compare kernels whose C signatures agree here; for others, "
                             "run bench_model.py in two checkouts.")
    return theirs


def builds(tree: Path | None) -> dict:
    """{library name: loaded build} of every kernel package, from the kernels tree at ``tree`` (None: this
    checkout's), built by cbuild as the model's own are (the same sources give the same file)."""
    packages = {p.LIBRARY: p for p in PACKAGES} if tree is None else packages_at(tree)
    libs = {}
    for name, package in packages.items():
        held = cbuild._loaded.pop(name, None)  # load() answers from this cache: build these sources instead
        try:
            lib = cbuild.load(name, package.SOURCES, package.SIGNATURES, "nothing", package.HEADERS)
        finally:
            if held is not None:
                cbuild._loaded[name] = held
        if lib is None:
            raise SystemExit(f"compare_kernels: could not build {name} (a C compiler is needed; AAREN_BACKEND must "
                             "not be torch)")
        libs[name] = lib
    return libs


@contextlib.contextmanager
def serving(libs: dict):
    """The kernels' wrappers call these builds inside the block (each asks cbuild.load, which answers from _loaded)."""
    held = {name: cbuild._loaded.get(name) for name in libs}
    cbuild._loaded.update(libs)
    try:
        yield
    finally:
        cbuild._loaded.update(held)


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
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first, per prompt")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the kernels use the same pool)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="also write the numbers to this JSON file")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1 or (args.layers is not None and args.layers < 1):
        p.error("--repeats, --threads and --layers must be >= 1, --warmup >= 0")
    if args.student and not (Path(args.student) / "config.json").is_file():
        p.error(f"--student {args.student}: no config.json there (a folder written by aaren-convert)")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        theirs = builds(kernels_at(args.rev, Path(tmp)))
    ours = builds(None)
    same_files = all(theirs[n]._name == ours[n]._name for n in ours)  # the same sources build the same file
    teacher, student = build_models(args)
    runs = {"teacher": (teacher, None), "this checkout": (student, ours), args.rev: (student, theirs)}
    rows = []
    for length in args.prompts:
        ids = torch.randint(3, teacher.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        times, logits = {name: [] for name in runs}, {}
        with torch.no_grad():
            for r in range(args.warmup + args.repeats):
                names = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]  # rotated: load hits all alike
                for name in names:
                    model, libs = runs[name]
                    with serving(libs) if libs else contextlib.nullcontext():
                        start = time.perf_counter()
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
    print(f"kernels: this checkout ({REPO}) against {args.rev}"
          f"{' (the same sources: the same build)' if same_files else ''}; {args.threads} thread(s), medians of "
          f"{args.repeats} alternating rounds")
    print(f"| prompt | teacher | this checkout | {args.rev} | this / {args.rev} speed | x teacher: this, {args.rev} "
          "| same logits |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        s, v = row["seconds"], row["speed_vs_teacher"]
        same = "yes" if row["same_logits"] else f"no (max change {row['max_logit_change']:.2e})"
        print(f"| {row['prompt']} | {s['teacher'] * 1e3:.1f} ms | {s['this checkout'] * 1e3:.1f} ms | "
              f"{s[args.rev] * 1e3:.1f} ms | {row['speed_vs_rev']:.3f}x | {v['this checkout']:.3f}x, "
              f"{v[args.rev]:.3f}x | {same} |")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(dict(rev=args.rev, same_build=same_files, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
