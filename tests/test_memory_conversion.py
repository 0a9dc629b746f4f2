# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Converting into the memory tier and sliding-attention layers: the retention fit, the coverage measurement that
chooses the rule, --convert-layers, and a whole tiny conversion with both."""

from __future__ import annotations

import pytest
import torch

import aaren_hf  # noqa: F401
from aaren_hf.conversion import retention
from aaren_hf.conversion.adapters import layer_types_for
from helpers import one_thread, tiny_model  # noqa: F401  (autouse fixture)
from test_conversion import read_weights, tiny, tiny_options  # noqa: F401  (fixture)


def test_layer_types_for_parses_and_refuses():
    assert layer_types_for("all", 3) == ["linear_attention"] * 3
    assert layer_types_for("none", 2) == ["sliding_attention"] * 2
    assert layer_types_for("0,2", 3) == ["linear_attention", "sliding_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"layer\(s\) \[3\], but the teacher has layers 0..2"):
        layer_types_for("1,3", 3)
    with pytest.raises(ValueError, match="'all', 'none', 'global' or layer indices"):
        layer_types_for("first", 3)
    with pytest.raises(ValueError, match="'global' needs the teacher's layer types"):
        layer_types_for("global", 3)


def _attention_that_wants(marked: torch.Tensor, T: int, heads: int) -> torch.Tensor:
    """Causal attention [B, H, T, T] where every query puts most of its weight on the marked keys it can see."""
    B = marked.shape[0]
    logits = torch.zeros(B, heads, T, T) + 4.0 * marked.float().view(B, 1, 1, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)


def test_fit_retention_learns_what_far_queries_attend_and_coverage_says_so():
    """Tokens carrying a marker feature get the attention of later queries; the fitted retention score must rank
    them first, so the memory's coverage of beyond-window attention beats keeping the newest tokens."""
    torch.manual_seed(0)
    model = tiny_model(window_size=4, num_sink_tokens=1, memory_size=3)
    mixer = model.model.layers[0].mixer
    B, T, E = 6, 40, model.config.hidden_size
    x = torch.randn(B, T, E)
    marked = torch.rand(B, T) < 0.08
    x[..., 0] = x[..., 0] + 3.0 * marked.float()  # the feature a linear score can read
    attn = _attention_that_wants(marked, T, model.config.num_attention_heads)
    fit = retention.fit_retention(mixer, x, attn)
    assert fit["r2"] > 0.1  # the target also depends on position (early keys face fewer rivals), which x lacks
    learned = retention.coverage(attn, retention.rule_scores(mixer, x, "learned"), 4, 1, 3)
    recent = retention.coverage(attn, retention.rule_scores(mixer, x, "recent"), 4, 1, 3)
    assert 0 < recent < learned <= 1
    assert learned > 1.5 * recent, (learned, recent)


def test_coverage_is_one_when_the_memory_holds_everything():
    T, W, S = 12, 3, 1
    attn = torch.softmax(torch.randn(1, 2, T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -1e9), -1)
    assert retention.coverage(attn, torch.zeros(1, T, 2), W, S, memory_size=T) == pytest.approx(1.0)
    assert retention.coverage(attn, torch.zeros(1, T, 2), W, S, memory_size=1) < 1.0


