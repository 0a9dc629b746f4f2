# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""``AarenAttention``: Aaren as a drop-in causal attention layer for any PyTorch model.

The paper ("Attention as an RNN", Feng et al. 2024) swaps softmax attention for Aaren in reinforcement-learning,
event-forecasting and time-series models. This layer is that swap: batch-first ``[B, T, E]`` in, causal ``[B, T, E]``
out, trained in parallel (chunked scan) and run as an RNN with a constant-size state (``step``).

Per head h and query slot j, a learned query c_hj scores each key: s_t = <k_t, c_hj> / sqrt(head_dim); the output
at t is the softmax(s)-weighted mean of the values v_1..v_t. The paper's form (the default) is one slot per head and
no decay.
"""

import math
from typing import Optional, Tuple, Union

import torch
from torch import nn

from .aaren_scan import chunk_aaren_torch, empty_state, recurrent_aaren_torch

try:  # Triton kernels when available; they share the signature of the PyTorch ops.
    from .kernels import chunk_aaren, fused_recurrent_aaren
except ImportError:
    chunk_aaren, fused_recurrent_aaren = chunk_aaren_torch, recurrent_aaren_torch

State = Tuple[torch.Tensor, torch.Tensor]  # (o [B, H*J, head_dim], lse [B, H*J]), float32


class AarenAttention(nn.Module):
    r"""Causal Aaren attention over a batch-first sequence.

    Args:
        embed_dim: model width E (input and output).
        num_heads: heads; must divide ``embed_dim``.
        num_query_slots: learned queries per head (J). 1 is the paper's Aaren. J > 1 adds a query projection and
            mixes the slot outputs per token with weights softmax_j(<q_proj(x_t)_h, c_hj> / sqrt(head_dim)).
        decay: ``None`` (paper: every past token keeps its weight), ``"learned"`` (a learned per-head, per-slot
            rate, starting at 0.01), or a float rate ``lam > 0`` (fixed): the weight of a token shrinks by
            ``exp(-lam)`` per later step, which gives the layer a sense of recency.
        bias: biases on the key, value, query and output projections.
        chunk_size: chunk length of the parallel scan (memory O(B * T * heads * chunk_size)).

    State: ``(o, lse)`` float32 tensors of shapes ``[B, H*J, head_dim]`` and ``[B, H*J]``, whatever the length.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_query_slots: int = 1,
        decay: Union[None, str, float] = None,
        bias: bool = True,
        chunk_size: int = 64,
    ):
        super().__init__()
        if num_heads <= 0 or embed_dim <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        if num_query_slots < 1 or chunk_size < 1:
            raise ValueError(f"num_query_slots ({num_query_slots}) and chunk_size ({chunk_size}) must be >= 1")
        fixed = isinstance(decay, (int, float)) and not isinstance(decay, bool)
        if not (decay is None or decay == "learned" or (fixed and decay > 0)):
            raise ValueError(f"decay must be None, 'learned' or a float rate > 0, got {decay!r}")
        self.embed_dim, self.num_heads, self.num_slots = embed_dim, num_heads, num_query_slots
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim**-0.5
        self.chunk_size = chunk_size
        H, J, D = num_heads, num_query_slots, self.head_dim

        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias) if J > 1 else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.queries = nn.Parameter(torch.randn(H, J, D))
        if decay == "learned":
            self.log_decay = nn.Parameter(torch.full((H, J), math.log(0.01)))
        elif decay is not None:
            self.register_buffer("log_decay", torch.full((H, J), math.log(float(decay))))
        else:
            self.log_decay = None

    def init_state(self, batch: int, device=None) -> State:
        """The empty state (nothing seen yet) for ``batch`` sequences."""
        device = device if device is not None else self.queries.device
        return empty_state(batch, self.num_heads * self.num_slots, self.head_dim, device)

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: Optional[torch.Tensor] = None,
        initial_state: Optional[State] = None,
        return_state: bool = False,
    ):
        """x [B, T, E] -> y [B, T, E]; y_t depends on x_1..x_t only (and on ``initial_state``).

        padding_mask: optional bool [B, T], True at padding, as PyTorch's ``key_padding_mask``. A padded token leaves
            the state unchanged and its output is 0. (A non-bool mask is refused: HF-style 1 = keep masks would be
            silently inverted.)
        initial_state: a state from an earlier call (``return_state=True``) or ``init_state``; None = empty.
        return_state: also return the state after the last token, to continue with ``forward`` or ``step``.
        """
        B, T, E = x.shape
        H, J, D = self.num_heads, self.num_slots, self.head_dim
        if E != self.embed_dim:
            raise ValueError(f"expected input [batch, time, {self.embed_dim}], got {tuple(x.shape)}")
        k = self.k_proj(x).view(B, T, H, D)
        v = self.v_proj(x).view(B, T, H, 1, D).expand(B, T, H, J, D).reshape(B, T, H * J, D)
        s = torch.einsum("bthd,hjd->bthj", k.float(), self.queries.float()).reshape(B, T, H * J) * self.scale
        g = None
        if self.log_decay is not None:
            g = (-self.log_decay.float().exp()).reshape(1, 1, H * J).expand(B, T, H * J)
        if padding_mask is not None:
            if padding_mask.dtype != torch.bool or padding_mask.shape != (B, T):
                raise ValueError(
                    f"padding_mask must be a bool tensor of shape {(B, T)} with True at padding (PyTorch's "
                    f"key_padding_mask convention), got {padding_mask.dtype} {tuple(padding_mask.shape)}"
                )
            pad = padding_mask.unsqueeze(-1)
            s = s.masked_fill(pad, float("-inf"))  # a padded token adds nothing to the softmax
            g = None if g is None else g.masked_fill(pad, 0.0)  # and does not age the state
        if T == 1:
            o, state = fused_recurrent_aaren(s, v, g, initial_state, return_state)
        else:
            o, state = chunk_aaren(s, v, g, initial_state, return_state, chunk_size=self.chunk_size)
        o = o.float().view(B, T, H, J, D)
        if J > 1:
            q = self.q_proj(x).view(B, T, H, D).float()
            weights = torch.softmax(torch.einsum("bthd,hjd->bthj", q, self.queries.float()) * self.scale, -1)
            o = (weights.unsqueeze(-1) * o).sum(3)
        y = self.out_proj(o.reshape(B, T, E).to(x.dtype))
        if padding_mask is not None:
            y = y.masked_fill(padding_mask.unsqueeze(-1), 0.0)
        return (y, state) if return_state else y

    def step(self, x_t: torch.Tensor, state: Optional[State] = None) -> Tuple[torch.Tensor, State]:
        """One streaming step: x_t [B, E] -> (y_t [B, E], new state). ``state`` None starts from the empty state."""
        y, state = self.forward(x_t.unsqueeze(1), initial_state=state, return_state=True)
        return y.squeeze(1), state

    def extra_repr(self) -> str:
        decay = None
        if self.log_decay is not None:
            decay = "learned" if isinstance(self.log_decay, nn.Parameter) else "fixed"
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_query_slots={self.num_slots}, decay={decay}"


__all__ = ["AarenAttention"]
