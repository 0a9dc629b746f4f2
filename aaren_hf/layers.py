# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""``AarenAttention``: the model's Aaren mixer as a drop-in causal attention layer for any PyTorch model.

The paper ("Attention as an RNN", Feng et al. 2024) swaps softmax attention for Aaren in reinforcement-learning,
event-forecasting and time-series models. This layer is that swap: batch-first ``[B, T, E]`` in, causal ``[B, T, E]``
out, trained in parallel (chunked scan) and run as an RNN with a constant-size state (``step``).

It is not a second implementation: it builds an ``AarenConfig`` from its arguments and runs the ``AarenMixer`` of
``modeling_aaren.py``, initialised by the model's own ``_init_weights``. Options, decay names and initial values
are therefore the config's (see ``AarenConfig``); only the padding mask follows PyTorch (True = padding).
"""

import warnings
from typing import Optional

import torch

from .configuration_aaren import AarenConfig
from .modeling_aaren import AarenLayerState, AarenMixer, AarenPreTrainedModel, positions

# state_dict names of the layer before it wrapped AarenMixer, so checkpoints saved then still load.
_LEGACY_NAMES = {"out_proj.": "mixer.o_proj.", "k_proj.": "mixer.k_proj.", "v_proj.": "mixer.v_proj.",
                 "q_proj.": "mixer.q_proj.", "queries": "mixer.queries", "log_decay": "mixer.log_decay"}


class AarenAttentionState(AarenLayerState):
    """A mixer state plus the real (non-padding) tokens seen per row, whose count is the next token's position."""

    def reset(self):
        super().reset()
        self.real_tokens = None  # [B] int64

    def tensors(self):
        tensors = super().tensors()
        if self.real_tokens is not None:
            tensors["real_tokens"] = self.real_tokens
        return tensors


class AarenAttention(AarenPreTrainedModel):
    r"""Causal Aaren attention over a batch-first sequence.

    Args:
        embed_dim: model width E (input and output); or a whole ``AarenConfig``, as ``from_pretrained`` passes it
            (the other arguments are then unused).
        num_heads: heads; ``embed_dim`` must be a multiple unless ``head_dim`` is given.
        num_query_slots: learned queries per head (J). 1 is the paper's Aaren. J > 1 adds a query projection and
            mixes the slot outputs per token with weights softmax_j(<q_proj(x_t)_h, c_hj> / sqrt(head_dim)).
        decay: the config's names: ``"none"`` (paper: every past token keeps its weight), ``"fixed"``,
            ``"learned"`` or ``"input"``, with the initial rate ``decay_init`` (default 0.01): a token's weight
            shrinks by ``exp(-rate)`` per later step. ``None`` means ``"none"``; a float rate (the old spelling of
            a fixed decay) still works but is deprecated.
        bias: biases on the query, key, value and output projections.
        chunk_size: chunk length of the parallel scan; None keeps the config's default.
        **options: any other ``AarenConfig`` mixer field (``decay_init``, ``window_size``, ``num_sink_tokens``,
            ``window_gate``, ``num_key_value_heads``, ``head_dim``, ``qk_norm``, ...).

    State: an ``AarenAttentionState``, constant in size whatever the length (float32 for the Aaren part).
    """

    def __init__(self, embed_dim, num_heads: Optional[int] = None, num_query_slots: int = 1, decay="none",
                 bias: bool = True, chunk_size: Optional[int] = None, **options):
        config = embed_dim if isinstance(embed_dim, AarenConfig) else self._config(
            embed_dim, num_heads, num_query_slots, decay, bias, chunk_size, **options)
        super().__init__(config)
        self.mixer = AarenMixer(config, layer_idx=0)
        self.post_init()

    @staticmethod
    def _config(embed_dim, num_heads, num_query_slots, decay, bias, chunk_size, **options) -> AarenConfig:
        if decay is None:
            decay = "none"
        elif isinstance(decay, (int, float)) and not isinstance(decay, bool):
            warnings.warn(f"AarenAttention(decay={decay!r}) is deprecated: pass decay='fixed', decay_init={decay!r}",
                          FutureWarning, stacklevel=3)
            decay, options["decay_init"] = "fixed", float(decay)
        if chunk_size is not None:
            options["chunk_size"] = chunk_size
        return AarenConfig(hidden_size=embed_dim, num_attention_heads=num_heads, num_query_slots=num_query_slots,
                           decay=decay, attention_bias=bias, num_hidden_layers=1, **options)

    @property
    def embed_dim(self) -> int:
        return self.config.hidden_size

    def init_state(self) -> AarenAttentionState:
        """The empty state (nothing seen yet); its tensors are sized by the first input."""
        return AarenAttentionState()

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                initial_state: Optional[AarenAttentionState] = None, return_state: bool = False):
        """x [B, T, E] -> y [B, T, E]; y_t depends on x_1..x_t only (and on ``initial_state``).

        padding_mask: optional bool [B, T], True at padding, as PyTorch's ``key_padding_mask``. A padded token leaves
            the state unchanged and its output is 0. (A non-bool mask is refused: HF-style 1 = keep masks would be
            silently inverted.)
        initial_state: a state from an earlier call (``return_state=True``) or ``init_state``; None = empty. It is
            not modified.
        return_state: also return the state after the last token, to continue with ``forward`` or ``step``.
        """
        B, T, E = x.shape
        if E != self.embed_dim:
            raise ValueError(f"expected input [batch, time, {self.embed_dim}], got {tuple(x.shape)}")
        keep = torch.ones(B, T, dtype=torch.bool, device=x.device)
        if padding_mask is not None:
            if padding_mask.dtype != torch.bool or padding_mask.shape != (B, T):
                raise ValueError(
                    f"padding_mask must be a bool tensor of shape {(B, T)} with True at padding (PyTorch's "
                    f"key_padding_mask convention), got {padding_mask.dtype} {tuple(padding_mask.shape)}"
                )
            keep = ~padding_mask
        state = None
        if initial_state is not None or return_state:
            state = initial_state.copy() if initial_state is not None else AarenAttentionState()
        pos, real_tokens = positions(keep, None if state is None else state.real_tokens)
        y = self.mixer(x, keep, pos, state)
        if padding_mask is not None:
            y = y.masked_fill(padding_mask.unsqueeze(-1), 0.0)
        if not return_state:
            return y
        state.real_tokens = real_tokens
        return y, state

    def step(self, x_t: torch.Tensor, state: Optional[AarenAttentionState] = None):
        """One streaming step: x_t [B, E] -> (y_t [B, E], new state). ``state`` None starts from the empty state."""
        y, state = self.forward(x_t.unsqueeze(1), initial_state=state, return_state=True)
        return y.squeeze(1), state

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for key in [k for k in state_dict if k.startswith(prefix)]:
            name = key[len(prefix):]
            for old, new in _LEGACY_NAMES.items():
                if name.startswith(old):
                    state_dict[prefix + new + name[len(old):]] = state_dict.pop(key)
                    break
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        c = self.config
        return (f"embed_dim={c.hidden_size}, num_heads={c.num_attention_heads}, num_query_slots={c.num_query_slots}, "
                f"decay={c.decay!r}, window_size={c.window_size}")


__all__ = ["AarenAttention", "AarenAttentionState"]
