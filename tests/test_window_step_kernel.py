"""The window branch's decode step in Triton (kernels/window/fused_recurrent.py, run here in Triton's interpreter as a
GPU runs it) against its reference, the PyTorch ``AarenMixer.window_step``: the same output to float rounding and,
after every step, the same state bit for bit (window, sinks, the memory's choices, codes and scales), the Aaren
state too (both sides run the same Aaren kernels). The outputs compared are the layer's, after the kernel mixed in
the Aaren branch's."""

import pytest
import torch

import aaren_hf.modeling_aaren as modeling
from aaren_hf import AarenCache
from helpers import (MIXER_CASES, STEP_CASES, distinct_mixers, kernel_beside_reference, recording, step_inputs,
                     tiny_model)

pytest.importorskip("triton")
if modeling.fused_window_step is None:
    pytest.skip("aaren_hf.kernels is not importable", allow_module_level=True)
from aaren_hf.kernels.window import fused_recurrent as step_kernel  # noqa: E402

# one case per feature the kernel branches on (the interpreter is slow): sinks with the gate from the input (the
# Aaren branch mixed in with per-token gates; the other cases' gates are per head), partial rotary, query groups, a
# plain memory in float32 and in 16 bits, 8-bit and 4-bit codes, Hadamard codes, a float16 cache, per-layer windows
# and rotary bases
CASES = ["window_sinks_gate_input", "partial_rotary", "gqa_slots_window", "memory_learned", "memory_kv_bf16", "memory_int8",
         "memory_int4_gqa", "memory_int4_hadamard", "gemma_block", "default_like_d64", "fp16_cache"]
EXTRA = dict(STEP_CASES, fp16_cache=dict(window_size=4, num_sink_tokens=1, memory_size=3, kv_cache_dtype="float16"))


def as_a_gpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(modeling, "launch_bound", lambda device: True)


@pytest.mark.parametrize("case", CASES)
def test_triton_step_equals_pytorch_step(case, monkeypatch):
    """Two states fed the same tokens one at a time, through the kernel and through the PyTorch step, long enough
    that the memory fills and then trades entries (random retention scores; kv head 0's all tie, so the tie rule
    runs too); from the first steps on (tokens that fill sinks or still see them in the window), with a row that
    starts with padding and is padding again for a few steps."""
    as_a_gpu(monkeypatch)
    model = tiny_model(chunk_size=16, **MIXER_CASES.get(case, {}), **EXTRA.get(case, {}))
    x, mask, pos = step_inputs(model, 18, [slice(0, 6), slice(14, 17)])
    for mixer in distinct_mixers(model, lambda mixer: mixer.window > 1):
        with_kernel = kernel_beside_reference(mixer, x, mask, pos, monkeypatch, "fused_window_step")
        if mixer.memory_size:  # the memory did fill, and trade entries
            assert bool((with_kernel.memory_pos >= 0).all())
            assert int(with_kernel.memory_pos.max()) > mixer.num_sinks + mixer.window + mixer.memory_size


@pytest.mark.parametrize("case, dtype", [("default_like_d64", torch.bfloat16), ("default_like_d64", torch.float16),
                                         ("int8_d64", torch.bfloat16)])
def test_triton_step_in_a_16_bit_model(case, dtype, monkeypatch):
    """A 16-bit model, as a GPU serves it: queries, keys and values in 16 bits, the window and sinks stored in them.
    The state bit for bit (the kernel rounds to bfloat16 by integer arithmetic, as torch's cast does: to nearest,
    ties to even), the output to 16-bit rounding (it is cast from a float32 sum taken in another order)."""
    as_a_gpu(monkeypatch)
    model = tiny_model(chunk_size=16, **MIXER_CASES.get(case, {}), **EXTRA.get(case, {})).to(dtype)
    B, T = 2, 18
    x = (torch.randn(B, T, model.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :4] = False
    pos = (mask.long().cumsum(1) - 1).masked_fill(~mask, -1)
    for mixer in distinct_mixers(model):
        kernel_beside_reference(mixer, x, mask, pos, monkeypatch, "fused_window_step", tol=1e-2)


@pytest.mark.requires_gpu
def test_gpu_window_step_equals_pytorch_step(monkeypatch):
    """The compiled kernel on CUDA beside the PyTorch step on CUDA, at the default recipe's mixer shape (SmolLM2's
    heads: 9 query and 3 kv heads of 64; window 64, 1 sink, 448 slots of rotated 4-bit codes), bf16, for enough
    tokens that the memory fills and trades entries: the state bit for bit (rotary products without fma, the codes'
    division and rounding exact, as the reference's on the same GPU), the output to bf16 rounding."""
    kw = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, window_size=64, num_sink_tokens=1,
              memory_size=448, memory_bits=4, memory_hadamard=True, num_query_slots=4, decay="learned",
              kv_cache_dtype="bfloat16")
    model = tiny_model(chunk_size=16, **kw).to("cuda", torch.bfloat16)
    B, T = 2, 560
    x = (torch.randn(B, T, 576, generator=torch.Generator().manual_seed(3)) * 2).to("cuda", torch.bfloat16)
    mask = torch.ones(B, T, dtype=torch.bool, device="cuda")
    mask[1, :7] = False
    pos = (mask.long().cumsum(1) - 1).masked_fill(~mask, -1)
    mixer = model.model.layers[0].mixer
    state = kernel_beside_reference(mixer, x, mask, pos, monkeypatch, "fused_window_step", prompt=40, tol=1e-2)
    # full, and trading: an entry past the first S + M eligible positions took a slot from an earlier one
    assert int(state.memory_pos.min()) >= 0 and int(state.memory_pos.max()) > 1 + 448


