#!/usr/bin/env python
# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Decode cost against context length: Aaren (fixed-size state) vs Llama (KV cache) vs Mamba (recurrent peer).

One run on this machine, CPU, fp32, eval, no_grad, batch 1, random init. For each model and each context T it
reports the median per-token decode latency, the bytes held by the cache/state at T, and the peak process memory.

How each cache is filled (all at exactly T tokens before decoding starts):
  * Aaren, Aaren+window: a real chunked prefill of T random tokens (pieces of --prefill-chunk tokens, each piece
    continuing from the returned AarenCache; logits only for the last token).
  * Llama: a transformers DynamicCache filled with random keys/values of the exact shape a prefill of T tokens
    leaves ([1, kv_heads, T, head_dim] per layer, via cache.update(k, v, layer_idx)); decoding then passes
    position_ids = [[T]] and an all-ones attention_mask of length T + 1, as generate() does. A real 64K prefill
    is not feasible here; decode cost depends on the cache's size, not its contents.
  * Mamba: a real prefill of min(T, --mamba-prefill) tokens. Its state (conv + SSM) has the same size for any T and
    its decode step does not read positions, so a longer prefill would change the values, not the cost.

Measurement:
  * Memory: each (model, T) runs in a fresh subprocess (peaks never mix). It reports the peak RSS of the whole child
    (imports + model + fill/prefill + decode) and, separately, the peak RSS while decoding (the high-water mark is
    reset through /proc/self/clear_refs after the fill, where the kernel allows it).
  * Latency: one further subprocess holds every (model, T) cache at once (Aaren states are handed over from the
    memory children, so each prefill runs once) and interleaves single decode steps round-robin, in a shuffled
    order each round, so that load from other jobs on a shared machine hits all rows alike. Median over --steps
    steps after --warmup steps.
  * The header names the git commit and a hash of aaren_hf's source; every subprocess reports its own hash, and a
    WARNING line says so when the source changed during the run (numbers from two versions).

Usage:
    python benchmarks/bench_decode.py                      # full run: T = 1K, 4K, 16K, 64K
    python benchmarks/bench_decode.py --quick              # smoke run with small contexts
    python benchmarks/bench_decode.py --json out.json      # also write every number as JSON
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

# aaren_hf before anything from transformers: with the repository root on sys.path (python -c / python -m pytest run
# from the root), transformers' probe for the hub package `kernels` finds this repository's kernels/ folder, and
# importing transformers' model code first then fails with a circular import.
import aaren_hf  # noqa: F401,E402
from aaren_hf.conversion.evaluate import format_bytes  # noqa: E402

MODELS = ("aaren", "aaren_window", "llama", "mamba")
LABELS = {"aaren": "Aaren", "aaren_window": "Aaren+win", "llama": "Llama KV", "mamba": "Mamba"}
DEFAULT_CONTEXTS = (1024, 4096, 16384, 65536)
QUICK_CONTEXTS = (128, 256, 512, 1024)
FLAT_MAX = 1.1  # target: 64K/1K ratio of Aaren's latency and state bytes
BYTES_MIN_FACTOR = 1000  # target: Aaren state at the largest context this many times smaller than the KV cache


# ----------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------


def _int_list(text):
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1
        if part.endswith("k"):
            part, scale = part[:-1], 1024
        out.append(int(part) * scale)
    if not out or any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive sizes, got {text!r}")
    return sorted(set(out))


