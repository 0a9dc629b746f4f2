#!/usr/bin/env python
# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Whole model, teacher vs Aaren, in one run: train step, prefill and generate; speed ratios and peak memory.

The teacher is a LlamaForCausalLM (sdpa attention); the students are AarenForCausalLM of the same shape built from
it by the converter (``build_student``) with the recipe's default mixer (4 query slots, learned decay, window 64 +
1 sink) and, optionally, the same mixer without the window branch. Weights are random unless ``--real`` (the
packaged SmolLM2-135M-Instruct teacher): speed does not depend on training.

    python benchmarks/bench_model.py                        # CPU: prefill + decode after 100..4000-token prompts
    python benchmarks/bench_model.py --device cuda          # CUDA, bf16, the shapes of issue 12 (3 models)
    python benchmarks/bench_model.py --shape tiny --train 2x64 --prompts 32,96 --json out.json   # seconds

Work measured (B = batch):
  * train step BxT: forward + backward + AdamW step on random ids with labels = ids; tokens/s = B*T / time.
  * prefill P: one forward over a P-token prompt at batch 1 returning the cache and the logits of the last token
    (what generate() does first).
  * generate BxP: after a prefill of B prompts of P tokens, greedy decode steps as generate() runs them (the next
    token, the growing all-ones attention mask, the cache, under torch.no_grad as generate() runs; no logits
    processors); ms per step, tokens/s = B / step.

Interleaving: every repetition runs each model once, in a rotated order, so load from other jobs on a shared
machine hits all models alike; decode steps alternate between the models step by step. Reported: the median.
Ratios ("x teacher") are teacher time / Aaren time (speed: > 1 means Aaren is faster) and Aaren memory / teacher
memory, both from this one run.

Peak memory of an operation = the model's own weights (+ gradients and AdamW state for a train step) + the peak
above what was held just before the operation (activations, the returned cache):
  * CUDA: torch.cuda.max_memory_allocated() after torch.cuda.reset_peak_memory_stats() (allocator bytes).
  * CPU: the process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs after malloc_trim)
    minus its RSS before the operation; RSS counts pages actually touched, so it is an estimate to ~MiB (None where
    the kernel does not allow the reset). Generate's peak is max(prefill peak, cache + peak of a decode step).
On the CPU it prints, from the generate rows, the prompt length from which each Aaren model decodes faster than the
teacher (or, when that is past the scanned lengths, where a linear fit of the per-step times puts it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import (  # noqa: E402  (also imports aaren_hf before transformers' model code: see there)
    _int_list,
    code_fingerprint,
    git_head,
    host_info,
    human_ctx,
    peak_rss_bytes,
    release_free_memory,
    reset_peak_rss,
    rss_bytes,
)

from aaren_hf.conversion.evaluate import format_bytes  # noqa: E402

MODELS = ("teacher", "aaren", "aaren_nowin")
LABELS = {"teacher": "teacher (Llama, sdpa)", "aaren": "Aaren default", "aaren_nowin": "Aaren without window"}
# LlamaConfig of HuggingFaceTB/SmolLM2-135M-Instruct (the packaged teacher), and a tiny one for tests.
SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         rms_norm_eps=1e-5, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
                         bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                 pad_token_id=0),
}
TINY_MIXER = {"window_size": 16}  # the default mixer with a window the tiny prompts go past
# Defaults per device: the GPU shapes, and what fits in minutes on one CPU thread.
DEFAULTS = {
    "cuda": dict(models="teacher,aaren,aaren_nowin", train="8x2k,2x8k,1x32k", prompts="2k,16k,128k",
                 generate="64x2k,32x16k,1x4k", repeats=3, warmup=1, steps=32, dtype="bfloat16"),
    "cpu": dict(models="teacher,aaren", train="1x256", prompts="100,500,1000,2000,4000",
                generate="1x100,1x500,1x1000,1x2000,1x4000", repeats=2, warmup=0, steps=24, dtype="float32"),
}


