# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Teacher adapters on tiny random teachers of every supported family (no weights, no network)."""


import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AttentionInterface,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from aaren_hf.configuration_aaren import AarenConfig
from aaren_hf.conversion.adapters import (
    SUPPORTED_TEACHERS,
    aaren_config_from_teacher,
    expected_teacher_shapes,
    map_teacher_state_dict,
    teacher_layers,
    teacher_qkv,
    teacher_qkv_weights,
    teacher_rotary_inv_freq,
)

HIDDEN, LAYERS, VOCAB = 64, 2, 128
MIXER = dict(num_query_slots=4, decay="learned", window_size=8, num_sink_tokens=1, window_gate="head")
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
              intermediate_size=96, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_teacher(family: str):
    torch.manual_seed(0)
    if family == "llama":
        cfg = LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 32})
        model = LlamaForCausalLM(cfg)
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**COMMON, num_key_value_heads=2, head_dim=16, sliding_window=64))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=32))
    elif family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=128,
                                           bos_token_id=1, eos_token_id=2))
    elif family == "gpt_neox":
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**COMMON, rotary_pct=0.25, rotary_emb_base=10000,
                                                 use_parallel_residual=True))
    else:
        raise AssertionError(family)
    model.eval()
    with torch.no_grad():  # random, non-trivial norms and biases so that a wrong mapping shows up
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


# Gemma-3 (hybrid local/global layers, its own block) has its own tests: tests/test_gemma3.py.
FAMILIES = tuple(name for name in SUPPORTED_TEACHERS if name != "gemma3_text")


@pytest.fixture(scope="module", params=FAMILIES)
def teacher(request):
    return make_teacher(request.param)


def test_supported_list():
    assert SUPPORTED_TEACHERS == ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt2", "gpt_neox")


EXPECTED_CONFIG = {
    "llama": dict(num_key_value_heads=2, head_dim=16, norm_type="rmsnorm", mlp_type="gated", attention_bias=False,
                  attention_out_bias=False, qk_norm=False, tie_word_embeddings=True, rope_theta=500000.0,
                  partial_rotary_factor=1.0, position_embedding_type="none", rms_norm_eps=1e-5, hidden_act="silu"),
    "mistral": dict(num_key_value_heads=2, head_dim=16, norm_type="rmsnorm", mlp_type="gated", attention_bias=False,
                    attention_out_bias=False, qk_norm=False, tie_word_embeddings=False),
    "qwen2": dict(num_key_value_heads=2, head_dim=16, attention_bias=True, attention_out_bias=False, qk_norm=False,
                  tie_word_embeddings=True),
    "qwen3": dict(num_key_value_heads=2, head_dim=32, attention_bias=False, qk_norm=True, mlp_type="gated"),
    "gpt2": dict(num_key_value_heads=4, head_dim=16, norm_type="layernorm", mlp_type="plain", mlp_bias=True,
                 attention_bias=True, attention_out_bias=True, hidden_act="gelu_new", intermediate_size=4 * HIDDEN,
                 position_embedding_type="learned", max_position_embeddings=128, tie_word_embeddings=True,
                 layer_norm_eps=1e-5),
    "gpt_neox": dict(num_key_value_heads=4, head_dim=16, norm_type="layernorm", mlp_type="plain", mlp_bias=True,
                     attention_bias=True, parallel_residual=True, partial_rotary_factor=0.25, rope_theta=10000.0,
                     tie_word_embeddings=False, hidden_act="gelu", position_embedding_type="none"),
}


def test_config_mapping(teacher):
    family = teacher.config.model_type
    cfg = aaren_config_from_teacher(teacher.config, **MIXER)
    assert isinstance(cfg, AarenConfig)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (VOCAB, HIDDEN, LAYERS, 4)
    for key, value in EXPECTED_CONFIG[family].items():
        assert getattr(cfg, key) == value, (family, key, getattr(cfg, key), value)
    for key, value in MIXER.items():
        assert getattr(cfg, key) == value
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    # a model is accepted in place of its config, overrides win, typos are caught
    assert aaren_config_from_teacher(teacher, window_size=0).window_size == 0
    with pytest.raises(TypeError, match="num_query_slots"):
        aaren_config_from_teacher(teacher.config, num_querry_slots=2)