def build_parser():
    p = argparse.ArgumentParser(
        description="Per-token decode latency, cache bytes and peak memory vs context: Aaren vs Llama (KV cache) "
        "vs Mamba, on CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--contexts", type=_int_list, default=None,
                   help="context lengths, e.g. 1k,4k,16k,64k (default: 1k,4k,16k,64k; --quick: 128,256,512,1024)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per model/context (default 100; "
                   "--quick: 10)")
    p.add_argument("--warmup", type=int, default=5, help="untimed decode steps first")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA) for Llama and Aaren; "
                   "default: --heads (MHA)")
    p.add_argument("--intermediate", type=int, default=1376, help="MLP width of Llama and Aaren")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--window", type=int, default=64, help="window of the Aaren+win row")
    p.add_argument("--sinks", type=int, default=1, help="sink tokens of the Aaren+win row")
    p.add_argument("--mamba-state", type=int, default=16, help="Mamba SSM state size")
    p.add_argument("--mamba-expand", type=int, default=2)
    p.add_argument("--mamba-prefill", type=int, default=1024,
                   help="Mamba prefills min(T, this) real tokens (its state size does not depend on T)")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="Aaren prefill piece length")
    p.add_argument("--models", default=",".join(MODELS), help=f"subset of {','.join(MODELS)}")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 by default: on a shared machine, more OpenMP threads than free cores "
                   "makes step times swing by several x)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="write all numbers to this JSON file")
    p.add_argument("--quick", action="store_true", help="small contexts and fewer steps, for a smoke run")
    p.add_argument("--in-process", action="store_true",
                   help="no subprocesses (fast; peak-memory numbers then mix across rows and are flagged so)")
    p.add_argument("--child-timeout", type=int, default=3600, help="seconds allowed to each subprocess")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.contexts is None:
        args.contexts = list(QUICK_CONTEXTS if args.quick else DEFAULT_CONTEXTS)
    if args.steps is None:
        args.steps = 10 if args.quick else 100
    if args.kv_heads is None:
        args.kv_heads = args.heads
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown --models {unknown}; choose from {MODELS}")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    return args


# ----------------------------------------------------------------------------------------------------------------
# Memory helpers
# ----------------------------------------------------------------------------------------------------------------


def _status_kib(field):
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def peak_rss_bytes():
    """High-water mark of the resident set of this process (VmHWM; ru_maxrss where /proc is missing)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib * 1024


def rss_bytes():
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def release_free_memory():
    """Hand memory freed by the prefill back to the OS (glibc keeps it otherwise, and it would count as decode RSS).

    No gc.collect(): tensors are freed by reference counting, and a full collection costs ~1 s per call here."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss():
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0). Returns whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def code_fingerprint():
    """sha256 over the .py files of aaren_hf and aaren_hf.kernels as they are on disk now. Parent and children compare
    theirs: a repository edited during a run would otherwise mix code versions silently."""
    import aaren_hf.kernels

    h = hashlib.sha256()
    for pkg in (aaren_hf, aaren_hf.kernels):
        root = os.path.dirname(pkg.__file__)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(f for f in filenames if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    h.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def git_head():
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{head}{'+uncommitted changes' if dirty else ''}" if head else None
    except (OSError, subprocess.SubprocessError):
        return None


# ----------------------------------------------------------------------------------------------------------------
# Models and caches
# ----------------------------------------------------------------------------------------------------------------


def make_config(kind, args):
    if kind in ("aaren", "aaren_window"):
        from aaren_hf import AarenConfig

        extra = dict(window_size=args.window, num_sink_tokens=args.sinks) if kind == "aaren_window" else {}
        return AarenConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            **extra,
        )
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            max_position_embeddings=max(args.contexts) + args.warmup + args.steps + 64,
        )
    if kind == "mamba":
        from transformers import MambaConfig

        return MambaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
            state_size=args.mamba_state, expand=args.mamba_expand,
        )
    raise ValueError(kind)


def build_model(kind, args):
    config = make_config(kind, args)
    torch.manual_seed(args.seed + MODELS.index(kind))  # same weights in every process
    if kind in ("aaren", "aaren_window"):
        from aaren_hf import AarenForCausalLM

        model = AarenForCausalLM(config)
    elif kind == "llama":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(config)
    else:
        from transformers import MambaForCausalLM

        model = MambaForCausalLM(config)
    return model.float().eval()


