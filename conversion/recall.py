# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Recall-bearing sequences: keys and key-value pairs buried in real text, asked for many windows later.

Stage 2 distils the teacher's next-token distribution over every token of a sequence, so a sequence teaches recall
as soon as it contains a key and, far later, a question whose answer is that key: the teacher (full attention)
puts its mass on the key's tokens there, the student must carry them across the gap. :func:`make_recall_windows`
builds such sequences from real filler text (held-out-free training windows), ready to be mixed into stage-2
batches:

    ids = make_recall_windows(tokenizer, train_windows, n=8, seq_len=2048, window=64, seed=0)  # [8, 2048]

Variety, so that the student learns to recall rather than one phrasing: several TRAINING templates (single keys
and named key-value pairs, prose and code-like), four key formats (:data:`KEY_FORMATS`: digits, words, hex, mixed
letters and digits), 1-4 items per sequence asked in shuffled order, distances (tokens between a statement and its
question) log-uniform in [4W, 32W] (clipped to what the length allows).

Evaluation uses separate wordings (:data:`EVAL_WORDINGS`) that no training template shares a phrase with (a test
checks it), so a recall score measures recall, not the memorised template. The ``"passkey"`` wording is the one
:func:`~aaren_hf.conversion.evaluate.recall_probe` always used (Mohtashami & Jaggi 2023's passkey test), kept token
for token so earlier numbers stay comparable.
"""

from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "EVAL_WORDINGS",
    "KEY_FORMATS",
    "TRAIN_TEMPLATES",
    "Template",
    "make_key",
    "make_recall_windows",
]

KEY_FORMATS = ("digits", "words", "hex", "mixed")

# Short, common, single-token-ish English words; keys of the "words" format are two of them ("amber falcon").
_KEY_WORDS = (
    "amber", "anchor", "apple", "arrow", "autumn", "badge", "banjo", "basket", "beacon", "berry", "bison", "blossom",
    "cactus", "candle", "canyon", "carpet", "castle", "cedar", "cherry", "cloud", "cobalt", "comet", "copper", "coral",
    "crystal", "dagger", "desert", "dolphin", "dragon", "eagle", "ember", "falcon", "feather", "forest", "garnet",
    "glacier", "granite", "harbor", "hazel", "honey", "island", "ivory", "jasmine", "jungle", "kettle", "lantern",
    "lemon", "marble", "meadow", "mirror", "monsoon", "nectar", "olive", "orchid", "otter", "pebble", "pepper",
    "planet", "quartz", "raven", "river", "saddle", "silver", "tiger", "tulip", "velvet", "violet", "walnut", "willow",
)
# Names of key-value items (disjoint from the key words, so a name never looks like an answer).
_NAMES = (
    "Alice", "Bruno", "Chloe", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ingrid", "Jonas", "Keiko", "Luis",
    "Marta", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Samir", "Tomas", "Ursula", "Viktor", "Wanda", "Yusuf",
)
_IDENTIFIERS = (
    "alpha", "beta", "gamma", "delta", "sigma", "omega", "kappa", "zeta", "theta", "lambda", "tau", "rho",
    "server", "client", "cache", "queue", "worker", "buffer", "socket", "parser",
)


def make_key(rng: random.Random, key_format: str, digits: int = 5) -> str:
    """A random key: ``digits`` -> "48213" (``digits`` long, no leading zero); ``words`` -> "amber falcon";
    ``hex`` -> "3fa9c2" (6-8 lowercase hex digits); ``mixed`` -> "QX4-82R" (letters and digits, one dash)."""
    if key_format == "digits":
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        return str(rng.randint(10 ** (digits - 1), 10**digits - 1))
    if key_format == "words":
        return " ".join(rng.sample(_KEY_WORDS, 2))
    if key_format == "hex":
        return "".join(rng.choice("0123456789abcdef") for _ in range(rng.randint(6, 8)))
    if key_format == "mixed":
        chars = string.ascii_uppercase + string.digits
        a, b = rng.randint(2, 3), rng.randint(2, 4)
        return "".join(rng.choice(chars) for _ in range(a)) + "-" + "".join(rng.choice(chars) for _ in range(b))
    raise ValueError(f"unknown key format {key_format!r}; choose from {', '.join(KEY_FORMATS)}")


@dataclass(frozen=True)
class Template:
    """One wording. The statement is ``before + " " + key + after``; the question ends right before the answer,
    which is ``" " + key + end``. ``{name}`` (key-value templates) is filled with the item's name in both.
    ``intro`` (optional) opens the sequence, before any filler."""

    name: str
    before: str
    after: str
    question: str
    end: str = "."
    names: Optional[tuple] = None  # pool of names for {name}; None: a single-key template
    intro: str = ""

    @property
    def keyed(self) -> bool:
        return self.names is not None


TRAIN_TEMPLATES = (
    Template("code", " The access code is", ". Keep it safe.\n",
             "\nWhich access code was given above? The access code is"),
    Template("number", " Please memorise the following number:", ".\n",
             "\nEarlier you were asked to memorise a number. That number was"),
    Template("secret", "\nToday's secret:", "\n", "\nQuestion: what was today's secret?\nAnswer:", end="\n"),
    Template("reference", " (Reference value for later:", ".)", "\nRecall the reference value mentioned before:"),
    Template("record", "\n[record] id =", "\n", "\n# look up the record id from above\nid =", end="\n"),
    Template("locker", " {name}'s locker code is", ".", "\nWhat is {name}'s locker code? {name}'s locker code is",
             names=_NAMES),
    Template("assign", "\n{name} =", "  # remember this value\n", "\nprint({name})  # prints", end="\n",
             names=_IDENTIFIERS),
    Template("ticket", " Ticket for {name}:", ".", "\nThe ticket that belonged to {name} read", names=_NAMES),
)

EVAL_WORDINGS = {
    # recall_probe's original wording, token for token (held out from training: see TRAIN_TEMPLATES)
    "passkey": Template(
        "passkey", " The pass key is", ". Remember it.\n", "\nWhat is the pass key? The pass key is",
        intro="There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n",
    ),
    "vault": Template("vault", " The combination of the vault is", ". Do not forget it.\n",
                      "\nTell me the combination of the vault. The combination of the vault is"),
    "room": Template("room", " {name} is staying in room", ".", "\nIn which room is {name} staying? Room",
                     names=_NAMES),
}


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def start_ids(tokenizer) -> list[int]:
    """What every sequence starts with: the BOS where the tokenizer puts one before any text (Gemma), else nothing;
    the same start as the text windows (data.load_token_windows)."""
    from .data import leading_bos

    bos = leading_bos(tokenizer)
    return [] if bos is None else [bos]


def _filler_stream(filler_windows, tokenizer) -> list[int]:
    from .data import text_tokens

    filler = torch.as_tensor(filler_windows)
    if filler.dim() != 2 or filler.numel() == 0:
        raise ValueError(f"filler_windows must be a non-empty [N, L] tensor of token ids, got shape "
                         f"{tuple(filler.shape)}")
    return text_tokens(filler, tokenizer).tolist()


def _take(stream: list[int], rng: random.Random, n: int) -> list[int]:
    """``n`` consecutive filler tokens from a random offset (wrapping around the stream)."""
    if n <= 0:
        return []
    start = rng.randrange(len(stream))
    reps = (start + n) // len(stream) + 1
    return (stream * (reps + 1))[start : start + n]


def _item(tokenizer, template: Template, key: str, name: Optional[str]) -> tuple[list, list, list]:
    """(statement ids, question ids, answer ids) of one item; the key's ids are the same in statement and answer
    (tokenised once, with its leading space), so copying them is exactly what the answer asks for."""
    fill = (lambda s: s.format(name=name)) if template.keyed else (lambda s: s)
    key_ids = _ids(tokenizer, " " + key)
    statement = _ids(tokenizer, fill(template.before)) + key_ids + _ids(tokenizer, fill(template.after))
    question = _ids(tokenizer, fill(template.question))
    return statement, question, key_ids + _ids(tokenizer, template.end)


def make_recall_windows(tokenizer, filler_windows, n: int, seq_len: int, window: int, seed: int = 0, *,
                        min_multiple: float = 4, max_multiple: float = 32, max_items: int = 4,
                        key_formats: Sequence[str] = KEY_FORMATS, templates: Sequence[Template] = TRAIN_TEMPLATES,
                        return_info: bool = False):
    """``n`` sequences of exactly ``seq_len`` tokens, each with 1 to ``max_items`` keys stated in real filler text
    and asked for later, the answer following each question.

    Layout: ``[intro][filler][statement 1][filler]...[statement k][gap][question a + answer][filler][question b +
    answer]...[filler]``, so every question is at least ``gap`` tokens after its statement. The gap is drawn
    log-uniformly in [``min_multiple`` * window, ``max_multiple`` * window], clipped to what ``seq_len`` leaves;
    ``distance`` (tokens between the end of a statement and the start of its question, other items included) is
    therefore >= min_multiple * window. Each sequence uses one template and one key format (drawn from
    ``templates`` / ``key_formats``); single-key templates carry one item, key-value templates 1..max_items with
    distinct names. The first tokens are filler (at least 4, so a sink never holds a key; how many is random, so
    the statements sit anywhere the gap allows).

    ``filler_windows``: [N, L] token ids of real text (training windows; never the held-out ones). Deterministic
    in ``seed``. Returns a LongTensor [n, seq_len]; with ``return_info``, also a list (one per sequence) of dicts
    ``{"template", "key_format", "items": [{"key", "name", "statement": [start, end), "question_start",
    "answer": [start, end), "distance"}]}`` in token indices.
    """
    if n < 0 or seq_len < 2 or window < 1:
        raise ValueError(f"need n >= 0, seq_len >= 2 and window >= 1, got n={n}, seq_len={seq_len}, window={window}")
    if not 0 < min_multiple <= max_multiple:
        raise ValueError(f"need 0 < min_multiple <= max_multiple, got {min_multiple}, {max_multiple}")
    if max_items < 1:
        raise ValueError(f"max_items must be >= 1, got {max_items}")
    templates, key_formats = list(templates), list(key_formats)
    if not templates or not key_formats:
        raise ValueError("templates and key_formats must not be empty")
    for f in key_formats:
        make_key(random.Random(0), f)  # unknown formats fail here, before any work
    stream = _filler_stream(filler_windows, tokenizer)
    start = start_ids(tokenizer)
    rng = random.Random(seed)
    lo = max(1, int(round(min_multiple * window)))
    rows, infos = [], []
    for _ in range(n):
        template = rng.choice(templates)
        key_format = rng.choice(key_formats)
        k = rng.randint(1, min(max_items, len(template.names))) if template.keyed else 1
        names = rng.sample(template.names, k) if template.keyed else [None]
        keys = []
        while len(keys) < k:  # distinct keys: an answer must identify its item
            key = make_key(rng, key_format)
            if key not in keys:
                keys.append(key)
        items = [_item(tokenizer, template, key, name) for key, name in zip(keys, names)]
        intro = start + _ids(tokenizer, template.intro)
        # small filler before and between statements and between questions; the rest is the gap and the tail
        head = rng.randint(4, 32)
        spacing = [rng.randint(8, 64) for _ in range(2 * k - 2)]
        while True:
            fixed = len(intro) + head + sum(spacing) + sum(len(s) + len(q) + len(a) for s, q, a in items)
            room = seq_len - fixed
            if room >= lo or k == 1:
                break
            k -= 1  # fewer items rather than a shorter gap: the gap is the point
            items, keys, names, spacing = items[:k], keys[:k], names[:k], spacing[: 2 * k - 2]
        if room < lo:
            raise ValueError(
                f"seq_len={seq_len} is too short for a gap of {min_multiple} x window={window} ({lo} tokens) plus "
                f"{fixed} tokens of filler head, statement, question and answer; use a longer seq_len or a smaller "
                "window multiple")
        hi = max(lo, min(int(max_multiple * window), room))
        gap = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        order = list(range(k))
        rng.shuffle(order)

        # what the gap leaves is split at random between the start and the end, so keys are stated anywhere in
        # the sequence (not always near its start, where a model could learn to look)
        head += rng.randint(0, room - gap)
        seq = intro + _take(stream, rng, head)
        info_items = [None] * k
        for j, (statement, _, _) in enumerate(items):
            if j:
                seq += _take(stream, rng, spacing[j - 1])
            info_items[j] = {"key": keys[j], "name": names[j], "statement": [len(seq), len(seq) + len(statement)]}
            seq += statement
        seq += _take(stream, rng, gap)
        for r, j in enumerate(order):
            if r:
                seq += _take(stream, rng, spacing[k - 2 + r])
            _, question, answer = items[j]
            info_items[j]["question_start"] = len(seq)
            info_items[j]["distance"] = len(seq) - info_items[j]["statement"][1]
            seq += question
            info_items[j]["answer"] = [len(seq), len(seq) + len(answer)]
            seq += answer
        seq += _take(stream, rng, seq_len - len(seq))
        rows.append(seq[:seq_len])
        infos.append({"template": template.name, "key_format": key_format, "items": info_items})
    ids = torch.tensor(rows, dtype=torch.long).view(n, seq_len)
    return (ids, infos) if return_info else ids
