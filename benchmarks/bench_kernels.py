# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Benchmark the Aaren scan against causal softmax attention, on whatever this machine has.

CPU: PyTorch chunked path vs the sequential token loop (recurrent_aaren_torch) vs causal SDPA, forward, fp32.
CUDA: Triton chunk kernel (forward and forward+backward) vs the PyTorch chunked path vs causal SDPA
(FlashAttention) in bf16, with achieved GB/s and TFLOP/s against the device peak; then decode-step latency
vs batch size (Triton fused_recurrent vs the PyTorch step).

All ratios in a table come from the same run. ``--json PATH`` writes every measurement.

    python benchmarks/bench_kernels.py                      # CPU defaults: T = 1K..16K, H=8, D=64
    python benchmarks/bench_kernels.py --seqlens 1024 4096 --json out.json
    python benchmarks/bench_kernels.py --peak 989,4800      # override the peak table (TFLOP/s, GB/s)
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Through the installed package only: putting the repository root on sys.path would make its kernels/ folder a
# top-level `kernels`, which transformers probes for (docs/layout.md).
from aaren_hf.aaren_scan import chunk_aaren_torch, recurrent_aaren_torch

# Dense bf16 tensor-core TFLOP/s and HBM GB/s by device name (substring match, first hit wins).
PEAKS = [
    ("H200", 989.0, 4800.0),
    ("H100 PCIe", 756.0, 2000.0),
    ("H100", 989.0, 3350.0),
    ("GH200", 989.0, 4000.0),
    ("A100-SXM4-80GB", 312.0, 2039.0),
    ("A100-PCIE-80GB", 312.0, 1935.0),
    ("A100", 312.0, 1555.0),
    ("L40S", 362.0, 864.0),
    ("L4", 121.0, 300.0),
    ("A10G", 70.0, 600.0),
    ("RTX 4090", 165.0, 1008.0),
    ("RTX 3090", 71.0, 936.0),
    ("T4", 65.0, 320.0),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="default: 8 on CPU, 16 on CUDA")
    p.add_argument("--head-dim", type=int, default=None, help="default: 64 on CPU, 128 on CUDA")
    p.add_argument("--seqlens", type=int, nargs="+", default=None,
                   help="default: 1K..16K on CPU; 1K..64K on CUDA (plus 128K forward only)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="default: 32 on CPU (the model's default, fastest for the PyTorch path), 64 on CUDA")
    p.add_argument("--decay", action="store_true", help="with a per-token log-decay g")
    p.add_argument("--seq-max-t", type=int, default=4096,
                   help="longest T for the sequential token loop (it is slow; longer T are skipped)")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of repeats per measurement (median)")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    p.add_argument("--peak", default=None, help="TFLOPS,GBPS of this device (overrides the built-in table)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def timeit(fn, device, min_time):
    """Seconds per call after one warm-up call, repeated until min_time has passed. CUDA: median of event timings
    (at least 3). CPU: the minimum, the least disturbed by other processes on a shared machine."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    times, start = [], time.perf_counter()
    while True:
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if time.perf_counter() - start >= min_time and len(times) >= (3 if device == "cuda" else 1):
            break
    return statistics.median(times) if device == "cuda" else min(times)


def make_inputs(B, T, H, D, device, dtype, decay, requires_grad=False):
    gen = torch.Generator(device=device).manual_seed(0)
    s = torch.randn(B, T, H, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, device=device, generator=gen) + 3).to(dtype) if decay else None
    q = torch.randn(B, H, T, D, device=device, dtype=dtype, generator=gen)
    k = torch.randn(B, H, T, D, device=device, dtype=dtype, generator=gen)
    vt = v.transpose(1, 2).contiguous()
    xs = [s, v, q, k, vt] + ([g] if decay else [])
    for x in xs:
        x.requires_grad_(requires_grad)
    return s, v, g, q, k, vt


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def fmt_t(x):
    return "-" if x is None else (f"{x * 1e3:9.2f} ms" if x < 10 else f"{x:8.2f} s ")


def fmt_r(x):
    return "-" if x is None else f"{x:7.1f}x"


def print_table(header, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    print(line(header))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))


def bench_cpu(args, results):
    B, H, D = args.batch, args.heads or 8, args.head_dim or 64
    seqlens = args.seqlens or [1024, 2048, 4096, 8192, 16384]
    print(f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), forward, fp32, "
          f"B={B} H={H} D={D} chunk={args.chunk_size} decay={args.decay}")
    rows = []
    for T in seqlens:
        s, v, g, q, k, vt = make_inputs(B, T, H, D, "cpu", torch.float32, args.decay)
        with torch.no_grad():
            t_chunk = timeit(lambda: chunk_aaren_torch(s, v, g, chunk_size=args.chunk_size), "cpu", args.min_time)
            t_sdpa = timeit(lambda: sdpa(q, k, vt), "cpu", args.min_time)
            t_seq = None
            if T <= args.seq_max_t:
                t_seq = timeit(lambda: recurrent_aaren_torch(s, v, g), "cpu", 0.0)
        r = dict(device="cpu", T=T, B=B, H=H, D=D, chunk_torch_s=t_chunk, sequential_torch_s=t_seq,
                 sdpa_causal_s=t_sdpa,
                 seq_over_chunk=None if t_seq is None else t_seq / t_chunk, sdpa_over_chunk=t_sdpa / t_chunk)
        results["cpu_forward"].append(r)
        rows.append([T, fmt_t(t_chunk), fmt_t(t_seq), fmt_t(t_sdpa), fmt_r(r["seq_over_chunk"]),
                     fmt_r(r["sdpa_over_chunk"])])
    print_table(["T", "chunked (torch)", "sequential loop", "causal SDPA", "seq/chunked", "SDPA/chunked"], rows)
    skipped = [T for T in seqlens if T > args.seq_max_t]
    if skipped:
        print(f"sequential loop skipped for T > {args.seq_max_t} (--seq-max-t): linear in T, too slow to repeat")
    print("ratios > 1: the chunked Aaren scan is faster; CPU times are the minimum over repeats")
    rs = results["cpu_forward"]
    at4k = [r["seq_over_chunk"] for r in rs if r["T"] == 4096 and r["seq_over_chunk"] is not None]
    long = [r["sdpa_over_chunk"] for r in rs if r["T"] >= 4096]
    results["targets"] = dict(seq_over_chunk_at_4k_ge_10=at4k[0] >= 10 if at4k else None,
                              faster_than_sdpa_from_4k=all(x > 1 for x in long) if long else None)
    print(f"targets: chunked >= 10x the sequential loop at T=4K: {results['targets']['seq_over_chunk_at_4k_ge_10']}; "
          f"faster than causal SDPA for every T >= 4K: {results['targets']['faster_than_sdpa_from_4k']}")


def device_peak(args):
    if args.peak:
        tf, gb = (float(x) for x in args.peak.split(","))
        return tf, gb, "--peak"
    name = torch.cuda.get_device_name()
    for key, tf, gb in PEAKS:
        if key in name:
            return tf, gb, key
    return None, None, "unknown device (pass --peak TFLOPS,GBPS)"


def bench_cuda(args, results, dev="cuda"):
    from aaren_hf.kernels.aaren.chunk import ChunkAarenFunction, chunk_aaren_triton, num_segments
    from aaren_hf.kernels.aaren.fused_recurrent import fused_recurrent_aaren_triton

    B, H, D, C = args.batch, args.heads or 16, args.head_dim or 128, args.chunk_size
    seqlens = args.seqlens or [1024, 4096, 16384, 65536, 131072]
    peak_tf, peak_gb, src = device_peak(args)
    name = torch.cuda.get_device_name()
    results["device_name"], results["peak_tflops"], results["peak_gbs"] = name, peak_tf, peak_gb
    print(f"{name}: peak {peak_tf} TFLOP/s bf16, {peak_gb} GB/s ({src}); bf16 B={B} H={H} D={D} chunk={C} "
          f"decay={args.decay}")
    rows = []
    for T in seqlens:
        fwd_only = T > 65536
        s, v, g, q, k, vt = make_inputs(B, T, H, D, dev, torch.bfloat16, args.decay, requires_grad=not fwd_only)
        do = torch.randn_like(v)
        # Bytes: read s, v (, g), write o (bf16) and lse (fp32); backward reads s, v, g, do, lse, writes ds, dv, dg.
        el = B * T * H
        bytes_fwd = el * (2 + 2 * D + (2 if args.decay else 0) + 2 * D + 4)
        bytes_bwd = el * (2 + 2 * D + (4 if args.decay else 0) + 2 * D + 4 + 2 + 2 * D)
        flop_fwd = 2 * C * D * el  # C x C weights times V (the full tile, as computed)
        flop_bwd = 4 * C * D * el  # dO V^T and P^T dO
        flop_attn = 2 * T * T * D * B * H  # causal: half of 4 T^2 D
        aaren_in = [x for x in (s, v, g) if x is not None]
        cases = [  # name, call, differentiable inputs, output gradient
            ("triton", lambda: chunk_aaren_triton(s, v, g, chunk_size=C)[0], aaren_in, do),
            # the kernel without the split into pieces (chunk_aaren_triton splits where num_segments says so)
            ("one pass", lambda: ChunkAarenFunction.apply(s, v, g, None, None, None, C)[0], aaren_in, do),
            ("torch", lambda: chunk_aaren_torch(s, v, g, chunk_size=C)[0], aaren_in, do),
            ("sdpa", lambda: sdpa(q, k, vt), [q, k, vt], do.transpose(1, 2)),
        ]
        for mode in ("fwd",) if fwd_only else ("fwd", "fwd+bwd"):
            times = {}
            for impl, fn, inputs, grad in cases:
                if impl == "torch" and T > 65536:
                    times[impl] = None
                    continue
                call = _fwd(fn) if mode == "fwd" else _fwd_bwd(fn, inputs, grad)
                try:
                    times[impl] = timeit(call, dev, args.min_time)
                except torch.cuda.OutOfMemoryError:
                    times[impl] = None
                torch.cuda.empty_cache()
            tt = times["triton"]
            nbytes = bytes_fwd if mode == "fwd" else bytes_fwd + bytes_bwd
            nflop = flop_fwd if mode == "fwd" else flop_fwd + flop_bwd
            aflop = flop_attn if mode == "fwd" else 3.5 * flop_attn
            r = dict(device=name, mode=mode, T=T, B=B, H=H, D=D, triton_s=tt, torch_s=times["torch"],
                     one_pass_s=times["one pass"], pieces=num_segments(B, T, H, C, v.device),
                     sdpa_s=times["sdpa"], triton_gbs=nbytes / tt / 1e9 if tt else None,
                     triton_tflops=nflop / tt / 1e12 if tt else None,
                     sdpa_tflops=aflop / times["sdpa"] / 1e12 if times["sdpa"] else None)
            r["triton_pct_bw"] = 100 * r["triton_gbs"] / peak_gb if peak_gb and tt else None
            r["sdpa_pct_peak"] = 100 * r["sdpa_tflops"] / peak_tf if peak_tf and r["sdpa_tflops"] else None
            results["cuda"].append(r)
            ratio = lambda x: None if x is None or tt is None else x / tt  # noqa: E731
            rows.append([T, mode, fmt_t(tt), r["pieces"], fmt_r(ratio(times["one pass"])), fmt_t(times["torch"]),
                         fmt_t(times["sdpa"]), fmt_r(ratio(times["torch"])),
                         fmt_r(ratio(times["sdpa"])),
                         "-" if tt is None else f"{r['triton_gbs']:.0f} ({r['triton_pct_bw'] or 0:.0f}%)",
                         "-" if tt is None else f"{r['triton_tflops']:.1f}",
                         "-" if r["sdpa_tflops"] is None
                         else f"{r['sdpa_tflops']:.0f} ({r['sdpa_pct_peak'] or 0:.0f}%)"])
            del times
        del s, v, g, q, k, vt, do
        torch.cuda.empty_cache()
    print_table(["T", "pass", "triton", "pieces", "one pass/triton", "torch chunked", "SDPA (flash)", "torch/triton",
                 "SDPA/triton", "triton GB/s (%peak)", "triton TFLOP/s", "SDPA TFLOP/s (%peak)"], rows)
    print("torch chunked skipped above T=64K; 128K is forward only")

    # Decode: one token per sequence, state carried (constant memory), vs the PyTorch step.
    rows = []
    for Bd in args.decode_batches:
        s, v, g, *_ = make_inputs(Bd, 1, H, D, dev, torch.bfloat16, args.decay)
        st = (torch.randn(Bd, H, D, device=dev), torch.randn(Bd, H, device=dev))
        with torch.no_grad():
            t_tr = timeit(lambda: fused_recurrent_aaren_triton(s, v, g, st, True), dev, args.min_time)
            t_pt = timeit(lambda: recurrent_aaren_torch(s, v, g, st, True), dev, args.min_time)
        results["decode"].append(dict(batch=Bd, H=H, D=D, triton_s=t_tr, torch_s=t_pt))
        rows.append([Bd, f"{t_tr * 1e6:.1f} us", f"{t_pt * 1e6:.1f} us", fmt_r(t_pt / t_tr)])
    print()
    print_table(["batch", "triton step", "torch step", "torch/triton"], rows)


def _fwd(fn):
    def call():
        with torch.no_grad():
            fn()

    return call


def _fwd_bwd(fn, inputs, grad):
    return lambda: torch.autograd.grad(fn(), inputs, grad)


def main(argv=None):
    args = parse_args(argv)
    if args.chunk_size is None:
        args.chunk_size = 64 if args.device == "cuda" else 32
    if args.threads:
        torch.set_num_threads(args.threads)
    results = dict(args=vars(args), torch=torch.__version__, cpu_forward=[], cuda=[], decode=[])
    if args.device == "cuda":
        bench_cuda(args, results)
    else:
        bench_cpu(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
