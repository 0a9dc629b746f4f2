# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Stage 1: attention transfer, layer by layer.

The teacher runs once over the training windows; forward hooks capture, for every layer, its attention module's
input (the normalised hidden states) and output (after the output projection), stored in bf16 (in RAM, or in
memory-mapped files in the work folder when they would not fit comfortably). Each student layer's ``AarenMixer`` is
then trained alone to reproduce that output from that input:

    loss = mean((mixer(x) - y)^2) / var(y)        (var over the layer's training targets: the loss is an FVU)

and its fraction of variance unexplained (FVU = sum (y - y_hat)^2 / sum (y - mean y)^2, mean per feature) is reported
on held-out windows before and after training. Layers are independent: with several processes each trains a
contiguous block of layers (and runs the teacher only up to its last layer), then every layer's mixer weights are
broadcast from the process that trained it. Within a layer, training checkpoints every ``checkpoint_every`` steps;
a finished layer is stored as ``stage1/layer_XXX.safetensors`` + ``.json``, so a resumed run skips it.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import load_file

from aaren_hf.modeling_aaren import AarenMixer

from . import train_state as ts
from .adapters import teacher_layers
from .init import never_trained, set_window_share
from .retention import coverage, fit_retention, rule_scores, teacher_attention, visible_share

__all__ = ["Stage1Options", "capture_attention", "fvu", "run_stage1", "train_mixer", "mixer_trainable_parameters"]


@dataclass
class Stage1Options:
    steps: int = 150  # optimizer steps per layer
    lr: float = 1e-3
    batch_size: int = 2  # windows per step
    warmup: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    train_teacher_weights: bool = True  # q/k/v/o (teacher-initialised) trainable; False: only the new parameters
    projection_lr_scale: float = 0.1  # lr multiplier of the teacher-initialised projections
    windows: Optional[int] = 32  # training windows to capture (None: all given)
    heldout_windows: int = 4  # held-out windows for the FVU report
    capture_dtype: str = "bfloat16"
    checkpoint_every: int = 50  # steps; 0: only at the end of a layer
    capture_batch_size: int = 2
    memory_fraction: float = 0.4  # keep captured activations in RAM below this share of available memory


# ----------------------------------------------------------------------------------------------------------------
# Capture
# ----------------------------------------------------------------------------------------------------------------


class _StopForward(Exception):
    pass


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _store(shape, dtype, path: Optional[Path]) -> torch.Tensor:
    if path is None:
        return torch.empty(shape, dtype=dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    numel = math.prod(shape)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)


@torch.no_grad()
def capture_attention(teacher, windows: torch.Tensor, layers: list[int], *, dtype=torch.bfloat16,
                      batch_size: int = 2, spill_dir: Optional[Path] = None, memory_fraction: float = 0.4,
                      progress: Optional[Callable[[int], None]] = None, log: Optional[Callable[[str], None]] = None,
                      device=None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Run ``teacher`` on ``windows`` [N, T] and return ``{layer: (x, y)}`` for the requested layers: the attention
    module's input and output, [N, T, E] in ``dtype`` on the CPU. The forward stops after the last requested layer.
    Spills to memory-mapped files under ``spill_dir`` when the activations would exceed ``memory_fraction`` of the
    available memory."""
    say = log or (lambda message: None)
    tlayers = teacher_layers(teacher)
    layers = sorted(set(layers))
    if not layers:
        return {}
    N, T = windows.shape
    E = teacher.config.hidden_size if hasattr(teacher.config, "hidden_size") else teacher.config.n_embd
    need = 2 * len(layers) * N * T * E * torch.empty((), dtype=dtype).element_size()
    spill = spill_dir is not None and need > memory_fraction * _available_memory()
    if spill:
        say(f"stage 1: activations need {need / 2**30:.1f} GiB; memory-mapping them under {spill_dir}")
    store = {
        i: (_store((N, T, E), dtype, spill_dir / f"x{i:03d}.bin" if spill else None),
            _store((N, T, E), dtype, spill_dir / f"y{i:03d}.bin" if spill else None))
        for i in layers
    }
    last = layers[-1]
    cursor = {"start": 0}
    hooks = []
    for i in layers:
        attention = tlayers[i].attention

        def hook(module, args, kwargs, output, index=i):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            y = output[0] if isinstance(output, (tuple, list)) else output
            s = cursor["start"]
            store[index][0][s : s + x.shape[0]] = x.detach().to("cpu", dtype)
            store[index][1][s : s + y.shape[0]] = y.detach().to("cpu", dtype)
            if index == last:
                raise _StopForward

        hooks.append(attention.register_forward_hook(hook, with_kwargs=True))
    was_training = teacher.training
    teacher.eval()
    device = device or next(teacher.parameters()).device
    try:
        for start in range(0, N, batch_size):
            cursor["start"] = start
            try:
                teacher(input_ids=windows[start : start + batch_size].to(device), use_cache=False)
            except _StopForward:
                pass
            if progress is not None:
                progress(min(start + batch_size, N))
    finally:
        for h in hooks:
            h.remove()
        teacher.train(was_training)
    for i, (x, y) in store.items():
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            raise FloatingPointError(f"layer {i}: non-finite teacher activations captured in {dtype}")
    return store


# ----------------------------------------------------------------------------------------------------------------
# Training one mixer
# ----------------------------------------------------------------------------------------------------------------


def mixer_trainable_parameters(mixer, train_teacher_weights: bool = True) -> tuple[list, list]:
    """(new parameters, teacher-initialised parameters) of a mixer that will train; frozen ones get
    ``requires_grad=False`` (:func:`init.never_trained`). New: ``AarenMixer.NEW_PARAMETERS``; the rest came from
    the teacher."""
    new, inherited = [], []
    for name, p in mixer.named_parameters():
        top = name.split(".", 1)[0]
        if never_trained(top, getattr(mixer, "decay", None)):
            p.requires_grad_(False)
        elif top in AarenMixer.NEW_PARAMETERS:
            p.requires_grad_(True)
            new.append(p)
        else:
            p.requires_grad_(train_teacher_weights)
            if train_teacher_weights:
                inherited.append(p)
    return new, inherited


def _positions(B, T, device):
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    pos = torch.arange(T, device=device).expand(B, T)
    return mask, pos


@torch.no_grad()
def fvu(mixer, x: torch.Tensor, y: torch.Tensor, batch_size: int = 4) -> float:
    """Held-out fraction of variance unexplained of ``mixer`` on inputs ``x`` and targets ``y`` [N, T, E]."""
    if x.shape[0] == 0:
        return float("nan")
    device = next(mixer.parameters()).device
    y64 = y.double()
    mean = y64.reshape(-1, y.shape[-1]).mean(0)
    denom = float((y64 - mean).pow(2).sum())
    num = 0.0
    for s in range(0, x.shape[0], batch_size):
        xb = x[s : s + batch_size].to(device, torch.float32)
        mask, pos = _positions(xb.shape[0], xb.shape[1], device)
        pred = mixer(xb, mask, pos).double().cpu()
        num += float((pred - y64[s : s + batch_size]).pow(2).sum())
    return num / max(denom, 1e-30)


def _target_variance(y: torch.Tensor) -> float:
    """Mean over features of the variance of the targets (the loss denominator), computed in chunks."""
    E = y.shape[-1]
    total = torch.zeros(E, dtype=torch.float64)
    total_sq = torch.zeros(E, dtype=torch.float64)
    count = 0
    for s in range(0, y.shape[0], 8):
        chunk = y[s : s + 8].reshape(-1, E).double()
        total += chunk.sum(0)
        total_sq += chunk.pow(2).sum(0)
        count += chunk.shape[0]
    mean = total / count
    return float((total_sq / count - mean.pow(2)).mean())


def train_mixer(mixer, x: torch.Tensor, y: torch.Tensor, opts: Stage1Options, *, seed: int, layer: int,
                checkpoint_dir: Optional[Path] = None, heldout: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                progress=None, log: Optional[Callable[[str], None]] = None) -> dict:
    """Train ``mixer`` to map x -> y (both [N, T, E]); returns a record with losses and held-out FVU.

    Deterministic given (seed, layer): step s uses windows :func:`train_state.sample_indices` (seed, s, stream=layer).
    With ``checkpoint_dir`` the optimizer state, parameters and step are saved every ``opts.checkpoint_every`` steps
    and training resumes from there."""
    say = log or (lambda message: None)
    device = next(mixer.parameters()).device
    new, inherited = mixer_trainable_parameters(mixer, opts.train_teacher_weights)
    groups = [{"params": new, "lr": opts.lr, "lr_scale": 1.0}]
    if inherited:
        groups.append({"params": inherited, "lr": opts.lr * opts.projection_lr_scale,
                       "lr_scale": opts.projection_lr_scale})
    optimizer = torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.99), weight_decay=opts.weight_decay)
    var = _target_variance(y)
    record = {"layer": layer, "steps": opts.steps, "target_variance": var}
    if heldout is not None:
        record["heldout_fvu_before"] = fvu(mixer, *heldout)
    loop = ts.TrainingLoop(opts, module=mixer, optimizer=optimizer, folder=checkpoint_dir, name=f"layer{layer:03d}",
                           label=f"stage 1 layer {layer}", lr_flag="--stage1-lr", history_key="losses")
    resumed = loop.resume()
    if resumed is not None:
        record.update(resumed.get("record", {}))
        say(f"stage 1 layer {layer}: resumed at step {loop.start}")
    N, T = x.shape[:2]
    mask, pos = _positions(opts.batch_size, T, device)
    params = [p for g in groups for p in g["params"]]

    def step_fn(step: int):
        idx = ts.sample_indices(seed, step, opts.batch_size, N, stream=1 + layer)
        xb = x[idx].to(device, torch.float32)
        yb = y[idx].to(device, torch.float32)
        pred = mixer(xb, mask[: len(idx)], pos[: len(idx)])
        loss = (pred.float() - yb).pow(2).mean() / var
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if opts.grad_clip and opts.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, opts.grad_clip)
        optimizer.step()
        value = float(loss.detach())
        return value, round(value, 6)

    mixer.train()
    started = time.time()
    loop.run(step_fn, tokens_per_step=opts.batch_size * T, progress=progress,
             extra=lambda done: {"record": record, "cursor": ts.cursor(done, opts.batch_size, N)})
    mixer.eval()
    record["train_loss_first"], record["train_loss_last"] = loop.loss_ends()
    record["losses"] = loop.history
    record["seconds"] = round(time.time() - started, 1)
    if heldout is not None:
        record["heldout_fvu_after"] = fvu(mixer, *heldout)
    return record


# ----------------------------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------------------------


def layer_split(num_layers: int, world: int) -> list[list[int]]:
    """Contiguous blocks of layers per rank (sizes differ by at most one)."""
    base, extra = divmod(num_layers, world)
    out, start = [], 0
    for r in range(world):
        size = base + (1 if r < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def _layer_files(folder: Path, layer: int) -> tuple[Path, Path]:
    return folder / f"layer_{layer:03d}.safetensors", folder / f"layer_{layer:03d}.json"


def _load_layer(folder: Path, layer: int, mixer) -> Optional[dict]:
    import json

    weights, meta = _layer_files(folder, layer)
    if not (weights.is_file() and meta.is_file()):
        return None
    try:
        record = json.loads(meta.read_text())
        tensors = load_file(weights)
    except (OSError, ValueError):
        return None
    ts._load_into(mixer, tensors)
    return record


def _broadcast_mixers(student, owners: list[list[int]], accelerator) -> None:
    import torch.distributed as dist

    for rank, layers in enumerate(owners):
        for i in layers:
            for tensor in list(student.model.layers[i].mixer.parameters()) + list(student.model.layers[i].mixer.buffers()):
                data = tensor.data
                dist.broadcast(data, src=rank)


def _broadcast_records(records: dict, num_layers: int, accelerator) -> dict:
    """Every rank learns every layer's FVU numbers (a float tensor all-reduced; no pickling)."""
    import torch.distributed as dist

    keys = ("heldout_fvu_before", "heldout_fvu_after", "train_loss_first", "train_loss_last", "seconds")
    table = torch.zeros(num_layers, len(keys), dtype=torch.float64)
    for i, rec in records.items():
        for j, key in enumerate(keys):
            value = rec.get(key)
            table[i, j] = float("nan") if value is None else float(value)
    present = torch.zeros(num_layers, dtype=torch.float64)
    for i in records:
        present[i] = 1
    table = torch.nan_to_num(table, nan=0.0)
    dist.all_reduce(table)
    dist.all_reduce(present)
    out = {}
    for i in range(num_layers):
        out[i] = dict(records.get(i, {}))
        out[i].update({key: float(table[i, j]) for j, key in enumerate(keys)})
        out[i]["layer"] = i
    return out


def run_stage1(student, teacher, train_windows: torch.Tensor, heldout_windows: torch.Tensor, opts: Stage1Options,
               *, seed: int, work_dir: Path, accelerator=None, log: Optional[Callable[[str], None]] = None,
               progress_factory=None, frozen_layers=()) -> dict:
    """Stage 1 on every layer of ``student`` (in place). Returns ``{"layers": [record, ...], "seconds": ...}``.

    ``progress_factory(total, desc)`` returns a :class:`train_state.Progress` (or None: no display).
    ``frozen_layers``: layers that already compute the teacher's attention exactly (a hybrid teacher's local
    layers): neither captured nor trained, recorded as ``{"unchanged": True}``."""
    say = log or (lambda message: None)
    started = time.time()
    folder = Path(work_dir) / "stage1"
    folder.mkdir(parents=True, exist_ok=True)
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    num_layers = len(student.model.layers)
    frozen = {int(i) for i in frozen_layers}
    trained = [i for i in range(num_layers) if i not in frozen]
    owners = [[trained[j] for j in block] for block in layer_split(len(trained), world)]
    mine = owners[rank]
    windows = train_windows if opts.windows is None else train_windows[: opts.windows]
    heldout = heldout_windows[: opts.heldout_windows] if opts.heldout_windows else heldout_windows[:0]

    records: dict[int, dict] = {}
    todo = []
    for i in mine:
        rec = _load_layer(folder, i, student.model.layers[i].mixer)
        if rec is not None:
            records[i] = rec
        else:
            todo.append(i)
    if len(todo) < len(mine):
        say(f"stage 1: {len(mine) - len(todo)} layer(s) already trained (resumed)")

    if todo:
        acts, held = _capture_layers(teacher, windows, heldout, todo, opts, folder / f"activations-rank{rank}", say,
                                     progress_factory)
        records.update(_train_layers(student, teacher, acts, held, todo, opts, seed, folder, say, progress_factory))
        shutil.rmtree(folder / f"activations-rank{rank}", ignore_errors=True)

    for i in range(num_layers):
        student.model.layers[i].mixer.requires_grad_(True)
    if world > 1:
        accelerator.wait_for_everyone()
        _broadcast_mixers(student, owners, accelerator)
        records = _broadcast_records(records, num_layers, accelerator)
    for i in frozen:
        records[i] = {"layer": i, "unchanged": True}
    layers = [{k: v for k, v in records[i].items() if k != "losses"} for i in range(num_layers)]
    fvus = [r.get("heldout_fvu_after") for r in layers if r.get("heldout_fvu_after") is not None]
    memory = [r["memory"] for r in layers if r.get("memory")]
    summary = {
        "memory": {k: _mean([m.get(k) for m in memory]) for k in memory[0]} if memory else None,
        "layers": layers,
        "mean_heldout_fvu_before": _mean([r.get("heldout_fvu_before") for r in layers]),
        "mean_heldout_fvu_after": _mean(fvus),
        "options": asdict(opts),
        "seconds": round(time.time() - started, 1),
    }
    return summary


def _capture_layers(teacher, windows: torch.Tensor, heldout: torch.Tensor, layers: list[int], opts: Stage1Options,
                    spill: Path, say, progress_factory) -> tuple[dict, dict]:
    """The teacher's attention inputs and outputs for ``layers``: (on the training windows, on the held-out ones)."""
    dtype = getattr(torch, opts.capture_dtype)
    say(f"stage 1: capturing teacher attention for layers {layers[0]}-{layers[-1]} on {windows.shape[0]} training "
        f"+ {heldout.shape[0]} held-out windows of {windows.shape[1]} tokens ({opts.capture_dtype})")
    t0 = time.time()
    bar = progress_factory(windows.shape[0] + heldout.shape[0], "stage 1: capture") if progress_factory else None
    acts = capture_attention(teacher, windows, layers, dtype=dtype, batch_size=opts.capture_batch_size,
                             spill_dir=spill, memory_fraction=opts.memory_fraction,
                             progress=bar.update_to if bar else None, log=say)
    base = windows.shape[0]
    held = {}
    if heldout.shape[0]:
        held = capture_attention(teacher, heldout, layers, dtype=dtype, batch_size=opts.capture_batch_size,
                                 progress=(lambda n: bar.update_to(base + n)) if bar else None)
    if bar:
        bar.close()
    say(f"stage 1: capture took {time.time() - t0:.0f} s")
    return acts, held


def _train_layers(student, teacher, acts: dict, held: dict, layers: list[int], opts: Stage1Options, seed: int,
                  folder: Path, say, progress_factory) -> dict[int, dict]:
    """Train each layer's mixer on its captured activations (fit its memory tier too), store it as a finished
    layer (:func:`_layer_files`) and drop its checkpoints; returns the layers' records. ``acts`` and ``held`` are
    emptied as the layers are done, to free their memory."""
    records = {}
    bar = progress_factory(len(layers) * opts.steps, "stage 1: layers") if progress_factory else None
    tlayers = teacher_layers(teacher)
    for i in layers:
        mixer = student.model.layers[i].mixer
        x, y = acts.pop(i)
        ho = held.pop(i) if i in held else None
        ho32 = (ho[0].float(), ho[1].float()) if ho is not None else None
        if bar is not None:
            bar.set_description(f"stage 1: layer {i}")
        memory = None
        if getattr(mixer, "memory_size", 0) > 0:  # first: the window gate starts from what the memory will hold
            memory = fit_memory(mixer, tlayers[i], x, ho32[0] if ho32 is not None else None)
            say(f"stage 1 layer {i:2d}: memory " + ", ".join(f"{k} {v:.3f}" for k, v in memory.items()))
        rec = train_mixer(mixer, x, y, opts, seed=seed, layer=i, checkpoint_dir=folder / "checkpoints",
                          heldout=ho32, progress=bar, log=say)
        if memory is not None:
            rec["memory"] = memory
        weights, meta = _layer_files(folder, i)
        ts.atomic_save_tensors(weights, ts.trainable_state(mixer, include_frozen=True))
        ts.atomic_write_json(meta, rec)
        ts.remove_checkpoints(folder / "checkpoints", f"layer{i:03d}")
        records[i] = rec
        say(f"stage 1 layer {i:2d}: loss {rec['train_loss_first']:.3f} -> {rec['train_loss_last']:.3f}, "
            f"held-out FVU {rec.get('heldout_fvu_before', float('nan')):.3f} -> "
            f"{rec.get('heldout_fvu_after', float('nan')):.3f} ({rec['seconds']:.0f} s)")
        del x, y
    if bar:
        bar.close()
    return records


def fit_memory(mixer, teacher_layer, x: torch.Tensor, heldout_x: Optional[torch.Tensor], batch: int = 4) -> dict:
    """Fit the memory tier's retention score to the teacher's attention on the captured windows, start the window
    gate (Aaren layers) from the share of that attention the window branch now sees (window, sinks and memory;
    ``window_share``: the mean over heads), and measure on held-out windows the share of beyond-window attention
    each rule keeps (docs/conversion.md: why "learned")."""
    inv_freq = mixer.rope_inv_freq
    attn = torch.cat([teacher_attention(teacher_layer, x[s : s + batch], inv_freq) for s in range(0, x.shape[0], batch)])
    out = {}
    if mixer.memory_rule == "learned":
        out["fit_r2"] = fit_retention(mixer, x.float(), attn)["r2"]
    if mixer.aaren_branch:  # the gate's start: the share of the teacher's attention the branch now sees
        share = sum(visible_share(attn[s : s + batch], rule_scores(mixer, x[s : s + batch], mixer.memory_rule),
                                  mixer.window, mixer.num_sinks, mixer.memory_size) * attn[s : s + batch].shape[0]
                    for s in range(0, x.shape[0], batch)) / x.shape[0]
        shares = set_window_share(mixer, share)
        out["window_share"] = sum(shares) / len(shares)
    del attn
    if heldout_x is not None and heldout_x.shape[0]:
        attn = teacher_attention(teacher_layer, heldout_x, inv_freq)
        rules = [r for r in ("learned", "aaren", "recent")
                 if (r != "learned" or mixer.memory_rule == "learned") and (r != "aaren" or mixer.aaren_branch)]
        for rule in rules:
            scores = rule_scores(mixer, heldout_x, rule)
            out[f"coverage_{rule}"] = coverage(attn, scores, mixer.window, mixer.num_sinks, mixer.memory_size)
    return out


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None