def describe_model(kind, model):
    c = model.config
    d = {"class": type(model).__name__, "params": sum(p.numel() for p in model.parameters()),
         "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
         "dtype": "float32"}
    if kind == "mamba":
        d.update(state_size=c.state_size, intermediate_size=c.intermediate_size, conv_kernel=c.conv_kernel)
    else:
        d.update(num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                 head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                 intermediate_size=c.intermediate_size)
    if kind == "aaren_window":
        d.update(window_size=c.window_size, num_sink_tokens=c.num_sink_tokens)
    if kind == "llama":
        d.update(attn_implementation=getattr(c, "_attn_implementation", None), cache="DynamicCache")
    return d


def _random_ids(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g)


class Decoder:
    """A model plus its cache at some context; ``step()`` decodes one token greedily."""

    def __init__(self, kind, model, ctx, args, state_file=None):
        self.kind, self.model, self.ctx = kind, model, ctx
        self.info = {}
        t0 = time.perf_counter()
        with torch.no_grad():
            if kind in ("aaren", "aaren_window"):
                self._fill_aaren(args, state_file)
            elif kind == "llama":
                self._fill_llama(args)
            else:
                self._fill_mamba(args)
        self.info["fill_s"] = time.perf_counter() - t0
        self.bytes_at_ctx = self.cache_bytes()

    # -- fills ------------------------------------------------------------------------------------------------
    def _fill_aaren(self, args, state_file):
        from aaren_hf import AarenCache

        self.cache = AarenCache(self.model.config)
        if state_file is not None and os.path.exists(state_file):
            from safetensors.torch import load_file

            saved = load_file(state_file)  # safetensors: nothing is unpickled
            for key, t in saved.items():
                if key.startswith("layer."):
                    _, i, name = key.split(".", 2)
                    setattr(self.cache.layers[int(i)], name, t)
            self.cache.seen_tokens = int(saved["seen_tokens"])
            self.cache.real_tokens, self.next_token = saved["real_tokens"], saved["next_token"]
            self.info["fill"] = "real prefill (state handed over from the memory run)"
            return
        ids = _random_ids(self.ctx, args.vocab, args.seed + self.ctx)
        out = None
        for start in range(0, self.ctx, args.prefill_chunk):
            out = self.model(input_ids=ids[:, start : start + args.prefill_chunk], past_key_values=self.cache,
                             use_cache=True, logits_to_keep=1)
        self.next_token = out.logits[:, -1:].argmax(-1)
        assert self.cache.get_seq_length() == self.ctx
        self.info["fill"] = f"real prefill, pieces of {args.prefill_chunk}"

    def save_state(self, path):
        from safetensors.torch import save_file

        tensors = {f"layer.{i}.{name}": t.contiguous()
                   for i, layer in enumerate(self.cache.layers) for name, t in layer.tensors().items()}
        tensors.update(seen_tokens=torch.tensor(self.cache.seen_tokens), real_tokens=self.cache.real_tokens,
                       next_token=self.next_token)
        save_file(tensors, path)

    def _fill_llama(self, args):
        from transformers import DynamicCache

        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.cache = DynamicCache(config=c)
        g = torch.Generator().manual_seed(args.seed + self.ctx)
        for i in range(c.num_hidden_layers):
            shape = (1, c.num_key_value_heads, self.ctx, head_dim)
            k = torch.randn(shape, generator=g, dtype=torch.float32)
            v = torch.randn(shape, generator=g, dtype=torch.float32)
            self.cache.update(k, v, i)
            del k, v
        assert self.cache.get_seq_length() == self.ctx
        total = self.ctx + args.warmup + args.steps + 8
        self.mask = torch.ones(1, total, dtype=torch.long)
        self.next_token = _random_ids(1, args.vocab, args.seed + 1)
        self.info["fill"] = "random K/V of prefill shape (DynamicCache.update)"

    def _fill_mamba(self, args):
        n = min(self.ctx, args.mamba_prefill)
        out = self.model(input_ids=_random_ids(n, args.vocab, args.seed + self.ctx), use_cache=True, logits_to_keep=1)
        self.cache = out.cache_params
        self.next_token = out.logits[:, -1:].argmax(-1)
        self.info["fill"] = f"real prefill of {n} tokens (state size independent of T)"
        self.info["prefilled_tokens"] = n

    # -- decode -----------------------------------------------------------------------------------------------
    def step(self):
        with torch.no_grad():
            if self.kind == "llama":
                n = self.cache.get_seq_length()
                out = self.model(input_ids=self.next_token, position_ids=torch.tensor([[n]]),
                                 attention_mask=self.mask[:, : n + 1], past_key_values=self.cache, use_cache=True)
            elif self.kind == "mamba":
                out = self.model(input_ids=self.next_token, cache_params=self.cache, use_cache=True)
            else:
                out = self.model(input_ids=self.next_token, past_key_values=self.cache, use_cache=True)
            self.next_token = out.logits[:, -1:].argmax(-1)

    def cache_bytes(self):
        if self.kind in ("aaren", "aaren_window"):
            return self.cache.state_bytes()
        total = 0
        for layer in self.cache.layers:
            if self.kind == "llama":
                tensors = [layer.keys, layer.values]
            else:
                tensors = list(layer.conv_states.values()) + list(layer.recurrent_states.values())
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return total


