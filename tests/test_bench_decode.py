# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Smoke test of benchmarks/bench_decode.py: tiny sizes, in-process. Asserts only measured sizes, never timings."""

import importlib.util
import json
from pathlib import Path

import aaren_hf  # noqa: F401  (before transformers' model code: see the note in bench_decode.py)

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_decode.py"
CONTEXTS = (128, 256, 512)


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_decode_quick_json(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "bench.json"
    bench.main([
        "--quick", "--in-process", "--contexts", ",".join(map(str, CONTEXTS)), "--steps", "3", "--warmup", "1",
        "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
        "--vocab", "256", "--window", "16", "--sinks", "1", "--mamba-prefill", "64", "--json", str(out),
    ])
    printed = capsys.readouterr().out
    assert "PASS" in printed or "FAIL" in printed
    assert "ms/token" in printed

    report = json.loads(out.read_text())
    for key in ("machine", "config", "models", "results", "ratios", "checks", "in_process"):
        assert key in report
    assert report["machine"]["torch"]
    assert set(report["results"]) == {"aaren", "aaren_window", "llama", "mamba"}
    for kind, rows in report["results"].items():
        assert set(rows) == {str(c) for c in CONTEXTS}, kind
        for row in rows.values():
            for key in ("latency_ms", "latency_ms_p25", "latency_ms_p75", "cache_bytes", "peak_rss_bytes", "fill"):
                assert key in row, (kind, key)
            assert row["latency_ms"] > 0 and row["cache_bytes"] > 0 and row["peak_rss_bytes"] > 0
        assert "latency_hi_over_lo" in report["ratios"][kind]
        assert "bytes_hi_over_lo" in report["ratios"][kind]

    def nbytes(kind):
        return [report["results"][kind][str(c)]["cache_bytes"] for c in CONTEXTS]

    # Aaren: one fixed-size state whatever the context (window row: once its window is full), also after decoding.
    for kind in ("aaren", "aaren_window", "mamba"):
        sizes = nbytes(kind)
        assert len(set(sizes)) == 1, (kind, sizes)
        after = [report["results"][kind][str(c)]["cache_bytes_after_decode"] for c in CONTEXTS]
        assert after == sizes, (kind, after, sizes)
    # Llama: K and V of every token, so exactly linear in the context.
    llama = nbytes("llama")
    per_token = llama[0] // CONTEXTS[0]
    assert per_token == 1 * 2 * 2 * (64 // 4) * 4  # layers * (K, V) * kv_heads * head_dim * fp32
    assert llama == [per_token * c for c in CONTEXTS]
    assert report["ratios"]["llama"]["bytes_hi_over_lo"] == CONTEXTS[-1] / CONTEXTS[0]
    assert report["ratios"]["aaren"]["bytes_hi_over_lo"] == 1.0

    names = {c["name"]: c for c in report["checks"]}
    assert names["Aaren state bytes 512/128 ratio"]["pass"]
    assert all(isinstance(c["pass"], bool) for c in report["checks"])