# ----------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------


def _shapes(text):
    """'8x2k,1x32k' -> [(8, 2048), (1, 32768)]."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        b, sep, t = part.lower().partition("x")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected BxT items such as 8x2k, got {part!r}")
        out.append((_int_list(b)[0], _int_list(t)[0]))
    return out


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--real", action="store_true", help="load the packaged SmolLM2-135M-Instruct teacher and convert "
                   "it (weights only change values, not speed)")
    p.add_argument("--student", metavar="DIR", default=None, help="time this converted model folder as 'aaren' "
                   "against the teacher its conversion.json names (trained retention scores decide how often a "
                   "token enters the memory, which random or freshly converted weights do not)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--models", default=None, help=f"subset of {','.join(MODELS)} (default: all on CUDA, "
                   "teacher,aaren on CPU); the teacher is always included")
    p.add_argument("--train", default=None, help="train steps BxT, e.g. 8x2k,1x32k ('' or 'none': skip)")
    p.add_argument("--prompts", default=None, help="prefill lengths at batch 1, e.g. 100,1000,4k ('none': skip)")
    p.add_argument("--generate", default=None, help="generate BxP (batch x prompt), e.g. 64x2k,1x4k ('none': skip)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per model and generate row")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions of each train step / prefill")
    p.add_argument("--warmup", type=int, default=None, help="untimed repetitions first, per row (decode: steps)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: on a shared machine more threads "
                   "than free cores makes times swing by several x)")
    p.add_argument("--profile", action="store_true", help="profile each model (torch.profiler) on the first train row "
                   "(one step), the shortest prefill (one) and the last generate row (a few decode steps): "
                   "operator calls, kernel launches and host syncs per step, and the operators that take the time")
    p.add_argument("--prefill-tokens", type=int, default=None, metavar="N", help="tokens per piece of a prefill for "
                   "this run (the model's PREFILL_TOKENS_GPU on a GPU, its PREFILL_CHUNK on a CPU): to compare pieces")
    p.add_argument("--compile-decode", default=None, metavar="BACKEND", help="decode as generate(cache_implementation="
                   "'static') does: every model's cache at fixed addresses (the teacher's StaticCache, the students' "
                   "static AarenCache), its steps through torch.compile with this backend (inductor: mode "
                   "reduce-overhead, CUDA graphs on a GPU; 'eager' only checks that the step traces); the warm-up "
                   "steps take the compiles")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="also write every number to this JSON file")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    for key, value in DEFAULTS[kind].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise SystemExit(f"unknown --models {unknown}; choose from {MODELS}")
    args.models = [m for m in MODELS if m in models or m == "teacher"]
    if len(args.models) < 2:
        raise SystemExit("--models: name at least one Aaren model (aaren, aaren_nowin) to compare with the teacher")
    if args.student is not None:
        if not (Path(args.student) / "config.json").is_file():
            raise SystemExit(f"--student {args.student!r} is not a model folder (no config.json): give a folder "
                             "written by aaren-convert")
        if args.real or args.models != ["teacher", "aaren"]:
            raise SystemExit("--student times that folder against its own teacher: leave out --real and give no "
                             "--models other than aaren")
    skip = ("", "none", "0")
    args.train = [] if args.train.strip().lower() in skip else _shapes(args.train)
    args.prompts = [] if args.prompts.strip().lower() in skip else _int_list(args.prompts)
    args.generate = [] if args.generate.strip().lower() in skip else _shapes(args.generate)
    if args.prefill_tokens is not None and args.prefill_tokens < 1:
        raise SystemExit("--prefill-tokens must be >= 1")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit("--repeats and --steps must be >= 1, --warmup >= 0")
    return args


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------


def mixer_options(kind, shape):
    from aaren_hf.conversion.recipes import DEFAULT_MIXER

    mixer = dict(DEFAULT_MIXER, **(TINY_MIXER if shape == "tiny" else {}))
    if kind == "aaren_nowin":
        mixer.update(window_size=0, num_sink_tokens=0, memory_size=0)
    return mixer


def random_teacher_and_student(layers):
    """A Llama teacher of SmolLM2-135M's shape with ``layers`` layers (random weights, seed 0) and the default student
    converted from it: what count_ops.py and saved_memory.py count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from aaren_hf.conversion.convert import build_student

    torch.manual_seed(0)
    shape = dict(SHAPES["smollm2-135m"], num_hidden_layers=layers)
    teacher = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=1 << 20, attn_implementation="sdpa"))
    return teacher, build_student(teacher, mixer_options("aaren", "smollm2-135m"))


