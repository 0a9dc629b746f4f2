# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""benchmarks/compare_kernels.py: the build it swaps in is the one that serves the model, a revision with the same
kernels gives the same build and logits, and what it cannot compare is refused with a reason. Never timings."""

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

REPO = Path(__file__).resolve().parent.parent


def load_script():
    folder = str(REPO / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("compare_kernels")


def needs_compiler():
    if cbuild.disabled() or (shutil.which("cc") is None and shutil.which("gcc") is None):
        pytest.skip("no C compiler, or AAREN_BACKEND=torch: there is no build to swap")


def tiny_student():
    compare = load_script()
    args = compare.parse_args(["--rev", "HEAD", "--shape", "tiny"])
    return compare.build_models(args)[1]


def test_a_swapped_build_is_the_one_that_serves_the_model(tmp_path):
    needs_compiler()
    compare = load_script()
    here = Path(compare.cbuild.__file__).parent
    same, changed = tmp_path / "same" / "kernels", tmp_path / "changed" / "kernels"
    for tree in (same, changed):
        shutil.copytree(here, tree, ignore=shutil.ignore_patterns("__pycache__"))
    chunk = changed / "window" / "chunk.c"
    text = chunk.read_text()
    assert text.count("float sum = sum8_pairs(total8);") == 1  # the window softmax's total: doubled below
    chunk.write_text(text.replace("float sum = sum8_pairs(total8);", "float sum = 2.0f * sum8_pairs(total8);"))

    student = tiny_student()
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    ours, unchanged, theirs = compare.builds(None), compare.builds(same), compare.builds(changed)
    assert all(unchanged[n]._name == ours[n]._name for n in ours)  # the same sources: the same file, no new build
    assert theirs["mixer"]._name != ours["mixer"]._name and theirs["window"]._name != ours["window"]._name
    assert theirs["aaren_scan"]._name == ours["aaren_scan"]._name  # step.c did not change

    def logits(libs):
        with torch.no_grad(), compare.serving(libs):
            return student(input_ids=ids, use_cache=True).logits

    with torch.no_grad():  # (with gradients the per-part calls run: equal to rounding only)
        plain = student(input_ids=ids, use_cache=True).logits
    assert torch.equal(logits(ours), plain) and torch.equal(logits(unchanged), plain)
    assert not torch.allclose(logits(theirs), plain, atol=1e-3)  # the window's weights halved: another output
    assert torch.equal(logits(ours), plain)  # and the checkout's build serves again after the block


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
    git_diff = ["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", "kernels/*.[ch]"]
    c_unchanged = subprocess.run(git_diff).returncode == 0
    assert report["same_build"] == c_unchanged
    for row in report["rows"]:
        assert set(row["seconds"]) == {"teacher", "this checkout", "HEAD"} and min(row["seconds"].values()) > 0
        if report["same_build"]:  # one library serving both: the same logits, bit for bit
            assert row["same_logits"] and row["max_logit_change"] == 0.0


def test_what_it_cannot_compare_is_refused_with_a_reason(tmp_path):
    compare = load_script()
    here = Path(compare.cbuild.__file__).parent
    tree = tmp_path / "kernels"
    shutil.copytree(here, tree, ignore=shutil.ignore_patterns("__pycache__"))
    wrapper = tree / "mixer" / "__init__.py"
    text = wrapper.read_text()
    assert text.count('"aaren_mixer_step": (ctypes.c_int, [ctypes.c_int] * 16') == 1
    wrapper.write_text(text.replace('"aaren_mixer_step": (ctypes.c_int, [ctypes.c_int] * 16',
                                    '"aaren_mixer_step": (ctypes.c_int, [ctypes.c_int] * 17'))
    with pytest.raises(SystemExit, match="aaren_mixer_step take other arguments"):
        compare.packages_at(tree)  # (before anything is compiled)
    if shutil.which("git") is not None:
        with pytest.raises(SystemExit, match="a revision that exists"):
            compare.kernels_at("no-such-revision-here", tmp_path)
    with pytest.raises(SystemExit):
        compare.parse_args(["--rev", "HEAD", "--repeats", "0"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--rev", "HEAD", "--student", str(tmp_path)])  # no config.json there
