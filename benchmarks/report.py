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
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from aaren_hf.conversion.evaluate import format_bytes

ROOT = Path(__file__).resolve().parents[1]
BENCH_DECODE = ROOT / "benchmarks" / "bench_decode.py"
BENCH_KERNELS = ROOT / "benchmarks" / "bench_kernels.py"
DEFAULT_MODEL = ROOT / "outputs" / "SmolLM2-135M-Instruct-aaren"

DECODE_LABELS = {"aaren": "Aaren", "aaren_window": "Aaren+window", "llama": "Llama (KV cache)", "mamba": "Mamba"}
DECODE_STYLE = {  # colour, marker, line style
    "aaren": ("tab:blue", "o", "-"), "aaren_window": ("tab:cyan", "s", "--"),
    "llama": ("tab:red", "^", "-"), "mamba": ("tab:green", "D", ":"),
}
QUICK_KERNEL_ARGS = {"cpu": ["--seqlens", "256", "512", "1024", "2048", "--seq-max-t", "1024", "--min-time", "0.1"],
                     "cuda": ["--seqlens", "1024", "4096", "16384", "--min-time", "0.1", "--decode-batches", "1", "64"]}

PNG = {"memory": "memory_vs_context.png", "latency": "decode_latency.png", "perplexity": "perplexity.png",
       "recall": "recall.png", "scan": "scan_time.png"}


# ----------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------


def _shown(path):
    path = Path(path)
    return path.relative_to(ROOT) if path.is_absolute() and path.is_relative_to(ROOT) else path


def build_parser():
    p = argparse.ArgumentParser(
        description="Run (or reuse the JSON of) the decode benchmark, the kernel benchmark and the conversion "
                    "evaluation, and write one Markdown report with PNG plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, metavar="DIR",
                   help=f"converted checkpoint to evaluate (default: {_shown(DEFAULT_MODEL)} if present)")
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


# ----------------------------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------------------------


