# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Teacher adapters: map a pretrained causal LM (Llama family, Gemma-3, GPT-2, GPT-NeoX) onto an Aaren model.

Three public entry points work for every supported teacher:

- :func:`aaren_config_from_teacher` copies the teacher's dimensions and block layout into an :class:`AarenConfig`,
  and takes the mixer options (slots, decay, window, ...) as keyword arguments.
- :func:`map_teacher_state_dict` returns every Aaren tensor that comes from the teacher, under the Aaren names
  (embeddings, norms, k/v/o and q projections, q/k norms, rotary inverse frequencies, MLPs, LM head). The mixer's
  new parameters (queries, decay, gates) are absent: the conversion initialises them.
- :func:`teacher_layers` and :func:`teacher_qkv` give the conversion access to each teacher layer: its attention
  module, its norms, and its per-head queries, keys and values (before rotary embeddings).

One small adapter class per family; ``llama``, ``mistral``, ``qwen2`` and ``qwen3`` share the Llama one (they differ
only in biases and Qwen3's q/k norms).

Hybrid teachers (Gemma-3: five local sliding-window layers for every global one) convert only their global layers
by default: the local layers stay exact sliding-window attention with the teacher's window and rotary base
(:func:`layer_types_for`, :func:`teacher_attention_types`).
"""

from __future__ import annotations

import importlib
import inspect
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from aaren_hf.configuration_aaren import AarenConfig
from aaren_hf.modeling_aaren import AarenForCausalLM

__all__ = [
    "RECENCY_SCORE_SPAN",
    "SUPPORTED_TEACHERS",
    "TeacherLayer",
    "aaren_config_from_teacher",
    "expected_teacher_shapes",
    "get_adapter",
    "map_teacher_state_dict",
    "teacher_layers",
    "teacher_qkv",
    "teacher_qkv_weights",
    "teacher_attention_scale",
    "teacher_attention_types",
    "teacher_rotary_inv_freq",
    "unchanged_layers",
]

SUPPORTED_TEACHERS = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt2", "gpt_neox")

MIXER_OPTIONS = ("num_query_slots", "decay", "decay_init", "window_size", "num_sink_tokens", "window_gate",
                 "window_gate_init", "memory_size", "memory_rule", "memory_recency", "memory_shared_layer",
                 "kv_cache_dtype", "memory_bits", "memory_hadamard", "convert_layers", "chunk_size")


@dataclass
class TeacherLayer:
    """One decoder layer of a teacher and the parts the conversion needs.

    ``attention`` is called with the output of ``input_norm``; ``post_attention_norm`` is the MLP's norm
    (applied to the residual stream after attention, or, with a parallel residual, to the layer input)."""

    index: int
    module: nn.Module
    attention: nn.Module
    input_norm: nn.Module
    post_attention_norm: nn.Module
    mlp: nn.Module
    family: str


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy: the Aaren model must never share storage with the teacher."""
    return tensor.detach().clone().contiguous()


def _rope_parameters(cfg) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) of a rotary teacher, as its own rotary embedding uses them.

    transformers' Llama-style "default" rope ignores ``partial_rotary_factor`` while GPT-NeoX and the scaled rope
    types honour it, so the rotary width is measured on the teacher's own RotaryEmbedding class (cheap: it only
    computes ``inv_freq``), falling back to the config's ``rope_parameters``."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per-layer-type dicts
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", 1.0))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rotary = _rotary_class(cfg)
    if rotary is not None:
        try:
            rotary_dim = 2 * rotary(cfg).inv_freq.shape[0]
        except Exception:  # unusual configs: trust the config
            rotary_dim = None
        if rotary_dim:
            partial = rotary_dim / head_dim
            if int(head_dim * partial) != rotary_dim:  # float round-off: AarenConfig truncates head_dim * factor
                partial = math.nextafter(partial, 2.0)
    return theta, partial


def _rotary_class(cfg):
    try:
        module = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    except ImportError:
        return None
    names = [name for name in dir(module) if name.endswith("RotaryEmbedding") and not name.startswith("_")]
    return getattr(module, names[0]) if len(names) == 1 else None


