# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Conversion pipeline on a tiny random Llama teacher and tiny text made here (no assets, no network):
init, stage 1, stage 2, trainable sets, the full conversion and its output folder, the CLI."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Import the package before any transformers model module: with the repository root on sys.path, its top-level
# `kernels/` folder is taken by transformers for the optional hub `kernels` package, and importing it first
# (through aaren_hf) avoids a circular import inside transformers.
import aaren_hf  # noqa: F401
from helpers import SUITE_CACHE, cache_at, fresh_cache, one_thread  # noqa: F401  (one_thread: autouse fixture)

ROOT = Path(__file__).resolve().parents[1]

WORDS = [f"w{i}" for i in range(60)]


# ----------------------------------------------------------------------------------------------------------------
# Helpers shared with test_resume.py and test_distributed.py
# ----------------------------------------------------------------------------------------------------------------


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<pad>"] + WORDS + [str(d) for d in range(10)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def make_tiny_teacher(folder: Path, layers: int = 2, seed: int = 0) -> Path:
    """A random Llama (GQA: 4 query heads, 2 key/value heads) with weights large enough for peaked attention
    and logits, saved with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_corpus(folder: Path, documents: int = 30, seed: int = 0) -> Path:
    """Documents of word sequences with local structure (a noisy counter), one .txt file each."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for d in range(documents):
        start, n = rng.randrange(len(WORDS)), rng.randint(150, 300)
        text = " ".join(WORDS[(start + 3 * i + rng.choice((0, 0, 0, 1))) % len(WORDS)] for i in range(n))
        (folder / f"doc{d:03d}.txt").write_text(text)
    return folder


def tiny_options(teacher, data, output, **overrides):
    """Options of a tiny conversion; :func:`cli_args` gives the same run on the command line."""
    from aaren_hf.conversion.convert import ConvertOptions, apply_overrides
    from aaren_hf.conversion.stage1 import Stage1Options
    from aaren_hf.conversion.stage2 import Stage2Options

    opts = ConvertOptions(
        teacher=str(teacher), output=str(output), data=(str(data),), seq_len=48, train_windows=16, heldout_windows=4,
        mixer={"num_query_slots": 2, "decay": "learned", "window_size": 8, "num_sink_tokens": 1,
               "window_gate": "head"},
        init_windows=2, long_seq_len=96,
        stage1=Stage1Options(steps=4, lr=3e-3, batch_size=2, windows=8, checkpoint_every=2),
        stage2=Stage2Options(steps=4, lr=2e-3, batch_size=2, checkpoint_every=2),
        eval=False, progress=False,
    )
    return apply_overrides(opts, **overrides)


def cli_env(cache: Path) -> dict:
    env = dict(os.environ)
    env["AAREN_HF_CACHE"] = str(fresh_cache(cache))
    env["HF_HUB_OFFLINE"] = "1"
    # as `python -P`: the repository root on sys.path would make kernels/ a top-level `kernels` (docs/layout.md)
    env["PYTHONSAFEPATH"] = "1"
    return env


def cli_args(teacher, data, output) -> list[str]:
    """The command-line twin of :func:`tiny_options`."""
    return ["--teacher", str(teacher), "--data", str(data), "--output", str(output), "--seq-len", "48",
            "--train-windows", "16", "--heldout-windows", "4", "--init-windows", "2", "--num-query-slots", "2",
            "--decay", "learned", "--window-size", "8", "--num-sink-tokens", "1", "--memory-size", "0",
            "--kv-cache-dtype", "model",
            "--long-seq-len", "96", "--stage1-steps", "4",
            "--stage1-lr", "3e-3", "--stage1-windows", "8", "--stage1-batch-size", "2", "--stage2-steps", "4",
            "--lr", "2e-3", "--batch-size", "2", "--checkpoint-every", "2", "--no-eval", "--no-progress"]