def fmt_num(x, unit=""):
    """3 significant digits or so, without scientific notation; '-' for None."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    a = abs(x)
    if a >= 100:
        s = f"{x:.0f}"
    elif a >= 10:
        s = f"{x:.1f}"
    elif a >= 1:
        s = f"{x:.2f}"
    elif a == 0:
        s = "0"
    else:
        s = f"{x:.3g}"
    return s + unit


def fmt_count(n):
    if n is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return fmt_num(n / scale, unit)
    return str(n)


def fmt_load(values):
    return "-" if not values else " / ".join(f"{v:.2f}" for v in values)


def fmt_ctx(n):
    n = int(n)
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def fmt_seconds(s):
    """Seconds as us below 1 ms, ms below 10 s, else s."""
    if s is None:
        return "-"
    if s < 1e-3:
        return fmt_num(1e6 * s, " us")
    return fmt_num(s, " s") if s >= 10 else fmt_num(1e3 * s, " ms")


def md_cell(text):
    text = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in str(text).replace("\n", " "))
    return text.replace("|", "\\|")


def md_table(header, rows):
    out = ["| " + " | ".join(md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Provenance
# ----------------------------------------------------------------------------------------------------------------


def git_commit():
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{' (with uncommitted changes)' if dirty else ''}" if head else None


def machine_info():
    import torch

    spec = importlib.util.spec_from_file_location("bench_decode", BENCH_DECODE)
    bench_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_decode)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {**bench_decode.host_info(), "gpus": gpus, "hostname": platform.node()}


def command_line(argv):
    if argv is None and getattr(sys, "orig_argv", None):
        return shlex.join(sys.orig_argv)
    return shlex.join(["python", "-P", "benchmarks/report.py", *(sys.argv[1:] if argv is None else argv)])


# ----------------------------------------------------------------------------------------------------------------
# Running the scripts
# ----------------------------------------------------------------------------------------------------------------


def run_logged(cmd, log_path, env=None):
    """Run ``cmd``, echoing its output to stderr and saving it to ``log_path``. Returns (exit code, output tail)."""
    print(f"[report] $ {shlex.join(map(str, cmd))}", file=sys.stderr, flush=True)
    lines = []
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(map(str, cmd))}\n")
        proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=str(ROOT), env=env, bufsize=1)
        for line in proc.stdout:
            sys.stderr.write(line)
            log.write(line)
            lines.append(line)
            del lines[:-40]
        rc = proc.wait()
    return rc, "".join(lines[-15:])


def _python():
    return [sys.executable, "-P"]


def decode_command(args, json_path):
    return _python() + [BENCH_DECODE] + (["--quick"] if args.quick else []) + shlex.split(args.decode_args) + \
        ["--json", json_path]


def kernels_command(args, json_path, device):
    extra = shlex.split(args.kernels_args)
    quick = QUICK_KERNEL_ARGS[device] if args.quick else []
    given = {a.split("=")[0] for a in extra if a.startswith("--")}
    quick = _drop_given(quick, given)
    # One thread on the CPU unless told otherwise (as bench_decode.py does): on a shared machine, OpenMP threads
    # competing for busy cores make the chunked scan's many small ops wait at barriers (measured here: 1.4 ms with
    # 1 thread, 228 ms with 2 threads, T=256 on 2 busy cores).
    threads = ["--threads", "1"] if device == "cpu" and "--threads" not in given else []
    return _python() + [BENCH_KERNELS, "--device", device] + threads + quick + extra + ["--json", json_path]


def _drop_given(defaults, given):
    """Remove options in ``given`` (and their values) from a default argument list."""
    out, skip = [], False
    for a in defaults:
        if a.startswith("--"):
            skip = a in given
        if not skip:
            out.append(a)
    return out


def eval_command(args, model_dir, json_path):
    return _python() + ["-m", "aaren_hf.conversion.cli", "eval", "--model", str(model_dir)] + \
        (["--quick"] if args.quick else []) + shlex.split(args.eval_args) + ["--json", json_path]


def _copy_input(src, dest):
    src, dest = Path(src), Path(dest)
    if src.resolve() != dest.resolve():
        shutil.copyfile(src, dest)
    return dest


def collect(args, data_dir, cuda_available):
    """Run the scripts (or take the given JSON). Returns {part: {"data", "source", "ran", "note", "failed"}}."""
    parts = {}

    # decode
    if args.skip_decode:
        parts["decode"] = {"note": "skipped (--skip-decode)"}
    elif args.decode_json:
        dest = _copy_input(args.decode_json, data_dir / "decode.json")
        parts["decode"] = {"data": json.loads(dest.read_text()), "source": f"given: {args.decode_json}", "ran": False}
    else:
        out = data_dir / "decode.json"
        cmd = decode_command(args, out)
        rc, tail = run_logged(cmd, data_dir / "decode.log")
        parts["decode"] = _result_of(rc, tail, out, cmd, "decode benchmark")

    # kernels
    if args.skip_kernels:
        parts["kernels"] = {"note": "skipped (--skip-kernels)"}
    elif args.kernels_json:
        datas = []
        for i, path in enumerate(args.kernels_json):
            dest = _copy_input(path, data_dir / (f"kernels_{i}.json" if len(args.kernels_json) > 1 else "kernels.json"))
            datas.append(json.loads(dest.read_text()))
        parts["kernels"] = {"data": datas, "source": "given: " + ", ".join(args.kernels_json), "ran": False}
    else:
        datas, commands, notes, failed = [], [], [], False
        devices = ["cpu"] + (["cuda"] if cuda_available and not args.no_cuda else [])
        for device in devices:
            out = data_dir / f"kernels_{device}.json"
            cmd = kernels_command(args, out, device)
            rc, tail = run_logged(cmd, data_dir / f"kernels_{device}.log")
            r = _result_of(rc, tail, out, cmd, f"kernel benchmark ({device})")
            commands.append(r["command"])
            if "data" in r:
                datas.append(r["data"])
            else:
                notes.append(r["note"])
                failed = True
        if not cuda_available:
            notes.append("no CUDA GPU visible: CPU kernel benchmark only")
        elif args.no_cuda:
            notes.append("CUDA kernel run skipped (--no-cuda)")
        parts["kernels"] = {"data": datas or None, "ran": True, "command": "\n".join(commands),
                            "source": "run here: " + ", ".join(f"kernels_{d}.json" for d in devices),
                            "note": "; ".join(notes) or None, "failed": failed}
        if not datas:
            del parts["kernels"]["data"]

    # evaluation
    if args.skip_eval:
        parts["eval"] = {"note": "skipped (--skip-eval)"}
    elif args.eval_json:
        dest = _copy_input(args.eval_json, data_dir / "eval.json")
        parts["eval"] = {"data": json.loads(dest.read_text()), "source": f"given: {args.eval_json}", "ran": False}
    else:
        model = Path(args.model) if args.model else DEFAULT_MODEL
        if not (model / "config.json").is_file():
            parts["eval"] = {"note": f"no converted checkpoint at {_shown(model)}: conversion evaluation skipped. "
                                     "Convert one (`aaren-convert --recipe smollm2-135m`) or pass --model DIR or "
                                     "--eval-json F"}
        else:
            out = data_dir / "eval.json"
            cmd = eval_command(args, model, out)
            env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
            rc, tail = run_logged(cmd, data_dir / "eval.log", env=env)
            parts["eval"] = _result_of(rc, tail, out, cmd, "conversion evaluation")
            parts["eval"]["model"] = str(model)
    return parts


def _result_of(rc, tail, out, cmd, what):
    command = shlex.join(map(str, cmd))
    if rc == 0 and Path(out).is_file():
        return {"data": json.loads(Path(out).read_text()), "source": f"run here: {Path(out).name}", "ran": True,
                "command": command}
    return {"failed": True, "command": command,
            "note": f"{what} FAILED (exit {rc}); last output:\n\n```\n{tail.rstrip()}\n```"}


# ----------------------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bytes_formatter():
    from matplotlib.ticker import FuncFormatter

    def f(v, _pos):
        if v <= 0:
            return ""
        for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if v >= scale:
                return f"{v / scale:g} {unit}"
        return f"{v:g} B"

    return FuncFormatter(f)


def _bytes_axis(ax, values):
    """Log y axis of bytes with ticks at powers of 2 (every 1, 2, 4, ... octaves: at most about 8 ticks), the
    lowest tick at or below the smallest value and the highest at or above the largest."""
    from matplotlib.ticker import FixedLocator, NullFormatter

    ax.set_yscale("log", base=2)
    lo, hi = math.log2(min(values)), math.log2(max(values))
    step = 1
    while (hi - lo) / step > 6:
        step *= 2
    tick_lo, tick_hi = step * math.floor(lo / step), step * math.ceil(hi / step)
    if tick_hi == tick_lo:
        tick_lo, tick_hi = tick_lo - step, tick_hi + step
    ax.yaxis.set_major_locator(FixedLocator([2.0 ** e for e in range(tick_lo, tick_hi + 1, step)]))
    ax.yaxis.set_major_formatter(_bytes_formatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(2.0 ** (tick_lo - 0.3), 2.0 ** (tick_hi + 0.3))


def _log_time_axis(ax, formatter, values):
    """Log y axis with labelled ticks at 1, 2, 5 x 10^k over up to 2 decades, 1, 3 x 10^k up to 4, else 10^k."""
    from matplotlib.ticker import LogLocator, NullFormatter

    ax.set_yscale("log")
    values = [v for v in values if v and v > 0]
    decades = math.log10(max(values) / min(values)) if values else 0
    subs = (1.0, 2.0, 5.0) if decades <= 2 else (1.0, 3.0) if decades <= 4 else (1.0,)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(formatter)
    ax.yaxis.set_minor_formatter(NullFormatter())


def _context_axis(ax, values, label):
    from matplotlib.ticker import NullFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(list(values))
    ax.set_xticklabels([fmt_ctx(v) for v in values])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(label)


def decode_rows(decode):
    """{model: [(context, row)]} sorted by context, in the JSON's model order."""
    order = decode.get("config", {}).get("models") or list(decode["results"])
    return {m: sorted(((int(c), r) for c, r in decode["results"][m].items()), key=lambda x: x[0])
            for m in order if m in decode["results"]}