def _special_ids(cfg) -> dict:
    return {name: getattr(cfg, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _linear_out(prefix: str, linear: nn.Linear, bias: bool) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.weight": _clone(linear.weight)}
    if bias:
        if linear.bias is None:
            raise ValueError(f"the Aaren config expects a bias on {prefix}, but the teacher's layer has none")
        out[f"{prefix}.bias"] = _clone(linear.bias)
    return out


def _qkv_out(prefix: str, pairs, aaren: AarenConfig, layer: int) -> dict[str, torch.Tensor]:
    """The student's q/k/v projections from the teacher's (weight [out, in], bias) pairs in q, k, v order; q only
    where the layer reads per-token queries."""
    out = {}
    for name, (weight, bias) in zip(("q_proj", "k_proj", "v_proj"), pairs):
        if name == "q_proj" and not aaren.layer_uses_query_projection(layer):
            continue
        out[f"{prefix}.{name}.weight"] = _clone(weight)
        if aaren.attention_bias:
            if bias is None:
                raise ValueError(f"the Aaren config expects a bias on {prefix}.{name}, but the teacher has none")
            out[f"{prefix}.{name}.bias"] = _clone(bias)
    return out


def _norm_out(prefix: str, norm: nn.Module, aaren: AarenConfig) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.weight": _clone(norm.weight)}
    if aaren.norm_type == "layernorm":
        out[f"{prefix}.bias"] = _clone(norm.bias)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Llama family: llama, mistral, qwen2, qwen3 (and SmolLM2, which is llama)
# ----------------------------------------------------------------------------------------------------------------


class LlamaAdapter:
    """``model.embed_tokens``, ``model.layers[i].self_attn.{q,k,v,o}_proj``, gated MLP, RMSNorm, ``model.norm``."""

    family = "llama"

    @staticmethod
    def config_kwargs(cfg) -> dict:
        model_type = cfg.model_type
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta, partial = _rope_parameters(cfg)
        if model_type == "qwen2":  # q/k/v biases are hard-wired in Qwen2Attention, o_proj has none
            attention_bias, attention_out_bias = True, False
        else:  # llama, qwen3: config.attention_bias on all four; mistral: no biases
            attention_bias = bool(getattr(cfg, "attention_bias", False))
            attention_out_bias = attention_bias
        return dict(
            hidden_act=cfg.hidden_act,
            intermediate_size=cfg.intermediate_size,
            num_key_value_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            norm_type="rmsnorm",
            rms_norm_eps=float(cfg.rms_norm_eps),
            mlp_type="gated",
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            attention_bias=attention_bias,
            attention_out_bias=attention_out_bias,
            qk_norm=model_type == "qwen3",
            parallel_residual=False,
            position_embedding_type="none",  # no table: the student's context is not capped (config default)
            rope_theta=theta,
            partial_rotary_factor=partial,
        )

    @staticmethod
    def base(model: nn.Module) -> nn.Module:
        return model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model

    mlp_norm = "post_attention_layernorm"  # the norm in front of the MLP

    @classmethod
    def layers(cls, model: nn.Module) -> list[TeacherLayer]:
        return [
            TeacherLayer(i, layer, layer.self_attn, layer.input_layernorm, getattr(layer, cls.mlp_norm),
                         layer.mlp, cls.family)
            for i, layer in enumerate(cls.base(model).layers)
        ]

    @staticmethod
    def qkv(attention: nn.Module, x: torch.Tensor):
        head_dim = attention.head_dim
        shape = (*x.shape[:-1], -1, head_dim)
        q = attention.q_proj(x).view(shape)
        k = attention.k_proj(x).view(shape)
        v = attention.v_proj(x).view(shape)
        if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm per head, before rotary
            q, k = attention.q_norm(q), attention.k_norm(k)
        return q, k, v

    @staticmethod
    def qkv_weights(attention: nn.Module):
        return [(proj.weight, proj.bias) for proj in (attention.q_proj, attention.k_proj, attention.v_proj)]

    @classmethod
    def state_dict(cls, model: nn.Module, aaren: AarenConfig) -> dict[str, torch.Tensor]:
        base = cls.base(model)
        out = {"model.embed_tokens.weight": _clone(base.embed_tokens.weight)}
        out.update(_norm_out("model.norm", base.norm, aaren))
        for layer in cls.layers(model):
            p = f"model.layers.{layer.index}"
            attn = layer.attention
            out.update(_norm_out(f"{p}.input_layernorm", layer.input_norm, aaren))
            out.update(_norm_out(f"{p}.post_attention_layernorm", layer.post_attention_norm, aaren))
            out.update(_qkv_out(f"{p}.mixer", cls.qkv_weights(attn), aaren, layer.index))
            out.update(_linear_out(f"{p}.mixer.o_proj", attn.o_proj, aaren.attention_out_bias))
            if aaren.qk_norm:
                out[f"{p}.mixer.q_norm.weight"] = _clone(attn.q_norm.weight)
                out[f"{p}.mixer.k_norm.weight"] = _clone(attn.k_norm.weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                out.update(_linear_out(f"{p}.mlp.{name}", getattr(layer.mlp, name), aaren.mlp_bias))
        return out

    @classmethod
    def rotary(cls, model: nn.Module) -> nn.Module | None:
        return getattr(cls.base(model), "rotary_emb", None)


# ----------------------------------------------------------------------------------------------------------------
# Gemma-3 (text): hybrid local/global attention, sandwich norms, (1 + weight) RMSNorm, scaled embeddings
# ----------------------------------------------------------------------------------------------------------------


class Gemma3Adapter(LlamaAdapter):
    """``Gemma3ForCausalLM`` (model_type ``gemma3_text``). The block is Llama's with: RMSNorms that scale by
    (1 + weight), norms after attention and after the MLP (``post_attention_layernorm``,
    ``post_feedforward_layernorm``; the MLP's input norm is ``pre_feedforward_layernorm``), q/k RMSNorms, embeddings
    times sqrt(hidden), a GELU-tanh gated MLP, scores scaled by ``query_pre_attn_scalar ** -0.5``, and per layer type
    a rotary base (local 10K, global 1M) and the local layers' sliding window. Each is an AarenConfig field.

    The weights are mapped by renaming the teacher's own state dict (:data:`RENAMES`); every teacher tensor must be
    used, so a new tensor in a future Gemma release is an error here, not a silently dropped weight."""

    family = "gemma3"
    # teacher name (below model.layers.{i}.) -> student name (below model.layers.{i}.)
    RENAMES = {
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "post_mixer_layernorm.weight",
        "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
        "post_feedforward_layernorm.weight": "post_mlp_layernorm.weight",
        "self_attn.q_proj.weight": "mixer.q_proj.weight",
        "self_attn.k_proj.weight": "mixer.k_proj.weight",
        "self_attn.v_proj.weight": "mixer.v_proj.weight",
        "self_attn.o_proj.weight": "mixer.o_proj.weight",
        "self_attn.q_proj.bias": "mixer.q_proj.bias",
        "self_attn.k_proj.bias": "mixer.k_proj.bias",
        "self_attn.v_proj.bias": "mixer.v_proj.bias",
        "self_attn.o_proj.bias": "mixer.o_proj.bias",
        "self_attn.q_norm.weight": "mixer.q_norm.weight",
        "self_attn.k_norm.weight": "mixer.k_norm.weight",
        "mlp.gate_proj.weight": "mlp.gate_proj.weight",
        "mlp.up_proj.weight": "mlp.up_proj.weight",
        "mlp.down_proj.weight": "mlp.down_proj.weight",
    }

    @staticmethod
    def config_kwargs(cfg) -> dict:
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, name, None) is not None:
                raise ValueError(f"Gemma teachers with {name}={getattr(cfg, name)} are not supported: Aaren has no "
                                 "logit soft-capping (Gemma-3 checkpoints set it to None)")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("Gemma teachers with use_bidirectional_attention=True (encoders) are not supported: "
                             "Aaren is causal")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        types = teacher_attention_types(cfg)
        thetas = [_gemma_rope(cfg, t)["rope_theta"] for t in types]
        kwargs = dict(
            hidden_act=cfg.hidden_activation,
            intermediate_size=cfg.intermediate_size,
            num_key_value_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            norm_type="rmsnorm",
            rms_norm_eps=float(cfg.rms_norm_eps),
            rms_norm_unit_offset=True,
            post_norms=True,
            embed_scale=float(cfg.hidden_size**0.5),
            query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
            mlp_type="gated",
            mlp_bias=False,
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            attention_out_bias=bool(getattr(cfg, "attention_bias", False)),
            qk_norm=True,
            parallel_residual=False,
            position_embedding_type="none",
            rope_theta=float(_gemma_rope(cfg, "full_attention")["rope_theta"]),
            partial_rotary_factor=1.0,
        )
        if len(set(thetas)) > 1:
            kwargs["rope_theta_per_layer"] = [float(t) for t in thetas]
        if "sliding_attention" in types:
            kwargs["sliding_window"] = int(cfg.sliding_window)
        return kwargs

    mlp_norm = "pre_feedforward_layernorm"
    # base, layers, qkv (q/k norms before rotary, as Qwen3's) and qkv_weights: LlamaAdapter's

    @classmethod
    def state_dict(cls, model: nn.Module, aaren: AarenConfig) -> dict[str, torch.Tensor]:
        base = cls.base(model)
        out, unused = {}, []
        for name, tensor in base.state_dict().items():
            if name == "embed_tokens.weight":
                out["model.embed_tokens.weight"] = _clone(tensor)
            elif name == "norm.weight":
                out["model.norm.weight"] = _clone(tensor)
            elif name.startswith("layers.") and name.split(".", 2)[2] in cls.RENAMES:
                _, index, rest = name.split(".", 2)
                target = cls.RENAMES[rest]
                if target == "mixer.q_proj.weight" or target == "mixer.q_proj.bias":
                    if not aaren.layer_uses_query_projection(int(index)):
                        continue  # the paper's form reads no per-token query
                out[f"model.layers.{index}.{target}"] = _clone(tensor)
            elif "rotary_emb" not in name:  # inv_freq buffers: mapped per layer by map_teacher_state_dict
                unused.append(name)
        if unused:
            raise ValueError(f"Gemma-3 teacher tensors with no place in the Aaren model: {unused[:5]}; this adapter "
                             "knows Gemma3ForCausalLM as of transformers 5.23")
        return out

    @classmethod
    def rotary(cls, model: nn.Module, layer: int | None = None):
        """The rotary embedding of layer ``layer``'s type (default: the global layers'), as (inv_freq, scaling)."""
        rotary = cls.base(model).rotary_emb
        kind = "full_attention" if layer is None else teacher_attention_types(model.config)[layer]
        return getattr(rotary, f"{kind}_inv_freq"), float(getattr(rotary, f"{kind}_attention_scaling", 1.0))


def _gemma_rope(cfg, layer_type: str) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params.get(layer_type), dict):
        return params[layer_type]
    if layer_type == "sliding_attention" and getattr(cfg, "rope_local_base_freq", None):  # older configs
        return {"rope_theta": cfg.rope_local_base_freq}
    return {"rope_theta": params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))}


