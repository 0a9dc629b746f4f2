# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Stream a very long input through an Aaren model's fixed-size recurrent state, then generate.

    python examples/long_context.py                          # 1M tokens through the converted model (*)
    python examples/long_context.py --tokens 200000 --chunk 8192
    python examples/long_context.py --tiny --tokens 50000    # random tiny model: runs anywhere in seconds
    python examples/long_context.py --tokens 100000 --threads 8   # all cores of an idle 8-core machine

The input (held-out python-docs text repeated, or --random token ids) is prefilled chunk by chunk, each chunk
continuing from the cache the previous one returned; then `generate` continues from that cache. Printed as it goes:
tokens processed, tokens/s, the state's bytes (constant), and what the teacher's KV cache would need at that length,
2 * layers * kv_heads * head_dim * tokens * bytes, next to this machine's RAM.

(*) Throughput is that of the model's matmuls: a 135M model prefills a few hundred tokens/s on a 2-core CPU (1M
tokens: about an hour; try --tokens 100000 first) and far more on a GPU. The ETA column tells.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import THREADS_HELP, cpu_threads  # noqa: E402  (one rule for --threads in both examples)

DEFAULT_MODEL = "outputs/SmolLM2-135M-Instruct-aaren"
HOLDOUT_EVERY = 10  # as in finetune_lora.py: every 10th document of the corpus is held out


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def machine_ram() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def teacher_kv_bytes(config, tokens: int, bytes_per_value: int) -> int:
    """A softmax-attention teacher of the same shape keeps keys and values of every token in every layer."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * tokens * bytes_per_value


def tiny_model_and_tokenizer(vocab_size=512):
    """A random tiny Aaren model (GQA, a small window with sinks, input decay) with no tokenizer: --tiny."""
    from aaren_hf import AarenConfig, AarenForCausalLM

    config = AarenConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, decay="input", window_size=16, num_sink_tokens=2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    return AarenForCausalLM(config), None


def input_tokens(tokenizer, n_tokens, vocab_size, random_ids=False, corpus="python-docs", text_file=None, seed=0):
    """[n_tokens] int64: held-out text repeated until long enough, or random ids (no tokenizer, --random)."""
    import torch

    if tokenizer is not None and not random_ids:
        documents = None
        if text_file:
            with open(text_file, encoding="utf-8", errors="replace") as handle:
                documents = [handle.read()]
            source = text_file
        else:
            try:
                from aaren_hf.conversion.assets import iter_documents

                documents = [d["text"] for i, d in enumerate(iter_documents(corpus)) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
                source = f"held-out {corpus} documents"
            except Exception as error:  # corpus not prepared and not preparable here: fall back to random ids
                print(f"(packaged corpus unavailable: {error}; using random token ids)", flush=True)
        if documents:
            ids, budget = [], min(n_tokens, 262_144)  # tokenize a bounded amount, then repeat it
            eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
            for start in range(0, len(documents), 16):
                for doc in tokenizer(documents[start:start + 16], add_special_tokens=False)["input_ids"]:
                    ids += doc + eos
                if len(ids) >= budget:
                    break
            ids = torch.tensor(ids[:budget], dtype=torch.long)
            reps = -(-n_tokens // len(ids))
            print(f"input: {source}, {len(ids):,} distinct tokens repeated x{reps} to {n_tokens:,}", flush=True)
            return ids.repeat(reps)[:n_tokens]
    generator = torch.Generator().manual_seed(seed)
    print(f"input: {n_tokens:,} random token ids", flush=True)
    return torch.randint(3, vocab_size, (n_tokens,), generator=generator)  # ids 0-2 are special in tiny models


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"converted folder (default: {DEFAULT_MODEL})")
    parser.add_argument("--tiny", action="store_true", help="random tiny model instead of --model (random ids)")
    parser.add_argument("--tokens", type=int, default=1_000_000, help="input length (default: 1,000,000)")
    parser.add_argument("--chunk", type=int, default=4096, help="tokens per prefill forward")
    parser.add_argument("--random", action="store_true", help="random token ids instead of text")
    parser.add_argument("--text-file", default=None, help="text to repeat instead of the packaged corpus")
    parser.add_argument("--corpus", default="python-docs")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--report-every", type=int, default=None, help="tokens between progress lines (default: "
                                                                       "about 20 lines in all)")
    parser.add_argument("--kv-bytes", type=int, default=2, help="bytes per teacher KV value (2: bf16/fp16)")
    parser.add_argument("--trust-remote-code", action="store_true", help="load without importing aaren_hf")
    parser.add_argument("--memory-recency", type=float, default=None,
                        help="load the model with this memory_recency (default: its own; a conversion sets 4 / the "
                             "teacher's context length). Give 0.0005 to a SmolLM2 student converted before that "
                             "default (its config says 0.0): without it the memory ends up reading keys farther back "
                             "than the teacher ever attended, and the output past the teacher's context is noise "
                             "(README, Limits)")
    parser.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.tokens < 2:
        raise SystemExit("error: --tokens must be at least 2")

    with cpu_threads(args.threads) as threads:
        return run(args, threads)


def run(args, threads):
    import torch

    torch.manual_seed(args.seed)
    if args.tiny:
        model, tokenizer = tiny_model_and_tokenizer()
        name = "random tiny Aaren"
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not os.path.isdir(args.model) and (args.model == DEFAULT_MODEL or args.model.startswith((".", "/", "~"))):
            raise SystemExit(f"error: {args.model} does not exist. Convert a model first (the README's `aaren-convert` "
                             "command), pass --model FOLDER, or use --tiny.")
        if not args.trust_remote_code:
            import aaren_hf  # noqa: F401
        overrides = {} if args.memory_recency is None else {"memory_recency": args.memory_recency}
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                     trust_remote_code=args.trust_remote_code, **overrides)
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
        name = args.model
    model.eval()
    config = model.config

    n = args.tokens
    if getattr(config, "position_embedding_type", "none") == "learned" and n > config.max_position_embeddings:
        print(f"this model has a learned position table of {config.max_position_embeddings} positions (a GPT-2 "
              f"teacher): --tokens capped to it", flush=True)
        n = config.max_position_embeddings
    ids = input_tokens(tokenizer, n, config.vocab_size, args.random or args.tiny, args.corpus, args.text_file, args.seed)
    ram = machine_ram()
    print(f"model: {name}: {config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads x "
          f"{config.head_dim} dims; window {config.window_size}, sinks {config.num_sink_tokens}, memory "
          f"{config.memory_size} (recency {getattr(config, 'memory_recency', 0.0)}); "
          f"RAM here: {human(ram) if ram else 'unknown'}; {threads} CPU thread(s)", flush=True)
    print(f"{'tokens':>12} {'tokens/s':>10} {'state bytes':>12} {'teacher KV cache':>17} {'ETA':>8}", flush=True)

    import logging

    from transformers import GenerationConfig

    # generate() warns once the input passes config.max_position_embeddings; without a learned position table
    # (checked above) Aaren has no such limit, so that warning does not apply here.
    logging.getLogger("transformers.generation.stopping_criteria").addFilter(
        lambda record: "predefined maximum length" not in record.getMessage())

    # Prefill all but the last token; generate() then feeds the last one from the full ids and the cache.
    prefill = n - 1
    report_every = args.report_every or max(args.chunk, (prefill // 20) // args.chunk * args.chunk)
    cache = None
    states = set()
    start = time.perf_counter()
    next_report = report_every
    done = 0
    with torch.inference_mode():
        while done < prefill:
            chunk = ids[done:min(done + args.chunk, prefill)].unsqueeze(0)
            out = model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            done += chunk.shape[1]
            if done >= next_report or done == prefill:
                next_report += report_every
                elapsed = time.perf_counter() - start
                state = cache.state_bytes()
                states.add(state)
                kv = teacher_kv_bytes(config, done, args.kv_bytes)
                flag = "  > RAM" if ram and kv > ram else ""
                eta = (prefill - done) / (done / elapsed)
                eta_text = f"{eta / 60:.0f} min" if eta >= 60 else f"{eta:.0f} s"
                print(f"{done:>12,} {done / elapsed:>10,.0f} {state:>12,} {human(kv):>17} {eta_text:>8}{flag}",
                      flush=True)
        elapsed = time.perf_counter() - start
        print(f"prefill: {done:,} tokens in {elapsed:.1f} s ({done / elapsed:,.0f} tokens/s); positions in the cache: "
              f"{cache.get_seq_length():,}", flush=True)

        gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False,
                                      pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id)
        full = ids[:n].unsqueeze(0)
        t0 = time.perf_counter()
        generated = model.generate(input_ids=full, attention_mask=torch.ones_like(full), past_key_values=cache,
                                   generation_config=gen_config)
        gen_time = time.perf_counter() - t0
    new = generated[0, n:]
    text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else new.tolist()
    print(f"generated {len(new)} tokens after {n:,} tokens of context in {gen_time:.2f} s: {text!r}")
    state = cache.state_bytes()
    kv = teacher_kv_bytes(config, n + len(new), args.kv_bytes)
    print(f"state bytes: {state:,} ({human(state)}), constant while streaming: "
          f"{'yes' if len(states | {state}) == 1 else 'no: ' + str(sorted(states | {state}))}; teacher KV cache at "
          f"{n + len(new):,} tokens: {human(kv)}{f' ({kv / ram:.2f}x this machine RAM)' if ram else ''}")
    return {"tokens": n, "state_bytes": sorted(states | {state}), "generated": new.tolist(), "teacher_kv_bytes": kv}


if __name__ == "__main__":
    main()
    sys.exit(0)
