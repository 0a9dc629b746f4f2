# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Generate text with a converted Aaren checkpoint: streamed tokens, batched prompts, chat template.

    python examples/generate.py                                  # default folder, default prompts
    python examples/generate.py "The capital of France is" --max-new-tokens 20
    python examples/generate.py --chat "What is a Python generator?" "Name three prime numbers."
    python examples/generate.py --model some/folder --trust-remote-code   # load without importing aaren_hf
    python examples/generate.py --threads 2 "Once upon a time"   # both cores of an idle 2-core machine

One prompt is streamed token by token (TextStreamer); several prompts run as one left-padded batch (a padded row
gives the same tokens as the prompt run alone) and are printed when done. The recurrent state's size is printed
at the end: it does not grow with the prompt or the generation.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

DEFAULT_MODEL = "outputs/SmolLM2-135M-Instruct-aaren"
DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
DEFAULT_CHAT_PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string."]
THREADS_HELP = (
    "torch CPU threads. Default: 1 on a machine with 4 usable cores or fewer, else torch's own default (one per "
    "core); 0: torch's default. Small machines are often shared, and torch's threads wait for each other at every "
    "op: with other work on the cores, 2 threads decoded 6x to 30x slower than 1 thread on a busy "
    "2-core machine, while a second thread can at best halve the time on an idle one. On an idle machine with "
    "few cores, pass --threads 0 (or the core count)."
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("prompts", nargs="*", help="prompts (default: two examples); several run as one batch")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"converted checkpoint folder (or hub id) (default: {DEFAULT_MODEL}, made by aaren-convert)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--system", default=None, help="system message for --chat")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-stream", action="store_true", help="do not stream a single prompt")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    parser.add_argument("--compile", action="store_true", help="generate(cache_implementation='static'): the state at "
                        "fixed addresses, and on a GPU transformers compiles the decode step (inductor, CUDA graphs; "
                        "the first call takes the compile); on a CPU the step stays the C kernels' one call a layer")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load with the modeling code saved in the folder, without importing aaren_hf (as a "
                             "user who only has transformers would)")
    return parser.parse_args(argv)


@contextlib.contextmanager
def cpu_threads(requested=None):
    """--threads while the block runs (None: 1 on <= 4 usable cores, else torch's default; 0: torch's default);
    yields the count in use and restores the previous one (main() also runs inside other programs: the tests)."""
    import torch

    previous = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    requested = (1 if cores <= 4 else 0) if requested is None else requested
    try:
        if requested > 0:
            torch.set_num_threads(requested)
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)


def load(model_path, trust_remote_code=False, dtype="float32", device=None):
    """(model, tokenizer) in eval mode. Without --trust-remote-code, importing aaren_hf registers the classes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(model_path) and (model_path.startswith((".", "/", "~")) or model_path.count("/") != 1
                                          or model_path == DEFAULT_MODEL):
        raise SystemExit(
            f"error: {model_path} does not exist. Convert a model first (see the README's `aaren-convert` command), "
            "or pass --model FOLDER."
        )
    if not trust_remote_code:
        import aaren_hf  # noqa: F401  (registers AutoConfig / AutoModelForCausalLM for model_type "aaren")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code)
    model.to(device).eval()
    # AutoTokenizer reads config.json too: without aaren_hf it needs trust_remote_code, or it asks interactively
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left", trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def build_inputs(tokenizer, prompts, chat=False, system=None):
    """Tokenized, left-padded batch. With chat=True the chat template (with generation prompt) wraps each prompt."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise SystemExit("error: --chat: this tokenizer has no chat template; run without --chat")
        texts = []
        for prompt in prompts:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        # the template already holds the special tokens (bos, role markers)
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return tokenizer(list(prompts), return_tensors="pt", padding=True)


def main(argv=None):
    args = parse_args(argv)
    with cpu_threads(args.threads) as threads:
        return run(args, threads)


def run(args, threads):
    prompts = args.prompts or (DEFAULT_CHAT_PROMPTS if args.chat else DEFAULT_PROMPTS)

    import torch
    from transformers import TextStreamer

    torch.manual_seed(args.seed)
    model, tokenizer = load(args.model, args.trust_remote_code, args.dtype, args.device)
    cls = type(model)
    print(f"model: {args.model} ({cls.__module__}.{cls.__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"parameters, {args.dtype}; {threads} CPU thread(s))", flush=True)

    inputs = build_inputs(tokenizer, prompts, args.chat, args.system).to(model.device)
    stream = len(prompts) == 1 and not args.no_stream  # TextStreamer handles one sequence
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, pad_token_id=tokenizer.pad_token_id)
    if args.do_sample:
        gen_kwargs.update(temperature=args.temperature, top_p=args.top_p)
    if args.repetition_penalty:
        gen_kwargs["repetition_penalty"] = args.repetition_penalty
    if args.compile:
        gen_kwargs["cache_implementation"] = "static"

    if stream:
        print(f"\n>>> {prompts[0]}", flush=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, streamer=streamer, return_dict_in_generate=True, **gen_kwargs)
    elapsed = time.perf_counter() - start

    prompt_len = inputs["input_ids"].shape[1]
    new_tokens = out.sequences[:, prompt_len:]
    if not stream:
        for prompt, tokens in zip(prompts, new_tokens):
            print(f"\n>>> {prompt}\n{tokenizer.decode(tokens, skip_special_tokens=True)}", flush=True)
    produced = int((new_tokens != tokenizer.pad_token_id).sum()) if tokenizer.pad_token_id is not None else new_tokens.numel()
    cache = out.past_key_values
    state = cache.state_bytes() if hasattr(cache, "state_bytes") else None
    print(f"\n{len(prompts)} prompt(s), {prompt_len} prompt tokens (padded), {produced} new tokens in {elapsed:.2f} s "
          f"({produced / max(elapsed, 1e-9):.1f} tokens/s)")
    if state is not None:
        print(f"state bytes: {state} ({state / max(len(prompts), 1) / 1024:.1f} KiB per sequence after "
              f"{cache.get_seq_length()} positions; fixed size from the first token on, whatever the context)")
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