def teacher_attention_types(teacher_config) -> list[str]:
    """Per layer of the teacher, "sliding_attention" (a local window, exact and bounded already) or
    "full_attention" (global: what a constant-memory student must replace). Only Gemma-3's local layers count as
    sliding here; every layer of the other families is global."""
    cfg = _config_of(teacher_config)
    types = getattr(cfg, "layer_types", None)
    if getattr(cfg, "model_type", None) == "gemma3_text" and types:
        return list(types)
    return ["full_attention"] * cfg.num_hidden_layers


# ----------------------------------------------------------------------------------------------------------------
# GPT-2
# ----------------------------------------------------------------------------------------------------------------


class GPT2Adapter:
    """``transformer.wte/wpe``, ``transformer.h[i].attn.c_attn`` (fused q,k,v) and ``c_proj``, ``mlp.c_fc/c_proj``,
    LayerNorm. Every projection is a ``Conv1D`` (weight ``[in, out]``), so weights are transposed."""

    family = "gpt2"

    @staticmethod
    def config_kwargs(cfg) -> dict:
        if not getattr(cfg, "scale_attn_weights", True) or getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            raise ValueError(
                "GPT-2 teachers with scale_attn_weights=False or scale_attn_by_inverse_layer_idx=True are not "
                "supported: Aaren scales attention scores by 1/sqrt(head_dim)"
            )
        hidden = cfg.n_embd
        return dict(
            hidden_act=cfg.activation_function,
            intermediate_size=cfg.n_inner or 4 * hidden,
            num_key_value_heads=cfg.n_head,
            head_dim=hidden // cfg.n_head,
            norm_type="layernorm",
            layer_norm_eps=float(cfg.layer_norm_epsilon),
            mlp_type="plain",
            mlp_bias=True,
            attention_bias=True,
            attention_out_bias=True,
            qk_norm=False,
            parallel_residual=False,
            position_embedding_type="learned",
            max_position_embeddings=cfg.n_positions,
        )

    @staticmethod
    def base(model: nn.Module) -> nn.Module:
        return model.transformer if hasattr(model, "transformer") else model

    @classmethod
    def layers(cls, model: nn.Module) -> list[TeacherLayer]:
        return [
            TeacherLayer(i, block, block.attn, block.ln_1, block.ln_2, block.mlp, cls.family)
            for i, block in enumerate(cls.base(model).h)
        ]

    @staticmethod
    def qkv_weights(attention: nn.Module):
        """c_attn (Conv1D, weight [hidden, 3*hidden]) -> three Linear-layout ([out, in]) weights and biases."""
        hidden = attention.c_attn.weight.shape[0]
        weights = attention.c_attn.weight.t().split(hidden, dim=0)
        return list(zip(weights, attention.c_attn.bias.split(hidden, dim=0)))

    @classmethod
    def qkv(cls, attention: nn.Module, x: torch.Tensor):
        q, k, v = attention.c_attn(x).split(attention.split_size, dim=-1)
        shape = (*x.shape[:-1], -1, attention.head_dim)
        return q.view(shape), k.view(shape), v.view(shape)

    @classmethod
    def state_dict(cls, model: nn.Module, aaren: AarenConfig) -> dict[str, torch.Tensor]:
        base = cls.base(model)
        out = {"model.embed_tokens.weight": _clone(base.wte.weight)}
        if aaren.position_embedding_type == "learned":
            out["model.embed_positions.weight"] = _clone(base.wpe.weight)
        out.update(_norm_out("model.norm", base.ln_f, aaren))
        for layer in cls.layers(model):
            p = f"model.layers.{layer.index}"
            attn = layer.attention
            out.update(_norm_out(f"{p}.input_layernorm", layer.input_norm, aaren))
            out.update(_norm_out(f"{p}.post_attention_layernorm", layer.post_attention_norm, aaren))
            out.update(_qkv_out(f"{p}.mixer", cls.qkv_weights(attn), aaren, layer.index))
            out[f"{p}.mixer.o_proj.weight"] = _clone(attn.c_proj.weight.t())
            if aaren.attention_out_bias:
                out[f"{p}.mixer.o_proj.bias"] = _clone(attn.c_proj.bias)
            out[f"{p}.mlp.fc_in.weight"] = _clone(layer.mlp.c_fc.weight.t())
            out[f"{p}.mlp.fc_out.weight"] = _clone(layer.mlp.c_proj.weight.t())
            if aaren.mlp_bias:
                out[f"{p}.mlp.fc_in.bias"] = _clone(layer.mlp.c_fc.bias)
                out[f"{p}.mlp.fc_out.bias"] = _clone(layer.mlp.c_proj.bias)
        return out

    @staticmethod
    def rotary(model: nn.Module) -> None:
        return None  # learned absolute positions; no rotary embedding