# ----------------------------------------------------------------------------------------------------------------
# The two measurements
# ----------------------------------------------------------------------------------------------------------------


def measure_memory(kind, ctx, args, state_out=None):
    """Build one model, fill its cache at ``ctx``, decode a few steps. Memory numbers mean something in a fresh
    process only."""
    torch.set_num_threads(args.threads)
    model = build_model(kind, args)
    release_free_memory()
    rss_model = rss_bytes()
    dec = Decoder(kind, model, ctx, args)
    peak_fill = peak_rss_bytes()
    if state_out is not None and kind in ("aaren", "aaren_window"):
        dec.save_state(state_out)
    release_free_memory()
    rss_after_fill = rss_bytes()
    reset_ok = reset_peak_rss()
    n = max(3, min(args.steps, 10))
    times = []
    for _ in range(n + 1):
        t0 = time.perf_counter()
        dec.step()
        times.append(time.perf_counter() - t0)
    peak_decode = peak_rss_bytes() if reset_ok else None
    peak_total = max(peak_fill, peak_decode or 0, peak_rss_bytes())
    return {
        "cache_bytes": dec.bytes_at_ctx,
        "cache_bytes_after_decode": dec.cache_bytes(),
        "rss_model_bytes": rss_model,
        "rss_after_fill_bytes": rss_after_fill,
        "peak_rss_bytes": peak_total,
        "peak_rss_fill_bytes": peak_fill,
        "peak_rss_decode_bytes": peak_decode,
        "isolated_latency_ms": 1e3 * statistics.median(times[1:]),
        "isolated_steps": n,
        "model": describe_model(kind, model),
        "code": code_fingerprint(),
        **dec.info,
    }


def measure_latency(args, state_files):
    """All (model, ctx) decoders alive at once; single steps interleaved in a shuffled order every round."""
    torch.set_num_threads(args.threads)
    decoders = {}
    for kind in args.models:
        model = build_model(kind, args)
        for ctx in args.contexts:
            decoders[(kind, ctx)] = Decoder(kind, model, ctx, args, state_files.get((kind, ctx)))
    keys = list(decoders)
    rng = random.Random(args.seed)
    times = {k: [] for k in keys}
    for r in range(args.warmup + args.steps):
        rng.shuffle(keys)
        for k in keys:
            t0 = time.perf_counter()
            decoders[k].step()
            dt = time.perf_counter() - t0
            if r >= args.warmup:
                times[k].append(dt)
    out = {}
    for (kind, ctx), ts in times.items():
        ts_ms = sorted(1e3 * t for t in ts)
        q = statistics.quantiles(ts_ms, n=4) if len(ts_ms) >= 2 else [ts_ms[0]] * 3
        out[(kind, ctx)] = {"latency_ms": statistics.median(ts_ms), "latency_ms_p25": q[0], "latency_ms_p75": q[2],
                            "latency_ms_min": ts_ms[0], "latency_steps": len(ts_ms),
                            "latency_fill": decoders[(kind, ctx)].info.get("fill"), "latency_code": code_fingerprint()}
    return out


