# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Aaren scan kernels against the float64 reference ``naive_aaren``: forward and every gradient.

CPU runs: the Triton kernels go through the public dispatch (``aaren_hf.kernels``) with TRITON_INTERPRET=1, set per
test with monkeypatch, so other test files in the same process keep the PyTorch path. Our kernels are wrapped for
the current mode at launch time and call none of triton.language's own @jit helpers, so they run in the interpreter
whether triton was imported before or after TRITON_INTERPRET=1 was set. ``chunk_aaren_torch`` is checked against
the same reference. GPU-only checks are marked ``requires_gpu``; ``test_compiles_for_sm90`` needs no GPU.
"""

import copy
import itertools
import math
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import aaren_hf.kernels as K
from aaren_hf.aaren_scan import chunk_aaren_mixed
from aaren_hf.kernels import chunk_aaren, chunk_aaren_torch, fused_recurrent_aaren, naive_aaren

HAS_TRITON = K.triton_available()
if HAS_TRITON and os.environ.get("TRITON_INTERPRET") != "1":
    # Import triton in compiled mode before the fixture below turns the interpreter on: triton.jit decides
    # compiled vs interpreted when it wraps, and triton.language wraps its own helpers at import, so an interpreter-
    # mode import would leave the requires_gpu tests unable to compile. Our kernels run in the interpreter either way.
    import triton.language  # noqa: F401
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
NAMES = ("o", "ht_o", "ht_lse", "ds", "dv", "dg", "dh0_o", "dh0_lse")


@pytest.fixture(autouse=True)
def _backend_env(request, monkeypatch):
    monkeypatch.delenv("AAREN_BACKEND", raising=False)
    if request.node.get_closest_marker("requires_gpu"):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # compiled kernels
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter on CPU tensors


def make_inputs(B, T, H, D, scale=1.0, mode="random", decay=False, h0=False, mask=0.0, n_seq=None, seed=42,
                dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    if mode == "random":
        s = rnd(B, T, H) * scale
    else:  # monotone: +30 or -30 per step, plus unit noise
        step = 30.0 if mode == "inc" else -30.0
        s = step * torch.arange(T, dtype=torch.float64)[None, :, None] + rnd(B, T, H)
    if mask:
        s = s.masked_fill(torch.rand(B, T, H, generator=gen, dtype=torch.float64) < mask, float("-inf"))
    v = rnd(B, T, H, D)
    g = F.logsigmoid(2 * rnd(B, T, H) + 1) if decay else None  # in about [-5, 0]
    n = B if n_seq is None else n_seq
    state = (rnd(n, H, D), rnd(n, H) * scale) if h0 else None
    grads = (rnd(B, T, H, D), rnd(n, H, D), rnd(n, H))
    cast = lambda x: None if x is None else x.to(device=device, dtype=dtype)  # noqa: E731
    state = None if state is None else (state[0].to(device), state[1].to(device))  # states stay float64 / fp32
    return cast(s), cast(v), cast(g), state, tuple(x.to(device) for x in grads)


def run(fn, s, v, g, state, grads, cu_seqlens=None, chunk_size=64, state_dtype=None):
    """Forward, then the gradients of <o, do> + <ht_o, dht_o> + <ht_lse, dht_lse>, all returned in float64."""
    leaf = lambda x, dt=None: None if x is None else x.detach().to(dt or x.dtype).requires_grad_()  # noqa: E731
    s, v, g = leaf(s), leaf(v), leaf(g)
    st = None if state is None else (leaf(state[0], state_dtype), leaf(state[1], state_dtype))
    o, (ho, hl) = fn(s, v, g, st, True, cu_seqlens, chunk_size)
    do, dho, dhl = grads
    loss = (o.double() * do).sum() + (ho.double() * dho).sum()
    loss = loss + torch.where(torch.isfinite(hl), hl.double(), 0.0).mul(dhl).sum()  # an empty state has lse=-inf
    inputs = [x for x in (s, v, g) + (st or ()) if x is not None]
    gr = iter(torch.autograd.grad(loss, inputs))
    out = dict(o=o, ht_o=ho, ht_lse=hl, ds=next(gr), dv=next(gr), dg=next(gr) if g is not None else None)
    if st is not None:
        out["dh0_o"], out["dh0_lse"], out["h0_o"] = next(gr), next(gr), st[0]
    return {k: (x.detach().double() if x is not None else None) for k, x in out.items()}


def rms(x):
    return x.pow(2).mean().sqrt().item() if x.numel() else 0.0


def compare(res, ref, tol, v, label=""):
    """Error of each output: rms(err) / scale <= tol and max|err| / max(scale, max|ref|) <= 10 tol. The scale is
    rms(ref), except for ds, dg and d lse_0: at large score ranges the true ds is ~0 while its two terms are large
    (docs/aaren_math.md section 3), so these are measured against rms(<v_i, dv_i>) (and rms(<o_0, d o_0>))."""
    vdv = rms((v.double() * ref["dv"]).sum(-1))
    errs = {}
    for k in NAMES:
        a, b = res.get(k), ref.get(k)
        if b is None:
            assert a is None, k
            continue
        assert a.shape == b.shape, (k, a.shape, b.shape)
        assert not torch.isnan(a).any(), f"{label} NaN in {k}"
        fin = torch.isfinite(b)
        assert torch.equal(fin, torch.isfinite(a)), f"{label} inf pattern differs in {k}"
        a, b = a[fin], b[fin]
        if not b.numel():
            continue
        scale = max(rms(b), 1e-6)
        if k == "ds":
            scale = max(scale, vdv)
        elif k == "dg":
            scale = max(scale, vdv * math.sqrt(ref["dg"].shape[1]))
        elif k == "dh0_lse":
            scale = max(scale, vdv, rms((ref["h0_o"] * ref["dh0_o"]).sum(-1)))
        elif k == "ht_lse":
            scale = max(scale, 1.0)
        err = (a - b).abs()
        errs[k] = (rms(err) / scale, err.max().item() / max(scale, b.abs().max().item()))
    bad = {k: e for k, e in errs.items() if e[0] > tol or e[1] > 10 * tol}
    print(label, {k: f"{e[0]:.1e}/{e[1]:.1e}" for k, e in errs.items()})
    assert not bad, f"{label} errors over {tol}: {bad} (all: {errs})"
    return errs


IMPLS = {
    "triton": lambda *a: chunk_aaren(*a),  # the public entry point; TRITON_INTERPRET=1 routes it to Triton
    "torch": lambda *a: chunk_aaren_torch(*a),
}

# (B, T, H, D, scale, mode, decay, h0, mask, chunk_size): a spread, not the cartesian product.
CASES = [
    (2, 1, 2, 16, 1, "random", False, False, 0.0, 64),
    (2, 15, 2, 64, 1, "random", True, True, 0.0, 64),
    (2, 63, 2, 100, 50, "random", True, False, 0.2, 64),
    (1, 64, 4, 16, 1000, "random", False, True, 0.0, 64),
    (2, 65, 2, 64, 1, "inc", True, True, 0.0, 64),
    (2, 65, 2, 16, 1, "dec", False, False, 0.0, 64),
    (2, 100, 2, 100, 1000, "random", True, True, 0.1, 16),
    (1, 130, 2, 64, 50, "dec", True, True, 0.0, 32),
    (1, 1000, 2, 64, 50, "random", True, True, 0.05, 64),
    (1, 1000, 1, 100, 1, "inc", False, False, 0.0, 64),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-T{}-H{}-D{}-x{}-{}-decay{}-h0{}-mask{}-C{}".format(*c))
def test_chunk_vs_naive_fp64(case):
    B, T, H, D, scale, mode, decay, h0, mask, C = case
    s, v, g, state, grads = make_inputs(B, T, H, D, scale, mode, decay, h0, mask)
    ref = run(naive_aaren, s, v, g, state, grads)
    assert torch.isfinite(ref["o"]).all()
    res = run(chunk_aaren_torch, s, v, g, state, grads, chunk_size=C)
    compare(res, ref, 1e-9, v, "torch")
    if HAS_TRITON:
        res = run(chunk_aaren, s, v, g, state, grads, chunk_size=C)
        assert res["o"].dtype == torch.float64
        compare(res, ref, 1e-4 if scale < 1000 else 3e-4, v, "triton")


@needs_triton
@pytest.mark.parametrize("segments", [2, 3, 7])
@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[5], CASES[7]], ids=lambda c: "T{}-{}-decay{}-h0{}".format(
    c[1], c[5], c[6], c[7]))
def test_split_sequences_vs_naive(case, segments):
    """The GPU path for small B * H: sequences cut into pieces that run in parallel, joined by a scan of the
    pieces' summaries. Same function and gradients (initial state absent or given, decay, masked scores)."""
    from aaren_hf.kernels.aaren.chunk import split_chunk_aaren

    B, T, H, D, scale, mode, decay, h0, mask, C = case
    C = 16  # several chunks per piece
    s, v, g, state, grads = make_inputs(B, T, H, D, scale, mode, decay, h0, mask)
    ref = run(naive_aaren, s, v, g, state, grads)
    split = lambda s, v, g, st, out, cu, C: split_chunk_aaren(s, v, g, st, out, C, segments)  # noqa: E731
    compare(run(split, s, v, g, state, grads, chunk_size=C), ref, 1e-4, v, f"split {segments}")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunk_low_precision_inputs(dtype):
    """fp32 and 16-bit inputs (upcast on load) against float64 on the same rounded inputs; fp32 initial state."""
    B, T, H, D = 2, 90, 2, 64
    s, v, g, state, grads = make_inputs(B, T, H, D, 5.0, "random", True, True, 0.1, dtype=dtype)
    ref = run(naive_aaren, s.double(), v.double(), g.double(), state, grads)
    res = run(chunk_aaren, s, v, g, state, grads, state_dtype=torch.float32)
    for k, x in res.items():
        assert x is None or not torch.isnan(x).any(), k
    compare(res, ref, 1e-4 if dtype == torch.float32 else 1e-2, v, str(dtype))


@pytest.mark.parametrize("impl", ["triton", "torch", "fused"])
def test_varlen(impl):
    if impl != "torch" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    lens = [1, 63, 0, 70, 15] if impl == "fused" else [1, 64, 0, 129, 15, 65]
    cu = torch.tensor([0] + lens).cumsum(0)
    T = int(cu[-1])
    s, v, g, state, grads = make_inputs(1, T, 2, 16 if impl == "fused" else 100, 20.0, "random", True, True, 0.1,
                                        n_seq=len(lens))
    ref = run(naive_aaren, s, v, g, state, grads, cu_seqlens=cu)
    fn = {"triton": chunk_aaren, "torch": chunk_aaren_torch, "fused": fused_recurrent_aaren}[impl]
    res = run(fn, s, v, g, state, grads, cu_seqlens=cu)
    compare(res, ref, 1e-9 if impl == "torch" else 1e-4, v, impl)


@needs_triton
@pytest.mark.parametrize("decay", [False, True])
def test_fused_recurrent_vs_naive(decay):
    s, v, g, state, grads = make_inputs(2, 40, 2, 100, 50.0, "random", decay, True, 0.1)
    ref = run(naive_aaren, s, v, g, state, grads)
    res = run(fused_recurrent_aaren, s, v, g, state, grads)
    compare(res, ref, 1e-4, v, "fused")


