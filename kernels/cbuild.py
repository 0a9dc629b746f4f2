"""The C kernels for CPUs (the decode step: ``aaren/step.c``, ``window/step.c``, ``mixer/step.c`` in one library; the
memory's ranking and codes, and a prompt's memory: ``memory/evict.c``, ``memory/codes.c``, ``memory/prefill.c``,
with ``memory/codes.h`` shared by the three libraries; a prompt's scan, ``aaren/step.c``; window attention, forward
and backward, ``window/chunk.c``, with the rotary embedding, ``window/rotate.c``, and a prompt's window bookkeeping,
``window/prefill.c``; ``vec8.h``, 8 floats at a time, for all), compiled on first use and loaded with ctypes. Each
kernel folder's header (``aaren/aaren.h``, ``window/window.h``, ``memory/memory.h``, ``mixer/mixer.h``) declares its
calls once, for the file that defines them and the files that compose them.

They are compiled with the machine's C compiler (``$CC``, else ``cc``/``gcc``) into ``$AAREN_HF_CACHE/kernels``
(default ``~/.cache/aaren_hf/kernels``), keyed by the sources, the headers they include, the flags and the CPU: no
build step at install, no Python headers. Each load marks its library as used; a build that no load has used for
``KEEP_DAYS`` (made from sources since edited, by another version of the package, or of a library since renamed) is
deleted when a new one is built. ``AAREN_BACKEND=torch`` (or ``naive``) turns them off; without a compiler, or where
it fails, a warning says so once and the model runs the PyTorch code (each kernel's reference).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

# -ffp-contract=off: no fused multiply-adds, so values round as PyTorch's separate ops do
FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
NATIVE = ["-march=native"]
OPENMP = ["-fopenmp"]  # threads from the pool PyTorch's operators use (window/chunk.c says how); else one thread

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)  # a header of our own
BUILD = re.compile(r".+-[0-9a-f]{16}\.so")  # what load names a build: library-key.so
KEEP_DAYS = 30  # a build unused this long is stale (another checkout on this machine marks its own when it loads)
_loaded: dict = {}  # name -> library, or None once it could not be built
_said_no_compiler = False


def disabled() -> bool:
    # and while torch.compile traces: it sees PyTorch operators, not what a C call through raw pointers reads and
    # writes (traced, the memory's ranking came out wrong: the buffer the kernel fills is not the one it used)
    return os.environ.get("AAREN_BACKEND", "").strip().lower() in ("torch", "naive") or torch.compiler.is_compiling()


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's flags (Linux), else the machine name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _cache_dir() -> Path:
    # the root of aaren_hf.conversion.assets.cache_root, restated: the kernels sit below the conversion package
    root = os.environ.get("AAREN_HF_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "aaren_hf") / "kernels"


def _compile(cc: str, flags: list, sources: tuple, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *map(str, sources), "-o", tmp, "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, target)  # atomic: another process never loads half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _prune(keep: Path) -> None:
    """Delete the builds beside ``keep`` (files named as load names them) that no load has marked for KEEP_DAYS."""
    cutoff = time.time() - KEEP_DAYS * 86400
    for old in keep.parent.glob("*-*.so"):
        try:
            if old != keep and BUILD.fullmatch(old.name) and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # gone already (another process pruned it), or not ours to delete
            pass


def _mark_used(target: Path) -> None:
    try:
        os.utime(target)
    except OSError:  # a read-only cache: nothing to prune there either
        pass


def headers_of(sources) -> tuple:
    """The files ``sources`` include with quotes (``#include "..."``), and those they include in turn: part of a
    build's key as the sources are, and shipped with them."""
    found, todo = [], [Path(source) for source in sources]
    while todo:
        source = todo.pop()
        for name in INCLUDE.findall(source.read_text()):
            header = (source.parent / name).resolve()
            if header not in found:
                found.append(header)
                todo.append(header)
    return tuple(sorted(found))


def load(name: str, sources: tuple, signatures: dict, instead: str):
    """``sources`` compiled (once per machine) into library ``name`` and loaded, its functions typed by ``signatures``
    ({function: (restype, argtypes)}); None when disabled or when it cannot be built (then, once, a warning that
    ``instead`` runs)."""
    if disabled():
        return None
    if name in _loaded:
        return _loaded[name]
    _loaded[name] = None
    where = " + ".join(f"kernels/{source.parent.name}/{source.name}" for source in sources)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        global _said_no_compiler
        if not _said_no_compiler:  # once for all the kernels
            _said_no_compiler = True
            warnings.warn("aaren_hf: no C compiler (set CC, or install gcc): on the CPU the model runs its PyTorch "
                          "code, decoding about half as fast", stacklevel=3)
        return None
    errors, headers = [], headers_of(sources)
    for flags in (FLAGS + OPENMP + NATIVE, FLAGS + NATIVE, FLAGS):
        key = hashlib.sha256(b"".join(source.read_bytes() for source in (*sources, *headers))
                             + " ".join([cc, *flags]).encode() + _cpu_key().encode())
        target = _cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
        try:
            if target.exists():
                _mark_used(target)
            else:
                _compile(cc, flags, sources, target)
                _prune(target)
            lib = ctypes.CDLL(str(target))
        except (OSError, subprocess.SubprocessError) as error:
            stderr = getattr(error, "stderr", b"") or b""
            errors.append(f"{' '.join(flags)}: {error} {stderr.decode(errors='replace')[-500:]}")
            continue
        for function, (restype, argtypes) in signatures.items():
            getattr(lib, function).restype, getattr(lib, function).argtypes = restype, argtypes
        _loaded[name] = lib
        return lib
    warnings.warn(f"aaren_hf: could not build {where} with {cc} ({'; '.join(errors)}): on the CPU the model runs "
                  f"{instead}", stacklevel=3)
    return None


def dense(t):
    return t if t.is_contiguous() else t.contiguous()


def records_grad(*tensors) -> bool:
    """Whether autograd records a step on these tensors (None: left out): where a C call without a backward
    declines, or a Function's backward would keep what no one asks of it (modeling_aaren's ``_trains``, which the
    modeling file restates to stand alone)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def as_bytes(t):
    """t as uint8 for a C call: a bool tensor's own bytes (no copy), anything else converted."""
    return dense(t.view(torch.uint8) if t.dtype == torch.bool else t.to(torch.uint8))