# ----------------------------------------------------------------------------------------------------------------
# Subprocess plumbing
# ----------------------------------------------------------------------------------------------------------------


def _child_argv(argv_base, spec):
    return [sys.executable, os.path.abspath(__file__), *argv_base, "--_child", json.dumps(spec)]


def _run_child(argv_base, spec, timeout):
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        result_path = f.name
    spec = {**spec, "result": result_path}
    try:
        proc = subprocess.run(_child_argv(argv_base, spec), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            tail = (proc.stderr or "")[-3000:]
            raise RuntimeError(f"child {spec.get('mode')} {spec.get('kind', '')} {spec.get('ctx', '')} failed "
                               f"(exit {proc.returncode}):\n{tail}")
        with open(result_path) as f:
            return json.load(f)
    finally:
        os.unlink(result_path)


def child_main(args):
    spec = json.loads(args._child)
    if spec["mode"] == "memory":
        result = measure_memory(spec["kind"], spec["ctx"], args, spec.get("state_out"))
    else:
        files = {(k, int(c)): p for k, c, p in spec["state_files"]}
        result = {f"{k}|{c}": v for (k, c), v in measure_latency(args, files).items()}
    with open(spec["result"], "w") as f:
        json.dump(result, f)


def _argv_without_private(argv):
    """The parent's options, forwarded to children (minus --json and --_child)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--json", "--_child"):
            skip = True
            continue
        if a.startswith("--json=") or a.startswith("--_child="):
            continue
        out.append(a)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def human_ctx(n):
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def host_info():
    """CPU model, cores, library versions and load: what a reader needs to compare timings across machines (also used
    by report.py)."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
            cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": cpu, "cpu_count": os.cpu_count(), "usable_cores": usable, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def machine_info(args):
    info = host_info()
    info["loadavg_start"] = info.pop("loadavg")
    return {**info, "torch_threads": args.threads, "device": "cpu", "dtype": "float32", "batch_size": 1,
            "git": git_head(), "aaren_hf_code": code_fingerprint()}


def compute_checks(results, args):
    ctxs = args.contexts
    lo, hi = ctxs[0], ctxs[-1]
    span = f"{human_ctx(hi)}/{human_ctx(lo)}"
    ratios, checks = {}, []
    for kind in args.models:
        r = results[kind]
        ratios[kind] = {
            "latency_hi_over_lo": r[hi]["latency_ms"] / r[lo]["latency_ms"],
            "bytes_hi_over_lo": r[hi]["cache_bytes"] / r[lo]["cache_bytes"],
            "contexts": [lo, hi],
        }
        if "llama" in results and kind != "llama":
            ratios[kind]["vs_llama"] = {
                str(c): {"latency": r[c]["latency_ms"] / results["llama"][c]["latency_ms"],
                         "bytes": r[c]["cache_bytes"] / results["llama"][c]["cache_bytes"]} for c in ctxs}

    def add(name, value, op, threshold, target=True):
        ok = value <= threshold if op == "<=" else value >= threshold if op == ">=" else value > threshold
        checks.append({"name": name, "value": value, "op": op, "threshold": threshold, "pass": bool(ok),
                       "target": target})

    for kind, target in (("aaren", True), ("aaren_window", False)):
        if kind not in results:
            continue
        add(f"{LABELS[kind]} latency {span} ratio", ratios[kind]["latency_hi_over_lo"], "<=", FLAT_MAX, target)
        add(f"{LABELS[kind]} state bytes {span} ratio", ratios[kind]["bytes_hi_over_lo"], "<=", FLAT_MAX, target)
    if "llama" in results:
        add(f"Llama KV latency {span} ratio grows", ratios["llama"]["latency_hi_over_lo"], ">", FLAT_MAX)
        add(f"Llama KV cache bytes {span} ratio grows (linear: {hi / lo:g})", ratios["llama"]["bytes_hi_over_lo"],
            ">", FLAT_MAX)
        for kind, target in (("aaren", True), ("aaren_window", False)):
            if kind in results:
                factor = results["llama"][hi]["cache_bytes"] / results[kind][hi]["cache_bytes"]
                add(f"Llama KV cache / {LABELS[kind]} state at {human_ctx(hi)}", factor, ">=", BYTES_MIN_FACTOR, target)
    return ratios, checks


def print_report(report, args):
    m, results = report["machine"], report["results"]
    print("=" * 118)
    print("Aaren decode benchmark (benchmarks/bench_decode.py)")
    print(f"machine : {m['cpu']}; {m['cpu_count']} cores ({m['usable_cores']} usable); torch {m['torch']} with "
          f"{m['torch_threads']} thread(s); transformers {m['transformers']}; Python {m['python']}")
    print(f"          load average at start {m['loadavg_start']}, at end {m.get('loadavg_end')} (shared machine)")
    print(f"setting : CPU, float32, eval, torch.no_grad, batch 1, random init, greedy decode; contexts "
          f"{', '.join(human_ctx(c) for c in args.contexts)}; median of {args.steps} interleaved steps after "
          f"{args.warmup} warm-up")
    for kind in args.models:
        d = report["models"][kind]
        extras = ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("class",))
        print(f"  {LABELS[kind]:<10} {d['class']}: {extras}")
    base = {k: results[k][args.contexts[0]].get("rss_model_bytes") for k in args.models}
    print("RSS once imports + model are loaded (before any cache): "
          + ", ".join(f"{LABELS[k]} {format_bytes(v)}" for k, v in base.items()))
    print(f"code    : git {m.get('git')}; aaren_hf source sha256 {m.get('aaren_hf_code')}")
    if report.get("code_changed_during_run"):
        print("WARNING : aaren_hf's source changed during this run (the subprocesses saw different versions): "
              "rerun for numbers from one version.")
    print(f"memory  : each model/context in a fresh subprocess: {not report['in_process']}; 'peak RSS' = whole "
          "child (imports, model, fill/prefill, decode); 'decode peak' = high-water mark reset after the fill")
    print("-" * 118)
    hdr = (f"{'model':<10} {'context':>7} {'ms/token':>9} {'IQR ms':>13} {'x Llama':>8} {'cache/state':>12} "
           f"{'x Llama':>10} {'peak RSS':>10} {'decode peak':>12}  fill")
    print(hdr)
    print("-" * 118)
    for kind in args.models:
        for c in args.contexts:
            r = results[kind][c]
            lat_x = byt_x = "-"
            if "llama" in results and kind != "llama":
                lat_x = f"{r['latency_ms'] / results['llama'][c]['latency_ms']:.2f}"
                byt_x = f"1/{results['llama'][c]['cache_bytes'] / r['cache_bytes']:.0f}"
            iqr = f"{r['latency_ms_p25']:.1f}-{r['latency_ms_p75']:.1f}"
            fill = r.get("fill", "")
            print(f"{LABELS[kind]:<10} {human_ctx(c):>7} {r['latency_ms']:>9.2f} {iqr:>13} {lat_x:>8} "
                  f"{format_bytes(r['cache_bytes']):>12} {byt_x:>10} {format_bytes(r['peak_rss_bytes']):>10} "
                  f"{format_bytes(r.get('peak_rss_decode_bytes')):>12}  {fill}")
        print()
    lo, hi = args.contexts[0], args.contexts[-1]
    print(f"{human_ctx(hi)}/{human_ctx(lo)} ratios:")
    for kind in args.models:
        rr = report["ratios"][kind]
        print(f"  {LABELS[kind]:<10} latency x{rr['latency_hi_over_lo']:.2f}   cache/state bytes "
              f"x{rr['bytes_hi_over_lo']:.2f}")
    print("-" * 118)
    if args.contexts != list(DEFAULT_CONTEXTS):
        print(f"note: the targets are defined for contexts 1K..64K; this run used "
              f"{', '.join(human_ctx(c) for c in args.contexts)}")
    for ch in report["checks"]:
        tag = "PASS" if ch["pass"] else "FAIL"
        scope = "" if ch["target"] else "  [window row, not a target: its state holds ~(window + sinks) tokens of K/V]"
        print(f"{tag}  {ch['name']}: {ch['value']:.4g} (want {ch['op']} {ch['threshold']:g}){scope}")
    print("=" * 118)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args._child is not None:
        child_main(args)
        return None
    report = {"machine": machine_info(args), "in_process": bool(args.in_process),
              "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
              "models": {}, "results": {}}
    memory, state_files = {}, {}
    base = _argv_without_private(argv)
    old_threads = torch.get_num_threads()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        try:
            for kind in args.models:
                for ctx in args.contexts:
                    state_out = os.path.join(tmp, f"{kind}_{ctx}.safetensors") if kind.startswith("aaren") else None
                    t0 = time.perf_counter()
                    if args.in_process:
                        memory[(kind, ctx)] = measure_memory(kind, ctx, args, state_out)
                    else:
                        spec = {"mode": "memory", "kind": kind, "ctx": ctx, "state_out": state_out}
                        memory[(kind, ctx)] = _run_child(base, spec, args.child_timeout)
                    if state_out is not None and os.path.exists(state_out):
                        state_files[(kind, ctx)] = state_out
                    r = memory[(kind, ctx)]
                    print(f"[memory] {LABELS[kind]:<10} {human_ctx(ctx):>5}: cache {format_bytes(r['cache_bytes'])}, "
                          f"peak RSS {format_bytes(r['peak_rss_bytes'])}, fill {r['fill_s']:.1f}s "
                          f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            if args.in_process:
                latency = measure_latency(args, state_files)
            else:
                spec = {"mode": "latency", "state_files": [[k, c, p] for (k, c), p in state_files.items()]}
                raw = _run_child(base, spec, args.child_timeout)
                latency = {(k.split("|")[0], int(k.split("|")[1])): v for k, v in raw.items()}
            print(f"[latency] interleaved run done ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
        finally:
            torch.set_num_threads(old_threads)
    for kind in args.models:
        report["models"][kind] = memory[(kind, args.contexts[0])]["model"]
        report["results"][kind] = {}
        for ctx in args.contexts:
            row = {k: v for k, v in memory[(kind, ctx)].items() if k != "model"}
            row.update(latency[(kind, ctx)])
            report["results"][kind][ctx] = row
    report["machine"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    seen = {report["machine"]["aaren_hf_code"], code_fingerprint()}
    for rows in report["results"].values():
        for row in rows.values():
            seen.update({row.get("code"), row.get("latency_code")} - {None})
    report["code_changed_during_run"] = len(seen) > 1
    report["wall_s"] = time.perf_counter() - t_start
    report["ratios"], report["checks"] = compute_checks(report["results"], args)
    print_report(report, args)
    if args.json_path:
        out = {**report, "results": {k: {str(c): v for c, v in rows.items()} for k, rows in report["results"].items()}}
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json_path}")
    return report


if __name__ == "__main__":
    main()
