"""AarenForCausalLM on CPU: parallel forward == token-by-token decoding for every mixer option, the mixer and its
window branch against brute-force references, numerical robustness, dtypes, bad input, PEFT."""

import collections
import contextlib
import copy
import math
import shutil
import traceback
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from aaren_hf import AarenCache, AarenConfig, AarenForCausalLM
from aaren_hf.aaren_scan import chunk_aaren_torch, recurrent_aaren_torch
from aaren_hf import modeling_aaren as modeling
from aaren_hf.configuration_aaren import AAREN_FORMAT_VERSION
from aaren_hf.kernels import memory as memory_kernel
from aaren_hf.kernels import triton_available
from aaren_hf.modeling_aaren import AarenLayerState, AarenMixer, memory_seen, memory_visibility
from helpers import (
    MIXER_CASES,
    brute_force_aaren,
    brute_force_window,
    incremental_logits,
    one_thread,  # noqa: F401  (autouse fixture)
    random_ids,
    recording,
    tiny_config,
    tiny_model,
)

ATOL = 1e-4


def assert_grads_close(got, want):
    """The same parameters have gradients, each within 1e-4 of the reference's norm (sums taken in another order)."""
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert (got[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-6, name


# ---------------------------------------------------------------------------------------------------------------
# Parallel forward == token-by-token decoding
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(MIXER_CASES))
def test_parallel_equals_incremental(case, monkeypatch):
    ids = random_ids(2, 15, seed=1)  # odd length; longer than every window in MIXER_CASES
    steps = []  # single tokens after the first call take the decode step (window_step, or the C step doing its work)
    steps_one_token = AarenMixer.steps_one_token

    def counted(mixer, state, T):
        took = steps_one_token(mixer, state, T)
        steps.extend([1] if took and mixer.window > 0 else [])
        return took

    monkeypatch.setattr(AarenMixer, "steps_one_token", counted)
    reference = None
    # A 16-bit cache rounds each key: a last-bit difference between the two paths (their sums run in other orders)
    # flips that rounding now and then, which moves the logits by up to about 4e-4 here; a float32 cache, 4e-6.
    atol = 1e-3 if MIXER_CASES[case].get("kv_cache_dtype") else ATOL
    for chunk_size in (1, 3, 64):
        model = tiny_model(seed=0, chunk_size=chunk_size, **MIXER_CASES[case])
        with torch.no_grad():
            full = model(ids, use_cache=False).logits
        if reference is None:
            reference = full
        # the chunk size is an implementation detail: same function whatever it is
        torch.testing.assert_close(full, reference, atol=ATOL, rtol=0)
        # prefill in pieces (5 then 7, then steps) or a prompt longer (13) than the window, then steps; the
        # chunk size only matters for multi-token pieces, so single steps throughout and a prompt shorter (3) than
        # the window run once
        for pieces in ((5, 7), (13,)) + (((), (3,)) if chunk_size == 3 else ()):
            torch.testing.assert_close(incremental_logits(model, ids, pieces), full, atol=atol, rtol=0,
                                       msg=lambda m: f"chunk_size={chunk_size} pieces={pieces}: {m}")
        with torch.no_grad():  # causal: a prefix gives the prefix's logits
            torch.testing.assert_close(model(ids[:, :3]).logits, full[:, :3], atol=ATOL, rtol=0)

    assert bool(steps) == bool(MIXER_CASES[case].get("window_size"))
    # The tolerance has teeth: the first token still moves the last logits by far more than ATOL.
    changed = ids.clone()
    changed[:, 0] = (changed[:, 0] + 1) % 63 + 1
    with torch.no_grad():
        moved = (model(changed).logits[:, -1] - full[:, -1]).abs().max()
    assert moved > 100 * ATOL


@pytest.mark.parametrize("kv_cache_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("case", [c for c, kw in MIXER_CASES.items() if kw.get("window_size")])
def test_decode_step_equals_general_path(case, kv_cache_dtype, monkeypatch):
    """Every mixer fed the same inputs token by token twice: the one-token decode step (window_step and the Aaren
    step, taken for every token after the prompt when no gradient is needed) and the general path (forced by
    enabling gradients). Same outputs to float rounding, and after every step bit for bit the same state: window,
    sinks, Aaren state, and the memory's entries (keys, values, scales, positions, scores), taken as a set: the step
    writes an entering token into the slot it frees, so its slot order is not the general path's.

    Left padding: row 1 starts after its window has filled with padding, so its first tokens become sinks inside
    the step; row 2 is padding until the last few tokens. Retention scores of kv head 0 all tie (zero projection
    weights, as initialised), so every step tests the tie rule (the newer wins); the other heads rank by random
    scores."""
    import aaren_hf.modeling_aaren as modeling

    model = tiny_model(**{"kv_cache_dtype": kv_cache_dtype, **MIXER_CASES[case]})
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mixer, "retention_proj"):
                layer.mixer.retention_proj.weight[0] = 0.0
    calls = {"window": 0, "aaren": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(AarenMixer, "window_step", counted("window", AarenMixer.window_step))
    monkeypatch.setattr(modeling, "aaren_step", counted("aaren", modeling.aaren_step))
    # the PyTorch steps and prompt scan, whose Aaren state is the general path's bit for bit (the C kernels' is to
    # float rounding: test_mixer_step_kernel.py, test_kernels.py)
    monkeypatch.setattr(modeling, "mixer_step_cpu", None)
    monkeypatch.setattr(modeling, "mixer_prefill_cpu", None)
    monkeypatch.setattr(modeling, "aaren_prefill_cpu", None)
    # attention outputs laid out as CUDA's fused kernels return them ([N, h, L, D] strided as [N, L, h, D]): the
    # steps must not assume a contiguous output (a view did, and failed on every GPU for GQA models with a window)
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: sdpa(*a, **kw).transpose(1, 2).contiguous().transpose(1, 2))
    B, T, prompt = 3, 19, 2
    x = torch.randn(B, T, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :7], mask[2, :15] = False, False
    pos = (mask.long().cumsum(1) - 1).masked_fill(~mask, -1)
    for layer in model.model.layers:
        mixer, fast, general = layer.mixer, AarenLayerState(), AarenLayerState()
        calls.update(window=0, aaren=0)
        for t in [slice(0, prompt)] + [slice(i, i + 1) for i in range(prompt, T)]:
            with torch.no_grad():
                out = mixer(x[:, t], mask[:, t], pos[:, t], fast)
            with torch.enable_grad():
                want = mixer(x[:, t], mask[:, t], pos[:, t], general).detach()
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{t}: {m}")
            want_state = memory_as_a_set({n: s.detach() for n, s in general.tensors().items()})
            got_state = memory_as_a_set(fast.tensors())
            assert got_state.keys() == want_state.keys()
            for name, tensor in got_state.items():
                assert torch.equal(tensor, want_state[name]), f"layer {mixer.layer_idx}, {t}: {name}"
        steps = T - prompt
        assert calls["window"] == steps  # every step: the prompt leaves a window of W - 1 entries, empty ones first
        assert calls["aaren"] == (steps if mixer.aaren_branch else 0)


def test_a_state_made_under_inference_mode_decodes_outside_it():
    """The decode step writes the memory in place, which PyTorch refuses on tensors made under inference_mode once
    outside it: a cache prefilled under ``torch.inference_mode()`` and continued under ``no_grad`` (as generate()
    runs) must still decode, with the logits of a cache made under no_grad throughout."""
    model = tiny_model(**MIXER_CASES["memory_int8"])
    ids = random_ids(2, 24)
    logits = {}
    for name, context in (("inference_mode", torch.inference_mode), ("no_grad", torch.no_grad)):
        with context():
            cache = AarenCache(model.config)
            model(ids[:, :16], past_key_values=cache, use_cache=True)
        with torch.no_grad():
            logits[name] = torch.cat([model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                                      for t in range(16, 24)], 1)
    assert torch.equal(logits["inference_mode"], logits["no_grad"])


@pytest.mark.parametrize("case", ["paper", "decay_input", "window_sinks_gate_input", "memory_gate_input_decay",
                                  "memory_shared", "memory_int4_hadamard", "memory_kv_bf16", "gemma_block"])
def test_a_decode_step_never_waits_for_the_device(case):
    """A decode step must not read a value back to the host (``int(t)``, ``bool(t)``, ``nonzero``, ``torch.equal``):
    on a GPU each such read waits for every launch before it, and a step with one cannot be captured in a CUDA graph.
    On the meta device (shapes only, no values) any such read raises, so the PyTorch decode path a GPU runs must go
    through there, here for a batch with a left-padded row whose next token still fills a sink. Shapes only: the
    values are test_decode_step_equals_general_path's (and the GPU test below checks the same on CUDA)."""
    model = tiny_model(**MIXER_CASES[case])
    ids = random_ids(2, 12, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # row 1: 3 real tokens after 9 pads, so its next tokens are early ones
    cache = AarenCache(model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            layer._apply(lambda t: t.to("meta"))
        cache.real_tokens = cache.real_tokens.to("meta")
        model.to("meta")
        out = model(ids[:, :1].to("meta"), attention_mask=F.pad(mask, (0, 1), value=1).to("meta"),
                    past_key_values=cache, use_cache=True).logits
    assert out.device.type == "meta" and out.shape == (2, 1, model.config.vocab_size)
    assert all(t.device.type == "meta" for layer in cache.layers for t in layer.tensors().values())


class HostReads(TorchDispatchMode):
    """Records the operators that read a value back to the host (``int(t)``, ``bool(t)``, ``.item()``,
    ``nonzero``, ``torch.equal``), with the model line that ran each."""

    NAMES = {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "equal", "masked_select", "_unique2"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.NAMES:
            frames = [f for f in traceback.extract_stack() if "aaren" in f.filename]
            self.seen.append((func.overloadpacket.__name__, frames[-1].line if frames else "?"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["memory_int4_hadamard", "memory_shared", "gqa_slots_window", "everything",
                                  "gemma_block"])
def test_a_gpu_train_step_and_prefill_never_wait_for_the_device(case, monkeypatch):
    """Training and prefill as a GPU runs them (``launch_bound`` says yes; the scan, window attention and the
    memory's codes by their Triton kernels in Triton's interpreter) read nothing back to the host: on a GPU each read
    waits for every launch before it, so the host stops queueing work while the device drains its queue, once per
    read (the sinks' ``nonzero``, the memory's list width and its last candidate were three such reads per layer).
    Forward and backward of a left-padded batch, then a prefill in two pieces with a cache. (A pass compares the
    layers' rotary frequencies, to compute shared angles once: once per version of them, here in a first prefill.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
    model = tiny_model(chunk_size=16, **MIXER_CASES[case])
    ids = random_ids(2, 40, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        model(ids[:, :3], past_key_values=AarenCache(model.config), use_cache=True)
    reads = HostReads()
    with reads:
        model(ids, attention_mask=mask, use_cache=False).logits.square().sum().backward()
        cache = AarenCache(model.config)
        with torch.no_grad():
            model(ids[:, :20], attention_mask=mask[:, :20], past_key_values=cache, use_cache=True)
            model(ids[:, 20:], attention_mask=mask, past_key_values=cache, use_cache=True)
    assert cache.seen_tokens == 40 and reads.seen == []


def test_a_gpu_decode_step_computes_its_angles_once_for_the_layers_that_share_them(monkeypatch):
    """A decode step computes its rotary angles (at the token, and the sinks' turn) once for all layers with the same
    frequencies and window, on a GPU too (``launch_bound`` says yes): the layers' frequencies are compared once per
    version of them (an in-place write makes a new version), so later steps read nothing back to the host; both sets
    in one ``rotary_angles`` call. Three layers: 1 call per step where the per-layer path makes 3; after one layer's
    frequencies are written (step 13) that layer computes its own (2). The logits equal the per-layer path's bit for
    bit."""
    monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
    ids = random_ids(2, 16, seed=4)
    real, calls = modeling.rotary_angles, []
    monkeypatch.setattr(modeling, "rotary_angles", lambda *a: calls.append(1) or real(*a))

    def steps(share):
        model = tiny_model(num_hidden_layers=3, **MIXER_CASES["memory_int4_hadamard"])
        same = modeling._same_values if share else (lambda a, b: a is b)
        out, counts, reads = [], [], HostReads()
        with mock.patch.object(modeling, "_same_values", same), torch.no_grad():
            cache = AarenCache(model.config)
            model(ids[:, :10], past_key_values=cache, use_cache=True)
            for t in range(10, 16):
                if t == 13:
                    model.model.layers[1].mixer.rope_inv_freq.mul_(1.5)
                calls.clear()
                with reads if t not in (10, 13) else contextlib.nullcontext():  # after a compare, none
                    out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
                counts.append(len(calls))
        return torch.cat(out, 1), counts, reads.seen

    shared, counts, reads = steps(share=True)
    per_layer, per_layer_counts, _ = steps(share=False)
    assert counts == [1, 1, 1, 2, 2, 2] and per_layer_counts == [3] * 6 and reads == []
    assert torch.equal(shared, per_layer)


def test_positions_count_the_real_tokens_so_far():
    """``positions``: each real token's position after the real tokens of earlier calls, -1 at padding (left, in
    the middle, at the end, a row of padding only), and the count after the call, which the next call starts from;
    an empty call changes nothing."""
    mask = torch.tensor([[False, False, True, True, True], [True, False, True, False, True],
                         [True, True, True, True, False], [False] * 5])
    pos, after = modeling.positions(mask)
    assert pos.tolist() == [[-1, -1, 0, 1, 2], [0, -1, 1, -1, 2], [0, 1, 2, 3, -1], [-1] * 5]
    assert after.tolist() == [3, 3, 4, 0]
    pos, after = modeling.positions(mask[:, :2], torch.tensor([7, 0, 2, 5]))
    assert pos.tolist() == [[-1, -1], [0, -1], [2, 3], [-1, -1]] and after.tolist() == [7, 1, 4, 5]
    pos, after = modeling.positions(mask[:, :0], torch.tensor([7, 0, 2, 5]))
    assert pos.shape == (4, 0) and after.tolist() == [7, 0, 2, 5]
    assert modeling.positions(mask[:, :0])[1].tolist() == [0] * 4


@pytest.mark.parametrize("launch_bound", [False, True])
def test_a_prefill_computes_its_rotary_angles_once_for_the_layers_that_share_them(launch_bound, monkeypatch):
    """A prefill piece computes the window branch's rotary angles (at the tokens, for keys and queries; and the sinks'
    turn back) once for all layers with the same frequencies (``Rotary``), where each layer computed them three times:
    three layers, 2 computations per piece against 6 per layer, 4 once one layer's frequencies differ. Training too
    (keys and queries share theirs), and its backward computes none (``_Rotate`` keeps the angles it turned by).
    Logits, state and gradients equal the per-layer path's bit for bit, on a CPU and as a GPU runs it."""
    monkeypatch.setattr(modeling, "launch_bound", lambda device: launch_bound)
    ids = random_ids(2, 24, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    real, calls = modeling.rotary_angles, []
    monkeypatch.setattr(modeling, "rotary_angles", lambda *a: calls.append(1) or real(*a))

    def run(share, rewrite=False):
        model = tiny_model(num_hidden_layers=3, **MIXER_CASES["memory_int4_hadamard"])
        if rewrite:
            model.model.layers[1].mixer.rope_inv_freq.mul_(1.5)
        same = modeling._same_values if share else (lambda a, b: a is b)
        counts = []
        with mock.patch.object(modeling, "_same_values", same):
            cache = AarenCache(model.config)
            with torch.no_grad():
                for piece in (slice(0, 15), slice(15, 24)):
                    calls.clear()
                    out = model(ids[:, piece], attention_mask=mask[:, :piece.stop], past_key_values=cache,
                                use_cache=True).logits
                    counts.append(len(calls))
            calls.clear()
            model(ids, attention_mask=mask, labels=ids).loss.backward()
            counts.append(len(calls))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return counts, [out, *cache.layers[2].tensors().values(), *grads]

    counts, shared = run(share=True)
    per_layer_counts, per_layer = run(share=False)
    assert counts == [2, 2, 2] and per_layer_counts == [6, 6, 6]
    assert len(shared) == len(per_layer) and all(torch.equal(a, b) for a, b in zip(shared, per_layer))
    assert run(share=True, rewrite=True)[0] == [4, 4, 4]


@pytest.mark.parametrize("case", ["memory_learned", "memory_int4_hadamard"])
def test_torch_compile_of_a_training_forward_gives_eagers_logits_and_gradients(case, monkeypatch):
    """torch.compile (dynamo, eager backend) of a forward and backward on a CPU, with the C kernels built: while it
    traces, the model must not call them (a ctypes call fills buffers through raw pointers, which tracing does not
    see: the memory's ranking came out wrong and the logits moved by about 1). The same logits and gradients as
    eager, to float rounding. Eager without the C window attention, which rounds otherwise than the PyTorch path the
    trace takes (with 4-bit codes a last-bit difference can move a code by a step); the memory's ranking and codes
    in C are the PyTorch path's bit for bit."""
    monkeypatch.setattr(modeling, "window_attention_cpu", None)
    model = tiny_model(**MIXER_CASES[case]).train()
    ids = random_ids(2, 20)
    results = []
    torch._dynamo.reset()
    for forward in (lambda i: model(i, use_cache=False).logits,
                    torch.compile(lambda i: model(i, use_cache=False).logits, backend="eager")):
        model.zero_grad()
        logits = forward(ids)
        logits.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), grads))
    torch._dynamo.reset()
    (eager, eager_grads), (compiled, compiled_grads) = results
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=0)
    assert_grads_close(compiled_grads, eager_grads)


@pytest.mark.parametrize("case", ["decay_input", "memory_int4_hadamard", "memory_shared", "gemma_block"])
def test_a_gpu_decode_step_compiles_into_one_graph(case, monkeypatch):
    """What torch.compile, and a CUDA graph after it, need from decoding: the model's whole decode step, as a GPU runs
    it (``launch_bound`` says yes), traces into one graph without a break (``fullgraph=True``) and gives the eager
    step's logits, step after step. Traced with the eager backend (no code generation). Triton's interpreter is on,
    so the scan's dispatch would pick the Triton kernels (which cannot be traced) if it missed the tracing."""
    monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_model(chunk_size=16, **MIXER_CASES[case])  # the Triton kernels' smallest chunk, for the prompt
    ids = random_ids(2, 15, seed=2)
    cache = AarenCache(model.config)
    torch._dynamo.reset()
    step = torch.compile(lambda i, c: model(i, past_key_values=c, use_cache=True).logits, fullgraph=True,
                         backend="eager")
    with torch.no_grad():
        model(ids[:, :12], past_key_values=cache, use_cache=True)
        caches = [cache, copy.deepcopy(cache)]  # one prompt through the interpreter, not two
        for t in range(12, 15):
            eager = model(ids[:, t:t + 1], past_key_values=caches[0], use_cache=True).logits
            torch.testing.assert_close(step(ids[:, t:t + 1], caches[1]), eager, atol=ATOL, rtol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("case", ["slots3", "gqa_slots_window", "memory_gate_input_decay", "memory_int4_gqa"])
def test_the_gpu_path_run_on_a_cpu_equals_the_cpu_path(case, monkeypatch):
    """What a GPU runs, run here: ``launch_bound`` says yes on the CPU, so the scan goes through the Triton kernels
    (Triton's interpreter) per op head, reading each kv head's values without copies; the window attention is one
    call; the ranking sweep, the prefill's pieces and the decode step's angles are the GPU's. Prefill logits, every
    parameter's gradient and token-by-token decoding equal the CPU path's (the interpreter computes in float32)."""
    ids = random_ids(2, 30, seed=3)
    results, mixed = {}, []
    for path in ("cpu", "gpu"):
        if path == "gpu":
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
            if modeling.fused_chunk_aaren_mixed is not None:
                kernel = modeling.fused_chunk_aaren_mixed
                monkeypatch.setattr(modeling, "fused_chunk_aaren_mixed", lambda *a: mixed.append(1) or kernel(*a))
        model = tiny_model(seed=0, chunk_size=16, **MIXER_CASES[case])
        logits = model(ids, use_cache=False).logits
        logits.square().sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[path] = logits.detach(), grads, incremental_logits(model, ids, pieces=(20,))
    (cpu, cpu_grads, cpu_steps), (gpu, gpu_grads, gpu_steps) = results["cpu"], results["gpu"]
    # with J > 1 slots training and prefill go through the scan whose backward forms the mix's gradient
    assert bool(mixed) == (modeling.fused_chunk_aaren_mixed is not None and model.config.num_query_slots > 1)
    torch.testing.assert_close(gpu, cpu, atol=ATOL, rtol=0)
    torch.testing.assert_close(gpu_steps, cpu_steps, atol=ATOL, rtol=0)
    assert_grads_close(gpu_grads, cpu_grads)


@pytest.mark.parametrize("memory_bits", [None, 4])
def test_the_window_kernel_equals_the_pytorch_window_attention(memory_bits, monkeypatch):
    """On the GPU's path the window branch runs the Triton kernel (kernels/window/chunk.py; Triton's interpreter
    here); without it, the PyTorch path that gathers every block's keys. Over several blocks of queries (150
    tokens, 64 per block), with left padding, sinks and a memory that fills and evicts, in one call and in two pieces
    (the second reading the state the first left): the same logits and the same gradients."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
    # one layer: a second, alike but for its weights, doubles the interpreter's minutes and adds no case
    model = tiny_model(seed=1, chunk_size=16, num_hidden_layers=1, num_key_value_heads=2, num_query_slots=2,
                       window_size=16, num_sink_tokens=2, memory_size=12, memory_bits=memory_bits)
    ids, mask = random_ids(2, 150, seed=5), torch.ones(2, 150, dtype=torch.long)
    mask[1, :9] = 0
    results, ran = {}, []
    kernel = modeling.fused_window_attention
    if kernel is None:
        pytest.skip("aaren_hf.kernels is not importable")

    def counted(*args):
        ran.append(args[0].shape[1])
        return kernel(*args)

    for path in ("kernel", "pytorch"):
        monkeypatch.setattr(modeling, "fused_window_attention", counted if path == "kernel" else None)
        model.zero_grad()
        logits = model(ids, attention_mask=mask, use_cache=False).logits
        logits.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        cache = AarenCache(model.config)
        with torch.no_grad():
            pieces = [model(ids[:, :70], attention_mask=mask[:, :70], past_key_values=cache, use_cache=True).logits,
                      model(ids[:, 70:], attention_mask=mask, past_key_values=cache, use_cache=True).logits]
        results[path] = logits.detach(), grads, torch.cat(pieces, 1)
    assert ran == [150, 70, 80]  # the whole prompt, then its two pieces
    (logits, grads, pieces), (want, want_grads, want_pieces) = results["kernel"], results["pytorch"]
    torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(pieces, want_pieces, atol=ATOL, rtol=0)
    torch.testing.assert_close(pieces, want, atol=ATOL, rtol=0)
    assert_grads_close(grads, want_grads)


@pytest.mark.parametrize("case", ["paper", "slots3", "decay_input", "gqa_slots_window", "memory_gate_input_decay",
                                  "memory_aaren_gqa"])
def test_prompt_branch_in_c_equals_the_chunked_scan(case, monkeypatch):
    """A prompt without gradients takes the C branch (kernels/aaren/step.c, aaren_branch_prefill); with it off, the
    PyTorch branch and its chunked scan: the same logits and cache to float rounding (left padding in row 1, a carried
    state in the second piece; the slot scores ranking the memory in "memory_aaren_gqa")."""
    scan, ran = modeling.aaren_prefill_cpu, []
    if scan is None:
        pytest.skip("aaren_hf.kernels is not importable")
    # a layer with a window would take the mixer's one call (the same C scan: tests/test_mixer_step_kernel.py)
    monkeypatch.setattr(modeling, "mixer_prefill_cpu", None)
    monkeypatch.setattr(modeling, "aaren_prefill_cpu", recording(scan, ran))
    model = tiny_model(**MIXER_CASES[case])
    ids, mask = random_ids(2, 21), torch.ones(2, 21, dtype=torch.long)
    mask[1, :5] = 0
    runs = {}
    for name in ("c", "chunked"):
        if name == "chunked":
            monkeypatch.setattr(modeling, "aaren_prefill_cpu", None)
        cache = AarenCache(model.config)
        with torch.no_grad():
            first = model(ids[:, :13], attention_mask=mask[:, :13], past_key_values=cache, use_cache=True).logits
            second = model(ids[:, 13:], attention_mask=mask, past_key_values=cache, use_cache=True).logits
        runs[name] = (torch.cat([first, second], 1), [memory_as_a_set(layer.tensors()) for layer in cache.layers])
    if not any(ran):
        pytest.skip("no C compiler")
    assert all(ran) and len(ran) == 2 * model.config.num_hidden_layers
    torch.testing.assert_close(runs["c"][0], runs["chunked"][0], atol=1e-5, rtol=1e-5)
    for got, want in zip(runs["c"][1], runs["chunked"][1]):
        assert got.keys() == want.keys()
        for name in got:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("case,dtype", [("window_sinks", torch.float32), ("gqa_slots_window", torch.float32),
                                        ("memory_gate_input_decay", torch.float32), ("memory_int4_gqa", torch.float32),
                                        ("memory_kv_bf16", torch.float32), ("partial_rotary", torch.float32),
                                        ("memory_int8", torch.bfloat16), ("gqa_slots_window", torch.float16)])
def test_window_attention_in_c_equals_the_pytorch_path(case, dtype, monkeypatch):
    """On a CPU window attention takes the C kernel (kernels/window/chunk.c); each call against the PyTorch path on
    the same inputs, to float rounding: a prompt in two pieces without gradients (left padding in row 1, a carried
    window and memory in the second piece), then a training forward whose gradients (queries, keys, values, earlier
    entries, memory candidates, sinks) are compared too; float32 and 16-bit models, both computing in float32 on a
    CPU. Compared call by call, not by logits: a difference in the last bits can move a retention score across its
    grid in a later layer, and the memory then keeps another token (as between any two roundings)."""
    kernel, attention, ran = modeling.window_attention_cpu, modeling.window_attention, []
    if kernel is None:
        pytest.skip("aaren_hf.kernels is not importable")
    # the prompt would take the mixer's one call (the same C kernel: tests/test_mixer_step_kernel.py)
    monkeypatch.setattr(modeling, "mixer_prefill_cpu", None)
    counted = recording(kernel, ran)

    def close(got, want):
        assert got.dtype == want.dtype
        if got.dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # float32 inside, rounded to 16 bits (backward: partial gradients added in 16 bits by autograd)
            eps = torch.finfo(got.dtype).eps
            torch.testing.assert_close(got, want, atol=4 * eps * float(want.detach().abs().max()), rtol=2 * eps)

    def both(*args):
        modeling.window_attention_cpu = None
        want = attention(*args)
        modeling.window_attention_cpu = counted
        got = attention(*args)
        assert got.dtype == dtype
        close(got, want)
        if got.requires_grad:
            flat = [a for arg in args for a in (arg if isinstance(arg, tuple) else (arg,))]
            leaves = [a for a in flat if isinstance(a, torch.Tensor) and a.requires_grad]
            do = torch.randn(got.shape, generator=torch.Generator().manual_seed(len(ran))).to(dtype)
            grads = (torch.autograd.grad(out, leaves, do, retain_graph=True) for out in (got, want))
            for a, b in zip(*grads):
                close(a, b)
        return got

    monkeypatch.setattr(modeling, "window_attention_cpu", counted)
    monkeypatch.setattr(modeling, "window_attention", both)
    model = tiny_model(**MIXER_CASES[case]).to(dtype)
    ids, mask = random_ids(2, 21), torch.ones(2, 21, dtype=torch.long)
    mask[1, :5] = 0
    cache = AarenCache(model.config)
    with torch.no_grad():
        model(ids[:, :13], attention_mask=mask[:, :13], past_key_values=cache, use_cache=True)
        model(ids[:, 13:], attention_mask=mask, past_key_values=cache, use_cache=True)
    if not any(ran):
        pytest.skip("no C compiler")
    assert all(ran) and len(ran) == 2 * model.config.num_hidden_layers
    ran.clear()
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    assert all(ran) and len(ran) == model.config.num_hidden_layers


def memory_as_a_set(state: dict) -> dict:
    """The state with each row of the memory sorted by position and its empty slots (position -1) zeroed, so two
    memories holding the same entries in other slots compare equal, and two with other entries do not."""
    if "memory_pos" not in state:
        return state
    order = state["memory_pos"].argsort(dim=-1, stable=True)
    held = state["memory_pos"].gather(-1, order) >= 0
    out = dict(state)
    for name, tensor in state.items():
        if name.startswith("memory_"):
            index = order if tensor.dim() == 3 else order.unsqueeze(-1).expand_as(tensor)
            kept = held if tensor.dim() == 3 else held.unsqueeze(-1)
            out[name] = tensor.gather(2, index).masked_fill(~kept, 0)
    return out


@pytest.mark.parametrize("case", ["window_sinks", "memory_learned"])
def test_decode_step_angles_are_shared_only_between_layers_with_the_same_frequencies(case):
    """The decode step computes its rotary angles once per pass for the layers that have the same frequencies and
    window; a layer with other frequencies (Gemma-3's local and global layers) must get its own. Layer 1 here
    rotates at half the frequencies of layer 0: token-by-token decoding still equals the parallel pass, and it
    differs from the model where both layers share layer 0's (so the test sees a wrongly shared angle)."""
    ids = random_ids(2, 13, seed=4)
    logits = {}
    for name, factor in (("own", 0.5), ("same", 1.0)):
        model = tiny_model(seed=0, **MIXER_CASES[case])
        with torch.no_grad():
            model.model.layers[1].mixer.rope_inv_freq.mul_(factor)
            full = model(ids, use_cache=False).logits
        torch.testing.assert_close(incremental_logits(model, ids, (2,)), full, atol=ATOL, rtol=0)
        logits[name] = full
    assert (logits["own"] - logits["same"]).abs().max() > 100 * ATOL


@pytest.mark.parametrize("case", ["paper", "everything", "memory_gate_input_decay"])
def test_long_prefill_goes_in_pieces_and_equals_one_pass(case, monkeypatch):
    """A prompt longer than PREFILL_CHUNK runs through the stack in pieces carrying the cache: same logits and
    hidden states as one pass without a cache, and the same state as feeding the pieces by hand."""
    import aaren_hf.modeling_aaren as modeling

    model = tiny_model(**MIXER_CASES[case])
    ids = random_ids(2, 23, seed=5)
    with torch.no_grad():
        want = model(ids, use_cache=False, output_hidden_states=True)
        monkeypatch.setattr(modeling, "PREFILL_CHUNK", 5)
        got = model(ids, use_cache=True, output_hidden_states=True)
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
    for a, b in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert got.past_key_values.get_seq_length() == 23
    with torch.no_grad():  # the cache continues exactly
        nxt = random_ids(2, 1, seed=6)
        torch.testing.assert_close(model(nxt, past_key_values=got.past_key_values, use_cache=True).logits[:, -1],
                                   model(torch.cat([ids, nxt], 1), use_cache=False).logits[:, -1], atol=ATOL, rtol=0)


def test_prefill_pieces_are_longer_on_a_gpu_within_one_token_budget():
    """A CPU keeps PREFILL_CHUNK tokens per piece; elsewhere (launch-bound) a piece of the whole batch holds up to
    PREFILL_TOKENS_GPU tokens, never fewer per sequence than on a CPU."""
    from aaren_hf.modeling_aaren import PREFILL_CHUNK, PREFILL_TOKENS_GPU, prefill_piece

    for batch in (1, 3, 8, 16, 64):
        assert prefill_piece(batch, torch.device("cpu")) == PREFILL_CHUNK
        piece = prefill_piece(batch, torch.device("cuda"))
        assert piece >= PREFILL_CHUNK
        assert piece * batch <= PREFILL_TOKENS_GPU or piece == PREFILL_CHUNK
        assert piece * (batch + 1) > PREFILL_TOKENS_GPU or piece * batch == PREFILL_TOKENS_GPU
    assert prefill_piece(1, torch.device("cuda")) == PREFILL_TOKENS_GPU


def test_the_ranking_sweep_ranks_as_many_blocks_per_pass_as_its_budget_allows(monkeypatch):
    """The sweep's blocks hold M candidates (at least 64), the fewest comparisons in all; a pass ranks as many blocks
    as SWEEP_PAIRS comparisons allow on a CPU, SWEEP_PAIRS_GPU elsewhere (launch-bound): one pass for a 32K-token
    piece of one sequence on a GPU. Any block and any number per pass give the same ranking: the brute-force test
    above draws both."""
    from aaren_hf.modeling_aaren import SWEEP_PAIRS, SWEEP_PAIRS_GPU, _evict_sweep, sweep_plan

    for M in (0, 16, 448, 1 << 20):
        assert sweep_plan(2, 3, M, torch.device("cpu")) == (max(64, M), SWEEP_PAIRS)
        assert sweep_plan(2, 3, M, torch.device("cuda")) == (max(64, M), SWEEP_PAIRS_GPU)
    assert sweep_plan(1, 3, 448, torch.device("cpu"), block=5) == (5, SWEEP_PAIRS)
    # count the passes: topk runs once per pass
    passes = []
    topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, *a, **k: passes.append(1) or topk(self, *a, **k))
    T, M = 32768 + 448 + 63, 448
    pos, score = torch.arange(T).expand(1, 3, T), torch.zeros(1, 3, T)
    _evict_sweep(pos, score, 0, T, M, *sweep_plan(1, 3, M, torch.device("cuda")))
    assert len(passes) == 1
    passes.clear()
    _evict_sweep(pos, score, 0, T, M, *sweep_plan(1, 3, M, torch.device("cpu")))
    assert len(passes) == -(-T // M // (SWEEP_PAIRS // (3 * (2 * M) ** 2)))


def test_logits_to_keep_and_hidden_states():
    model = tiny_model(window_size=4)
    ids = random_ids(1, 9)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        last = model(ids, logits_to_keep=1).logits
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    torch.testing.assert_close(last, out.logits[:, -1:])
    with torch.no_grad():  # return_dict=False gives the tuple transformers' callers expect
        as_tuple = model(ids, return_dict=False, use_cache=False)
        base = model.model(ids, return_dict=False, use_cache=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], out.logits)
    assert isinstance(base, tuple) and base[0].shape == (1, 9, model.config.hidden_size)


def test_inputs_embeds_equals_input_ids():
    model = tiny_model(**MIXER_CASES["everything"])
    ids = random_ids(2, 7)
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Brute-force references
# ---------------------------------------------------------------------------------------------------------------


def _rms(x, weight, eps, unit_offset=False):
    scale = 1.0 + weight.double() if unit_offset else weight.double()
    return scale * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def reference_mixer(mixer, config, x, mask):
    """The mixer written from the config docs and docs/aaren_math.md, in float64, with T x T masked softmaxes."""
    B, T, E = x.shape
    H, Hkv, D, J = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.num_query_slots
    G, scale = H // Hkv, (config.query_pre_attn_scalar or D) ** -0.5
    pos = (mask.long().cumsum(1) - 1).masked_fill(~mask, -1)
    x = x.double()
    lin = lambda layer, inp: F.linear(inp, layer.weight.double(), None if layer.bias is None else layer.bias.double())
    k = lin(mixer.k_proj, x).view(B, T, Hkv, D)
    v = lin(mixer.v_proj, x).view(B, T, Hkv, D)
    q = lin(mixer.q_proj, x).view(B, T, H, D) if hasattr(mixer, "q_proj") else None
    if config.qk_norm:
        k = _rms(k, mixer.k_norm.weight, config.rms_norm_eps, config.rms_norm_unit_offset)
        q = _rms(q, mixer.q_norm.weight, config.rms_norm_eps, config.rms_norm_unit_offset) if q is not None else None
    if not mixer.aaren_branch and config.sliding_window:  # the teacher's own local attention: window alone
        win = brute_force_window(q, k, v, pos, config.sliding_window, 0, mixer.rope_inv_freq, scale,
                                 kv_dtype=mixer.kv_cache_dtype, memory_bits=config.memory_bits,
                                 memory_hadamard=config.memory_hadamard)
        return lin(mixer.o_proj, win.reshape(B, T, H * D))
    memory = config.layer_memory_size(mixer.layer_idx)
    if not mixer.aaren_branch:  # a sliding-attention layer: the window branch alone
        win = brute_force_window(q, k, v, pos, config.window_size, config.num_sink_tokens, mixer.rope_inv_freq,
                                 scale, memory, mixer.ranking_score(mixer.retention_score(x.float(), None, pos), None),
                                 kv_dtype=mixer.kv_cache_dtype, memory_bits=config.memory_bits,
                                 memory_hadamard=config.memory_hadamard)
        return lin(mixer.o_proj, win.reshape(B, T, H * D))
    c = mixer.queries.double()  # [H, J, D]
    k_h = k.repeat_interleave(G, dim=2)  # query head h reads kv head h // G
    v_h = v.repeat_interleave(G, dim=2)
    s = torch.einsum("bthd,hjd->bthj", k_h, c) * scale
    s = s.masked_fill(~mask[:, :, None, None], float("-inf")).reshape(B, T, H * J)
    g = None
    if config.decay != "none":
        rate = mixer.log_decay.double().exp().reshape(H * J)
        factor = 1.0
        if config.decay == "input":
            factor = F.softplus(lin(mixer.decay_proj, x)) / math.log(2.0)
        g = (-rate * factor * torch.ones(B, T, H * J, dtype=torch.float64)).masked_fill(~mask[:, :, None], 0.0)
    o, _ = brute_force_aaren(s, v_h.repeat_interleave(J, dim=2), g)
    o = o.view(B, T, H, J, D)
    if J > 1:
        alpha = torch.softmax(torch.einsum("bthd,hjd->bthj", q, c) * scale, -1)
        o = (alpha.unsqueeze(-1) * o).sum(3)
    else:
        o = o[:, :, :, 0]
    if config.window_size > 0:
        retention = None
        if memory:  # the mixer's own scores: the rule is checked by test_memory_matches_brute_force
            s_all = s.float().masked_fill(~mask[:, :, None], 0.0)
            retention = mixer.ranking_score(mixer.retention_score(x.float(), s_all, pos), None)
        win = brute_force_window(q, k, v, pos, config.window_size, config.num_sink_tokens, mixer.rope_inv_freq,
                                 scale, memory, retention, kv_dtype=mixer.kv_cache_dtype, memory_bits=config.memory_bits,
                                 memory_hadamard=config.memory_hadamard)
        gate_logit = mixer.window_gate.double() if config.window_gate == "head" else lin(mixer.gate_proj, x)
        gate = torch.sigmoid(gate_logit).unsqueeze(-1)
        o = gate * win + (1 - gate) * o
    return lin(mixer.o_proj, o.reshape(B, T, H * D))


@pytest.mark.parametrize("case", [c for c in MIXER_CASES if c != "parallel_residual"])
def test_mixer_matches_brute_force_reference(case):
    config = tiny_config(**MIXER_CASES[case])
    model = tiny_model(**MIXER_CASES[case])
    mixer = model.model.layers[1].mixer
    x = torch.randn(3, 11, config.hidden_size, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, :3] = False  # left padding in the second row
    mask[2, [3, 5, 6]] = False  # holes in the third: a masked token must leave the state alone (no decay either)
    pos = (mask.long().cumsum(1) - 1).masked_fill(~mask, -1)
    with torch.no_grad():
        got = mixer(x, mask, pos)
    want = reference_mixer(mixer, config, x, mask)
    # The window branch keeps the last W cache entries, padding included: with holes it sees fewer than W real
    # tokens. Only left and right padding (what generate() and batching make) match the position-based reference.
    check = mask.clone()
    if config.window_size:
        check[2] = False
    torch.testing.assert_close(got[check].double(), want[check], atol=2e-5, rtol=1e-5)
    # teeth: the reference is not trivially satisfied (outputs vary along the sequence)
    assert (want[0, 1:] - want[0, :-1]).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_scores_keep_no_copy_of_the_keys_per_query(dtype):
    """_SinkScores against the autograd expression it stands for (gather each query's row of turned sink keys, then
    matmul in float32): output and both gradients bit for bit (the CPU's float32 conversion depends on it), in float32
    and with bfloat16 queries and keys (a 16-bit model on a GPU: float32 scores, gradients in the inputs' dtype); and
    it keeps for backward only its inputs, not the gathered [B, T, S, Hkv, D] keys autograd keeps. Every row is
    read, one several times (rows repeat)."""
    from aaren_hf.modeling_aaren import _SinkScores

    g = torch.Generator().manual_seed(4)
    B, T, Hkv, G, D, S, W = 2, 37, 3, 2, 16, 2, 5
    q = torch.randn(B, T, Hkv, G, D, generator=g).to(dtype).requires_grad_()
    turned = torch.randn(B * (S + W), S, Hkv, D, generator=g).to(dtype).requires_grad_()
    rows = (torch.randint(0, S + W, (B, T), generator=g) + torch.arange(0, B * (S + W), S + W).view(B, 1)).flatten()
    rows[: S + W] = torch.arange(S + W)
    rows[T: T + S + W] = torch.arange(S + W, 2 * (S + W))
    weight = torch.randn(B, T, Hkv, G, S, generator=g)
    results, saved = [], []
    for scores in (lambda: _SinkScores.apply(q, turned, rows),
                   lambda: torch.matmul(q.float(), turned.float().index_select(0, rows).view(B, T, S, Hkv, D)
                                        .permute(0, 1, 3, 4, 2))):
        q.grad = turned.grad = None
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = scores()
        (out * weight).sum().backward()
        results.append((out.detach(), q.grad, turned.grad))
        saved.append(None)
    for got, want, want_dtype in zip(*results, (torch.float32, dtype, dtype)):
        assert got.dtype == want_dtype and torch.equal(got, want)
    assert (turned.grad.flatten(1).abs().amax(1) > 0).all()  # every row was read
    mine, autograd = saved[:saved.index(None)], saved[saved.index(None) + 1:-1]
    assert sum(mine) == q.numel() + turned.numel() + rows.numel()
    assert sum(autograd) >= sum(mine) - turned.numel() - rows.numel() + B * T * S * Hkv * D


@pytest.mark.parametrize("shared_keys", [True, False])
@pytest.mark.parametrize("window,sinks,split", [(4, 0, 6), (4, 2, 6), (3, 3, 1), (5, 2, 9), (16, 2, 4)])
def test_window_branch_matches_brute_force(window, sinks, split, shared_keys, monkeypatch):
    """window_attention (through the mixer's window branch) vs a T x T masked softmax, also when the sequence
    arrives in two calls with the window and sinks carried in the cache. Left padding in row 1; GQA (4 q / 2 kv).
    shared_keys False: the attention call of torch < 2.5 (keys repeated per query head)."""
    monkeypatch.setattr(modeling, "_SDPA_SHARES_KEYS", shared_keys)
    config = tiny_config(window_size=window, num_sink_tokens=sinks, num_key_value_heads=2, partial_rotary_factor=0.5)
    mixer = tiny_model(window_size=window, num_sink_tokens=sinks, num_key_value_heads=2,
                       partial_rotary_factor=0.5).model.layers[0].mixer
    B, T, H, Hkv, D = 2, 13, 4, 2, config.head_dim
    gen = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, Hkv, D, generator=gen), torch.randn(
        B, T, Hkv, D, generator=gen)
    q, k = 3 * q, 3 * k  # peaked softmax: wrong key sets or wrong rotations show
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :2] = False
    pos = (mask.long().cumsum(1) - 1).masked_fill(~mask, -1)
    want = brute_force_window(q, k, v, pos, window, sinks, mixer.rope_inv_freq, mixer.scale)
    with torch.no_grad():
        whole = mixer.window_branch(q, k, v, pos, None)
        state = AarenLayerState()
        parts = torch.cat([mixer.window_branch(q[:, :split], k[:, :split], v[:, :split], pos[:, :split], state),
                           mixer.window_branch(q[:, split:], k[:, split:], v[:, split:], pos[:, split:], state)], 1)
    torch.testing.assert_close(whole.double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(parts.double(), want, atol=2e-5, rtol=1e-5)
    assert whole[1, :2].abs().max() == 0  # padding queries give 0
    rot = config.rotary_dim
    torch.testing.assert_close(mixer.rope_inv_freq, 1.0 / config.rope_theta ** (torch.arange(0, rot, 2) / rot))
    if sinks and window + sinks < T:  # the sinks matter: dropping them changes the answer
        no_sink = brute_force_window(q, k, v, pos, window, 0, mixer.rope_inv_freq, mixer.scale)
        assert (no_sink - want).abs().max() > 1e-2


def memory_inputs(T, D, seed, padding):
    """Inputs of the memory tier's tests: batch 2, GQA (4 q / 2 kv heads), peaked q and k (wrong key sets show),
    retention scores on a coarse grid (ties), ``padding`` left-padding tokens in row 1. Returns (q, k, v, retention,
    pos, the generator, for more draws)."""
    B, H, Hkv = 2, 4, 2
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (3 * torch.randn(B, T, H, D, generator=gen), 3 * torch.randn(B, T, Hkv, D, generator=gen),
               torch.randn(B, T, Hkv, D, generator=gen))
    retention = torch.randint(0, 4, (B, T, Hkv), generator=gen).float()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :padding] = False
    return q, k, v, retention, (mask.long().cumsum(1) - 1).masked_fill(~mask, -1), gen


