# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Initialise what the teacher lacks from the teacher's own statistics on calibration text.

The mapped weights (embeddings, norms, q/k/v/o projections, MLPs, rotary frequencies) come from
:func:`aaren_hf.conversion.adapters.map_teacher_state_dict`. What is new in an Aaren mixer is set here, from a few
calibration windows run through the teacher with eager attention (so the attention probabilities are visible):

- ``queries`` [H, J, D]: per query head, k-means (J centroids, k-means++ seeding and a few Lloyd iterations, all
  seeded) of the teacher's queries before rotary. Each centroid is rescaled to the RMS norm of the queries in its
  cluster, so that <c, k> * D**-0.5 has the spread of the teacher's own scores (an average of queries is shorter
  than a typical query and would give flat scores). With one slot (the paper's form) the single query is the
  rescaled mean query.
- ``log_decay`` [H, J]: rate ~ 1 / (the head's mean attention distance), measured on the calibration windows for
  queries in the second half of each window, sink tokens excluded when the window branch keeps sinks. The J slots
  of a head get rates spread geometrically around it (x 1/spread ... x spread).
- ``window_gate`` [H] (or ``gate_proj.bias`` with an input gate): logit of the share of the head's attention mass
  that falls inside what the window branch sees (last W tokens + S sinks), clipped to [0.05, 0.95]: heads that the
  window already reproduces start with the window branch dominant. With a memory tier, stage 1 sets it again once
  the retention score is fitted, from the share inside window, sinks and memory (what the branch then sees).
- ``rope_inv_freq``: copied from the teacher by the adapter; kept as mapped.

Everything is deterministic given the seed.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch

from aaren_hf.modeling_aaren import AarenMixer

from .adapters import teacher_layers, teacher_qkv

__all__ = ["attention_statistics", "kmeans", "initialize_student", "set_window_share", "spread_multipliers"]


# ----------------------------------------------------------------------------------------------------------------
# k-means
# ----------------------------------------------------------------------------------------------------------------


def kmeans(points: torch.Tensor, k: int, iterations: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means of ``points`` [M, D] (float32): k-means++ seeding then Lloyd iterations. Returns (centroids [k, D],
    assignment [M]). An empty cluster is re-seeded with the point farthest from its centroid. Deterministic."""
    points = points.float()
    M = points.shape[0]
    if M == 0:
        raise ValueError("k-means of an empty point set")
    g = torch.Generator().manual_seed(int(seed))
    first = int(torch.randint(M, (1,), generator=g))
    centroids = [points[first]]
    d2 = (points - centroids[0]).pow(2).sum(-1)
    for _ in range(1, k):
        total = float(d2.sum())
        if total <= 0:  # fewer distinct points than clusters
            idx = int(torch.randint(M, (1,), generator=g))
        else:
            idx = int(torch.multinomial(d2 / total, 1, generator=g))
        centroids.append(points[idx])
        d2 = torch.minimum(d2, (points - points[idx]).pow(2).sum(-1))
    c = torch.stack(centroids).clone()
    assign = torch.zeros(M, dtype=torch.long)
    for _ in range(max(1, iterations)):
        dist = torch.cdist(points, c)  # [M, k]
        assign = dist.argmin(-1)
        for j in range(k):
            members = assign == j
            if members.any():
                c[j] = points[members].mean(0)
            else:
                far = int(dist.min(-1).values.argmax())
                c[j] = points[far]
                assign[far] = j
    return c, assign


def spread_multipliers(num_slots: int, spread: float) -> torch.Tensor:
    """[J] geometric factors from 1/spread to spread (1 for a single slot)."""
    if num_slots == 1 or spread <= 1.0:
        return torch.ones(num_slots)
    exps = torch.linspace(-1.0, 1.0, num_slots)
    return torch.tensor(float(spread)).pow(exps)


# ----------------------------------------------------------------------------------------------------------------
# Teacher statistics on calibration windows
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _eager_attention(model):
    """Switch the teacher to eager attention (probabilities visible) for the duration, then back."""
    previous = getattr(model.config, "_attn_implementation", None)
    switched = False
    if previous != "eager" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
        switched = True
    try:
        yield model
    finally:
        if switched and previous is not None:
            model.set_attn_implementation(previous)


def _attention_input(args, kwargs):
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    if args:
        return args[0]
    raise RuntimeError("cannot find the attention module's input (no hidden_states argument)")


@torch.no_grad()
def attention_statistics(teacher, windows: torch.Tensor, *, window_size: int = 0, num_sink_tokens: int = 0,
                         keep_inputs: bool = True, progress: Optional[Callable[[int], None]] = None) -> dict:
    """Run ``teacher`` (eager attention) on ``windows`` [N, T], one at a time, and return per layer:
    ``inputs`` (the attention module's input [N, T, E], float32, when ``keep_inputs``), ``mean_distance`` [H]
    (mean of t - i under the attention probabilities, queries t >= T/2, sink keys excluded when the window branch
    keeps sinks), ``window_mass`` [H] (share of attention inside the window branch's view: keys t - i < W or i < S,
    queries t >= W + S; None without a window) and ``sink_mass`` [H] (attention on key 0)."""
    layers = teacher_layers(teacher)
    L = len(layers)
    N, T = windows.shape
    captured: dict[int, list[torch.Tensor]] = {i: [] for i in range(L)}
    hooks = []
    if keep_inputs:
        for layer in layers:
            def pre_hook(module, args, kwargs, index=layer.index):
                captured[index].append(_attention_input(args, kwargs).detach().float().cpu())
            hooks.append(layer.attention.register_forward_pre_hook(pre_hook, with_kwargs=True))

    t = torch.arange(T).view(T, 1)
    i = torch.arange(T).view(1, T)
    dist = (t - i).clamp(min=0).float()
    q_far = torch.arange(T) >= T // 2
    excluded = i < num_sink_tokens if (window_size > 0 and num_sink_tokens > 0) else torch.zeros(1, T, dtype=torch.bool)
    if window_size > 0:
        visible = ((t - i) < window_size) | (i < num_sink_tokens)
        q_win = torch.arange(T) >= window_size + num_sink_tokens
        if not q_win.any():
            q_win = torch.ones(T, dtype=torch.bool)
    dist_sum = None
    win_sum = None
    sink_sum = None
    try:
        with _eager_attention(teacher):
            teacher.eval()
            for n in range(N):
                out = teacher(input_ids=windows[n : n + 1], output_attentions=True, use_cache=False)
                if out.attentions is None or len(out.attentions) != L:
                    raise RuntimeError("the teacher returned no attention probabilities with eager attention")
                for layer_idx, probs in enumerate(out.attentions):
                    p = probs[0].float()  # [H, T, T]
                    H = p.shape[0]
                    if dist_sum is None:
                        dist_sum = torch.zeros(L, H)
                        win_sum = torch.zeros(L, H)
                        sink_sum = torch.zeros(L, H)
                    pk = p.masked_fill(excluded, 0.0)
                    norm = pk.sum(-1).clamp(min=1e-9)  # [H, T]
                    mean_d = (pk * dist).sum(-1) / norm  # [H, T]
                    dist_sum[layer_idx] += mean_d[:, q_far].mean(-1)
                    sink_sum[layer_idx] += p[:, :, 0][:, q_far].mean(-1)
                    if window_size > 0:
                        mass = (p * visible).sum(-1)  # [H, T]
                        win_sum[layer_idx] += mass[:, q_win].mean(-1)
                del out
                if progress is not None:
                    progress(n + 1)
    finally:
        for h in hooks:
            h.remove()
    stats = {}
    for layer_idx in range(L):
        stats[layer_idx] = {
            "inputs": torch.cat(captured[layer_idx]) if keep_inputs else None,
            "mean_distance": dist_sum[layer_idx] / N,
            "window_mass": (win_sum[layer_idx] / N) if window_size > 0 else None,
            "sink_mass": sink_sum[layer_idx] / N,
        }
    return stats


# ----------------------------------------------------------------------------------------------------------------
# Initialisation
# ----------------------------------------------------------------------------------------------------------------


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


@torch.no_grad()
def set_window_share(mixer, share: torch.Tensor, clip: tuple[float, float] = (0.05, 0.95)) -> list[float]:
    """Set the window gate (``window_gate`` [H], or an input gate's bias) so that each head starts with ``share``
    [H] of its output from the window branch, clipped to ``clip``; returns the shares set. Called here with the
    share of the teacher's attention inside the window and sinks, and again by stage 1 once a memory tier's
    retention score is fitted, with the share inside window, sinks and memory."""
    share = share.float().clamp(*clip)
    logits = torch.tensor([_logit(float(p)) for p in share])
    if hasattr(mixer, "window_gate"):
        mixer.window_gate.copy_(logits.to(mixer.window_gate.dtype))
    elif hasattr(mixer, "gate_proj"):
        mixer.gate_proj.weight.zero_()
        mixer.gate_proj.bias.copy_(logits.to(mixer.gate_proj.bias.dtype))
    return [round(float(v), 3) for v in share]


@torch.no_grad()
def initialize_student(student, teacher, calibration_windows: torch.Tensor, *, seed: int = 0,
                       kmeans_iterations: int = 8, kmeans_points: int = 4096, decay_spread: float = 2.0,
                       gate_clip: tuple[float, float] = (0.05, 0.95), query_scale: str = "norm",
                       log: Optional[Callable[[str], None]] = None,
                       progress: Optional[Callable[[int], None]] = None) -> dict:
    """Set every mixer's ``queries``, ``log_decay`` and window gate from the teacher (see the module docstring).

    ``student``: an AarenForCausalLM whose teacher-derived weights are already mapped. ``calibration_windows``
    [N, T] token ids (a few windows suffice). ``query_scale``: "norm" (centroid rescaled to its cluster's RMS query
    norm) or "none". Returns a JSON-serialisable report (per layer: mean distance, decay rates, gate shares)."""
    if query_scale not in ("norm", "none"):
        raise ValueError(f"query_scale must be 'norm' or 'none', got {query_scale!r}")
    say = log or (lambda message: None)
    cfg = student.config
    layers = teacher_layers(teacher)
    mixers = [layer.mixer for layer in student.model.layers]
    if len(layers) != len(mixers):
        raise ValueError(f"teacher has {len(layers)} layers, student {len(mixers)}")
    H, J, D = cfg.num_attention_heads, cfg.num_query_slots, cfg.head_dim
    windows = torch.as_tensor(calibration_windows).long()
    stats = attention_statistics(teacher, windows, window_size=cfg.window_size, num_sink_tokens=cfg.num_sink_tokens,
                                 progress=progress)
    multipliers = spread_multipliers(J, decay_spread)
    report = {"calibration_windows": int(windows.shape[0]), "calibration_length": int(windows.shape[1]),
              "kmeans_iterations": kmeans_iterations, "decay_spread": decay_spread, "query_scale": query_scale,
              "layers": []}
    dtype = next(mixers[0].parameters()).dtype
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny k-means ops: thread barriers cost more than they give
    try:
        _set_layers(layers, mixers, stats, report, H, J, D, dtype, multipliers, seed, kmeans_points,
                    kmeans_iterations, query_scale, gate_clip, cfg)
    finally:
        torch.set_num_threads(threads)
    converted = [e for e in report["layers"] if "mean_distance" in e]
    if not converted:
        say("init: no Aaren layers (every layer is sliding-window attention): nothing to initialise")
        return report
    first, last = converted[0], converted[-1]
    say(f"init: {windows.shape[0]} calibration windows; mean attention distance layer {first['layer']} "
        f"{min(first['mean_distance']):.1f}-{max(first['mean_distance']):.1f}, layer {last['layer']} "
        f"{min(last['mean_distance']):.1f}-{max(last['mean_distance']):.1f} tokens"
        + (f"; window share layer {first['layer']} {min(first['window_share']):.2f}-{max(first['window_share']):.2f}"
           if "window_share" in first else ""))
    return report


def _set_layers(layers, mixers, stats, report, H, J, D, dtype, multipliers, seed, kmeans_points, kmeans_iterations,
                query_scale, gate_clip, cfg):
    for layer_idx, (tlayer, mixer) in enumerate(zip(layers, mixers)):
        st = stats[layer_idx]
        x = st.pop("inputs").to(next(tlayer.attention.parameters()).dtype)
        if not mixer.aaren_branch:  # a sliding-attention layer keeps the teacher's weights: nothing new to set
            report["layers"].append({"layer": layer_idx, "type": "sliding_attention"})
            continue
        q, _, _ = teacher_qkv(tlayer, x)  # [N, T, H, D] before rotary
        q = q.float().reshape(-1, q.shape[-2], q.shape[-1])
        if q.shape[1] != H or q.shape[2] != D:
            raise ValueError(f"layer {layer_idx}: teacher queries {tuple(q.shape[1:])} vs student heads ({H}, {D})")
        M = q.shape[0]
        g = torch.Generator().manual_seed(seed * 7_919 + layer_idx)
        take = torch.randperm(M, generator=g)[: min(M, kmeans_points)]
        queries = torch.empty(H, J, D)
        for h in range(H):
            pts = q[take, h]
            if J == 1:
                c = pts.mean(0, keepdim=True)
                assign = torch.zeros(pts.shape[0], dtype=torch.long)
            else:
                c, assign = kmeans(pts, J, kmeans_iterations, seed=seed * 1_000_003 + layer_idx * 97 + h)
            if query_scale == "norm":
                for j in range(J):
                    members = pts[assign == j]
                    target = members.norm(dim=-1).pow(2).mean().sqrt() if len(members) else pts.norm(dim=-1).mean()
                    c[j] = c[j] * (target / c[j].norm().clamp(min=1e-6))
            queries[h] = c
        mixer.queries.copy_(queries.to(dtype))
        entry = {"layer": layer_idx,
                 "mean_distance": [round(float(v), 2) for v in st["mean_distance"]],
                 "sink_mass": [round(float(v), 3) for v in st["sink_mass"]]}
        if hasattr(mixer, "log_decay"):
            rate = 1.0 / st["mean_distance"].clamp(min=1.0)  # [H]
            rates = (rate.view(H, 1) * multipliers.view(1, J)).clamp(1e-5, 1.0)
            mixer.log_decay.copy_(rates.log().to(mixer.log_decay.dtype))
            entry["decay_rate"] = [round(float(v), 5) for v in rate]
        if cfg.window_size > 0:
            entry["window_share"] = set_window_share(mixer, st["window_mass"], gate_clip)
        report["layers"].append(entry)


def mixer_attribute(name: str) -> Optional[str]:
    """The mixer attribute a model parameter belongs to ("queries", "q_proj", ...); None outside the mixers. A PEFT
    name (``...mixer.q_proj.base_layer.weight``) gives the attribute it wraps."""
    return name.split(".mixer.", 1)[1].split(".", 1)[0] if ".mixer." in name else None


def is_new_parameter(name: str) -> bool:
    """Whether a model parameter has no counterpart in the teacher (``AarenMixer.NEW_PARAMETERS``)."""
    return mixer_attribute(name) in AarenMixer.NEW_PARAMETERS


def never_trained(attribute: Optional[str], decay: str) -> bool:
    """Mixer parameters that no stage trains: a "fixed" decay, and the memory's retention score, which is fitted in
    closed form in stage 1 (retention.py) and only ranks tokens, so no gradient reaches it (and DDP refuses a
    parameter without one)."""
    return (attribute == "log_decay" and decay == "fixed") or attribute == "retention_proj"


def new_parameter_names(student) -> list[str]:
    """Names of the mixer parameters that do not come from the teacher (what :func:`initialize_student` sets)."""
    return [name for name, _ in student.named_parameters() if is_new_parameter(name)]
