# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Loss against context length: does a model stay sane as its context grows past what its teacher trained on?

The same scored tokens (the last ``--scored`` of the text) are scored after L tokens of the text before them, fed
in pieces of ``--piece`` tokens through the model's cache (the teacher's KV cache, the student's fixed state), for
each L in ``--lengths``. Printed per model and L: mean next-token loss over the scored tokens, over their first 256
(which lean on the context most) and over their last 512 (which have their own 512 tokens besides). A model that
uses its context sees the loss fall as L grows; one that breaks sees it rise.

    .venv/bin/python -P benchmarks/context_length.py --model outputs/SmolLM2-135M-Instruct-aaren \
        --model ~/.cache/aaren_hf/teachers/SmolLM2-135M-Instruct --lengths 0,2048,8192,16384,32768
    .venv/bin/python -P benchmarks/context_length.py --model outputs/SmolLM2-135M-Instruct-aaren \
        --set memory_size=0 --set memory_shared_layer=None       # the student without its memory tier

Text: every 10th document of the packaged python-docs corpus (the examples' held-out share; a conversion samples
its training windows from the same corpus, so some may have been seen: the trend in L is the point, not the
level), or ``--text-file``. A full KV cache grows with L: the teacher at 32K tokens takes minutes and gigabytes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

HOLDOUT_EVERY = 10  # as in examples/finetune_lora.py: every 10th document of the corpus is held out


def text_ids(tokenizer, n_tokens, corpus="python-docs", text_file=None) -> torch.Tensor:
    """[n_tokens] int64: the last of all held-out documents joined by EOS (or of --text-file), so that the scored
    tokens are the same whatever the lengths asked for; an error if there are fewer."""
    if text_file:
        with open(text_file, encoding="utf-8", errors="replace") as handle:
            documents = [handle.read()]
    else:
        from aaren_hf.conversion.assets import iter_documents

        documents = [d["text"] for i, d in enumerate(iter_documents(corpus)) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = []
    for doc in tokenizer(documents, add_special_tokens=False)["input_ids"]:
        ids += doc + eos
    if len(ids) < n_tokens:
        raise SystemExit(f"the text has {len(ids):,} tokens; --lengths and --scored need {n_tokens:,}")
    return torch.tensor(ids[len(ids) - n_tokens:], dtype=torch.long)


@torch.no_grad()
def scored_loss(model, ids, context, scored, piece):
    """Per-token next-token loss [scored - 1] of the last ``scored`` ids after the ``context`` ids before them."""
    target = ids[len(ids) - scored:]
    prefix = ids[len(ids) - scored - context:len(ids) - scored]
    cache = None
    for start in range(0, context, piece):
        out = model(input_ids=prefix[start:start + piece][None], past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        cache = out.past_key_values
    logits = model(input_ids=target[None], past_key_values=cache, use_cache=cache is not None).logits[0, :-1]
    return torch.nn.functional.cross_entropy(logits.float(), target[1:], reduction="none")


def parse_value(text):
    """A --set value: None, True, False, an integer, a number, else the string."""
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="a model folder (repeat for several)")
    parser.add_argument("--lengths", default="0,2048,8192,16384,32768", help="context lengths L, comma-separated")
    parser.add_argument("--scored", type=int, default=1024, help="tokens scored after each context (>= 513)")
    parser.add_argument("--piece", type=int, default=2048, help="tokens fed per call while reading the context")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every model, e.g. memory_size=0 (None, True, False, numbers)")
    parser.add_argument("--text-file", default=None, help="score this text instead of the packaged corpus")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    try:
        args.lengths = sorted({int(x) for x in args.lengths.split(",")})
        args.overrides = {k: parse_value(v) for k, v in (item.split("=", 1) for item in args.set)}
    except ValueError:
        parser.error("--lengths takes integers (0,2048,...); --set takes KEY=VALUE")
    if min(args.lengths) < 0 or args.scored < 513 or args.piece < 1:
        parser.error("need --lengths >= 0, --scored >= 513 and --piece >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    import aaren_hf  # noqa: F401  (registers the Aaren classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    print("| model | L | loss | first 256 | last 512 | seconds |\n|---|---|---|---|---|---|", flush=True)
    for path in args.model:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **args.overrides).eval()
        ids = text_ids(tokenizer, max(args.lengths) + args.scored, text_file=args.text_file)
        for context in args.lengths:
            start = time.perf_counter()
            loss = scored_loss(model, ids, context, args.scored, args.piece)
            row = dict(model=path, context=context, loss=loss.mean().item(), first_256=loss[:256].mean().item(),
                       last_512=loss[-512:].mean().item(), seconds=time.perf_counter() - start)
            rows.append(row)
            print(f"| {path} | {context} | {row['loss']:.3f} | {row['first_256']:.3f} | {row['last_512']:.3f} | "
                  f"{row['seconds']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"overrides": args.overrides, "scored": args.scored, "rows": rows}, handle, indent=1)
    return rows


if __name__ == "__main__":
    main()