def test_memory_recency_adds_its_multiple_of_the_position_and_keeps_newer_tokens():
    """memory_recency: the learned score plus lambda x position, in float32; at a lambda far above the scores' spread
    the memory holds the newest tokens that left the window, in prefill and after decoding, where without it the
    highest-scoring tokens of the whole stream stay."""
    ids = random_ids(1, 40, seed=3)
    kept = {}
    for recency in (0.0, 1000.0):
        model = tiny_model(**dict(MIXER_CASES["memory_learned"], memory_recency=recency)).eval()
        mixer = model.model.layers[1].mixer
        x, pos = torch.randn(1, 5, mixer.retention_proj.in_features), torch.arange(5).view(1, 5)
        torch.testing.assert_close(mixer.retention_score(x, None, pos),
                                   mixer.retention_proj(x).float() + recency * pos.unsqueeze(-1).float())
        with torch.no_grad():
            cache = model(ids[:, :30], use_cache=True).past_key_values
            for t in range(30, 40):
                cache = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).past_key_values
        kept[recency] = [sorted(state.memory_pos[0, 0].tolist()) for state in cache.layers]
        oldest_in_window = [int(state.window_pos[0].min()) for state in cache.layers]
        if recency:
            M = model.config.memory_size
            assert kept[recency] == [list(range(w - M, w)) for w in oldest_in_window]
    assert kept[0.0] != kept[1000.0]


