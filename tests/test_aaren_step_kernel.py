"""The C decode step of the Aaren branch (kernels/aaren/step.c) against its reference, the PyTorch decode path of
AarenMixer.aaren_output: the same output and state to float rounding after every step, padding included, for
every mixer with an Aaren branch."""

import shutil

import pytest
import torch

from aaren_hf.kernels.aaren import step as aaren_kernel
from aaren_hf.modeling_aaren import AarenLayerState
from helpers import MIXER_CASES, kernel_beside_reference, tiny_model

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the mixer runs the PyTorch step (tested in test_model.py)")

EXTRA = {  # the default recipe's Aaren branch (4 slots, learned decay, GQA) at its head size
    "default_like_d64": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, window_size=5,
                             num_sink_tokens=1, memory_size=6, memory_bits=4, memory_hadamard=True,
                             num_query_slots=4, decay="learned"),
}


def test_the_kernel_builds():
    assert aaren_kernel.library() is not None


@pytest.mark.parametrize("case", list(MIXER_CASES) + list(EXTRA))
def test_kernel_step_equals_pytorch_step(case, monkeypatch):
    """Two states fed the same tokens, through the kernel and through the PyTorch step; row 1 is padding for a few
    decode steps (the state must not move), scores large enough that a decay or a missed stabiliser shows."""
    model = tiny_model(**MIXER_CASES.get(case, {}), **EXTRA.get(case, {}))
    B, T = 2, 30
    x = torch.randn(B, T, model.config.hidden_size, generator=torch.Generator().manual_seed(7)) * 3
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 5:9] = False
    pos = (mask.long().cumsum(1) - 1).masked_fill(~mask, -1)
    mixers = [layer.mixer for layer in model.model.layers if layer.mixer.aaren_branch]
    assert mixers
    for mixer in mixers:
        # expf/logf and dot products in another order: the Aaren state to float rounding; the rest (ranked by the
        # scores the kernel hands on) bit for bit
        kernel_beside_reference(mixer, x, mask, pos, monkeypatch, "aaren_step_cpu", rounded=("aaren_o", "aaren_lse"))


def test_padding_leaves_the_state_as_it_was():
    """A padding token (mask False) returns the state unchanged, bit for bit, and its scores are -inf."""
    model = tiny_model(num_query_slots=2, decay="learned")
    mixer, state = model.model.layers[0].mixer, AarenLayerState()
    x = torch.randn(1, 5, model.config.hidden_size)
    with torch.no_grad():
        mixer(x[:, :4], torch.ones(1, 4, dtype=torch.bool), torch.arange(4).view(1, 4), state)
        before = state.aaren_o.clone(), state.aaren_lse.clone()
        q, k, v = mixer.project(x[:, 4:])
        _, s = aaren_kernel.aaren_step_cpu(q, k, v, torch.zeros(1, 1, dtype=torch.bool), mixer.queries,
                                           mixer.log_decay, None, state, decay="learned", scale=mixer.scale)
    assert torch.equal(state.aaren_o, before[0]) and torch.equal(state.aaren_lse, before[1])
    assert bool((s == float("-inf")).all())


def test_unsupported_inputs_take_the_reference(monkeypatch):
    """bfloat16 inputs and more than 64 slots are not the kernel's: None and the state untouched;
    AAREN_BACKEND=torch turns it off."""
    model = tiny_model(num_query_slots=2)
    mixer, state = model.model.layers[0].mixer, AarenLayerState()
    x = torch.randn(1, 5, model.config.hidden_size)
    with torch.no_grad():
        mixer(x[:, :4], torch.ones(1, 4, dtype=torch.bool), torch.arange(4).view(1, 4), state)
        before = state.aaren_o
        q, k, v = mixer.project(x[:, 4:])
        assert aaren_kernel.aaren_step_cpu(q, k.bfloat16(), v, torch.ones(1, 1, dtype=torch.bool), mixer.queries,
                                           None, None, state, decay="none", scale=mixer.scale) is None
    assert state.aaren_o is before
    # more slots than step.c takes (MAX_J = 64): it declines, and the model decodes with the PyTorch step
    many = tiny_model(hidden_size=16, num_attention_heads=2, num_query_slots=65)
    mixer, state = many.model.layers[0].mixer, AarenLayerState()
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        mixer(x[:, :4], torch.ones(1, 4, dtype=torch.bool), torch.arange(4).view(1, 4), state)
        q, k, v = mixer.project(x[:, 4:])
        assert aaren_kernel.aaren_step_cpu(q, k, v, torch.ones(1, 1, dtype=torch.bool), mixer.queries, None, None,
                                           state, decay="none", scale=mixer.scale) is None
        ids = torch.randint(1, 60, (1, 7))
        out = many(ids[:, :4], use_cache=True)
        steps = [many(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True).logits
                 for t in range(4, 7)]
        torch.testing.assert_close(steps[-1][:, -1], many(ids).logits[:, -1], atol=1e-4, rtol=0)
    monkeypatch.setenv("AAREN_BACKEND", "torch")
    assert aaren_kernel.library() is None
