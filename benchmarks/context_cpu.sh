#!/usr/bin/env bash
# Decoding tau and speed by context length for every shipped drafter, frozen against SharpDraft
# by context, 1k-7k tokens: Genesis passages of 1k-7k tokens plus a summary task,
# 128 new tokens, float32, 2 threads, each against target-only decoding in the same run.
# Run with nothing else on the machine; writes benchmarks/results/context-cpu/bench-<drafter>/.
#   bash benchmarks/context_cpu.sh [DRAFTERS]      (default: "dflash eagle3 pard")
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/context-cpu
for d in ${1:-dflash eagle3 pard}; do
  sharpdraft bench --drafter "$d" --lengths 1024 2048 4096 7168 --maths 0 --max-new-tokens 128 \
    --threads 2 --dtype float32 --out "$OUT/bench-$d"
done