# ----------------------------------------------------------------------------------------------------------------
# GPT-NeoX (Pythia)
# ----------------------------------------------------------------------------------------------------------------


class GPTNeoXAdapter:
    """``gpt_neox.embed_in``, ``layers[i].attention.query_key_value`` (fused, per-head interleaved ``[H, 3, D]``
    rows) and ``dense``, ``mlp.dense_h_to_4h/dense_4h_to_h``, LayerNorm, partial rotary, parallel residual,
    untied ``embed_out`` (called ``lm_head`` in transformers 5)."""

    family = "gpt_neox"

    @staticmethod
    def config_kwargs(cfg) -> dict:
        theta, partial = _rope_parameters(cfg)
        return dict(
            hidden_act=cfg.hidden_act,
            intermediate_size=cfg.intermediate_size,
            num_key_value_heads=cfg.num_attention_heads,
            head_dim=cfg.hidden_size // cfg.num_attention_heads,
            norm_type="layernorm",
            layer_norm_eps=float(cfg.layer_norm_eps),
            mlp_type="plain",
            mlp_bias=True,  # GPTNeoXMLP's Linear layers always have biases
            attention_bias=bool(getattr(cfg, "attention_bias", True)),
            attention_out_bias=bool(getattr(cfg, "attention_bias", True)),
            qk_norm=False,
            parallel_residual=bool(cfg.use_parallel_residual),
            position_embedding_type="none",  # no table: the student's context is not capped (config default)
            rope_theta=theta,
            partial_rotary_factor=partial,
        )

    @staticmethod
    def base(model: nn.Module) -> nn.Module:
        return model.gpt_neox if hasattr(model, "gpt_neox") else model

    @classmethod
    def layers(cls, model: nn.Module) -> list[TeacherLayer]:
        return [
            TeacherLayer(i, layer, layer.attention, layer.input_layernorm, layer.post_attention_layernorm,
                         layer.mlp, cls.family)
            for i, layer in enumerate(cls.base(model).layers)
        ]

    @staticmethod
    def qkv_weights(attention: nn.Module):
        """query_key_value rows are ordered [head, (q|k|v), head_dim]: split to three [H*D, hidden] weights."""
        fused = attention.query_key_value
        heads, head_dim = attention.config.num_attention_heads, attention.head_size
        weight = fused.weight.view(heads, 3, head_dim, -1)
        weights = [weight[:, i].reshape(heads * head_dim, -1) for i in range(3)]
        biases = [None] * 3
        if fused.bias is not None:
            bias = fused.bias.view(heads, 3, head_dim)
            biases = [bias[:, i].reshape(heads * head_dim) for i in range(3)]
        return list(zip(weights, biases))

    @staticmethod
    def qkv(attention: nn.Module, x: torch.Tensor):
        qkv = attention.query_key_value(x).view(*x.shape[:-1], -1, 3 * attention.head_size)
        q, k, v = qkv.chunk(3, dim=-1)
        return q, k, v

    @classmethod
    def state_dict(cls, model: nn.Module, aaren: AarenConfig) -> dict[str, torch.Tensor]:
        base = cls.base(model)
        out = {"model.embed_tokens.weight": _clone(base.embed_in.weight)}
        out.update(_norm_out("model.norm", base.final_layer_norm, aaren))
        for layer in cls.layers(model):
            p = f"model.layers.{layer.index}"
            attn = layer.attention
            out.update(_norm_out(f"{p}.input_layernorm", layer.input_norm, aaren))
            out.update(_norm_out(f"{p}.post_attention_layernorm", layer.post_attention_norm, aaren))
            out.update(_qkv_out(f"{p}.mixer", cls.qkv_weights(attn), aaren, layer.index))
            out.update(_linear_out(f"{p}.mixer.o_proj", attn.dense, aaren.attention_out_bias))
            out.update(_linear_out(f"{p}.mlp.fc_in", layer.mlp.dense_h_to_4h, aaren.mlp_bias))
            out.update(_linear_out(f"{p}.mlp.fc_out", layer.mlp.dense_4h_to_h, aaren.mlp_bias))
        return out

    @classmethod
    def rotary(cls, model: nn.Module) -> nn.Module | None:
        return getattr(cls.base(model), "rotary_emb", None)