@pytest.mark.parametrize("impl", ["triton", "torch", "fused", "split", "recurrent"])
def test_values_shared_by_groups_of_op_heads(impl):
    """v with fewer heads than s (Hv = 2 for H = 6): op head h reads value head h // 3, as the model's kv heads serve
    their query heads and slots, without copies. The reference reads them so (the same as repeating the values
    per op head, dv summed over each group); every implementation gives its outputs and gradients."""
    if impl in ("triton", "fused", "split") and not HAS_TRITON:
        pytest.skip("triton is not installed")
    B, T, H, Hv, D = 2, 70, 6, 2, 32
    s, v, g, state, grads = make_inputs(B, T, H, D, 20.0, "random", True, True, 0.1)
    v = v[:, :, :Hv].contiguous()
    ref = run(naive_aaren, s, v, g, state, grads)
    copied = run(naive_aaren, s, v.repeat_interleave(H // Hv, 2), g, state, grads)
    torch.testing.assert_close(ref["o"], copied["o"], rtol=0, atol=0)
    torch.testing.assert_close(ref["dv"], copied["dv"].view(B, T, Hv, H // Hv, D).sum(3), rtol=1e-12, atol=1e-12)
    from aaren_hf.kernels.aaren.chunk import split_chunk_aaren

    fn = {"triton": chunk_aaren, "torch": chunk_aaren_torch, "fused": fused_recurrent_aaren,
          "recurrent": K.recurrent_aaren_torch,
          "split": lambda s, v, g, st, out, cu, C: split_chunk_aaren(s, v, g, st, out, C, 3)}[impl]
    res = run(fn if impl != "recurrent" else lambda *a: fn(*a[:6]), s, v, g, state, grads, chunk_size=16)
    assert res["dv"].shape == v.shape
    compare(res, ref, 1e-9 if impl in ("torch", "recurrent") else 1e-4, v, impl)


@needs_triton
def test_the_split_goes_where_programs_leave_an_h200_idle(monkeypatch):
    """num_segments on a GPU with 132 SMs (an H200), at SmolLM2's 36 op heads (9 query heads x 4 slots) and the
    benchmark's 16: pieces where B x H programs would leave most SMs idle and each piece keeps 16+ chunks; none
    below 8K tokens, none on a CPU."""
    from types import SimpleNamespace

    from aaren_hf.kernels.aaren.chunk import num_segments

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    gpu = torch.device("cuda")
    assert num_segments(2, 8192, 36, 64, gpu) == 4  # a 2 x 8K train step: 72 programs -> 288
    assert num_segments(1, 32768, 36, 64, gpu) == 8
    assert num_segments(1, 16384, 16, 64, gpu) == 16
    assert num_segments(8, 2048, 36, 64, gpu) == 1  # below 8K tokens
    assert num_segments(8, 8192, 16, 64, gpu) == 1  # 128 programs already: 3 pieces would not pay
    assert num_segments(1, 8192, 16, 64, torch.device("cpu")) == 1


@needs_triton
@pytest.mark.parametrize("decay,h0,mask", [(False, False, 0.0), (True, True, 0.1), (True, False, 0.3)])
def test_per_token_lse_and_its_gradient(decay, h0, mask):
    """The Triton op's per-token lse (the split hands its summary scan's on as carries) and the gradients that flow
    back through it (the backward takes delta_t - dlse_t, and dg the suffix sums of dlse) against the PyTorch
    scan's per-token states, in float64: masked tokens, empty leading rows (lse = -inf, no gradient), decay, an
    initial state."""
    from aaren_hf.aaren_scan import empty_state, scan_states
    from aaren_hf.kernels.aaren.chunk import ChunkAarenFunction

    B, T, H, D = 2, 150, 3, 20
    s, v, g, state, (do, _, _) = make_inputs(B, T, H, D, 3.0, "random", decay, h0, mask)
    glse = torch.randn(B, T, H, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    results = []
    for impl in ("triton", "reference"):
        leaves = [x.detach().clone().requires_grad_() for x in (s, v, g) + (state or ()) if x is not None]
        it = iter(leaves)
        s_, v_, g_ = next(it), next(it), next(it) if g is not None else None
        st = (next(it), next(it)) if state is not None else None
        if impl == "triton":
            o, lse, _, _ = ChunkAarenFunction.apply(s_, v_, g_, *(st or (None, None)), None, 32)
        else:
            init = st or tuple(x.double() for x in empty_state(B, H, D))
            o, lse = scan_states(s_.transpose(1, 2), v_.transpose(1, 2), None if g_ is None else g_.transpose(1, 2),
                                 *init, 16)
            o, lse = o.transpose(1, 2), lse.transpose(1, 2)
        loss = (o * do).sum() + torch.where(torch.isfinite(lse), lse, 0.0).mul(glse).sum()
        results.append([o, lse] + list(torch.autograd.grad(loss, leaves)))
    assert torch.isinf(results[1][1]).any() == (not h0 and mask > 0.2)  # empty leading rows where meant
    names = ["o", "lse", "ds", "dv"] + ["dg"] * decay + ["dh0_o", "dh0_lse"] * h0
    for name, got, want in zip(names, *results, strict=True):
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got)), name
        # the kernels compute in float32
        assert (got[fin] - want[fin]).abs().max() <= 1e-5 * (1 + want[fin].abs().max()), name


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_shift_invariance(impl):
    """Without decay or initial state, and with no gradient on the final lse, sum_i ds_i = 0 per sequence."""
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    B, T, H, D = 2, 150, 2, 64
    s, v, _, _, (do, dho, _) = make_inputs(B, T, H, D, 50.0, "random", mask=0.1)
    ref = run(naive_aaren, s, v, None, None, (do, dho, torch.zeros(B, H, dtype=torch.float64)))
    res = run(IMPLS[impl], s, v, None, None, (do, dho, torch.zeros(B, H, dtype=torch.float64)))
    scale = rms((v * ref["dv"]).sum(-1))
    assert res["ds"].sum(1).abs().max().item() < 1e-4 * scale * math.sqrt(T)
    assert ref["ds"].sum(1).abs().max().item() < 1e-9 * scale * math.sqrt(T)


@needs_triton
@pytest.mark.parametrize("decay", [False, True])
def test_decode_after_prefill(decay):
    """Chunked prefill, then one token at a time from its final state, equals the full chunked forward."""
    B, T, T0, H, D = 2, 75, 67, 2, 64
    s, v, g, state, _ = make_inputs(B, T, H, D, 10.0, "random", decay, True, 0.1, dtype=torch.float32)
    state = (state[0].float(), state[1].float())
    full, full_ht = chunk_aaren(s, v, g, state, True)
    o, st = chunk_aaren(s[:, :T0], v[:, :T0], None if g is None else g[:, :T0], state, True)
    outs = [o]
    for t in range(T0, T):
        g_t = None if g is None else g[:, t : t + 1]
        o_t, st = fused_recurrent_aaren(s[:, t : t + 1], v[:, t : t + 1], g_t, st, True)
        outs.append(o_t)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st[0], full_ht[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st[1], full_ht[1], rtol=1e-5, atol=1e-5)
    # and the PyTorch decode path from the Triton prefill state
    _, st = chunk_aaren(s[:, :T0], v[:, :T0], None if g is None else g[:, :T0], state, True)
    o_t, _ = K.recurrent_aaren_torch(s[:, T0:], v[:, T0:], None if g is None else g[:, T0:], st)
    torch.testing.assert_close(o_t, full[:, T0:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["triton", "torch", "fused"])
def test_fully_masked(impl):
    """Rows with every score -inf: o = 0 (or the initial state), an empty final state, finite gradients."""
    if impl != "torch" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    B, T, H, D = 2, 70, 2, 16
    s, v, g, _, grads = make_inputs(B, T, H, D, 1.0, "random", True)
    s[0] = float("-inf")  # batch row 0: nothing at all
    s[1, :, 0] = float("-inf")  # batch row 1, head 0
    fn = {"triton": chunk_aaren, "torch": chunk_aaren_torch, "fused": fused_recurrent_aaren}[impl]
    ref = run(naive_aaren, s, v, g, None, grads)
    res = run(fn, s, v, g, None, grads)
    assert (res["o"][0] == 0).all() and (res["o"][1, :, 0] == 0).all() and (res["ht_o"][0] == 0).all()
    assert torch.isneginf(res["ht_lse"][0]).all() and torch.isneginf(res["ht_lse"][1, 0])
    for k in ("ds", "dv", "dg"):
        assert torch.isfinite(res[k]).all(), k
        assert (res[k][0] == 0).all(), k  # nothing depends on a fully masked row
    compare(res, ref, 1e-9 if impl == "torch" else 1e-4, v, impl)
    # with an initial state, a fully masked row returns that state, decayed
    st = (torch.randn(B, H, D, dtype=torch.float64), torch.randn(B, H, dtype=torch.float64))
    ref = run(naive_aaren, s, v, g, st, grads)
    res = run(fn, s, v, g, st, grads)
    torch.testing.assert_close(res["o"][0], st[0][0].expand(T, H, D), rtol=1e-5, atol=1e-5)
    compare(res, ref, 1e-9 if impl == "torch" else 1e-4, v, impl + " h0")


# (B, T, Hkv, G, J, D, chunk_size, decay, h0): slots mixed inside the chunks, values shared per kv head
MIXED_CASES = [(2, 37, 2, 3, 4, 8, 8, True, True), (1, 5, 1, 1, 1, 4, 64, False, False),
               (2, 64, 3, 3, 2, 16, 16, True, False), (1, 100, 2, 2, 3, 8, 32, True, True), (1, 9, 1, 2, 2, 4, 1, True, True)]


def mixed_scan_inputs(case, gen, score_scale=3.0, dtype=torch.float64):
    """(s, v, mix, g, state) for a MIXED_CASES case: row 0 starts with masked tokens (s = -inf, g = 0), one op head
    of row 1 is masked throughout."""
    B, T, Hkv, G, J, D, C, decay, h0 = case
    HJ = Hkv * G * J
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)  # noqa: E731
    s = rnd(B, T, HJ) * score_scale
    s[0, : min(3, T)] = float("-inf")
    if B > 1:
        s[1, :, 0] = float("-inf")
    v, mix = rnd(B, T, Hkv, D), torch.softmax(rnd(B, T, Hkv * G, J), -1)
    g = F.logsigmoid(2 * rnd(B, T, HJ) + 1).masked_fill(torch.isinf(s), 0.0) if decay else None
    return s, v, mix, g, (rnd(B, HJ, D), rnd(B, HJ)) if h0 else None


@pytest.mark.parametrize("case", MIXED_CASES, ids=lambda c: "B{}-T{}-Hkv{}-G{}-J{}-D{}-C{}-decay{}-h0{}".format(*c))
def test_chunk_aaren_mixed_equals_the_scan_per_slot_then_mixed(case):
    """The model's CPU read of the scan (aaren_scan.chunk_aaren_mixed) against chunk_aaren_torch per op head, values
    repeated to the op heads, outputs mixed over the slots: outputs, final state and every gradient, float64. Row 0
    starts with masked tokens, one head of row 1 is masked throughout."""
    B, T, Hkv, G, J, D, C, decay, h0 = case
    HJ = Hkv * G * J
    gen = torch.Generator().manual_seed(7)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    s, v, mix, g, st = mixed_scan_inputs(case, gen)
    inputs = [x.requires_grad_() for x in (s, v, mix) + ((g,) if decay else ()) + (st or ())]
    weights = (rnd(B, T, Hkv * G, D), rnd(B, HJ, D), rnd(B, HJ))

    def loss(out, final):
        lse = torch.where(torch.isfinite(final[1]), final[1], 0.0)
        return (out * weights[0]).sum() + (final[0] * weights[1]).sum() + (lse * weights[2]).sum()

    out, final = chunk_aaren_mixed(s, v, mix, g, st, True, chunk_size=C)
    repeated = v.unsqueeze(3).expand(B, T, Hkv, G * J, D).reshape(B, T, HJ, D)
    o, want_final = chunk_aaren_torch(s, repeated, g, st, True, chunk_size=C)
    want = (mix.unsqueeze(-1) * o.view(B, T, Hkv * G, J, D)).sum(3)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(final, want_final, atol=1e-12, rtol=0)
    got_grads = torch.autograd.grad(loss(out, final), inputs)
    want_grads = torch.autograd.grad(loss(want, want_final), inputs)
    for a, b in zip(got_grads, want_grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@needs_triton
@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("case", MIXED_CASES, ids=lambda c: "B{}-T{}-Hkv{}-G{}-J{}-D{}-C{}-decay{}-h0{}".format(*c))
def test_triton_mixed_scan_equals_chunk_aaren_mixed(case, segments):
    """The GPU's read of the scan in training (``fused_chunk_aaren_mixed``: the Triton scan per op head, its slots
    mixed after it, the mix's gradient formed inside its backward from the mixed output's) against its reference
    chunk_aaren_mixed in float64: output, final state and every gradient, the mix's included. Row 0 starts with
    masked tokens, one op head of row 1 is masked throughout; also cut into 3 pieces (the split a GPU takes from 8K
    tokens), where the mix enters the second pass only."""
    mixed_scan_beside_reference(case, segments, "cpu", torch.float64, 1e-4)


@pytest.mark.requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_mixed_scan_equals_chunk_aaren_mixed(dtype):
    """The compiled mixed scan at SmolLM2's mixer shape (3 kv heads, 3 query heads each, 4 slots, D = 64) against
    its float64 reference: one pass, and the split into pieces."""
    for segments in (1, 4):
        mixed_scan_beside_reference((2, 1000, 3, 3, 4, 64, 64, True, True), segments, "cuda", dtype,
                                    1e-3 if dtype == torch.float32 else 3e-2)


def mixed_scan_beside_reference(case, segments, device, dtype, tol):
    from aaren_hf.kernels import fused_chunk_aaren_mixed
    from aaren_hf.kernels.aaren.chunk import split_chunk_aaren

    B, T, Hkv, G, J, D, C, decay, h0 = case
    C, HJ = max(C, 16), Hkv * G * J  # the Triton kernels' smallest chunk
    gen = torch.Generator().manual_seed(13)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    s, v, mix, g, st = mixed_scan_inputs(case, gen)
    # the reference sees the inputs the kernel sees (rounded to dtype), in float64; mix and state stay float32
    s, v, g = (None if x is None else x.to(dtype).double() for x in (s, v, g))
    mix, st = mix.float().double(), None if st is None else tuple(x.float().double() for x in st)
    inputs = [x.requires_grad_() for x in (s, v, mix) + ((g,) if decay else ()) + (st or ())]
    weights = (rnd(B, T, Hkv * G, D), rnd(B, HJ, D), rnd(B, HJ))

    def loss(out, final):
        lse = torch.where(torch.isfinite(final[1]), final[1], 0.0)
        return ((out.double() * weights[0]).sum() + (final[0].double() * weights[1]).sum()
                + (lse.double() * weights[2]).sum())

    on_device = [x.detach().to(device).requires_grad_() for x in inputs]
    s_, v_, mix_ = on_device[0].to(dtype), on_device[1].to(dtype), on_device[2].float()
    g_ = on_device[3].to(dtype) if decay else None
    st_ = tuple(x.float() for x in on_device[-2:]) if h0 else None
    if segments == 1:
        out, final = fused_chunk_aaren_mixed(s_, v_, mix_, g_, st_, True, C)
    else:
        out, final = split_chunk_aaren(s_, v_, g_, st_, True, C, segments, mix_)
    want, want_final = chunk_aaren_mixed(s, v, mix, g, st, True, chunk_size=C)
    assert out.shape == want.shape and out.dtype == dtype
    def close(name, a, b):  # max error within tol of the largest entry (1 at least); -inf (empty lse) where b's is
        a, b = a.detach().double().cpu(), b.detach()
        assert a.shape == b.shape and torch.equal(torch.isfinite(a), torch.isfinite(b)), name
        a, b = a[torch.isfinite(b)], b[torch.isfinite(b)]
        assert (a - b).abs().max() <= tol * max(b.abs().max().item(), 1.0), (name, (a - b).abs().max().item())

    for name, a, b in zip(("out", "final o", "final lse"), (out, *final), (want, *want_final)):
        close(name, a, b)
    got_grads = torch.autograd.grad(loss(out, final), on_device)
    want_grads = torch.autograd.grad(loss(want, want_final), inputs)
    names = ("s", "v", "mix") + (("g",) if decay else ()) + (("h0_o", "h0_lse") if h0 else ())
    for name, a, b in zip(names, got_grads, want_grads):
        close("d" + name, a, b)


@pytest.mark.parametrize("case", ["paper", "slots3", "decay_learned", "decay_input", "gqa_slots_window"])
@pytest.mark.parametrize("score_scale", [3.0, 1e4])
def test_aaren_prefill_cpu_equals_the_branch_reference(case, score_scale):
    """The C prompt branch (kernels/aaren/step.c, aaren_branch_prefill: slot scores, decays, scan, the slots' mix)
    against the model's own PyTorch path in float64 (which the kernel declines): outputs, masked slot scores and
    state over two pieces (the second continuing the first's state), an odd length, padding at the start of row 0,
    scores up to about 1e4; the caller's state untouched."""
    from aaren_hf.kernels.aaren import aaren_prefill_cpu
    from aaren_hf.modeling_aaren import AarenLayerState
    from helpers import MIXER_CASES, tiny_model

    model = tiny_model(**MIXER_CASES[case])
    mixer = model.model.layers[0].mixer
    with torch.no_grad():
        mixer.queries.mul_(score_scale / 3.0)
        reference = copy.deepcopy(mixer).double()
    x = torch.randn(2, 23, model.config.hidden_size, generator=torch.Generator().manual_seed(11))
    mask = torch.ones(2, 23, dtype=torch.bool)
    mask[0, :4] = False
    runs = {}
    for name, m, dtype in (("c", mixer, torch.float32), ("reference", reference, torch.float64)):
        state, out = AarenLayerState(), []
        with torch.no_grad():
            for piece in (slice(0, 13), slice(13, 23)):
                xp, mp = x[:, piece].to(dtype), mask[:, piece]
                q, k, v = m.project(xp)
                out += [*m.aaren_output(xp, q, k, v, mp, state), state.aaren_o, state.aaren_lse]
        runs[name] = out
    carried = runs["c"][-2:]
    kept = [t.clone() for t in carried]
    with torch.no_grad():
        q, k, v = mixer.project(x)
        got = aaren_prefill_cpu(q, k, v, mask, mixer.queries, mixer.scale, mixer.decay,
                                getattr(mixer, "log_decay", None),
                                mixer.decay_proj(x) if mixer.decay == "input" else None, tuple(carried), True)
    if got is None:
        pytest.skip("no C compiler")
    assert all(torch.equal(a, b) for a, b in zip(carried, kept))
    for i, (a, b) in enumerate(zip(runs["c"], runs["reference"])):
        assert a.dtype == torch.float32 and torch.equal(torch.isfinite(a), torch.isfinite(b)), i
        a, b = a[torch.isfinite(b)].double(), b[torch.isfinite(b)]
        assert (a - b).abs().max() <= 1e-5 * max(b.abs().max().item(), 1.0), (i, (a - b).abs().max().item())


@pytest.mark.parametrize("decay", ["none", "learned", "input"])
@pytest.mark.parametrize("H, Hkv, J, D", [(4, 2, 3, 16), (3, 3, 1, 24), (2, 1, 9, 8)])
def test_aaren_prefill_cpu_is_the_decode_step_bit_for_bit(decay, H, Hkv, J, D):
    """A prompt through the C prefill in one call, in pieces of 1, 2 and 6 tokens, and token after token through
    the C decode step (kernels/mixer: aaren/step.c's aaren_branch_step) gives the same outputs and state bit for
    bit: one per-token code serves both, so a prompt's split changes no bit. Padding inside the prompt, op heads not
    a multiple of the eight lanes, scores from tiny to about 1e3."""
    from aaren_hf.kernels.aaren import aaren_prefill_cpu
    from aaren_hf.kernels.mixer import mixer_step_cpu
    from aaren_hf.modeling_aaren import AarenLayerState

    g = torch.Generator().manual_seed(5)
    B, T = 2, 17
    q, k, v = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, Hkv, D, generator=g), torch.randn(
        B, T, Hkv, D, generator=g)
    k[1, 9] *= 300.0
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:5] = False
    mask[1, 16] = False
    queries, scale = torch.randn(H, J, D, generator=g), D ** -0.5
    log_decay = (torch.randn(H, J, generator=g) - 3.0) if decay != "none" else None
    decay_in = torch.randn(B, T, H * J, generator=g) if decay == "input" else None
    pos = torch.where(mask, torch.arange(T).expand(B, T), -1)

    def prefill(piece, carried):
        return aaren_prefill_cpu(q[:, piece], k[:, piece], v[:, piece], mask[:, piece], queries, scale, decay,
                                 log_decay, None if decay_in is None else decay_in[:, piece], carried, True)

    with torch.no_grad():
        whole = prefill(slice(0, T), None)
        if whole is None:
            pytest.skip("no C compiler")
        runs = {}
        for name, cuts in (("pieces", (0, 1, 3, 9, T)), ("steps", (0, 1))):
            outs, carried = [], None
            for a, b in zip(cuts[:-1], cuts[1:]):
                o, _, carried = prefill(slice(a, b), carried)
                outs.append(o)
            if name == "steps":
                state = AarenLayerState()
                state.aaren_o, state.aaren_lse = carried
                for t in range(1, T):
                    one = slice(t, t + 1)
                    outs.append(mixer_step_cpu(
                        q[:, one], k[:, one], v[:, one], pos[:, one], mask[:, one], state, queries=queries,
                        log_decay=log_decay, decay_in=None if decay_in is None else decay_in[:, one], decay=decay,
                        angles=None, sink_turn=None, window=0, sinks=0, memory_size=0, bits=None, rotate=False,
                        retention=None, rule="learned", share=0, shared_retention=None, gate=None, scale=scale))
                carried = (state.aaren_o, state.aaren_lse)
            runs[name] = (torch.cat(outs, 1), *carried)
    for name, got in runs.items():
        for a, b in zip(got, (whole[0], *whole[2])):
            assert torch.isfinite(a).all() and torch.equal(a, b), name


@pytest.mark.parametrize("case", ["window_sinks_gate_input", "partial_rotary", "gqa_slots_window"])
def test_window_queries_cpu_equals_its_reference(case):
    """A prompt's queries in C (kernels/window/chunk.c, aaren_window_queries) against the PyTorch lines of
    _window_attention_fused: the rotated queries bit for bit, the sinks' scores (_sink_scores' gather and matmul) to
    float rounding. Queries at padding (-1), inside the first S + W
    positions and beyond, a sink not yet filled, two rows, an odd length, queries and positions that are slices of
    longer tensors (as a second piece of a prompt is), bfloat16 sink keys (a bfloat16 cache). With gradients wanted
    the C call declines and autograd's path runs."""
    from aaren_hf.kernels.window import window_queries_cpu
    from aaren_hf.modeling_aaren import Rotary, _sink_scores
    from helpers import MIXER_CASES, tiny_model

    mixer = tiny_model(**MIXER_CASES[case]).model.layers[0].mixer
    g = torch.Generator().manual_seed(3)
    B, T, H, Hkv, D, S, W = 2, 19, mixer.num_heads, mixer.num_kv_heads, mixer.head_dim, mixer.num_sinks, mixer.window
    assert S > 0
    q = torch.randn(B, T + 4, H, D, generator=g)[:, 4:]
    sink_k = (torch.randn(B, S, Hkv, D, generator=g) * 4.0).bfloat16()
    sink_pos = torch.arange(S).expand(B, S).clone()
    sink_pos[1, -1] = -1  # not filled yet: never seen
    pos = torch.stack([torch.arange(T + 4) - 6, torch.arange(T + 4) * 3 + 40])[:, 4:]
    assert not q.is_contiguous() and not pos.is_contiguous()
    rotary = Rotary(pos, mixer.rope_inv_freq)
    with torch.no_grad():
        got = window_queries_cpu(q, pos, rotary.angles(), sink_k, sink_pos, rotary.back_angles(B, S + W), W)
        if got is None:
            pytest.skip("no C compiler")
        want_q = rotary.rotate(q.contiguous())
        want_s = _sink_scores(q, pos, sink_k, W, rotary, torch.float32).view(B, T, H, S)
    qr, scores = got
    assert torch.equal(qr, want_q) and not torch.equal(qr, q)
    torch.testing.assert_close(scores, want_s, rtol=1e-5, atol=1e-5)
    q.requires_grad_()
    assert window_queries_cpu(q, pos, rotary.angles(), sink_k, sink_pos, rotary.back_angles(B, S + W), W) is None
    _sink_scores(q, pos, sink_k, W, rotary, torch.float32).sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_aaren_prefill_cpu_declines_where_its_reference_runs(monkeypatch):
    """Gradients wanted, float64, or the C kernels turned off (AAREN_BACKEND=torch): None, so the model runs the
    PyTorch branch (the chunked scan)."""
    from aaren_hf.kernels.aaren import aaren_prefill_cpu

    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8)
    mask, queries = torch.ones(1, 5, dtype=torch.bool), torch.randn(2, 2, 8)
    with torch.no_grad():
        if aaren_prefill_cpu(q, k, v, mask, queries, 0.3, "none") is None:
            pytest.skip("no C compiler")
        assert aaren_prefill_cpu(q.double(), k.double(), v.double(), mask, queries.double(), 0.3, "none") is None
    assert aaren_prefill_cpu(q, k, v, mask, queries.requires_grad_(), 0.3, "none") is None
    monkeypatch.setenv("AAREN_BACKEND", "torch")
    with torch.no_grad():
        assert aaren_prefill_cpu(q, k, v, mask, queries, 0.3, "none") is None


@needs_triton
def test_interpreter_after_compiled_import():
    """triton imported (compiled mode) before TRITON_INTERPRET=1 is set, as when other test files import it first:
    the kernels must still run in the interpreter."""
    code = (
        "import os, torch, triton, triton.language\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from aaren_hf.kernels import chunk_aaren, fused_recurrent_aaren, naive_aaren\n"
        "s = torch.randn(1, 70, 2, dtype=torch.float64, requires_grad=True)\n"
        "v, g = torch.randn(1, 70, 2, 16, dtype=torch.float64), -torch.rand(1, 70, 2, dtype=torch.float64)\n"
        "ref = naive_aaren(s, v, g)[0]\n"
        "for fn in (chunk_aaren, fused_recurrent_aaren):\n"
        "    o = fn(s, v, g)[0]\n"
        "    o.sum().backward()\n"
        "    assert (o - ref).abs().max() < 1e-5, fn\n"
    )
    env = {k: x for k, x in os.environ.items() if k not in ("TRITON_INTERPRET", "AAREN_BACKEND")}
    env["PYTHONSAFEPATH"] = "1"  # as `python -P`: kernels/ must not be importable as a top-level `kernels`
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


@needs_triton
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_memory_codes_kernel_is_the_reference_bit_for_bit(bits, rotate, monkeypatch):
    """round_with_codes in Triton (kernels/memory/codes.py) against its PyTorch reference (encode, then decode): the
    same codes, scales and values bit for bit, over vectors of every scale (zero, tiny, huge, one channel near
    float32's largest), widths 2-256 and a leading shape with no rows; 16-bit x read as it lies, and the values
    written in 16 bits as ``to_cache`` casts the reference's (float16 saturating); through the model's dispatch as
    a GPU runs it too, where the gradient passes straight through to x in x's dtype."""
    import aaren_hf.modeling_aaren as modeling
    from aaren_hf.kernels.memory.codes import memory_round_triton
    from aaren_hf.modeling_aaren import MemoryCodes, to_cache
    from helpers import code_test_vectors

    codes_of = MemoryCodes(bits, rotate)
    for x32 in code_test_vectors(bits + rotate):
        # (16-bit x as a cache holds it: float16 saturated, as the cache saturates it)
        for x, dtype in ((x32, torch.float32), (x32, torch.float16), (x32.to(torch.bfloat16), torch.bfloat16),
                         (to_cache(x32, torch.float16), torch.float32)):
            got = memory_round_triton(x, bits, rotate, dtype)
            want = codes_of.encode(x)
            assert torch.equal(got[1][0], want[0]) and torch.equal(got[1][1], want[1]), (tuple(x.shape), x.dtype)
            assert torch.equal(got[0], to_cache(codes_of.decode(*want), dtype)), (tuple(x.shape), x.dtype, dtype)
            ran = []
            with monkeypatch.context() as m:
                m.setattr(modeling, "launch_bound", lambda device: True)
                m.setattr(modeling, "fused_memory_round", lambda *a: ran.append(1) or memory_round_triton(*a))
                x = x.detach().requires_grad_(x.numel() > 0)
                back, coded = codes_of.round_with_codes(x, dtype)
            assert ran and torch.equal(back.detach(), got[0]) and torch.equal(coded[0], got[1][0])
            if x.requires_grad:
                up = torch.randn(back.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
                back.backward(up)
                assert x.grad.dtype == x.dtype and torch.equal(x.grad, up.to(x.dtype))
    assert memory_round_triton(torch.randn(3, 6), bits, rotate) is None  # not a power of 2: the reference's


@needs_triton
def test_memory_ranking_kernel_gives_the_sweeps_indices(monkeypatch):
    """The ranking sweep in Triton (kernels/memory/evict.py: the candidates numbered in their order, then each pass's
    blocks) against the PyTorch sweep (a sort, then comparisons): the same evict indices, exactly (a candidate that
    never enters leaves at its own index; -1 for those that are not real), over several hundred candidates with
    padding, sinks, tied scores and the last ones after ``upto``; blocks of M and of 37, in one pass and in several
    (the kernel's e_first). Scores of both signs, -0 beside +0 (tied, as a sort has them), -inf and the largest
    floats and the float next to one; positions up to 2^31 - 1 (the ranks' numbers hold the position in their low 31
    bits); the top sets' empty slots pointing at later candidates (a GPU's top-K may pick those). The brute-force
    test in test_model.py checks what queries see through it."""
    import aaren_hf.modeling_aaren as modeling

    gen = torch.Generator().manual_seed(0)
    ran = []

    def scrambled(rank, top, evict, e_first, block, upto, M):
        """The pass with the top sets' empty slots (top-K's picks of rank -1) pointing anywhere at or after the
        block's first candidate, as a GPU's top-K may leave them, every other one after ``upto`` (where the indices
        stay C): the kernel must take them as empty."""
        ran.append(1)
        C = rank.shape[-1] - 1
        e0 = (e_first + torch.arange(top.shape[2]) * block).view(1, 1, -1, 1)
        empty = (rank.gather(-1, top.flatten(2)).view(top.shape) < 0) | (top >= e0)
        anywhere = e0 + (torch.rand(top.shape, generator=gen) * (C + 1 - e0)).long()
        late = upto + (torch.rand(top.shape, generator=gen) * (C - upto)).long()
        later = torch.where(torch.arange(top.shape[-1]) % 2 == 0, late.clamp(min=e0), anywhere)
        return K.fused_memory_evict(rank, torch.where(empty, later, top), evict, e_first, block, upto, M)

    monkeypatch.setattr(modeling, "fused_memory_evict", scrambled)
    big = torch.tensor(3.0e38)  # with the next float up: ranks a packing that lets a position's bits touch the score's
    extremes = torch.tensor([0.0, -0.0, float("-inf"), 3.0e38, float(torch.nextafter(big, torch.tensor(4e38))),
                             -3.0e38, 1e-30, -1e-30])
    for B, Hkv, C, M, block, passes, sinks, first in ((1, 3, 700, 48, 64, 1, 0, 0), (2, 2, 301, 20, 37, 3, 2, 0),
                                                      (1, 2, 200, 16, 64, 2, 1, 2**31 - 199)):
        # views, as the model passes them: one row of positions for every row and kv head, the scores transposed
        pos = torch.where(torch.arange(C) < 3, -1, torch.arange(C) - 3 + first).expand(B, Hkv, C)  # 3 padding first
        score = (torch.randn(B, C, Hkv, generator=gen) * 2).round() / 64  # many ties
        pick = torch.randint(0, 3, (B, C, Hkv), generator=gen) == 0  # a third of them from the extremes
        score = torch.where(pick, extremes[torch.randint(0, len(extremes), (B, C, Hkv), generator=gen)], score)
        score = score.transpose(1, 2)

        def sweep(as_gpu: bool):
            monkeypatch.setattr(modeling, "launch_bound", lambda device: as_gpu)
            return modeling._evict_sweep(pos, score, sinks, C - 10, M, block,
                                         B * Hkv * (C + 1) * math.ceil(C / block / passes))

        want = sweep(False)
        n = len(ran)
        got = sweep(True)
        assert len(ran) - n == passes
        assert torch.equal(got, want), (B, Hkv, C, M, block)
        assert (got[pos < sinks] == -1).all() and (got[pos >= sinks] >= 0).all()
        # the numbers themselves: every pair of real candidates in the reference's order, the rest -1
        rank, evict = K.fused_memory_ranks(pos, score, sinks)
        ref_rank, ref_evict = modeling.candidate_ranks(pos, score, sinks)
        assert torch.equal(evict, ref_evict[..., :C]) and torch.equal(rank < 0, ref_rank < 0)
        above = lambda r: r.unsqueeze(-1) > r.unsqueeze(-2)  # noqa: E731
        assert torch.equal(above(rank), above(ref_rank))


def _ranking_on(device, C, monkeypatch):
    """(the sweep's evict on ``device`` as the model runs it there, the C heap's or else the CPU sweep's) for
    SmolLM2's memory (3 kv heads, M = 448, one sink) over C candidates, the last 63 after ``upto``."""
    import aaren_hf.modeling_aaren as modeling
    from aaren_hf.kernels.memory import memory_evict_cpu

    pos = torch.arange(C).expand(1, 3, C) - 1  # one padding candidate first
    score = modeling.round_retention(torch.randn(1, 3, C, generator=torch.Generator().manual_seed(0)))
    upto, M = C - 63, 448
    want = memory_evict_cpu(pos, score, upto, 1, M)
    if want is None:  # no C compiler: the CPU's sweep
        with monkeypatch.context() as m:
            m.setattr(modeling, "launch_bound", lambda d: False)
            want = modeling._evict_sweep(pos, score, 1, upto, M, *modeling.sweep_plan(1, 3, M, pos.device))
    ran = []
    kernel = modeling.fused_memory_evict
    monkeypatch.setattr(modeling, "fused_memory_evict", lambda *a: ran.append(1) or kernel(*a))
    got = modeling._evict_sweep(pos.to(device), score.to(device), 1, upto, M,
                                *modeling.sweep_plan(1, 3, M, torch.device(device)))
    assert ran
    return got.cpu(), want


@needs_triton
def test_memory_lists_kernel_gives_the_references_sets(monkeypatch):
    """Each block's list of memory candidates in Triton (kernels/memory/lists.py) against ``_memory_lists``: the same
    counts; in every list the block's seen candidates (the reference's set, exactly, in candidate order) come first,
    then unseen ones, K = min(C, M + Q) entries with none twice (the attention kernel would count a repeated one
    twice). Candidates from ``memory_visibility`` over held memories, padding and tied scores, more than one read of
    1,024 candidates; through the model's dispatch as a GPU runs it."""
    import aaren_hf.modeling_aaren as modeling

    gen = torch.Generator().manual_seed(0)
    for B, Hkv, T, Q, M, W, held in ((1, 3, 300, 64, 48, 16, 0), (2, 2, 100, 16, 20, 8, 20), (2, 1, 200, 64, 8, 4, 8),
                                     (1, 2, 2500, 64, 448, 64, 448)):
        C = held + W - 1 + T
        pos = (torch.arange(C) - held).repeat(B, Hkv, 1)
        pos[1:, :, :held + W + 3] = -1  # a padded row
        score = (torch.randn(B, Hkv, C, generator=gen) * 2).round() / 64
        last, evict = modeling.memory_visibility(pos, score, held, W, 1, M, T)
        nblk = -(-T // Q)
        want, want_counts = modeling._memory_lists(evict, last, T, nblk, Q)  # on a CPU: the PyTorch code
        ran = []
        with monkeypatch.context() as m:
            m.setattr(modeling, "fused_memory_lists", lambda *a: ran.append(1) or K.fused_memory_lists(*a))
            m.setattr(modeling, "launch_bound", lambda device: True)
            got, counts = modeling._memory_lists(evict, last, T, nblk, Q, width=M + Q)
        assert ran and torch.equal(counts, want_counts)
        K_ = min(C, M + Q)
        assert got.shape == (B, nblk, Hkv, K_)
        lo, hi = last[:T][::Q], last[:T][(torch.arange(nblk) * Q + Q - 1).clamp(max=T - 1)]
        seen = (torch.arange(C) <= hi.view(-1, 1, 1)) & (evict.unsqueeze(1) > lo.view(-1, 1, 1))  # [B, n, Hkv, C]
        n_seen = seen.sum(-1)
        for b, n, h in itertools.product(range(B), range(nblk), range(Hkv)):
            entries, c = got[b, n, h], int(n_seen[b, n, h])
            assert entries[:c].tolist() == want[b, n, h, :c].tolist(), (B, b, n, h)
            assert len(set(entries.tolist())) == K_ and not seen[b, n, h, entries[c:]].any(), (B, b, n, h)


def _kept_memories(case, dtype, device, kernel, monkeypatch):
    """(the state after each of three prefill pieces as a GPU runs the model, how often the keep kernel ran per
    layer); the kernel where ``kernel``, else ``keep_memory``'s PyTorch code."""
    from helpers import MIXER_CASES, tiny_model

    import aaren_hf.modeling_aaren as modeling

    # one layer: a second, alike but for its weights, would double the interpreter's time and add no case
    model = tiny_model(chunk_size=16, num_hidden_layers=1, **{**MIXER_CASES[case], "memory_size": 24}).to(device, dtype)
    ids = torch.randint(3, 60, (2, 60), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    ran = []
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(modeling, "launch_bound", lambda device: True)
        m.setattr(modeling, "fused_keep_memory",
                  (lambda *a: ran.append(1) or K.fused_keep_memory(*a)) if kernel else None)
        cache, out = modeling.AarenCache(model.config), []
        for piece in (slice(0, 5), slice(5, 17), slice(17, 60)):
            model(ids[:, piece], attention_mask=mask[:, :piece.stop], past_key_values=cache, use_cache=True)
            out += [t.clone() for layer in cache.layers for t in layer.tensors().values()]
    return out, len(ran) / model.config.num_hidden_layers


@needs_triton
@pytest.mark.parametrize("case,dtype", [("memory_learned", torch.float32), ("memory_learned", torch.bfloat16),
                                        ("memory_kv_bf16", torch.float32), ("memory_int8", torch.float32),
                                        ("memory_int4_hadamard", torch.bfloat16), ("memory_int4_gqa", torch.float32)])
def test_keep_memory_kernel_leaves_the_references_state_bit_for_bit(case, dtype, monkeypatch):
    """The memory a prefill piece leaves, in Triton (kernels/memory/keep.py), against ``AarenMixer.keep_memory``'s
    PyTorch code, as a GPU runs the model: the layer's state after each of three pieces bit for bit (slots in the
    same order, what was not kept cleared, empty slots as the reference pads them), where the candidates are fewer
    than the M = 24 slots (a first piece of 5 tokens) and more (a piece of 43), a left-padded row; plain keys and
    values, stored in another dtype, 8- and 4-bit codes with their scales, two kv heads."""
    (got, ran), (want, _) = (_kept_memories(case, dtype, "cpu", kernel, monkeypatch) for kernel in (True, False))
    assert ran == 3
    assert len(got) == len(want) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.requires_gpu
@pytest.mark.parametrize("case,dtype", [("memory_learned", torch.float32), ("memory_int4_hadamard", torch.bfloat16)])
def test_gpu_keep_memory_kernel_leaves_the_references_state_bit_for_bit(case, dtype, monkeypatch):
    """The compiled keep kernel on CUDA against ``keep_memory``'s PyTorch code on the same GPU: the states bit for
    bit."""
    (got, ran), (want, _) = (_kept_memories(case, dtype, "cuda", kernel, monkeypatch) for kernel in (True, False))
    assert ran == 3
    assert len(got) == len(want) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.requires_gpu
def test_gpu_memory_ranking_kernel_gives_the_cpu_heaps_indices(monkeypatch):
    """The compiled ranking kernel on CUDA, a 32K-token piece at SmolLM2's memory shape in one pass, against the C
    heap on the CPU: the same evict indices."""
    got, want = _ranking_on("cuda", 32768 + 64, monkeypatch)
    assert torch.equal(got, want)


@pytest.mark.requires_gpu
def test_gpu_memory_codes_kernel_is_the_reference_bit_for_bit():
    """The compiled kernel against the reference on the same GPU: codes, scales and values bit for bit (correctly
    rounded divisions, no contraction into an fma anywhere they could differ); float32 and 16-bit in and out."""
    from aaren_hf.kernels.memory.codes import memory_round_triton
    from aaren_hf.modeling_aaren import MemoryCodes, to_cache

    gen = torch.Generator().manual_seed(0)
    for bits, rotate in ((8, False), (8, True), (4, False), (4, True)):
        x = torch.randn(3, 1000, 64, generator=gen) * torch.logspace(-30, 30, 11)[torch.randint(0, 11, (3, 1000, 1),
                                                                                                 generator=gen)]
        x = x.cuda()
        got, want = memory_round_triton(x, bits, rotate), MemoryCodes(bits, rotate).encode(x)
        assert torch.equal(got[1][0], want[0]) and torch.equal(got[1][1], want[1]), (bits, rotate)
        assert torch.equal(got[0], MemoryCodes(bits, rotate).decode(*want)), (bits, rotate)
        for dtype in (torch.bfloat16, torch.float16):  # 16-bit in, 16-bit values out (float16 saturating)
            x16 = x.to(dtype)
            got, want = memory_round_triton(x16, bits, rotate, dtype), MemoryCodes(bits, rotate).encode(x16)
            assert torch.equal(got[1][0], want[0]) and torch.equal(got[1][1], want[1]), (bits, rotate, dtype)
            assert torch.equal(got[0], to_cache(MemoryCodes(bits, rotate).decode(*want), dtype)), (bits, rotate, dtype)


# one case per feature the Aaren step kernel branches on: one slot or several, no decay, a fixed, learned or
# input-dependent decay, query groups, beside a window, sinks and a memory (one ranked by the Aaren scores)
AAREN_STEP_CASES = ["paper", "slots3", "decay_fixed", "decay_input", "gqa_slots_window", "memory_aaren_gqa",
                    "memory_gate_input_decay", "default_like_d64", "everything"]


@needs_triton
@pytest.mark.parametrize("case", AAREN_STEP_CASES)
def test_aaren_step_kernel_equals_the_pytorch_step(case, monkeypatch):
    """The Aaren branch's decode step in one launch (``fused_aaren_step``, Triton's interpreter) beside the PyTorch
    step, tokens fed one at a time after a 3-token prompt, a row with padding at the start and in the middle: the
    mixer's output to float32 rounding, the Aaren state to float32 rounding and everything else (window, sinks, the
    memory's choices, ranked by the kernel's scores where the rule says so) bit for bit."""
    import aaren_hf.modeling_aaren as modeling
    from helpers import MIXER_CASES, STEP_CASES, distinct_mixers, kernel_beside_reference, step_inputs, tiny_model

    if modeling.fused_aaren_step is None:
        pytest.skip("aaren_hf.kernels is not importable")
    monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
    # the reference's scores and decay by the PyTorch code, not by the scan-inputs kernel, whose decay formula the
    # step kernel shares (``scores.input_decay``)
    monkeypatch.setattr(modeling, "fused_scan_inputs", None)
    model = tiny_model(chunk_size=16, **MIXER_CASES.get(case, {}), **STEP_CASES.get(case, {}))
    x, mask, pos = step_inputs(model, 14, [slice(0, 4), slice(8, 10)])
    for mixer in distinct_mixers(model, lambda mixer: mixer.aaren_branch):
        kernel_beside_reference(mixer, x, mask, pos, monkeypatch, "fused_aaren_step", rounded=("aaren_o", "aaren_lse"))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_aaren_step_kernel_in_a_16_bit_model(dtype, monkeypatch):
    """A 16-bit model as a GPU serves it (the default recipe's kind: 4 slots, learned decay, query groups, a 4-bit
    memory ranked by a learned score): the output to 16-bit rounding, the Aaren state to float32 rounding, the rest
    bit for bit."""
    import aaren_hf.modeling_aaren as modeling
    from helpers import STEP_CASES, distinct_mixers, kernel_beside_reference, step_inputs, tiny_model

    if modeling.fused_aaren_step is None:
        pytest.skip("aaren_hf.kernels is not importable")
    monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
    monkeypatch.setattr(modeling, "fused_scan_inputs", None)  # the reference's scores and decay by PyTorch
    model = tiny_model(chunk_size=16, **STEP_CASES["default_like_d64"]).to(dtype)
    x, mask, pos = step_inputs(model, 12, [slice(0, 4)])
    for mixer in distinct_mixers(model):
        kernel_beside_reference(mixer, x.to(dtype), mask, pos, monkeypatch, "fused_aaren_step",
                                rounded=("aaren_o", "aaren_lse"), tol=1e-2)


@pytest.mark.requires_gpu
def test_gpu_aaren_step_kernel_equals_the_pytorch_step(monkeypatch):
    """The compiled kernel on CUDA beside the PyTorch step on CUDA at SmolLM2's mixer shape (9 query heads, 3 kv
    heads of 64, 4 slots, learned decay), bf16, 100 tokens one at a time."""
    import aaren_hf.modeling_aaren as modeling
    from helpers import kernel_beside_reference, tiny_model

    kw = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, window_size=64, num_sink_tokens=1,
              num_query_slots=4, decay="learned")
    model = tiny_model(chunk_size=16, **kw).to("cuda", torch.bfloat16)
    x = (torch.randn(2, 100, 576, generator=torch.Generator().manual_seed(3)) * 2).to("cuda", torch.bfloat16)
    mask = torch.ones(2, 100, dtype=torch.bool, device="cuda")
    mask[1, :7] = False
    pos = (mask.long().cumsum(1) - 1).masked_fill(~mask, -1)
    assert modeling.fused_aaren_step is not None
    monkeypatch.setattr(modeling, "fused_scan_inputs", None)  # the reference's scores and decay by PyTorch
    kernel_beside_reference(model.model.layers[0].mixer, x, mask, pos, monkeypatch, "fused_aaren_step", prompt=40,
                            rounded=("aaren_o", "aaren_lse"), tol=1e-2)


AOT_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from aaren_hf.kernels.aaren import chunk, fused_recurrent, scores
from aaren_hf.kernels.memory import codes as memory_codes, evict as memory_evict, keep as memory_keep
from aaren_hf.kernels.memory import lists as memory_lists
from aaren_hf.kernels.window import chunk as window_chunk, fused_recurrent as window_step, rotate
from aaren_hf.kernels.window import carry as window_carry
from aaren_hf.kernels.layer import glu, rmsnorm

def aot(fn, sig, consts, **options):
    jf = triton.jit(fn)
    sig = dict(sig, **{k: "constexpr" for k in consts})
    src = ASTSource(jf, {n: sig[n] for n in jf.arg_names}, constexprs=consts)
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(dict(num_warps=8, num_stages=2), **options))
    assert k.asm["cubin"], fn.__name__

P, B = "*fp32", "*bf16"
common = dict(cu_seqlens="*i64", chunk_offsets="*i64", T="i32", s=B, v=B, g=B, lse=P, h0_o=P, h0_lse=P, ht_o=P,
              ht_lse=P, cs_o=P, cs_lse=P)
c = dict(H=8, GV=2, D=100, BD=128, C=64, HAS_G=True, HAS_H0=True, IS_VARLEN=True, DOT_PREC="tf32")
aot(chunk._aaren_chunk_fwd_kernel, dict(common, o=B), dict(c, SAVE_CS=True))
for mixed in (False, True):
    aot(chunk._aaren_chunk_bwd_kernel, dict(common, do=B, dlse=P, dht_o=P, dht_lse=P, mix=P, ds=B, dv=B, dg=B,
                                             dh0_o=P, dh0_lse=P, dmix=P),
        dict(c, J=4, HAS_DHT=True, HAS_DLSE=True, HAS_MIX=mixed))
aot(fused_recurrent._aaren_fused_recurrent_fwd_kernel, dict(common, o=B),
    dict(H=8, GV=2, D=100, BD=128, HAS_G=True, HAS_H0=True, IS_VARLEN=True))
for decay, J in ((2, 4), (0, 1)):
    aot(fused_recurrent._aaren_step_kernel, dict(q=B, k=B, v=B, queries=B, log_decay=B, decay_in=B, mask="*i1",
                                                 o_state=P, lse_state=P, out=B, s_out=P, scale="fp32"),
        dict(H=9, HKV=3, J=J, BJ=max(2, J), D=64, BD=64, DECAY=decay, MIX=J > 1), num_warps=4, num_stages=1)
sig = dict(q=B, k=B, queries=B, mask="*i1", log_decay=B, decay_in=B, N="i32", scale="fp32")
for c in (dict(H=9, HKV=3, G=3, J=4, BJ=4, D=64, BD=64, BT=32, MIX=True, DECAY=1),
          dict(H=8, HKV=2, G=4, J=1, BJ=2, D=128, BD=128, BT=32, MIX=False, DECAY=0),
          dict(H=8, HKV=8, G=1, J=3, BJ=4, D=80, BD=128, BT=16, MIX=True, DECAY=2)):
    aot(scores._scores_fwd_kernel, dict(sig, s=P, mix=P, g=P), c, num_warps=4, num_stages=1)
    aot(scores._scores_bwd_kernel, dict(sig, mix=P, ds=P, dmix=P, dg=P, dq=B, dk=B, dqueries=P, dlog_decay=P,
                                        ddecay_in=B), c, num_warps=4, num_stages=1)
I = "*i64"
common = dict(q=B, qpos=I, cos=P, sin=P, ks=B, vs=B, spos=I, mk=B, mv=B, evict=I, last=I, idx=I, counts=I, sink_s=P,
              sink_v=B, sink_pos=I, lse=P, T="i32", Ls="i32", P0="i32", W="i32", C="i32", K="i32", NB="i32",
              scale="fp32")
for c in (dict(H=9, HKV=3, S=1, D=64, BD=64, BQ=64, BK=64, HAS_MEM=True, DOT_PREC="tf32", ROT=64),
          dict(H=8, HKV=2, S=0, D=80, BD=128, BQ=64, BK=64, HAS_MEM=False, DOT_PREC="tf32", ROT=0)):
    aot(window_chunk._window_fwd_kernel, dict(common, o=B), c, enable_fp_fusion=False)
    for mixed, rows in ((False, False), (True, True), (True, False)):
        aot(window_chunk._window_bwd_kernel, dict(common, do=B, o=B, diff=B, mw=B, da=B, dmw=B if rows else P,
                                                  dq=B, dks=P, dvs=P, dmk=P, dmv=P, dsink_s=P, dsink_v=P),
            dict(c, MIXED=mixed, MW_ROWS=rows), enable_fp_fusion=False)
sig = dict(q=B, k=B, v=B, pos=I, cos_t=P, sin_t=P, cos_s=P, sin_s=P, retention=B, shared=P, out=B, aaren_o=B, gate=B,
           gate_b="i32", win_k=B, win_v=B, win_pos=I, win_score=P, sink_k=B, sink_v=B, sink_pos=I, mem_k="*u8",
           mem_v="*u8", mem_k_scale=B, mem_v_scale=B, mem_pos=I, mem_score=P, scale="fp32")
c = dict(H=9, HKV=3, BHKV=4, G=3, BG=4, D=64, BD=64, LOG_BD=6, ROT=64, W=64, BW=64, S=1, M=448, BM=64, MP=512, BITS=4,
         ROTATE=True, SATURATE=False, MIX=True, SHARE=1)
for consts, mem in ((c, "*u8"), (dict(c, D=128, BD=128, LOG_BD=7, G=4, H=12, BITS=8, ROTATE=False, SHARE=2), "*i8"),
                    (dict(c, D=96, BD=128, LOG_BD=7, ROT=48, M=16, BM=16, MP=16, BITS=0, ROTATE=False, MIX=False,
                          SHARE=0), B)):
    aot(window_step._window_step_kernel, dict(sig, mem_k=mem, mem_v=mem), consts, num_warps=4, num_stages=1,
        enable_fp_fusion=False)
for bits, codes in ((4, "*u8"), (8, "*i8")):
    for x, back in ((P, P), (B, B), ("*fp16", "*fp16")):
        aot(memory_codes._round_kernel, dict(x=x, back=back, codes=codes, scale=B, N="i64"),
            dict(D=64, LOG_D=6, BITS=bits, ROTATE=bits == 4, SATURATE=back == "*fp16", BN=64), num_warps=4,
            num_stages=1)
aot(memory_evict._grid_kernel, dict(x=B, y=P, N="i32"), dict(BN=1024), num_warps=4, num_stages=1,
    enable_fp_fusion=False)
for score in (P, B):
    aot(memory_evict._ranks_kernel, dict(pos=I, score=score, rank=I, evict=I, C="i32", HKV="i32", num_sinks="i32",
                                         pos_b="i64", pos_h="i64", pos_c="i64", score_b="i64", score_h="i64",
                                         score_c="i64"), dict(BC=1024), num_warps=4, num_stages=1)
aot(memory_evict._evict_block_kernel, dict(rank=I, top=I, evict=I, C="i32", K="i32", n="i32", e_first="i32",
                                           block="i32", upto="i32", M="i32"), dict(BP=512, XB=32, DB=64))
aot(window_carry._sinks_fwd_kernel, dict(k=B, v=B, pos=I, old_k=B, old_v=B, old_pos=I, new_k=B, new_v=B, new_pos=I,
                                          at=I, T="i32"), dict(S=4, E=192, BE=256, BT=1024), num_warps=4, num_stages=1)
aot(window_carry._sinks_bwd_kernel, dict(dnew_k=B, dnew_v=B, at=I, dk=B, dv=B, T="i32"),
    dict(S=1, E=192, BE=256, BT=16), num_warps=4, num_stages=1)
aot(window_carry._next_window_kernel, dict(k_prev=B, v_prev=B, pos_prev=I, k=B, v=B, pos=I, score=P, win_k=B, win_v=B,
                                          win_pos=I, win_score=P, Wp="i32", T="i32", first="i32", short="i32",
                                          W1="i32"), dict(HKV=3, E=192, BE=256, BH=4, HAS_SCORE=True), num_warps=4,
    num_stages=1)
aot(memory_lists._lists_kernel, dict(evict=I, last=I, idx=I, seen_count=I, C="i32", T="i32", Q="i32", K="i32"),
    dict(HKV=3, BC=1024), num_warps=4, num_stages=1)
for kv, scale, E, has_scale in (("*u8", B, 32, True), (B, I, 64, False)):
    aot(memory_keep._keep_kernel, dict(idx=I, kept=I, k=kv, v=kv, k_scale=scale, v_scale=scale, pos=I, score=P,
                                       new_k=kv, new_v=kv, new_k_scale=scale, new_v_scale=scale, new_pos=I,
                                       new_score=P, C="i32", M="i32", K="i32", EMPTY="i32", pos_b="i64",
                                       pos_h="i64", pos_c="i64", score_b="i64", score_h="i64", score_c="i64"),
        dict(HKV=3, E=E, BE=E, BM=64, HAS_SCALE=has_scale), num_warps=4, num_stages=1)
for x, D, BD, rot, inverse in ((B, 64, 64, 64, False), (B, 64, 64, 64, True), (P, 96, 128, 32, False)):
    aot(rotate._rotate_kernel, dict(x=x, cos=P, sin=P, out=x, NH="i64", T="i32", stride_b="i64", stride_t="i64"),
        dict(H=9, D=D, BD=BD, ROT=rot, BR=4096 // BD, INVERSE=inverse), num_warps=4, num_stages=1,
        enable_fp_fusion=False)
for x, w, BN, offset in ((B, B, 1024, False), (B, B, 1024, True), (B, P, 4096, False), (P, P, 512, False)):
    aot(rmsnorm._rms_norm_fwd_kernel, dict(x=x, w=w, y=w, rstd=P, R="i32", N="i32", eps="fp32"),
        dict(BR=4096 // BN, BN=BN, OFFSET=offset), num_warps=8, num_stages=1)
    aot(rmsnorm._rms_norm_bwd_kernel, dict(x=x, w=w, rstd=P, dy=w, dx=x, dw=P, R="i32", N="i32", P="i32"),
        dict(BR=4096 // BN, BN=BN, OFFSET=offset), num_warps=4, num_stages=1)
for x, N, act in ((B, "i32", 0), ("*fp16", "i64", 0), (B, "i32", 1)):
    aot(glu._glu_fwd_kernel, dict(gate=x, up=x, h=x, N=N), dict(BLOCK=1024, ACT=act), num_warps=4, num_stages=1)
    aot(glu._glu_bwd_kernel, dict(gate=x, up=x, dh=x, dgate=x, dup=x, N=N), dict(BLOCK=1024, ACT=act), num_warps=4,
        num_stages=1)
"""


@needs_triton
def test_compiles_for_sm90():
    """The kernels compile for sm90 (H100/H200) down to a cubin with triton's bundled ptxas: no GPU needed. Run in
    a fresh process, because an interpreter-mode import of triton can't compile."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: x for k, x in os.environ.items() if k not in ("TRITON_INTERPRET", "AAREN_BACKEND")}
    env["PYTHONSAFEPATH"] = "1"  # as `python -P`: kernels/ must not be importable as a top-level `kernels`
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    subprocess.run([sys.executable, "-c", AOT_SM90], check=True, env=env, timeout=600)


def test_dispatch(monkeypatch):
    x = torch.zeros(1)
    assert K.select_backend(x) == ("triton" if HAS_TRITON else "torch")  # TRITON_INTERPRET=1 here
    for name in ("torch", "naive") + (("triton",) if HAS_TRITON else ()):
        monkeypatch.setenv("AAREN_BACKEND", name)
        assert K.select_backend(x) == name
    monkeypatch.setenv("AAREN_BACKEND", "naive")
    o, _ = chunk_aaren(torch.zeros(1, 2, 1), torch.ones(1, 2, 1, 4))
    assert torch.equal(o, torch.ones(1, 2, 1, 4))
    monkeypatch.setenv("AAREN_BACKEND", "cuda")
    with pytest.raises(ValueError, match="AAREN_BACKEND"):
        chunk_aaren(torch.zeros(1, 2, 1), torch.zeros(1, 2, 1, 4))
    monkeypatch.delenv("AAREN_BACKEND")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert K.select_backend(x) == "torch"  # CPU tensors, no interpreter: PyTorch
    monkeypatch.setenv("AAREN_BACKEND", "triton")
    if HAS_TRITON:
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            chunk_aaren(torch.zeros(1, 2, 1), torch.zeros(1, 2, 1, 4))
    monkeypatch.setattr(K, "triton_available", lambda: False)
    with pytest.raises(ImportError, match="triton"):
        chunk_aaren(torch.zeros(1, 2, 1), torch.zeros(1, 2, 1, 4))


# ---------------------------------------------------------------------------------------------------------------
# GPU only: compiled kernels (sm90), tensor-core dot accuracy, large shapes.


@pytest.mark.requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("decay", [False, True])
def test_gpu_compiled_vs_naive(dtype, decay):
    """Compiled kernels (tf32 dot for 16-bit inputs, ieee for fp32) against float64 on the GPU."""
    s, v, g, state, grads = make_inputs(2, 1000, 4, 100, 50.0, "random", decay, True, 0.05, dtype=dtype,
                                        device="cuda")
    ref = run(naive_aaren, s.double(), v.double(), None if g is None else g.double(), state, grads)
    res = run(chunk_aaren, s, v, g, state, grads, state_dtype=torch.float32)
    compare(res, ref, 3e-2 if dtype == torch.bfloat16 else 1e-4, v, f"cuda {dtype}")
    res = run(fused_recurrent_aaren, s, v, g, state, grads, state_dtype=torch.float32)
    compare(res, ref, 3e-2 if dtype == torch.bfloat16 else 1e-4, v, f"cuda fused {dtype}")


@pytest.mark.requires_gpu
def test_gpu_large_vs_torch():
    """Large shapes, bf16, varlen and dense: Triton against the PyTorch chunked path (fp32 compute)."""
    B, T, H, D = 2, 16384, 8, 128
    s, v, g, state, grads = make_inputs(B, T, H, D, 20.0, "random", True, True, 0.01, dtype=torch.bfloat16,
                                        device="cuda")
    ref = run(chunk_aaren_torch, s, v, g, state, grads, state_dtype=torch.float32)
    res = run(chunk_aaren, s, v, g, state, grads, state_dtype=torch.float32)
    compare(res, ref, 3e-2, v, "large")
    cu = torch.tensor([0, 1, 5000, 5064, 2 * T], device="cuda")
    flat = lambda x: None if x is None else x.reshape(1, 2 * T, *x.shape[2:])  # noqa: E731
    st = (state[0][:1].expand(4, H, D).contiguous(), state[1][:1].expand(4, H).contiguous())
    gr = (flat(grads[0]), grads[1][:1].expand(4, H, D), grads[2][:1].expand(4, H))
    ref = run(chunk_aaren_torch, flat(s), flat(v), flat(g), st, gr, cu_seqlens=cu, state_dtype=torch.float32)
    res = run(chunk_aaren, flat(s), flat(v), flat(g), st, gr, cu_seqlens=cu, state_dtype=torch.float32)
    compare(res, ref, 3e-2, flat(v), "large varlen")


# ---------------------------------------------------------------------------------------------------------------
# The window branch's attention (kernels/window/chunk.py) against a dense float64 softmax with the mask written out.


def window_inputs(B=2, T=150, H=4, Hkv=2, D=24, P0=5, W=16, C=40, S=2, memory=True, sinks=True, seed=0,
                  dtype=torch.float32, device="cpu"):
    """Random queries, a stream of P0 + T keys (left padding in both rows), C memory candidates with random
    stretches, S sinks at positions 0 or 1 (the last row's last one empty: -1), which the queries from W on see;
    the memory's lists as the model builds them (``_memory_lists``)."""
    from aaren_hf.modeling_aaren import _memory_lists

    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    Ls = P0 + T
    spos = (torch.arange(Ls) - P0).expand(B, Ls).clone()
    spos[0, :3], spos[1, :P0 + 12] = -1, -1
    x = dict(q=rnd(B, T, H, D), ks=rnd(B, Ls, Hkv, D), vs=rnd(B, Ls, Hkv, D))
    args = dict(qpos=spos[:, P0:].to(device), spos=spos.to(device), P0=P0, window=W, scale=D ** -0.5)
    lists = sink = None
    if memory:
        x.update(mk=rnd(B, Hkv, C, D), mv=rnd(B, Hkv, C, D))
        # as memory_visibility gives them: query i's last eligible candidate grows by one per query once the
        # window has filled; candidate c stays until some later index (-1: never in the memory)
        stay = torch.randint(1, 40, (B, Hkv, C), generator=gen)
        evict = torch.where(torch.rand(B, Hkv, C, generator=gen) < 0.2, -1, torch.arange(C) + stay)
        last = (torch.arange(T + 1) - 20).clamp(-1, C - 1)
        idx, counts = _memory_lists(evict, last, T, -(-T // K.WINDOW_BLOCK), K.WINDOW_BLOCK, width=C)
        lists = (evict, last, idx, counts)
    if sinks:
        x.update(sink_s=rnd(B, T, H, S) * 3, sink_v=rnd(B, S, Hkv, D))
        sink = torch.randint(0, 2, (B, S), generator=gen)
        sink[-1, -1] = -1
    return x, args, lists, sink


def run_window(x, args, memory, sink, angles=None):
    from aaren_hf.kernels import fused_window_attention

    dev = x["q"].device
    mem = None if memory is None else (x["mk"], x["mv"]) + tuple(t.to(dev) for t in memory)
    sinks = None if sink is None else (x["sink_s"], x["sink_v"], sink.to(dev))
    return fused_window_attention(x["q"], args["qpos"], x["ks"], x["vs"], args["spos"], args["P0"], args["window"],
                                  args["scale"], mem, sinks, angles)


def dense_window(x, args, memory, sink):
    """Every key each query sees in one list, the mask written out: [B, T, H, D]; a padding query gets 0."""
    q, ks, vs = x["q"], x["ks"], x["vs"]
    B, T, H, D = q.shape
    Ls, Hkv = ks.shape[1], ks.shape[2]
    G, P0, W = H // Hkv, args["P0"], args["window"]
    spos, qpos = args["spos"].cpu(), args["qpos"].cpu()
    keys, values = [ks.repeat_interleave(G, 2).transpose(1, 2)], [vs.repeat_interleave(G, 2).transpose(1, 2)]
    me, r = torch.arange(T).view(T, 1) + P0, torch.arange(Ls)
    masks = [((r <= me) & (r > me - W) & (spos.view(B, 1, Ls) >= 0)).view(B, 1, T, Ls).expand(B, H, T, Ls)]
    if memory is not None:
        evict, last = memory[0], memory[1][:T]
        C = evict.shape[-1]
        keys.append(x["mk"].repeat_interleave(G, 1))
        values.append(x["mv"].repeat_interleave(G, 1))
        masks.append((torch.arange(C) <= last.view(T, 1)) & (last.view(T, 1) < evict.repeat_interleave(G, 1)[:, :, None]))
    logits = [torch.einsum("bthd,bhkd->bhtk", q, k) * args["scale"] for k in keys]
    if sink is not None:
        logits.append(x["sink_s"].permute(0, 2, 1, 3) * args["scale"])
        values.append(x["sink_v"].repeat_interleave(G, 2).transpose(1, 2))
        sp = sink.view(B, 1, -1)
        seen = (sp >= 0) & (sp <= qpos.view(B, T, 1) - W)  # a filled sink outside the query's window
        assert seen.any() and not seen.all()
        masks.append(seen.view(B, 1, T, -1).expand(B, H, T, sink.shape[-1]))
    mask = torch.cat(masks, -1).to(q.device) & (qpos >= 0).view(B, 1, T, 1).to(q.device)
    p = torch.softmax(torch.cat(logits, -1).masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhtk,bhkd->bthd", p, torch.cat(values, 2))


def window_grads(fn, x, args, memory, sink, dtype=None):
    leaves = {n: t.detach().to(dtype or t.dtype).requires_grad_() for n, t in x.items()}
    o = fn(leaves, args, memory, sink)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(o)
    return (o, *torch.autograd.grad(o, list(leaves.values()), do)), ["o", *leaves]


@needs_triton
@pytest.mark.parametrize("memory,sinks,P0,T", [(True, True, 5, 150), (True, False, 0, 64), (False, True, 15, 63),
                                               (False, False, 3, 1), (True, True, 15, 200)])
def test_window_kernel_vs_dense_float64(memory, sinks, P0, T):
    """Forward and every gradient (queries, stream keys and values, memory keys and values, sink scores and values):
    several blocks of queries, a stream with and without earlier entries, left padding, a head size that is not a
    power of two, grouped kv heads, a candidate list cut at each block's count."""
    x, args, mem, sink = window_inputs(T=T, P0=P0, memory=memory, sinks=sinks)
    got, names = window_grads(run_window, x, args, mem, sink)
    want, _ = window_grads(dense_window, x, args, mem, sink, torch.float64)
    for name, a, b in zip(names, got, want):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert (a.double() - b).abs().max() <= 1e-5 * (1 + b.abs().max()), name
    assert got[0][:, :, :, :][args["qpos"] < 0].abs().max() == 0  # padding queries: 0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_kernel_16_bit_inputs(dtype):
    """16-bit inputs (the GPU's): float32 inside, results within their dtype's rounding of float64."""
    x, args, mem, sink = window_inputs(dtype=dtype)
    got, names = window_grads(run_window, x, args, mem, sink)
    want, _ = window_grads(dense_window, x, args, mem, sink, torch.float64)
    for name, a, b in zip(names, got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert (a.double() - b).abs().max() <= 2e-2 * (1 + b.abs().max()), name


@needs_triton
@pytest.mark.parametrize("dtype,per_token", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_window_kernel_mixed_with_the_aaren_branch_keeps_one_tensor_more(dtype, per_token):
    """``mix``: the output and the Aaren output's gradient bit for bit those of the kernel followed by
    ``mix_branches`` (the same lerp and formulas, which the backward kernel follows, roundings included), the gate's
    gradient within one rounding of its dtype (the kernel sums each row's products, in another order), the rest
    within float rounding (the backward's softmax row sums read o rebuilt from the mixed output); kept for backward,
    of the output's size: q, the output (which the layer's output projection keeps anyway) and one more, where the
    two steps apart keep q, o and one more."""
    check_mixed_window(window_inputs(dtype=dtype), per_token)


def check_mixed_window(inputs, per_token):
    from aaren_hf.kernels import fused_window_attention
    from aaren_hf.modeling_aaren import mix_branches, mix_weight

    x, args, mem, sink = inputs
    B, T, H, D = x["q"].shape
    dtype, device = x["q"].dtype, x["q"].device
    gen = torch.Generator().manual_seed(3)
    x["a"] = torch.randn(B, T, H, D, generator=gen).to(device, dtype)
    gate = torch.randn(B, T, H, generator=gen).to(dtype) * 3 if per_token else torch.randn(H, generator=gen)
    x["gate"] = gate.to(device)
    window_only = [n for n in x if n not in ("a", "gate")]

    def apart(leaves, args_, memory, sink_):
        o = run_window({n: leaves[n] for n in window_only}, args_, memory, sink_)
        return mix_branches(o, (leaves["a"], leaves["gate"]))

    def mixed(leaves, args_, memory, sink_):
        a = leaves["a"]
        lists = (leaves["mk"], leaves["mv"]) + tuple(t.to(device) for t in memory)
        return fused_window_attention(leaves["q"], args_["qpos"], leaves["ks"], leaves["vs"], args_["spos"],
                                      args_["P0"], args_["window"], args_["scale"], lists,
                                      (leaves["sink_s"], leaves["sink_v"], sink_.to(device)), None,
                                      (a, mix_weight(a, leaves["gate"])))

    kept = {}

    def pack(t):
        if t.numel() == B * T * H * D:
            kept[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got, names = window_grads(mixed, x, args, mem, sink)
    want, _ = window_grads(apart, x, args, mem, sink)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and torch.isfinite(a).all(), name
        if name in ("o", "a"):
            assert torch.equal(a, b), name
        elif name == "gate":
            ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
            a, b = a.double(), b.double()
            assert ((a - b).abs() <= ulp * b.abs() + 1e-6 * (1 + b.abs().max())).all(), name
        else:
            assert (a.float() - b.float()).abs().max() <= tolerance * (1 + b.float().abs().max()), name
    assert len(kept) == 3 and got[0].untyped_storage().data_ptr() in kept  # q, the mixed output, the difference


def run_window_cpu(x, args, memory, sink, angles=None):
    from aaren_hf.kernels.window import window_attention_cpu

    mem = None if memory is None else (x["mk"], x["mv"], memory[0], memory[1])
    sinks = None if sink is None else (x["sink_s"], x["sink_v"], sink)
    return window_attention_cpu(x["q"], args["qpos"], x["ks"], x["vs"], args["spos"], args["P0"], args["window"],
                                args["scale"], mem, sinks, angles)


@pytest.mark.parametrize("memory,sinks,P0,T", [(True, True, 5, 150), (True, False, 0, 64), (False, True, 15, 63),
                                               (False, False, 3, 1), (True, True, 15, 17)])
@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 24), (9, 3, 64), (2, 2, 96)])
@pytest.mark.parametrize("score_scale,threads", [(1.0, 1), (40.0, 1), (1.0, 3)])
def test_c_window_kernel_vs_dense_float64(memory, sinks, P0, T, H, Hkv, D, score_scale, threads):
    """The C attention (kernels/window/chunk.c), forward and every gradient, against the dense float64 softmax:
    blocks of queries cut anywhere, a stream with and without earlier entries, left padding, grouped and ungrouped
    kv heads, head widths that fill four, three and no full 32-float tiles, scores large enough that most weights
    underflow, the work shared among threads (by blocks forward, by rows backward). Within twice the error of the
    dense softmax computed in float32 (large scores cost float32 digits whoever computes), and 1e-6."""
    x, args, mem, sink = window_inputs(T=T, P0=P0, memory=memory, sinks=sinks, H=H, Hkv=Hkv, D=D)
    x["q"] = x["q"] * score_scale
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if run_window_cpu(x, args, mem, sink) is None:
            pytest.skip("no C compiler")
        got, names = window_grads(run_window_cpu, x, args, mem, sink)
    finally:
        torch.set_num_threads(before)
    float32, _ = window_grads(dense_window, x, args, mem, sink)
    want, _ = window_grads(dense_window, x, args, mem, sink, torch.float64)
    for name, a, a32, b in zip(names, got, float32, want):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        err, err32 = ((t.double() - b).abs().max() / (1 + b.abs().max()) for t in (a, a32))
        assert err <= 2 * err32 + 1e-6, (name, err.item(), err32.item())
    assert got[0][args["qpos"] < 0].abs().max() == 0  # padding queries: 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_c_window_kernel_16_bit_inputs(dtype):
    """16-bit inputs (a 16-bit model on a CPU): float32 inside, results and gradients in their dtype, within its
    rounding of float64."""
    x, args, mem, sink = window_inputs(dtype=dtype)
    if run_window_cpu(x, args, mem, sink) is None:
        pytest.skip("no C compiler")
    got, names = window_grads(run_window_cpu, x, args, mem, sink)
    want, _ = window_grads(dense_window, x, args, mem, sink, torch.float64)
    for name, a, b in zip(names, got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert (a.double() - b).abs().max() <= 2e-2 * (1 + b.abs().max()), name


@pytest.mark.parametrize("kernel,device", [("triton", "cpu"), ("c", "cpu"),
                                           pytest.param("triton", "cuda", marks=pytest.mark.requires_gpu)])
@pytest.mark.parametrize("dtype,D,rot", [(torch.float32, 24, 24), (torch.bfloat16, 24, 16), (torch.float16, 64, 64)])
def test_window_kernels_turn_the_queries_as_rotate_does(kernel, device, dtype, D, rot):
    """With ``angles`` a kernel turns q as it reads it (and again in backward), where the model turned q first and
    kept the turned copy: the output and every gradient, q's through the turn back, the same bits as the kernel fed
    ``rotate(q)`` with autograd through it (full and partial rotary, 16-bit queries rounded after the turn, C's
    float32 inside for 16-bit inputs). On a GPU (compiled, the turn by ``fused_rotate``) too, but for the gradients
    the kernel adds with float32 atomics, whose order varies from run to run: those to their dtype's rounding."""
    import aaren_hf.modeling_aaren as modeling

    if kernel == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    run = run_window if kernel == "triton" else run_window_cpu
    x, args, mem, sink = window_inputs(D=D, dtype=dtype, device=device)
    if run(x, args, mem, sink) is None:
        pytest.skip("no C compiler")
    pos = args["qpos"].clamp(min=0) * 997  # large angles
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
    angles = modeling.rotary_angles(pos, inv_freq)

    def turned_first(leaves, args, memory, sink):
        return run(dict(leaves, q=modeling.rotate(leaves["q"], pos, inv_freq, angles)), args, memory, sink)

    want, names = window_grads(turned_first, x, args, mem, sink)
    got, _ = window_grads(partial(run, angles=angles), x, args, mem, sink)
    unturned, _ = window_grads(run, x, args, mem, sink)
    assert not torch.equal(unturned[0], want[0])  # the angles matter
    for name, a, b in zip(names, got, want):
        assert a.dtype == dtype, name
        if device == "cpu" or name in ("o", "q", "sink_s"):
            assert torch.equal(a, b), name
        else:
            assert (a.double() - b.double()).abs().max() <= 2 * torch.finfo(dtype).eps * (1 + b.abs().max()), name
    for bad in ((angles[0][:, :-1], angles[1][:, :-1]), (angles[0].double(), angles[1].double()),
                (angles[0][..., :-1], angles[1][..., :-1])):  # one token short, float64, an odd rot
        with pytest.raises(ValueError, match="angles: cos and sin"):
            run(x, args, mem, sink, angles=bad)
    if kernel == "triton":  # float64 queries: the turn back would decline (the C kernel takes no float64 at all)
        with pytest.raises(ValueError, match="float32 or 16-bit queries"):
            run(dict(x, q=x["q"].double()), args, mem, sink, angles=angles)


def test_c_window_kernel_same_bits_on_any_number_of_threads():
    """Threads claim blocks (rows, backward) one at a time, in any order the OS runs them: the output and every
    gradient must not depend on how many there are."""
    x, args, mem, sink = window_inputs(B=2, T=150, P0=5)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 5):
            torch.set_num_threads(threads)
            if run_window_cpu(x, args, mem, sink) is None:
                pytest.skip("no C compiler")
            results.append(window_grads(run_window_cpu, x, args, mem, sink)[0])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("shape,rot", [((2, 37, 9, 64), 64), ((1, 1, 4, 64), 64), ((3, 5, 2, 24), 16),
                                       ((1, 300, 3, 128), 64)])
def test_c_rotary_is_the_references_bit_for_bit(shape, rot, monkeypatch):
    """rotate_by on a CPU (kernels/window/rotate.c) against its PyTorch code: full and partial rotary, one token and
    many, large angles, values of every scale, turned back (``inverse``: by -sin); the gradient through rotate() the
    same bit for bit too."""
    import aaren_hf.modeling_aaren as modeling
    from aaren_hf.kernels.window import rotate_cpu

    gen = torch.Generator().manual_seed(rot)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-20, 20, shape[-1])
    pos = torch.randint(0, 1 << 20, shape[:2], generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = modeling.rotary_angles(pos, inv_freq)
    got, back = rotate_cpu(x, cos, sin), rotate_cpu(x, cos, sin, True)
    if got is None:
        pytest.skip("no C compiler")
    wide = (cos.expand(*shape[:2], 2, rot), sin.expand(*shape[:2], 2, rot))  # not the shape it takes
    assert rotate_cpu(x.double(), cos, sin) is None and rotate_cpu(x, *wide) is None
    assert rotate_cpu(*(t.to("meta") for t in (x, cos, sin))) is None  # shapes only: nothing to read
    xg = x.clone().requires_grad_()
    grad = torch.randn(shape, generator=gen)
    with_c = (modeling.rotate(x, pos, inv_freq), torch.autograd.grad(modeling.rotate(xg, pos, inv_freq), xg, grad)[0])
    monkeypatch.setattr(modeling, "rotate_cpu", None)
    want, want_back = modeling.rotate_by(x, cos, sin), modeling.rotate_by(x, cos, -sin)
    reference = (modeling.rotate(x, pos, inv_freq),
                 torch.autograd.grad(modeling.rotate(xg, pos, inv_freq), xg, grad)[0])
    assert torch.equal(got, want) and torch.equal(back, want_back)
    assert torch.equal(with_c[0], reference[0]) and torch.equal(with_c[1], reference[1])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,rot", [((2, 37, 9, 64), 64), ((1, 1, 4, 64), 64), ((3, 5, 2, 24), 16),
                                       ((1, 70, 3, 96), 32), ((2, 3, 1, 12), 6)])
def test_rotary_kernel_is_the_references_bit_for_bit(shape, rot, dtype, monkeypatch):
    """rotate_by in Triton (kernels/window/rotate.py) against its PyTorch code: full and partial rotary, widths that
    are not a power of 2, one token and many (rows that fill no whole program), large angles, values of every scale
    the dtype holds, turned back (sin negated, or ``inverse``) too, token rows strided or broadcast; as a GPU runs
    the model, ``rotate`` with a gradient (``_Rotate``) goes through it forward and backward, the same output and
    gradient bit for bit as autograd through the reference."""
    import aaren_hf.modeling_aaren as modeling

    gen = torch.Generator().manual_seed(rot)
    top = 20 if dtype == torch.float32 else 3
    x = (torch.randn(*shape, generator=gen) * torch.logspace(-top, top, shape[-1])).to(dtype)
    pos = torch.randint(0, 1 << 20, shape[:2], generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = modeling.rotary_angles(pos, inv_freq)
    grad = torch.randn(shape, generator=gen).to(dtype)
    xg = x.clone().requires_grad_()
    monkeypatch.setattr(modeling, "rotate_cpu", None)  # the PyTorch code, not the C pass (the same bits)
    # token rows read where they lie: every other token, and one sequence's tokens broadcast over the batch
    views = [(x[:, ::2], cos[:, :(shape[1] + 1) // 2].contiguous(), sin[:, :(shape[1] + 1) // 2].contiguous()),
             (x[:1].expand_as(x), cos, sin)]
    want = [modeling.rotate_by(x, cos, sin), modeling.rotate_by(x, cos, -sin), modeling.rotate_by(x, cos, -sin),
            modeling.rotate(x, pos, inv_freq)]
    want += [torch.autograd.grad(modeling.rotate(xg, pos, inv_freq), xg, grad)[0]]
    want += [modeling.rotate_by(*view) for view in views]
    ran = []
    monkeypatch.setattr(modeling, "fused_rotate", lambda *a: ran.append(1) or K.fused_rotate(*a))
    monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
    got = [K.fused_rotate(x, cos, sin), K.fused_rotate(x, cos, -sin), K.fused_rotate(x, cos, sin, True),
           modeling.rotate(x, pos, inv_freq)]
    got += [torch.autograd.grad(modeling.rotate(xg, pos, inv_freq), xg, grad)[0]]
    got += [K.fused_rotate(*view) for view in views]
    assert len(ran) == 3  # rotate without a gradient, then _Rotate's forward and its backward
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    wide = (cos.expand(*shape[:2], 2, rot), sin.expand(*shape[:2], 2, rot))  # not the shape it takes
    assert K.fused_rotate(x.double(), cos, sin) is None and K.fused_rotate(x, *wide) is None
    assert K.fused_rotate(x, cos.double(), sin.double()) is None


def _sinks_inputs(B, T, Hkv, D, S, dtype, stored, device="cpu"):
    """A piece of keys and values and the sinks before it: row 0 the first piece of a sequence, row 1 left-padded by
    3 (a piece longer than 1,024: all but its last 3 tokens), row 2 past its first S tokens (its slots kept), row 3
    its first two slots filled by an earlier piece."""
    gen = torch.Generator().manual_seed(T)
    k, v = ((torch.randn(B, T, Hkv, D, generator=gen) * 3).to(device, dtype) for _ in range(2))
    pos = torch.arange(T).repeat(B, 1)
    pos[1] = (pos[1] - (T - 3 if T > 1024 else 3)).clamp(min=-1)
    pos[2] += S
    pos[3] += 2
    sink_k, sink_v = ((torch.randn(B, S, Hkv, D, generator=gen) * 3).to(device, stored) for _ in range(2))
    sink_pos = torch.full((B, S), -1)
    sink_pos[2:] = torch.arange(S)
    return k, v, pos.to(device), sink_k, sink_v, sink_pos.to(device)


@needs_triton
@pytest.mark.parametrize("dtype, stored", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                           (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("T", [1, 5, 1500])
def test_sinks_kernel_is_the_references_bit_for_bit(T, dtype, stored, monkeypatch):
    """The sinks' slots in Triton (kernels/window/carry.py) against ``fill_sinks``' PyTorch code: the slots' keys,
    values and positions, and the gradients of k, v and the old slots, bit for bit; pieces shorter than the slots,
    and longer than one program's scan of positions (1,024), padding, slots filled before."""
    import aaren_hf.modeling_aaren as modeling

    B, Hkv, D, S = 4, 3, 12, 4
    results = []
    for kernel in (None, K.fused_sinks):
        monkeypatch.setattr(modeling, "launch_bound", lambda device: kernel is not None)
        ran = []
        monkeypatch.setattr(modeling, "fused_sinks", kernel and (lambda *a: ran.append(1) or kernel(*a)))
        k, v, pos, sink_k, sink_v, sink_pos = _sinks_inputs(B, T, Hkv, D, S, dtype, stored)
        k, v, sink_k, sink_v = (t.requires_grad_() for t in (k, v, sink_k, sink_v))
        new = modeling.fill_sinks(k, v, pos, sink_k, sink_v, sink_pos)
        weights = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(new[:2])]
        sum((t.float() * w).sum() for t, w in zip(new, weights)).backward()
        assert len(ran) == (kernel is not None)
        results.append([t.detach() for t in new] + [t.grad for t in (k, v, sink_k, sink_v)])
    for a, b in zip(*results, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if T == 5:  # padding 3 leaves slots 2 and 3 of row 1 empty
        assert results[0][2].tolist() == [[0, 1, 2, 3], [0, 1, -1, -1], [0, 1, 2, 3], [0, 1, 2, 3]]


@needs_triton
@pytest.mark.parametrize("dtype, device", [(torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.float16, "cpu"),
                                           pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.requires_gpu)])
@pytest.mark.parametrize("J, Hkv, decay, spread", [(4, 2, "learned", 1.0), (1, 4, "none", 1.0), (3, 1, "input", 1.0),
                                                   (4, 2, "fixed", 300.0), (2, 2, "input", 30.0)])
def test_scan_inputs_kernel_vs_the_reference_in_float64(J, Hkv, decay, spread, dtype, device, monkeypatch):
    """What the scan reads, in Triton (kernels/aaren/scores.py), against ``AarenMixer.scan_inputs``' PyTorch code
    run in float64 on the same values: the slot scores (-inf at padding), the slots' mix and the log-decay per token
    (0 at padding), and the gradients of q, k, the slot queries, the decay rates and the input (through the input
    decay's projection); groups of 2, 4 and 1 query heads, 1, 2, 3 and 4 slots, every decay, an odd length with front
    padding and gradients there, scores hundreds apart (a saturated softmax), decay projections past softplus's
    threshold (20) both ways. The PyTorch code in the same dtype is held to the same tolerance. On CUDA: compiled,
    in bf16 only (each dtype compiles the kernels anew, and gpu_check.sh's GPU tests run on a budget)."""
    import aaren_hf.modeling_aaren as modeling
    from helpers import tiny_model

    mixer = tiny_model(num_query_slots=J, num_key_value_heads=Hkv, window_size=4, decay=decay).model.layers[0].mixer
    with torch.no_grad():
        mixer.queries.mul_(spread)
        if decay == "input":
            mixer.decay_proj.weight.mul_(spread)
    B, T, H, D = 3, 37, mixer.num_heads, mixer.head_dim
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, mixer.q_proj.in_features, generator=gen)
    q, k = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, Hkv, D, generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :6] = False
    weights = [torch.randn(B, T, H * J, generator=gen), torch.randn(B, T, H, J, generator=gen),
               torch.randn(B, T, H * J, generator=gen)]
    mixer, x, q, k, mask, *weights = (t.to(device) for t in (mixer, x, q, k, mask, *weights))
    ran = []
    monkeypatch.setattr(modeling, "fused_scan_inputs", lambda *a: ran.append(1) or K.fused_scan_inputs(*a))

    def scan_inputs(mixer, compute, gpu, frozen=False):
        # in float64: the values of the ``dtype`` model, inputs and parameters alike, computed exactly
        mixer = copy.deepcopy(mixer).to(dtype).to(compute)
        for p in mixer.parameters() if frozen else ():  # as an adapter's fine-tuning leaves them
            p.requires_grad_(False)
        inputs = [t.to(dtype).to(compute).requires_grad_() for t in (x, q, k)]
        with monkeypatch.context() as m:
            m.setattr(modeling, "launch_bound", lambda device: gpu)
            got = mixer.scan_inputs(*inputs, mask)
        assert all(t is None or t.dtype == torch.float32 or compute == torch.float64 for t in got)
        wrt = dict(dq=inputs[1], dk=inputs[2], **({} if frozen else {"dqueries": mixer.queries}))
        if decay in ("input", "learned") and not frozen:  # a "fixed" decay has none
            wrt["dlog_decay"] = mixer.log_decay
        if decay == "input":
            wrt["dx"] = inputs[0]
        # gradients at padding too, which no key or decay may receive (its score and decay are constants)
        outs, ws = zip(*[(t, w.to(t.dtype)) for t, w in zip(got, weights) if t is not None and t.requires_grad])
        grads = torch.autograd.grad(outs, list(wrt.values()), ws, allow_unused=J == 1)  # q: the mix's
        return dict(zip(("s", "mix", "g"), got), **dict(zip(wrt, grads)))

    want = scan_inputs(mixer, torch.float64, False)
    got, reference = scan_inputs(mixer, dtype, True), scan_inputs(mixer, dtype, False)
    assert len(ran) == 1 and got.keys() == want.keys()
    assert torch.equal(got["s"].isinf(), ~mask[..., None].expand(B, T, H * J)) and not got["s"].isnan().any()
    if decay != "none":
        assert not got["g"][~mask].any() and got["g"].isfinite().all()
    for name, b in want.items():
        a, r = got[name], reference[name]
        if b is None:
            assert a is None and r is None and name in ("mix", "g", "dq")
            continue
        assert a.dtype == r.dtype and a.shape == b.shape, name
        fin = b.isfinite()
        # what the kernel returns in the inputs' dtype is rounded once to it; the scores and mix are float32, whose
        # rounding a saturated softmax's gradients magnify; an input decay reads its projection in the inputs' dtype
        tol = (1e-5 if spread == 1 else 1e-4) if a.dtype in (torch.float32, torch.float64) else 1e-2
        if name == "g" and decay == "input" and dtype != torch.float32:
            tol = 1e-2
        size = b[fin].abs().max()
        assert (a.double() - b)[fin].abs().max() <= tol * size, (name, float((a.double() - b)[fin].abs().max()))
        assert (r.double() - b)[fin].abs().max() <= tol * size, (name, "reference")
    # frozen parameters: the inputs' gradients as before, bit for bit
    frozen = scan_inputs(mixer, dtype, True, frozen=True)
    assert len(ran) == 2 and {"dq", "dk"} <= frozen.keys() and "dqueries" not in frozen
    for name, a in frozen.items():
        assert (a is None and got[name] is None) or torch.equal(a, got[name]), name


@needs_triton
@pytest.mark.parametrize("dtype, device", [(torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.float16, "cpu"),
                                           pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.requires_gpu)])
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_kernel_vs_the_reference_in_float64(offset, dtype, device, monkeypatch):
    """RMSNorm in Triton (kernels/layer/rmsnorm.py), through the model's ``AarenRMSNorm`` as a GPU runs it, against
    the module's PyTorch code run in float64 on the same values: the output and the gradients of x and the weight,
    Llama's scale and Gemma's (1 + weight); rows whose scales span 1e-3 to 1e3 and a row of zeros (no NaN), a width
    that is not a power of 2, the backward's programs each taking several blocks of rows (a strided share); with the
    weight frozen, x's gradient bit for bit. The PyTorch code in the same dtype is held to the same tolerance."""
    import aaren_hf.modeling_aaren as modeling
    from aaren_hf.kernels.layer import rmsnorm

    gen = torch.Generator().manual_seed(0)
    B, T, N = 3, 37, 300
    x = torch.randn(B, T, N, generator=gen) * 10 ** (torch.rand(B, T, 1, generator=gen) * 6 - 3)
    x[1, 5] = 0
    dy = torch.randn(B, T, N, generator=gen)
    norm = modeling.AarenRMSNorm(N, eps=1e-5, unit_offset=offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(N, generator=gen) * 0.3 + (0 if offset else 1))
    monkeypatch.setattr(rmsnorm, "_BWD_PROGRAMS", 3)
    ran = []
    monkeypatch.setattr(modeling, "fused_rms_norm", lambda *a: ran.append(1) or K.fused_rms_norm(*a))

    def normed(compute, gpu, frozen=False):
        # in float64: the values of the ``dtype`` module and input, computed exactly
        module = copy.deepcopy(norm).to(dtype).to(device).to(compute).requires_grad_(not frozen)
        xi = x.to(dtype).to(device).to(compute).requires_grad_()
        with monkeypatch.context() as m:
            m.setattr(modeling, "launch_bound", lambda device: gpu)
            y = module(xi)
        assert y.dtype == compute and y.shape == x.shape
        wrt = [xi] if frozen else [xi, module.weight]
        return [y.detach(), *torch.autograd.grad(y, wrt, dy.to(device).to(compute))]

    want = normed(torch.float64, False)
    got, reference = normed(dtype, True), normed(dtype, False)
    assert len(ran) == 1
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, r, b in zip(("y", "dx", "dweight"), got, reference, want, strict=True):
        assert a.isfinite().all() and a.dtype == r.dtype
        size = b.abs().max()
        assert (a.double() - b).abs().max() <= tol * size, (name, float((a.double() - b).abs().max() / size))
        assert (r.double() - b).abs().max() <= tol * size, (name, "reference")
    assert not got[0][1, 5].any()
    frozen = normed(dtype, True, frozen=True)
    assert len(ran) == 2 and len(frozen) == 2 and torch.equal(frozen[1], got[1])


@needs_triton
@pytest.mark.parametrize("dtype, device", [(torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.float16, "cpu"),
                                           pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.requires_gpu)])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlp_kernel_vs_the_reference_in_float64(act, dtype, device, monkeypatch):
    """A gated MLP's act(gate) * up in Triton (kernels/layer/glu.py), through the model's ``AarenMLP`` as a GPU runs
    it, against its PyTorch code run in float64 on the same values: the MLP's output and the gradients of its input
    and its three weights, for silu (Llama) and the tanh-approximated GELU (Gemma); gate values from -100 to 100
    (exp of them overflows float32: no NaN), a size that is no multiple of the kernel's block. An MLP of another
    activation (ReLU) keeps the PyTorch code. The PyTorch code in the same dtype is held to the same tolerance."""
    import aaren_hf.modeling_aaren as modeling
    from helpers import tiny_config

    gen = torch.Generator().manual_seed(0)
    mlp = modeling.AarenMLP(tiny_config(hidden_act=act, intermediate_size=100))
    with torch.no_grad():
        mlp.gate_proj.weight.mul_(torch.linspace(0.1, 60, mlp.gate_proj.out_features)[:, None])
    x = torch.randn(3, 37, mlp.gate_proj.in_features, generator=gen)
    dy = torch.randn(3, 37, mlp.down_proj.out_features, generator=gen)
    ran = []
    monkeypatch.setattr(modeling, "fused_glu", lambda *a: ran.append(K.fused_glu(*a)) or ran[-1])

    def run_mlp(module, compute, gpu):
        module = copy.deepcopy(module).to(dtype).to(device).to(compute)
        xi = x.to(dtype).to(device).to(compute).requires_grad_()
        with monkeypatch.context() as m:
            m.setattr(modeling, "launch_bound", lambda device: gpu)
            y = module(xi)
        wrt = [xi, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight]
        return [y.detach(), *torch.autograd.grad(y, wrt, dy.to(device).to(compute))]

    want = run_mlp(mlp, torch.float64, False)
    got, reference = run_mlp(mlp, dtype, True), run_mlp(mlp, dtype, False)
    assert len(ran) == 1 and ran[0] is not None
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, r, b in zip(("y", "dx", "dgate", "dup", "ddown"), got, reference, want, strict=True):
        assert a.isfinite().all() and a.dtype == r.dtype
        size = b.abs().max()
        assert (a.double() - b).abs().max() <= tol * size, (name, float((a.double() - b).abs().max() / size))
        assert (r.double() - b).abs().max() <= tol * size, (name, "reference")
    relu = modeling.AarenMLP(tiny_config(hidden_act="relu", intermediate_size=100))
    run_mlp(relu, dtype, True)
    assert len(ran) == 2 and ran[1] is None


@needs_triton
@pytest.mark.parametrize("dtype, stored", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                           (torch.float16, torch.float16), (torch.float32, torch.float32)])
def test_next_window_kernel_is_the_references_bit_for_bit(dtype, stored, monkeypatch):
    """The window a piece hands on, in Triton (kernels/window/carry.py), against ``next_window``'s PyTorch code:
    keys, values, positions and scores bit for bit, for windows of 2 to 9, held windows empty, short and full,
    pieces shorter and longer than the window (front padding: zeros, -1, -inf), with and without scores; through
    the model's dispatch as a GPU runs it too."""
    import aaren_hf.modeling_aaren as modeling

    gen = torch.Generator().manual_seed(0)
    B, Hkv, D = 2, 3, 10
    ran = []
    for W in (2, 5, 9):
        for Wp in sorted({0, 3, W - 1}):
            for T in (1, 2, 7, 20):
                k_prev, v_prev = ((torch.randn(B, Wp, Hkv, D, generator=gen) * 3).to(stored) for _ in range(2))
                k, v = ((torch.randn(B, T, Hkv, D, generator=gen) * 3).to(dtype) for _ in range(2))
                pos_prev, pos = (torch.randint(-1, 50, (B, n), generator=gen) for n in (Wp, T))
                for score in (None, torch.randn(B, Wp + T, Hkv, generator=gen)):
                    args = (k_prev, v_prev, pos_prev, k, v, pos, W, score)
                    want = modeling.next_window(*args)  # on a CPU: the PyTorch code
                    with monkeypatch.context() as m:
                        m.setattr(modeling, "fused_next_window", lambda *a: ran.append(1) or K.fused_next_window(*a))
                        m.setattr(modeling, "launch_bound", lambda device: True)
                        got = modeling.next_window(*args)
                    assert got.keys() == want.keys(), (W, Wp, T)
                    for key in want:
                        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (W, Wp, T, key)
    assert len(ran) == 2 * 4 * (3 + 3 + 3)  # every case through the kernel


@pytest.mark.requires_gpu
def test_gpu_carry_kernels_are_the_references_bit_for_bit(monkeypatch):
    """The compiled kernels of kernels/window/carry.py on CUDA against ``fill_sinks``' and ``next_window``'s PyTorch
    code on the same GPU, SmolLM2's kv shape, bf16, 4 x 2,048 tokens after a held window of 63: the slots, their
    gradients and the next window bit for bit."""
    import aaren_hf.modeling_aaren as modeling

    results = []
    for sinks, window in ((None, None), (K.fused_sinks, K.fused_next_window)):
        monkeypatch.setattr(modeling, "fused_sinks", sinks)
        monkeypatch.setattr(modeling, "fused_next_window", window)
        k, v, pos, sink_k, sink_v, sink_pos = _sinks_inputs(4, 2048, 3, 64, 4, torch.bfloat16, torch.bfloat16, "cuda")
        k, v = k.requires_grad_(), v.requires_grad_()
        new = modeling.fill_sinks(k, v, pos, sink_k, sink_v, sink_pos)
        (new[0].float().square().sum() + new[1].float().sum()).backward()
        held = (k[:, :63].detach() * 2, v[:, :63].detach() * 2, pos[:, :63] - 63)
        nxt = modeling.next_window(*held, k.detach(), v.detach(), pos, 64,
                                   torch.randn(4, 63 + 2048, 3, generator=torch.Generator().manual_seed(0)).cuda())
        results.append([t.detach() for t in new] + [k.grad, v.grad] + list(nxt.values()))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_rotary_kernel_is_the_references_bit_for_bit(dtype, monkeypatch):
    """The compiled kernel on CUDA against the PyTorch code on the same GPU, SmolLM2's query shape at 8 x 2,048
    tokens and a partial rotary: bit for bit (no contraction into an fma)."""
    import aaren_hf.modeling_aaren as modeling

    gen = torch.Generator().manual_seed(0)
    for shape, rot in (((8, 2048, 9, 64), 64), ((2, 333, 3, 96), 32)):
        x = (torch.randn(*shape, generator=gen) * 3).to("cuda", dtype)
        pos = torch.randint(0, 1 << 17, shape[:2], generator=gen).cuda()
        cos, sin = modeling.rotary_angles(pos, 1.0 / (10000 ** (torch.arange(0, rot, 2, device="cuda") / rot)))
        monkeypatch.setattr(modeling, "fused_rotate", None)
        want = modeling.rotate_by(x, cos, sin)
        assert torch.equal(K.fused_rotate(x, cos, sin), want), (shape, rot)


def test_c_window_kernel_built_without_openmp_runs_on_one_thread(monkeypatch, tmp_path):
    """A compiler that refuses -fopenmp (clang without libomp, say): the next flags build the kernel without it, no
    warning, and it computes the same bits on one thread."""
    import shutil
    import warnings

    import aaren_hf.kernels.cbuild as cbuild
    from aaren_hf.kernels import window

    x, args, mem, sink = window_inputs(B=2, T=150, P0=5)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or run_window_cpu(x, args, mem, sink) is None:
        pytest.skip("no C compiler")
    want = window_grads(run_window_cpu, x, args, mem, sink)[0]
    fake = tmp_path / "cc-without-openmp"
    fake.write_text(f'#!/bin/sh\nfor a; do [ "$a" = -fopenmp ] && exit 1; done\nexec {cc} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("AAREN_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cbuild, "_loaded", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lib = window._library()
    assert lib is not None
    built = list((tmp_path / "cache" / "kernels").glob("window-*.so"))
    assert len(built) == 1 and b"GOMP_parallel" not in built[0].read_bytes()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = window_grads(run_window_cpu, x, args, mem, sink)[0]
    finally:
        torch.set_num_threads(before)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_c_window_kernel_runs_on_torchs_openmp_runtime():
    """The kernel's threads come from the OpenMP runtime torch already loaded (libgomp.so.1 found by its soname), not
    a second copy whose workers would compete with torch's for the cores. (A torch built with another runtime, Intel's
    or LLVM's, gets GNU's beside it: skipped.)"""
    from aaren_hf.kernels.window import _library

    maps = Path("/proc/self/maps")
    if not maps.exists() or _library() is None:
        pytest.skip("needs Linux's /proc and a C compiler")
    loaded = {line.split()[-1] for line in maps.read_text().splitlines()
              if line.rsplit("/", 1)[-1].startswith(("libgomp", "libiomp", "libomp"))}
    if not any("libgomp" in path for path in loaded) or len({p.rsplit("/", 1)[-1][:6] for p in loaded}) > 1:
        pytest.skip(f"torch's OpenMP runtime is not GNU's alone here: {sorted(loaded)}")
    assert len(loaded) == 1, loaded


def test_c_window_kernel_declines_where_its_reference_runs(monkeypatch):
    """float64, a head width the tiles do not take, or the C kernels turned off (AAREN_BACKEND=torch): None, so the
    model runs the PyTorch path."""
    x, args, mem, sink = window_inputs(T=20)
    if run_window_cpu(x, args, mem, sink) is None:
        pytest.skip("no C compiler")
    assert run_window_cpu({n: t.double() for n, t in x.items()}, args, mem, sink) is None
    assert run_window_cpu(window_inputs(T=20, D=20)[0], args, mem, sink) is None
    assert run_window_cpu({n: t.to("meta") for n, t in x.items()}, args, mem, sink) is None  # nothing to read
    monkeypatch.setenv("AAREN_BACKEND", "torch")
    assert run_window_cpu(x, args, mem, sink) is None


@pytest.mark.requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_window_kernel_vs_dense(dtype):
    """The compiled window kernel (tf32 dots for 16-bit inputs, ieee for float32, float32 atomics in backward) at
    SmolLM2's head shape, against float64: several hundred blocks, a memory, a sink."""
    x, args, mem, sink = window_inputs(B=2, T=1000, H=9, Hkv=3, D=64, P0=63, W=64, C=600, S=1, dtype=dtype,
                                       device="cuda")
    got, names = window_grads(run_window, x, args, mem, sink)
    want, _ = window_grads(dense_window, x, args, mem, sink, torch.float64)
    for name, a, b in zip(names, got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert (a.double() - b).abs().max() <= (2e-2 if dtype == torch.bfloat16 else 1e-3) * (1 + b.abs().max()), name


@pytest.mark.requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_window_kernel_mixed_with_the_aaren_branch(dtype):
    """The compiled window kernel with the Aaren branch mixed in its Function (a gate per token), at SmolLM2's head
    shape: as the kernel followed by ``mix_branches``, keeping one tensor of the output's size besides q and it."""
    check_mixed_window(window_inputs(B=2, T=1000, H=9, Hkv=3, D=64, P0=63, W=64, C=600, S=1, dtype=dtype,
                                     device="cuda"), per_token=True)
