# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Stage 2: end-to-end distillation on the logits.

    loss = T^2 * KL(softmax(teacher / T) || softmax(student / T))  [+ ce_weight * next-token cross-entropy]

averaged over every predicted token of the batch. The trainable set is a choice (``trainable``):

- ``all``: every parameter of the student (embeddings, norms, MLPs, mixers, LM head);
- ``mixer``: only the mixers (q/k/v/o projections, query slots, decay, window gates);
- ``lora``: PEFT LoRA adapters (rank ``lora_r``) on the mixers' q/k/v/o projections and the MLP linears, plus the
  mixers' own new parameters (query slots, decay, window gates), which have no teacher counterpart to stay close
  to. Adapters are merged into the weights at the end, so the saved model is a plain Aaren checkpoint.

Optimizer: AdamW with linear warmup and a cosine decay, gradient clipping, gradient accumulation over micro-batches
(``batch_size`` windows per optimizer step in total, ``micro_batch_size`` per forward, split across processes).
Data order: step s uses windows :func:`train_state.sample_indices` (seed, s), the same in one process or many, so a
run on N processes computes the same averaged gradient as one process (up to float summation order).
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import train_state as ts
from .init import is_new_parameter, mixer_attribute, never_trained

__all__ = ["Stage2Options", "TRAINABLE_SETS", "distill_loss", "heldout_kl", "run_stage2", "select_trainable"]

TRAINABLE_SETS = ("all", "mixer", "lora")
LORA_TARGETS = r".*\.(mixer\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj|fc_in|fc_out))"


@dataclass
class Stage2Options:
    steps: int = 24
    lr: float = 3e-5  # all parameters; 1e-4 made the held-out KL worse on SmolLM2-135M at these batch sizes
    batch_size: int = 4  # windows per optimizer step, over all processes
    micro_batch_size: int = 1  # windows per forward/backward
    warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    trainable: str = "all"
    ce_weight: float = 0.0
    temperature: float = 1.0
    lora_r: int = 8
    lora_alpha: int = 16
    checkpoint_every: int = 10  # optimizer steps (a 2,048-token step of SmolLM2-135M takes ~30 s on 2 cores); 0: only at the end
    eval_windows: int = 2  # held-out windows for the KL report before and after
    seq_len: Optional[int] = None  # crop training windows to this length (None: as given)


# ----------------------------------------------------------------------------------------------------------------
# Trainable set
# ----------------------------------------------------------------------------------------------------------------


def select_trainable(student, trainable: str, *, lora_r: int = 8, lora_alpha: int = 16, frozen_layers=()):
    """Set ``requires_grad`` for ``trainable`` ("all" | "mixer" | "lora") and return the model to train (a PEFT
    model for "lora"). A "fixed" decay stays frozen in every set, and so does the memory's retention score: it is
    fitted in stage 1 and only ranks tokens, so no gradient reaches it (and DDP refuses parameters without one).
    ``frozen_layers``: layers kept exactly as the teacher's (a hybrid teacher's local layers); when given, those
    blocks and everything outside the layers (embeddings, final norm, head) stay frozen too."""
    model = _select_trainable(student, trainable, lora_r=lora_r, lora_alpha=lora_alpha)
    if frozen_layers:
        frozen = {int(i) for i in frozen_layers}
        for name, p in model.named_parameters():
            found = LAYER_INDEX.search(name)
            if found is None or int(found.group(1)) in frozen:
                p.requires_grad_(False)
    return model


LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _select_trainable(student, trainable: str, *, lora_r: int = 8, lora_alpha: int = 16):
    if trainable not in TRAINABLE_SETS:
        raise ValueError(f"trainable must be one of {TRAINABLE_SETS}, got {trainable!r}")
    decay = getattr(student.config, "decay", None)

    def frozen_anyway(name: str) -> bool:
        return never_trained(mixer_attribute(name), decay)

    if trainable == "all":
        for name, p in student.named_parameters():
            p.requires_grad_(not frozen_anyway(name))
        return student
    if trainable == "mixer":
        for name, p in student.named_parameters():
            p.requires_grad_(".mixer." in name and not frozen_anyway(name))
        return student
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=LORA_TARGETS, bias="none")
    model = get_peft_model(student, config)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
        elif is_new_parameter(name) and "base_layer" not in name and not frozen_anyway(name):
            p.requires_grad_(True)
        else:
            p.requires_grad_(False)
    return model


