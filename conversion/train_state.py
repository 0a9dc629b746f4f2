# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The conversion's training loop (:class:`TrainingLoop`, used by both stages) and its checkpoints: safetensors +
JSON only, written atomically.

A checkpoint is a folder::

    <root>/<name>-step00000040/
        params.safetensors     the parameters (and persistent buffers) being trained, by name
        optimizer.safetensors  every tensor of the optimizer state, flattened: ``state.<index>.<key>``
        rng.safetensors        torch CPU (and CUDA) generator states, numpy's Mersenne-Twister key
        state.json             step, data cursor, scheduler, optimizer hyper-parameters, python/numpy RNG
                               scalars, anything the caller adds (``extra``), and the file sizes

It is written into a temporary folder, fsynced, renamed into place, and only then named by the pointer file
``<root>/<name>.latest.json`` (written to a temporary name, then ``os.replace``). A kill -9 at any moment leaves
either the previous checkpoint or the new one reachable, never a half-written one; older checkpoint folders are
removed after the pointer moves (``keep`` most recent kept).

Nothing is pickled: tensors go to safetensors, everything else to JSON. The data order of every stage is a pure
function of (seed, step) (:func:`sample_indices`), so the cursor is the step itself and a resumed run sees exactly the
batches an uninterrupted one would. On CPU in one process a resumed run ends bitwise identical to an uninterrupted
one (tested in ``tests/test_resume.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "CheckpointError",
    "LockHeld",
    "RunLock",
    "file_fingerprint",
    "atomic_write_json",
    "atomic_save_tensors",
    "capture_rng",
    "restore_rng",
    "flatten_optimizer_state",
    "load_optimizer_state",
    "latest_checkpoint",
    "load_checkpoint",
    "load_tensors_into",
    "Progress",
    "TrainingLoop",
    "lr_at",
    "save_checkpoint",
    "sample_indices",
    "trainable_state",
]

FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit the run that tries to resume from it."""


# ----------------------------------------------------------------------------------------------------------------
# Atomic files
# ----------------------------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def atomic_write(path, write) -> Path:
    """Create ``path`` through a temporary file in the same folder and ``os.replace``: a crash (kill -9 included)
    leaves the old file or none, never half a file. ``write(tmp_name)`` fills the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        _fsync_file(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes owner-only files; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_json(path, data) -> Path:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _standalone(tensors: dict) -> dict:
    """CPU tensors that each own their whole storage (safetensors refuses shared or partial storage)."""
    out, seen = {}, set()
    for name, value in tensors.items():
        value = value.detach().to("cpu").contiguous()
        storage = value.untyped_storage()
        if value.numel() and (storage.data_ptr() in seen or storage.nbytes() != value.nbytes):
            value = value.clone()
            storage = value.untyped_storage()
        if value.numel():
            seen.add(storage.data_ptr())
        out[name] = value
    return out


def atomic_save_tensors(path, tensors: dict, metadata: Optional[dict] = None) -> Path:
    """safetensors file written atomically. Shared storage is fine (tensors are copied to contiguous CPU tensors)."""
    # An empty metadata dict next to an empty tensor dict makes safetensors 0.8 write a header it cannot read back
    # ('{},"__metadata__":{}}'): a conversion with no new parameters (--convert-layers none) hit it on resume.
    meta = {k: str(v) for k, v in (metadata or {}).items()} or None
    return atomic_write(path, lambda tmp: save_file(_standalone(tensors), tmp, metadata=meta))


def file_fingerprint(path) -> dict:
    """Size and SHA-256 of a file's content: what a resumed run compares, since a path and a modification time do
    not show that the bytes behind them changed (a re-download, `cp -p`, an edited corpus)."""
    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


# ----------------------------------------------------------------------------------------------------------------
# Run lock
# ----------------------------------------------------------------------------------------------------------------


class LockHeld(RuntimeError):
    """Another live run holds the lock; the message names it and says what to do."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class RunLock:
    """An exclusive lock file (``O_CREAT | O_EXCL``) holding the owner's pid, host and start time.

    A lock whose owner is a dead process on this host is stale and taken over; one from another host cannot be
    checked and counts as held (the message says which file to delete if no run is active there). A lock file
    still empty (its owner is between creating and writing it) counts as held for ``grace`` seconds."""

    def __init__(self, path, grace: float = 10.0):
        self.path = Path(path)
        self.grace = grace
        self.owned = False

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def _is_stale(self, holder: dict) -> bool:
        if not holder:
            try:
                return time.time() - self.path.stat().st_mtime > self.grace
            except FileNotFoundError:
                return True
        if holder.get("host") != socket.gethostname():
            return False
        return not _pid_alive(int(holder.get("pid", -1)))

    def acquire(self) -> "RunLock":
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if not self._is_stale(holder):
                    who = (f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
                           if holder else "a process that is starting")
                    raise LockHeld(
                        f"another run is using this output: {self.path} is held by {who}. Wait for it to finish or "
                        f"stop it; if no such run is active, delete {self.path}"
                    ) from None
                self.path.unlink(missing_ok=True)  # stale: its owner died without cleaning up
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump(me, handle)
                handle.flush()
                os.fsync(handle.fileno())
            self.owned = True
            return self
        raise LockHeld(f"could not take the lock {self.path}: other runs keep taking it; try again")

    def release(self) -> None:
        if self.owned and self._holder().get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.owned = False


# ----------------------------------------------------------------------------------------------------------------
# RNG
# ----------------------------------------------------------------------------------------------------------------


def capture_rng() -> tuple[dict, dict]:
    """(tensors, json) describing the torch, CUDA, numpy and python generators."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32).view(np.int32).copy())
    version, internal, gauss_next = random.getstate()
    meta = {
        "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }
    return tensors, meta


def restore_rng(tensors: dict, meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted(k for k in tensors if k.startswith("torch_cuda_"))
    if cuda and torch.cuda.is_available():
        states = [tensors[k] for k in cuda][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)
    n = meta["numpy"]
    keys = tensors["numpy_keys"].numpy().view(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = meta["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


# ----------------------------------------------------------------------------------------------------------------
# Optimizer state <-> (safetensors, JSON)
# ----------------------------------------------------------------------------------------------------------------


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return {"__tuple__": isinstance(value, tuple), "items": [_jsonable(v) for v in value]}
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return {"__float__": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"cannot store optimizer setting of type {type(value).__name__} in JSON: {value!r}")


def _from_json(value):
    if isinstance(value, dict) and "items" in value and "__tuple__" in value:
        items = [_from_json(v) for v in value["items"]]
        return tuple(items) if value["__tuple__"] else items
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return value


def flatten_optimizer_state(optimizer) -> tuple[dict, dict]:
    """``optimizer.state_dict()`` as (tensors ``state.<index>.<key>``, JSON: param_groups and non-tensor state)."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entry in sd["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = _jsonable(value)
    groups = [{k: _jsonable(v) for k, v in group.items()} for group in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars, "class": type(optimizer).__name__}


def load_optimizer_state(optimizer, tensors: dict, meta: dict) -> None:
    state: dict = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    for index, entry in meta.get("scalars", {}).items():
        state.setdefault(int(index), {}).update({k: _from_json(v) for k, v in entry.items()})
    groups = [{k: _from_json(v) for k, v in group.items()} for group in meta["param_groups"]]
    current = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in current]:
        raise CheckpointError(
            "the checkpoint's optimizer holds different parameter groups than this run "
            f"({[len(g['params']) for g in groups]} vs {[len(g['params']) for g in current]}): the trainable set or "
            "the model changed since it was written; start over without --resume"
        )
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ----------------------------------------------------------------------------------------------------------------
# Model state
# ----------------------------------------------------------------------------------------------------------------


def trainable_state(module: torch.nn.Module, include_frozen: bool = False, include_buffers: bool = True) -> dict:
    """Name -> tensor of the parameters that require grad (all with ``include_frozen``), and persistent buffers.
    Shared parameters (tied embeddings) appear once."""
    out = {name: p for name, p in module.named_parameters() if include_frozen or p.requires_grad}
    if include_buffers:
        persistent = set()
        for mod_name, mod in module.named_modules():
            for b_name in mod._buffers:
                if b_name not in mod._non_persistent_buffers_set:
                    persistent.add(f"{mod_name}.{b_name}" if mod_name else b_name)
        out.update({name: b for name, b in module.named_buffers() if name in persistent and b is not None})
    return out


def _load_into(module: torch.nn.Module, tensors: dict, strict_names: bool = True) -> None:
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    missing = [k for k in tensors if k not in params and k not in buffers]
    if missing and strict_names:
        raise CheckpointError(f"checkpoint holds tensors this model lacks: {missing[:5]} (model changed?)")
    with torch.no_grad():
        for name, value in tensors.items():
            target = params.get(name, buffers.get(name))
            if target is None:
                continue
            if tuple(target.shape) != tuple(value.shape):
                raise CheckpointError(f"{name}: checkpoint shape {tuple(value.shape)} vs model {tuple(target.shape)}")
            target.copy_(value.to(target.dtype))


def load_tensors_into(module: torch.nn.Module, path) -> None:
    """Copy the tensors of a safetensors file into ``module``'s parameters/buffers of the same names."""
    _load_into(module, load_file(Path(path)))


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------


def _pointer(root: Path, name: str) -> Path:
    return root / f"{name}.latest.json"


def save_checkpoint(root, name: str, *, module: torch.nn.Module, optimizer, step: int, extra: Optional[dict] = None,
                    include_frozen: bool = False, keep: int = 1) -> Path:
    """Write checkpoint ``<root>/<name>-step<step>`` and point ``<root>/<name>.latest.json`` at it.

    ``module``: the (unwrapped) model or sub-module being trained; its trainable parameters and persistent buffers
    are stored (all parameters with ``include_frozen``). ``extra``: JSON-serialisable dict (cursor, scheduler,
    losses, options...)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-step{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        atomic_save_tensors(tmp / "params.safetensors", trainable_state(module, include_frozen))
        opt_tensors, opt_meta = flatten_optimizer_state(optimizer) if optimizer is not None else ({}, None)
        atomic_save_tensors(tmp / "optimizer.safetensors", opt_tensors)
        rng_tensors, rng_meta = capture_rng()
        atomic_save_tensors(tmp / "rng.safetensors", rng_tensors)
        state = {
            "format": FORMAT,
            "name": name,
            "step": int(step),
            "optimizer": opt_meta,
            "rng": rng_meta,
            "extra": extra or {},
            "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir())},
        }
        atomic_write_json(tmp / "state.json", state)
        os.chmod(tmp, 0o755)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_json(_pointer(root, name), {"checkpoint": final.name, "step": int(step)})
    # drop older checkpoints of this name (and leftovers of interrupted writes)
    older = sorted(p for p in root.glob(f"{name}-step*") if p.is_dir() and p != final)
    for path in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(path, ignore_errors=True)
    for leftover in root.glob(f".{name}-step*.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return final


def _valid(folder: Path) -> bool:
    try:
        state = json.loads((folder / "state.json").read_text())
        return all((folder / f).is_file() and (folder / f).stat().st_size == size for f, size in state["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def latest_checkpoint(root, name: str) -> Optional[Path]:
    """The checkpoint folder named by the pointer file, or (pointer lost) the newest valid one; None if none."""
    root = Path(root)
    pointer = _pointer(root, name)
    if pointer.is_file():
        try:
            folder = root / json.loads(pointer.read_text())["checkpoint"]
            if _valid(folder):
                return folder
        except (OSError, ValueError, KeyError):
            pass
    candidates = sorted((p for p in root.glob(f"{name}-step*") if p.is_dir() and _valid(p)), reverse=True)
    return candidates[0] if candidates else None


def load_checkpoint(folder, *, module: torch.nn.Module, optimizer=None, restore_rng_state: bool = True) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` into ``module`` / ``optimizer``; returns ``state.json``
    (``step``, ``extra``, ...)."""
    folder = Path(folder)
    if not _valid(folder):
        raise CheckpointError(f"{folder} is not a complete checkpoint")
    state = json.loads((folder / "state.json").read_text())
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{folder}: checkpoint format {state.get('format')} (this code reads {FORMAT})")
    _load_into(module, load_file(folder / "params.safetensors"))
    if optimizer is not None and state.get("optimizer") is not None:
        load_optimizer_state(optimizer, load_file(folder / "optimizer.safetensors"), state["optimizer"])
    if restore_rng_state:
        restore_rng(load_file(folder / "rng.safetensors"), state["rng"])
    return state


def remove_checkpoints(root, name: str) -> None:
    root = Path(root)
    for path in root.glob(f"{name}-step*"):
        shutil.rmtree(path, ignore_errors=True)
    _pointer(root, name).unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------------------
# The training loop
# ----------------------------------------------------------------------------------------------------------------


def lr_at(step: int, total: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps (at most a fifth of the run), then cosine from lr to lr * min_ratio at
    ``total``."""
    warmup = min(warmup, total // 5)
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    progress = min(max(progress, 0.0), 1.0)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class TrainingLoop:
    """The optimizer steps of one training run, with checkpoints every ``opts.checkpoint_every`` steps and resume.

    ``opts`` gives ``steps``, ``lr``, ``warmup``, ``min_lr_ratio`` and ``checkpoint_every`` (Stage1Options and
    Stage2Options both do). A parameter group's learning rate is the schedule's times its ``lr_scale`` (1 if
    absent). ``folder=None``: no checkpoints. ``writes=False``: this process does not write them (other ranks of a
    data-parallel run), and ``barrier`` (if given) is called after each one so that no rank runs ahead of a write.

    Each step's record (whatever the step function returns besides its loss) goes to ``history``, which checkpoints
    store under ``history_key`` and a resumed run gets back."""

    def __init__(self, opts, *, module: torch.nn.Module, optimizer, folder, name: str, label: str, lr_flag: str,
                 history_key: str = "history", writes: bool = True, barrier=None):
        self.opts, self.module, self.optimizer = opts, module, optimizer
        self.folder = None if folder is None else Path(folder)
        self.name, self.label, self.lr_flag = name, label, lr_flag
        self.history_key, self.writes, self.barrier = history_key, writes, barrier
        self.start = 0
        self.history: list = []
        self.resumed_from: Optional[Path] = None

    def resume(self) -> Optional[dict]:
        """Load the newest checkpoint, if any, into the module, the optimizer and the RNGs; returns its ``extra``
        (None when there is nothing to resume from)."""
        found = latest_checkpoint(self.folder, self.name) if self.folder is not None else None
        if found is None:
            return None
        state = load_checkpoint(found, module=self.module, optimizer=self.optimizer)
        self.start, self.resumed_from = state["step"], found
        self.history = state["extra"].get(self.history_key, [])
        return state["extra"]

    def run(self, step_fn, *, tokens_per_step: int = 0, progress=None, extra=None) -> None:
        """Steps ``start`` to ``opts.steps``: ``step_fn(step)`` computes the gradients, steps the optimizer and returns
        ``(loss, record)``. ``extra(done)``: what a checkpoint after ``done`` steps stores besides the history."""
        opts = self.opts
        for step in range(self.start, opts.steps):
            rate = lr_at(step, opts.steps, opts.lr, opts.warmup, opts.min_lr_ratio)
            for group in self.optimizer.param_groups:
                group["lr"] = rate * group.get("lr_scale", 1.0)
            loss, record = step_fn(step)
            if not math.isfinite(loss):
                raise FloatingPointError(f"{self.label}: loss became {loss} at step {step}; lower {self.lr_flag}")
            self.history.append(record)
            if progress is not None:
                progress.update(1, loss, tokens_per_step)
            done = step + 1
            if opts.checkpoint_every and done % opts.checkpoint_every == 0 and done < opts.steps:
                self.save(done, extra(done) if extra is not None else {})

    def loss_ends(self, loss=lambda record: record) -> tuple[Optional[float], Optional[float]]:
        """Mean loss over the first and over the last steps of the history (up to 10, a third of the run each)."""
        losses = [loss(record) for record in self.history]
        if not losses:
            return None, None
        k = max(1, min(10, len(losses) // 3))
        return sum(losses[:k]) / k, sum(losses[-k:]) / k

    def save(self, step: int, extra: dict, with_optimizer: bool = True) -> None:
        if self.folder is None:
            return
        if self.writes:
            save_checkpoint(self.folder, self.name, module=self.module,
                            optimizer=self.optimizer if with_optimizer else None, step=step,
                            extra={self.history_key: self.history, **extra})
        if self.barrier is not None:
            self.barrier()


# ----------------------------------------------------------------------------------------------------------------
# Deterministic data order
# ----------------------------------------------------------------------------------------------------------------


def sample_indices(seed: int, step: int, count: int, total: int, stream: int = 0) -> list[int]:
    """Indices (into ``total`` training windows) of the ``count`` samples of optimizer step ``step``.

    The sample stream is epoch after epoch of permutations of range(total); epoch ``e`` is shuffled by a generator
    seeded from (seed, stream, e). Step ``s`` takes stream positions [s * count, (s + 1) * count). A pure function,
    so the data cursor of a run is its step and resuming needs no iterator state. ``stream`` separates independent
    orders (e.g. one per stage-1 layer)."""
    if total <= 0:
        raise ValueError("no training windows")
    out: list[int] = []
    start = step * count
    cache: dict[int, torch.Tensor] = {}
    for position in range(start, start + count):
        epoch, offset = divmod(position, total)
        if epoch not in cache:
            g = torch.Generator().manual_seed((seed * 1_000_003 + stream * 7_919 + epoch) % (2**63))
            cache[epoch] = torch.randperm(total, generator=g)
        out.append(int(cache[epoch][offset]))
    return out


def cursor(step: int, count: int, total: int) -> dict:
    """JSON description of where a run stands in its data stream (for logs and checkpoints)."""
    position = step * count
    return {"step": int(step), "samples_seen": int(position), "epoch": position // max(total, 1),
            "offset_in_epoch": position % max(total, 1)}


def iter_files(folder) -> Iterable[Path]:
    return sorted(Path(folder).iterdir())


# ----------------------------------------------------------------------------------------------------------------
# Progress display
# ----------------------------------------------------------------------------------------------------------------


class Progress:
    """A tqdm bar (rank 0 only) showing the step count, time left, the smoothed loss and tokens/s.

    ``update(steps=1, loss=None, tokens=0)`` after each step; ``update_to(done)`` for counters; ``close()``.
    With ``enabled=False`` every call is a no-op (other ranks, or ``--no-progress``)."""

    def __init__(self, total: int, desc: str, enabled: bool = True, unit: str = "step", initial: int = 0):
        self.enabled = enabled
        self.loss = None
        self.tokens = 0
        self.started = None
        self.done = initial
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True, leave=True,
                            smoothing=0.1)

    def update(self, steps: int = 1, loss: Optional[float] = None, tokens: int = 0) -> None:
        import time

        if self.started is None:
            # the clock starts when the first step ends: counting that step's tokens over ~0 s printed nonsense
            self.started = time.time()
        else:
            self.tokens += tokens
        self.done += steps
        if loss is not None:
            self.loss = loss if self.loss is None else 0.9 * self.loss + 0.1 * loss
        if self.bar is None:
            return
        postfix = {}
        if self.loss is not None:
            postfix["loss"] = f"{self.loss:.4f}"
        elapsed = time.time() - self.started
        if self.tokens and elapsed > 0:
            postfix["tok/s"] = f"{self.tokens / elapsed:.0f}"
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(steps)

    def update_to(self, done: int) -> None:
        if done > self.done:
            self.update(done - self.done)

    def set_description(self, desc: str) -> None:
        if self.bar is not None:
            self.bar.set_description(desc, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
