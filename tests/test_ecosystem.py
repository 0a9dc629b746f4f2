"""Aaren models inside the wider Hugging Face ecosystem: pipeline, Trainer, Accelerate, lm-evaluation-harness.

Tiny random models and a byte-level BPE tokenizer trained here: offline, seconds each. The lm-eval test is skipped
when `lm_eval` is not installed (it is not a dependency of aaren-hf).
"""

import math

import pytest
import torch

import aaren_hf  # noqa: F401  (registers the Auto classes)
from aaren_hf import AarenCache, AarenConfig, AarenForCausalLM
from helpers import bpe_tokenizer

TEXT = """The quick brown fox jumps over the lazy dog.
def fibonacci(n):
    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
"""


def make_tokenizer():
    return bpe_tokenizer(TEXT)


def tiny_config(vocab_size, **overrides):
    kwargs = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(overrides)
    return AarenConfig(**kwargs)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("eco") / "tiny-aaren"
    torch.manual_seed(0)
    AarenForCausalLM(tiny_config(len(tokenizer))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _reset_accelerate_state():
    """Accelerator / Trainer state is process-wide: each test starts from a clean one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def lm_batches(tokenizer, n=8, length=24, seed=0):
    ids = tokenizer(TEXT * 8, add_special_tokens=False)["input_ids"]
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length, (n,), generator=generator).tolist()
    return torch.tensor([ids[s:s + length] for s in starts])


# ----------------------------------------------------------------------------------------------------------------
# pipeline
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trust_remote_code", [False, True], ids=["package", "remote-code"])
def test_text_generation_pipeline(tiny_folder, trust_remote_code):
    from transformers import pipeline

    generator = pipeline("text-generation", model=str(tiny_folder), trust_remote_code=trust_remote_code,
                         device="cpu")
    # with aaren_hf imported, its registered classes take precedence over the folder's copy even with
    # trust_remote_code=True (the package-less remote-code path is tested in a fresh process in test_examples.py)
    assert type(generator.model).__name__ == "AarenForCausalLM"
    generator.tokenizer.padding_side = "left"
    prompts = ["The capital of France is", "def"]
    outputs = generator(prompts, max_new_tokens=4, do_sample=False, batch_size=2)
    for prompt, output in zip(prompts, outputs):
        assert output[0]["generated_text"].startswith(prompt)
        assert len(output[0]["generated_text"]) > len(prompt)
    # returns only the new text when asked, like any causal LM
    new = generator(prompts[0], max_new_tokens=3, do_sample=False, return_full_text=False)
    assert not new[0]["generated_text"].startswith(prompts[0])


# ----------------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------------


def test_trainer_runs_a_few_steps(tokenizer, tmp_path):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = AarenForCausalLM(tiny_config(len(tokenizer), decay="input", window_size=4))
    blocks = lm_batches(tokenizer, n=8)
    dataset = [{"input_ids": b, "labels": b} for b in blocks]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False})
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    result = trainer.train()
    assert result.global_step == 4 and math.isfinite(result.training_loss)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 4 and losses[-1] < losses[0]
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert any("mixer.queries" in n for n in changed) and any("decay_proj" in n for n in changed)
    # back in eval mode it still generates with its recurrent cache
    model.eval()
    out = model.generate(input_ids=blocks[:1, :5], max_new_tokens=3, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    assert isinstance(out.past_key_values, AarenCache)


# ----------------------------------------------------------------------------------------------------------------
# Accelerate
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerator_prepare_and_step(tokenizer, monkeypatch, mixed_precision):
    """`accelerate launch` hands its config to Accelerator() through ACCELERATE_* variables: Accelerator() must pick
    it up, prepare an Aaren model and an optimizer, and run a training step (bf16: CPU autocast)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", mixed_precision)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    accelerator = Accelerator()
    assert accelerator.mixed_precision == mixed_precision
    assert accelerator.distributed_type == DistributedType.NO and accelerator.device.type == "cpu"

    torch.manual_seed(0)
    model = AarenForCausalLM(tiny_config(len(tokenizer), num_query_slots=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = lm_batches(tokenizer, n=4).to(accelerator.device)
    before = accelerator.unwrap_model(model).model.layers[0].mixer.queries.detach().clone()
    losses = []
    for _ in range(3):
        with accelerator.autocast():
            loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(l) for l in losses) and losses[-1] < losses[0]
    unwrapped = accelerator.unwrap_model(model)
    assert not torch.equal(unwrapped.model.layers[0].mixer.queries, before)
    assert unwrapped.model.layers[0].mixer.queries.dtype == torch.float32  # master weights stay fp32


# ----------------------------------------------------------------------------------------------------------------
# lm-evaluation-harness
# ----------------------------------------------------------------------------------------------------------------


def test_lm_eval_hflm_wraps_aaren(tokenizer, tiny_folder):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness (pip install lm-eval) is not installed")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    torch.manual_seed(0)
    model = AarenForCausalLM(tiny_config(len(tokenizer))).eval()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2, max_length=256)

    pairs = [("The capital of France is", " Paris"), ("def fibonacci(n):", "\n    return n"),
             ("The quick brown", " fox jumps")]
    requests = [Instance("loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests)
    assert len(results) == len(pairs)
    for (context, continuation), (logprob, greedy) in zip(pairs, results):
        assert isinstance(greedy, bool) and logprob < 0
        # same number computed by hand: sum of log p(continuation token | prefix)
        ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
        cont = tokenizer(context + continuation, add_special_tokens=False)["input_ids"][len(ctx):]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        expected = sum(logprobs[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
        assert logprob == pytest.approx(expected, abs=1e-3)

    gen_requests = [
        Instance("generate_until", doc={}, idx=i,
                 arguments=(context, {"until": ["\n\n"], "max_gen_toks": 5, "do_sample": False}))
        for i, (context, _) in enumerate(pairs)
    ]
    generations = lm.generate_until(gen_requests)
    assert len(generations) == len(pairs) and all(isinstance(g, str) for g in generations)
    # greedy generation through HFLM (left-padded batches) matches generate() on each context alone
    for (context, _), text in zip(pairs, generations):
        ids = tokenizer(context, return_tensors="pt", add_special_tokens=False)["input_ids"]
        alone = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        expected = tokenizer.decode(alone[0, ids.shape[1]:], skip_special_tokens=True).split("\n\n")[0]
        assert text == expected

    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", doc={}, arguments=(TEXT,), idx=0)])
    assert len(rolling) == 1 and rolling[0] < 0

    # what `lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True` builds
    from_path = HFLM(pretrained=str(tiny_folder), trust_remote_code=True, device="cpu", batch_size=2)
    assert type(from_path.model).__name__ == "AarenForCausalLM"
    (logprob, _), = from_path.loglikelihood([requests[0]])
    assert math.isfinite(logprob) and logprob < 0