def test_visible_share_counts_window_sinks_and_memory_by_brute_force():
    """Per head, the mean over queries of the attention on what the window branch sees, checked against a loop
    over queries that applies the memory rule (top M scores among the tokens that left the window, newer wins)."""
    torch.manual_seed(0)
    B, H, Hkv, T, W, S, M = 2, 4, 2, 15, 3, 1, 2
    attn = torch.softmax(torch.randn(B, H, T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -1e9), -1)
    scores = torch.randint(0, 3, (B, T, Hkv)).float()  # ties on purpose
    share = retention.visible_share(attn, scores, W, S, M)
    expected = torch.zeros(H)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                left = [j for j in range(S, t - W + 1)]
                ranked = sorted(left, key=lambda j: (float(scores[b, j, h // (H // Hkv)]), j), reverse=True)
                seen = set(ranked[:M]) | {j for j in range(T) if (t - j < W and j <= t) or j < S}
                expected[h] += sum(float(attn[b, h, t, j]) for j in seen)
    torch.testing.assert_close(share, expected / (B * T))
    assert (retention.visible_share(attn, scores, W, S, T) - 1).abs().max() < 1e-5  # a memory that holds everything


def test_stage1_starts_the_window_gate_from_what_the_memory_will_hold(tiny):  # noqa: F811
    """With a memory tier, the gate's starting share is the teacher's attention on window, sinks and memory (higher
    than on window and sinks alone), set after the retention fit."""
    from aaren_hf.conversion.adapters import teacher_layers
    from aaren_hf.conversion.convert import build_student, load_teacher
    from aaren_hf.conversion.stage1 import capture_attention, fit_memory

    _, teacher = load_teacher(str(tiny[0]))
    student = build_student(teacher, {"window_size": 4, "num_sink_tokens": 1, "memory_size": 6})
    mixer = student.model.layers[0].mixer
    windows = torch.randint(0, teacher.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    x, _ = capture_attention(teacher, windows, [0], dtype=torch.float32)[0]
    out = fit_memory(mixer, teacher_layers(teacher)[0], x, None)
    attn = retention.teacher_attention(teacher_layers(teacher)[0], x, mixer.rope_inv_freq)
    share = retention.visible_share(attn, retention.rule_scores(mixer, x, "learned"), 4, 1, 6).clamp(0.05, 0.95)
    torch.testing.assert_close(torch.sigmoid(mixer.window_gate.detach().float()), share, atol=1e-5, rtol=0)
    assert out["window_share"] == pytest.approx(float(share.mean()), abs=1e-3)
    assert float(retention.visible_share(attn, retention.rule_scores(mixer, x, "learned"), 4, 1, 0).mean()) < \
        float(share.mean())


def test_conversion_with_memory_and_sliding_layers(tiny, tmp_path):  # noqa: F811
    """A whole tiny conversion with the memory tier, one layer kept as sliding attention: the retention score is
    fitted (no longer zero), coverage is reported, the sliding layer has no Aaren parameters, and the result
    loads and decodes exactly as it scores."""
    from aaren_hf import AarenForCausalLM
    from aaren_hf.conversion.convert import convert

    teacher, data = tiny
    mixer = {"num_query_slots": 2, "decay": "learned", "window_size": 8, "num_sink_tokens": 1, "window_gate": "head",
             "memory_size": 4, "memory_rule": "learned", "convert_layers": "1"}
    out = convert(tiny_options(teacher, data, tmp_path / "out", mixer=mixer))
    model = AarenForCausalLM.from_pretrained(out).eval()
    assert model.config.layer_types == ["sliding_attention", "linear_attention"]
    weights = read_weights(out)
    assert "model.layers.0.mixer.queries" not in weights and "model.layers.1.mixer.queries" in weights
    for i in (0, 1):
        assert weights[f"model.layers.{i}.mixer.retention_proj.weight"].abs().max() > 0
    import json

    record = json.loads((out / "conversion.json").read_text())
    memory = record["stage1"]["memory"]
    assert {"fit_r2", "coverage_learned", "coverage_recent"} <= set(memory)
    ids = torch.randint(4, 60, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache, steps = None, []
        out_ = model(ids[:, :10], use_cache=True)
        cache, steps = out_.past_key_values, [out_.logits]
        for t in range(10, 30):
            o = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(o.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)


def test_long_training_windows_come_from_training_documents_and_carry_recall(tiny):  # noqa: F811
    """Stage 2's long windows are cut from the run's training documents only (never a held-out one), and the
    requested share of stage-1 and stage-2 windows is recall-bearing."""
    from aaren_hf.conversion.convert import _load_long_windows, _load_windows, training_windows
    from aaren_hf.conversion.data import load_token_windows
    from test_conversion import make_tokenizer

    teacher, data = tiny
    tok = make_tokenizer()
    opts = tiny_options(teacher, data, "unused", seq_len=96, train_windows=8, long_seq_len=192, recall_fraction=0.5)
    train, heldout, info = _load_windows(tok, opts, lambda m: None)
    long = _load_long_windows(tok, opts, info["train_documents"], 192)
    assert long is not None and long.shape[1] == 192
    run = load_token_windows(tok, list(opts.data), seq_len=96, num_heldout=opts.heldout_windows, seed=opts.seed)
    held_text = {tuple(w.tolist()) for w in run.heldout}
    pieces = {tuple(w[i : i + 96].tolist()) for w in long for i in range(0, 97)}
    assert not held_text & pieces  # no held-out window appears inside a long training window
    messages = []
    s1, s2 = training_windows(tok, opts, train, long, window=8, say=messages.append)
    n1 = opts.stage1.windows
    assert s1.shape == train.shape and torch.equal(s1[: n1 // 2], train[: n1 // 2])
    assert not torch.equal(s1[n1 // 2 : n1], train[n1 // 2 : n1])  # half of the captured windows bury keys
    assert s2.shape == long.shape and "recall-bearing windows" in messages[0]
    rows = {tuple(w.tolist()) for w in long}
    assert sum(tuple(w.tolist()) not in rows for w in s2) == round(0.5 * long.shape[0])


def test_recall_vs_memory_script_on_a_converted_folder(tiny, tmp_path, monkeypatch, capsys):  # noqa: F811
    """benchmarks/recall_vs_memory.py end to end on a tiny converted model with a memory, run from another working
    directory: the teacher found through the folder's conversion.json as `aaren-convert eval` finds it (the script
    once read the record's own teacher field, a path relative to the folder), each row at two memory sizes, the
    perplexity curve and the JSON; a memory size of 0 switches the student's memory off with its sharing across
    layers (the learned row, which has nothing to rank, left out); a folder without the record is refused with a
    usage error, not a traceback."""
    import importlib
    import json
    import sys

    from aaren_hf.conversion.convert import convert
    from test_bench_model import load_bench

    teacher, data = tiny
    mixer = {"num_query_slots": 2, "decay": "learned", "window_size": 8, "num_sink_tokens": 1, "window_gate": "head",
             "memory_size": 4, "memory_rule": "learned", "memory_shared_layer": 0}
    out = convert(tiny_options(teacher, data, tmp_path / "out", mixer=mixer))
    load_bench()  # benchmarks/ on sys.path
    script = importlib.import_module("recall_vs_memory")
    monkeypatch.chdir(tmp_path / "out")
    monkeypatch.setattr(sys, "argv", ["recall_vs_memory.py", "--model", str(out), "--memory-sizes", "0,4",
                                      "--distances", "16", "--trials", "2", "--perplexity", "1", "--long-seq-len",
                                      "96", "--ranks", "--json", str(tmp_path / "recall.json")])
    script.main()
    result = json.loads((tmp_path / "recall.json").read_text())
    rows = [(r["name"], r["memory"]) for r in result["rows"]]
    assert rows == [("teacher (full KV cache)", None), ("teacher + TOVA", 0), ("student", 0)] + [
        ("teacher + TOVA", 4), ("teacher + learned retention", 4), ("student", 4)]
    assert all(len(r["accuracy"]) == 1 and 0 <= r["accuracy"][0] <= 1 for r in result["rows"])
    assert [c["memory"] for c in result["perplexity"]] == [0, 4]
    assert all(c["ppl"] > 1 and c["streaming_ppl"] > 1 for c in result["perplexity"])
    printed = capsys.readouterr().out
    assert "| student | 4 |" in printed
    # --ranks: each memory layer's rank of the key among the tokens beyond the window, which the key (letters and
    # digits at 16 tokens back, past the window of 8) has left: at least 0, at most the candidates' count
    ranks = result["ranks"]["16"]
    assert ranks and all(0 <= r < 96 for r in ranks), ranks
    assert "| 0 | 4 |" in printed
    monkeypatch.setattr(sys, "argv", ["recall_vs_memory.py", "--model", str(tmp_path), "--trials", "1"])
    with pytest.raises(SystemExit) as exit_:
        script.main()
    assert exit_.value.code == 2 and "no conversion.json naming its teacher" in capsys.readouterr().err
