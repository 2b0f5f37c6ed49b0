#!/usr/bin/env bash
# Retrain the three shipped drafters of SmolLM2-135M-Instruct on the self-distilled corpus, on
# CPU, with the commands their RECIPE.md files record (the checkpoints under
# python/sharpdraft/checkpoints/ came from this script). Usage:
#   bash scripts/train_drafters_cpu.sh [MINUTES_PER_DRAFTER] [OUT_ROOT]
# MINUTES_PER_DRAFTER (default 12) is each training loop's time budget (the cosine schedule ends
# with it); OUT_ROOT (default python/sharpdraft/checkpoints) receives <drafter>-smollm2/.
# The feature cache of the corpus is built once (under $SHARPDRAFT_HOME/train_cache) and shared.
set -euo pipefail
cd "$(dirname "$0")/.."
MIN=${1:-12}
OUT=${2:-python/sharpdraft/checkpoints}
THREADS=${THREADS:-2}
DATA=(--corpus corpus --tokens 1000000000 --eval-tokens 8192 --seq-len 1024 --threads "$THREADS")

sharpdraft train dflash "${DATA[@]}" --cache-only --out "$OUT/dflash-smollm2"
sharpdraft train dflash "${DATA[@]}" --block-size 8 --blocks 16 --steps 1000000 \
  --eval-every 300 --max-minutes "$MIN" --out "$OUT/dflash-smollm2"
sharpdraft train eagle3 "${DATA[@]}" --window 512 --ttt-steps 3 --steps 1000000 \
  --eval-every 300 --max-minutes "$MIN" --out "$OUT/eagle3-smollm2"
sharpdraft train pard "${DATA[@]}" --window 512 --steps 1000000 \
  --eval-every 300 --max-minutes "$MIN" --out "$OUT/pard-smollm2"
