"""AarenAttention, the drop-in layer: causality, padding, streaming state, reference values, gradients, and a
time-series toy model that learns."""

import math

import pytest
import torch
from torch import nn

import aaren_hf
from aaren_hf import AarenAttention
from helpers import brute_force_aaren, one_thread  # noqa: F401 (fixture)

VARIANTS = {
    "paper": {},
    "slots3": dict(num_query_slots=3),
    "learned_decay": dict(decay="learned"),
    "fixed_decay": dict(decay=0.3),
    "slots2_learned_decay_nobias": dict(num_query_slots=2, decay="learned", bias=False),
}
E, H = 16, 4


def make(variant, chunk_size=4, seed=0):
    torch.manual_seed(seed)
    layer = AarenAttention(E, H, chunk_size=chunk_size, **VARIANTS[variant])
    if layer.log_decay is not None and isinstance(layer.log_decay, nn.Parameter):
        with torch.no_grad():  # learned rates away from their initial value, different per head and slot
            layer.log_decay.uniform_(math.log(0.05), math.log(0.5))
    return layer


def inputs(B=3, T=11, seed=1):
    return torch.randn(B, T, E, generator=torch.Generator().manual_seed(seed))


def test_exported_and_paper_form_by_default():
    assert aaren_hf.AarenAttention is AarenAttention and "AarenAttention" in aaren_hf.__all__
    layer = AarenAttention(E, H)
    assert layer.num_slots == 1 and layer.q_proj is None and layer.log_decay is None
    assert tuple(layer.queries.shape) == (H, 1, E // H)
    o, lse = layer.init_state(2)
    assert o.shape == (2, H, E // H) and lse.shape == (2, H) and o.dtype == lse.dtype == torch.float32
    assert torch.isinf(lse).all() and (lse < 0).all()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference_softmax_over_the_past(variant):
    layer = make(variant)
    x = inputs()
    B, T, _ = x.shape
    J, D = layer.num_slots, layer.head_dim
    with torch.no_grad():
        y = layer(x)
        k = layer.k_proj(x).view(B, T, H, D).double()
        v = layer.v_proj(x).view(B, T, H, D).double()
        c = layer.queries.double()
        s = (torch.einsum("bthd,hjd->bthj", k, c) / math.sqrt(D)).reshape(B, T, H * J)
        g = None
        if layer.log_decay is not None:
            g = (-layer.log_decay.double().exp()).reshape(1, 1, H * J).expand(B, T, H * J)
        o, _ = brute_force_aaren(s, v.repeat_interleave(J, dim=2), g)
        o = o.view(B, T, H, J, D)
        if J > 1:
            q = layer.q_proj(x).view(B, T, H, D).double()
            o = (torch.softmax(torch.einsum("bthd,hjd->bthj", q, c) / math.sqrt(D), -1).unsqueeze(-1) * o).sum(3)
        else:
            o = o[:, :, :, 0]
        want = nn.functional.linear(o.reshape(B, T, E), layer.out_proj.weight.double(),
                                    None if layer.out_proj.bias is None else layer.out_proj.bias.double())
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)


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
            torch.testing.assert_close(y2[:, : t + 1], y[:, : t + 1], atol=1e-6, rtol=0)
            assert (y2[:, t + 1 :] - y[:, t + 1 :]).abs().amax(-1).min() > 1e-4  # later outputs do change


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_padding_mask(variant):
    layer = make(variant)
    x = inputs(B=2, T=10)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[0, :3] = True  # left padding
    pad[1, [4, 5, 9]] = True  # holes and a right pad
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
            y2, state2 = layer(x[:, split:], initial_state=state, return_state=True)
            torch.testing.assert_close(torch.cat([y1, y2], 1), y, atol=1e-5, rtol=0)
        _, final = layer(x, return_state=True)
        torch.testing.assert_close(state2[0], final[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(state2[1], final[1], atol=1e-5, rtol=0)
        # an empty initial state is the same as none
        torch.testing.assert_close(layer(x, initial_state=layer.init_state(x.shape[0])), y, atol=1e-6, rtol=0)
        assert (layer(x[:, 5:]) - y[:, 5:]).abs().max() > 1e-3  # without the state the answer differs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_equals_forward(variant):
    layer = make(variant)
    x = inputs()
    with torch.no_grad():
        y = layer(x)
        state, outs = None, []
        for t in range(x.shape[1]):
            y_t, state = layer.step(x[:, t], state)
            outs.append(y_t)
        torch.testing.assert_close(torch.stack(outs, 1), y, atol=1e-5, rtol=0)
        # streaming after a parallel prefill
        _, state = layer(x[:, :6], return_state=True)
        y_t, _ = layer.step(x[:, 6], state)
        torch.testing.assert_close(y_t, y[:, 6], atol=1e-5, rtol=0)
        assert state[0].shape == (x.shape[0], H * layer.num_slots, E // H)  # constant-size state


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gradients_flow_to_every_parameter_and_the_input(variant):
    layer = make(variant)
    x = inputs().requires_grad_(True)
    _, state = layer(inputs(seed=5)[:, :3], return_state=True)
    y, _ = layer(x, initial_state=state, return_state=True)
    (y * torch.randn_like(y)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().max() > 0
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name
    if VARIANTS[variant].get("decay", None) not in (None, "learned"):
        assert "log_decay" not in dict(layer.named_parameters())  # a fixed decay is not trained


def test_half_precision_input_keeps_fp32_state():
    layer = make("slots2_learned_decay_nobias").to(torch.bfloat16)
    x = inputs().to(torch.bfloat16)
    with torch.no_grad():
        y, (o, lse) = layer(x, return_state=True)
        ref = make("slots2_learned_decay_nobias")(inputs())
    assert y.dtype == torch.bfloat16 and o.dtype == lse.dtype == torch.float32
    assert (y.float() - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(embed_dim=10, num_heads=4), "must be a positive multiple of num_heads"),
        (dict(embed_dim=16, num_heads=0), "must be a positive multiple of num_heads"),
        (dict(embed_dim=16, num_heads=4, num_query_slots=0), "num_query_slots"),
        (dict(embed_dim=16, num_heads=4, decay="exp"), "decay must be None, 'learned' or a float rate > 0"),
        (dict(embed_dim=16, num_heads=4, decay=0.0), "decay must be None, 'learned' or a float rate > 0"),
        (dict(embed_dim=16, num_heads=4, decay=True), "decay must be None, 'learned' or a float rate > 0"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=None) as err:
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