def plot_memory(decode, path):
    plt = _plt()
    rows = decode_rows(decode)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    contexts = sorted({c for rs in rows.values() for c, _ in rs})
    for m, rs in rows.items():
        color, marker, ls = DECODE_STYLE.get(m, (None, "o", "-"))
        ax.plot([c for c, _ in rs], [r["cache_bytes"] for _, r in rs], marker=marker, ls=ls, color=color,
                label=DECODE_LABELS.get(m, m), lw=2, ms=6)
    _context_axis(ax, contexts, "context length T (tokens before decoding)")
    _bytes_axis(ax, [r["cache_bytes"] for rs in rows.values() for _, r in rs])
    ax.set_ylabel("cache / state bytes per sequence (log scale)")
    title = "Decode memory vs context (batch 1, fp32)"
    if "llama" in rows and "aaren" in rows:
        c, r = rows["llama"][-1]
        aaren = dict(rows["aaren"]).get(c)
        if aaren:
            ratio = fmt_num(r["cache_bytes"] / aaren["cache_bytes"])
            title += f"\nLlama KV cache / Aaren state at {fmt_ctx(c)}: {ratio}x"
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_latency(decode, path):
    plt = _plt()
    rows = decode_rows(decode)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    contexts = sorted({c for rs in rows.values() for c, _ in rs})
    values = []
    for m, rs in rows.items():
        color, marker, ls = DECODE_STYLE.get(m, (None, "o", "-"))
        x = [c for c, _ in rs]
        y = [r["latency_ms"] for _, r in rs]
        lo = [max(0.0, r["latency_ms"] - r.get("latency_ms_p25", r["latency_ms"])) for _, r in rs]
        hi = [max(0.0, r.get("latency_ms_p75", r["latency_ms"]) - r["latency_ms"]) for _, r in rs]
        ax.errorbar(x, y, yerr=[lo, hi], marker=marker, ls=ls, color=color, label=DECODE_LABELS.get(m, m), lw=2,
                    ms=6, capsize=3)
        values += y
    _context_axis(ax, contexts, "context length T (tokens before decoding)")
    if values and max(values) / max(min(values), 1e-12) > 10:
        from matplotlib.ticker import FuncFormatter

        _log_time_axis(ax, FuncFormatter(lambda v, _p: f"{v:g}"), values)
        ax.set_ylabel("ms per decoded token (median, log scale)")
    else:
        ax.set_ylim(bottom=0)
        ax.set_ylabel("ms per decoded token (median)")
    threads = decode.get("machine", {}).get("torch_threads")
    ax.set_title("Per-token decode latency vs context (CPU"
                 + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else "") + "; bars: IQR)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _wrap(name, width=24):
    return "\n".join(textwrap.wrap(str(name), width)) or str(name)