def read_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(Path(folder) / "model.safetensors")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(teacher folder, data folder); the token cache goes to a temporary AAREN_HF_CACHE (restored after this
    module, so other test files see the real cache)."""
    root = tmp_path_factory.mktemp("tiny")
    with cache_at(root / "cache"):
        yield make_tiny_teacher(root / "teacher"), make_corpus(root / "data")


@pytest.fixture(scope="module")
def parts(tiny):
    """Teacher, tokenizer, windows and an initialised student (shared; tests copy before training)."""
    from aaren_hf.conversion.convert import build_student, load_teacher
    from aaren_hf.conversion.data import load_token_windows
    from aaren_hf.conversion.init import initialize_student

    teacher_dir, data = tiny
    tokenizer, teacher = load_teacher(str(teacher_dir))
    windows = load_token_windows(tokenizer, str(data), seq_len=48, num_heldout=4, seed=0)
    mixer = {"num_query_slots": 2, "decay": "learned", "window_size": 8, "num_sink_tokens": 1}
    student = build_student(teacher, mixer)
    report = initialize_student(student, teacher, windows.train[:2], seed=0)
    return {"teacher": teacher, "tokenizer": tokenizer, "train": windows.train, "heldout": windows.heldout,
            "student": student, "report": report, "mixer": mixer}


def fresh_student(parts):
    import copy

    return copy.deepcopy(parts["student"])


# ----------------------------------------------------------------------------------------------------------------
# Initialisation
# ----------------------------------------------------------------------------------------------------------------


def test_kmeans_is_seeded_and_finds_clusters():
    from aaren_hf.conversion.init import kmeans

    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[5.0, 0.0], [-5.0, 0.0], [0.0, 5.0]])
    points = torch.cat([c + 0.1 * torch.randn(50, 2, generator=g) for c in centres])
    c1, a1 = kmeans(points, 3, iterations=5, seed=3)
    c2, a2 = kmeans(points, 3, iterations=5, seed=3)
    assert torch.equal(c1, c2) and torch.equal(a1, a2)
    found = sorted(c1.tolist())
    assert all(min(torch.dist(torch.tensor(f), c).item() for c in centres) < 0.2 for f in found)


def test_init_sets_new_parameters_from_teacher_statistics(parts):
    student, report = parts["student"], parts["report"]
    cfg = student.config
    for layer, entry in zip(student.model.layers, report["layers"]):
        mixer = layer.mixer
        assert torch.isfinite(mixer.queries).all() and mixer.queries.abs().sum() > 0
        rates = mixer.log_decay.exp()
        # slots spread around the head's rate ~ 1 / mean distance, the same ordering of heads
        head_rate = torch.tensor(entry["decay_rate"])
        assert torch.allclose(rates.prod(-1).pow(1 / cfg.num_query_slots), head_rate, rtol=1e-3)
        assert torch.equal(head_rate.argsort(), (1 / torch.tensor(entry["mean_distance"])).argsort())
        share = torch.sigmoid(mixer.window_gate)
        assert torch.allclose(share, torch.tensor(entry["window_share"]), atol=2e-3)
        assert ((share >= 0.05 - 1e-6) & (share <= 0.95 + 1e-6)).all()
        # rotary frequencies come from the teacher
        assert torch.allclose(mixer.rope_inv_freq, parts["teacher"].model.rotary_emb.inv_freq.float())


def test_init_queries_match_teacher_query_scale(parts):
    from aaren_hf.conversion.adapters import teacher_layers, teacher_qkv

    teacher = parts["teacher"]
    x = teacher.model.embed_tokens(parts["train"][:2])
    layer = teacher_layers(teacher)[0]
    q, _, _ = teacher_qkv(layer, layer.input_norm(x))
    rms = q.detach().norm(dim=-1).pow(2).mean().sqrt()
    norms = parts["student"].model.layers[0].mixer.queries.norm(dim=-1)
    assert 0.3 * rms < norms.mean() < 1.5 * rms


# ----------------------------------------------------------------------------------------------------------------
# Stage 1
# ----------------------------------------------------------------------------------------------------------------


def test_stage1_lowers_layer_loss(parts):
    from aaren_hf.conversion.stage1 import Stage1Options, capture_attention, fvu, train_mixer

    student, teacher = fresh_student(parts), parts["teacher"]
    acts = capture_attention(teacher, parts["train"][:8], [0, 1])
    held = capture_attention(teacher, parts["heldout"][:2], [0, 1])
    opts = Stage1Options(steps=25, lr=3e-3, batch_size=2, warmup=2)
    for i in (0, 1):
        mixer = student.model.layers[i].mixer
        ho = tuple(t.float() for t in held[i])
        record = train_mixer(mixer, *acts[i], opts, seed=0, layer=i, heldout=ho)
        assert record["train_loss_last"] < record["train_loss_first"]
        assert record["heldout_fvu_after"] < record["heldout_fvu_before"]
        assert abs(fvu(mixer, *ho) - record["heldout_fvu_after"]) < 1e-9


def test_capture_matches_teacher_attention_output(parts):
    """The hooks store exactly what the attention module receives and returns: x = input_norm(h) and
    h + y + mlp(post_norm(h + y)) is the layer's output."""
    from aaren_hf.conversion.adapters import teacher_layers
    from aaren_hf.conversion.stage1 import capture_attention

    teacher = parts["teacher"]
    ids = parts["train"][:2]
    x, y = capture_attention(teacher, ids, [0], dtype=torch.float32)[0]
    layer = teacher_layers(teacher)[0]
    with torch.no_grad():
        hidden = teacher(input_ids=ids, output_hidden_states=True).hidden_states
        h = hidden[0]
        assert torch.allclose(layer.input_norm(h), x, atol=1e-5)
        r = h + y
        assert torch.allclose(r + layer.mlp(layer.post_attention_norm(r)), hidden[1], atol=1e-4)


