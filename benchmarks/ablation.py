"""Ablation of the student's mixer options on one teacher, same data and budget for every row.

Each row is a full `aaren-convert` run (own process, own output folder); this script only chooses the flags,
runs what is not done yet and tabulates the runs' own JSON (conversion.json, evaluation.json). Rows are claimed
with the converter's run lock on NAME.claim, so two copies of this script started side by side share the work (one
core each):

    .venv/bin/python -P benchmarks/ablation.py                     # all rows, stage 1 only, 100 steps/layer
    .venv/bin/python -P benchmarks/ablation.py --table-only        # just rebuild reports/ablation/ABLATION.md

A finished row (evaluation.json present) is never rerun; delete its folder to redo it. The claim of a runner killed
mid-row goes to the next runner that finds its process gone. Model weights are deleted after evaluation unless
--keep-models (9 rows x 540 MB).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from aaren_hf.conversion.evaluate import format_bytes
from aaren_hf.conversion.train_state import LockHeld, RunLock

# name -> (what it shows, mixer flags). Order = priority: the rows the conclusion rests on run first.
ROWS = {
    "paper": ("paper's form: 1 query/head, no decay", dict(slots=1, decay="none", window=0, sinks=0)),
    "slots4+decay+w64+sink": ("recipe default", dict(slots=4, decay="learned", window=64, sinks=1)),
    "slots4+decay": ("+ slots + decay", dict(slots=4, decay="learned", window=0, sinks=0)),
    "slots4+decay+w256+sink": ("+ window 256 + sink", dict(slots=4, decay="learned", window=256, sinks=1)),
    "decay": ("+ decay", dict(slots=1, decay="learned", window=0, sinks=0)),
    "slots4": ("+ 4 query slots", dict(slots=4, decay="none", window=0, sinks=0)),
    "slots4+decay+w64": ("+ window 64, no sink", dict(slots=4, decay="learned", window=64, sinks=0)),
    "slots4+decay+w256": ("+ window 256, no sink", dict(slots=4, decay="learned", window=256, sinks=0)),
    "paper+w64+sink": ("paper's form + window 64 + sink", dict(slots=1, decay="none", window=64, sinks=1)),
    "slots4+inputdecay+w64+sink": ("input-dependent decay", dict(slots=4, decay="input", window=64, sinks=1)),
}


# The rows compare the options the recipe had when the README's table was measured (2026-11-30): no memory tier, keys
# and values in the model's dtype, no recall exercises among the training windows, evaluation at 512 tokens. Later
# recipe defaults would change every row alike and hide what the table measured; the memory has its own tables.
TABLE_SETUP = ["--memory-size", "0", "--kv-cache-dtype", "model", "--recall-fraction", "0", "--long-seq-len", "512"]


def mixer_flags(m):
    return [*TABLE_SETUP, "--num-query-slots", str(m["slots"]), "--decay", m["decay"],
            "--window-size", str(m["window"]), "--num-sink-tokens", str(m["sinks"])]


def run_row(name, args, out_dir):
    folder = out_dir / name
    if (folder / "evaluation.json").exists():
        return
    try:  # not NAME.lock: that is the lock the converter itself takes on its --output, the row's folder
        claim = RunLock(out_dir / f"{name}.claim").acquire()
    except LockHeld:
        print(f"[{name}] claimed by another runner, skipped", flush=True)
        return
    try:
        cmd = [sys.executable, "-P", "-m", "aaren_hf.conversion.cli", "--recipe", args.recipe,
               "--output", str(folder), "--overwrite", "--no-progress", "--threads", str(args.threads),
               "--stage1-steps", str(args.stage1_steps), "--stage2-steps", str(args.stage2_steps),
               "--eval-windows", str(args.eval_windows), "--recall-trials", str(args.recall_trials),
               *mixer_flags(ROWS[name][1]), *args.extra]
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        start = time.time()
        with open(out_dir / f"{name}.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        print(f"[{name}] exit {rc} after {time.time() - start:.0f} s", flush=True)
        if rc == 0 and not args.keep_models:
            for f in folder.glob("*.safetensors"):
                f.unlink()
    finally:
        claim.release()


def row_summary(name, folder):
    conv = json.loads((folder / "conversion.json").read_text())
    ev = json.loads((folder / "evaluation.json").read_text())
    by_kind = {}
    for p in ev["perplexity"]:
        by_kind.setdefault(p["kind"], p)  # first baseline = the equal-memory one
    teacher, student, base = by_kind["teacher"], by_kind["student"], by_kind["baseline"]
    recall = {r["name"]: r["results"] for r in ev["recall"]}
    s1, s2 = conv.get("stage1") or {}, conv.get("stage2") or {}
    o1 = conv["options"]["stage1"]
    seq = conv["options"]["seq_len"]
    layers = len(s1.get("layers", []))
    s1_tokens = s1.get("layers", [{}])[0].get("steps", 0) * o1["batch_size"] * seq if layers else 0
    return dict(
        name=name, what=ROWS.get(name, ("",))[0], mixer=conv["options"]["mixer"],
        state=ev["memory"]["student_state_bytes"],
        ppl_t=teacher["ppl"]["ppl"], ppl_s=student["ppl"]["ppl"], ppl_b=base["ppl"]["ppl"],
        long_t=teacher["ppl"]["ppl_from_position"], long_s=student["ppl"]["ppl_from_position"],
        long_b=base["ppl"]["ppl_from_position"],
        base_name=f"S={base.get('sinks', 0)} W={base.get('window')}",
        fvu=s1.get("mean_heldout_fvu_after"), kl=s2.get("heldout_kl_after"),
        s1_tokens=s1_tokens, s2_tokens=s2.get("tokens", 0), seconds=conv["seconds"],
        recall_s=[(r["key_to_answer"], r["accuracy"]) for r in recall[student["name"]]],
        recall_b=[(r["key_to_answer"], r["accuracy"]) for r in recall[base["name"]]],
        windows=ev["setup"]["windows"], window_length=ev["setup"]["window_length"],
    )


def table(rows):
    head = ("| row | slots | decay | W | sinks | state | student ppl (x teacher) | pos>=256 | "
            "StreamingLLM at equal memory | pos>=256 | stage-1 FVU | passkey student (key->answer: acc) | "
            "passkey baseline | stage-1 tokens/layer | wall |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        m = r["mixer"]
        rec = lambda xs: " ".join(f"{d}:{a:.2f}" for d, a in xs)
        lines.append(
            f"| {r['name']} | {m['num_query_slots']} | {m['decay']} | {m['window_size']} | {m['num_sink_tokens']} "
            f"| {format_bytes(r['state'])} | {r['ppl_s']:.2f} ({r['ppl_s'] / r['ppl_t']:.2f}x) "
            f"| {r['long_s'] / r['long_t']:.2f}x | {r['base_name']}: {r['ppl_b']:.2f} ({r['ppl_b'] / r['ppl_t']:.2f}x) "
            f"| {r['long_b'] / r['long_t']:.2f}x | {r['fvu']:.3f} | {rec(r['recall_s'])} | {rec(r['recall_b'])} "
            f"| {r['s1_tokens']:,} | {r['seconds'] / 60:.1f} min |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--out-dir", type=Path, default=Path("reports/ablation"))
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--stage1-steps", type=int, default=100)
    ap.add_argument("--stage2-steps", type=int, default=0)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--recall-trials", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (1: one core per runner)")
    ap.add_argument("--keep-models", action="store_true")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more aaren-convert flags for every row")
    args = ap.parse_args()
    args.extra = [a for a in args.extra if a != "--"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for name in args.rows:
            run_row(name, args, args.out_dir)
    done = [row_summary(n, args.out_dir / n) for n in ROWS if (args.out_dir / n / "evaluation.json").exists()]
    if not done:
        sys.exit(f"no finished rows in {args.out_dir}")
    r0 = done[0]
    text = (f"# Ablation: {args.recipe}, stage-1 steps {args.stage1_steps}, stage-2 steps {args.stage2_steps}\n\n"
            f"Teacher ppl {r0['ppl_t']:.2f} (pos>=256: {r0['long_t']:.2f}) on {r0['windows']} held-out windows of "
            f"{r0['window_length']} tokens, the same windows for every row. Baseline: the teacher, untrained, "
            f"with a StreamingLLM cache of the student's memory. Passkey cells: tokens from key to answer: exact "
            f"match.\n\n" + table(done) + "\n")
    tmp = args.out_dir / "ABLATION.md.tmp"
    tmp.write_text(text)
    tmp.replace(args.out_dir / "ABLATION.md")
    print(text)


if __name__ == "__main__":
    main()