def plot_perplexity(ev, path):
    plt = _plt()
    models = ev["perplexity"]
    lr = models[0]["ppl"].get("from_position")
    names = [_wrap(m["name"]) for m in models]
    alls = [m["ppl"]["ppl"] for m in models]
    tails = [m["ppl"].get("ppl_from_position") for m in models]
    has_tail = any(t is not None for t in tails)
    fig, ax = plt.subplots(figsize=(max(6.5, 2.3 * len(models) + 1.5), 4.8))
    width = 0.38 if has_tail else 0.6
    xs = list(range(len(models)))
    colors = {"teacher": "tab:gray", "student": "tab:blue", "baseline": "tab:orange"}
    bar_colors = [colors.get(m.get("kind"), "tab:purple") for m in models]
    b1 = ax.bar([x - (width / 2 if has_tail else 0) for x in xs], alls, width, color=bar_colors, edgecolor="black",
                label="all predicted tokens")
    bars = [b1]
    if has_tail:
        b2 = ax.bar([x + width / 2 for x in xs], [t or 0 for t in tails], width, color=bar_colors, edgecolor="black",
                    hatch="//", alpha=0.6, label=f"positions >= {lr} (long range)")
        bars.append(b2)
    for group in bars:
        for rect in group:
            h = rect.get_height()
            if h > 0:
                ax.annotate(fmt_num(h), (rect.get_x() + rect.get_width() / 2, h), xytext=(0, 2),
                            textcoords="offset points", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(xs)
    ax.set_xticklabels(names, fontsize=9)
    vals = [v for v in alls + tails if v]
    if vals and max(vals) / min(vals) > 20:
        ax.set_yscale("log")
        ax.set_ylabel("perplexity (log scale, lower is better)")
    else:
        ax.set_ylim(0, max(vals) * 1.15 if vals else 1)
        ax.set_ylabel("perplexity (lower is better)")
    s = ev.get("setup", {})
    ax.set_title(f"Perplexity on held-out text: {s.get('windows')} windows x {s.get('window_length')} tokens"
                 f"\n({_wrap(s.get('text_source', ''), 60)})", fontsize=10)
    if has_tail:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def recall_series(ev):
    """[(name, [(distance, accuracy, token_accuracy)])] without skipped distances."""
    out = []
    for probe in ev.get("recall", []):
        pts = [(r["distance"], r["accuracy"], r["token_accuracy"]) for r in probe["results"]
               if not r.get("skipped") and r.get("accuracy") is not None]
        out.append((probe["name"], pts))
    return out


def plot_recall(ev, path):
    plt = _plt()
    series = recall_series(ev)
    distances = sorted({d for _, pts in series for d, _, _ in pts})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharex=True)
    styles = [("tab:gray", "o", "-", 11), ("tab:blue", "s", "--", 8), ("tab:orange", "^", ":", 6),
              ("tab:red", "v", "-.", 5), ("tab:green", "D", "--", 4), ("tab:purple", "x", ":", 6)]
    for i, (name, pts) in enumerate(series):
        color, marker, ls, ms = styles[i % len(styles)]
        for ax, k in zip(axes, (1, 2)):
            ax.plot([p[0] for p in pts], [p[k] for p in pts], marker=marker, ls=ls, color=color, ms=ms, lw=2,
                    mfc="none", mew=2, label=_wrap(name, 50))
    first = (ev.get("recall") or [{}])[0]
    for ax, what in zip(axes, ("exact match of the whole key", "fraction of key digits right")):
        if distances:
            _context_axis(ax, distances, "distance: filler tokens between the key and the question")
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    axes[0].set_title("Passkey recall: exact match", fontsize=10)
    axes[1].set_title("Passkey recall: digit accuracy", fontsize=10)
    fig.suptitle(f"Recall over distance ({first.get('n_trials')} trials per distance; filler: {first.get('filler')})",
                 fontsize=11)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, max(1, len(labels))), frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def kernel_rows(kernels):
    """(cpu rows, cuda rows, cuda decode rows, cpu json, cuda json): the first file holding each part."""
    cpu = next((k for k in kernels if k.get("cpu_forward")), None)
    cuda = next((k for k in kernels if k.get("cuda")), None)
    return (cpu["cpu_forward"] if cpu else [], cuda["cuda"] if cuda else [], cuda.get("decode", []) if cuda else [],
            cpu, cuda)


