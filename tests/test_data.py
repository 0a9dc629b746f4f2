# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Token windows: split by document, packing, EOS handling, determinism, caching, source formats."""

import copy
import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from aaren_hf.conversion import data as data_module
from aaren_hf.conversion.data import DataSourceError, load_documents, load_token_windows, tokenize_documents

NUM_DOCS = 40
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]


def doc_words(i: int) -> list[str]:
    """Document i: its own marker word d{i}, repeated, with a length that varies between documents."""
    return [f"d{i}"] * (5 + (i * 7) % 23)


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {token: i for i, token in enumerate(SPECIALS + [f"d{i}" for i in range(NUM_DOCS)] + ["shared"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture()
def corpus(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(NUM_DOCS):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(doc_words(i)) + "\n")
    (folder / "empty.txt").write_text("   \n")  # empty documents are skipped
    (folder / "dup.txt").write_text(" ".join(doc_words(3)) + "\n")  # identical to doc03: kept once
    return folder


def marker_docs(tokenizer, windows: torch.Tensor) -> set[int]:
    ids = set(windows.flatten().tolist()) - set(tokenizer.all_special_ids)
    return {int(tokenizer.convert_ids_to_tokens(i)[1:]) for i in ids}


def windows_for(tokenizer, corpus, tmp_path, **kwargs):
    args = dict(seq_len=8, num_train=None, num_heldout=4, seed=0, cache_dir=tmp_path / "cache")
    args.update(kwargs)
    return load_token_windows(tokenizer, corpus, **args)


def test_split_by_document(tokenizer, corpus, tmp_path):
    w = windows_for(tokenizer, corpus, tmp_path)
    assert w.train.dtype == torch.int64 and w.train.shape[1] == 8 and w.heldout.shape == (4, 8)
    assert len(w.documents) == NUM_DOCS  # the empty file skipped, the duplicate dropped
    assert not set(w.train_documents) & set(w.heldout_documents)
    assert sorted(w.train_documents + w.heldout_documents) == list(range(NUM_DOCS))
    # the tokens themselves say which document they come from: no held-out document's text is in training
    train_docs, heldout_docs = marker_docs(tokenizer, w.train), marker_docs(tokenizer, w.heldout)
    assert not train_docs & heldout_docs
    name_to_marker = {name: int(name.rsplit("doc", 1)[1][:2]) for name in w.documents}
    assert heldout_docs <= {name_to_marker[w.documents[i]] for i in w.heldout_documents}
    assert train_docs <= {name_to_marker[w.documents[i]] for i in w.train_documents}


def test_eos_between_documents_and_no_padding(tokenizer, corpus, tmp_path):
    w = windows_for(tokenizer, corpus, tmp_path, num_heldout=0, seed=3)
    assert w.heldout.shape == (0, 8) and not w.heldout_documents
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    assert not (w.train == pad).any(), "packed windows never hold padding"
    # every document is followed by exactly one EOS; only the tail of the last document may be dropped
    tokens, offsets, names = tokenize_documents(tokenizer, corpus, cache_dir=tmp_path / "cache")
    for i in range(len(names)):
        doc = tokens[offsets[i]:offsets[i + 1]]
        assert doc[-1] == eos and (doc[:-1] != eos).all()
    total_tokens = int(offsets[-1])
    assert w.train.numel() == (total_tokens // 8) * 8
    eos_in_windows = int((w.train == eos).sum())
    assert NUM_DOCS - 1 <= eos_in_windows <= NUM_DOCS
    # the windows are exactly the shuffled concatenation: each window is a run of "d{i}" words separated by EOS
    for row in w.train.tolist():
        runs = [t for t in row if t != eos]
        assert len({t for t in runs}) <= 8


def test_bos_option(tokenizer, corpus, tmp_path):
    tokens, offsets, _ = tokenize_documents(tokenizer, corpus, add_bos=True, cache_dir=tmp_path / "cache")
    starts = tokens[offsets[:-1]]
    assert (starts == tokenizer.bos_token_id).all()


def test_windows_start_with_the_bos_the_tokenizer_adds(tokenizer, corpus, tmp_path):
    """A tokenizer that puts BOS before every text (Gemma) gets windows of BOS + seq_len - 1 text tokens; the text is
    the same stream as without it, and text_tokens gives it back without the BOS."""
    from tokenizers import processors

    from aaren_hf.conversion.data import leading_bos, text_tokens

    with_bos = copy.deepcopy(tokenizer)
    bos = with_bos.bos_token_id
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert leading_bos(with_bos) == bos and leading_bos(tokenizer) is None
    plain = windows_for(tokenizer, corpus, tmp_path, num_heldout=2)
    led = windows_for(with_bos, corpus, tmp_path, num_heldout=2)
    assert led.train.shape[1] == 8 and (led.train[:, 0] == bos).all() and not (led.train[:, 1:] == bos).any()
    assert led.heldout_documents == plain.heldout_documents
    assert not (plain.train == bos).any()
    assert torch.equal(text_tokens(plain.train, tokenizer), plain.train.reshape(-1))
    stripped = text_tokens(led.train, with_bos)
    assert stripped.numel() == led.train.numel() - led.train.shape[0] and not (stripped == bos).any()
    # the same documents' text, only cut at other places
    assert marker_docs(tokenizer, led.train) == marker_docs(tokenizer, plain.train)
    # recall exercises start the same way, and their filler carries no BOS
    from aaren_hf.conversion.recall import make_recall_windows

    recall = make_recall_windows(with_bos, led.train, 3, 60, 4, seed=0, min_multiple=2, max_multiple=4)
    assert (recall[:, 0] == bos).all() and not (recall[:, 1:] == bos).any()
    assert not (make_recall_windows(tokenizer, plain.train, 3, 60, 4, seed=0, min_multiple=2) == bos).any()


def test_deterministic_and_seeded(tokenizer, corpus, tmp_path):
    a = windows_for(tokenizer, corpus, tmp_path, seed=1, num_train=10)
    b = windows_for(tokenizer, corpus, tmp_path, seed=1, num_train=10, use_cache=False)
    assert torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)
    assert a.heldout_documents == b.heldout_documents
    c = windows_for(tokenizer, corpus, tmp_path, seed=2, num_train=10)
    assert c.heldout_documents != a.heldout_documents or not torch.equal(c.train, a.train)


def test_cache_skips_tokenisation(tokenizer, corpus, tmp_path, monkeypatch):
    first = windows_for(tokenizer, corpus, tmp_path)
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1 and {p.name for p in cached[0].iterdir()} == {"tokens.npy", "offsets.npy", "meta.json"}

    def fail(*args, **kwargs):
        raise AssertionError("documents were read again despite the cache")

    monkeypatch.setattr(data_module, "load_documents", fail)
    second = windows_for(tokenizer, corpus, tmp_path)
    assert torch.equal(first.train, second.train)
    # a changed source invalidates the cache entry
    (corpus / "doc00.txt").write_text("shared shared shared\n")
    monkeypatch.undo()
    third = windows_for(tokenizer, corpus, tmp_path)
    assert len(list((tmp_path / "cache").iterdir())) == 2
    assert third.info["tokens"] != first.info["tokens"]


def test_too_small_is_an_error(tokenizer, corpus, tmp_path):
    with pytest.raises(ValueError, match="training windows"):
        windows_for(tokenizer, corpus, tmp_path, num_train=10_000)
    with pytest.raises(ValueError, match="held-out"):
        windows_for(tokenizer, corpus, tmp_path, num_heldout=10_000)


def test_jsonl_and_parquet_sources(tokenizer, tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": " ".join(doc_words(i))}) + "\n" for i in range(10)))
    docs = load_documents(jsonl)
    assert len(docs) == 10 and docs[0][0] == " ".join(doc_words(0))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"content": [" ".join(doc_words(i)) for i in range(10, 20)]}), parquet)
    with pytest.raises(DataSourceError, match="text"):
        load_documents(parquet)  # no "text" column
    w = load_token_windows(tokenizer, [parquet], seq_len=4, num_heldout=2, seed=0, text_field="content",
                           cache_dir=tmp_path / "c")
    assert marker_docs(tokenizer, w.train) | marker_docs(tokenizer, w.heldout) <= set(range(10, 20))


def test_missing_local_path(tokenizer, tmp_path):
    with pytest.raises(DataSourceError, match="does not exist"):
        load_documents(tmp_path / "nope.txt")


def test_hub_dataset_offline_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("datasets")
    with pytest.raises(DataSourceError, match="python-docs"):
        load_documents("aaren-hf-test/no-such-dataset-xyz")


@pytest.mark.slow
@pytest.mark.smoke
def test_packaged_corpus_with_real_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from aaren_hf.conversion.assets import packaged_teacher_path

    tok = AutoTokenizer.from_pretrained(packaged_teacher_path())
    w = load_token_windows(tok, "python-docs", seq_len=512, num_train=48, num_heldout=16, seed=0)
    assert w.train.shape == (48, 512) and w.heldout.shape == (16, 512)
    assert not set(w.train_documents) & set(w.heldout_documents)
    assert w.info["tokens"] > 2_000_000


def test_html_pages_and_one_long_file_become_documents():
    """The two corpora of English the recipes never train on: HTML pages give their text (blocks on their own
    lines, no script or style), and one long file is cut at blank lines into documents of at least the size asked
    for, which put back together give the file."""
    from aaren_hf.conversion.assets import CORPORA, html_text, split_at_blank_lines

    page = ("<html><head><style>p {color: red}</style><title>Title</title></head><body><h1>Head</h1>"
            "<p>One   two</p><script>var x = 1;</script><div>three <b>four</b></div></body></html>")
    assert html_text(page) == "Title\nHead\nOne two\nthree four"
    text = "\n\n".join(f"paragraph {i} " + "x" * (10 * i) for i in range(12))
    pieces = split_at_blank_lines(text, 150)
    assert len(pieces) > 2 and "\n\n".join(pieces) == text
    assert all(len(p) >= 150 - 2 for p in pieces[:-1]) and all(p.startswith("paragraph") for p in pieces)
    assert CORPORA["debian-handbook"].html and CORPORA["jargon"].split_chars > 0