def finish_trainable(model):
    """The plain student back from :func:`select_trainable`'s result (LoRA merged), every parameter trainable."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


# ----------------------------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------------------------


def distill_loss(student_logits, teacher_logits, input_ids=None, *, ce_weight: float = 0.0,
                 temperature: float = 1.0) -> tuple[torch.Tensor, float, float]:
    """(loss, kl, ce) averaged over tokens; logits [B, T, V]. KL is KL(teacher || student) at ``temperature``
    (times T^2, Hinton's scaling); CE is next-token cross-entropy on ``input_ids`` (only when ``ce_weight`` > 0)."""
    V = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, V) / temperature, -1)
    t = F.log_softmax(teacher_logits.float().reshape(-1, V) / temperature, -1)
    kl = F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2
    loss = kl
    ce_value = float("nan")
    if ce_weight > 0:
        if input_ids is None:
            raise ValueError("ce_weight > 0 needs input_ids")
        ce = F.cross_entropy(student_logits[:, :-1].float().reshape(-1, V), input_ids[:, 1:].reshape(-1))
        loss = loss + ce_weight * ce
        ce_value = float(ce.detach())
    return loss, float(kl.detach()), ce_value


@torch.no_grad()
def heldout_kl(student, teacher, windows: torch.Tensor, batch_size: int = 1) -> Optional[float]:
    """Mean per-token KL(teacher || student) on ``windows`` (None when there are none)."""
    if windows is None or windows.shape[0] == 0:
        return None
    device = next(student.parameters()).device
    was = student.training
    student.eval()
    total, count = 0.0, 0
    for s in range(0, windows.shape[0], batch_size):
        ids = windows[s : s + batch_size].to(device)
        t_logits = teacher(input_ids=ids, use_cache=False).logits
        s_logits = student(input_ids=ids, use_cache=False).logits
        _, kl, _ = distill_loss(s_logits, t_logits)
        total += kl * ids.numel()
        count += ids.numel()
    student.train(was)
    return total / count


# ----------------------------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------------------------


def _split(opts: Stage2Options, world: int) -> tuple[int, int]:
    """(windows per process per step, accumulation steps)."""
    if opts.batch_size % world:
        raise ValueError(f"stage 2 batch size {opts.batch_size} is not divisible by the {world} processes")
    per_rank = opts.batch_size // world
    if per_rank % opts.micro_batch_size:
        raise ValueError(
            f"stage 2: {per_rank} windows per process per step are not divisible by the micro-batch size "
            f"{opts.micro_batch_size}; choose --batch-size as a multiple of processes x micro-batch size"
        )
    return per_rank, per_rank // opts.micro_batch_size


