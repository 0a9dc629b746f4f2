# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The report's Markdown: one section per part (decode, evaluation, kernels), each table read from the collected JSON,
each figure one of the PNGs that ``plot.draw_plots`` wrote."""

from __future__ import annotations

from aaren_hf.conversion.evaluate import format_bytes

from .collect import decode_rows, kernel_rows
from .text import DECODE_LABELS, fmt_count, fmt_ctx, fmt_load, fmt_num, fmt_seconds, md_table


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


def section_decode(part, plots, notes):
    """Body of the decode benchmark: its setting, memory and latency tables, targets. Appends caveats to ``notes``."""
    lines = []
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
    contexts = sorted({c for rs in rows.values() for c, _ in rs})
    models = list(rows)

    lines += ["### 1. Memory vs context", "", f"![Decode cache/state bytes vs context]({plots['memory']})", ""]
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

    lines += ["### 2. Per-token decode latency vs context", "", f"![Per-token decode latency]({plots['latency']})", ""]
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
    return lines


def section_eval(part, plots, notes):
    """Body of the evaluation: perplexity, recall, state bytes, samples. Appends caveats to ``notes``."""
    lines = []
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
    if ev.get("perplexity"):
        lr = ev["perplexity"][0]["ppl"].get("from_position")
        lines += ["### 3. Perplexity: teacher vs student vs StreamingLLM baseline", "",
                  f"![Perplexity]({plots['perplexity']})", ""]
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
        first = ev["recall"][0]
        lines += ["### 4. Recall over distance (passkey)", "", f"![Recall over distance]({plots['recall']})", ""]
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
    return lines


def section_kernels(part, plots, notes):
    """Body of the kernel benchmark: CPU and CUDA scan times, decode steps. Appends caveats to ``notes``."""
    lines = []
    kernels = part["data"]
    if part.get("note"):
        lines += [part["note"], ""]
    cpu_rows, cuda_rows, dec_rows, cpu_json, cuda_json = kernel_rows(kernels)
    if not (cpu_rows or cuda_rows):
        return lines + ["The kernel JSON holds no measurements.", ""]
    lines += [f"![Scan time vs T]({plots['scan']})", ""]
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
    return lines


SECTIONS = (  # part, title, body
    ("decode", "## 1-2. Decode: memory and per-token latency vs context", section_decode),
    ("eval", "## 3-4. Conversion evaluation: perplexity and recall", section_eval),
    ("kernels", "## 5. Scan time vs sequence length", section_kernels),
)


def render_report(parts, plots, command, machine, commit, date):
    """The whole REPORT.md text; ``plots`` is what ``plot.draw_plots`` drew for these parts."""
    notes = []
    body = []
    for key, title, section in SECTIONS:
        part = parts.get(key, {"note": "not run"})
        body += _section_start(title, part)
        if "data" in part:
            body += section(part, plots, notes)
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
    return "\n".join(head + body + tail).rstrip() + "\n"
