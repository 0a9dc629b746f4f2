# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""What the memory's quantizer costs: the teacher with its whole KV cache held in the memory's codes.

A memory entry of a converted model is read back through its ``MemoryCodes`` (one bfloat16 scale per key or value
vector; with ``memory_hadamard``, of the Hadamard-rotated vector). This script isolates the
quantizer from everything else: the untrained teacher reads every key and value of its cache through it (a
StreamingLLM cache whose window covers the whole window of text, so nothing is evicted), for each code width and
with and without the rotation, and its perplexity on held-out windows is printed beside the teacher's own, in one
run. Rotary keys have a few channels far larger than the rest; without the rotation they set the scale, and at 4
bits the other channels round to zero.

    .venv/bin/python -P benchmarks/memory_codes.py --windows 8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def codes_table(teacher, windows: torch.Tensor, bits=(8, 4), batch_size: int = 4) -> list[dict]:
    """Rows {"codes", "bits", "hadamard", "ppl", "ratio", "kl"}: the teacher, then its cache in each code form;
    ``kl``: the mean KL divergence of the coded cache's next-token distribution from the teacher's (nats per token),
    which sees a quantizer's cost where perplexity ratios round to 1.00x. Perplexity is token-weighted over every
    window's tokens 1..L-1, as ``aaren_hf.conversion.evaluate.perplexity`` counts it; each model runs once per batch."""
    import torch.nn.functional as F

    from aaren_hf.conversion.evaluate import streaming_llm_baseline
    from aaren_hf.modeling_aaren import MemoryCodes

    length = windows.shape[1]
    forms = [MemoryCodes(b, rotate) for b in bits for rotate in (False, True)]
    cached = {codes: streaming_llm_baseline(teacher, 0, length, codes) for codes in forms}
    kl = dict.fromkeys(forms, 0.0)
    nll = dict.fromkeys([None, *forms], 0.0)  # summed over the predicted tokens; None: the teacher
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        targets = batch[:, 1:].unsqueeze(-1)
        with torch.no_grad():
            want = F.log_softmax(teacher(input_ids=batch).logits.float(), -1)
            nll[None] -= want[:, :-1].gather(-1, targets).double().sum().item()
            for form, model in cached.items():
                got = F.log_softmax(model(input_ids=batch).logits.float(), -1)
                kl[form] += (want.exp() * (want - got)).sum().item() / (windows.shape[0] * length)
                nll[form] -= got[:, :-1].gather(-1, targets).double().sum().item()
    ppl = {form: math.exp(total / (windows.shape[0] * (length - 1))) for form, total in nll.items()}
    rows = [{"codes": "none (the teacher)", "bits": None, "hadamard": False, "ppl": ppl[None], "ratio": 1.0,
             "kl": 0.0}]
    for codes in forms:
        rows.append({"codes": str(codes), "bits": codes.bits, "hadamard": codes.rotate, "ppl": ppl[codes],
                     "ratio": ppl[codes] / ppl[None], "kl": kl[codes]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default=None, help="teacher folder (default: the packaged SmolLM2-135M)")
    parser.add_argument("--data", action="append", default=None,
                        help="text sources, as aaren-convert takes them (default: the recipe's three corpora)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8, help="held-out windows to score (of the recipe's 16)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.windows < 1 or args.seq_len < 2:
        parser.error("--windows must be >= 1 and --seq-len >= 2")
    if args.threads:
        torch.set_num_threads(args.threads)

    from aaren_hf.conversion.assets import packaged_teacher_path
    from aaren_hf.conversion.convert import load_teacher
    from aaren_hf.conversion.data import load_token_windows

    tokenizer, teacher = load_teacher(args.teacher or str(packaged_teacher_path()))
    teacher.eval()
    sources = args.data or ["python-docs", "kernel-docs", "perl-docs"]
    windows = load_token_windows(tokenizer, sources, seq_len=args.seq_len, num_train=0,
                                 num_heldout=max(16, args.windows)).heldout[: args.windows]
    start = time.time()
    rows = codes_table(teacher, windows)
    print(f"{len(windows)} held-out windows of {args.seq_len} tokens ({', '.join(sources)}); "
          f"{time.time() - start:.0f} s\n")
    print("| cache held as | perplexity | / teacher | KL from the teacher, nats per token |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['codes']} | {r['ppl']:.3f} | {r['ratio']:.2f}x | {r['kl']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seq_len": args.seq_len, "windows": len(windows), "sources": sources, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