def test_triton_step_ranks_and_shares_retention_as_the_pytorch_step(monkeypatch):
    """memory_shared_layer=0, decoded token by token with the kernel and with the PyTorch step: the kernel ranks the
    score itself (the 1/64 grid, layer 0 leaving its best over kv heads in ``shared``, layer 1 ranking by the larger
    of its own and that one), so the layers keep the same tokens with the same scores, bit for bit, and the logits
    are the same to rounding. Layer 0's retention weights are scaled up so that its best decides the later layers'
    memories. Layer 0's state is the same bit for bit; the later layers' inputs differ by the rounding of the
    outputs before them (the kernel sums in another order), so the rest of their state is compared to rounding."""
    as_a_gpu(monkeypatch)
    model = tiny_model(chunk_size=16, **MIXER_CASES["memory_shared"], num_hidden_layers=3)
    with torch.no_grad():
        model.model.layers[0].mixer.retention_proj.weight.mul_(40)
    T, P = 16, 4  # tokens, of which the prompt
    ids = torch.randint(3, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(4))
    served = []
    counted = recording(modeling.fused_window_step, served)
    runs = {}
    for name, step in (("kernel", counted), ("pytorch", None)):
        monkeypatch.setattr(modeling, "fused_window_step", step)
        cache = AarenCache(model.config)
        with torch.no_grad():
            logits = [model(ids[:, :P], past_key_values=cache, use_cache=True).logits]
            logits += [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(P, T)]
        runs[name] = torch.cat(logits, 1), [layer.tensors() for layer in cache.layers]
    assert len(served) == (T - P) * model.config.num_hidden_layers and all(served)
    torch.testing.assert_close(runs["kernel"][0], runs["pytorch"][0], atol=1e-4, rtol=1e-4)
    for i, (got, want) in enumerate(zip(runs["kernel"][1], runs["pytorch"][1])):
        assert got.keys() == want.keys()
        for key in got:
            if i == 0 or key in ("window_score", "window_pos", "memory_pos", "memory_score"):
                assert torch.equal(got[key], want[key]), f"layer {i}: {key}"
            else:
                torch.testing.assert_close(got[key].float(), want[key].float(), atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"layer {i}: {key}: {m}")


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # 3e38 * 64 in the interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_grid_is_round_retention(monkeypatch, dtype):
    """The kernels' ranking grid (``_on_grid``: the step kernel's, and ``fused_round_retention``'s, by which a
    prefill or a train step rounds its scores on a GPU) is ``round_retention``'s PyTorch code bit for bit: ties
    (k + 1/2) / 64 to even either side of zero, scores near 2^16 and 2^17 (whose multiples of 64 lie near 2^22 and
    2^23, where the float32 spacing reaches 1/2 and 1), the largest floats, infinities, NaN, zeros and tiny scores of
    either sign (which round to zeros of their sign); float32 scores and bf16 ones (a learned rule's projection)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from aaren_hf.kernels import fused_round_retention
    from aaren_hf.kernels.memory.evict import _on_grid

    assert step_kernel._on_grid is _on_grid  # one grid for both kernels

    halves = (torch.arange(-40, 40) + 0.5) / 64
    near = torch.tensor([2.0 ** 22 - 1.5, 2.0 ** 22 - 0.5, 2.0 ** 22 + 0.5, 2.0 ** 22 + 1.5, 2.0 ** 23 - 1.5,
                         2.0 ** 23 - 0.5, 2.0 ** 23 + 1.0]) / 64  # ties, scaled by 64, either side of 2^22 and 2^23
    near = torch.cat([near, -near])
    edges = torch.tensor([65535.99, 65536.01, 131071.99, 131072.01, -65536.01, 2.0 ** 20 + 0.5 / 64, 3e38, -3e38,
                          float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30, 0.0, -0.0, 0.5 / 64, -0.5 / 64])
    edges = torch.cat([near, edges])
    x = torch.cat([halves, edges, torch.randn(1500, generator=torch.Generator().manual_seed(0))]).to(dtype)
    x = x.view(3, -1)  # more than one program's block of 1,024
    y = fused_round_retention(x)
    monkeypatch.setattr(modeling, "fused_round_retention", None)
    want = modeling.round_retention(x)
    assert y.dtype == want.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y.view(torch.int32), want.view(torch.int32))