def layer_in_pytorch():
    """A patch that runs the student's RMSNorm and gated MLP by their PyTorch code where a GPU would run their Triton
    kernels, as the teacher runs its own: the mixer's difference alone (``--layer pytorch`` of count_ops.py and
    saved_memory.py)."""
    from unittest import mock

    import aaren_hf.modeling_aaren as modeling

    return mock.patch.multiple(modeling, fused_rms_norm=None, fused_glu=None)


def build_models(args):
    """{name: model} on the device, in eval mode and the benchmark dtype; students converted from the teacher, or
    the --student folder and its own teacher."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from aaren_hf.conversion.convert import build_student

    torch.manual_seed(args.seed)
    if args.student is not None:
        from aaren_hf.conversion.convert import teacher_of

        teacher = AutoModelForCausalLM.from_pretrained(teacher_of(args.student), dtype=torch.float32,
                                                       attn_implementation="sdpa")
        models = {"teacher": teacher, "aaren": AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)}
    else:
        if args.real:
            from aaren_hf.conversion.assets import packaged_teacher_path

            teacher = AutoModelForCausalLM.from_pretrained(packaged_teacher_path(), dtype=torch.float32,
                                                           attn_implementation="sdpa")
        else:
            teacher = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape], max_position_embeddings=1 << 20,
                                                   attn_implementation="sdpa"))
        models = {"teacher": teacher}
        for kind in args.models[1:]:
            models[kind] = build_student(teacher, mixer_options(kind, "smollm2-135m" if args.real else args.shape))
    dtype = getattr(torch, args.dtype)
    args.vocab = teacher.config.vocab_size
    return {k: m.to(device=args.device, dtype=dtype).eval() for k, m in models.items()}


def describe(kind, model):
    c = model.config
    d = {"class": type(model).__name__, "params": sum(p.numel() for p in model.parameters()),
         "layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
         "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab": c.vocab_size}
    if kind == "teacher":
        d["attn_implementation"] = c._attn_implementation
    else:
        d.update(num_query_slots=c.num_query_slots, decay=c.decay, window_size=c.window_size,
                 num_sink_tokens=c.num_sink_tokens, window_gate=c.window_gate)
    return d


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def cache_bytes(cache):
    if hasattr(cache, "state_bytes"):  # AarenCache
        return cache.state_bytes()
    return tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))


# ----------------------------------------------------------------------------------------------------------------
# Timing and memory
# ----------------------------------------------------------------------------------------------------------------


def synchronize(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak bytes of the enclosed operation above what was held when it began (see the module docstring)."""

    def __init__(self, device):
        self.cuda = str(device).startswith("cuda")
        self.device = device
        self.delta = None

    def __enter__(self):
        synchronize(self.device)
        if self.cuda:
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            release_free_memory()
            self.base = rss_bytes()
            self.ok = self.base is not None and reset_peak_rss()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        self.seconds = time.perf_counter() - self.t0
        if self.cuda:
            self.delta = torch.cuda.max_memory_allocated(self.device) - self.base
        elif self.ok:
            self.delta = max(0, peak_rss_bytes() - self.base)
        return False


def _peak(previous, value):
    """Running maximum of peak bytes; None (not measurable here) wins."""
    return None if previous is None or value is None else max(previous, value)


def rotated(names, r):
    """Order of the models in repetition r: rotated, so no model always runs first."""
    r %= len(names)
    return list(names[r:]) + list(names[:r])


