#!/usr/bin/env python
# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""One Markdown report (with PNG plots) of the decode benchmark, the kernel benchmark and the conversion evaluation.

The measurements are not made here: the existing scripts run in subprocesses and write JSON, or JSON files from an
earlier run are given on the command line; every number in the report is read from those files.

    benchmarks/bench_decode.py --json      decode latency and cache/state bytes vs context (Aaren, Llama KV, Mamba)
    benchmarks/bench_kernels.py --json     scan time vs T on the CPU (chunked vs loop vs SDPA); on CUDA as well
                                           when a GPU is visible (a second run with --device cuda)
    aaren-convert eval --model DIR --json  perplexity teacher / student / StreamingLLM baseline, recall over
                                           distance, state vs KV bytes of a converted checkpoint

Usage:
    python -P benchmarks/report.py                                   # everything, full sizes (long on a CPU)
    python -P benchmarks/report.py --quick --skip-eval               # smoke run, a few minutes
    python -P benchmarks/report.py --decode-json d.json --kernels-json k.json --eval-json e.json   # no runs
    python -P benchmarks/report.py --model outputs/my-aaren --skip-decode --skip-kernels

Writes OUT/REPORT.md, OUT/*.png and the JSON it used under OUT/data/ (with the scripts' logs).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

# `python -P` keeps this script's folder off sys.path too; put it back (never the repository root: docs/layout.md).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting.collect import ROOT, collect, command_line, git_commit, machine_info, shown  # noqa: E402
from reporting.plot import PNG, draw_plots  # noqa: E402
from reporting.render import render_report  # noqa: E402
from reporting.text import DECODE_LABELS  # noqa: E402,F401  (the report's model names, read by tests)

DEFAULT_MODEL = ROOT / "outputs" / "SmolLM2-135M-Instruct-aaren"


def build_parser():
    p = argparse.ArgumentParser(
        description="Run (or reuse the JSON of) the decode benchmark, the kernel benchmark and the conversion "
                    "evaluation, and write one Markdown report with PNG plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, metavar="DIR",
                   help=f"converted checkpoint to evaluate (default: {shown(DEFAULT_MODEL)} if present)")
    p.add_argument("--out", default="reports", metavar="DIR", help="output folder (REPORT.md, PNGs, data/)")
    p.add_argument("--quick", action="store_true",
                   help="smoke sizes: bench_decode --quick, short kernel sweep, aaren-convert eval --quick")
    p.add_argument("--skip-decode", action="store_true", help="no decode benchmark section")
    p.add_argument("--skip-kernels", action="store_true", help="no kernel benchmark section")
    p.add_argument("--skip-eval", action="store_true", help="no conversion evaluation section")
    p.add_argument("--decode-json", metavar="F", help="reuse this bench_decode.py --json output instead of running it")
    p.add_argument("--kernels-json", metavar="F", action="append",
                   help="reuse this bench_kernels.py --json output instead of running it (repeatable: a CPU and a "
                        "CUDA file)")
    p.add_argument("--eval-json", metavar="F",
                   help="reuse this evaluation JSON (aaren-convert eval --json, or a model folder's evaluation.json)")
    p.add_argument("--decode-args", default="", metavar="ARGS",
                   help="extra arguments for bench_decode.py, one string (e.g. \"--contexts 1k,4k --steps 20\")")
    p.add_argument("--kernels-args", default="", metavar="ARGS",
                   help="extra arguments for bench_kernels.py (the CPU run gets --threads 1 unless given here)")
    p.add_argument("--eval-args", default="", metavar="ARGS", help="extra arguments for aaren-convert eval")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA kernel run even if a GPU is visible")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("decode_json", "eval_json"):
        path = getattr(args, name)
        if path is not None and not Path(path).is_file():
            p.error(f"--{name.replace('_', '-')} {path!r}: no such file")
    for path in args.kernels_json or []:
        if not Path(path).is_file():
            p.error(f"--kernels-json {path!r}: no such file")
    if args.model is not None and not args.skip_eval and args.eval_json is None:
        if not (Path(args.model) / "config.json").is_file():
            p.error(f"--model {args.model!r} is not a model folder (no config.json)")
    return args


def main(argv=None):
    args = parse_args(argv)
    out_dir = Path(args.out)
    data_dir = out_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for name in PNG.values():  # no stale plot from an earlier run
        (out_dir / name).unlink(missing_ok=True)
    command = command_line(argv)
    date = datetime.datetime.now(datetime.timezone.utc).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    machine = machine_info()
    parts = collect(args, data_dir, bool(machine["gpus"]), DEFAULT_MODEL)
    plots = draw_plots(parts, out_dir)
    text = render_report(parts, plots, command, machine, git_commit(), date)
    report = out_dir / "REPORT.md"
    report.write_text(text)
    print(f"[report] wrote {report} and {len(plots)} plot(s): {', '.join(plots.values()) or 'none'}", file=sys.stderr)
    failed = [k for k, p in parts.items() if p.get("failed")]
    if failed:
        print(f"[report] failed parts: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
