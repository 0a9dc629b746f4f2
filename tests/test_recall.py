# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Recall-bearing training sequences (conversion/recall.py): layout, determinism, held-out evaluation wordings."""

import random
import re

import pytest
import torch
from helpers import bpe_tokenizer, one_thread  # noqa: F401  (one_thread: module fixture, 1 thread)

from aaren_hf.conversion import recall as rc



MANUAL = " ".join(f"Line {i} of the manual explains option number {i * 7 % 101}." for i in range(400))


@pytest.fixture(scope="module")
def tokenizer():
    """A real byte-level BPE (merges learned from the filler text), so keys and words span several tokens."""
    return bpe_tokenizer(MANUAL)


@pytest.fixture(scope="module")
def filler(tokenizer):
    """Real-looking text as [N, L] windows, with a distinct token stream to recognise filler slices."""
    ids = tokenizer(MANUAL, add_special_tokens=False)["input_ids"]
    n = len(ids) // 100
    return torch.tensor(ids[: n * 100]).view(n, 100)


def _is_slice_of(tokens, stream):
    """True if ``tokens`` occur contiguously in the (wrapped) filler stream."""
    doubled = stream + stream
    n = len(tokens)
    return any(doubled[i : i + n] == tokens for i in range(len(stream)))


def test_make_key_formats():
    rng = random.Random(0)
    for _ in range(50):
        assert re.fullmatch(r"[1-9]\d{4}", rc.make_key(rng, "digits"))
        assert re.fullmatch(r"[1-9]\d{6}", rc.make_key(rng, "digits", digits=7))
        words = rc.make_key(rng, "words").split(" ")
        assert len(words) == 2 and words[0] != words[1]
        assert re.fullmatch(r"[0-9a-f]{6,8}", rc.make_key(rng, "hex"))
        assert re.fullmatch(r"[A-Z0-9]{2,3}-[A-Z0-9]{2,4}", rc.make_key(rng, "mixed"))
    with pytest.raises(ValueError, match="unknown key format"):
        rc.make_key(rng, "emoji")


def test_windows_layout_and_answers(tokenizer, filler):
    W = 8
    ids, info = rc.make_recall_windows(tokenizer, filler, n=24, seq_len=400, window=W, seed=3, return_info=True)
    assert ids.shape == (24, 400) and ids.dtype == torch.long
    stream = filler.reshape(-1).tolist()
    formats, templates = set(), set()
    for row, meta in zip(ids.tolist(), info):
        formats.add(meta["key_format"])
        templates.add(meta["template"])
        template = next(t for t in rc.TRAIN_TEMPLATES if t.name == meta["template"])
        assert 1 <= len(meta["items"]) <= (4 if template.keyed else 1)
        first = min(item["statement"][0] for item in meta["items"])
        assert first >= 4 and _is_slice_of(row[:first], stream)  # filler first: no key in the sinks
        for item in meta["items"]:
            key_ids = tokenizer(" " + item["key"], add_special_tokens=False)["input_ids"]
            a, b = item["answer"]
            assert row[a : a + len(key_ids)] == key_ids  # the answer is the key, token for token
            s0, s1 = item["statement"]
            stated = tokenizer.decode(row[s0:s1])
            assert item["key"] in stated and (item["name"] is None or item["name"] in stated)
            question = tokenizer.decode(row[item["question_start"] : a])
            assert item["key"] not in question and (item["name"] is None or item["name"] in question)
            assert item["distance"] == item["question_start"] - s1 >= 4 * W
        # statements come before every question: no answer is given away before it is asked
        assert max(i["statement"][1] for i in meta["items"]) <= min(i["question_start"] for i in meta["items"])
    assert formats == set(rc.KEY_FORMATS) and len(templates) >= 5


def test_distances_span_the_range(tokenizer, filler):
    W = 16
    _, info = rc.make_recall_windows(tokenizer, filler, n=60, seq_len=700, window=W, seed=0, return_info=True,
                                     max_items=1, min_multiple=4, max_multiple=32)
    gaps = [item["distance"] for meta in info for item in meta["items"]]
    assert min(gaps) >= 4 * W
    assert max(gaps) <= 700 and max(gaps) > 16 * W  # clipped by the length, but far beyond the window
    starts = [item["statement"][0] for meta in info for item in meta["items"]]
    assert min(starts) < 50 and max(starts) > 300  # keys are stated anywhere the gap allows, not only at the start


def test_deterministic_in_seed(tokenizer, filler):
    a = rc.make_recall_windows(tokenizer, filler, 6, 300, 8, seed=11)
    b = rc.make_recall_windows(tokenizer, filler, 6, 300, 8, seed=11)
    c = rc.make_recall_windows(tokenizer, filler, 6, 300, 8, seed=12)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert rc.make_recall_windows(tokenizer, filler, 0, 300, 8).shape == (0, 300)


def test_bad_arguments(tokenizer, filler):
    with pytest.raises(ValueError, match="too short"):
        rc.make_recall_windows(tokenizer, filler, 2, 120, window=64)
    with pytest.raises(ValueError, match="min_multiple"):
        rc.make_recall_windows(tokenizer, filler, 2, 300, 8, min_multiple=8, max_multiple=4)
    with pytest.raises(ValueError, match="unknown key format"):
        rc.make_recall_windows(tokenizer, filler, 2, 300, 8, key_formats=("digits", "emoji"))
    with pytest.raises(ValueError, match="filler_windows"):
        rc.make_recall_windows(tokenizer, torch.zeros(0, 5, dtype=torch.long), 2, 300, 8)
    with pytest.raises(ValueError, match="window"):
        rc.make_recall_windows(tokenizer, filler, 2, 300, 0)


def _phrases(text: str, n: int = 3) -> set:
    words = re.findall(r"[a-z]+", re.sub(r"\{name\}", " ", text.lower()))
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_evaluation_wordings_are_held_out(tokenizer, filler):
    """No three-word phrase of an evaluation wording occurs in a training template, nor in generated training
    text; the key nouns of the evaluation wordings (pass key, vault, room) never appear in training sequences."""
    train_text = " ".join(f"{t.intro} {t.before} {t.after} {t.question}" for t in rc.TRAIN_TEMPLATES)
    train_phrases = _phrases(train_text)
    for wording in rc.EVAL_WORDINGS.values():
        held = _phrases(f"{wording.intro} {wording.before} {wording.after} {wording.question}")
        assert held and not held & train_phrases, wording.name
    ids = rc.make_recall_windows(tokenizer, filler, 40, 300, 8, seed=5)
    filler_text = tokenizer.decode(filler.reshape(-1).tolist()).lower()
    for row in ids.tolist():
        text = tokenizer.decode(row).lower()
        for noun in ("pass key", "vault", "room"):
            assert noun not in text or noun in filler_text