def plot_scan(kernels, path):
    plt = _plt()
    from matplotlib.ticker import FuncFormatter

    cpu_rows, cuda_rows, _, cpu_json, cuda_json = kernel_rows(kernels)
    panels = [p for p in (("cpu", cpu_rows), ("cuda", cuda_rows)) if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 4.8), squeeze=False)
    def seconds_label(v, _pos):
        if v <= 0:
            return ""
        if v < 1e-3:
            return f"{float(f'{v * 1e6:.3g}'):g} us"
        return f"{float(f'{v * 1e3:.3g}'):g} ms" if v < 1 else f"{v:g} s"

    sec = FuncFormatter(seconds_label)
    for ax, (device, rows) in zip(axes[0], panels):
        if device == "cpu":
            series = [("chunked scan (PyTorch)", "chunk_torch_s", "tab:blue", "o", "-"),
                      ("sequential token loop", "sequential_torch_s", "tab:green", "s", ":"),
                      ("causal softmax attention (SDPA)", "sdpa_causal_s", "tab:red", "^", "--")]
            r0 = rows[0]
            a = cpu_json.get("args", {})
            title = (f"CPU forward, fp32: B={r0.get('B')} H={r0.get('H')} D={r0.get('D')}, "
                     f"chunk {a.get('chunk_size')}")
            pts_by = {s[1]: [(r["T"], r.get(s[1])) for r in rows] for s in series}
        else:
            series = [("Triton chunk kernel fwd", "triton_s|fwd", "tab:blue", "o", "-"),
                      ("Triton fwd+bwd", "triton_s|fwd+bwd", "tab:blue", "o", "--"),
                      ("chunked scan (PyTorch) fwd", "torch_s|fwd", "tab:green", "s", "-"),
                      ("SDPA (flash) fwd", "sdpa_s|fwd", "tab:red", "^", "-"),
                      ("SDPA (flash) fwd+bwd", "sdpa_s|fwd+bwd", "tab:red", "^", "--")]
            r0 = rows[0]
            title = f"{r0.get('device')}, bf16: B={r0.get('B')} H={r0.get('H')} D={r0.get('D')}"
            pts_by = {}
            for s in series:
                key, mode = s[1].split("|")
                pts_by[s[1]] = [(r["T"], r.get(key)) for r in rows if r.get("mode") == mode]
        Ts = sorted({r["T"] for r in rows})
        plotted = []
        for label, key, color, marker, ls in series:
            pts = [(t, v) for t, v in pts_by[key] if v is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ls=ls, color=color, lw=2, ms=6,
                        label=label)
                plotted += [p[1] for p in pts]
        _context_axis(ax, Ts, "sequence length T")
        _log_time_axis(ax, sec, plotted)
        ax.set_ylabel("time per call (log scale, lower is better)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    fig.suptitle("Aaren scan vs causal attention: time vs sequence length", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------------


def _section_start(title, part):
    """The section's title, then where its numbers come from (file, command), or the note saying why there are none."""
    lines = [title, ""]
    if "data" not in part:
        return lines + [part.get("note") or "no data", ""]
    if part.get("source"):
        lines.append(f"Source: {part['source']}.")
    if part.get("command"):
        lines += ["", "```", part["command"], "```"]
    return lines + [""]


def section_decode(part, out_dir, notes):
    lines = _section_start("## 1-2. Decode: memory and per-token latency vs context", part)
    if "data" not in part:
        return lines, {}
    d = part["data"]
    m, cfg = d.get("machine", {}), d.get("config", {})
    lines.append(
        f"Measured on: {m.get('cpu')}, {m.get('cpu_count')} cores ({m.get('usable_cores')} usable), "
        f"{m.get('torch_threads')} torch thread(s), torch {m.get('torch')}, transformers {m.get('transformers')}, "
        f"git {m.get('git')}; load average (1/5/15 min) {fmt_load(m.get('loadavg_start'))} at the start, "
        f"{fmt_load(m.get('loadavg_end'))} at the end. "
        f"Setting: {m.get('device')}, {m.get('dtype')}, batch {m.get('batch_size')}, random init; median of "
        f"{cfg.get('steps')} interleaved decode steps after {cfg.get('warmup')} warm-up steps; each (model, context) "
        f"in its own subprocess for memory: {not d.get('in_process')}; whole run {fmt_num(d.get('wall_s'), ' s')}.")
    lines.append("")
    model_rows = []
    for k, md in d.get("models", {}).items():
        desc = ", ".join(f"{a}={b}" for a, b in md.items() if a not in ("class", "params", "dtype"))
        model_rows.append([DECODE_LABELS.get(k, k), md.get("class"), fmt_count(md.get("params")), desc])
    lines += md_table(["model", "class", "parameters", "configuration"], model_rows) + [""]
    for k, rs in d.get("results", {}).items():
        fills = list(dict.fromkeys(r.get("fill") for _, r in sorted(rs.items(), key=lambda x: int(x[0]))
                                   if r.get("fill")))
        if fills:
            lines.append(f"- {DECODE_LABELS.get(k, k)}: cache filled by {'; '.join(fills)}")
    lines.append("")
    if d.get("in_process"):
        notes.append("decode benchmark ran with --in-process: its peak-memory numbers mix across rows")
    if d.get("code_changed_during_run"):
        notes.append("aaren_hf's source changed during the decode benchmark: its numbers come from two versions")
    if cfg.get("quick"):
        notes.append("decode benchmark in --quick mode: small contexts and few steps; the flat-vs-linear targets are "
                     "defined for 1K..64K")

    rows = decode_rows(d)
    plots = {}
    plot_memory(d, out_dir / PNG["memory"])
    plot_latency(d, out_dir / PNG["latency"])
    plots["memory"], plots["latency"] = PNG["memory"], PNG["latency"]
    contexts = sorted({c for rs in rows.values() for c, _ in rs})
    models = list(rows)

    lines += ["### 1. Memory vs context", "", f"![Decode cache/state bytes vs context]({PNG['memory']})", ""]
    header = ["context"] + [f"{DECODE_LABELS.get(k, k)} bytes" for k in models]
    if "llama" in rows:
        header += [f"Llama KV / {DECODE_LABELS.get(k, k)}" for k in models if k != "llama"]
    table = []
    for c in contexts:
        row = [fmt_ctx(c)] + [format_bytes(dict(rows[k]).get(c, {}).get("cache_bytes")) for k in models]
        if "llama" in rows:
            kv = dict(rows["llama"])[c]["cache_bytes"]
            row += [fmt_num(kv / dict(rows[k])[c]["cache_bytes"], "x") for k in models if k != "llama"]
        table.append(row)
    lines += md_table(header, table) + [""]
    peak = [[DECODE_LABELS.get(k, k)] + [format_bytes(dict(rows[k])[c].get("peak_rss_bytes")) for c in contexts]
            for k in models]
    lines += ["Peak resident memory of the whole benchmark process (imports, model, fill, decode):", ""]
    lines += md_table(["model"] + [fmt_ctx(c) for c in contexts], peak) + [""]

    lines += ["### 2. Per-token decode latency vs context", "", f"![Per-token decode latency]({PNG['latency']})", ""]
    table = []
    for c in contexts:
        row = [fmt_ctx(c)]
        for k in models:
            r = dict(rows[k]).get(c)
            row.append("-" if r is None else f"{fmt_num(r['latency_ms'])} ({fmt_num(r.get('latency_ms_p25'))}-"
                       f"{fmt_num(r.get('latency_ms_p75'))})")
        table.append(row)
    lines += ["Median ms per decoded token (interquartile range):", ""]
    lines += md_table(["context"] + [f"{DECODE_LABELS.get(k, k)} ms" for k in models], table) + [""]
    ratios = d.get("ratios", {})
    if ratios:
        lo, hi = contexts[0], contexts[-1]
        lines += [f"Growth from {fmt_ctx(lo)} to {fmt_ctx(hi)} (ratio of the largest to the smallest context):", ""]
        lines += md_table(["model", "latency ratio", "bytes ratio"],
                          [[DECODE_LABELS.get(k, k), fmt_num(r["latency_hi_over_lo"], "x"),
                            fmt_num(r["bytes_hi_over_lo"], "x")] for k, r in ratios.items()]) + [""]
    checks = d.get("checks", [])
    if checks:
        lines += ["Targets checked by bench_decode.py:", ""]
        lines += md_table(["check", "value", "wanted", "result", "scope"],
                          [[c["name"], fmt_num(c["value"]), f"{c['op']} {c['threshold']:g}",
                            "PASS" if c["pass"] else "FAIL", "target" if c.get("target", True) else "informative"]
                           for c in checks]) + [""]
    return lines, plots


def section_eval(part, out_dir, notes):
    lines = _section_start("## 3-4. Conversion evaluation: perplexity and recall", part)
    if "data" not in part:
        return lines, {}
    ev = part["data"]
    s = ev.get("setup", {})
    lines.append(
        f"Teacher: {s.get('teacher')}; student: {s.get('student')} (window {s.get('student_window')}, "
        f"{s.get('student_sinks')} sink(s)). Held-out text: {s.get('text_source')}; {s.get('windows')} windows of "
        f"{s.get('window_length')} tokens, stride {s.get('stride')} ({s.get('predicted_tokens')} predicted tokens), "
        f"each scored on its own; keys/values in {s.get('kv_dtype')}; seed {s.get('seed')}; evaluation took "
        f"{fmt_num(ev.get('seconds'), ' s')}.")
    lines.append("")
    if s.get("quick"):
        notes.append("conversion evaluation in quick mode: at most 4 windows, 2 recall trials, distances <= 512")
    plots = {}
    if ev.get("perplexity"):
        plot_perplexity(ev, out_dir / PNG["perplexity"])
        plots["perplexity"] = PNG["perplexity"]
        lr = ev["perplexity"][0]["ppl"].get("from_position")
        lines += ["### 3. Perplexity: teacher vs student vs StreamingLLM baseline", "",
                  f"![Perplexity]({PNG['perplexity']})", ""]
        lines += md_table(["model", "perplexity", "ratio to teacher", f"perplexity at positions >= {lr}",
                           "state / KV bytes"],
                          [[m["name"], fmt_num(m["ppl"]["ppl"]), fmt_num(m.get("ratio_to_teacher"), "x"),
                            fmt_num(m["ppl"].get("ppl_from_position")),
                            f"{format_bytes(m.get('memory_bytes'))} ({m.get('memory_note', '')})"]
                           for m in ev["perplexity"]]) + [""]
        eq = ev.get("equal_memory")
        if eq:
            lines.append(
                f"Equal-memory baseline: the student's state is {format_bytes(eq['student_state_bytes'])}; the teacher "
                f"holds {format_bytes(eq['teacher_kv_bytes_per_token'])} of keys/values per token, so the baseline with "
                f"{eq['sinks']} sink(s) gets a window of {eq['window']} tokens "
                f"({format_bytes(eq['baseline_kv_bytes'])})" + (" (clamped)" if eq.get("clamped") else "") +
                ". The baseline is the teacher, untrained, with a StreamingLLM attention mask.")
            lines.append("")
    if ev.get("recall"):
        plot_recall(ev, out_dir / PNG["recall"])
        plots["recall"] = PNG["recall"]
        first = ev["recall"][0]
        lines += ["### 4. Recall over distance (passkey)", "", f"![Recall over distance]({PNG['recall']})", ""]
        lines.append(f"{first.get('task')}; {first.get('n_trials')} trials per distance; filler: "
                     f"{first.get('filler')}. Cells: exact match (digit accuracy).")
        lines.append("")
        names = [p["name"] for p in ev["recall"]]
        table = []
        for i, row in enumerate(first["results"]):
            cells = []
            for p in ev["recall"]:
                r = p["results"][i]
                cells.append("n/a (" + str(r["skipped"]) + ")" if r.get("skipped") else
                             f"{fmt_num(r['accuracy'])} ({fmt_num(r['token_accuracy'])})")
            gap = next((p["results"][i].get("key_to_answer") for p in ev["recall"]
                        if p["results"][i].get("key_to_answer")), None)
            table.append([str(row["distance"]), "-" if gap is None else str(gap)] + cells)
        lines += md_table(["distance", "key to answer"] + names, table) + [""]
    mem = ev.get("memory")
    if mem and mem.get("rows"):
        lines += ["### State vs KV-cache bytes of the converted model (per sequence)", ""]
        base = mem.get("baseline")
        header = ["context", "teacher KV cache", "student state"]
        header += [f"StreamingLLM S={base['sinks']} W={base['window']}"] if base else []
        header += ["teacher / student"]
        table = []
        for r in mem["rows"]:
            row = [fmt_ctx(r["context"]), format_bytes(r["teacher_kv_bytes"]), format_bytes(r["student_state_bytes"])]
            row += [format_bytes(r.get("baseline_kv_bytes"))] if base else []
            table.append(row + [fmt_num(r.get("teacher_over_student"), "x")])
        lines += md_table(header, table) + [""]
        a, b = mem.get("student_state_bytes_measured_at", [None, None])
        lines.append(f"Student state measured from its cache after {a} and after {b} tokens: "
                     f"{'identical' if mem.get('student_state_constant') else 'NOT identical'}.")
        lines.append("")
    samples = ev.get("samples")
    if samples and samples.get("teacher"):
        lines += [f"### Samples (greedy, {samples.get('max_new_tokens')} new tokens)", ""]
        lines += md_table(["prompt", "teacher", "student"],
                          [[t["prompt"], t["completion"], st["completion"]]
                           for t, st in zip(samples["teacher"], samples.get("student", []))]) + [""]
    return lines, plots


def section_kernels(part, out_dir, notes):
    lines = _section_start("## 5. Scan time vs sequence length", part)
    if "data" not in part:
        return lines, {}
    kernels = part["data"]
    if part.get("note"):
        lines += [part["note"], ""]
    cpu_rows, cuda_rows, dec_rows, cpu_json, cuda_json = kernel_rows(kernels)
    plots = {}
    if not (cpu_rows or cuda_rows):
        return lines + ["The kernel JSON holds no measurements.", ""], plots
    plot_scan(kernels, out_dir / PNG["scan"])
    plots["scan"] = PNG["scan"]
    lines += [f"![Scan time vs T]({PNG['scan']})", ""]
    if cpu_rows:
        a = cpu_json.get("args", {})
        lines.append(f"CPU, forward, fp32, torch {cpu_json.get('torch')}, threads: "
                     f"{a.get('threads') or 'torch default'}; chunk {a.get('chunk_size')}, decay {a.get('decay')}; "
                     f"minimum time over repeats of >= {a.get('min_time')} s; sequential loop only up to "
                     f"T = {a.get('seq_max_t')}. Ratios > 1: the chunked scan is faster.")
        lines.append("")
        lines += md_table(["T", "chunked (PyTorch)", "sequential loop", "causal SDPA", "loop / chunked",
                           "SDPA / chunked"],
                          [[str(r["T"]), fmt_seconds(r["chunk_torch_s"]), fmt_seconds(r.get("sequential_torch_s")),
                            fmt_seconds(r["sdpa_causal_s"]), fmt_num(r.get("seq_over_chunk"), "x"),
                            fmt_num(r.get("sdpa_over_chunk"), "x")] for r in cpu_rows]) + [""]
        t = cpu_json.get("targets") or {}
        yn = {True: "yes", False: "no", None: "not measured (T = 4K not in this run)"}
        lines.append(f"Targets (bench_kernels.py): chunked >= 10x the sequential loop at T = 4K: "
                     f"{yn[t.get('seq_over_chunk_at_4k_ge_10')]}; faster than causal SDPA for every T >= 4K: "
                     f"{yn[t.get('faster_than_sdpa_from_4k')]}.")
        lines.append("")
    if cuda_rows:
        lines.append(f"{cuda_json.get('device_name')}, bf16; peak {cuda_json.get('peak_tflops')} TFLOP/s, "
                     f"{cuda_json.get('peak_gbs')} GB/s; median of CUDA-event timings.")
        lines.append("")
        lines += md_table(["T", "pass", "Triton", "PyTorch chunked", "SDPA (flash)", "Triton GB/s (% peak)",
                           "Triton TFLOP/s", "SDPA TFLOP/s (% peak)"],
                          [[str(r["T"]), r["mode"], fmt_seconds(r.get("triton_s")), fmt_seconds(r.get("torch_s")),
                            fmt_seconds(r.get("sdpa_s")),
                            f"{fmt_num(r.get('triton_gbs'))} ({fmt_num(r.get('triton_pct_bw'), '%')})",
                            fmt_num(r.get("triton_tflops")),
                            f"{fmt_num(r.get('sdpa_tflops'))} ({fmt_num(r.get('sdpa_pct_peak'), '%')})"]
                           for r in cuda_rows]) + [""]
        if dec_rows:
            lines += ["Decode step (one token per sequence, state carried):", ""]
            lines += md_table(["batch", "Triton step", "PyTorch step", "PyTorch / Triton"],
                              [[str(r["batch"]), fmt_num(1e6 * r["triton_s"], " us"),
                                fmt_num(1e6 * r["torch_s"], " us"), fmt_num(r["torch_s"] / r["triton_s"], "x")]
                               for r in dec_rows]) + [""]
    return lines, plots


def build_report(parts, out_dir, command, machine, commit, date):
    notes = []
    body, plots = [], {}
    for fn, key in ((section_decode, "decode"), (section_eval, "eval"), (section_kernels, "kernels")):
        lines, p = fn(parts.get(key, {"note": "not run"}), out_dir, notes)
        body += lines
        plots.update(p)
    gpus = ", ".join(machine["gpus"]) or "none"
    head = [
        "# Aaren benchmark report",
        "",
        f"- Command: `{command}`",
        f"- Date: {date}",
        f"- Machine: {machine['cpu']}, {machine['cpu_count']} cores ({machine['usable_cores']} usable), GPU: {gpus}; "
        f"torch {machine['torch']}, transformers {machine['transformers']}, Python {machine['python']}; "
        f"load average (1/5/15 min) {fmt_load(machine['loadavg'])} when the report was written",
        f"- Git commit: {commit}",
        "- Sources: " + "; ".join(
            f"{name}: {p.get('source') or ('run here' if p.get('ran') else (p.get('note') or '-').split(chr(10))[0])}"
            for name, p in (("decode", parts.get("decode", {})), ("kernels", parts.get("kernels", {})),
                            ("evaluation", parts.get("eval", {})))),
        "",
        "Every number below is read from the JSON files in `data/` (written by the benchmark scripts in this run, or "
        "copied from the files given on the command line); measurements made by a JSON's own run may come from "
        "another machine or commit, as recorded in each section.",
        "",
    ]
    for name, p in parts.items():
        if p.get("failed"):
            notes.append(f"{name}: " + p["note"].split("\n")[0] + " (see its section and data/*.log)")
    tail = []
    if notes:
        tail = ["## Caveats", ""] + [f"- {n}" for n in notes] + [""]
    text = "\n".join(head + body + tail).rstrip() + "\n"
    return text, plots


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
    parts = collect(args, data_dir, bool(machine["gpus"]))
    text, plots = build_report(parts, out_dir, command, machine, git_commit(), date)
    report = out_dir / "REPORT.md"
    report.write_text(text)
    print(f"[report] wrote {report} and {len(plots)} plot(s): {', '.join(plots.values()) or 'none'}", file=sys.stderr)
    failed = [k for k, p in parts.items() if p.get("failed")]
    if failed:
        print(f"[report] failed parts: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
