# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Checkpoint and resume: an interrupted conversion resumed with --resume ends with exactly the weights of an
uninterrupted one (bitwise, CPU, one process).

- ``test_kill9_then_resume_matches_uninterrupted``: a real crash. The CLI runs in a subprocess; as soon as its
  first stage-2 checkpoint exists the test sends SIGKILL (the process is then somewhere after that checkpoint,
  so work since it is lost), and ``--resume`` finishes the run.
- ``test_stage1_midlayer_resume`` / ``test_stage2_resume_in_process``: simulated crashes at a known step, in
  process (the data order raises when a given step asks for its batch; everything in memory is discarded and the
  run is rebuilt from disk).
- ``test_checkpoint_files``: safetensors + JSON only, atomic pointer, optimizer state round trip.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import cache_at, one_thread  # noqa: F401  (one_thread: autouse fixture)
from test_conversion import (cli_args, cli_env, make_corpus, make_tiny_teacher, read_weights,  # noqa: F401
                             tiny_options)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    with cache_at(root / "cache"):
        yield make_tiny_teacher(root / "teacher"), make_corpus(root / "data"), root / "cache"


def assert_same_weights(a: dict, b: dict):
    assert set(a) == set(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different[:5]}"


def test_kill9_then_resume_matches_uninterrupted(tiny, tmp_path):
    from aaren_hf.conversion.convert import convert

    teacher, data, cache = tiny
    # reference: uninterrupted, in this process (same options as the CLI arguments, one thread)
    reference = tmp_path / "reference"
    convert(tiny_options(teacher, data, reference, stage2={"steps": 24}))

    out = tmp_path / "crashed"
    args = cli_args(teacher, data, out) + ["--stage2-steps", "24", "--threads", "1", "--keep-work"]
    env = cli_env(cache)
    pointer = out.with_name(out.name + ".work") / "stage2" / "stage2.latest.json"
    proc = subprocess.Popen([sys.executable, "-m", "aaren_hf.conversion.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not pointer.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    killed = proc.poll() is None
    if killed:
        os.kill(proc.pid, signal.SIGKILL)
    log = proc.communicate()[0]
    assert killed, f"the run ended before its first stage-2 checkpoint could be seen:\n{log[-2000:]}"
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists(), "killed before finishing: no output folder may exist"
    state = json.loads(pointer.read_text())
    assert 0 < state["step"] < 24

    resumed = subprocess.run([sys.executable, "-m", "aaren_hf.conversion.cli", *args, "--resume"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step" in resumed.stderr and "loaded from the work folder" in resumed.stderr
    assert_same_weights(read_weights(reference), read_weights(out))


def test_resume_refuses_changed_options(tiny, tmp_path):
    from aaren_hf.conversion.convert import ConversionError, convert

    teacher, data, _ = tiny
    out = tmp_path / "o"
    same = dict(stage2={"steps": 0}, stage1={"steps": 2})
    opts = tiny_options(teacher, data, out, keep_work=True, **same)
    convert(opts)
    work = out.with_name("o.work")
    assert (work / "run.json").is_file()
    (out / "config.json").unlink()  # pretend the output is incomplete; resume must still check the options
    with pytest.raises(ConversionError, match="options differ.*seq_len"):
        convert(tiny_options(teacher, data, out, seq_len=32, resume=True, **same))
    with pytest.raises(ConversionError, match=r"\(mixer\.window_size: \d+ -> 5\)"):  # names the one nested option
        convert(tiny_options(teacher, data, out, mixer=dict(opts.mixer, window_size=5), resume=True, **same))
    # a run.json from a version that had no such option: refused (what the run did instead is unknown), and said so
    run = json.loads((work / "run.json").read_text())
    del run["options"]["mixer"]["window_gate"], run["options"]["long_seq_len"]
    (work / "run.json").write_text(json.dumps(run))
    with pytest.raises(ConversionError, match=r"long_seq_len: \(not recorded\) -> .*older aaren-convert, before "
                                              r"long_seq_len, mixer\.window_gate existed"):
        convert(tiny_options(teacher, data, out, resume=True, **same))


def _parts(tiny):
    from aaren_hf.conversion.convert import build_student, load_teacher
    from aaren_hf.conversion.data import load_token_windows
    from aaren_hf.conversion.init import initialize_student

    teacher_dir, data, _ = tiny
    tokenizer, teacher = load_teacher(str(teacher_dir))
    windows = load_token_windows(tokenizer, str(data), seq_len=48, num_heldout=4, seed=0)
    student = build_student(teacher, {"num_query_slots": 2, "decay": "learned", "window_size": 8,
                                      "num_sink_tokens": 1})
    initialize_student(student, teacher, windows.train[:2], seed=0)
    return teacher, student, windows


class Crash(Exception):
    pass


def crash_at_step(monkeypatch, step: int):
    """Make the training loop die when step ``step`` (0-based) asks for its batch: steps before it are done, their
    work since the last checkpoint is lost, as in a kill."""
    from aaren_hf.conversion import train_state as ts

    real = ts.sample_indices

    def sample_indices(seed, at, *args, **kwargs):
        if at == step:
            raise Crash(f"simulated crash at step {at}")
        return real(seed, at, *args, **kwargs)

    monkeypatch.setattr(ts, "sample_indices", sample_indices)
    return monkeypatch.undo


def test_stage1_midlayer_resume(tiny, tmp_path, monkeypatch):
    from aaren_hf.conversion.stage1 import Stage1Options, capture_attention, train_mixer

    teacher, student, windows = _parts(tiny)
    x, y = capture_attention(teacher, windows.train[:8], [1])[1]
    opts = Stage1Options(steps=9, lr=3e-3, batch_size=2, warmup=2, checkpoint_every=3)

    full = copy.deepcopy(student.model.layers[1].mixer)
    train_mixer(full, x, y, opts, seed=0, layer=1)

    first = copy.deepcopy(student.model.layers[1].mixer)
    undo = crash_at_step(monkeypatch, 5)
    with pytest.raises(Crash):
        train_mixer(first, x, y, opts, seed=0, layer=1, checkpoint_dir=tmp_path)
    undo()
    # the checkpoint is at step 3: steps 4-5 are lost, as in a crash
    assert json.loads((tmp_path / "layer001.latest.json").read_text())["step"] == 3
    del first
    second = copy.deepcopy(student.model.layers[1].mixer)  # fresh object: nothing from the first run in memory
    torch.manual_seed(1234)  # garbage RNG state: the checkpoint restores it
    record = train_mixer(second, x, y, opts, seed=0, layer=1, checkpoint_dir=tmp_path)
    assert len(record["losses"]) == 9
    assert_same_weights(dict(full.state_dict()), dict(second.state_dict()))


@pytest.mark.parametrize("trainable", ["all", "lora"])
def test_stage2_resume_in_process(tiny, tmp_path, trainable, monkeypatch):
    from aaren_hf.conversion.stage2 import Stage2Options, run_stage2

    teacher, student, windows = _parts(tiny)
    opts = Stage2Options(steps=6, lr=2e-3, batch_size=2, micro_batch_size=1, warmup=1, trainable=trainable,
                         checkpoint_every=2, eval_windows=0, lora_r=4)
    full, _ = run_stage2(copy.deepcopy(student), teacher, windows.train, windows.heldout, opts, seed=0,
                         work_dir=tmp_path / "a")
    undo = crash_at_step(monkeypatch, 3)
    with pytest.raises(Crash):
        run_stage2(copy.deepcopy(student), teacher, windows.train, windows.heldout, opts, seed=0,
                   work_dir=tmp_path / "b")
    undo()
    # steps 1-3 ran, the checkpoint after step 2 survives: step 3 is redone
    assert json.loads((tmp_path / "b" / "stage2" / "stage2.latest.json").read_text())["step"] == 2
    resumed, summary = run_stage2(copy.deepcopy(student), teacher, windows.train, windows.heldout, opts, seed=0,
                                  work_dir=tmp_path / "b")
    assert [h[0] for h in summary["history"]] == [1, 2, 3, 4, 5, 6]
    assert_same_weights(dict(full.state_dict()), dict(resumed.state_dict()))


def test_checkpoint_files(tmp_path):
    from aaren_hf.conversion import train_state as ts

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[1].weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        optimizer.step()
    ts.save_checkpoint(tmp_path, "run", module=model, optimizer=optimizer, step=3, extra={"cursor": {"step": 3}})
    ts.save_checkpoint(tmp_path, "run", module=model, optimizer=optimizer, step=4)
    folder = ts.latest_checkpoint(tmp_path, "run")
    assert folder.name == "run-step00000004" and not (tmp_path / "run-step00000003").exists()
    assert sorted(p.name for p in folder.iterdir()) == ["optimizer.safetensors", "params.safetensors",
                                                        "rng.safetensors", "state.json"]
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("*.pkl"))

    expected = torch.rand(3)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    optimizer2 = torch.optim.AdamW([p for p in clone.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(99)
    state = ts.load_checkpoint(folder, module=clone, optimizer=optimizer2)
    assert state["step"] == 4
    assert torch.equal(torch.rand(3), expected)  # the generator continues where it was at the save
    for a, b in zip(model.parameters(), clone.parameters()):
        if a.requires_grad:
            assert torch.equal(a, b)
    sa, sb = optimizer.state_dict(), optimizer2.state_dict()
    for index in sa["state"]:
        for key, value in sa["state"][index].items():
            assert torch.equal(value, sb["state"][index][key])
    assert sa["param_groups"] == sb["param_groups"]

    # a half-written checkpoint (crash during the write) is ignored: the pointer still names the complete one
    broken = tmp_path / "run-step00000005"
    broken.mkdir()
    (broken / "params.safetensors").write_bytes(b"partial")
    assert ts.latest_checkpoint(tmp_path, "run") == folder
    (tmp_path / "run.latest.json").unlink()
    assert ts.latest_checkpoint(tmp_path, "run") == folder


def test_rng_state_round_trip():
    import random

    import numpy as np

    from aaren_hf.conversion import train_state as ts

    tensors, meta = ts.capture_rng()
    json.dumps(meta)
    a = (torch.rand(2), np.random.rand(2), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    ts.restore_rng(tensors, meta)
    b = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_sample_indices_is_a_pure_function():
    from aaren_hf.conversion.train_state import sample_indices

    seen = [i for s in range(5) for i in sample_indices(7, s, 4, 10)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))  # epochs are permutations
    assert sample_indices(7, 3, 4, 10) == seen[12:16]
    assert sample_indices(8, 3, 4, 10) != seen[12:16]


def test_a_run_with_no_new_parameters_resumes(tmp_path):
    # --convert-layers none --memory-size 0 (the control row) creates no parameters; its empty init file must
    # load back (safetensors 0.8 cannot read what it writes for no tensors with an empty metadata dict)
    from aaren_hf.conversion import train_state as ts

    module = torch.nn.Linear(2, 2)
    before = [p.clone() for p in module.parameters()]
    ts.atomic_save_tensors(tmp_path / "init.safetensors", {}, metadata={})
    ts.load_tensors_into(module, tmp_path / "init.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
