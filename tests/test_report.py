# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""benchmarks/report.py end to end, on tiny sizes: the decode and kernel benchmarks run for real (so a change in
their JSON schema breaks this test), the evaluation JSON comes from conversion.evaluate on tiny random models. Checks
that the Markdown references the PNGs, that they are valid images, and that the numbers in its tables are the
JSON's."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aaren_hf  # noqa: F401  (before transformers' model code: see the note in bench_decode.py)

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "benchmarks" / "report.py"
VOCAB = 257
CONTEXTS = (64, 128, 256)
DECODE_ARGS = ("--in-process --contexts 64,128,256 --steps 3 --warmup 1 --layers 1 --hidden 64 --heads 4 "
               "--kv-heads 2 --intermediate 128 --vocab 256 --window 16 --sinks 1 --mamba-prefill 32")
KERNEL_ARGS = "--seqlens 64 128 256 --seq-max-t 128 --min-time 0.01 --threads 1"


def load_report_module():
    spec = importlib.util.spec_from_file_location("aaren_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eval_json(tmp_path_factory):
    """A real evaluate() result on a tiny random teacher/student with a byte-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from aaren_hf import AarenConfig, AarenForCausalLM
    from aaren_hf.conversion import evaluate as ev

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_id=256, pad_token_id=256,
        bos_token_id=None, attn_implementation="sdpa")).eval()
    student = AarenForCausalLM(AarenConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_query_slots=2, decay="learned", window_size=8, num_sink_tokens=1,
        chunk_size=16, eos_token_id=256, pad_token_id=256)).eval()
    windows = torch.randint(0, VOCAB, (4, 40), generator=torch.Generator().manual_seed(2))
    results = ev.evaluate(student, teacher, tokenizer, windows, sinks=1, recall_distances=(8, 32), quick=True,
                          text_source="random tokens", contexts=(4096, 32768), log=False, max_new_tokens=4)
    path = tmp_path_factory.mktemp("eval") / "evaluation.json"
    path.write_text(json.dumps(results))
    return path


@pytest.fixture(scope="module")
def report_run(tmp_path_factory, eval_json):
    """report.py in a subprocess: decode and kernel benchmarks run (tiny), evaluation JSON given."""
    out = tmp_path_factory.mktemp("report")
    cmd = [sys.executable, "-P", str(REPORT), "--out", str(out), "--eval-json", str(eval_json), "--no-cuda",
           "--decode-args", DECODE_ARGS, "--kernels-args", KERNEL_ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, (out / "REPORT.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# Markdown parsing
# ---------------------------------------------------------------------------------------------------------------


def tables(text):
    """Every Markdown table: [(header, [row dict])]."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("| ") and re.fullmatch(r"\|(---\|)+", lines[i + 1]):
            split = lambda s: [c.strip() for c in re.split(r"(?<!\\)\|", s)[1:-1]]  # noqa: E731
            header = split(lines[i])
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("| "):
                rows.append(dict(zip(header, split(lines[i]))))
                i += 1
            out.append((header, rows))
        else:
            i += 1
    return out


def table_with(text, column):
    found = [rows for header, rows in tables(text) if column in header]
    assert len(found) == 1, (column, [h for h, _ in tables(text)])
    return found[0]


UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "us": 1e-6, "ms": 1e-3, "s": 1.0, "x": 1.0, "": 1.0}


def value(cell):
    """'4.39 KiB' -> bytes, '1.04 ms' / '12.0 us' -> seconds, '241x' -> 241.0, '-' -> None."""
    cell = cell.strip()
    if cell == "-":
        return None
    m = re.fullmatch(r"(-?[0-9.]+)\s*(B|KiB|MiB|GiB|us|ms|s|x|)", cell)
    assert m, cell
    return float(m.group(1)) * UNITS[m.group(2)]


def close(cell, expected):
    """A printed number (about 3 significant digits) equals the JSON's value."""
    got = value(cell)
    if expected is None:
        return got is None
    return got is not None and abs(got - expected) <= 0.0051 * abs(expected) + 1e-12


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------