def test_a_learned_memory_forgets_at_the_teachers_context_length(teacher):
    """A learned memory's recency comes from the teacher's context (its position table for GPT-2): a key scored
    RECENCY_SCORE_SPAN above a newer token leaves once it is a context length old. Given, it wins (0 too); other
    rules and a model without a memory get none (the config would refuse recency on the aaren rule)."""
    from aaren_hf.conversion.adapters import RECENCY_SCORE_SPAN

    memory = dict(MIXER, memory_size=4, memory_rule="learned")
    context = getattr(teacher.config, "max_position_embeddings", None) or teacher.config.n_positions
    assert context == 128
    assert aaren_config_from_teacher(teacher.config, **memory).memory_recency == RECENCY_SCORE_SPAN / 128
    assert aaren_config_from_teacher(teacher.config, **memory, memory_recency=0.25).memory_recency == 0.25
    assert aaren_config_from_teacher(teacher.config, **memory, memory_recency=0).memory_recency == 0.0
    assert aaren_config_from_teacher(teacher.config, **dict(memory, memory_rule="aaren")).memory_recency == 0.0
    assert aaren_config_from_teacher(teacher.config, **MIXER).memory_recency == 0.0


def test_unsupported_teacher():
    from transformers import BertConfig

    with pytest.raises(ValueError, match="gpt_neox") as info:
        aaren_config_from_teacher(BertConfig())
    assert all(name in str(info.value) for name in SUPPORTED_TEACHERS)


@pytest.mark.parametrize("mixer", [MIXER, dict(num_query_slots=1)], ids=["hybrid", "paper"])
def test_state_dict_names_and_shapes(teacher, mixer):
    cfg = aaren_config_from_teacher(teacher.config, **mixer)
    mapped = map_teacher_state_dict(teacher, cfg)
    expected = expected_teacher_shapes(cfg)
    assert set(mapped) == set(expected)
    for name, tensor in mapped.items():
        assert tuple(tensor.shape) == expected[name], name
    assert ("lm_head.weight" in mapped) == (not cfg.tie_word_embeddings)
    has_q = any(".q_proj." in k for k in mapped)
    assert has_q == cfg.uses_query_projection
    # copies, never views of the teacher's storage
    teacher_ptrs = {p.data_ptr() for p in teacher.parameters()}
    assert not any(t.data_ptr() in teacher_ptrs for t in mapped.values())


def test_untied_head_from_tied_teacher():
    teacher = make_teacher("qwen2")
    cfg = aaren_config_from_teacher(teacher.config, tie_word_embeddings=False)
    mapped = map_teacher_state_dict(teacher, cfg)
    torch.testing.assert_close(mapped["lm_head.weight"], mapped["model.embed_tokens.weight"])
    neox = make_teacher("gpt_neox")
    with pytest.raises(ValueError, match="untied"):
        map_teacher_state_dict(neox, aaren_config_from_teacher(neox.config, tie_word_embeddings=True))


def test_rope_inv_freq_copied(teacher):
    cfg = aaren_config_from_teacher(teacher.config, **MIXER)
    mapped = map_teacher_state_dict(teacher, cfg)
    inv_freq = teacher_rotary_inv_freq(teacher)
    if teacher.config.model_type == "gpt2":  # no rotary: zero frequencies, the identity rotation
        assert inv_freq is None
        assert not mapped["model.layers.0.mixer.rope_inv_freq"].any()
        return
    assert inv_freq.shape == (cfg.rotary_dim // 2,)
    for i in range(LAYERS):
        torch.testing.assert_close(mapped[f"model.layers.{i}.mixer.rope_inv_freq"], inv_freq.float())
    if teacher.config.model_type == "llama":  # llama3 scaling: not the plain theta ** (-2i/d) schedule
        plain = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2).float() / cfg.rotary_dim))
        assert not torch.allclose(inv_freq, plain)


