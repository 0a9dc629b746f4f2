# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The converter never destroys a user's files, and every expected failure is one clear line (issue 9).

Tiny random teachers and text made here; every refusal happens before any training, so most tests take well under
a second. docs/RELIABILITY.md lists each bad input with the test that covers it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aaren_hf  # noqa: F401  (before transformers: see tests/helpers.py)
from helpers import one_thread  # noqa: F401  (autouse fixture)
from test_conversion import cli_args, make_tiny_teacher, make_tokenizer, run_cli, tiny  # noqa: F401  (fixture)
from test_conversion import tiny_options

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def mine(tiny, tmp_path):
    """Copies of the teacher and the data that a test may change or delete."""
    teacher, data = tiny
    return Path(shutil.copytree(teacher, tmp_path / "teacher")), Path(shutil.copytree(data, tmp_path / "data"))


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(output: Path) -> list[str]:
    """What a failed run left next to its output: the folder, its work folder, its lock."""
    names = (output.name, f"{output.name}.work", f"{output.name}.lock")
    return sorted(p.name for p in output.parent.iterdir() if p.name in names or p.name.startswith(f".{output.name}"))


def expect_one_line_error(args, capsys, *needles):
    code, _, err = run_cli(args, capsys)
    assert code == 1, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("aaren-convert: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ----------------------------------------------------------------------------------------------------------------
# --overwrite replaces only what aaren-convert wrote
# ----------------------------------------------------------------------------------------------------------------


def test_overwrite_refuses_the_current_and_the_home_folder(tiny, tmp_path, monkeypatch, capsys):
    teacher, data = tiny
    notes = tmp_path / "work-dir"
    notes.mkdir()
    (notes / "notes.txt").write_text("my notes")
    monkeypatch.chdir(notes)
    expect_one_line_error(cli_args(teacher, data, ".") + ["--overwrite"], capsys, "current folder", "--output ./")
    monkeypatch.setenv("HOME", str(notes))
    monkeypatch.chdir(tmp_path)
    expect_one_line_error(cli_args(teacher, data, notes) + ["--overwrite"], capsys, "home folder")
    assert (notes / "notes.txt").read_text() == "my notes" and sorted(os.listdir(notes)) == ["notes.txt"]


@pytest.mark.parametrize("where, what", [
    ("teacher", "teacher folder"),          # the teacher itself
    ("parent-of-teacher", "teacher folder"),  # a folder holding the teacher
    ("inside-teacher", "teacher folder"),   # a new folder inside the teacher
    ("data", "the data"),
    ("parent-of-data", "the data"),
])
def test_overwrite_refuses_folders_related_to_teacher_or_data(mine, tmp_path, capsys, where, what):
    teacher, data = mine
    if where == "parent-of-data":
        (tmp_path / "texts").mkdir()
        data = Path(shutil.move(data, tmp_path / "texts" / "data"))
    output = {"teacher": teacher, "parent-of-teacher": tmp_path, "inside-teacher": teacher / "student",
              "data": data, "parent-of-data": tmp_path / "texts"}[where]
    before = snapshot(tmp_path)
    expect_one_line_error(cli_args(teacher, data, output) + ["--overwrite"], capsys, what, "Choose an --output")
    assert snapshot(tmp_path) == before


def test_overwrite_refuses_a_folder_with_files_it_did_not_write(tiny, tmp_path, capsys):
    teacher, data = tiny
    output = tmp_path / "out"
    output.mkdir()
    (output / "thesis.tex").write_text("years of work")
    expect_one_line_error(cli_args(teacher, data, output) + ["--overwrite"], capsys, "did not write", "thesis.tex")
    assert (output / "thesis.tex").read_text() == "years of work"


def test_overwrite_replaces_its_own_output_but_not_added_files(tiny, tmp_path, capsys):
    from aaren_hf.conversion.convert import MARKER, ConversionError, convert

    teacher, data = tiny
    output = tmp_path / "out"
    budget = dict(stage1={"steps": 1}, stage2={"steps": 1})
    convert(tiny_options(teacher, data, output, **budget))
    marker = json.loads((output / MARKER).read_text())
    assert "model.safetensors" in marker["files"] and MARKER not in marker["files"]
    convert(tiny_options(teacher, data, output, overwrite=True, seed=1, **budget))  # its own output: replaced
    (output / "my-eval.md").write_text("mine")
    with pytest.raises(ConversionError, match="my-eval.md"):
        convert(tiny_options(teacher, data, output, overwrite=True, **budget))
    assert (output / "my-eval.md").read_text() == "mine"
    assert leftovers(output) == ["out"]


# ----------------------------------------------------------------------------------------------------------------
# Work folder, fingerprints, lock
# ----------------------------------------------------------------------------------------------------------------


def test_failed_start_leaves_nothing_and_a_corrected_rerun_starts(tiny, tmp_path, capsys):
    from transformers import BertConfig

    teacher, data = tiny
    bert = tmp_path / "bert"
    BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(bert)
    expect_one_line_error(cli_args(bert, data, tmp_path / "new" / "deep" / "out"), capsys, "not supported")
    assert not (tmp_path / "new").exists()
    output = tmp_path / "out"
    expect_one_line_error(cli_args(bert, data, output), capsys, "not supported")
    assert leftovers(output) == []
    code, _, err = run_cli(cli_args(teacher, data, output) + ["--stage1-steps", "1", "--stage2-steps", "1"], capsys)
    assert code == 0, err
    assert leftovers(output) == ["out"]


def _start_then_stop(teacher, data, output):
    """A run interrupted after its start: the work folder and run.json exist, nothing holds the lock."""
    from aaren_hf.conversion.convert import _prepare_work

    opts = tiny_options(teacher, data, output)
    lock, created = _prepare_work(opts, output, output.with_name("out.work"), str(teacher.resolve()))
    lock.release()
    assert created
    return opts


def test_resume_refuses_changed_teacher_weights_or_data(mine, tmp_path):
    from aaren_hf.conversion.convert import ConversionError, _prepare_work

    teacher, data = mine
    output = tmp_path / "out"
    opts = _start_then_stop(teacher, data, output)
    opts.resume = True
    work = output.with_name("out.work")
    lock, _ = _prepare_work(opts, output, work, str(teacher.resolve()))  # unchanged: resumes
    lock.release()
    make_tiny_teacher(teacher, seed=1)  # same path, same sizes, other weights
    with pytest.raises(ConversionError, match="teacher model.safetensors: content differs"):
        _prepare_work(opts, output, work, str(teacher.resolve()))
    make_tiny_teacher(teacher, seed=0)
    text = (data / "doc003.txt").read_text()
    (data / "doc003.txt").write_text(text.replace("w1", "w2", 1))
    with pytest.raises(ConversionError, match=r"data: .*doc003\.txt changed"):
        _prepare_work(opts, output, work, str(teacher.resolve()))
    assert not output.with_name("out.lock").exists()


def test_lock_refuses_a_second_run_and_takes_over_a_stale_one(tiny, tmp_path, capsys):
    from aaren_hf.conversion.convert import _prepare_work

    teacher, data = tiny
    output = tmp_path / "out"
    _start_then_stop(teacher, data, output)
    work, lock_file = output.with_name("out.work"), output.with_name("out.lock")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock_file.write_text(json.dumps({"pid": live.pid, "host": os.uname().nodename, "started": "now"}))
        for extra in (["--overwrite"], ["--resume"]):
            expect_one_line_error(cli_args(teacher, data, output) + extra, capsys, "another run", str(live.pid))
        assert (work / "run.json").is_file(), "--overwrite deleted the live run's work folder"
    finally:
        live.kill()
        live.wait()
    # the owner is dead now: the lock is stale and taken over
    opts = tiny_options(teacher, data, output, resume=True)
    lock, _ = _prepare_work(opts, output, work, str(teacher.resolve()))
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock_file.exists()


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------


def test_a_single_text_file_is_split_into_documents(tiny, tmp_path):
    from aaren_hf.conversion.data import DataSourceError, load_token_windows

    _, data = tiny
    single = tmp_path / "book.txt"
    single.write_text("\n\n".join(p.read_text() for p in sorted(data.iterdir())))
    windows = load_token_windows(make_tokenizer(), str(single), seq_len=48, num_heldout=4, seed=0,
                                 use_cache=False)
    assert windows.heldout.shape == (4, 48) and windows.train.shape[0] > 20
    assert len(windows.documents) > 10 and all(name.startswith(f"{single}#") for name in windows.documents)
    assert not set(windows.train_documents) & set(windows.heldout_documents)
    one_line = tmp_path / "line.txt"
    rng = __import__("random").Random(0)
    one_line.write_text(" ".join(f"w{rng.randrange(60)}" for _ in range(3000)))  # no paragraph: fixed pieces
    assert len(load_token_windows(make_tokenizer(), str(one_line), seq_len=48, num_heldout=2,
                                  use_cache=False).documents) > 5
    short = tmp_path / "short.txt"
    short.write_text("w1 w2 w3 " * 30)
    with pytest.raises(DataSourceError, match="--heldout-windows"):
        load_token_windows(make_tokenizer(), str(short), seq_len=48, num_heldout=4, use_cache=False)


def test_binary_text_is_refused_and_latin1_is_read_with_a_warning(tmp_path, caplog):
    from aaren_hf.conversion.data import DataSourceError, load_documents

    (tmp_path / "model.txt").write_bytes(b"PK\x03\x04\x00\x00binary")
    with pytest.raises(DataSourceError, match=r"model\.txt is not text"):
        load_documents(str(tmp_path / "model.txt"))
    (tmp_path / "cafe.txt").write_bytes("un café à Paris\n".encode("latin-1"))
    with caplog.at_level("WARNING"):
        documents = load_documents(str(tmp_path / "cafe.txt"))
    assert documents[0][0] == "un café à Paris\n"
    assert "cafe.txt is not UTF-8" in caplog.text and "Latin-1" in caplog.text


# ----------------------------------------------------------------------------------------------------------------
# Expected failures: one line naming the file and what to do; nothing left behind
# ----------------------------------------------------------------------------------------------------------------


def _gpt2_teacher(folder: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = make_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=1, n_head=2,
                               bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _bad_jsonl(folder: Path) -> Path:
    path = folder / "docs.jsonl"
    path.write_text('{"text": "w1 w2"}\n{"text": "w3 w4"}\n{"text": "w5 \n')
    return path


@pytest.mark.parametrize("case", ["truncated-weights", "missing-weights", "malformed-jsonl", "gpt2-seq-len",
                                  "read-only-output", "unsupported-architecture"])
def test_expected_failures_are_one_line_and_leave_nothing(mine, tmp_path, capsys, case):
    teacher, data = mine
    output = tmp_path / "out"
    needles = []
    if case == "truncated-weights":
        weights = teacher / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        needles = ["teacher's weights", str(teacher), "cut short"]
    elif case == "missing-weights":
        (teacher / "model.safetensors").unlink()
        needles = ["teacher's weights", str(teacher)]
    elif case == "malformed-jsonl":
        data = _bad_jsonl(tmp_path)
        needles = [f"{data}:3: not valid JSON", "one JSON object"]
    elif case == "gpt2-seq-len":
        teacher, data = _gpt2_teacher(tmp_path / "gpt2"), _bad_jsonl(tmp_path)  # refused before the data is read
        needles = ["--seq-len 48", "32 positions", "--seq-len 32 or less"]
    elif case == "read-only-output":
        if os.geteuid() != 0:
            (tmp_path / "ro").mkdir(mode=0o555)
            output = tmp_path / "ro" / "out"
        else:  # root writes anywhere on a normal file system; /sys refuses even root
            output = Path("/sys/aaren-hf-test-output")
            try:
                Path("/sys/.aaren-hf-probe").touch()
            except OSError:
                pass
            else:
                Path("/sys/.aaren-hf-probe").unlink()
                pytest.skip("no folder here refuses writes to root")
        needles = ["cannot write next to --output", "a folder you can write to"]
    else:
        from transformers import BertConfig

        teacher = tmp_path / "bert"
        BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=64).save_pretrained(teacher)
        needles = ["'bert' is not supported", "llama"]
    expect_one_line_error(cli_args(teacher, data, output), capsys, *needles)
    if output.parent.exists() and os.access(output.parent, os.W_OK) and case != "read-only-output":
        assert leftovers(output) == []


def test_output_that_cannot_be_written_after_training_keeps_the_work(tiny, tmp_path, monkeypatch):
    from aaren_hf.conversion import convert as convert_module

    teacher, data = tiny
    output = tmp_path / "out"
    opts = tiny_options(teacher, data, output, stage1={"steps": 1}, stage2={"steps": 1})

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(convert_module, "_publish_folder", disk_full)
        with pytest.raises(convert_module.ConversionError, match=r"No space left on device\. The trained model is kept"):
            convert_module.convert(opts)
    assert leftovers(output) == ["out.work"]  # no lock, no half output
    opts.resume = True
    assert convert_module.convert(opts) == output and leftovers(output) == ["out"]


def test_debug_shows_the_traceback_and_unexpected_errors_keep_it(tiny, tmp_path, capsys, monkeypatch):
    from aaren_hf.conversion import convert as convert_module
    from aaren_hf.conversion.cli import main

    teacher, data = tiny
    with pytest.raises(convert_module.ConversionError, match="no interrupted conversion"):
        main(cli_args(teacher, data, tmp_path / "out") + ["--resume", "--debug"])

    def boom(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(convert_module, "check_teacher_type", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        main(cli_args(teacher, data, tmp_path / "out"))
    assert "conversion failed" in capsys.readouterr().err  # logged with its traceback
    assert leftovers(tmp_path / "out") == []


# ----------------------------------------------------------------------------------------------------------------
# The output folder can be published as it is
# ----------------------------------------------------------------------------------------------------------------


def _teacher_with_tokenizer_code(folder: Path) -> Path:
    """A teacher whose tokenizer_config.json names custom code (auto_map) that must never run."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizerFast"]}
    config_path.write_text(json.dumps(config))
    (folder / "tokenization_custom.py").write_text("raise RuntimeError('teacher tokenizer code was executed')\n")
    return folder


def test_output_is_portable_and_its_tokenizer_needs_no_custom_code(mine, tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    from aaren_hf.conversion.convert import convert

    teacher, data = mine
    _teacher_with_tokenizer_code(teacher)
    output = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    opts = tiny_options("teacher", "./data", output, stage1={"steps": 1}, stage2={"steps": 1}, eval=True,
                        eval_quick=True, recall_distances=(16,), recall_trials=1)
    convert(opts)
    for name in ("conversion.json", "conversion.log", "README.md", "evaluation.json"):
        text = (output / name).read_text()
        assert str(tmp_path) not in text and str(Path.home()) + "/" not in text, name
    record = json.loads((output / "conversion.json").read_text())
    assert record["teacher"] == "teacher" and record["options"]["teacher"] == "../teacher"
    assert record["options"]["data"] == ["../data"]
    card = (output / "README.md").read_text()
    assert "max_length=4096" in card  # lm-eval: the teacher's context, not 2**20
    assert "--base-model" in card  # a local teacher: the card says how to add base_model
    modes = {p.name: p.stat().st_mode & 0o777 for p in output.iterdir()}
    assert set(modes.values()) == {0o644}, modes
    tokenizer_config = json.loads((output / "tokenizer_config.json").read_text())
    assert "auto_map" not in tokenizer_config and tokenizer_config["tokenizer_class"]
    assert not (output / "tokenization_custom.py").exists()
    # no trust_remote_code: a prompt would read stdin, which pytest refuses (OSError)
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert tokenizer("w1 w2")["input_ids"] == make_tokenizer()("w1 w2")["input_ids"]
    # `aaren-convert eval` finds the teacher and the data again through the relative paths
    monkeypatch.chdir(REPO)
    code, out, err = run_cli(["eval", "--model", str(output), "--quick", "--recall-distances", "16"], capsys)
    assert code == 0 and "student (Aaren)" in out, err


def test_model_card_escapes_control_bytes_in_samples():
    from aaren_hf.conversion.model_card import render_model_card

    results = {"samples": {"max_new_tokens": 4, "teacher": [{"prompt": "Hi", "completion": "ok\x1b[31m red\x00"}],
                           "student": [{"prompt": "Hi", "completion": "\x07bell\r"}]}}
    card = render_model_card({"teacher": "x"}, results)
    assert not any(c in card for c in "\x1b\x00\x07\r")
    assert "\\x1b[31m red\\x00" in card and "\\x07bell\\r" in card


# ----------------------------------------------------------------------------------------------------------------
# push_to_hub.py
# ----------------------------------------------------------------------------------------------------------------


def _push():
    from test_examples import load_example

    return load_example("push_to_hub")


@pytest.fixture
def model_folder(tmp_path):
    from test_examples import make_tiny_folder

    return make_tiny_folder(tmp_path / "tiny-aaren")


def test_push_refuses_symlinks_leaving_the_folder(model_folder, tmp_path):
    push = _push()
    secret = tmp_path / "id_rsa"
    secret.write_text("private key")
    (model_folder / "notes.txt").symlink_to(secret)
    (model_folder / "inside.json").symlink_to(model_folder / "config.json")  # inside the folder: fine
    problems, _ = push.check_folder(model_folder)
    assert len(problems) == 1 and "notes.txt -> " in problems[0] and "inside.json" not in problems[0]
    with pytest.raises(SystemExit, match="outside the folder"):
        push.main([str(model_folder), "--dry-run"])


def test_push_base_model_flag_or_hint(model_folder, capsys):
    push = _push()
    card = model_folder / "README.md"
    card.write_text(card.read_text().replace("base_model: HuggingFaceTB/SmolLM2-135M-Instruct\n", ""))
    with pytest.raises(SystemExit, match="pass --base-model OWNER/NAME"):
        push.main([str(model_folder), "--dry-run"])
    before = card.read_text()
    push.main([str(model_folder), "--dry-run", "--base-model", "you/tiny-aaren"])
    assert "base_model: you/tiny-aaren" in capsys.readouterr().out
    assert card.read_text() == before  # a dry run changes nothing


def test_finetune_card_names_the_converted_model_not_its_teacher(model_folder, tmp_path):
    from test_examples import load_example

    ft = load_example("finetune_lora")
    info = dict(targets="mlp.up_proj", rank=4, data="docs.jsonl", steps=3, seq_len=32, eval_blocks=2,
                ppl_before=9.0, ppl_after=8.0)
    merged = tmp_path / "run" / "merged"
    merged.mkdir(parents=True)
    ft.write_card(model_folder, merged, info, base_model_id="you/tiny-aaren")
    card = (merged / "README.md").read_text()
    assert "base_model: you/tiny-aaren" in card and "SmolLM2" not in card and str(tmp_path) not in card


# ----------------------------------------------------------------------------------------------------------------
# Model edge cases
# ----------------------------------------------------------------------------------------------------------------


def test_empty_input_is_a_clear_error():
    from helpers import tiny_model

    model = tiny_model(window_size=4, num_sink_tokens=1)
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="input is empty"):
        model(empty)
    with pytest.raises(ValueError, match="input is empty"):
        model.generate(empty, max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("version", ["1", 1.0, True])
def test_non_integer_format_version_is_not_called_newer(version):
    from aaren_hf import AarenConfig

    with pytest.raises(ValueError, match="not a whole number") as error:
        AarenConfig(aaren_format_version=version)
    assert "newer" not in str(error.value)
