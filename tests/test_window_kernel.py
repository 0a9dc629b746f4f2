"""The C decode step (kernels/window/step.c) against its reference, AarenMixer.window_step in PyTorch: the same
output to float rounding and, after every step, the same state bit for bit, memory slots in the same order."""

import shutil

import pytest
import torch

from aaren_hf.kernels import cbuild
from aaren_hf.kernels import window as window_kernel
from aaren_hf.kernels.aaren import step as aaren_kernel
from aaren_hf.modeling_aaren import AarenLayerState
from helpers import MIXER_CASES, kernel_beside_reference, tiny_model

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the mixer runs the PyTorch step (tested in test_model.py)")

WINDOW_CASES = [c for c, kw in MIXER_CASES.items() if kw.get("window_size")]
# the default recipe's kind of memory (rotated 4-bit codes; 8-bit ones) at a real head size
EXTRA = {
    "default_like_d64": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, window_size=5,
                             num_sink_tokens=1, memory_size=6, memory_bits=4, memory_hadamard=True,
                             num_query_slots=2, decay="learned"),
    "int8_d64": dict(hidden_size=128, num_attention_heads=2, window_size=3, num_sink_tokens=2, memory_size=4,
                     memory_bits=8),
}


def test_the_kernel_builds():
    assert window_kernel.library() is not None


@pytest.mark.parametrize("kv_cache_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("case", WINDOW_CASES + list(EXTRA))
def test_kernel_step_equals_pytorch_step(case, kv_cache_dtype, monkeypatch):
    """Two states fed the same tokens one at a time, through the kernel and through the PyTorch step, long enough
    that the memory fills and then trades entries (random retention scores; kv head 0's all tie, so the tie rule
    runs too); from the first steps on (tokens that fill sinks or still see them in the window), and with a row that
    starts with padding."""
    kwargs = {"kv_cache_dtype": kv_cache_dtype, **MIXER_CASES.get(case, {}), **EXTRA.get(case, {})}
    model = tiny_model(**kwargs)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mixer, "retention_proj"):
                layer.mixer.retention_proj.weight[0] = 0.0
    B, T = 2, 40
    x = torch.randn(B, T, model.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 2
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :6] = False  # left padding: row 1's first decode steps are padding, then tokens that fill the sinks
    pos = (mask.long().cumsum(1) - 1).masked_fill(~mask, -1)
    for mixer in [layer.mixer for layer in model.model.layers if layer.mixer.window > 1]:
        # outputs to float32 rounding, every state tensor bit for bit
        with_kernel = kernel_beside_reference(mixer, x, mask, pos, monkeypatch, "window_step_cpu")
        if mixer.memory_size:  # the memory did fill, and trade entries
            assert bool((with_kernel.memory_pos >= 0).all())
            assert int(with_kernel.memory_pos.max()) > mixer.num_sinks + mixer.window + mixer.memory_size


def declines(model, at: int) -> bool:
    """Whether the kernel returns None for a token at position ``at`` after a 6-token prompt (and if so, that it
    left the state's values as they were)."""
    mixer, state = model.model.layers[0].mixer, AarenLayerState()
    x = torch.randn(1, 7, model.config.hidden_size)
    with torch.no_grad():
        mixer(x[:, :6], torch.ones(1, 6, dtype=torch.bool), torch.arange(6).view(1, 6), state)
        q, k, v = mixer.project(x[:, 6:])
        before = {n: t.clone() for n, t in state.tensors().items()}
        pos = torch.tensor([[at]])
        out = window_kernel.window_step_cpu(q, k, v, pos, *mixer.step_angles(pos, None), state, torch.zeros(1, 1, 1),
                                            sinks=mixer.num_sinks, memory_size=mixer.memory_size, bits=None,
                                            rotate=False, scale=mixer.scale)
    if out is None:
        assert all(torch.equal(t, before[n]) for n, t in state.tensors().items())
    return out is None


def test_off_switch_and_unsupported_inputs_take_the_reference(monkeypatch):
    """The kernel returns None and touches nothing for a float16 cache and for a head larger than step.c takes
    (MAX_D = 256). AAREN_BACKEND=torch turns it off."""
    memory = dict(window_size=3, num_sink_tokens=1, memory_size=2)
    assert declines(tiny_model(**memory, kv_cache_dtype="float16"), at=6)
    assert not declines(tiny_model(**memory), at=6)  # what the cases around differ from
    assert declines(tiny_model(hidden_size=512, num_attention_heads=1, **memory), at=6)
    monkeypatch.setenv("AAREN_BACKEND", "torch")
    assert window_kernel.library() is None


def test_without_a_working_compiler_the_reference_runs(monkeypatch, tmp_path):
    """A compiler that fails (here: $CC names nothing) gives a warning that says what to do and no kernel, once
    per kernel; no compiler at all, one warning; the mixer then decodes with its PyTorch steps."""
    monkeypatch.setattr(cbuild, "_loaded", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("AAREN_HF_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="could not build kernels/window/step.c"):
        assert window_kernel.library() is None
    with pytest.warns(UserWarning, match="could not build kernels/aaren/step.c"):
        assert aaren_kernel.library() is None
    assert window_kernel.library() is None and aaren_kernel.library() is None  # tried once: no second warning
    # no compiler at all: one warning for both kernels
    monkeypatch.setattr(cbuild, "_loaded", {})
    monkeypatch.setattr(cbuild, "_said_no_compiler", False)
    monkeypatch.delenv("CC")
    monkeypatch.setattr(cbuild.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match="no C compiler") as said:
        assert window_kernel.library() is None and aaren_kernel.library() is None
    assert len(said) == 1
    model = tiny_model(window_size=3, num_sink_tokens=1, memory_size=2)
    ids = torch.randint(1, 60, (1, 12))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6], use_cache=True)
        cache, steps = out.past_key_values, []
        for t in range(6, 12):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 6:], atol=1e-4, rtol=0)