def summary(seconds):
    ts = sorted(seconds)
    return {"median_s": statistics.median(ts), "min_s": ts[0], "max_s": ts[-1], "n": len(ts)}


def random_ids(args, batch, length, salt):
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + salt)
    return torch.randint(3, args.vocab, (batch, length), generator=g).to(args.device)


# ----------------------------------------------------------------------------------------------------------------
# The three kinds of work
# ----------------------------------------------------------------------------------------------------------------


def run_train(models, args):
    rows = []
    param_bytes = {k: tensor_bytes(m.parameters()) for k, m in models.items()}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-6) for k, m in models.items()}
    for m in models.values():
        m.train()
    try:
        for batch, length in args.train:
            ids = random_ids(args, batch, length, salt=batch * length)
            times = {k: [] for k in models}
            peak = {k: 0 for k in models}
            for r in range(args.warmup + args.repeats):
                for kind in rotated(list(models), r):
                    model, opt = models[kind], optimizers[kind]
                    opt.zero_grad(set_to_none=True)
                    # held before the step: weights + AdamW moments once they exist (the first step makes them,
                    # and then they count in its delta); gradients are made inside the step
                    held = param_bytes[kind] + tensor_bytes(t for s in opt.state.values() for t in s.values()
                                                            if torch.is_tensor(t))
                    with PeakMemory(args.device) as probe:
                        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                        opt.step()
                    if r >= args.warmup:
                        times[kind].append(probe.seconds)
                    peak[kind] = _peak(peak[kind], None if probe.delta is None else held + probe.delta)
                    opt.zero_grad(set_to_none=True)
            row = {"work": "train", "batch": batch, "tokens": length, "models": {}}
            for kind in models:
                s = summary(times[kind])
                row["models"][kind] = {**s, "tokens_per_s": batch * length / s["median_s"], "peak_bytes": peak[kind]}
            if args.profile and (batch, length) == args.train[0]:
                def step(kind):
                    models[kind](input_ids=ids, labels=ids, use_cache=False).loss.backward()
                    optimizers[kind].step()
                    optimizers[kind].zero_grad(set_to_none=True)
                _profile_row(row, models, step, args.device)
            rows.append(row)
            _progress(row)
    finally:
        for m in models.values():
            m.eval()
            m.zero_grad(set_to_none=True)
        optimizers.clear()
        release_free_memory()
        if str(args.device).startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def prefill(model, ids, static_length=None):
    """(cache, next token) after a prompt. ``static_length``: in the cache generate(cache_implementation="static")
    makes, the teacher's StaticCache of that many positions or the student's AarenCache at fixed addresses."""
    cache = None
    if static_length is not None:
        from transformers import StaticCache

        from aaren_hf import AarenCache, AarenForCausalLM

        cache = (AarenCache(model.config, static=True) if isinstance(model, AarenForCausalLM)
                 else StaticCache(config=model.config, max_cache_len=static_length))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    return out.past_key_values, out.logits[:, -1:].argmax(-1)


def static_length(args, prompt_len, steps):
    return prompt_len + steps + 1 if args.compile_decode else None


class Decoding:
    """One model's cache after a prefill, and greedy decode steps as generate() runs them."""

    def __init__(self, kind, model, cache, next_token, prompt_len, max_steps, compile_backend=None):
        self.kind, self.cache, self.next_token = kind, cache, next_token
        self.model = model
        if compile_backend is not None:  # generate()'s compile of the step (transformers' CompileConfig)
            mode = "reduce-overhead" if compile_backend == "inductor" else None
            self.model = torch.compile(model, backend=compile_backend, mode=mode)
        self.n = prompt_len
        self.mask = None  # what generate() passes for prompts without padding
        if compile_backend is None:  # as measured before: the growing all-ones mask
            self.mask = torch.ones(next_token.shape[0], prompt_len + max_steps + 1, dtype=torch.long,
                                   device=next_token.device)

    def step(self):
        kwargs = dict(input_ids=self.next_token, past_key_values=self.cache, use_cache=True)
        if self.mask is not None:
            kwargs["attention_mask"] = self.mask[:, : self.n + 1]
        if self.kind == "teacher":  # generate() passes the position of the new token to a KV-cache model
            kwargs["position_ids"] = torch.full_like(self.next_token, self.n)
        out = self.model(**kwargs)
        self.next_token = out.logits[:, -1:].argmax(-1)
        self.n += 1


