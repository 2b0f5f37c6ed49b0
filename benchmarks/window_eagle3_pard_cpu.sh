#!/usr/bin/env bash
# EAGLE-3 and PARD, CPU, 2 threads: does a context window of n_ref = 512
# (their training length) keep them accurate on long contexts, and does SharpDraft add to it?
# The teacher-forced sweep (frozen vs slope 0.2, by context bucket, the held-out texts of 7,168
# tokens: 2 of the 3 asked for exist) of the shipped checkpoints with and without --context-window 512. Both drafters'
# teacher-forced forwards apply the window exactly as their sessions do (tests/test_eagle3.py,
# tests/test_pard.py). Writes benchmarks/results/window-cpu/.
set -euo pipefail
cd "$(dirname "$0")/.."
O=benchmarks/results/window-cpu
SW=(--length 7168 --sequences 3 --per-bucket 48 --scalings "slope 0.2" --threads 2)
for d in eagle3 pard; do
  sharpdraft analyze sweep --drafter "$d" "${SW[@]}" --out "$O/sweep-$d"
  sharpdraft analyze sweep --drafter "$d" "${SW[@]}" --context-window 512 --out "$O/sweep-$d-w512"
done