@pytest.mark.parametrize("window,sinks,memory,splits", [(4, 1, 3, (6,)), (3, 0, 2, (1, 2, 3)), (2, 2, 5, (9,)),
                                                          (5, 1, 1, (4, 1, 1, 1)), (3, 1, 4, ())])
def test_memory_matches_brute_force(window, sinks, memory, splits):
    """The exact-memory tier vs a per-query sort of every past token: whole sequence, and in pieces (then one token
    at a time) with the memory carried in the cache. Scores on a coarse grid, so ties (broken towards the newer
    token) happen; left padding in row 1; GQA with a different memory per kv head."""
    kw = dict(window_size=window, num_sink_tokens=sinks, num_key_value_heads=2, memory_size=memory)
    config = tiny_config(**kw)
    mixer = tiny_model(**kw).model.layers[0].mixer
    B, T, Hkv, D = 2, 17, 2, config.head_dim
    q, k, v, retention, pos, _ = memory_inputs(T, D, seed=11, padding=3)
    want = brute_force_window(q, k, v, pos, window, sinks, mixer.rope_inv_freq, mixer.scale, memory, retention)
    with torch.no_grad():
        whole = mixer.window_branch(q, k, v, pos, None, retention)
        state, parts, t = AarenLayerState(), [], 0
        for n in list(splits) + [1] * (T - sum(splits)):
            cut = slice(t, t + n)
            parts.append(mixer.window_branch(q[:, cut], k[:, cut], v[:, cut], pos[:, cut], state, retention[:, cut]))
            t += n
            assert state.memory_k.shape == (B, Hkv, memory, D)  # fixed size from the first call on
    torch.testing.assert_close(whole.double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(parts, 1).double(), want, atol=2e-5, rtol=1e-5)
    # teeth: the memory changes the answer, and which tokens it keeps matters
    no_memory = brute_force_window(q, k, v, pos, window, sinks, mixer.rope_inv_freq, mixer.scale)
    assert (no_memory - want).abs().max() > 1e-2
    flipped = brute_force_window(q, k, v, pos, window, sinks, mixer.rope_inv_freq, mixer.scale, memory, -retention)
    assert (flipped - want).abs().max() > 1e-2


