"""AarenAttention, the drop-in layer around the model's AarenMixer: reference values, causality, padding, streaming
state, gradients, the old decay spelling and state-dict names, and a time-series toy model that learns."""

import math

import pytest
import torch
from torch import nn

import aaren_hf
from aaren_hf import AarenAttention
from aaren_hf.layers import AarenAttentionState
from helpers import one_thread, randomize_options  # noqa: F401 (fixture)
from test_model import reference_mixer

VARIANTS = {
    "paper": {},
    "slots3": dict(num_query_slots=3),
    "learned_decay": dict(decay="learned"),
    "fixed_decay": dict(decay="fixed", decay_init=0.3),
    "slots2_input_decay_nobias": dict(num_query_slots=2, decay="input", bias=False),
    "slots2_window3_sink": dict(num_query_slots=2, decay="learned", window_size=3, num_sink_tokens=1),
    "gqa_window4_input_gate": dict(num_key_value_heads=2, window_size=4, window_gate="input"),
    "window3_sink_memory2": dict(decay="learned", window_size=3, num_sink_tokens=1, memory_size=2),
}
E, H = 16, 4


def make(variant, chunk_size=4, seed=0):
    torch.manual_seed(seed)
    layer = AarenAttention(E, H, chunk_size=chunk_size, **VARIANTS[variant])
    with torch.no_grad():  # projections at the scale of a trained layer, so that every term shows in the outputs
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, 0.4)
    randomize_options(nn.ModuleList([layer]), seed)  # its patterns expect the mixer below a parent module
    return layer.eval()


def inputs(B=3, T=11, seed=1):
    return torch.randn(B, T, E, generator=torch.Generator().manual_seed(seed))