def run_stage2(student, teacher, train_windows: torch.Tensor, heldout_windows: torch.Tensor, opts: Stage2Options,
               *, seed: int, work_dir: Path, accelerator=None, log: Optional[Callable[[str], None]] = None,
               progress_factory=None, frozen_layers=()):
    """Distil ``teacher`` into ``student``. Returns ``(student, summary)``; the student is the plain model (LoRA
    merged). Resumes from the newest checkpoint in ``work_dir/stage2``. ``frozen_layers``: see
    :func:`select_trainable`."""
    from accelerate import Accelerator

    say = log or (lambda message: None)
    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    world, main = accelerator.num_processes, accelerator.is_main_process
    accum = _split(opts, world)[1]
    windows = train_windows if opts.seq_len is None else train_windows[:, : opts.seq_len]
    N, T = windows.shape
    eval_windows = heldout_windows[: opts.eval_windows] if opts.eval_windows else heldout_windows[:0]
    if opts.seq_len is not None:
        eval_windows = eval_windows[:, : opts.seq_len]
    teacher.eval()

    with torch.random.fork_rng(devices=[]):  # LoRA's random init: a function of the seed, whatever ran before
        torch.manual_seed(seed + 2_000_003)
        model = select_trainable(student, opts.trainable, lora_r=opts.lora_r, lora_alpha=opts.lora_alpha,
                                 frozen_layers=frozen_layers)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(model, opts)
    n_train = sum(p.numel() for p in params)
    n_total = sum(p.numel() for p in student.parameters())
    summary = {"options": asdict(opts), "trainable_parameters": n_train, "total_parameters": n_total,
               "processes": world, "accumulation_steps": accum}
    loop = ts.TrainingLoop(opts, module=model, optimizer=optimizer, folder=Path(work_dir) / "stage2", name="stage2",
                           label="stage 2", lr_flag="--stage2-lr", writes=main,
                           barrier=accelerator.wait_for_everyone)
    resumed = loop.resume()
    if resumed is not None:
        summary.update(resumed.get("summary", {}))
        say(f"stage 2: resumed at step {loop.start} from {loop.resumed_from.name}")
    else:
        summary["heldout_kl_before"] = heldout_kl(student, teacher, eval_windows) if main else None
    say(f"stage 2: {opts.steps} steps x {opts.batch_size} windows of {T} tokens ({opts.trainable}: "
        f"{n_train / 1e6:.2f}M of {n_total / 1e6:.2f}M parameters trainable; {world} process(es), "
        f"{accum} accumulation step(s) of {opts.micro_batch_size})"
        + (f"; held-out KL before {summary['heldout_kl_before']:.4f}" if summary.get("heldout_kl_before") is not None
           else ""))

    ddp = accelerator.prepare(model) if world > 1 else model
    ddp.train()
    started = time.time()
    bar = progress_factory(opts.steps, "stage 2: distill", initial=loop.start) if progress_factory else None
    step_fn = _distill_step(ddp, params, teacher, windows, optimizer, opts, seed=seed, accelerator=accelerator)
    loop.run(step_fn, tokens_per_step=opts.batch_size * T, progress=bar,
             extra=lambda done: {"summary": _json_summary(summary), "cursor": ts.cursor(done, opts.batch_size, N)})
    if bar is not None:
        bar.close()
    if loop.start < opts.steps or resumed is None:
        # the final state, so that a crash during evaluation or saving does not lose the training
        loop.save(opts.steps, {"summary": _json_summary(summary), "final": True}, with_optimizer=False)
    model.eval()
    student = finish_trainable(model)
    if "heldout_kl_after" not in summary:
        summary["heldout_kl_after"] = heldout_kl(student, teacher, eval_windows) if main else None
    summary["train_loss_first"], summary["train_loss_last"] = loop.loss_ends(lambda record: record[1])
    summary["history"] = loop.history
    summary["tokens"] = opts.steps * opts.batch_size * T
    summary["seconds"] = round(time.time() - started, 1)
    if summary.get("heldout_kl_after") is not None:
        say(f"stage 2: held-out KL {summary.get('heldout_kl_before') or float('nan'):.4f} -> "
            f"{summary['heldout_kl_after']:.4f}; train loss {summary['train_loss_first']:.4f} -> "
            f"{summary['train_loss_last']:.4f} ({summary['seconds']:.0f} s)")
    return student, summary


def _optimizer(model, opts: Stage2Options):
    """AdamW; no weight decay on vectors (norms, biases) and on the mixers' new parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or is_new_parameter(name) else decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": opts.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95))


def _distill_step(ddp, params: list, teacher, windows: torch.Tensor, optimizer, opts: Stage2Options, *, seed: int,
                  accelerator):
    """The step function of :class:`train_state.TrainingLoop`: one optimizer step over ``opts.batch_size`` windows,
    this process's share in micro-batches with gradient accumulation; returns (loss, [step, loss, kl, grad
    norm]), loss and KL averaged over all processes."""
    world, rank = accelerator.num_processes, accelerator.process_index
    per_rank, accum = _split(opts, world)

    def step_fn(step: int):
        idx = ts.sample_indices(seed, step, opts.batch_size, windows.shape[0], stream=0)
        mine = idx[rank * per_rank : (rank + 1) * per_rank]
        optimizer.zero_grad(set_to_none=True)
        step_loss = step_kl = 0.0
        for m in range(accum):
            ids = windows[mine[m * opts.micro_batch_size : (m + 1) * opts.micro_batch_size]].to(accelerator.device)
            with torch.no_grad():
                t_logits = teacher(input_ids=ids, use_cache=False).logits
            sync = m == accum - 1
            ctx = accelerator.no_sync(ddp) if (world > 1 and not sync) else contextlib.nullcontext()
            with ctx:
                s_logits = ddp(input_ids=ids, use_cache=False).logits
                loss, kl, _ = distill_loss(s_logits, t_logits, ids, ce_weight=opts.ce_weight,
                                           temperature=opts.temperature)
                accelerator.backward(loss / accum)
            step_loss += float(loss.detach()) / accum
            step_kl += kl / accum
            del t_logits, s_logits, loss
        grad_norm = None
        if opts.grad_clip and opts.grad_clip > 0:
            grad_norm = accelerator.clip_grad_norm_(params, opts.grad_clip)
        optimizer.step()
        if world > 1:
            reduced = accelerator.reduce(torch.tensor([step_loss, step_kl], device=accelerator.device), "mean")
            step_loss, step_kl = (float(v) for v in reduced)
        return step_loss, [step + 1, round(step_loss, 6), round(step_kl, 6),
                           None if grad_norm is None else round(float(grad_norm), 4)]

    return step_fn


def _json_summary(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k in ("heldout_kl_before",)}
