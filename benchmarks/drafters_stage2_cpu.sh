#!/usr/bin/env bash
# The measurements of the stage-2 drafters in the README (CPU, 2 threads, nothing else running):
# the main job, the bench (held-out corpus prompts + Genesis contexts) for each drafter, and the
# dilution analyses of DFlash. Writes under benchmarks/results/dilution-cpu/
# (the stage-2 benches and main jobs it also writes there were superseded by results/drafters-cpu/).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/dilution-cpu
T=(--threads 2)
mkdir -p "$OUT"
sharpdraft generate --kjv-context 2048 --compare-ar --max-new-tokens 256 --draft-threshold 0.3 \
  --json "${T[@]}" > "$OUT/main_job_dflash.json"
sharpdraft generate --drafter eagle3 --tree --kjv-context 2048 --compare-ar --max-new-tokens 256 \
  --json "${T[@]}" > "$OUT/main_job_eagle3_tree.json"
for d in dflash eagle3 pard; do
  sharpdraft bench --drafter "$d" --lengths 1024 4096 --maths 0 --corpus corpus \
    --corpus-prompts 4 --max-new-tokens 128 --out "$OUT/bench-$d" "${T[@]}"
done
sharpdraft analyze mass --drafter dflash --lengths 256 1024 2048 4096 7000 --steps 6 \
  --out "$OUT/mass-dflash" "${T[@]}"
sharpdraft analyze sweep --drafter dflash --length 7168 --sequences 3 --per-bucket 24 \
  --out "$OUT/sweep-dflash" "${T[@]}"
sharpdraft analyze calibrate --drafter dflash --no-write --out "$OUT/calibrate-dflash" "${T[@]}"