def test_capture_spills_to_disk_when_memory_is_short(parts, tmp_path):
    from aaren_hf.conversion.stage1 import capture_attention

    ids = parts["train"][:3]
    in_ram = capture_attention(parts["teacher"], ids, [0, 1])
    on_disk = capture_attention(parts["teacher"], ids, [0, 1], spill_dir=tmp_path, memory_fraction=0.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x000.bin", "x001.bin", "y000.bin", "y001.bin"]
    for i in (0, 1):
        assert torch.equal(in_ram[i][0], on_disk[i][0]) and torch.equal(in_ram[i][1], on_disk[i][1])


def test_frozen_teacher_weights_option(parts):
    from aaren_hf.conversion.stage1 import mixer_trainable_parameters

    mixer = fresh_student(parts).model.layers[0].mixer
    new, inherited = mixer_trainable_parameters(mixer, train_teacher_weights=False)
    trainable = {n for n, p in mixer.named_parameters() if p.requires_grad}
    assert trainable == {"queries", "log_decay", "window_gate"} and not inherited


# ----------------------------------------------------------------------------------------------------------------
# Stage 2
# ----------------------------------------------------------------------------------------------------------------


def test_stage2_lowers_kl(parts, tmp_path):
    from aaren_hf.conversion.stage2 import Stage2Options, heldout_kl, run_stage2

    student, teacher = fresh_student(parts), parts["teacher"]
    train, heldout = parts["train"], parts["heldout"]
    before = heldout_kl(student, teacher, heldout)
    opts = Stage2Options(steps=12, lr=3e-3, batch_size=2, warmup=2, eval_windows=4, checkpoint_every=0)
    student, summary = run_stage2(student, teacher, train, heldout, opts, seed=0, work_dir=tmp_path)
    assert summary["heldout_kl_before"] == pytest.approx(before)
    assert summary["heldout_kl_after"] < 0.8 * before
    assert summary["train_loss_last"] < summary["train_loss_first"]


@pytest.mark.parametrize("trainable", ["all", "mixer", "lora"])
def test_trainable_set_selection(parts, trainable):
    from aaren_hf.conversion.stage2 import finish_trainable, select_trainable

    student = fresh_student(parts)
    reference = {n: p.detach().clone() for n, p in student.named_parameters()}
    model = select_trainable(student, trainable, lora_r=4)
    on = {n for n, p in model.named_parameters() if p.requires_grad}
    names = [n for n, _ in model.named_parameters()]
    if trainable == "all":
        assert on == set(names)
    elif trainable == "mixer":
        assert on == {n for n in names if ".mixer." in n}
        assert "model.embed_tokens.weight" not in on and not any(".mlp." in n for n in on)
    else:
        assert on, "nothing trainable"
        lora = {n for n in on if "lora_" in n}
        rest = on - lora
        targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora}
        assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        assert rest and all(n.endswith(("queries", "log_decay", "window_gate")) for n in rest)
        assert not any("base_layer" in n for n in on)
        # one step moves only those; merging returns a plain Aaren model with the same parameter names
        x = parts["train"][:1]
        model(input_ids=x).logits.float().pow(2).mean().backward()
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
    merged = finish_trainable(model)
    assert type(merged).__name__ == "AarenForCausalLM"
    assert {n for n, _ in merged.named_parameters()} == set(reference)
    if trainable == "lora":
        changed = {n for n, p in merged.named_parameters() if not torch.equal(p, reference[n])}
        assert changed and not any("embed_tokens" in n or "norm" in n for n in changed)