ADAPTERS = {
    "llama": LlamaAdapter,
    "mistral": LlamaAdapter,
    "qwen2": LlamaAdapter,
    "qwen3": LlamaAdapter,
    "gemma3_text": Gemma3Adapter,
    "gpt2": GPT2Adapter,
    "gpt_neox": GPTNeoXAdapter,
}
assert tuple(ADAPTERS) == SUPPORTED_TEACHERS


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------


def _config_of(teacher) -> object:
    """Accept a config, a model, or anything with ``.config``."""
    return teacher.config if hasattr(teacher, "config") and not hasattr(teacher, "model_type") else teacher


def _output_embedding(model: nn.Module) -> torch.Tensor | None:
    """The LM head's weight (``lm_head``; GPT-NeoX's ``embed_out`` is renamed ``lm_head`` by transformers 5), or
    None for a base model without a head."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    if head is None:
        head = getattr(model, "lm_head", None) or getattr(model, "embed_out", None)
    return None if head is None else head.weight


def get_adapter(teacher):
    """The adapter class for a teacher model or config; ValueError for unsupported architectures."""
    cfg = _config_of(teacher)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ADAPTERS:
        hint = ""
        if model_type == "gemma3":  # Gemma3ForConditionalGeneration: a vision tower around a gemma3_text model
            hint = (". 'gemma3' is the multimodal Gemma-3 (4B and up); Gemma-3-270M and 1B are 'gemma3_text'. "
                    "Convert the language model alone: save Gemma3ForCausalLM.from_pretrained(...) with its "
                    "text_config, or use a gemma3_text checkpoint")
        raise ValueError(
            f"unsupported teacher model_type {model_type!r}; supported: {', '.join(SUPPORTED_TEACHERS)}{hint}"
        )
    return ADAPTERS[model_type]


_AAREN_PARAMETERS = set(inspect.signature(AarenConfig.__init__).parameters) - {"self", "kwargs"}


# A learned memory's default recency: RECENCY_SCORE_SPAN / the teacher's context length, so that a kept key scored
# this far above a newer token is outranked by it once it is about a context length old, and the memory never hands
# the student keys at distances the teacher's positions never reached (past them the loss jumps as a full KV
# cache's does: README, "Limits"). 4 units: on SmolLM2-135M's student (8,192 tokens: lambda = 0.00049), over 8,192
# tokens of held-out text, each layer's best score sits about 5 above its median token's and the 448th best (what a
# full memory holds) 1-3 above, so the best keys last about a context length and a typical kept one half of it.
# Measured flat to 32K tokens of context (0.001 as well, at some cost to recall from 2,048 tokens back).
RECENCY_SCORE_SPAN = 4.0


def aaren_config_from_teacher(teacher_config, **options) -> AarenConfig:
    """An :class:`AarenConfig` with the teacher's dimensions and block layout.

    ``options`` are AarenConfig arguments, typically the mixer's (``num_query_slots``, ``decay``, ``decay_init``,
    ``window_size``, ``num_sink_tokens``, ``window_gate``, ``window_gate_init``, ``chunk_size``); any other
    AarenConfig argument given here overrides the value taken from the teacher. A learned memory's
    ``memory_recency``, unless given, comes from the teacher's context length (:data:`RECENCY_SCORE_SPAN`).
    """
    cfg = _config_of(teacher_config)
    adapter = get_adapter(cfg)
    options = dict(options)
    convert_layers = options.pop("convert_layers", None)
    layer_types = layer_types_for(convert_layers, cfg.num_hidden_layers, teacher_attention_types(cfg))
    if "sliding_attention" in layer_types:
        options["layer_types"] = layer_types
    unknown = sorted(set(options) - _AAREN_PARAMETERS)
    if unknown:
        raise TypeError(f"unknown AarenConfig option(s) {unknown}; mixer options: {', '.join(MIXER_OPTIONS)}")
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        initializer_range=getattr(cfg, "initializer_range", 0.02),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        **_special_ids(cfg),
    )
    kwargs.update(adapter.config_kwargs(cfg))
    kwargs.update(options)
    config = AarenConfig(**kwargs)
    context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if "memory_recency" not in options and config.max_memory_size > 0 and config.memory_rule == "learned" and context:
        config.memory_recency = RECENCY_SCORE_SPAN / context
    return config


def layer_types_for(convert_layers: str | None, num_layers: int, teacher_types: list[str] | None = None) -> list[str]:
    """Which student layers are Aaren layers ("linear_attention") and which keep exact sliding-window attention.

    ``convert_layers``: "all", "none", "global" (the teacher's global layers), comma-separated layer indices, or
    None: "global" for a hybrid teacher (``teacher_types``, from :func:`teacher_attention_types`, has local layers),
    "all" otherwise. A hybrid teacher's local layers kept as they are stay the teacher's own local attention; its
    global layers must all become Aaren layers (kept, they would attend to the whole context and the state would
    grow with it). For the other teachers a kept layer is the window branch alone (window, sinks, memory)."""
    types = list(teacher_types) if teacher_types is not None else ["full_attention"] * num_layers
    hybrid = "sliding_attention" in types
    text = ("global" if hybrid else "all") if convert_layers is None else str(convert_layers).strip()
    global_layers = {i for i, t in enumerate(types) if t != "sliding_attention"}
    if text == "all":
        chosen = set(range(num_layers))
    elif text == "none":
        chosen = set()
    elif text == "global":
        if teacher_types is None:
            raise ValueError("convert_layers='global' needs the teacher's layer types")
        chosen = global_layers
    else:
        try:
            chosen = {int(part) for part in text.split(",") if part.strip()}
        except ValueError:
            raise ValueError(f"convert_layers must be 'all', 'none', 'global' or layer indices like '0,5,11', "
                             f"got {text!r}")
        bad = sorted(i for i in chosen if not 0 <= i < num_layers)
        if bad:
            raise ValueError(f"convert_layers names layer(s) {bad}, but the teacher has layers 0..{num_layers - 1}")
    if hybrid and not global_layers <= chosen:
        kept = sorted(global_layers - chosen)
        raise ValueError(
            f"convert_layers {text!r} keeps layer(s) {kept} unconverted, but they are global (full-attention) layers "
            f"of this teacher: kept, they would attend to the whole context and the model's state would grow with it "
            f"instead of staying constant. Convert them: leave --convert-layers out or pass 'global' (converts "
            f"layers {sorted(global_layers)}), 'all', or indices that include {kept}."
        )
    return ["linear_attention" if i in chosen else "sliding_attention" for i in range(num_layers)]


def unchanged_layers(teacher_config, aaren_config: AarenConfig) -> list[int]:
    """Layers whose student mixer computes exactly the teacher's attention: a teacher's local (sliding-window)
    layer kept as a "sliding_attention" layer with the teacher's window, no sinks and no memory. Conversion trains
    nothing in them (stage 1 skips them; stage 2 freezes their blocks)."""
    cfg = _config_of(teacher_config)
    types = teacher_attention_types(cfg)
    window = getattr(cfg, "sliding_window", None)
    return [i for i, t in enumerate(types)
            if t == "sliding_attention" and aaren_config.layer_type(i) == "sliding_attention"
            and aaren_config.layer_window(i) == (window, 0, 0)]


def teacher_layers(model: nn.Module) -> list[TeacherLayer]:
    """The teacher's decoder layers, each with its attention module, input norm, MLP norm and MLP."""
    return get_adapter(model).layers(model)


_FAMILY_ADAPTERS = {"llama": LlamaAdapter, "gemma3": Gemma3Adapter, "gpt2": GPT2Adapter, "gpt_neox": GPTNeoXAdapter}


def _attention_and_adapter(teacher_layer):
    if isinstance(teacher_layer, TeacherLayer):
        return teacher_layer.attention, _FAMILY_ADAPTERS[teacher_layer.family]
    module = teacher_layer
    for attribute, adapter in (("self_attn", LlamaAdapter), ("attn", GPT2Adapter), ("attention", GPTNeoXAdapter)):
        if hasattr(module, attribute):  # a decoder layer
            return getattr(module, attribute), adapter
    if hasattr(module, "q_proj"):  # an attention module
        return module, LlamaAdapter
    if hasattr(module, "c_attn"):
        return module, GPT2Adapter
    if hasattr(module, "query_key_value"):
        return module, GPTNeoXAdapter
    raise ValueError(f"cannot find the attention of {type(module).__name__}; supported: {', '.join(SUPPORTED_TEACHERS)}")


def teacher_qkv(teacher_layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's per-head queries, keys and values for the attention input ``x`` ``[B, T, hidden]``.

    ``x`` is what the attention module receives, i.e. the output of the layer's input norm (apply
    ``TeacherLayer.input_norm`` to residual-stream states first). ``teacher_layer`` is a :class:`TeacherLayer`, a
    decoder layer or its attention module. Returns ``q [B, T, H, D]``, ``k [B, T, Hkv, D]``, ``v [B, T, Hkv, D]``
    before rotary embeddings (Qwen3: after its per-head q/k RMSNorm, which precedes rotary). The teacher applies
    rotary to the first ``rotary_dim`` channels of q and k and scales scores by ``D ** -0.5``.
    """
    attention, adapter = _attention_and_adapter(teacher_layer)
    return adapter.qkv(attention, x)


def teacher_attention_scale(teacher_layer, head_dim: int) -> float:
    """The factor on the teacher's query-key scores: its attention module's ``scaling`` (Gemma:
    query_pre_attn_scalar ** -0.5), else head_dim ** -0.5."""
    attention, _ = _attention_and_adapter(teacher_layer)
    scaling = getattr(attention, "scaling", None)
    return float(scaling) if isinstance(scaling, float) else head_dim**-0.5


def teacher_qkv_weights(teacher_layer, head_dim: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Per-head views of the teacher's query, key and value projections, in ``nn.Linear`` layout:
    ``{"q": (weight [H, D, hidden], bias [H, D] or None), "k": ([Hkv, D, hidden], ...), "v": ...}`` with
    ``q[b, t, h] = weight[h] @ x[b, t] + bias[h]`` (the input of :func:`teacher_qkv`). Views share the teacher's
    storage (GPT-2's are transposed views of its Conv1D weights): clone before modifying. Qwen3's per-head q/k
    RMSNorm comes after these projections."""
    attention, adapter = _attention_and_adapter(teacher_layer)
    out = {}
    for name, (weight, bias) in zip("qkv", adapter.qkv_weights(attention)):
        out[name] = (weight.unflatten(0, (-1, head_dim)), None if bias is None else bias.unflatten(0, (-1, head_dim)))
    return out


def teacher_rotary_inv_freq(model: nn.Module, layer: int | None = None) -> torch.Tensor | None:
    """The teacher's rotary inverse frequencies ``[rotary_dim / 2]`` (rope scaling such as llama3's included) of
    layer ``layer`` (they differ between Gemma-3's local and global layers; default: the global layers'), or None
    for teachers without rotary embeddings (GPT-2)."""
    adapter = get_adapter(model)
    if adapter is Gemma3Adapter:
        inv_freq, scaling = adapter.rotary(model, layer)
    else:
        rotary = adapter.rotary(model)
        if rotary is None:
            return None
        inv_freq, scaling = rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))
    if abs(scaling - 1.0) > 1e-6:
        warnings.warn(
            f"the teacher's rotary embedding scales cos/sin by {scaling} (e.g. YaRN); Aaren's window branch "
            "uses plain cos/sin, so its scores differ from the teacher's by that factor squared"
        )
    return inv_freq


