#!/usr/bin/env bash
# The LongSpark measurements in the README (CPU, 2 threads, nothing else running), written under
# benchmarks/results/longspark-cpu/: drafting cost and drafter state against context for LongSpark,
# DFlash and EAGLE-3; the bench (held-out corpus prompts + Genesis contexts; frozen and both
# SharpDraft scopes); the teacher-forced sweep by context bucket on long held-out text (both
# scopes); the main job's command with --drafter longspark.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/longspark-cpu
T=(--threads 2)
mkdir -p "$OUT"
python benchmarks/drafter_cost_cpu.py "${T[@]}" --out "$OUT/drafter-cost"
sharpdraft bench --drafter longspark --lengths 1024 4096 --maths 0 --corpus corpus \
  --corpus-prompts 4 --max-new-tokens 128 --out "$OUT/bench" "${T[@]}"
sharpdraft analyze sweep --drafter longspark --length 7168 --sequences 3 --per-bucket 48 \
  --scalings "slope 0.2" "const e^0.4" --out "$OUT/sweep" "${T[@]}"
sharpdraft generate --drafter longspark --kjv-context 2048 --compare-ar --max-new-tokens 256 \
  --json "${T[@]}" > "$OUT/main_job_longspark.json"
sharpdraft generate --drafter longspark --kjv-context 2048 --compare-ar --max-new-tokens 256 \
  --json "${T[@]}" > "$OUT/main_job_longspark_repeat.json"
sharpdraft generate --drafter longspark --kjv-context 2048 --compare-ar --max-new-tokens 256 \
  --no-sharp --json "${T[@]}" > "$OUT/main_job_longspark_frozen.json"
sharpdraft generate --drafter eagle3 --tree --kjv-context 2048 --compare-ar --max-new-tokens 256 \
  --json "${T[@]}" > "$OUT/main_job_eagle3_tree_same_session.json"