def test_block_groups_cover_every_block_with_the_keys_it_needs():
    """Runs of query blocks: consecutive, covering all blocks once, each as wide as its widest block; a run ends
    before a block that needs more than sqrt(2) times the keys of the run's first, so a filling memory gives a few
    runs and a full one a single run."""
    filling = [0, 63, 127, 191, 255, 319, 383, 447, 511, 511, 511, 511, 511, 511, 511, 487]  # 1,000 tokens, W=64
    for counts in (filling, [511] * 9, [0], [5, 0, 9, 0, 30], [0, 0, 0]):
        groups = modeling._block_groups(counts, 128)
        assert [n for first, end, _ in groups for n in range(first, end)] == list(range(len(counts)))
        for first, end, width in groups:
            assert width == max(1, *counts[first:end])
            assert all(128 + c <= math.sqrt(2) * (128 + counts[first]) for c in counts[first:end])
    assert [g[:2] for g in modeling._block_groups(filling, 128)] == [(0, 1), (1, 3), (3, 6), (6, 16)]
    assert len(modeling._block_groups([511] * 9, 128)) == 1


def test_memory_blocks_in_runs_give_the_one_call_answer(monkeypatch):
    """While the memory fills, the PyTorch path's query blocks go to attention in runs of their own width (on a CPU
    without the C kernel): the same outputs as one call at the widest block's width, and the brute force's outputs
    and gradients."""
    monkeypatch.setattr(modeling, "window_attention_cpu", None)
    kw = dict(window_size=4, num_sink_tokens=1, num_key_value_heads=2, memory_size=12)
    config = tiny_config(**kw)
    mixer = tiny_model(**kw).model.layers[0].mixer
    q, k, v, retention, pos, gen = memory_inputs(45, config.head_dim, seed=3, padding=5)
    runs = []
    grouped = modeling._block_groups
    monkeypatch.setattr(modeling, "_block_groups", lambda *a: runs.append(grouped(*a)) or runs[-1])
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    got = mixer.window_branch(*inputs, pos, None, retention)
    monkeypatch.setattr(modeling, "_block_groups", lambda counts, fixed: [(0, len(counts), max(counts))])
    with torch.no_grad():
        one = mixer.window_branch(q, k, v, pos, None, retention)
    assert len(runs) == 1 and len(runs[0]) >= 3  # teeth: the runs did split
    torch.testing.assert_close(got.detach(), one, atol=1e-6, rtol=1e-6)
    references = [t.double().requires_grad_(True) for t in (q, k, v)]
    want = brute_force_window(*references, pos, 4, 1, mixer.rope_inv_freq, mixer.scale, 12, retention)
    torch.testing.assert_close(got.detach().double(), want.detach(), atol=2e-5, rtol=1e-5)
    # and the gradients, through the runs and the sinks' turned keys
    weight = torch.randn(got.shape, generator=gen)
    (got * weight).sum().backward()
    (want * weight.double()).sum().backward()
    for mine, ref in zip(inputs, references):
        torch.testing.assert_close(mine.grad.double(), ref.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ranking", ["sweep", "c", "triton"])
def test_memory_visibility_equals_ranking_every_query_by_brute_force(ranking, monkeypatch):
    """The ranking behind the memory against its definition: each query sees, per kv head, the M best (score, then
    newer) real candidates that have left its window. Held entries first (some empty), left padding, sinks, scores
    with many ties. "sweep": the PyTorch reference (blocks ranked against the top set before them, never C x C),
    blocks of 1 to 8 candidates, 1 to 3 of them per pass; "c": the heap of kernels/memory/evict.c, which serves
    CPUs; "triton": the sweep as a GPU runs it, each pass's blocks ranked by kernels/memory/evict.py (Triton's
    interpreter)."""
    ran = []
    if ranking in ("sweep", "triton"):
        monkeypatch.setattr(modeling, "memory_evict_cpu", None)
    elif modeling.memory_evict_cpu is None or memory_kernel.memory_evict_cpu(
            torch.zeros(1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1), 1, 0, 1) is None:
        pytest.skip("no C compiler: the sweep serves CPUs too")
    if ranking == "triton":
        if modeling.fused_memory_evict is None or not triton_available():
            pytest.skip("triton is not installed")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
        kernel = modeling.fused_memory_evict
        monkeypatch.setattr(modeling, "fused_memory_evict", lambda *a: ran.append(1) or kernel(*a))
    g = torch.Generator().manual_seed(0)
    for trial in range(30 if ranking == "triton" else 60):  # the interpreter takes a quarter second a pass
        B, Hkv = 2, 2
        T, P = int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(0, 5, (1,), generator=g))
        first = int(torch.randint(0, 6, (1,), generator=g))
        W, S, M = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 8), (0, 3), (0, 7)))
        C = first + P + T
        pos = (torch.arange(C) - first + 10).expand(B, Hkv, C).clone()
        pos[:, :, :first] = torch.randperm(10, generator=g)[:first] - 1  # held entries: older, -1 = empty slot
        pos[0, :, first : first + 2] = -1  # left padding
        score = torch.randint(0, 4, (B, Hkv, C), generator=g).float() / 64
        block = int(torch.randint(1, 9, (1,), generator=g))
        pairs = int(torch.randint(1, 4, (1,), generator=g)) * B * Hkv * max((M + block) ** 2, C + 1)
        monkeypatch.setattr(modeling, "SWEEP_PAIRS", pairs)  # 1 to 3 blocks per pass
        monkeypatch.setattr(modeling, "SWEEP_PAIRS_GPU", pairs)  # the kernel's passes hold more
        last, evict = memory_visibility(pos, score, first, W, S, M, T, block=block)
        got = memory_seen(evict, last)  # [B, Hkv, T + 1, C]
        want = torch.zeros_like(got)
        for b in range(B):
            for h in range(Hkv):
                for i in range(T + 1):
                    left = first - 1 + max(0, P + i - W + 1)
                    eligible = [c for c in range(left + 1) if pos[b, h, c] >= S]
                    eligible.sort(key=lambda c: (float(score[b, h, c]), int(pos[b, h, c])), reverse=True)
                    want[b, h, i, eligible[:M]] = True
        assert torch.equal(got, want), (trial, T, P, first, W, S, M, block)
    assert bool(ran) == (ranking == "triton")