def test_mapped_linears_reproduce_teacher(teacher):
    """q/k/v from the mapped weights == teacher_qkv; o_proj/MLP weights act like the teacher's modules."""
    cfg = aaren_config_from_teacher(teacher.config, **MIXER)
    mapped = map_teacher_state_dict(teacher, cfg)
    x = torch.randn(2, 5, HIDDEN)
    d = cfg.head_dim
    for layer in teacher_layers(teacher):
        p = f"model.layers.{layer.index}"

        def lin(name, inp):
            return F.linear(inp, mapped[f"{p}.{name}.weight"], mapped.get(f"{p}.{name}.bias"))

        with torch.no_grad():
            q, k, v = teacher_qkv(layer, x)
            q_m = lin("mixer.q_proj", x).view(2, 5, -1, d)
            k_m = lin("mixer.k_proj", x).view(2, 5, -1, d)
            v_m = lin("mixer.v_proj", x).view(2, 5, -1, d)
            if cfg.qk_norm:
                q_m = F.rms_norm(q_m, (d,), mapped[f"{p}.mixer.q_norm.weight"], layer.attention.q_norm.variance_epsilon)
                k_m = F.rms_norm(k_m, (d,), mapped[f"{p}.mixer.k_norm.weight"], layer.attention.k_norm.variance_epsilon)
            torch.testing.assert_close(q_m, q)
            torch.testing.assert_close(k_m, k)
            torch.testing.assert_close(v_m, v)
            views = teacher_qkv_weights(layer, d)
            assert views["q"][0].shape == (cfg.num_attention_heads, d, HIDDEN)
            assert views["k"][0].shape == views["v"][0].shape == (cfg.num_key_value_heads, d, HIDDEN)
            for name, ref in (("q", q), ("k", k), ("v", v)):
                weight, bias = views[name]
                per_head = torch.einsum("bti,hdi->bthd", x, weight) + (0 if bias is None else bias)
                if cfg.qk_norm and name != "v":
                    norm = getattr(layer.attention, f"{name}_norm")
                    per_head = norm(per_head)
                torch.testing.assert_close(per_head, ref, rtol=1e-4, atol=1e-5)
            h = torch.randn(2, 5, cfg.num_attention_heads * d)
            o_teacher = getattr(layer.attention, "o_proj", None) or getattr(layer.attention, "c_proj", None) \
                or layer.attention.dense
            torch.testing.assert_close(lin("mixer.o_proj", h), o_teacher(h))
            if cfg.mlp_type == "gated":
                act = layer.mlp.act_fn
                mlp = lin("mlp.down_proj", act(lin("mlp.gate_proj", x)) * lin("mlp.up_proj", x))
            else:
                act = getattr(layer.mlp, "act", None)
                mlp = lin("mlp.fc_out", act(lin("mlp.fc_in", x)))
            torch.testing.assert_close(mlp, layer.mlp(x))
            norm_w = mapped[f"{p}.input_layernorm.weight"]
            torch.testing.assert_close(norm_w, layer.input_norm.weight)


