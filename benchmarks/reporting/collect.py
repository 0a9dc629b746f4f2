# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Collect the report's inputs: run the benchmark scripts and the evaluation in subprocesses (or take their JSON from
the command line), record where the numbers come from, and read the rows out of the JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH_DECODE = ROOT / "benchmarks" / "bench_decode.py"
BENCH_KERNELS = ROOT / "benchmarks" / "bench_kernels.py"
QUICK_KERNEL_ARGS = {"cpu": ["--seqlens", "256", "512", "1024", "2048", "--seq-max-t", "1024", "--min-time", "0.1"],
                     "cuda": ["--seqlens", "1024", "4096", "16384", "--min-time", "0.1", "--decode-batches", "1", "64"]}


def shown(path):
    """``path`` relative to the repository when it lies inside it (shorter in notes and help texts)."""
    path = Path(path)
    return path.relative_to(ROOT) if path.is_absolute() and path.is_relative_to(ROOT) else path


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


def _given(path, dest):
    """A part whose JSON was given on the command line, copied next to the report's other data."""
    return {"data": json.loads(_copy_input(path, dest).read_text()), "source": f"given: {path}", "ran": False}


def collect(args, data_dir, cuda_available, default_model):
    """Run the scripts (or take the given JSON). Returns {part: {"data", "source", "ran", "note", "failed"}}."""
    parts = {}

    # decode
    if args.skip_decode:
        parts["decode"] = {"note": "skipped (--skip-decode)"}
    elif args.decode_json:
        parts["decode"] = _given(args.decode_json, data_dir / "decode.json")
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
        parts["eval"] = _given(args.eval_json, data_dir / "eval.json")
    else:
        model = Path(args.model) if args.model else Path(default_model)
        if not (model / "config.json").is_file():
            parts["eval"] = {"note": f"no converted checkpoint at {shown(model)}: conversion evaluation skipped. "
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
# Rows of the collected JSON
# ----------------------------------------------------------------------------------------------------------------


def decode_rows(decode):
    """{model: [(context, row)]} sorted by context, in the JSON's model order."""
    order = decode.get("config", {}).get("models") or list(decode["results"])
    return {m: sorted(((int(c), r) for c, r in decode["results"][m].items()), key=lambda x: x[0])
            for m in order if m in decode["results"]}


def kernel_rows(kernels):
    """(cpu rows, cuda rows, cuda decode rows, cpu json, cuda json): the first file holding each part."""
    cpu = next((k for k in kernels if k.get("cpu_forward")), None)
    cuda = next((k for k in kernels if k.get("cuda")), None)
    return (cpu["cpu_forward"] if cpu else [], cuda["cuda"] if cuda else [], cuda.get("decode", []) if cuda else [],
            cpu, cuda)