def expected_teacher_shapes(aaren: AarenConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every Aaren tensor that :func:`map_teacher_state_dict` fills from a teacher.

    Asked of the model itself: its state dict, built on the meta device (no memory, no initialisation), less the
    mixers' new parameters and a tied LM head."""
    from .init import new_parameter_names  # init imports this module

    with torch.device("meta"):
        model = AarenForCausalLM(aaren)
    skip = set(new_parameter_names(model))
    if aaren.tie_word_embeddings:
        skip.add("lm_head.weight")
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in skip}


def map_teacher_state_dict(teacher_model: nn.Module, aaren_config: AarenConfig) -> dict[str, torch.Tensor]:
    """Every Aaren tensor that comes from the teacher, under its Aaren name (copies, not views of the teacher).

    Includes ``lm_head.weight`` unless ``aaren_config.tie_word_embeddings`` (a tied teacher's embedding is copied
    into an untied head), ``model.embed_positions.weight`` for GPT-2, and, when the window branch is on,
    ``mixer.rope_inv_freq``: the teacher's rotary inverse frequencies (rope scaling included), or zeros for GPT-2,
    which has no rotary embedding (zero frequencies rotate nothing, so the window branch scores tokens exactly as
    GPT-2's attention does). Shapes are checked against :func:`expected_teacher_shapes`.
    """
    adapter = get_adapter(teacher_model)
    out = adapter.state_dict(teacher_model, aaren_config)

    if not aaren_config.tie_word_embeddings:
        head = _output_embedding(teacher_model)
        if head is None:
            if not getattr(teacher_model.config, "tie_word_embeddings", False):
                raise ValueError(
                    "the teacher has no LM head (a base model?) and untied embeddings: load it with "
                    "AutoModelForCausalLM, or set tie_word_embeddings=True in the Aaren config"
                )
            head = out["model.embed_tokens.weight"]
        out["lm_head.weight"] = _clone(head)
    elif not getattr(teacher_model.config, "tie_word_embeddings", False):
        raise ValueError(
            "the Aaren config ties the LM head to the embeddings but the teacher's are untied: the teacher's head "
            "would be lost; use tie_word_embeddings=False"
        )

    for i in range(aaren_config.num_hidden_layers):
        if aaren_config.layer_window(i)[0] == 0:
            continue
        inv_freq = teacher_rotary_inv_freq(teacher_model, i)
        if inv_freq is None:  # GPT-2: no rotary; zero frequencies make the rotation the identity, as in the teacher
            inv_freq = torch.zeros(aaren_config.rotary_dim // 2)
        if inv_freq.shape != (aaren_config.rotary_dim // 2,):
            raise ValueError(
                f"the teacher's rotary inv_freq has shape {tuple(inv_freq.shape)}, the Aaren config's rotary_dim "
                f"{aaren_config.rotary_dim} needs ({aaren_config.rotary_dim // 2},)"
            )
        out[f"model.layers.{i}.mixer.rope_inv_freq"] = _clone(inv_freq.float())

    expected = expected_teacher_shapes(aaren_config)
    missing = sorted(set(expected) - set(out))
    extra = sorted(set(out) - set(expected))
    wrong = sorted(k for k in set(out) & set(expected) if tuple(out[k].shape) != expected[k])
    if missing or extra or wrong:
        details = [f"{k}: {tuple(out[k].shape)} vs {expected[k]}" for k in wrong[:5]]
        raise ValueError(
            f"teacher does not match the Aaren config: missing {missing[:5]}, unexpected {extra[:5]}, "
            f"wrong shapes {details} (was the config made by aaren_config_from_teacher for this teacher?)"
        )
    return out
