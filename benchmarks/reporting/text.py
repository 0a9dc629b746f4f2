# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Number and Markdown formatting shared by the plots and the report, and the names shown for each decode model."""

from __future__ import annotations

import math

DECODE_LABELS = {"aaren": "Aaren", "aaren_window": "Aaren+window", "llama": "Llama (KV cache)", "mamba": "Mamba"}


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