# in Triton's interpreter (slow) two of the three: a coded memory with query groups, and a shared score (a plain
# memory's step ranks by the same code as a coded one's)
@pytest.mark.parametrize("case,backend", [(case, backend) for backend in ("c", "torch", "triton")
                                          for case in ("memory_learned", "memory_int4_gqa", "memory_shared")
                                          if (case, backend) != ("memory_learned", "triton")])
def test_a_nan_retention_score_ranks_as_minus_inf_in_every_path(case, backend, monkeypatch):
    """A broken model's NaN retention score: comparisons with NaN are false, so the parallel pass's ranking (the C
    heap, or the sweep) and the decode step (C, PyTorch, or the Triton step, which ranks the score itself) each
    treated it their own way and kept different tokens (logits 2.8-5.7 apart here). Ranked as -inf everywhere,
    token-by-token decoding equals the parallel pass."""
    if backend == "torch":
        monkeypatch.setenv("AAREN_BACKEND", "torch")
    if backend == "triton":  # as a GPU runs the model, in Triton's interpreter
        if modeling.fused_window_step is None or not triton_available():
            pytest.skip("needs triton and aaren_hf.kernels")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
        served = []
        monkeypatch.setattr(modeling, "fused_window_step", recording(modeling.fused_window_step, served))
    model = tiny_model(**MIXER_CASES[case], **({"chunk_size": 16} if backend == "triton" else {}))
    for layer in model.model.layers:
        if hasattr(layer.mixer, "retention_proj"):  # NaN for the tokens whose first feature is large
            layer.mixer.retention_proj.register_forward_hook(
                lambda mod, inp, out: out.masked_fill(inp[0][..., :1] > 0.3, float("nan")))
    ids = random_ids(2, 20, seed=1)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    assert torch.isfinite(full).all()
    torch.testing.assert_close(incremental_logits(model, ids, (7,)), full, atol=ATOL, rtol=0)
    if backend == "triton":
        assert served and all(served)


def test_shared_retention_keeps_the_top_tokens_by_the_larger_score():
    """memory_shared_layer=0: layer 1's memory holds, per KV head, the M tokens that have left the window with the
    highest max(own score, layer 0's best score over KV heads), by a brute-force sort; layer 0's memory is its own.
    Teeth: layer 0's scores are made to dominate, so layer 1 keeps other tokens than it would on its own."""
    kw = dict(window_size=3, num_sink_tokens=1, memory_size=3, num_key_value_heads=2)
    shared, alone = tiny_model(**kw, memory_shared_layer=0), tiny_model(**kw)
    with torch.no_grad():
        for model in (shared, alone):
            model.model.layers[0].mixer.retention_proj.weight.mul_(40)
    recorded = {}
    for i, layer in enumerate(shared.model.layers):
        own = layer.mixer.retention_score
        layer.mixer.retention_score = lambda x, s, pos, i=i, own=own: recorded.setdefault(i, own(x, s, pos))
    ids = random_ids(1, 17, seed=2)
    T, W, S, M = 17, 3, 1, 3
    with torch.no_grad():
        kept_shared = shared(ids, use_cache=True).past_key_values.layers
        kept_alone = alone(ids, use_cache=True).past_key_values.layers

    def brute(score):  # [T, Hkv] -> per kv head the set of positions kept for the next query (stream index T)
        left = range(S, T - W + 1)
        return [set(sorted(left, key=lambda j: (float(score[j, h]), j), reverse=True)[:M]) for h in range(2)]

    own0, own1 = (modeling.round_retention(recorded[i][0]) for i in (0, 1))
    combined = torch.maximum(own1, own0.amax(-1, keepdim=True))
    got = [set(kept_shared[1].memory_pos[0, h].tolist()) for h in range(2)]
    assert got == brute(combined)
    assert [set(kept_shared[0].memory_pos[0, h].tolist()) for h in range(2)] == brute(own0)
    assert got != [set(kept_alone[1].memory_pos[0, h].tolist()) for h in range(2)] == brute(own1)


