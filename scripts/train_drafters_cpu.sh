#!/usr/bin/env bash
# Stage 2 of the shipped drafters of SmolLM2-135M-Instruct: continue each stage-1 checkpoint
# (trained on packed raw text; the commands are in its RECIPE.md) on the self-distilled corpus
# in corpus/ (the target's own responses; loss on response tokens, the prompt as context), on
# CPU. The shipped checkpoints under python/sharpdraft/checkpoints/ came from this script.
#   bash scripts/train_drafters_cpu.sh [MINUTES_PER_DRAFTER] [OUT_ROOT]
# MINUTES_PER_DRAFTER (default 12): each loop's time budget (its cosine schedule ends with it);
# OUT_ROOT (default runs/stage2): receives <drafter>-smollm2/ (copy config.json,
# model.safetensors and training.json into python/sharpdraft/checkpoints/<drafter>-smollm2/).
# INIT (default python/sharpdraft/checkpoints) holds the checkpoints continued from. The corpus
# feature cache is built once (under $SHARPDRAFT_HOME/train_cache) and shared by all three.
set -euo pipefail
cd "$(dirname "$0")/.."
MIN=${1:-12}
OUT=${2:-runs/stage2}
INIT=${INIT:-python/sharpdraft/checkpoints}
THREADS=${THREADS:-2}
DATA=(--corpus corpus --tokens 1000000000 --eval-tokens 8192 --seq-len 1024 --threads "$THREADS"
      --steps 1000000 --warmup 30 --eval-every 250 --max-minutes "$MIN")

sharpdraft train dflash "${DATA[@]}" --cache-only --out "$OUT/dflash-smollm2"
sharpdraft train dflash "${DATA[@]}" --init-from "$INIT/dflash-smollm2" --lr 1e-3 --gamma 2 \
  --blocks 32 --anchor-warmup 0 --out "$OUT/dflash-smollm2"
sharpdraft train eagle3 "${DATA[@]}" --init-from "$INIT/eagle3-smollm2" --lr 1e-3 --window 512 \
  --ttt-steps 3 --out "$OUT/eagle3-smollm2"
sharpdraft train pard "${DATA[@]}" --init-from "$INIT/pard-smollm2" --lr 3e-4 --window 512 \
  --out "$OUT/pard-smollm2"
