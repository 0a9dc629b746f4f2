# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The report's PNG plots, drawn from the collected JSON with matplotlib (Agg backend, no display needed)."""

from __future__ import annotations

import math
import textwrap

from .collect import decode_rows, kernel_rows
from .text import DECODE_LABELS, fmt_ctx, fmt_num

DECODE_STYLE = {  # colour, marker, line style
    "aaren": ("tab:blue", "o", "-"), "aaren_window": ("tab:cyan", "s", "--"),
    "llama": ("tab:red", "^", "-"), "mamba": ("tab:green", "D", ":"),
}
PNG = {"memory": "memory_vs_context.png", "latency": "decode_latency.png", "perplexity": "perplexity.png",
       "recall": "recall.png", "scan": "scan_time.png"}


def draw_plots(parts, out_dir):
    """Draw every plot the collected parts have data for. Returns {plot key: file name in out_dir}."""
    plots = {}
    decode = parts.get("decode", {}).get("data")
    if decode is not None:
        plot_memory(decode, out_dir / PNG["memory"])
        plot_latency(decode, out_dir / PNG["latency"])
        plots["memory"], plots["latency"] = PNG["memory"], PNG["latency"]
    ev = parts.get("eval", {}).get("data")
    if ev is not None and ev.get("perplexity"):
        plot_perplexity(ev, out_dir / PNG["perplexity"])
        plots["perplexity"] = PNG["perplexity"]
    if ev is not None and ev.get("recall"):
        plot_recall(ev, out_dir / PNG["recall"])
        plots["recall"] = PNG["recall"]
    kernels = parts.get("kernels", {}).get("data")
    if kernels is not None and any(kernel_rows(kernels)[:2]):
        plot_scan(kernels, out_dir / PNG["scan"])
        plots["scan"] = PNG["scan"]
    return plots


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


def _decode_figure(decode):
    """(plt, fig, ax, rows, contexts) for a plot of the decode benchmark against the context length."""
    plt = _plt()
    rows = decode_rows(decode)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    return plt, fig, ax, rows, sorted({c for rs in rows.values() for c, _ in rs})


def _save_decode_figure(plt, fig, ax, path):
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    _save(plt, fig, path)


def _save(plt, fig, path, **layout):
    fig.tight_layout(**layout)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(decode, path):
    plt, fig, ax, rows, contexts = _decode_figure(decode)
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
    _save_decode_figure(plt, fig, ax, path)


def plot_latency(decode, path):
    plt, fig, ax, rows, contexts = _decode_figure(decode)
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
    _save_decode_figure(plt, fig, ax, path)


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
    _save(plt, fig, path)


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
    _save(plt, fig, path, rect=(0, 0.12, 1, 1))


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
    _save(plt, fig, path)
