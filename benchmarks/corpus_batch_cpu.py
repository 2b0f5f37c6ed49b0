"""Corpus generation speed by batch size and prompt length (CPU): the default target, prepared
as `sharpdraft data generate` prepares it, runs `sharpdraft.inference.batched.generate_batch`
on random prompts of each length for each batch size, without EOS (every row decodes --new
tokens). The prefill is timed by a one-token run of the same batch, so decode tokens/s =
B (new - 1) / (total - prefill). Prints a Markdown table; --json writes the rows.

    python benchmarks/corpus_batch_cpu.py --batches 16 64 --lengths 150 700 --threads 2
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from sharpdraft.data.prompts import pad_id
from sharpdraft.eval.report import write_json
from sharpdraft.inference.batched import generate_batch
from sharpdraft.target import loading as models
from sharpdraft.target.runtime import TargetRuntime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--lengths", type=int, nargs="+", default=[150, 700],
                   help="prompt lengths in tokens")
    p.add_argument("--new", type=int, default=64, help="tokens generated per row")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    if args.new < 2 or min(args.batches) < 1 or min(args.lengths) < 1:
        p.error("--new must be >= 2, --batches and --lengths >= 1")
    torch.set_num_threads(args.threads)
    model, tokenizer, _ = models.load_target()
    model = TargetRuntime.prepare(model)       # generate_batch takes the prepared runtime
    pad = pad_id(tokenizer)
    rng = random.Random(0)
    rows = []
    print("| prompt tokens | batch | prefill s | decode ms / step | decode tok/s | overall tok/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        for b in args.batches:
            prompts = [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(b)]
            t0 = time.perf_counter()
            generate_batch(model, prompts, args.new, pad_token_id=pad, eos_token_id=None)
            total = time.perf_counter() - t0
            t0 = time.perf_counter()
            generate_batch(model, prompts, 1, pad_token_id=pad, eos_token_id=None)
            prefill = time.perf_counter() - t0
            decode = max(total - prefill, 1e-9)
            row = {"prompt_tokens": length, "batch": b, "prefill_s": round(prefill, 3),
                   "decode_ms_per_step": round(1000 * decode / (args.new - 1), 1),
                   "decode_tokens_per_s": round(b * (args.new - 1) / decode, 1),
                   "overall_tokens_per_s": round(b * args.new / total, 1)}
            rows.append(row)
            print(f"| {length} | {b} | {row['prefill_s']} | {row['decode_ms_per_step']} | "
                  f"{row['decode_tokens_per_s']} | {row['overall_tokens_per_s']} |", flush=True)
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