def test_memory_size_zero_is_the_model_without_it():
    """memory_size=0 builds no retention parameters and computes exactly the model without the tier."""
    base = dict(window_size=4, num_sink_tokens=1, num_query_slots=2, decay="learned")
    ids = random_ids(2, 13)
    plain = tiny_model(**base)
    zero = tiny_model(**base, memory_size=0)
    assert not any("retention" in n for n, _ in zero.named_parameters())
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, zero(ids).logits)
    with_memory = tiny_model(**base, memory_size=2)
    with_memory.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        assert (with_memory(ids).logits - plain(ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kv_cache_dtype_stores_window_and_memory_in_16_bits(dtype):
    """A float32 model with kv_cache_dtype keeps window, sink and memory keys/values in 16 bits (half their bytes;
    the Aaren state, positions and scores stay float32), computes on the rounded values on every path (the
    prefill-vs-decode checks run on the "memory_kv_bf16" case), and moves the output by rounding error only."""
    base = dict(window_size=3, num_sink_tokens=1, memory_size=3, num_query_slots=2, decay="learned")
    ids = random_ids(2, 17)
    full, half = tiny_model(**base), tiny_model(**base, kv_cache_dtype=dtype)
    half.load_state_dict(full.state_dict())
    caches = {}
    with torch.no_grad():
        for name, model in (("full", full), ("half", half)):
            caches[name] = AarenCache(model.config)
            logits = model(ids, past_key_values=caches[name], use_cache=True).logits
            caches[name + "_logits"] = logits
    diff = (caches["half_logits"] - caches["full_logits"]).abs().max()
    assert 0 < diff < 0.05 * caches["full_logits"].abs().max()
    kv_names = ("window_k", "window_v", "sink_k", "sink_v", "memory_k", "memory_v")
    kv_bytes = 0
    for layer in caches["half"].layers:
        for name, t in layer.tensors().items():
            want = getattr(torch, dtype) if name in kv_names else (torch.float32 if t.is_floating_point() else t.dtype)
            assert t.dtype == want, name
            kv_bytes += t.numel() * t.element_size() if name in kv_names else 0
    assert kv_bytes > 0 and caches["full"].state_bytes() - caches["half"].state_bytes() == kv_bytes


@pytest.mark.parametrize("bits", [8, 4])
def test_memory_bits_store_the_memory_as_codes(bits):
    """memory_bits keeps the memory's keys and values as integer codes (4 bits: two to a byte) with one bfloat16
    scale per vector, next to a 16-bit window: the memory's bytes shrink by exactly what the codes save, and the
    output moves by rounding error only. The codes are the ones the reference rounding gives."""
    from helpers import quantized

    from aaren_hf.modeling_aaren import MemoryCodes

    base = dict(window_size=3, num_sink_tokens=1, memory_size=4, num_key_value_heads=2, kv_cache_dtype="bfloat16")
    ids = random_ids(2, 17)
    plain, coded = tiny_model(**base), tiny_model(**base, memory_bits=bits)
    coded.load_state_dict(plain.state_dict())
    caches, logits = {}, {}
    with torch.no_grad():
        for name, model in (("plain", plain), ("coded", coded)):
            caches[name] = AarenCache(model.config)
            logits[name] = model(ids, past_key_values=caches[name], use_cache=True).logits
    diff = (logits["coded"] - logits["plain"]).abs().max()
    assert 0 < diff < 0.05 * logits["plain"].abs().max()
    D, M, Hkv = coded.config.head_dim, 4, 2
    for i, (layer, plain_layer) in enumerate(zip(caches["coded"].layers, caches["plain"].layers)):
        assert layer.memory_k.dtype == (torch.int8 if bits == 8 else torch.uint8)
        assert layer.memory_k.shape == (2, Hkv, M, D * bits // 8) and layer.memory_v.shape == layer.memory_k.shape
        assert layer.memory_k_scale.shape == (2, Hkv, M, 1) and layer.memory_k_scale.dtype == torch.bfloat16
        for name in ("k", "v"):
            got = MemoryCodes(bits).decode(getattr(layer, "memory_" + name), getattr(layer, f"memory_{name}_scale"))
            if i == 0:  # same input: the same tokens kept, each its 16-bit original rounded as the reference rounds
                assert torch.equal(layer.memory_pos, plain_layer.memory_pos)
                want = quantized(getattr(plain_layer, "memory_" + name).double(), bits)
                torch.testing.assert_close(got.double(), want, atol=0, rtol=0)
            # codes read back and stored again are the same codes: no drift over prefill chunks
            again = MemoryCodes(bits).encode(got)
            assert torch.equal(again[0], getattr(layer, "memory_" + name))
            assert torch.equal(again[1], getattr(layer, f"memory_{name}_scale"))
    saved = coded.config.num_hidden_layers * 2 * 2 * Hkv * M * (D * 2 - (D * bits // 8 + 2))  # rows, k and v
    assert caches["plain"].state_bytes() - caches["coded"].state_bytes() == saved


@pytest.mark.parametrize("rotate", [False, True])
def test_memory_codes_stay_finite_for_zero_and_huge_vectors(rotate):
    from aaren_hf.modeling_aaren import MemoryCodes

    x = torch.stack([torch.zeros(8), torch.full((8,), 3e38), torch.linspace(-1e-30, 1e-30, 8)])
    for bits in (8, 4):
        back = MemoryCodes(bits, rotate).decode(*MemoryCodes(bits, rotate).encode(x))
        assert torch.isfinite(back).all() and torch.equal(back[0], torch.zeros(8))
        torch.testing.assert_close(back[1], x[1], rtol=0.01, atol=0)


@pytest.mark.parametrize("D", [2, 8, 64, 128])
def test_hadamard_codes_are_the_reference_codes_and_read_back_exactly(D):
    """memory_hadamard: the codes are those of x H / D (H from its definition, float64), read back times H; codes
    read back and coded again are the same codes (no drift across prefill pieces or decode steps); and with one large
    channel, as rotary keys have, they lose far less than plain codes, which round the other channels to zero."""
    from helpers import quantized, sylvester

    from aaren_hf.modeling_aaren import MemoryCodes, hadamard

    gen = torch.Generator().manual_seed(D)
    x = torch.randn(300, D, generator=gen) * torch.randn(300, 1, generator=gen).exp()
    torch.testing.assert_close(hadamard(x).double(), x.double() @ sylvester(D) / D, rtol=1e-6, atol=1e-6)
    x[:, 1] *= 30
    for bits in (8, 4):
        rotated = MemoryCodes(bits, rotate=True)
        codes, scale = rotated.encode(x)
        back = rotated.decode(codes, scale)
        assert back.dtype == torch.float32
        torch.testing.assert_close(back.double(), quantized(x.double(), bits, hadamard=True), rtol=1e-6, atol=1e-6)
        again = rotated.encode(back)
        assert torch.equal(again[0], codes) and torch.equal(again[1], scale)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a 16-bit product would round the whole numbers
            assert torch.equal(rotated.decode(codes, scale), back)
        if D >= 8:  # the more channels share the large one's weight, the more the rotation gains
            plain = MemoryCodes(bits).decode(*MemoryCodes(bits).encode(x))
            assert (back - x).norm() < (0.5 if D >= 64 else 0.9) * (plain - x).norm()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_memory_codes_in_c_are_the_references_bit_for_bit(bits, rotate, monkeypatch):
    """round_with_codes on a CPU (kernels/memory/codes.c) against its PyTorch reference (encode, then decode): the
    same codes, scales and values bit for bit, over vectors of every scale (zero, tiny, huge, one large channel),
    widths 2-256 and leading shapes with no rows; and round_with_codes gives the same whichever of the two runs."""
    from aaren_hf.kernels.memory import memory_round_cpu
    from aaren_hf.modeling_aaren import MemoryCodes
    from helpers import code_test_vectors

    codes_of = MemoryCodes(bits, rotate)
    for x in code_test_vectors(bits + rotate):
        got = memory_round_cpu(x, bits, rotate)
        assert got is not None, "the C kernel did not run"
        want_codes = codes_of.encode(x)
        assert torch.equal(got[1][0], want_codes[0]) and torch.equal(got[1][1], want_codes[1])
        assert torch.equal(got[0], codes_of.decode(*want_codes))
        monkeypatch.setattr(modeling, "memory_round_cpu", None)  # round_with_codes by the reference
        back, coded = codes_of.round_with_codes(x)
        monkeypatch.undo()
        assert torch.equal(back, got[0]) and torch.equal(coded[0], got[1][0])
        assert torch.equal(codes_of.round_with_codes(x)[0], got[0])  # and through the kernel
    if rotate:  # the butterflies need a power of 2: declined, nothing written
        assert memory_round_cpu(torch.randn(3, 6), bits, rotate) is None


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
@pytest.mark.parametrize("case", ["window_sinks", "partial_rotary", "gemma_block", "memory_learned", "memory_kv_bf16",
                                  "memory_int8", "memory_int4_gqa", "memory_int4_hadamard"])
def test_a_prompts_window_branch_in_c_is_the_references_bit_for_bit(case, monkeypatch):
    """A prompt's window branch without gradients on a CPU, around its attention: the rounding, sinks and next window
    (kernels/window/prefill.c) and, for a memory held in codes, memory_candidates and keep_memory
    (kernels/memory/prefill.c), against the PyTorch reference: the logits, and every state tensor after each piece,
    the same bits. Pieces from 1 token (fewer than the window holds) to past the memory's size, later ones
    starting from a held window and memory; a left-padded row; scores with ties (few distinct values). The mixer's
    one call for a prompt (kernels/mixer) is off: it runs these kernels too (tests/test_mixer_step_kernel.py)."""
    monkeypatch.setattr(modeling, "mixer_prefill_cpu", None)
    model = tiny_model(**MIXER_CASES[case])
    for layer in model.model.layers:
        if hasattr(layer.mixer, "retention_proj"):  # scores on a coarse grid: many ties
            layer.mixer.retention_proj.register_forward_hook(lambda mod, inp, out: (out * 4).round() / 64)
    ids = random_ids(2, 40, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kernels = {name: getattr(modeling, name) for name in ("window_prefill_cpu", "memory_prefill_cpu")}
    calls = {name: [] for name in kernels}

    def counted(name):
        def call(*args, **kwargs):
            got = kernels[name](*args, **kwargs)
            calls[name].append(got is not None)
            return got
        return call

    def run():
        cache, out, t = AarenCache(model.config), [], 0
        with torch.no_grad():
            for n in (1, 9, 1, 2, 17, 10):
                out.append(model(ids[:, t:t + n], attention_mask=mask[:, :t + n], past_key_values=cache,
                                 use_cache=True).logits)
                out.extend(state for layer in cache.layers for state in layer.tensors().values())
                t += n
            out.append(model(ids, attention_mask=mask).logits)  # no cache: nothing kept
        return out

    for name in kernels:
        monkeypatch.setattr(modeling, name, counted(name))
    got = run()
    assert calls["window_prefill_cpu"] and all(calls["window_prefill_cpu"]), "the window's C kernel did not run"
    if model.config.memory_bits:
        assert calls["memory_prefill_cpu"] and all(calls["memory_prefill_cpu"]), "the memory's C kernel did not run"
    for name in kernels:
        monkeypatch.setattr(modeling, name, None)
    want = run()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("bits", [8, 4])
def test_memory_codes_pass_gradients_straight_through(bits):
    """Training reads the memory's rounded keys and values: the gradient reaches x as if there were no rounding; without
    a gradient the same values come back."""
    from aaren_hf.modeling_aaren import MemoryCodes

    codes = MemoryCodes(bits, rotate=True)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(bits), requires_grad=True)
    weight = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    (codes.round(x) * weight).sum().backward()
    torch.testing.assert_close(x.grad, weight)
    assert torch.equal(codes.round(x).detach(), codes.round(x.detach()))


def test_memory_codes_are_the_configs_and_refuse_other_widths(monkeypatch):
    """One quantizer object per config (what the mixer and the coded baselines share); bad widths are refused; the
    autocast query also works on torch < 2.4, whose is_autocast_enabled takes no device (a Hub user's torch)."""
    from aaren_hf import modeling_aaren
    from aaren_hf.modeling_aaren import MemoryCodes

    config = tiny_config(window_size=4, memory_size=[0, 2], memory_bits=4, memory_hadamard=True)
    assert MemoryCodes.of(config) == MemoryCodes(4, rotate=True) and str(MemoryCodes.of(config)) == "4-bit Hadamard codes"
    assert MemoryCodes.of(tiny_config(window_size=4, memory_size=2)) is None
    layers = AarenForCausalLM(config).model.layers
    assert [layer.mixer.memory_codes for layer in layers] == [None, MemoryCodes(4, rotate=True)]  # layer 0 keeps none
    for bad in (dict(bits=3), dict(bits=16), dict(bits=8, rotate="yes")):
        with pytest.raises(ValueError, match="8 or 4 bits"):
            MemoryCodes(**bad)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda: False)  # the old signature: CUDA only
    monkeypatch.setattr(torch, "is_autocast_cpu_enabled", lambda: True, raising=False)
    assert modeling_aaren._autocast_on("cpu") and not modeling_aaren._autocast_on("cuda")


def test_float16_cache_saturates_instead_of_overflowing():
    model = tiny_model(window_size=3, num_sink_tokens=1, memory_size=2, kv_cache_dtype="float16")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mixer.v_proj.weight.mul_(1e6)
    ids = random_ids(2, 11)
    cache = AarenCache(model.config)
    with torch.no_grad():
        logits = torch.cat([model(ids[:, :6], past_key_values=cache, use_cache=True).logits,
                            model(ids[:, 6:], past_key_values=cache, use_cache=True).logits], 1)
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(t).all() for layer in cache.layers for n, t in layer.tensors().items() if "_v" in n)


@pytest.mark.parametrize("window_kernel", [True, False])
def test_float16_sink_scores_past_its_range_stay_finite_as_a_gpu_runs_them(window_kernel, monkeypatch):
    """On a GPU a float16 model attends in float16 (``_attention_dtype``), and the sinks' scores are computed apart
    from the window's, before the scale (``_sink_scores``): held in float16 they overflowed to inf from 65504 (a
    scaled score of 8,188 at D = 64) and the softmax made the logits NaN. Queries and keys scaled until the sinks'
    scores pass that; as a GPU runs the model (Triton's interpreter): with the window kernel, training and a prefill
    followed by decode steps give the CPU path's logits (float32 attention) to float16's rounding, and finite
    gradients; without it (the PyTorch path, whose float16 queries hold the scores saturated) finite ones."""
    if modeling.fused_window_attention is None or not triton_available():
        pytest.skip("needs triton and aaren_hf.kernels")
    scores = []
    sink_scores = modeling._sink_scores
    monkeypatch.setattr(modeling, "_sink_scores", lambda *a: scores.append(sink_scores(*a)) or scores[-1])
    model = tiny_model(chunk_size=16, window_size=4, num_sink_tokens=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mixer.q_proj.weight.mul_(100)
            layer.mixer.k_proj.weight.mul_(100)
    model.half()
    ids = random_ids(2, 21, seed=3)
    logits = {}
    for path in ("cpu", "gpu"):
        with monkeypatch.context() as m:
            if path == "gpu":
                m.setenv("TRITON_INTERPRET", "1")
                m.setattr(modeling, "launch_bound", lambda device: True)
                if not window_kernel:
                    m.setattr(modeling, "fused_window_attention", None)
            model.zero_grad()
            out = model(ids, use_cache=False).logits
            out.float().square().sum().backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), path
            logits[path] = out.detach().float()
            if path == "gpu" and window_kernel:
                with torch.no_grad():
                    logits["steps"] = incremental_logits(model, ids, (15,)).float()
    assert max(s.abs().max() for s in scores) > 65504  # float16's largest
    assert torch.isfinite(logits["gpu"]).all()
    if window_kernel:
        torch.testing.assert_close(logits["gpu"], logits["cpu"], atol=1e-2, rtol=0)
        torch.testing.assert_close(logits["steps"], logits["cpu"], atol=1e-2, rtol=0)


@pytest.mark.parametrize("with_decay", [False, True])
@pytest.mark.parametrize("score_range", [3.0, 1000.0])
def test_scan_ops_match_brute_force(with_decay, score_range):
    """Both PyTorch ops (chunked and token by token) vs a float64 T x T softmax: -inf padding, initial state,
    scores spanning +-score_range, packed sequences (cu_seqlens)."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 23, 3, 4
    s = (torch.rand(B, T, H, generator=gen) * 2 - 1) * score_range
    s[0, :4] = float("-inf")  # padding at the start of row 0: empty state, output 0
    s[1, 10] = float("-inf")
    v = torch.randn(B, T, H, D, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 0.5 if with_decay else None
    init = (torch.randn(B, H, D, generator=gen), torch.randn(B, H, generator=gen) * score_range)
    for initial in (None, init):
        want, (want_o, want_lse) = brute_force_aaren(s, v, g, initial)
        for op, kw in ((chunk_aaren_torch, dict(chunk_size=5)), (chunk_aaren_torch, dict(chunk_size=64)),
                       (recurrent_aaren_torch, {})):
            o, (fo, flse) = op(s, v, g, initial, True, **kw)
            assert torch.isfinite(o).all()
            torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(fo.double(), want_o, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(flse.double(), want_lse, atol=1e-4 * max(1.0, score_range / 100), rtol=0)
    # packed: two sequences in one row restart from the empty state at the boundary
    cu = torch.tensor([0, 9, T])
    o, _ = chunk_aaren_torch(s[1:], v[1:], None if g is None else g[1:], None, False, cu, 4)
    first, _ = brute_force_aaren(s[1:, :9], v[1:, :9], None if g is None else g[1:, :9])
    second, _ = brute_force_aaren(s[1:, 9:], v[1:, 9:], None if g is None else g[1:, 9:])
    torch.testing.assert_close(o.double(), torch.cat([first, second], 1), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Numerical robustness and dtypes
# ---------------------------------------------------------------------------------------------------------------


def test_scores_spanning_thousands_stay_finite():
    model = tiny_model(decay="input", window_size=4, num_sink_tokens=1, num_query_slots=2)
    ids = random_ids(2, 15, seed=4)
    layer0 = model.model.layers[0]
    with torch.no_grad():
        x0 = layer0.input_layernorm(model.model.embed_tokens(ids))
        k = layer0.mixer.k_proj(x0).view(2, 15, 4, -1)
        s = torch.einsum("btkd,kjd->btkj", k, layer0.mixer.queries) * layer0.mixer.scale
        factor = 1000.0 / s.abs().max()
        for layer in model.model.layers:
            layer.mixer.queries.mul_(factor)
        s = s * factor
    assert s.max() > 300 and s.min() < -300  # scores really span about +-1000
    with torch.no_grad():
        full = model(ids).logits
    step = incremental_logits(model, ids, (5,))
    assert torch.isfinite(full).all() and torch.isfinite(step).all()
    # near-hard-max weights amplify last-bit differences of the scores (1000 * 1e-7) through the layers: the two
    # paths differ by about 1.1e-3 at worst here (a change of summation order anywhere moves it by a few 1e-5)
    torch.testing.assert_close(step, full, atol=2e-3, rtol=1e-3)


def test_100k_tokens_through_chunked_prefill_and_recurrent_decode():
    model = tiny_model(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16,
                       chunk_size=64, decay="input", window_size=4, num_sink_tokens=2)
    T = 100_000
    ids = random_ids(1, T, seed=5)
    cache = AarenCache(model.config)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        bytes_after_prefill = cache.state_bytes()
        steps = [model(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits for i in range(3)]
    assert torch.isfinite(out.logits).all() and all(torch.isfinite(x).all() for x in steps)
    layer = cache.layers[0]
    assert torch.isfinite(layer.aaren_o).all() and torch.isfinite(layer.aaren_lse).all()
    assert cache.get_seq_length() == T + 3 and int(cache.real_tokens) == T + 3
    assert cache.state_bytes() == bytes_after_prefill  # nothing grew


def test_100k_tokens_recurrent_op_after_long_history():
    """The decode op continuing a 100k-token state (scores +-1000, decay) agrees with the chunked op."""
    gen = torch.Generator().manual_seed(0)
    T, tail = 100_000, 300
    s = (torch.rand(1, T, 2, generator=gen) * 2 - 1) * 1000
    v = torch.randn(1, T, 2, 4, generator=gen)
    g = -torch.rand(1, T, 2, generator=gen) * 1e-3
    o_full, _ = chunk_aaren_torch(s, v, g, None, False)
    _, state = chunk_aaren_torch(s[:, :-tail], v[:, :-tail], g[:, :-tail], None, True)
    o_tail, (fo, flse) = recurrent_aaren_torch(s[:, -tail:], v[:, -tail:], g[:, -tail:], state, True)
    assert torch.isfinite(o_full).all() and torch.isfinite(fo).all() and torch.isfinite(flse).all()
    # Scores of +-1000 leave fp32 about 1e-4 of absolute precision in the exponent (eps * 1000): both paths are
    # held to that against a float64 run of the same data.
    o_ref, _ = chunk_aaren_torch(s.double(), v.double(), g.double(), None, False)
    torch.testing.assert_close(o_tail.double(), o_ref[:, -tail:], atol=2e-4, rtol=0)
    torch.testing.assert_close(o_full[:, -tail:].double(), o_ref[:, -tail:], atol=2e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_keep_fp32_state(dtype):
    case = MIXER_CASES["everything"]
    model32 = tiny_model(**case)
    model = tiny_model(**case).to(dtype)
    ids = random_ids(2, 11, seed=2)
    with torch.no_grad():
        ref = model32(ids).logits
        cache = AarenCache(model.config)
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        for _ in range(3):
            nxt = logits[:, -1:].argmax(-1)
            logits = model(nxt, past_key_values=cache, use_cache=True).logits
            assert torch.isfinite(logits).all()
        full = model(ids).logits
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert full.dtype == dtype and torch.isfinite(full).all()
    assert generated.shape == (2, 15)
    assert (full.float() - ref).abs().max() < 0.05 * ref.abs().max()  # close to the fp32 model
    for layer in cache.layers:
        assert layer.aaren_o.dtype == torch.float32 and layer.aaren_lse.dtype == torch.float32
        assert layer.window_k.dtype == dtype and layer.window_v.dtype == dtype  # like a KV cache
        assert torch.isfinite(layer.aaren_o).all()


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(hidden_size=30, num_attention_heads=4), "not divisible by num_attention_heads"),
        (dict(num_attention_heads=4, num_key_value_heads=3), "must be a multiple of num_key_value_heads"),
        (dict(decay="exponential"), "decay must be one of"),
        (dict(norm_type="batchnorm"), "norm_type must be one of"),
        (dict(window_size=4, window_gate="token"), "window_gate must be one of"),
        (dict(mlp_type="moe"), "mlp_type must be one of"),
        (dict(position_embedding_type="alibi"), "position_embedding_type must be one of"),
        (dict(hidden_size=0), "hidden_size must be an integer > 0"),
        (dict(num_hidden_layers=-1), "num_hidden_layers must be an integer > 0"),
        (dict(chunk_size=0), "chunk_size must be an integer > 0"),
        (dict(num_query_slots=0), "num_query_slots must be an integer > 0"),
        (dict(window_size=-2), "window_size must be an integer >= 0"),
        (dict(vocab_size=2.5), "vocab_size must be an integer > 0"),
        (dict(num_sink_tokens=2), "num_sink_tokens > 0 needs the window branch"),
        (dict(memory_size=4), "memory_size > 0 needs the window branch"),
        (dict(window_size=4, memory_size=-1), "memory_size must be an integer >= 0"),
        (dict(window_size=4, memory_size=[2]), "one integer >= 0 per layer (2 layers)"),
        (dict(window_size=4, memory_size=[2, -1]), "one integer >= 0 per layer"),
        (dict(memory_size=[0, 2]), "memory_size > 0 needs the window branch"),
        (dict(window_size=4, memory_size=2, memory_shared_layer=1), "a layer index from 0 to 0"),
        (dict(window_size=4, memory_size=[0, 2], memory_shared_layer=0), "names a layer without a memory"),
        (dict(window_size=4, memory_size=2, memory_rule="h2o"), "memory_rule must be one of"),
        (dict(window_size=4, kv_cache_dtype="int8"), "kv_cache_dtype must be one of"),
        (dict(window_size=4, memory_size=2, memory_bits=2), "memory_bits must be one of"),
        (dict(window_size=4, memory_size=2, memory_bits=4, head_dim=5), "needs an even head_dim"),
        (dict(window_size=4, memory_size=2, memory_hadamard=True), "set memory_bits=8 or 4 as well"),
        (dict(window_size=4, memory_size=2, memory_bits=8, memory_hadamard=True, head_dim=12), "a power of 2"),
        (dict(window_size=4, memory_size=2, memory_bits=8, memory_hadamard="yes"), "must be True or False"),
        (dict(window_size=4, memory_size=2, memory_recency=-0.5), "memory_recency must be a finite number >= 0"),
        (dict(window_size=4, memory_size=2, memory_recency=float("nan")), "memory_recency must be a finite number"),
        (dict(window_size=4, memory_size=2, memory_recency="0.1"), "memory_recency must be a finite number"),
        (dict(window_size=4, memory_size=2, memory_rule="aaren", memory_recency=0.1), "set memory_rule='learned'"),
        (dict(layer_types=["linear_attention"]), "layer_types must list one of"),
        (dict(layer_types=["linear_attention", "global"]), "layer_types must list one of"),
        (dict(layer_types=["linear_attention", "sliding_attention"]), "'sliding_attention' layer is the window branch alone"),
        (dict(window_size=4, memory_size=2, memory_rule="aaren", layer_types=["sliding_attention"] * 2),
         "use memory_rule='learned'"),
        (dict(decay="fixed", decay_init=0.0), "decay_init must be > 0"),
        (dict(partial_rotary_factor=1.5), "partial_rotary_factor must be in [0, 1]"),
        (dict(aaren_format_version=AAREN_FORMAT_VERSION + 1), "newer aaren-hf"),
    ],
)
def test_bad_config_values_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=None) as err:
        tiny_config(**kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("override,message", [
    (dict(memory_size=-1), "memory_size must be an integer >= 0"),
    (dict(memory_shared_layer=5), "a layer index from 0 to 0"),
    (dict(window_size=0), "memory_size > 0 needs the window branch"),
])
def test_from_pretrained_overrides_are_checked_like_the_config(tmp_path, override, message):
    tiny_model(window_size=4, memory_size=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        AarenForCausalLM.from_pretrained(tmp_path, **override)
    assert message in str(err.value)
    # a valid override goes through, a tuple normalised as __init__ does
    model = AarenForCausalLM.from_pretrained(tmp_path, memory_size=(3, 1))
    assert model.config.memory_size == [3, 1] and model.model.layers[1].mixer.memory_size == 1


@pytest.mark.parametrize("cast", ["to", "half"])
def test_a_cast_model_keeps_its_rotary_frequencies_in_float32(tmp_path, cast):
    """model.to(torch.bfloat16) or .half() leaves rope_inv_freq as it was (float32, the same values), so a cast model
    computes what one loaded in that dtype does, bit for bit; a rounded frequency turns far-apart keys otherwise."""
    model = tiny_model(window_size=4, num_sink_tokens=1, memory_size=3, rope_theta=50.0)
    model.save_pretrained(tmp_path)
    dtype = torch.bfloat16 if cast == "to" else torch.float16
    rounded = [layer.mixer.rope_inv_freq.to(dtype).float() for layer in model.model.layers]
    want = [layer.mixer.rope_inv_freq.clone() for layer in model.model.layers]
    assert any(not torch.equal(r, w) for r, w in zip(rounded, want))  # the check below can fail
    cast_model = model.to(dtype) if cast == "to" else model.half()
    for layer, freq in zip(cast_model.model.layers, want):
        assert layer.mixer.rope_inv_freq.dtype == torch.float32 and torch.equal(layer.mixer.rope_inv_freq, freq)
        assert layer.mixer.q_proj.weight.dtype == dtype  # the rest was cast
    loaded = AarenForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    ids = random_ids(2, 40)
    with torch.no_grad():
        assert torch.equal(cast_model(ids).logits, loaded(ids).logits)
    assert cast_model.to("cpu").model.layers[0].mixer.rope_inv_freq.dtype == torch.float32


def test_good_config_round_trips():
    config = tiny_config(**MIXER_CASES["everything"])
    again = AarenConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()


def test_input_longer_than_learned_position_table():
    model = tiny_model(position_embedding_type="learned", max_position_embeddings=16)
    with torch.no_grad():
        model(random_ids(1, 16))  # exactly the table: fine
        with pytest.raises(ValueError, match="learned position table holds 16 positions"):
            model(random_ids(1, 17))
        cache = AarenCache(model.config)
        model(random_ids(1, 16), past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="reaches position 16"):  # one more decode step
            model(random_ids(1, 1), past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="max_position_embeddings"):
            model.generate(random_ids(1, 10), max_new_tokens=10, do_sample=False)


def test_bad_forward_arguments():
    model = tiny_model()
    ids = random_ids(1, 5)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids=ids, inputs_embeds=model.get_input_embeddings()(ids))
    with pytest.raises(ValueError, match="2D"):
        model(ids, attention_mask=torch.ones(1, 1, 5, 5))
    from transformers import DynamicCache

    with pytest.raises(TypeError, match="must be an AarenCache"):
        model(ids, past_key_values=DynamicCache(), use_cache=True)
    with pytest.raises(NotImplementedError, match="cannot be rolled back"):
        AarenCache(model.config).crop(3)


# ---------------------------------------------------------------------------------------------------------------
# PEFT
# ---------------------------------------------------------------------------------------------------------------


def test_peft_lora_training_step_with_gradient_checkpointing_and_merge(monkeypatch):
    import transformers.modeling_utils
    from peft import LoraConfig, get_peft_model

    checkpoint_calls = []
    real_checkpoint = transformers.modeling_utils.checkpoint

    def counting_checkpoint(function, *args, **kwargs):
        checkpoint_calls.append(kwargs.get("use_reentrant"))
        return real_checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", counting_checkpoint)
    model = tiny_model(window_size=4, num_sink_tokens=1, window_gate="input", num_query_slots=2)
    ids = random_ids(2, 12, seed=8)
    with torch.no_grad():
        base_logits = model(ids).logits
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    targets = ["k_proj", "v_proj", "o_proj", "q_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    adapted = {n.split(".")[-4] for n, p in peft_model.named_parameters() if "lora_A" in n}
    assert set(targets) <= adapted
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert checkpoint_calls == [False] * model.config.num_hidden_layers  # every layer ran checkpointed
    grads = [p.grad for n, p in peft_model.named_parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().max() > 0 for g in grads)
    optimizer.step()

    peft_model.eval()
    with torch.no_grad():
        adapted_logits = peft_model(input_ids=ids).logits
        assert (adapted_logits - base_logits).abs().max() > 1e-3  # the step changed the model
        merged = peft_model.merge_and_unload()
        assert not any("lora" in n for n, _ in merged.named_parameters())
        merged_logits = merged(input_ids=ids).logits
    torch.testing.assert_close(merged_logits, adapted_logits, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the model on CUDA runs the Triton kernels (chunk for prefill, fused_recurrent for decode)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_attention_in_16_bits_stays_within_their_rounding(dtype, monkeypatch):
    """On CUDA a 16-bit model's window, memory and sink attention gathers and attends in 16 bits (``_attention_dtype``;
    run here on the CPU's kernel): outputs and gradients of q, k, v stay within 16-bit rounding of the float32 path
    on the same inputs, sinks (whose scores ride in extra query dimensions) and memory included, and SDPA is handed
    16-bit tensors only."""
    monkeypatch.setattr(modeling, "window_attention_cpu", None)  # the path CUDA falls back to, not the CPU's C kernel
    mixer = tiny_model(**MIXER_CASES["memory_gate_input_decay"]).model.layers[0].mixer.to(dtype)
    gen = torch.Generator().manual_seed(7)
    B, T, H, Hkv, D = 2, 40, mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    q, k, v = (torch.randn(B, T, h, D, generator=gen).to(dtype) * 2 for h in (H, Hkv, Hkv))
    pos = torch.arange(T).expand(B, T).clone()
    pos[1, :5] = -1  # left padding
    retention = torch.randint(0, 4, (B, T, Hkv), generator=gen).float()
    attention, handed = modeling._attention, []
    monkeypatch.setattr(modeling, "_attention", lambda *a: handed.append({t.dtype for t in a[:4]}) or attention(*a))
    results = {}
    for path, attend in (("float32", lambda q: torch.float32), ("16-bit", lambda q: q.dtype)):
        monkeypatch.setattr(modeling, "_attention_dtype", attend)
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = mixer.window_branch(*inputs, pos, None, retention)
        out.float().square().sum().backward()
        results[path] = [out.detach().float()] + [t.grad.float() for t in inputs]
    assert handed[0] == {torch.float32} and handed[-1] == {dtype}
    for got, want in zip(results["16-bit"], results["float32"]):
        assert ((got - want).norm() / want.norm()).item() < 2e-2
        assert torch.isfinite(got).all()


def test_bfloat16_grid_is_the_conversion_in_integer_arithmetic():
    """The memory codes' scale (``bfloat16_grid``): x.to(bfloat16).float() bit for bit on random bit patterns of
    non-negative floats (ties, subnormals, the largest finite values, inf; an exhaustive run over all 2^31 agreed),
    and a NaN, whatever its payload, stays a NaN."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F800001, (1 << 20,), generator=gen, dtype=torch.int64)
    edges = torch.tensor([0, 1, 0x8000, 0x18000, 0x3F808000, 0x3F818000, 0x007FFFFF, 0x7F7F8000, 0x7F7FFFFF,
                          0x7F800000], dtype=torch.int64)
    x = torch.cat([bits, edges]).to(torch.int32).view(torch.float32)
    assert torch.equal(modeling.bfloat16_grid(x).view(torch.int32), x.to(torch.bfloat16).float().view(torch.int32))
    nans = torch.tensor([0x7F800001, 0x7F807FFF, 0x7FC00000, 0x7FFFFFFF], dtype=torch.int64)
    assert modeling.bfloat16_grid(nans.to(torch.int32).view(torch.float32)).isnan().all()


def test_a_decode_step_compiled_by_inductor_stores_the_codes_prefill_would():
    """The GPU's decode path (run here) compiled by inductor, with a 4-bit memory: its logits match eager step by
    step. Before bfloat16_grid, inductor kept the codes' scale unrounded inside a fused kernel, a stored code
    differed and the logits drifted by 0.01-0.05 from the third step (this test failed so). Compiling takes
    15-90 s."""
    model = tiny_model(seed=0, chunk_size=16, **MIXER_CASES["memory_int4_gqa"])
    ids = random_ids(1, 20, seed=3)
    caches = [AarenCache(model.config), AarenCache(model.config)]
    torch._dynamo.reset()
    step = torch.compile(model, backend="inductor", dynamic=True)
    with mock.patch.object(modeling, "launch_bound", lambda device: True), torch.no_grad():
        for cache in caches:
            model(ids[:, :12], past_key_values=cache, use_cache=True)
        for t in range(12, 17):
            mask = torch.ones(1, t + 1, dtype=torch.long)
            kw = dict(input_ids=ids[:, t:t + 1], attention_mask=mask, use_cache=True)
            eager = model(past_key_values=caches[0], **kw).logits
            torch.testing.assert_close(step(past_key_values=caches[1], **kw).logits, eager, atol=1e-4, rtol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_sigmoid_is_the_float32_sigmoid_rounded(dtype):
    """What ``mix_branches`` relies on to take a 16-bit gate's sigmoid in 16 bits: on every finite and infinite value
    of the dtype, torch's sigmoid gives the bits of the float32 sigmoid cast to it."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[~x.isnan()]
    assert torch.equal(torch.sigmoid(x).view(torch.int16), torch.sigmoid(x.float()).to(dtype).view(torch.int16))


def test_sink_scores_turn_16_bit_keys_as_float32_turns_rounded():
    """``_sink_scores`` turns bf16 sink keys back in bf16 (a 16-bit cache on a GPU): the scores (float32) and the
    queries' gradients are the bits of turning float32 copies and casting them, the keys' gradient within bf16
    rounding of that (it is rounded before the sum over the copies); with partial rotary, GQA, a query inside the
    first S + W."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, Hkv, D, S, W = 2, 30, 6, 2, 32, 2, 8
    q = torch.randn(B, T, H, D, generator=gen).bfloat16().requires_grad_()
    sink_k = (torch.randn(B, S, Hkv, D, generator=gen) * 3).bfloat16().requires_grad_()
    pos = torch.stack([torch.arange(T), torch.arange(T) + 100])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D // 2, 2).float() / (D // 2)))  # rotary on half the channels
    rotary = modeling.Rotary(pos, inv_freq)
    got = modeling._sink_scores(q, pos, sink_k, W, rotary, torch.bfloat16)
    turned = rotary.turn_back(sink_k.float().unsqueeze(1).expand(B, S + W, S, Hkv, D).reshape(B, S + W, S * Hkv, D))
    c = pos.clamp(max=S + W - 1) + torch.arange(0, B * (S + W), S + W).view(B, 1)
    keys = turned.reshape(B * (S + W), S, Hkv, D).index_select(0, c.flatten()).view(B, T, S, Hkv, D).bfloat16()
    want = torch.matmul(q.view(B, T, Hkv, H // Hkv, D).float(), keys.float().permute(0, 1, 3, 4, 2))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    grads = [torch.autograd.grad(out.float().square().sum(), [q, sink_k]) for out in (got, want)]
    assert torch.equal(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-2, atol=1e-2 * float(grads[1][1].abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_product_of_16_bit_inputs_keeps_them_in_16_bits(dtype):
    """The slots' mix and the slot scores (``float32_product``): the values and gradients of the float32 product of
    16-bit inputs, a broadcast second factor included (the slots' queries), while backward keeps the first factor
    in 16 bits, no float32 copy (the second, small one, as its float32 copy: one cast fewer in backward)."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(2, 3, 7, 16, generator=gen).to(dtype)
    b = torch.randn(3, 16, 4, generator=gen).to(dtype)
    grad = torch.randn(2, 3, 7, 4, generator=gen)
    results, kept = {}, []
    for name, fn in (("plain", lambda x, y: torch.matmul(x.float(), y.float())), ("ours", modeling.float32_product)):
        x, y = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append((name, t.dtype, t.shape)) or t,
                                                      lambda t: t):
            out = fn(x, y)
        out.backward(grad)
        results[name] = (out, x.grad, y.grad)
    for got, want in zip(results["ours"], results["plain"]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert {d for n, d, _ in kept if n == "plain"} == {torch.float32}
    assert [(d, shape) for n, d, shape in kept if n == "ours"] == [(dtype, a.shape), (torch.float32, b.shape)]
    assert modeling.float32_product(a.float(), b.float()).equal(torch.matmul(a.float(), b.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D, rot", [(16, 16), (16, 8), (12, 6)])
def test_rotate_gives_autograds_gradient_and_keeps_only_its_angles(dtype, D, rot):
    """``rotate`` with a gradient (``_Rotate``): the output and the gradient of autograd through ``rotate_by`` bit for
    bit, full and partial rotary; backward keeps the cos and sin it was given (the layers of a pass share them) and
    nothing else, as autograd does, but turns the gradient back in one pass where autograd runs the products'."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 9, 3, D, generator=gen) * 3).to(dtype)
    pos = torch.randint(0, 5000, (2, 9), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    angles = modeling.rotary_angles(pos, inv_freq)
    grad = torch.randn(2, 9, 3, D, generator=gen).to(dtype)
    results, kept = {}, collections.defaultdict(list)
    for name, fn in (("autograd", lambda y: modeling.rotate_by(y, *angles)),
                     ("ours", lambda y: modeling.rotate(y, pos, inv_freq, angles))):
        y = x.clone().requires_grad_(True)
        keep = lambda t: kept[name].append(t) or t  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = fn(y)
        out.backward(grad)
        results[name] = out, y.grad
    for got, want in zip(results["ours"], results["autograd"]):
        assert torch.equal(got, want)
    assert sorted(t.data_ptr() for t in kept["ours"]) == sorted(t.data_ptr() for t in angles)


@pytest.mark.requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_window_attention_runs_in_the_memory_efficient_kernel(dtype):
    """The window, memory and sink attention of a prefill, forward and backward, with SDPA allowed only its
    memory-efficient kernel (not the math backend, which keeps every score in float32): it runs, and gives the math
    backend's outputs and gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kw = dict(window_size=8, num_sink_tokens=1, num_key_value_heads=2, memory_size=6)
    mixer = tiny_model(**kw).model.layers[0].mixer.to("cuda", dtype)
    gen = torch.Generator().manual_seed(5)
    B, T, H, Hkv, D = 2, 50, 4, 2, mixer.head_dim
    q, k, v = (torch.randn(B, T, h, D, generator=gen).to("cuda", dtype) for h in (H, Hkv, Hkv))
    pos = torch.arange(T).expand(B, T).cuda()
    retention = torch.randint(0, 4, (B, T, Hkv), generator=gen).float().cuda()
    results = []
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with sdpa_kernel([backend]):
            out = mixer.window_branch(*inputs, pos, None, retention)
            out.float().square().sum().backward()
        results.append([out.detach().float()] + [t.grad.float() for t in inputs])
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.requires_gpu
@pytest.mark.parametrize("case", ["memory_int4_hadamard", "gqa_slots_window", "everything"])
def test_gpu_train_step_and_prefill_never_wait_for_the_device(case):
    """CUDA's own check of test_a_gpu_train_step_and_prefill_never_wait_for_the_device, after one warm-up pass
    (Triton's autotuning synchronises)."""
    model = tiny_model(chunk_size=16, **MIXER_CASES[case]).cuda()
    ids = random_ids(2, 40, seed=2).cuda()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0

    def run():
        model.zero_grad()
        model(ids, attention_mask=mask, use_cache=False).logits.square().sum().backward()
        cache = AarenCache(model.config)
        with torch.no_grad():
            model(ids[:, :20], attention_mask=mask[:, :20], past_key_values=cache, use_cache=True)
            return model(ids[:, 20:], attention_mask=mask, past_key_values=cache, use_cache=True).logits

    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all()


@pytest.mark.requires_gpu
@pytest.mark.parametrize("case", ["decay_input", "memory_int4_hadamard", "memory_shared"])
def test_gpu_decode_step_never_waits_for_the_device(case):
    """CUDA's own check of test_a_decode_step_never_waits_for_the_device: with sync debug mode "error", a decode
    step (Triton's one-token scan, the window step, the memory's update) raises at any read back to the host."""
    model = tiny_model(chunk_size=16, **MIXER_CASES[case]).cuda()  # the Triton kernels' smallest chunk
    ids = random_ids(2, 20, seed=2).cuda()
    cache = AarenCache(model.config)
    with torch.no_grad():
        model(ids[:, :16], past_key_values=cache, use_cache=True)
        model(ids[:, 16:17], past_key_values=cache, use_cache=True)  # Triton's autotuning synchronises, once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(17, 20):
                out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all()


@pytest.mark.requires_gpu
@pytest.mark.parametrize("case", ["paper", "decay_input", "everything", "memory_int4_hadamard", "memory_shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_model_matches_cpu_and_its_own_decode(case, dtype):
    ids = random_ids(2, 61, seed=3)  # several chunks of 16 plus a remainder; "everything" has 64 positions
    model = tiny_model(seed=0, chunk_size=16, **MIXER_CASES[case]).to(dtype)
    with torch.no_grad():  # the same rounded weights in float64, and through the PyTorch ops at dtype, on the CPU
        exact = copy.deepcopy(model).double()(ids).logits
        cpu = model(ids).logits.double()
    gpu = model.to("cuda")
    with torch.no_grad():
        full = gpu(ids.cuda()).logits.double().cpu()
    incremental = incremental_logits(gpu, ids.cuda(), pieces=(40,)).double().cpu()
    # Relative error of the whole logits tensor against float64: the GPU (tf32 dots in fp32, bf16 activations
    # rounded otherwise than on the CPU) must come about as close as the CPU does at the same dtype. Not GPU vs CPU
    # directly: with 4-bit memory codes in bf16 the CPU itself is ~5 % off (an activation that rounds the other way
    # moves a code by a step), ~1 % for the other mixers.
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    bound = 2 * rel(cpu, exact) + (1e-3 if dtype == torch.float32 else 1e-2)
    for name, got in (("prefill", full), ("decode", incremental)):
        assert rel(got, exact) < bound, f"GPU {name}, {dtype}: {rel(got, exact):.2e} (CPU: {rel(cpu, exact):.2e})"
    assert torch.isfinite(full).all()