def _rope(x, inv_freq, rotary_dim):
    """Rotate-half rotary on the first rotary_dim channels of x [B, T, H, D] at positions 0..T-1."""
    t = torch.arange(x.shape[1], dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[None, :, None], emb.sin()[None, :, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


_CAPTURED = []


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    _CAPTURED.append((query.detach(), key.detach(), value.detach()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("aaren_test_capture", _capture_attention)


def test_teacher_qkv_matches_teacher_forward(teacher):
    """teacher_qkv + rotary with the copied inv_freq == the q/k/v the teacher's own attention computes."""
    cfg = aaren_config_from_teacher(teacher.config, **MIXER)
    layers = teacher_layers(teacher)
    inputs = []
    hooks = [
        layer.attention.register_forward_pre_hook(
            lambda mod, args, kwargs: inputs.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True
        )
        for layer in layers
    ]
    previous = teacher.config._attn_implementation
    teacher.set_attn_implementation("aaren_test_capture")
    _CAPTURED.clear()
    try:
        with torch.no_grad():
            teacher(torch.randint(3, VOCAB, (2, 12)))
    finally:
        teacher.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()
    assert len(inputs) == len(_CAPTURED) == LAYERS
    inv_freq = teacher_rotary_inv_freq(teacher)
    for layer, x, (q_ref, k_ref, v_ref) in zip(layers, inputs, _CAPTURED):
        with torch.no_grad():
            q, k, v = teacher_qkv(layer, x)
            assert q.shape == (2, 12, cfg.num_attention_heads, cfg.head_dim)
            assert k.shape == v.shape == (2, 12, cfg.num_key_value_heads, cfg.head_dim)
            # the decoder layer itself (not the TeacherLayer record) is accepted too
            torch.testing.assert_close(teacher_qkv(layer.module, x)[2], v)
            if inv_freq is not None:
                q, k = _rope(q, inv_freq, cfg.rotary_dim), _rope(k, inv_freq, cfg.rotary_dim)
        torch.testing.assert_close(q, q_ref.transpose(1, 2), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(k, k_ref.transpose(1, 2), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, v_ref.transpose(1, 2), rtol=1e-4, atol=1e-5)


def test_teacher_layers_structure(teacher):
    layers = teacher_layers(teacher)
    assert [layer.index for layer in layers] == list(range(LAYERS))
    for layer in layers:
        assert layer.attention in list(layer.module.children())
        assert layer.input_norm in list(layer.module.children())
        assert layer.mlp in list(layer.module.children())


def test_llama_default_rope_ignores_partial_factor():
    """transformers' default Llama rope rotates the whole head even if the config says partial_rotary_factor."""
    teacher = LlamaForCausalLM(LlamaConfig(**COMMON, partial_rotary_factor=0.5)).eval()
    cfg = aaren_config_from_teacher(teacher.config, window_size=8)
    assert cfg.rotary_dim == 2 * teacher.model.rotary_emb.inv_freq.shape[0] == cfg.head_dim
    map_teacher_state_dict(teacher, cfg)
    neox = GPTNeoXConfig(**COMMON, rotary_pct=0.4)
    assert aaren_config_from_teacher(neox).partial_rotary_factor == pytest.approx(0.375)  # int(16 * 0.4) = 6


def test_gpt2_unusual_scaling_rejected():
    with pytest.raises(ValueError, match="scale_attn"):
        aaren_config_from_teacher(GPT2Config(n_embd=HIDDEN, n_layer=1, n_head=4, scale_attn_by_inverse_layer_idx=True))


# ----------------------------------------------------------------------------------------------------------------
# Loading into the Aaren model (runs once aaren_hf/modeling_aaren.py exists)
# ----------------------------------------------------------------------------------------------------------------



def test_load_into_aaren_model(teacher):
    from aaren_hf.modeling_aaren import AarenForCausalLM

    cfg = aaren_config_from_teacher(teacher.config, **MIXER)
    student = AarenForCausalLM(cfg).eval()
    mapped = map_teacher_state_dict(teacher, cfg)
    student_keys = set(student.state_dict())
    assert set(mapped) <= student_keys, sorted(set(mapped) - student_keys)
    result = student.load_state_dict(mapped, strict=False)
    assert not result.unexpected_keys
    # whatever the student lacks from the mapping must be one of the mixer's new parameters
    new_parameter_names = ("queries", "log_decay", "decay_proj", "window_gate", "gate_proj")
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    for key in set(result.missing_keys) - tied:
        assert key in mapped or any(part in key for part in new_parameter_names), key
    if cfg.tie_word_embeddings:
        assert student.get_output_embeddings().weight.data_ptr() == student.get_input_embeddings().weight.data_ptr()

    ids = torch.randint(3, VOCAB, (2, 7))
    layer0 = teacher_layers(teacher)[0]
    with torch.no_grad():
        torch.testing.assert_close(student.get_input_embeddings()(ids), teacher.get_input_embeddings()(ids))
        x = torch.randn(2, 7, HIDDEN)
        torch.testing.assert_close(student.model.layers[0].mlp(x), layer0.mlp(x))
        torch.testing.assert_close(student.model.layers[0].input_layernorm(x), layer0.input_norm(x))
        torch.testing.assert_close(student.model.layers[0].post_attention_layernorm(x), layer0.post_attention_norm(x))


def test_window_only_student_equals_teacher(teacher):
    """Window branch covering the whole sequence, gate saturated: the student is the teacher, so every mapped
    tensor (embeddings, norms, q/k/v/o, rotary, MLP, head, residual layout) must be right."""
    from aaren_hf.modeling_aaren import AarenForCausalLM

    cfg = aaren_config_from_teacher(teacher.config, num_query_slots=2, decay="learned", window_size=32,
                                    num_sink_tokens=1, window_gate="head", window_gate_init=30.0)
    student = AarenForCausalLM(cfg).eval()
    student.load_state_dict(map_teacher_state_dict(teacher, cfg), strict=False)
    ids = torch.randint(3, VOCAB, (2, 12))
    with torch.no_grad():
        expected = teacher(ids).logits
        got = student(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_recipes_map_onto_their_families():
    from aaren_hf.conversion.recipes import DEFAULT_MIXER, RECIPES, get_recipe

    assert {"smollm2-135m", "smollm2-360m", "qwen2.5-0.5b", "llama-3.2-1b", "pythia-160m", "pythia-410m",
            "gpt2"} <= set(RECIPES)
    assert [name for name, r in RECIPES.items() if r.offline_teacher] == ["smollm2-135m", "gemma3-270m"]
    for recipe in RECIPES.values():
        if recipe.model_type not in FAMILIES:  # gemma3-270m: tests/test_gemma3.py
            continue
        assert recipe.model_type in SUPPORTED_TEACHERS
        # the tiny teacher has fewer layers than the shared layer the SmolLM2-135M recipe names (6 of its 30)
        cfg = recipe.aaren_config(make_teacher(recipe.model_type).config, memory_shared_layer=None)
        for key, value in DEFAULT_MIXER.items():
            assert getattr(cfg, key) == value
        # the packaged teacher's 30-minute budget has no stage 2 (recipes.py says why); the hub recipes do
        assert recipe.budget.stage1_steps > 0 and recipe.budget.data_tokens > 0
        assert (recipe.budget.stage2_steps > 0) == (recipe.name != "smollm2-135m")
    with pytest.raises(KeyError, match="smollm2-135m"):
        get_recipe("nope")
    changed = get_recipe("gpt2").replace(mixer={"window_size": 16}, budget={"stage2_steps": 1})
    assert changed.mixer["window_size"] == 16 and changed.mixer["num_query_slots"] == 4
    # a tier turned off takes the recipe's settings that live in it (as aaren-convert's flags do)
    windowless = get_recipe("smollm2-135m").replace(mixer={"window_size": 0}).mixer
    assert (windowless["num_sink_tokens"], windowless["memory_size"], windowless["memory_shared_layer"]) == (0, 0, None)
    assert changed.budget.stage2_steps == 1 and get_recipe("gpt2").budget.stage2_steps > 1


@pytest.mark.slow
@pytest.mark.smoke
def test_packaged_teacher_maps_exactly():
    """The real SmolLM2-135M teacher: config as documented, and a window-only student reproduces its logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aaren_hf.conversion.assets import packaged_teacher_path
    from aaren_hf.modeling_aaren import AarenForCausalLM

    path = packaged_teacher_path()
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = aaren_config_from_teacher(teacher.config, window_size=64, num_sink_tokens=1, num_query_slots=4,
                                    decay="learned", window_gate_init=30.0)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.eos_token_id == 2
    student = AarenForCausalLM(cfg).eval()
    result = student.load_state_dict(map_teacher_state_dict(teacher, cfg), strict=False)
    assert not result.unexpected_keys
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected, got = teacher(ids).logits, student(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    assert tokenizer.decode(got[0, -1].argmax()) == " Paris"
