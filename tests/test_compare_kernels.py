# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""benchmarks/compare_kernels.py: the revision's kernels it swaps in are the ones that serve the model (and only
inside the block), a revision with the same kernels gives the same logits, and what it cannot compare is refused with
a reason. Never timings."""

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aaren_hf  # noqa: F401  (before transformers' model code: see the note in bench_decode.py)
from aaren_hf.kernels import cbuild
from test_bench_model import load_bench

REPO = Path(__file__).resolve().parent.parent
KERNELS = Path(cbuild.__file__).parent


def load_script():
    load_bench()  # benchmarks/ on sys.path
    return importlib.import_module("compare_kernels")


def needs_compiler():
    if cbuild.disabled() or (shutil.which("cc") is None and shutil.which("gcc") is None):
        pytest.skip("no C compiler, or AAREN_BACKEND=torch: the C kernels do not serve")


def tiny_student():
    compare = load_script()
    student = compare.build_models(compare.parse_args(["--rev", "HEAD", "--shape", "tiny"]))[1]
    return student, sys.modules[type(student).__module__]


def kernels_copy(into: Path, edit=None) -> Path:
    """This checkout's kernels tree copied below ``into``; ``edit``: {relative path: (old text, new text)}."""
    tree = into / "kernels"
    shutil.copytree(KERNELS, tree, ignore=shutil.ignore_patterns("__pycache__"))
    for path, (old, new) in (edit or {}).items():
        text = (tree / path).read_text()
        assert text.count(old) == 1, (path, old)
        (tree / path).write_text(text.replace(old, new))
    return tree


def test_the_revisions_kernels_serve_the_model_inside_the_block_only(tmp_path):
    needs_compiler()
    compare = load_script()
    student, model_code = tiny_student()
    same = compare.wrappers_at(kernels_copy(tmp_path / "same"), model_code)
    # the window softmax's total doubled: the window's weights halved, another output
    changed = compare.wrappers_at(kernels_copy(tmp_path / "changed", {"window/chunk.c": (
        "float sum = sum8_pairs(total8);", "float sum = 2.0f * sum8_pairs(total8);")}), model_code)
    assert {"mixer_prefill_cpu", "mixer_step_cpu", "window_attention_cpu", "aaren_prefill_cpu"} <= set(same)
    own = {name: getattr(model_code, name) for name in same}
    assert all(same[name] is not own[name] for name in same)  # the copy's functions, not this checkout's
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))

    def logits(wrappers=None):
        with torch.no_grad(), compare.serving(model_code, wrappers or {}):
            return student(input_ids=ids, use_cache=True).logits

    plain = logits()
    assert torch.equal(logits(same), plain)
    assert not torch.allclose(logits(changed), plain, atol=1e-3)
    assert all(getattr(model_code, name) is function for name, function in own.items())  # restored after the block
    assert torch.equal(logits(), plain)


def test_head_against_this_checkout_end_to_end(tmp_path, capsys):
    needs_compiler()
    compare = load_script()
    try:
        compare.git("rev-parse", "--verify", "HEAD^{commit}")
    except SystemExit:
        pytest.skip("not a git checkout (an sdist or a copy): nothing to compare with")
    out = tmp_path / "compare.json"
    rows = compare.main(["--rev", "HEAD", "--shape", "tiny", "--prompts", "24,40", "--repeats", "2", "--warmup", "1",
                         "--json", str(out)])
    printed = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert "| prompt | teacher | this checkout | HEAD |" in table[0] and len(table) == 2 + len(rows) == 4
    report = json.loads(out.read_text())
    git_diff = ["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", "kernels"]
    assert report["same_kernels"] == (subprocess.run(git_diff).returncode == 0)
    for row in report["rows"]:
        assert set(row["seconds"]) == {"teacher", "this checkout", "HEAD"} and min(row["seconds"].values()) > 0
        if report["same_kernels"]:  # the same code on both sides: the same logits, bit for bit
            assert row["same_logits"] and row["max_logit_change"] == 0.0


def test_decode_steps_run_each_sides_step_kernel(tmp_path, capsys):
    """``--decode``: each side's decode step runs its own wrapper and C (a revision whose step kernel halves the
    window's softmax gives other logits after a prompt the window is full after); end to end, a decode-step table
    whose sides agree bit for bit where the kernels are the same."""
    needs_compiler()
    compare = load_script()
    student, model_code = tiny_student()
    changed = compare.wrappers_at(kernels_copy(tmp_path / "changed", {"window/step.c": (
        "scores[g * N + j] /= sum;", "scores[g * N + j] /= 2.0f * sum;")}), model_code)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))

    def step_logits(wrappers):
        with torch.no_grad(), compare.serving(model_code, wrappers):
            cache = student(input_ids=ids, use_cache=True).past_key_values
            return student(input_ids=ids[:, :1], past_key_values=cache, use_cache=True).logits

    assert not torch.allclose(step_logits(changed), step_logits({}), atol=1e-3)
    try:
        compare.git("rev-parse", "--verify", "HEAD^{commit}")
    except SystemExit:
        return  # not a git checkout: nothing to compare end to end
    out = tmp_path / "decode.json"
    rows = compare.main(["--rev", "HEAD", "--shape", "tiny", "--prompts", "24", "--decode", "3", "--warmup", "1",
                         "--json", str(out)])
    assert "a decode step after the prompt (medians of 3 alternating steps)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["decode_steps"] == 3 and len(rows) == 1
    for row in report["rows"]:
        assert set(row["seconds"]) == {"teacher", "this checkout", "HEAD"} and min(row["seconds"].values()) > 0
        if report["same_kernels"]:
            assert row["same_logits"] and row["max_logit_change"] == 0.0


def test_what_it_cannot_compare_is_refused_with_a_reason(tmp_path):
    needs_compiler()
    compare = load_script()
    student, model_code = tiny_student()
    renamed = kernels_copy(tmp_path / "renamed", {"mixer/__init__.py": ("def mixer_step_cpu(", "def step_cpu(")})
    with pytest.raises(SystemExit, match="no mixer_step_cpu"):
        compare.wrappers_at(renamed, model_code)
    narrower = compare.wrappers_at(kernels_copy(tmp_path / "narrower", {"mixer/__init__.py": (
        "scale, stored,\n                      pool=None):", "scale, stored):")}), model_code)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    with pytest.raises(SystemExit, match="mixer_prefill_cpu does not take the arguments this checkout's model"):
        with torch.no_grad(), compare.serving(model_code, narrower):
            student(input_ids=ids, use_cache=True)
    assert model_code.mixer_prefill_cpu is not narrower["mixer_prefill_cpu"]  # restored on the way out
    # a TypeError from inside a kernel that takes the arguments is that error, not "other arguments"
    failing = compare.wrappers_at(kernels_copy(tmp_path / "failing", {"mixer/__init__.py": (
        "    B, T, Hkv, D = k.shape\n    H, S, M = q.shape[2], sinks, memory_size",
        "    raise TypeError('inside the kernel')")}), model_code)
    with pytest.raises(TypeError, match="inside the kernel"):
        with torch.no_grad(), compare.serving(model_code, failing):
            student(input_ids=ids, use_cache=True)
    if shutil.which("git") is not None:
        with pytest.raises(SystemExit, match="a revision that exists"):
            compare.kernels_at("no-such-revision-here", tmp_path)
    with pytest.raises(SystemExit):
        compare.parse_args(["--rev", "HEAD", "--repeats", "0"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--rev", "HEAD", "--decode", "-1"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--rev", "HEAD", "--student", str(tmp_path)])  # no config.json there