def test_exported_and_paper_form_by_default():
    assert aaren_hf.AarenAttention is AarenAttention and "AarenAttention" in aaren_hf.__all__
    layer = AarenAttention(E, H)
    mixer = layer.mixer
    assert isinstance(mixer, aaren_hf.modeling_aaren.AarenMixer)
    assert layer.config.decay == "none" and layer.config.num_query_slots == 1 and layer.config.window_size == 0
    assert not hasattr(mixer, "q_proj") and not hasattr(mixer, "log_decay")
    assert tuple(mixer.queries.shape) == (H, 1, E // H) and mixer.queries.std() > 0.5  # the model's init: N(0, 1)
    _, state = layer(inputs(B=2), return_state=True)
    assert state.aaren_o.shape == (2, H, E // H) and state.aaren_lse.shape == (2, H)
    assert state.aaren_o.dtype == state.aaren_lse.dtype == torch.float32


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference_softmax_over_the_past(variant):
    layer = make(variant)
    x = inputs()
    pad = torch.zeros(3, 11, dtype=torch.bool)
    pad[1, :3] = True  # left padding
    pad[2, 8:] = True  # right padding
    with torch.no_grad():
        for padding_mask in (None, pad):
            y = layer(x, padding_mask=padding_mask)
            keep = torch.ones_like(pad) if padding_mask is None else ~pad
            want = reference_mixer(layer.mixer, layer.config, x, keep)
            torch.testing.assert_close(y.double()[keep], want[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal(variant, chunk_size):
    layer = make(variant, chunk_size)
    x = inputs()
    with torch.no_grad():
        y = layer(x)
        for t in (0, 4, 9):
            x2 = x.clone()
            x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :]) * 5
            y2 = layer(x2)
            torch.testing.assert_close(y2[:, : t + 1], y[:, : t + 1], atol=1e-5, rtol=0)
            assert (y2[:, t + 1 :] - y[:, t + 1 :]).abs().amax(-1).min() > 1e-4  # later outputs do change


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_padding_mask(variant):
    layer = make(variant)
    x = inputs(B=2, T=10)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[0, :3] = True  # left padding
    pad[1, 7:] = True  # right padding
    if not layer.config.window_size:
        pad[1, [4, 5]] = True  # holes: the window keeps its last entries by index, so only the Aaren state skips them
    with torch.no_grad():
        y = layer(x, padding_mask=pad)
        assert y[pad].abs().max() == 0  # padded positions output 0
        # padding is invisible: same outputs as the sequence without the padded tokens...
        for b in range(2):
            alone = layer(x[b : b + 1, ~pad[b]])
            torch.testing.assert_close(y[b, ~pad[b]], alone[0], atol=1e-5, rtol=0)
        # ...whatever the padded tokens hold
        x2 = x.clone()
        x2[pad] = torch.randn_like(x2[pad]) * 100
        torch.testing.assert_close(layer(x2, padding_mask=pad), y, atol=1e-5, rtol=0)
        assert (layer(x2)[~pad] - y[~pad]).abs().max() > 1e-3  # without the mask they would count
    with pytest.raises(ValueError, match="bool tensor .* True at padding"):
        layer(x, padding_mask=(~pad).long())  # an HF-style 1 = keep mask is refused, not silently inverted
    with pytest.raises(ValueError, match="bool tensor"):
        layer(x, padding_mask=pad[:, :5])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_initial_state_continues_the_sequence(variant):
    layer = make(variant)
    x = inputs()
    with torch.no_grad():
        y = layer(x)
        for split in (1, 5, 8):
            y1, state = layer(x[:, :split], return_state=True)
            kept = state.tensors()
            y2, state2 = layer(x[:, split:], initial_state=state, return_state=True)
            torch.testing.assert_close(torch.cat([y1, y2], 1), y, atol=1e-5, rtol=0)
            assert all(state.tensors()[name] is t for name, t in kept.items())  # the caller's state is unchanged
        _, final = layer(x, return_state=True)
        for name, tensor in final.tensors().items():
            torch.testing.assert_close(state2.tensors()[name], tensor, atol=1e-5, rtol=0)
        # an empty initial state is the same as none
        torch.testing.assert_close(layer(x, initial_state=layer.init_state()), y, atol=1e-6, rtol=0)
        assert (layer(x[:, 5:]) - y[:, 5:]).abs().max() > 1e-3  # without the state the answer differs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_state_continues_twice_the_same(variant):
    """Continuing from a state leaves its values as they were (the decode step writes the memory in place: the
    layer works on a copy), so two continuations from it are the same."""
    layer = make(variant)
    x = inputs(T=14)
    with torch.no_grad():
        _, state = layer(x[:, :9], return_state=True)
        before = {name: t.clone() for name, t in state.tensors().items()}

        def continuation():
            ys, s = [], state
            for t in range(9, 14):
                y, s = layer.step(x[:, t], s)
                ys.append(y)
            return torch.stack(ys)

        first, again = continuation(), continuation()
    assert all(torch.equal(t, before[name]) for name, t in state.tensors().items())
    assert torch.equal(first, again)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_equals_forward(variant):
    layer = make(variant)
    x = inputs()
    pad = torch.zeros(3, 11, dtype=torch.bool)
    pad[1, :4] = True  # a left-padded row
    with torch.no_grad():
        y = layer(x)
        state, outs = None, []
        for t in range(x.shape[1]):
            y_t, state = layer.step(x[:, t], state)
            outs.append(y_t)
        torch.testing.assert_close(torch.stack(outs, 1), y, atol=1e-5, rtol=0)
        # one token at a time with padding, as generate() feeds a left-padded batch
        y_pad = layer(x, padding_mask=pad)
        state, outs = None, []
        for t in range(x.shape[1]):
            y_t, state = layer(x[:, t : t + 1], pad[:, t : t + 1], state, return_state=True)
            outs.append(y_t)
        torch.testing.assert_close(torch.cat(outs, 1), y_pad, atol=1e-5, rtol=0)
        # streaming after a parallel prefill
        _, state = layer(x[:, :6], return_state=True)
        y_t, _ = layer.step(x[:, 6], state)
        torch.testing.assert_close(y_t, y[:, 6], atol=1e-5, rtol=0)
        assert isinstance(state, AarenAttentionState)
        assert state.aaren_o.shape == (x.shape[0], H * layer.config.num_query_slots, E // H)  # constant-size state


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gradients_flow_to_every_parameter_and_the_input(variant):
    layer = make(variant).train()
    x = inputs().requires_grad_(True)
    _, state = layer(inputs(seed=5)[:, :3], return_state=True)
    y, _ = layer(x, initial_state=state, return_state=True)
    (y * torch.randn_like(y)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().max() > 0
    for name, p in layer.named_parameters():
        if not p.requires_grad:
            assert name == "mixer.log_decay" and layer.config.decay == "fixed"  # a fixed decay is not trained
            continue
        if name.startswith("mixer.retention_proj"):  # ranks tokens for the memory (the conversion fits it to the
            continue  # teacher's attention): no gradient through the output
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name


def test_half_precision_input_keeps_fp32_state():
    layer = make("slots2_input_decay_nobias").to(torch.bfloat16)
    x = inputs().to(torch.bfloat16)
    with torch.no_grad():
        y, state = layer(x, return_state=True)
        ref = make("slots2_input_decay_nobias")(inputs())
    assert y.dtype == torch.bfloat16 and state.aaren_o.dtype == state.aaren_lse.dtype == torch.float32
    assert (y.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_old_decay_spellings_map_onto_the_config():
    assert AarenAttention(E, H, decay=None).config.decay == "none"
    with pytest.warns(FutureWarning, match="decay='fixed', decay_init=0.3"):
        layer = AarenAttention(E, H, decay=0.3)
    assert layer.config.decay == "fixed" and layer.config.decay_init == 0.3
    torch.testing.assert_close(layer.mixer.log_decay.exp(), torch.full((H, 1), 0.3))


def test_state_dict_with_the_old_names_loads():
    layer = make("slots3")
    rename = {"mixer.o_proj.": "out_proj.", "mixer.": ""}
    old = {}
    for key, value in layer.state_dict().items():
        new_key = next((key.replace(a, b, 1) for a, b in rename.items() if key.startswith(a)), key)
        old[new_key] = value
    assert "out_proj.weight" in old and "queries" in old
    fresh = AarenAttention(E, H, num_query_slots=3, chunk_size=4)
    fresh.load_state_dict(old)
    with torch.no_grad():
        torch.testing.assert_close(fresh(inputs()), layer(inputs()))


def test_save_pretrained_round_trip(tmp_path):
    layer = make("slots2_window3_sink")
    layer.save_pretrained(tmp_path)
    loaded = AarenAttention.from_pretrained(tmp_path).eval()
    assert loaded.config.window_size == 3 and loaded.config.num_query_slots == 2
    with torch.no_grad():
        torch.testing.assert_close(loaded(inputs()), layer(inputs()))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(embed_dim=10, num_heads=4), "not divisible by num_attention_heads"),
        (dict(embed_dim=16, num_heads=0), "num_attention_heads must be an integer > 0"),
        (dict(embed_dim=16, num_heads=4, num_query_slots=0), "num_query_slots"),
        (dict(embed_dim=16, num_heads=4, decay="exp"), "AarenConfig.decay must be one of"),
        (dict(embed_dim=16, num_heads=4, decay=True), "AarenConfig.decay must be one of"),
        (dict(embed_dim=16, num_heads=4, decay=0.0), "decay_init must be > 0"),
    ],
)
@pytest.mark.filterwarnings("ignore:AarenAttention\\(decay=:FutureWarning")
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as err:
        AarenAttention(**kwargs)
    assert message in str(err.value)


class Block(nn.Module):
    """Pre-norm Transformer block with AarenAttention in place of self-attention."""

    def __init__(self, dim, heads, **kw):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = AarenAttention(dim, heads, **kw)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def test_time_series_toy_model_learns():
    """Next-value forecasting of noisy sines with random frequency and phase: the frequency must be read from the
    past, which only the attention layers can do."""
    torch.manual_seed(0)
    dim = 16
    model = nn.Sequential(nn.Linear(1, dim), Block(dim, 4, decay="learned"), Block(dim, 4, num_query_slots=2),
                          nn.Linear(dim, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)

    def batch(n=32, T=40):
        t = torch.arange(T + 1).float()
        freq = torch.rand(n, 1, generator=gen) * 0.5 + 0.1
        phase = torch.rand(n, 1, generator=gen) * 2 * math.pi
        series = torch.sin(freq * t + phase) + 0.05 * torch.randn(n, T + 1, generator=gen)
        return series[:, :-1, None], series[:, 1:, None]

    x_val, y_val = batch(64)
    with torch.no_grad():
        before = nn.functional.mse_loss(model(x_val), y_val).item()
    for _ in range(40):
        x, y = batch()
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after = nn.functional.mse_loss(model(x_val), y_val).item()
    assert math.isfinite(after) and after < 0.3 * before, (before, after)
