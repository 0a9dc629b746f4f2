# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Smoke test of benchmarks/bench_model.py on the tiny shape (seconds). Asserts structure and sanity, never timings."""

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

import aaren_hf  # noqa: F401  (before transformers' model code: see the note in bench_decode.py)

PROMPTS = (24, 40)


def load_bench():
    """benchmarks/ is a folder of scripts, not a package: import bench_model.py (and its bench_decode.py) from it."""
    folder = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("bench_model")


def test_bench_model_tiny_table_and_json(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "bench_model.json"
    bench.main([
        "--shape", "tiny", "--device", "cpu", "--models", "aaren,aaren_nowin", "--train", "2x32",
        "--prompts", ",".join(map(str, PROMPTS)), "--generate", ",".join(f"1x{p}" for p in PROMPTS) + ",2x24",
        "--steps", "3", "--repeats", "2", "--profile", "--prefill-tokens", "16", "--json", str(out),
    ])
    printed = capsys.readouterr().out

    # the Markdown table: one header with every model and a ratio column per Aaren model, one line per row of work
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert "teacher (Llama, sdpa)" in table[0] and "Aaren default" in table[0] and "Aaren without window" in table[0]
    assert "Aaren default / teacher" in table[0]
    assert table[1].startswith("|---|")
    body = table[2:]
    assert len(body) == 1 + len(PROMPTS) + len(PROMPTS) + 1
    assert sum("train step, B=2 x 32" in line for line in body) == 1
    assert sum(line.startswith("| prefill 1 x ") for line in body) == len(PROMPTS)
    assert sum(line.startswith("| generate, B=") for line in body) == len(PROMPTS) + 1
    assert all("x speed" in line for line in body)
    # the crossover lines (batch 1 has two prompt lengths; batch 2 only one, so none for it)
    assert "generate, B=1: Aaren default" in printed and "prefill, B=1: Aaren without window" in printed
    assert "generate, B=2:" not in printed

    report = json.loads(out.read_text())
    from aaren_hf import modeling_aaren

    assert report["config"]["prefill_tokens"] == 16 and modeling_aaren.PREFILL_CHUNK == 2048  # restored after the run
    assert set(report["models"]) == {"teacher", "aaren", "aaren_nowin"}
    assert report["models"]["teacher"]["attn_implementation"] == "sdpa"
    assert report["models"]["aaren"]["window_size"] > 0 and report["models"]["aaren_nowin"]["window_size"] == 0
    assert report["models"]["aaren"]["num_query_slots"] == 4 and report["models"]["aaren"]["decay"] == "learned"
    assert report["machine"]["device"] == "cpu" and report["machine"]["torch"]
    works = [(r["work"], r["batch"], r["tokens"]) for r in report["rows"]]
    assert works == [("train", 2, 32)] + [("prefill", 1, p) for p in PROMPTS] + \
        [("generate", 1, p) for p in PROMPTS] + [("generate", 2, 24)]
    for row in report["rows"]:
        assert set(row["models"]) == {"teacher", "aaren", "aaren_nowin"}
        for kind, m in row["models"].items():
            assert m["median_s"] > 0 and m["min_s"] <= m["median_s"] <= m["max_s"], (row["work"], kind)
            assert m["tokens_per_s"] > 0
            assert m["n"] == (3 if row["work"] == "generate" else 2)
            if m["peak_bytes"] is not None:  # None only where the kernel refuses the RSS high-water reset
                assert m["peak_bytes"] >= 0.5 * report["models"][kind]["params"] * 4  # at least ~its float32 weights
        for kind in ("aaren", "aaren_nowin"):
            ratio = row["ratios"][kind]
            assert math.isfinite(ratio["speed"]) and ratio["speed"] > 0
            assert math.isclose(ratio["speed"], row["models"]["teacher"]["median_s"] / row["models"][kind]["median_s"])
            assert ratio["memory"] is None or ratio["memory"] > 0
    generate = [r for r in report["rows"] if r["work"] == "generate"]
    for row in generate:
        teacher_kv = row["models"]["teacher"]["cache_bytes"]
        # K and V of prompt + decoded tokens: layers * 2 * kv_heads * head_dim * float32 per token and row
        per_token = 2 * 2 * 2 * 16 * 4
        assert teacher_kv == row["batch"] * per_token * (row["tokens"] + 3 + 3)  # 3 warm-up steps + 3 timed
        assert row["models"]["aaren_nowin"]["cache_bytes"] > 0
    # the no-window student's state does not grow with the prompt
    nowin = {r["tokens"]: r["models"]["aaren_nowin"]["cache_bytes"] for r in generate if r["batch"] == 1}
    assert len(set(nowin.values())) == 1
    # --profile: operator counts per step for each model, on the first train row, the shortest prefill and the last
    # generate row only; the students' mixers run more operators than the teacher's attention in a train step
    profiled = [(r["work"], r["batch"], r["tokens"]) for r in report["rows"] if "profile" in r]
    assert profiled == [("train", 2, 32), ("prefill", 1, min(PROMPTS)), ("generate", 2, 24)]
    for row in report["rows"]:
        for kind, prof in row.get("profile", {}).items():
            assert prof["aten_calls_per_step"] > 0 and prof["top_self_cpu"], (row["work"], kind)
            assert prof["steps"] == (10 if row["work"] == "generate" else 1)
    train_calls = {k: p["aten_calls_per_step"] for k, p in report["rows"][0]["profile"].items()}
    assert train_calls["aaren"] > train_calls["teacher"]
    for unit in ("train step", "prefill", "decode step"):
        assert f"profile per {unit} (" in printed
    cross = report["crossover"]["generate"]["aaren"]["1"]
    assert cross["lengths"] == list(PROMPTS) and len(cross["speed_ratios"]) == len(PROMPTS)
    assert isinstance(cross["measured"], bool)


def test_bench_model_compiles_the_decode_steps(tmp_path, monkeypatch):
    """--compile-decode: every model's decode steps (warm-up included) go through torch.compile with the given
    backend ('eager' here: it traces, where a GPU would run inductor), the rows come out, and the JSON says so."""
    import torch

    bench = load_bench()
    compiled, real = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled.append(kw["backend"]) or real(model, **kw))
    out = tmp_path / "bench_model.json"
    bench.main(["--shape", "tiny", "--device", "cpu", "--train", "none", "--prompts", "none", "--generate", "1x24",
                "--steps", "2", "--compile-decode", "eager", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["config"]["compile_decode"] == "eager"
    assert [r["work"] for r in report["rows"]] == ["generate"]
    assert compiled == ["eager"] * 4  # teacher and student, in the warm-up and in the row
    assert all(m["ms_per_step"] > 0 for m in report["rows"][0]["models"].values())


def test_bench_model_arguments():
    bench = load_bench()
    args = bench.parse_args(["--device", "cpu", "--train", "8x2k,1x32k", "--generate", "none", "--prompts", "1k"])
    assert args.train == [(8, 2048), (1, 32768)] and args.generate == [] and args.prompts == [1024]
    assert args.models == ["teacher", "aaren"] and args.dtype == "float32"  # the CPU defaults
    args = bench.parse_args(["--device", "cuda", "--shape", "tiny"])
    assert args.models == ["teacher", "aaren", "aaren_nowin"] and args.dtype == "bfloat16"
    assert (32, 16384) in args.generate and (8, 2048) in args.train
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--prefill-tokens", "0"])


def test_count_ops_counts_what_launches():
    """benchmarks/count_ops.py's counter: an operator that writes elements counts, by name; a view, a bare
    allocation and an operator that writes no element (an empty state's tensors) launch nothing on a GPU and do
    not count."""
    import torch

    load_bench()
    count_ops = importlib.import_module("count_ops")
    with count_ops.CountOps() as counter:
        x = torch.ones(3)
        x.view(3, 1), torch.empty(4), torch.zeros(2, 0), x[:0].clone(), x[:0].to(torch.float16)
        x + 1
    assert counter.n == 2 and dict(counter.names) == {"ones": 1, "add": 1}
    assert counter.bytes == 3 * 4 + (3 + 3) * 4  # ones writes 3 floats; add reads 3 and writes 3


def test_count_ops_as_a_gpu_runs_it_runs_fewer_operators(monkeypatch):
    """benchmarks/count_ops.py: a prompt past one CPU piece and several CPU sweep passes (the default mixer's memory
    ranks 448 of the tokens that left its 64-token window) runs fewer operators as a GPU runs it (one piece, one
    window-attention call, larger sweep passes; fewer still with the window kernel than with the PyTorch window path),
    with the same logits to float rounding, and moves fewer bytes with the window kernel; at one layer a decode step
    runs fewer operators than the teacher's (with the step kernels); a train step runs and moves more with the PyTorch
    window path and the PyTorch norms and MLP than with their kernels; ``launch_bound`` and the C kernels' switch are
    left as they were. Triton's interpreter runs the GPU's kernels slowly (seconds a kernel at SmolLM2's shape), so
    the models are SmolLM2's layer narrowed (3 heads sharing 1 kv head, as 9 share 3; the default mixer as it is) and
    the CPU's pieces and sweep passes small, so that a short prompt takes several of each."""
    import os

    import torch

    bench = load_bench()
    count_ops = importlib.import_module("count_ops")
    from aaren_hf import modeling_aaren
    from aaren_hf.kernels import triton_available

    narrow = dict(bench.SHAPES["smollm2-135m"], vocab_size=512, hidden_size=192, intermediate_size=512,
                  num_attention_heads=3, num_key_value_heads=1)
    monkeypatch.setitem(bench.SHAPES, "smollm2-135m", narrow)
    M, Hkv = bench.mixer_options("aaren", "smollm2-135m")["memory_size"], narrow["num_key_value_heads"]
    block, _ = modeling_aaren.sweep_plan(1, Hkv, M, torch.device("cpu"))
    monkeypatch.setattr(modeling_aaren, "PREFILL_CHUNK", 256)
    monkeypatch.setattr(modeling_aaren, "SWEEP_PAIRS", Hkv * (M + block) ** 2)  # one block of the sweep a pass
    before = modeling_aaren.launch_bound, os.environ.get("AAREN_BACKEND")
    counts = count_ops.main(["--tokens", "700", "--layers", "1", "--decode-prompt", "600", "--train-tokens", "130"])
    assert counts["train"]["student"] > 0 and counts["train"]["teacher"] > 0
    assert counts["MB"]["train"]["student"] > 0 and counts["MB"]["train"]["teacher"] > 0
    (cpu, _), (gpu, diff_gpu) = counts["prefill"]
    assert cpu > 2 * gpu > 0
    if modeling_aaren.fused_window_attention is not None and triton_available():  # the kernels: fewer operators
        plain = count_ops.main(["--tokens", "700", "--layers", "1", "--decode-prompt", "600", "--window", "pytorch",
                                "--layer", "pytorch", "--train-tokens", "130"])
        assert plain["train"]["teacher"] == counts["train"]["teacher"]
        assert plain["train"]["student"] > counts["train"]["student"] + 20
        assert plain["MB"]["train"]["student"] > counts["MB"]["train"]["student"]
        assert plain["prefill"][1][0] > gpu + 20
        assert plain["MB"]["prefill"][1] > counts["MB"]["prefill"][1] > 0  # each block's keys gathered
    assert diff_gpu < 1e-4
    if modeling_aaren.fused_window_step is not None and triton_available():
        assert 0 < counts["decode"]["student"] < counts["decode"]["teacher"]
    assert (modeling_aaren.launch_bound, os.environ.get("AAREN_BACKEND")) == before


def test_saved_memory_counts_what_16_bit_window_attention_saves():
    """benchmarks/saved_memory.py: the bytes a training forward keeps for backward, per layer, as a GPU runs the
    student. With the teacher's PyTorch norms and MLP (``--layer pytorch``) the student keeps more than the teacher
    (its mixer), window attention in the model's 16-bit dtype less than in float32, and its Triton kernel less than
    the PyTorch path (the gathered keys and values, the mask); the norm and MLP kernels keep less than their PyTorch
    code (the float32 copies, silu(gate)); the teacher's count is the same in every run; ``launch_bound``,
    ``_attention_dtype`` and the interpreter switch are left as they were."""
    import os

    pytest.importorskip("triton")
    load_bench()
    saved_memory = importlib.import_module("saved_memory")
    from aaren_hf import modeling_aaren

    before = modeling_aaren.launch_bound, modeling_aaren._attention_dtype, os.environ.get("TRITON_INTERPRET")
    runs = {dtype: saved_memory.main(["--tokens", "160", "--attention-dtype", dtype, "--layer", "pytorch"])[0]
            for dtype in ("model", "float32")}
    assert runs["model"]["teacher"] == runs["float32"]["teacher"] > 0
    assert runs["model"]["teacher"] < runs["model"]["student"] < runs["float32"]["student"]
    # the window kernel keeps its inputs, output and log-sum-exp, not each block's gathered keys and its mask
    gathered = saved_memory.main(["--tokens", "160", "--window", "pytorch", "--layer", "pytorch"])[0]
    assert gathered["teacher"] == runs["model"]["teacher"]
    assert runs["model"]["student"] < gathered["student"] - 0.5
    # two norms' float32 inputs (2 x 4 bytes per hidden unit) and silu(gate) (2 bytes per MLP unit) per token
    kernels = saved_memory.main(["--tokens", "160"])[0]
    assert kernels["teacher"] == runs["model"]["teacher"]
    assert kernels["student"] < runs["model"]["student"] - 0.9 * 160 * (8 * 576 + 2 * 1536) / 2**20
    assert (modeling_aaren.launch_bound, modeling_aaren._attention_dtype, os.environ.get("TRITON_INTERPRET")) == before


def test_saved_memory_counts_what_the_graph_still_holds():
    """saved_memory's count: a node whose output was detached at once is freed with what it saved (a running max),
    so its input is not counted; what a live node saves is."""
    import torch

    load_bench()
    saved_memory = importlib.import_module("saved_memory")

    class Model(torch.nn.Module):
        def forward(self, x, use_cache=False):
            y = x * 2.0  # kept by nothing: a product by a number saves no tensor
            peak = y.amax(-1, keepdim=True).detach()  # amax saves y, but its node goes with the detached output
            return torch.exp(y - peak)  # saves its result: 4 x 256 float32

    x = torch.randn(4, 256, requires_grad=True)
    by_line = saved_memory.saved_by_line(Model(), x)
    assert len(by_line) == 1 and sum(by_line.values()) == 4 * 256 * 4


def test_bench_window_times_both_paths_and_checks_they_agree(monkeypatch):
    """benchmarks/bench_window.py on the CPU: the C attention kernel against the PyTorch path (and the PyTorch decode
    step alone), then, with Triton's interpreter, the Triton kernels, whose outputs (and the decode step's state) the
    script checks against the PyTorch paths' (two rows, several blocks, a memory; a decode step after 80 tokens)."""
    from aaren_hf.kernels import window as window_kernel

    pytest.importorskip("triton")
    load_bench()
    bench_window = importlib.import_module("bench_window")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    runs = bench_window.main(["--device", "cpu", "--shapes", "1x130", "--steps", "1", "--step-prompt", "70",
                              "--min-time", "0"])
    rows = runs["attention"]
    assert rows[0]["pytorch"]["forward_s"] > 0
    if window_kernel._library() is not None:  # a C compiler: the kernel's row, checked against the PyTorch path
        assert rows[0]["kernel"]["forward_backward_s"] > 0
    assert runs["step"][0]["pytorch_s"] > 0 and runs["step"][0]["kernel_s"] is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runs = bench_window.main(["--device", "cpu", "--shapes", "2x150", "--steps", "2", "--step-prompt", "80",
                              "--min-time", "0"])
    assert runs["attention"][0]["kernel"]["forward_backward_s"] > 0 and runs["attention"][0]["B"] == 2
    assert runs["step"][0]["kernel_s"] > 0 and runs["step"][0]["B"] == 2


def test_context_length_scores_the_same_tokens_after_each_context(tmp_path, capsys):
    """benchmarks/context_length.py on a tiny student with a window, a sink and a memory: at every L the scored
    tokens are the text's last ones, and their loss after L tokens read in pieces through the cache is the loss of
    one forward pass over the L + scored tokens (L = 0: over the scored tokens alone); --set reaches the config; a
    text too short for the lengths is refused."""
    import json

    import torch
    from test_examples import TEXT, make_tiny_folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_bench()
    context_length = importlib.import_module("context_length")
    folder = make_tiny_folder(tmp_path / "student", window_size=8, num_sink_tokens=1, memory_size=4)
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 40)
    argv = ["--model", str(folder), "--lengths", "0,37", "--scored", "520", "--piece", "16", "--text-file", str(text),
            "--json", str(tmp_path / "rows.json")]
    rows = context_length.main(argv)
    assert [(r["model"], r["context"]) for r in rows] == [(str(folder), 0), (str(folder), 37)]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = context_length.text_ids(tokenizer, 37 + 520, text_file=str(text))
    for row in rows:
        whole = ids[len(ids) - 520 - row["context"]:][None]
        with torch.no_grad():
            logits = model(input_ids=whole, use_cache=False).logits[0, -520:-1]
        loss = torch.nn.functional.cross_entropy(logits, whole[0, -519:], reduction="none")
        assert abs(row["loss"] - loss.mean().item()) < 1e-5
        assert abs(row["last_512"] - loss[-512:].mean().item()) < 1e-5
    assert json.loads((tmp_path / "rows.json").read_text())["rows"][1]["context"] == 37
    assert f"| {folder} | 37 |" in capsys.readouterr().out
    without = context_length.main(argv[:-2] + ["--set", "memory_size=0"])
    assert without[1]["loss"] != rows[1]["loss"]  # the memory switched off
    with pytest.raises(SystemExit, match="need 100,000"):
        context_length.main(["--model", str(folder), "--lengths", "99480", "--scored", "520", "--text-file", str(text)])