def run_prompts(models, args):
    """Prefill rows (batch 1, args.prompts) and generate rows (args.generate); a batch-1 generate row whose prompt
    length is also a prefill row reuses that row's prefills."""
    jobs = sorted({(1, p) for p in args.prompts} | set(args.generate), key=lambda bp: (bp[0] != 1, bp))
    param_bytes = {k: tensor_bytes(m.parameters()) for k, m in models.items()}
    prefill_rows, generate_rows = [], []
    # no_grad, not inference_mode: what generate() runs under (inference_mode speeds up the many-operator step more)
    with torch.no_grad():
        for batch, length in jobs:
            ids = random_ids(args, batch, length, salt=7 * length + batch)
            times = {k: [] for k in models}
            pre_delta = {k: 0 for k in models}
            states = {}
            for r in range(args.warmup + args.repeats):
                for kind in rotated(list(models), r):
                    states.pop(kind, None)  # free the previous repetition's cache first
                    with PeakMemory(args.device) as probe:
                        states[kind] = prefill(models[kind], ids,
                                               static_length(args, length, args.warmup_steps + args.steps))
                    if r >= args.warmup:
                        times[kind].append(probe.seconds)
                    pre_delta[kind] = _peak(pre_delta[kind], probe.delta)
            if batch == 1 and length in args.prompts:
                row = {"work": "prefill", "batch": 1, "tokens": length, "models": {}}
                for kind in models:
                    s = summary(times[kind])
                    peak = None if pre_delta[kind] is None else param_bytes[kind] + pre_delta[kind]
                    row["models"][kind] = {**s, "tokens_per_s": length / s["median_s"], "peak_bytes": peak}
                if args.profile and length == min(args.prompts):
                    _profile_row(row, models, lambda kind: prefill(models[kind], ids), args.device)
                prefill_rows.append(row)
                _progress(row)
            if (batch, length) not in args.generate:
                continue
            n_steps = args.warmup_steps + args.steps
            decoders = {k: Decoding(k, models[k], *states[k], length, n_steps, args.compile_decode) for k in models}
            step_times = {k: [] for k in models}
            step_delta = {k: 0 for k in models}
            for i in range(n_steps):
                for kind in rotated(list(models), i):
                    with PeakMemory(args.device) as probe:
                        decoders[kind].step()
                    if i >= args.warmup_steps:
                        step_times[kind].append(probe.seconds)
                    step_delta[kind] = _peak(step_delta[kind], probe.delta)
            row = {"work": "generate", "batch": batch, "tokens": length, "models": {}}
            for kind, dec in decoders.items():
                s = summary(step_times[kind])
                held = cache_bytes(dec.cache)
                peak = None
                if pre_delta[kind] is not None and step_delta[kind] is not None:
                    peak = param_bytes[kind] + max(pre_delta[kind], held + step_delta[kind])
                row["models"][kind] = {**s, "ms_per_step": 1e3 * s["median_s"], "tokens_per_s": batch / s["median_s"],
                                       "peak_bytes": peak, "cache_bytes": held,
                                       "prefill_median_s": statistics.median(times[kind])}
            generate_rows.append(row)
            _progress(row)
            if args.profile and (batch, length) == args.generate[-1]:
                _profile_row(row, models, lambda kind: decoders[kind].step(), args.device, repeats=10)
            del decoders, states
    return prefill_rows, generate_rows