def test_header_and_images(report_run):
    from PIL import Image

    out, text = report_run
    assert text.startswith("# Aaren benchmark report")
    head = text.split("## ")[0]
    assert "Command: `" in head and "report.py" in head and "--eval-json" in head
    assert re.search(r"Date: \d{4}-\d\d-\d\d \d\d:\d\d", head)
    assert re.search(r"Machine: .*\d+ cores .*torch " + re.escape(torch.__version__), head)
    assert re.search(r"Git commit: ([0-9a-f]{40}|None)", head)

    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(images) == sorted(["memory_vs_context.png", "decode_latency.png", "perplexity.png", "recall.png",
                                     "scan_time.png"])
    for name in images:
        path = out / name
        assert path.is_file(), name
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size[0] >= 400 and im.size[1] >= 300, (name, im.size)
    for name in ("decode.json", "kernels_cpu.json", "eval.json", "decode.log", "kernels_cpu.log"):
        assert (out / "data" / name).is_file(), name
    assert "FAILED" not in text


def test_decode_numbers_match_json(report_run):
    rep = load_report_module()
    out, text = report_run
    d = json.loads((out / "data" / "decode.json").read_text())
    res = d["results"]
    assert set(res) == {"aaren", "aaren_window", "llama", "mamba"}
    label = rep.DECODE_LABELS

    memory = table_with(text, "Llama KV / Aaren")
    assert [r["context"] for r in memory] == [str(c) for c in CONTEXTS]
    for row, c in zip(memory, CONTEXTS):
        for kind in res:
            assert close(row[f"{label[kind]} bytes"], res[kind][str(c)]["cache_bytes"]), (kind, c, row)
        kv = res["llama"][str(c)]["cache_bytes"]
        for kind in ("aaren", "aaren_window", "mamba"):
            assert close(row[f"Llama KV / {label[kind]}"], kv / res[kind][str(c)]["cache_bytes"]), (kind, c)

    latency = table_with(text, f"{label['aaren']} ms")
    for row, c in zip(latency, CONTEXTS):
        for kind in res:
            r = res[kind][str(c)]
            m = re.fullmatch(r"(\S+) \((\S+)-(\S+)\)", row[f"{label[kind]} ms"])
            assert m, row
            assert close(m.group(1), r["latency_ms"]) and close(m.group(2), r["latency_ms_p25"])
            assert close(m.group(3), r["latency_ms_p75"])

    checks = {r["check"]: r for r in table_with(text, "wanted")}
    assert len(checks) == len(d["checks"])
    for c in d["checks"]:
        assert close(checks[c["name"]]["value"], c["value"]), c["name"]
        assert checks[c["name"]]["result"] == ("PASS" if c["pass"] else "FAIL")

    growth = {r["model"]: r for r in table_with(text, "latency ratio")}
    for kind, r in d["ratios"].items():
        assert close(growth[label[kind]]["latency ratio"], r["latency_hi_over_lo"])
        assert close(growth[label[kind]]["bytes ratio"], r["bytes_hi_over_lo"])


def test_kernel_numbers_match_json(report_run):
    out, text = report_run
    k = json.loads((out / "data" / "kernels_cpu.json").read_text())
    rows = {r["T"]: r for r in table_with(text, "chunked (PyTorch)")}
    assert sorted(int(t) for t in rows) == [r["T"] for r in k["cpu_forward"]] == list(CONTEXTS)
    for r in k["cpu_forward"]:
        row = rows[str(r["T"])]
        assert close(row["chunked (PyTorch)"], r["chunk_torch_s"])
        assert close(row["sequential loop"], r["sequential_torch_s"])
        assert close(row["causal SDPA"], r["sdpa_causal_s"])
        assert close(row["loop / chunked"], r["seq_over_chunk"])
        assert close(row["SDPA / chunked"], r["sdpa_over_chunk"])
    assert rows["256"]["sequential loop"] == "-"  # beyond --seq-max-t


