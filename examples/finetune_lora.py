# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""LoRA fine-tuning of a converted Aaren checkpoint with PEFT and the Transformers Trainer.

    python examples/finetune_lora.py                                   # python-docs corpus, small CPU defaults
    python examples/finetune_lora.py --text-file my.txt --max-steps 200 --seq-len 512
    python examples/finetune_lora.py --list-targets                    # the LoRA target names this model has
    python examples/finetune_lora.py --target-modules mixer.k_proj mixer.v_proj mlp.down_proj
    torchrun --nproc_per_node 2 examples/finetune_lora.py ...          # several CPU processes (gloo)
    accelerate launch examples/finetune_lora.py ...                    # GPUs

Steps: held-out perplexity of the base model; LoRA training (gradient checkpointing on); the adapter is saved to
OUTPUT/adapter, reloaded with AutoPeftModelForCausalLM (trust_remote_code=True), merged with merge_and_unload and
saved with a model card to OUTPUT/merged; held-out perplexity after. Both folders go to the Hub with
examples/push_to_hub.py as they are (safetensors and JSON only, files 0644, no local paths in the cards) once they
name their base model: pass --base-model-id OWNER/NAME (the converted model on the Hub), or later
`push_to_hub.py FOLDER --base-model OWNER/NAME`.

Text: the packaged python-docs corpus (aaren_hf.conversion.assets) unless --text-file is given (.txt: one
document; .jsonl: one {"text": ...} document per line). Every 10th document is held out (or the last 10% of the
tokens when there are fewer than 10 documents).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import cpu_threads  # noqa: E402  (one rule for --threads in the examples)

DEFAULT_MODEL = "outputs/SmolLM2-135M-Instruct-aaren"
HOLDOUT_EVERY = 10
# the window and memory stored at full precision (config overrides of an Aaren checkpoint): see merge_difference
FULL_PRECISION_STATE = dict(kv_cache_dtype=None, memory_bits=None, memory_hadamard=False)


# ----------------------------------------------------------------------------------------------------------------
# LoRA target names
# ----------------------------------------------------------------------------------------------------------------


def linear_module_names(model) -> dict[str, list[str]]:
    """Short names of the nn.Linear layers ("mixer.q_proj", "mlp.up_proj", "lm_head") -> full module names."""
    from torch import nn

    names: dict[str, list[str]] = {}
    for full, module in model.named_modules():
        if isinstance(module, nn.Linear):
            parts = full.split(".")
            short = ".".join(parts[-2:]) if len(parts) >= 2 and parts[-2] in ("mixer", "mlp") else parts[-1]
            names.setdefault(short, []).append(full)
    return names


def valid_target_names(model) -> list[str]:
    """Every name accepted by --target-modules: the block linears as "mixer.x" / "mlp.x", their bare leaf names
    ("x", which matches that leaf in the mixer and the MLP alike) and "lm_head"."""
    shorts = linear_module_names(model)
    leaves = {short.split(".")[-1] for short in shorts}
    return sorted(set(shorts) | leaves)


def default_target_modules(model) -> list[str]:
    """All mixer and MLP linears present in this model (which depends on the config: q_proj only with query slots
    or a window, decay_proj only with input-dependent decay, gate/up/down or fc_in/fc_out by MLP type)."""
    return sorted(short for short in linear_module_names(model) if short.startswith(("mixer.", "mlp.")))


def resolve_target_modules(model, requested=None) -> list[str]:
    """Check the requested LoRA targets against the model; a name matching no linear layer is an error that lists
    the valid names (PEFT itself only complains when *no* name matches, and silently skips the others)."""
    if not requested:
        return default_target_modules(model)
    requested = [name for item in requested for name in item.split(",") if name]
    full_names = [full for fulls in linear_module_names(model).values() for full in fulls]
    unknown = [name for name in requested
               if not any(full == name or full.endswith("." + name) for full in full_names)]
    if unknown:
        arch = type(model).__name__
        raise ValueError(
            f"LoRA target module(s) {unknown} not found in this {arch}. Valid names: {', '.join(valid_target_names(model))}. "
            "(Aaren blocks have mixer.{q_proj (only with query slots or a window), k_proj, v_proj, o_proj, decay_proj "
            "(input decay), gate_proj (input window gate)} and mlp.{gate_proj, up_proj, down_proj} or mlp.{fc_in, fc_out}; "
            "there is no self_attn/attn/c_attn.)"
        )
    return requested


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------