def test_fixed_decay_stays_frozen(parts):
    from aaren_hf.conversion.convert import build_student
    from aaren_hf.conversion.stage2 import select_trainable

    student = build_student(parts["teacher"], {**parts["mixer"], "decay": "fixed"})
    for trainable in ("all", "mixer"):
        select_trainable(student, trainable)
        assert not any(p.requires_grad for n, p in student.named_parameters() if n.endswith("log_decay"))


# ----------------------------------------------------------------------------------------------------------------
# Full conversion
# ----------------------------------------------------------------------------------------------------------------


def test_full_conversion_output_loads_and_generates(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aaren_hf.conversion.convert import convert

    teacher, data = tiny
    out = tmp_path / "student"
    opts = tiny_options(teacher, data, out, eval=True, eval_quick=True, recall_distances=(16, 64), recall_trials=1)
    assert convert(opts) == out
    files = {p.name for p in out.iterdir()}
    for name in ("config.json", "model.safetensors", "modeling_aaren.py", "configuration_aaren.py",
                 "tokenizer.json", "generation_config.json", "README.md", "conversion.json", "conversion.log",
                 "evaluation.json"):
        assert name in files, name
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in files)
    assert not (tmp_path / "student.work").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "aaren" and "AutoModelForCausalLM" in config["auto_map"]
    record = json.loads((out / "conversion.json").read_text())
    assert record["stage1"]["mean_heldout_fvu_after"] is not None and record["stage2"]["heldout_kl_after"] is not None
    results = json.loads((out / "evaluation.json").read_text())
    names = [m["kind"] for m in results["perplexity"]]
    assert names[:2] == ["teacher", "student"] and "baseline" in names
    assert "stage 1" in (out / "conversion.log").read_text()
    assert "## Evaluation" in (out / "README.md").read_text()

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "AarenForCausalLM"
    ids = tokenizer("w1 w4 w7", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 5

    # the output exists now: a second run without --overwrite refuses
    from aaren_hf.conversion.convert import ConversionError

    with pytest.raises(ConversionError, match="already exists"):
        convert(tiny_options(teacher, data, out))


def test_cli_eval_subcommand(tiny, tmp_path, capsys):
    """`aaren-convert eval` finds teacher, data and held-out split in the model's conversion.json."""
    from aaren_hf.conversion.convert import convert

    teacher, data = tiny
    out = tmp_path / "student"
    convert(tiny_options(teacher, data, out, stage1={"steps": 1}, stage2={"steps": 1}))
    code, text, err = run_cli(["eval", "--model", str(out), "--quick", "--recall-distances", "16",
                               "--json", str(tmp_path / "eval.json")], capsys)
    assert code == 0, err
    assert "### Perplexity" in text and "student (Aaren)" in text
    results = json.loads((tmp_path / "eval.json").read_text())
    assert results["setup"]["window_length"] == 48
    code, _, err = run_cli(["eval", "--model", str(tmp_path / "missing")], capsys)
    assert code == 2 and "not a model folder" in err
    record = (out / "conversion.json").read_text()
    (out / "conversion.json").write_text(record[: len(record) // 2])  # truncated: a clear error, not a traceback
    code, _, err = run_cli(["eval", "--model", str(out), "--quick"], capsys)
    assert code == 2 and "conversion.json cannot be read" in err and "Traceback" not in err


def test_bench_model_times_a_converted_folder_against_its_own_teacher(tiny, tmp_path, capsys):
    """benchmarks/bench_model.py --student DIR: the folder's trained weights against the teacher its conversion.json
    names (the same one `aaren-convert eval` finds); refused with --real or a folder that is not a model."""
    from transformers import AutoModelForCausalLM

    from aaren_hf.conversion.convert import teacher_of
    from aaren_hf.conversion.convert import ConversionError, convert
    from test_bench_model import load_bench

    teacher, data = tiny
    out = tmp_path / "student"
    convert(tiny_options(teacher, data, out, stage1={"steps": 1}, stage2={"steps": 1}))
    assert teacher_of(out) == str(Path(teacher).resolve())
    with pytest.raises(ConversionError, match="no conversion.json"):
        teacher_of(tmp_path)
    bench = load_bench()
    bench.main(["--student", str(out), "--device", "cpu", "--train", "none", "--prompts", "24", "--generate", "1x24",
                "--steps", "2", "--repeats", "1", "--json", str(tmp_path / "bench.json")])
    assert str(out) in capsys.readouterr().out
    report = json.loads((tmp_path / "bench.json").read_text())
    student = AutoModelForCausalLM.from_pretrained(out)
    assert report["models"]["aaren"]["params"] == sum(p.numel() for p in student.parameters())
    assert report["models"]["teacher"]["params"] == sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(teacher).parameters())
    assert [r["work"] for r in report["rows"]] == ["prefill", "generate"]
    for argv in (["--student", str(out), "--real"], ["--student", str(tmp_path / "missing")]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv + ["--device", "cpu"])


def test_cli_eval_reads_only_documents_the_conversion_held_out(tiny, tmp_path, capsys):
    """On the conversion's own data a longer --seq-len gets fewer windows from the same held-out documents (never
    more documents); other data is cut by --heldout-windows alone; a partly trained-on mix or another seed is
    refused."""
    import argparse

    from aaren_hf.conversion.cli import _heldout_split
    from aaren_hf.conversion.convert import convert, load_teacher
    from aaren_hf.conversion.data import load_token_windows

    teacher, data = tiny
    out = tmp_path / "student"
    convert(tiny_options(teacher, data, out, stage1={"steps": 1}, stage2={"steps": 1}))  # 4 held out x 48 tokens
    recorded = json.loads((out / "conversion.json").read_text())["options"]
    parser = argparse.ArgumentParser()
    trained = [str(data)]
    assert _heldout_split(parser, recorded, trained, trained, 96, 2, 0) == 2
    assert _heldout_split(parser, recorded, trained, trained, 24, 3, 0) == 8
    assert _heldout_split(parser, recorded, ["elsewhere"], trained, 96, 5, 0) == 5
    tokenizer, _ = load_teacher(str(teacher))
    held = set(load_token_windows(tokenizer, trained, seq_len=48, num_heldout=4).heldout_documents)
    for seq_len in (24, 96):
        split = _heldout_split(parser, recorded, trained, trained, seq_len, 1, 0)
        assert set(load_token_windows(tokenizer, trained, seq_len=seq_len, num_heldout=split).heldout_documents) <= held
    other = make_corpus(tmp_path / "other", seed=5)
    for args, message in ((["--seq-len", "96", "--heldout-windows", "3"], "at most 2 windows of 96"),
                          (["--seed", "1"], "differs from the conversion's"),
                          (["--data", str(data), "--data", str(other)], "shares sources")):
        code, _, err = run_cli(["eval", "--model", str(out), "--quick", *args], capsys)
        assert code == 2 and message in err, err
    code, _, err = run_cli(["eval", "--model", str(out), "--quick", "--seq-len", "96", "--heldout-windows", "2",
                            "--recall-distances", "16", "--json", str(tmp_path / "eval.json")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "eval.json").read_text())["setup"]["window_length"] == 96


def test_unsupported_teacher_type(tmp_path):
    from transformers import BertConfig

    from aaren_hf.conversion.adapters import SUPPORTED_TEACHERS
    from aaren_hf.conversion.convert import ConversionError, check_teacher_type

    folder = tmp_path / "bert"
    BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(folder)
    with pytest.raises(ConversionError) as info:
        check_teacher_type(str(folder))
    message = str(info.value)
    assert "'bert'" in message and all(t in message for t in SUPPORTED_TEACHERS)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def run_cli(args, capsys):
    from aaren_hf.conversion.cli import main

    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_help(capsys):
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    for text in ("--recipe", "--teacher", "--resume", "--trainable", "examples:", "aaren-convert recipes",
                 "torchrun --standalone --nproc_per_node 2"):
        assert text in out
    code, out, _ = run_cli(["eval", "--help"], capsys)
    assert code == 0 and "--model" in out
    code, out, _ = run_cli(["recipes"], capsys)
    assert code == 0 and "smollm2-135m" in out


def test_console_script_entry_point(tmp_path):
    """setup.cfg declares aaren-convert = aaren_hf.conversion.cli:main; the module runs with -m too."""
    result = subprocess.run([sys.executable, "-m", "aaren_hf.conversion.cli", "--help"], capture_output=True,
                            text=True, env=cli_env(tmp_path / "cache"), timeout=120)
    assert result.returncode == 0 and "usage: aaren-convert" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--teacher", "x", "--seq-len", "0"], "--seq-len: must be an integer between 16 and"),
    (["--teacher", "x", "--stage1-lr", "-1"], "--stage1-lr: must be a number > 0"),
    (["--teacher", "x", "--trainable", "everything"], "invalid choice: 'everything'"),
    (["--teacher", "./no/such/folder"], "does not exist"),
    (["--teacher", "x", "--num-sink-tokens", "2", "--window-size", "0"], "needs the window branch"),
    (["--teacher", "x", "--memory-shared-layer", "six"], "expected a layer index (0, 1, ...) or 'none'"),
    (["--teacher", "x", "--batch-size", "3", "--micro-batch-size", "2"], "multiple of --micro-batch-size"),
    (["--recipe", "nope"], "unknown recipe 'nope'"),
    ([], "give --recipe NAME"),
    (["--teacher", "x", "--resume", "--overwrite"], "give one of them"),
    (["--teacher", "x", "--data", "./missing.txt"], "no such file or folder"),
    (["--recipe", "smollm2-135m", "--memory-size", "0", "--memory-shared-layer", "6"], "--memory-shared-layer none"),
    (["--recipe", "smollm2-135m", "--window-size", "0", "--num-sink-tokens", "1"], "or --num-sink-tokens 0"),
])
def test_cli_bad_arguments(args, message, capsys):
    code, _, err = run_cli(args, capsys)
    assert code == 2
    assert message in err