def _profile_row(row, models, work, device, repeats=1):
    try:
        row["profile"] = {kind: profile_work(lambda: work(kind), device, repeats,
                                             models[kind].config.num_hidden_layers) for kind in models}
    except Exception as error:  # a profiler that cannot start (CUPTI) must not lose the timings
        print(f"--profile failed: {error!r}", file=sys.stderr)


# what torch.profiler names a kernel launch and a host wait, CUDA runtime and driver API alike
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_work(fn, device, repeats, layers, top=12):
    """torch.profiler over ``repeats`` calls of fn: top-level operator calls per call (what a launch-bound step pays
    for), kernel launches and host syncs per call (GPU), and the operators with the most self time on the host and,
    on a GPU, on the device."""
    from torch.profiler import ProfilerActivity, profile

    cuda = str(device).startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        synchronize(device)
    events = prof.events()
    calls = sum(1 for e in events if e.name.startswith("aten::")
                and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    averages = prof.key_averages()

    def device_time(e):  # the name changed in torch 2.4
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    def count(names):
        return sum(e.count for e in averages if e.key in names)

    def top_ops(key):
        return [{"op": e.key, "ms_per_step": key(e) / 1e3 / repeats, "calls_per_step": e.count / repeats}
                for e in sorted(averages, key=key, reverse=True)[:top]]

    out = {"steps": repeats, "aten_calls_per_step": calls / repeats, "aten_calls_per_layer": calls / repeats / layers,
           "top_self_cpu": top_ops(lambda e: e.self_cpu_time_total)}
    if cuda:
        out.update(launches_per_step=count(LAUNCHES) / repeats, syncs_per_step=count(SYNCS) / repeats,
                   device_busy_ms_per_step=sum(device_time(e) for e in averages) / 1e3 / repeats,
                   top_self_device=top_ops(device_time))
    return out


def warm_up(models, args):
    """One short prefill and a few decode steps per model before anything is timed (first-call costs: allocator,
    lazy initialisation, kernel compilation on CUDA)."""
    ids = random_ids(args, 1, 16, salt=1)
    with torch.no_grad():
        for kind, model in models.items():
            dec = Decoding(kind, model, *prefill(model, ids, static_length(args, 16, 3)), 16, 3, args.compile_decode)
            for _ in range(3):
                dec.step()
    synchronize(args.device)


def _progress(row):
    m = row["models"]
    parts = [f"{k} {1e3 * v['median_s']:.1f} ms" for k, v in m.items()]
    print(f"[{row['work']} {row['batch']}x{human_ctx(row['tokens'])}] " + ", ".join(parts), file=sys.stderr,
          flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Ratios, crossover, report
# ----------------------------------------------------------------------------------------------------------------


def add_ratios(rows):
    for row in rows:
        teacher = row["models"]["teacher"]
        row["ratios"] = {}
        for kind, m in row["models"].items():
            if kind == "teacher":
                continue
            mem = (m["peak_bytes"] / teacher["peak_bytes"]) if m["peak_bytes"] and teacher["peak_bytes"] else None
            row["ratios"][kind] = {"speed": teacher["median_s"] / m["median_s"], "memory": mem}


def _fit(xs, ys):
    """Least-squares line y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def crossover(rows, kind):
    """Prompt length from which ``kind`` is at least as fast as the teacher, per batch size, from rows that share
    the batch. Where it is not reached within the scanned lengths, a linear fit of time against prompt length
    (teacher's attention grows with it, the recurrent state does not) estimates it."""
    out = {}
    for batch in sorted({r["batch"] for r in rows}):
        rs = sorted((r for r in rows if r["batch"] == batch and kind in r["models"]), key=lambda r: r["tokens"])
        if not rs:
            continue
        lengths = [r["tokens"] for r in rs]
        faster = [r["ratios"][kind]["speed"] >= 1.0 for r in rs]
        res = {"lengths": lengths, "speed_ratios": [r["ratios"][kind]["speed"] for r in rs]}
        first = next((i for i in range(len(rs)) if all(faster[i:])), None)
        if first is not None:
            res.update(measured=True, from_tokens=lengths[first],
                       after_tokens=lengths[first - 1] if first > 0 else None)
        else:
            res["measured"] = False
            if len(rs) >= 2:
                at, bt = _fit(lengths, [r["models"]["teacher"]["median_s"] for r in rs])
                aa, ba = _fit(lengths, [r["models"][kind]["median_s"] for r in rs])
                res["fit"] = {"teacher_s": [at, bt], kind + "_s": [aa, ba]}
                res["estimated_tokens"] = (aa - at) / (bt - ba) if bt > ba and aa > at else None
        out[batch] = res
    return out


def crossover_text(work, kind, batch, c):
    label = LABELS[kind]
    if c["measured"]:
        if c["after_tokens"] is None:
            return (f"{work}, B={batch}: {label} is at least as fast as the teacher at every scanned prompt length "
                    f"({human_ctx(c['lengths'][0])} to {human_ctx(c['lengths'][-1])} tokens)")
        return (f"{work}, B={batch}: {label} overtakes the teacher between {c['after_tokens']} and {c['from_tokens']} "
                f"prompt tokens (faster from {c['from_tokens']} on)")
    est = c.get("estimated_tokens")
    tail = "" if "fit" not in c else (
        f"; linear fit puts the crossover near {est:,.0f} tokens" if est else
        "; a linear fit of the times does not cross (the teacher's time does not grow faster than Aaren's)")
    ratios = ", ".join(f"{x:.2f}x" for x in c["speed_ratios"])
    return (f"{work}, B={batch}: {label} does not overtake the teacher within {human_ctx(c['lengths'][0])}-"
            f"{human_ctx(c['lengths'][-1])} prompt tokens (speed vs teacher: {ratios}){tail}")


def _cell(row, kind):
    m = row["models"][kind]
    if row["work"] == "train":
        text = f"{m['tokens_per_s']:,.0f} tok/s"
    elif row["work"] == "prefill":
        text = f"{m['median_s']:.3g} s"
    else:
        text = f"{m['ms_per_step']:.1f} ms/step ({m['tokens_per_s']:,.1f} tok/s)"
    return text + (f", {format_bytes(m['peak_bytes'])}" if m["peak_bytes"] else "")


def _ratio_cell(row, kind):
    r = row["ratios"][kind]
    text = f"{r['speed']:.2f}x speed"
    return text + (f", {r['memory']:.2f}x memory" if r["memory"] else "")


def _work_label(row):
    b, t = row["batch"], human_ctx(row["tokens"])
    if row["work"] == "train":
        return f"train step, B={b} x {t}"
    if row["work"] == "prefill":
        return f"prefill {b} x {t} (logits of last token)"
    return f"generate, B={b} after a {t} prompt"


def markdown_table(rows, kinds):
    students = [k for k in kinds if k != "teacher"]
    head = ["work"] + [LABELS[k] for k in kinds] + [f"{LABELS[k]} / teacher" for k in students]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [_work_label(row)] + [_cell(row, k) for k in kinds] + [_ratio_cell(row, k) for k in students]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_info(args):
    info = host_info()
    info["loadavg_start"] = info.pop("loadavg")
    info.update(device=args.device, dtype=args.dtype, torch_threads=torch.get_num_threads(), git=git_head(),
                aaren_hf_code=code_fingerprint())
    if str(args.device).startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(args.device)
        try:
            import aaren_hf.kernels as kernels

            info["backend"] = kernels.select_backend(torch.zeros(1, device=args.device))
        except (ImportError, AttributeError):
            info["backend"] = "torch"
    return info


def print_report(report, args):
    m = report["machine"]
    where = m.get("gpu") or f"{m['cpu']}, {m['usable_cores']} usable cores, {m['torch_threads']} torch thread(s)"
    weights = "real weights" if args.real else "random weights"
    print(f"## bench_model: teacher vs Aaren ({args.student or f'{args.shape}, {weights}'}, "
          f"{args.device}, {args.dtype})")
    print()
    print(f"command: `python benchmarks/bench_model.py {' '.join(report['argv'])}`".rstrip())
    print(f"machine: {where}; torch {m['torch']}, transformers {m['transformers']}; load average "
          f"{m['loadavg_start']} at start, {m.get('loadavg_end')} at end; git {m['git']}")
    for kind, d in report["models"].items():
        extra = ", ".join(f"{k}={v}" for k, v in d.items() if k != "class")
        print(f"- {LABELS[kind]}: {d['class']}, {extra}")
    print(f"- median of {args.repeats} interleaved repetitions per train/prefill row (after {args.warmup} warm-up), "
          f"of {args.steps} decode steps per generate row; ratios = teacher time / Aaren time and Aaren / teacher "
          f"peak memory; memory: {report['memory_measure']}")
    print()
    print(markdown_table(report["rows"], args.models))
    print()
    for line in report["crossover_text"]:
        print(f"- {line}")
    for row in report["rows"]:
        if "profile" in row:
            unit = {"train": "train step", "prefill": "prefill", "generate": "decode step"}[row["work"]]
            print(f"\nprofile per {unit} ({_work_label(row)}; torch.profiler, {args.device}):")
            for kind, prof in row["profile"].items():

                def ops(key):
                    return ", ".join(f"{o['op'][:60]} {o['ms_per_step']:.1f} ms" for o in prof[key][:6])

                line = (f"- {LABELS[kind]}: {prof['aten_calls_per_step']:.0f} operator calls "
                        f"({prof['aten_calls_per_layer']:.0f} per layer)")
                if "launches_per_step" in prof:
                    line += (f", {prof['launches_per_step']:.0f} kernel launches, {prof['syncs_per_step']:.0f} host "
                             f"syncs, device busy {prof['device_busy_ms_per_step']:.1f} ms; most device time: "
                             f"{ops('top_self_device')}")
                print(line + f"; most host time: {ops('top_self_cpu')}")
    print(f"\n(wall time {report['wall_s']:.0f} s)")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.warmup_steps = max(args.warmup, 3)
    import aaren_hf.modeling_aaren as modeling

    # the constant modeling_aaren.prefill_piece reads on this device
    piece = "PREFILL_CHUNK" if torch.device(args.device).type == "cpu" else "PREFILL_TOKENS_GPU"
    old_piece = getattr(modeling, piece)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    try:
        if args.prefill_tokens is not None:
            setattr(modeling, piece, args.prefill_tokens)
        models = build_models(args)
        report = {"argv": argv, "machine": machine_info(args),
                  "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                  "models": {k: describe(k, m) for k, m in models.items()},
                  "memory_measure": ("torch.cuda.max_memory_allocated (allocator bytes)"
                                     if str(args.device).startswith("cuda") else
                                     "CPU resident set (VmHWM reset per operation) minus RSS before it, plus weights")}
        warm_up(models, args)
        rows = run_train(models, args) if args.train else []
        prefill_rows, generate_rows = run_prompts(models, args) if (args.prompts or args.generate) else ([], [])
    finally:
        torch.set_num_threads(old_threads)
        setattr(modeling, piece, old_piece)
    rows += prefill_rows + generate_rows
    add_ratios(rows)
    report["rows"] = rows
    report["crossover"], report["crossover_text"] = {}, []
    for work, work_rows in (("generate", generate_rows), ("prefill", prefill_rows)):
        for kind in args.models[1:]:
            per_batch = crossover(work_rows, kind)
            report["crossover"].setdefault(work, {})[kind] = {str(b): c for b, c in per_batch.items()}
            for b, c in per_batch.items():
                if len(c["lengths"]) > 1:
                    report["crossover_text"].append(crossover_text(work, kind, b, c))
    report["machine"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    report["wall_s"] = time.perf_counter() - t_start
    print_report(report, args)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json_path}")
    return report


if __name__ == "__main__":
    main()