def load_documents(text_files=None, corpus="python-docs") -> tuple[list[str], str]:
    """(documents, description). --text-file wins; else the packaged corpus, prepared when missing."""
    if not text_files:
        try:
            from aaren_hf.conversion.assets import AssetError, packaged_text_files
        except ImportError as error:
            raise SystemExit(f"error: the packaged corpus needs aaren_hf.conversion ({error}); pass --text-file") from error
        try:
            text_files = [str(p) for p in packaged_text_files(corpus)]
        except AssetError as error:
            raise SystemExit(f"error: packaged corpus {corpus!r} is not available: {error}\nPass --text-file.") from error
        description = f"packaged {corpus} corpus"
    else:
        description = ", ".join(Path(name).name for name in text_files)  # goes into the card: no local paths
    documents = []
    for name in text_files:
        path = Path(name)
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as handle:
                documents += [json.loads(line)["text"] for line in handle if line.strip()]
        else:
            documents.append(path.read_text(encoding="utf-8", errors="replace"))
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise SystemExit(f"error: no text in {description}")
    return documents, description


def token_blocks(tokenizer, documents, seq_len, max_blocks):
    """Concatenate documents (each followed by EOS) and cut into at most max_blocks blocks of seq_len tokens.
    Documents are tokenized only as far as needed."""
    import torch

    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    need = seq_len * max_blocks
    for start in range(0, len(documents), 32):
        for doc_ids in tokenizer(documents[start:start + 32], add_special_tokens=False)["input_ids"]:
            ids += doc_ids + eos
        if len(ids) >= need:
            break
    n = min(len(ids) // seq_len, max_blocks)
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def split_blocks(tokenizer, documents, seq_len, train_blocks, eval_blocks):
    """(train [N, L], held-out [M, L]) token blocks; every HOLDOUT_EVERY-th document is held out."""
    if len(documents) >= HOLDOUT_EVERY:
        held = [d for i, d in enumerate(documents) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
        train = [d for i, d in enumerate(documents) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
        return (token_blocks(tokenizer, train, seq_len, train_blocks),
                token_blocks(tokenizer, held, seq_len, eval_blocks))
    blocks = token_blocks(tokenizer, documents, seq_len, train_blocks + eval_blocks)
    n_eval = max(1, min(eval_blocks, len(blocks) // HOLDOUT_EVERY))
    return blocks[:-n_eval], blocks[-n_eval:]


class BlockDataset:
    """Causal-LM examples from fixed-length blocks (labels = inputs; the model shifts them)."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def checkpoint_dtype(model_path):
    """The torch dtype a local checkpoint was saved in (config.json "dtype"), or None."""
    import torch

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, name, None) if isinstance(name, str) else None


def perplexity(model, blocks, batch_size=4) -> float:
    """exp(mean next-token NLL) over held-out blocks (equal lengths, so the batch means average exactly)."""
    import torch

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(blocks), batch_size):
            batch = blocks[start:start + batch_size].to(device)
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            n = batch.shape[0] * (batch.shape[1] - 1)
            total += float(loss) * n
            count += n
    model.train(was_training)
    return math.exp(total / max(count, 1))


def merge_difference(adapter_dir, probe) -> float:
    """max |logits difference| on ``probe`` between the adapter (reloaded as a user would) and its merge_and_unload,
    both with the window and memory stored at full precision. Merged weights differ from the adapter's sums by float
    rounding, and a state kept in bfloat16 and 4-bit codes (the recipe's) rounds a few of the two models' entries to
    neighbouring values: on the converted SmolLM2 that alone moved logits by 0.7, burying whatever the merge itself
    got wrong (with the state at full precision: 1e-4)."""
    import torch
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir), trust_remote_code=True, dtype=torch.float32,
                                                     **FULL_PRECISION_STATE).eval()
    with torch.no_grad():
        adapter = model(input_ids=probe, use_cache=False).logits
        merged = model.merge_and_unload()(input_ids=probe, use_cache=False).logits
    return (adapter - merged).abs().max().item()


# ----------------------------------------------------------------------------------------------------------------
# Model card of the merged model
# ----------------------------------------------------------------------------------------------------------------


def write_card(base_path, folder, info: dict, base_model_id=None, adapter=False):
    """README.md for the merged fine-tune (``adapter``: for the adapter folder), with license/tags inherited from the
    converted model's card. ``base_model`` is the converted model (``base_model_id``), never its teacher, which
    the converted card names; without an id it is left out (push_to_hub.py --base-model adds it). The card names
    the base by its folder name, not by this machine's path."""
    from huggingface_hub import ModelCard, ModelCardData

    from aaren_hf.conversion.train_state import atomic_write

    base_data = {}
    card_path = Path(base_path) / "README.md"
    if card_path.is_file():
        try:
            base_data = ModelCard.load(card_path).data.to_dict()
        except Exception:  # a card without YAML: keep the defaults below
            base_data = {}
    tags = list(dict.fromkeys((base_data.get("tags") or []) + ["aaren", "lora", "peft"]))
    data = ModelCardData(
        base_model=base_model_id,
        license=base_data.get("license") or "apache-2.0",
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        tags=tags,
    )
    base = base_model_id or Path(base_path).name
    what = "LoRA adapter" if adapter else "merged LoRA fine-tune"
    body = f"""
# {Path(folder).parent.name} ({what})

An Aaren ("Attention as an RNN") causal LM: `{base}` fine-tuned with LoRA (rank {info['rank']}) on
{info['data']} for {info['steps']} steps of {info['seq_len']}-token blocks{'' if adapter else ', then merged into the weights'}.
LoRA targets: {info['targets']}.

| held-out perplexity | before | after |
| --- | --- | --- |
| {info['eval_blocks']} blocks of {info['seq_len']} tokens | {info['ppl_before']:.2f} | {info['ppl_after']:.2f} |
"""
    if adapter:
        body += f"""
Load with PEFT (the base model's code runs with `trust_remote_code=True`):

```python
from peft import AutoPeftModelForCausalLM
model = AutoPeftModelForCausalLM.from_pretrained("REPO_OR_FOLDER", trust_remote_code=True)
```
"""
    else:
        body += """
The modeling code is included: load with

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("REPO_OR_FOLDER", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("REPO_OR_FOLDER", trust_remote_code=True)  # reads config.json too
```
"""
    text = f"---\n{data.to_yaml()}\n---\n{body}"
    atomic_write(Path(folder) / "README.md", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"converted checkpoint folder (default: {DEFAULT_MODEL})")
    parser.add_argument("--output-dir", default=None, help="default: outputs/<model name>-lora")
    parser.add_argument("--text-file", action="append", help=".txt or .jsonl training text (repeatable); default: "
                                                              "the packaged corpus")
    parser.add_argument("--corpus", default="python-docs", help="packaged corpus when no --text-file (python-docs, "
                                                                "kernel-docs, perl-docs)")
    parser.add_argument("--target-modules", nargs="+", default=None,
                        help="LoRA targets, e.g. mixer.k_proj mlp.down_proj (default: every mixer and MLP linear)")
    parser.add_argument("--list-targets", action="store_true", help="print the valid target names and exit")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16)
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-blocks", type=int, default=8, help="held-out blocks of --seq-len tokens")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load the base model with the code saved in its folder instead of importing aaren_hf")
    parser.add_argument("--base-model-id", default=None, help="hub id of the converted model, for the merged card")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads per process (default: torch's "
                        "own, one per core); on a shared machine fewer threads than busy cores can be much faster")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with cpu_threads(args.threads or 0):  # 0: torch's own count; restored after (main also runs inside the tests)
        return finetune(args)


def finetune(args):
    import torch
    from accelerate import PartialState
    from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_path = args.model
    if os.path.isdir(model_path):
        model_path = os.path.abspath(model_path)  # the adapter config records it: reloadable from any folder
    elif model_path == DEFAULT_MODEL or model_path.startswith((".", "/", "~")):
        raise SystemExit(f"error: {model_path} does not exist. Convert a model first (the README's `aaren-convert` "
                         "command) or pass --model FOLDER.")
    if not args.trust_remote_code:
        import aaren_hf  # noqa: F401  (registers the Auto classes)

    state = PartialState(cpu=not torch.cuda.is_available())  # torchrun/accelerate launch: one per process
    main_process = state.is_main_process
    log = print if main_process else (lambda *a, **k: None)
    set_seed(args.seed)
    output_dir = Path(args.output_dir or f"outputs/{Path(model_path).name}-lora")

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, trust_remote_code=args.trust_remote_code)
    if args.list_targets:
        log("valid LoRA target names:", ", ".join(valid_target_names(model)))
        log("default targets:", ", ".join(default_target_modules(model)))
        return None
    try:
        targets = resolve_target_modules(model, args.target_modules)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error

    documents, data_desc = load_documents(args.text_file, args.corpus)
    tokens_per_step = args.batch_size * args.grad_accum * state.num_processes
    train_blocks, eval_blocks = split_blocks(tokenizer, documents, args.seq_len, args.max_steps * tokens_per_step,
                                             args.eval_blocks)
    if len(train_blocks) == 0 or len(eval_blocks) == 0:
        raise SystemExit(f"error: not enough text in {data_desc} for blocks of {args.seq_len} tokens")
    log(f"data: {data_desc}: {len(documents)} documents -> {len(train_blocks)} train / {len(eval_blocks)} held-out "
        f"blocks of {args.seq_len} tokens")

    ppl_before = None
    if main_process:
        ppl_before = perplexity(model.to(state.device), eval_blocks)
        log(f"held-out perplexity before: {ppl_before:.3f}", flush=True)
    state.wait_for_everyone()

    lora = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout, target_modules=targets,
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    if main_process:
        trainable, total = model.get_nb_trainable_parameters()
        log(f"LoRA on {', '.join(targets)}: {trainable:,} trainable of {total:,} parameters")

    bf16 = args.bf16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    training_args = TrainingArguments(
        output_dir=str(output_dir / "trainer"),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.max_steps // 10 if args.max_steps >= 20 else 0,  # warmup's first step has lr 0
        logging_steps=max(1, args.max_steps // 10),
        save_strategy="no",
        report_to=[],
        activation_checkpointing=not args.no_gradient_checkpointing,  # = gradient_checkpointing (renamed in 5.x)
        activation_checkpointing_kwargs={"use_reentrant": False},
        bf16=bf16,
        use_cpu=not torch.cuda.is_available(),
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=BlockDataset(train_blocks))
    start = time.perf_counter()
    result = trainer.train()
    log(f"trained {result.global_step} steps in {time.perf_counter() - start:.1f} s "
        f"({state.num_processes} process(es)); final train loss {result.training_loss:.4f}")

    adapter_dir, merged_dir = output_dir / "adapter", output_dir / "merged"
    if main_process:
        # not trainer.save_model: it adds training_args.bin, a pickle that push_to_hub.py (rightly) refuses
        model.save_pretrained(str(adapter_dir))
    state.wait_for_everyone()
    if not main_process:
        return None
    try:
        (output_dir / "trainer").rmdir()  # Trainer's output_dir; empty with save_strategy="no"
    except OSError:
        pass

    # Reload as a user would: the adapter folder names its base model; the base loads with its saved code.
    diff = merge_difference(adapter_dir, eval_blocks[:2])
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir), trust_remote_code=True, dtype=torch.float32)
    merged = reloaded.merge_and_unload()
    ppl_after = perplexity(merged, eval_blocks)
    log(f"adapter: {adapter_dir} (reloaded with AutoPeftModelForCausalLM; merged vs adapter logits max |diff| "
        f"{diff:.2e}, state at full precision)")
    log(f"held-out perplexity before: {ppl_before:.3f}  after: {ppl_after:.3f}")

    saved_dtype = checkpoint_dtype(model_path)
    if saved_dtype is not None and saved_dtype != torch.float32:
        merged = merged.to(saved_dtype)  # trained in float32; saved in the base checkpoint's dtype
    merged.save_pretrained(str(merged_dir))
    tokenizer.save_pretrained(str(merged_dir))
    info = dict(targets=", ".join(targets), rank=args.rank, data=data_desc, steps=result.global_step,
                seq_len=args.seq_len, eval_blocks=len(eval_blocks), ppl_before=ppl_before, ppl_after=ppl_after)
    # imported only now: with --trust-remote-code the model above must come from the folder's own code
    from aaren_hf.conversion.model_card import finish_folder
    from aaren_hf.conversion.train_state import atomic_write_json

    write_card(model_path, merged_dir, info, args.base_model_id)
    write_card(model_path, adapter_dir, info, args.base_model_id, adapter=True)
    if args.base_model_id:  # reloaded above from the local folder; published, it names the hub model
        adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
        adapter_config["base_model_name_or_path"] = args.base_model_id
        atomic_write_json(adapter_dir / "adapter_config.json", adapter_config)
    finish_folder(merged_dir, type(tokenizer).__name__)
    finish_folder(adapter_dir)
    base_flag = "" if args.base_model_id else " --base-model OWNER/NAME-OF-THE-CONVERTED-MODEL"
    log(f"merged model: {merged_dir} (upload with: python examples/push_to_hub.py {merged_dir}{base_flag} --dry-run)")
    return {"ppl_before": ppl_before, "ppl_after": ppl_after, "merge_diff": diff, "adapter_dir": str(adapter_dir),
            "merged_dir": str(merged_dir), "targets": targets, "threads": torch.get_num_threads()}


if __name__ == "__main__":
    main()