def test_cli_kv_cache_dtype():
    """The recipe stores window/memory keys/values in bfloat16; --kv-cache-dtype model keeps the model's dtype."""
    from aaren_hf.conversion.cli import convert_parser, options_from_args

    parser = convert_parser()
    for flag, want in ((None, "bfloat16"), ("model", None), ("float16", "float16")):
        argv = ["--recipe", "smollm2-135m"] + (["--kv-cache-dtype", flag] if flag else [])
        assert options_from_args(parser.parse_args(argv), parser).mixer["kv_cache_dtype"] == want
    with pytest.raises(SystemExit):
        parser.parse_args(["--recipe", "smollm2-135m", "--kv-cache-dtype", "int8"])


def test_cli_memory_recency():
    """--memory-recency reaches the mixer (0 too, which switches the teacher-derived default off); unset, the recipe
    leaves it to the teacher's context; negative or not a number is refused."""
    from aaren_hf.conversion.cli import convert_parser, options_from_args

    parser = convert_parser()
    for extra, want in (([], None), (["--memory-recency", "0.001"], 0.001), (["--memory-recency", "0"], 0.0)):
        mixer = options_from_args(parser.parse_args(["--recipe", "smollm2-135m", *extra]), parser).mixer
        assert mixer.get("memory_recency") == want, extra
    for bad in ("-0.1", "nan", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--recipe", "smollm2-135m", "--memory-recency", bad])


def test_cli_memory_bits():
    """The recipe keeps the memory as 4-bit codes; --memory-bits 8 widens them, 16 stores them like the window; a
    model without a memory ignores the setting."""
    from aaren_hf.conversion.cli import convert_parser, options_from_args

    parser = convert_parser()
    for flag, want in ((None, 4), ("8", 8), ("16", None)):
        argv = ["--recipe", "smollm2-135m"] + (["--memory-bits", flag] if flag else [])
        assert options_from_args(parser.parse_args(argv), parser).mixer["memory_bits"] == want
    with pytest.raises(SystemExit):
        parser.parse_args(["--recipe", "smollm2-135m", "--memory-bits", "2"])
    # Hadamard-rotated codes: the recipe's with its 4-bit codes, where they pay; other bits bring their own default
    # (off at 8 unless asked); refused without codes
    for extra, want in (([], True), (["--memory-bits", "8"], False), (["--memory-bits", "8", "--memory-hadamard", "on"],
                        True), (["--memory-bits", "4", "--memory-hadamard", "off"], False),
                        (["--memory-hadamard", "off"], False), (["--memory-bits", "16"], False)):
        mixer = options_from_args(parser.parse_args(["--recipe", "smollm2-135m", *extra]), parser).mixer
        assert mixer.get("memory_hadamard") == want, extra
    with pytest.raises(SystemExit):
        options_from_args(parser.parse_args(["--recipe", "smollm2-135m", "--memory-bits", "16", "--memory-hadamard",
                                             "on"]), parser)
    from helpers import tiny_model

    plain, coded = tiny_model(window_size=3), tiny_model(window_size=3, memory_bits=8)
    ids = torch.randint(1, 60, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, coded(ids).logits)


def test_cli_turning_a_tier_off_takes_the_recipes_settings_that_live_in_it():
    """A window of 0 takes the recipe's sinks and memory with it, a memory of 0 its sharing across layers; flags the
    user gives still win (and conflict: test_cli_bad_arguments)."""
    from aaren_hf.conversion.cli import convert_parser, options_from_args

    parser = convert_parser()

    def mixer(*flags):
        return options_from_args(parser.parse_args(["--recipe", "smollm2-135m", *flags]), parser).mixer

    recipe = mixer()
    assert recipe["memory_size"] > 0 and recipe["num_sink_tokens"] > 0 and recipe["memory_shared_layer"] is not None
    off = mixer("--window-size", "0")
    assert [off[k] for k in ("window_size", "num_sink_tokens", "memory_size", "memory_shared_layer")] == [0, 0, 0, None]
    no_memory = mixer("--memory-size", "0")
    assert no_memory["memory_shared_layer"] is None and no_memory["num_sink_tokens"] == recipe["num_sink_tokens"]
    assert mixer("--memory-size", "256")["memory_shared_layer"] == recipe["memory_shared_layer"]


def readme_convert_commands() -> list:
    """The arguments of every `aaren-convert --recipe ...` line in the README's code blocks: what users copy."""
    text = (ROOT / "README.md").read_text()
    return [shlex.split(match.group(1)) for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for match in re.finditer(r"aaren-convert (--recipe [^#&\n]*)", block)]


README_CONVERT_COMMANDS = readme_convert_commands()


@pytest.mark.parametrize("argv", README_CONVERT_COMMANDS, ids=" ".join)
def test_readme_convert_commands_pass_the_checks_a_run_starts_with(argv, monkeypatch):
    """Each conversion the README shows gets past what a run checks before it reads data: the flags, then the
    student's config against its teacher's (the README's `--memory-size 0` once failed there, on the recipe's shared
    memory layer, after the teacher had loaded)."""
    from aaren_hf.conversion.assets import AssetError
    from aaren_hf.conversion.cli import convert_parser, options_from_args
    from aaren_hf.conversion.convert import check_positions, check_teacher_type, resolve_teacher

    assert len(README_CONVERT_COMMANDS) >= 7, README_CONVERT_COMMANDS  # the pattern still finds the README's list
    monkeypatch.setenv("AAREN_HF_CACHE", str(SUITE_CACHE))  # the packaged teacher as set up, not unpacked anew
    parser = convert_parser()
    opts = options_from_args(parser.parse_args(argv), parser)
    try:
        teacher = resolve_teacher(opts.teacher, opts.recipe)
    except AssetError as error:  # an opt-in teacher not set up on this machine
        pytest.skip(str(error))
    if not Path(teacher).is_dir():
        pytest.skip(f"the {opts.recipe} recipe's teacher is not on this machine ({teacher}; its config needs the hub)")
    check_positions(check_teacher_type(teacher), opts)


def test_ablation_script_converts_a_row_and_tabulates_it(tiny, tmp_path):
    """benchmarks/ablation.py end to end on the tiny teacher, its row without a window: the row's flags pass the
    converter's checks on the recipe (whose sinks and memory live in the window), the script's claim on the row is not
    the converter's own lock on the row's output, the table's setup reaches the converter, and the table lists the
    row as it ran, its weights deleted and its claim released."""
    teacher, data = tiny
    out = tmp_path / "ablation"
    cmd = [sys.executable, "-P", str(ROOT / "benchmarks" / "ablation.py"), "--out-dir", str(out), "--rows", "paper",
           "--stage1-steps", "1", "--eval-windows", "1", "--recall-trials", "1", "--", "--teacher", str(teacher),
           "--data", str(data), "--seq-len", "48", "--train-windows", "16", "--heldout-windows", "4",
           "--init-windows", "2", "--long-seq-len", "96", "--stage1-windows", "8", "--quick-eval"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=cli_env(tmp_path / "cache"))
    log = out / "paper.log"
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    mixer = json.loads((out / "paper" / "conversion.json").read_text())["options"]["mixer"]
    assert (mixer["window_size"], mixer["num_sink_tokens"], mixer["memory_size"], mixer["kv_cache_dtype"]) == (
        0, 0, 0, None)
    assert "| paper | 1 | none | 0 | 0 |" in (out / "ABLATION.md").read_text()
    assert not list((out / "paper").glob("*.safetensors")) and not list(out.glob("*.claim"))


def test_cli_errors_say_what_to_do(tiny, tmp_path, capsys):
    teacher, data = tiny
    code, _, err = run_cli(["--teacher", str(teacher), "--data", str(data), "--output", str(tmp_path / "o"),
                            "--resume"], capsys)
    assert code == 1 and "no interrupted conversion to resume" in err and "run without --resume" in err
    folder = tmp_path / "bert"
    from transformers import BertConfig

    BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(folder)
    code, _, err = run_cli(["--teacher", str(folder), "--output", str(tmp_path / "b")], capsys)
    assert code == 1 and "not supported" in err and "llama" in err


def test_progress_rate_counts_from_the_end_of_the_first_step(monkeypatch):
    """The first step's tokens over ~0 s made stage 2 print tok/s=296204641; the rate now starts after it."""
    import time as time_module

    from aaren_hf.conversion import train_state as ts

    now = [100.0]
    monkeypatch.setattr(time_module, "time", lambda: now[0])
    bar = ts.Progress(3, "test", enabled=True)
    for _ in range(3):
        bar.update(1, 0.5, tokens=1000)
        now[0] += 2.0
    assert bar.bar.postfix == "loss=0.5000, tok/s=500"  # 2,000 tokens in the 4 s after the first step ended
    bar.close()