def test_eval_numbers_match_json(report_run, eval_json):
    out, text = report_run
    ev = json.loads((out / "data" / "eval.json").read_text())
    assert ev == json.loads(eval_json.read_text())
    lr = ev["perplexity"][0]["ppl"]["from_position"]
    ppl = {r["model"]: r for r in table_with(text, "ratio to teacher")}
    assert len(ppl) == len(ev["perplexity"]) == 3
    for m in ev["perplexity"]:
        row = ppl[m["name"]]
        assert close(row["perplexity"], m["ppl"]["ppl"])
        assert close(row["ratio to teacher"], m["ratio_to_teacher"])
        assert close(row[f"perplexity at positions >= {lr}"], m["ppl"]["ppl_from_position"])
        assert close(row["state / KV bytes"].split(" (")[0], m["memory_bytes"])

    recall = table_with(text, "key to answer")
    assert [int(r["distance"]) for r in recall] == [r["distance"] for r in ev["recall"][0]["results"]]
    for probe in ev["recall"]:
        for row, r in zip(recall, probe["results"]):
            m = re.fullmatch(r"(\S+) \((\S+)\)", row[probe["name"].replace("|", "\\|")])
            assert m and close(m.group(1), r["accuracy"]) and close(m.group(2), r["token_accuracy"]), (probe, row)

    mem = table_with(text, "teacher / student")
    assert len(mem) == len(ev["memory"]["rows"])
    for row, r in zip(mem, ev["memory"]["rows"]):
        assert close(row["teacher KV cache"], r["teacher_kv_bytes"])
        assert close(row["student state"], r["student_state_bytes"])
        assert close(row["teacher / student"], r["teacher_over_student"])


def test_no_checkpoint_is_a_note(tmp_path, monkeypatch):
    rep = load_report_module()
    monkeypatch.setattr(rep, "DEFAULT_MODEL", tmp_path / "no-such-model")
    assert rep.main(["--out", str(tmp_path / "out"), "--skip-decode", "--skip-kernels"]) == 0
    text = (tmp_path / "out" / "REPORT.md").read_text()
    assert "no converted checkpoint at" in text and "skipped (--skip-decode)" in text
    assert "![" not in text and not list((tmp_path / "out").glob("*.png"))
    with pytest.raises(SystemExit):
        rep.parse_args(["--model", str(tmp_path / "no-such-model")])


def cuda_fixture():
    """bench_kernels.py --device cuda output, written by hand (no GPU here): the keys bench_cuda() records."""
    rows = []
    for T, modes in ((1024, ("fwd", "fwd+bwd")), (4096, ("fwd", "fwd+bwd")), (131072, ("fwd",))):
        for mode in modes:
            scale = (3.0 if mode == "fwd+bwd" else 1.0) * T / 1024
            tt, sd = 1e-5 * scale, 2e-5 * scale * T / 1024
            rows.append(dict(device="NVIDIA H200", mode=mode, T=T, B=1, H=16, D=128, triton_s=tt,
                             torch_s=None if T > 65536 else 4 * tt, sdpa_s=sd, triton_gbs=1000.0 + T / 100,
                             triton_tflops=12.5, sdpa_tflops=400.0, triton_pct_bw=20.8, sdpa_pct_peak=40.4))
    return dict(args={"device": "cuda", "seqlens": None, "chunk_size": 64}, torch=torch.__version__, cpu_forward=[],
                cuda=rows, decode=[dict(batch=b, H=16, D=128, triton_s=5e-6, torch_s=4e-5) for b in (1, 64)],
                device_name="NVIDIA H200", peak_tflops=989.0, peak_gbs=4800.0)


def test_cuda_kernel_section(tmp_path):
    from PIL import Image

    rep = load_report_module()
    k = cuda_fixture()
    src = tmp_path / "kernels_cuda.json"
    src.write_text(json.dumps(k))
    out = tmp_path / "out"
    assert rep.main(["--out", str(out), "--skip-decode", "--skip-eval", "--kernels-json", str(src)]) == 0
    text = (out / "REPORT.md").read_text()
    assert re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text) == ["scan_time.png"]
    with Image.open(out / "scan_time.png") as im:
        assert im.format == "PNG"
    rows = table_with(text, "Triton TFLOP/s")
    assert [(int(r["T"]), r["pass"]) for r in rows] == [(r["T"], r["mode"]) for r in k["cuda"]]
    for row, r in zip(rows, k["cuda"]):
        assert close(row["Triton"], r["triton_s"]) and close(row["SDPA (flash)"], r["sdpa_s"])
        assert close(row["PyTorch chunked"], r["torch_s"])
        assert close(row["Triton TFLOP/s"], r["triton_tflops"])
    decode = table_with(text, "Triton step")
    assert [int(r["batch"]) for r in decode] == [1, 64]
