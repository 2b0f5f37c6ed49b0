#!/usr/bin/env bash
# Continue the shipped drafters of SmolLM2-135M-Instruct on the self-distilled corpus in corpus/
# (the target's own responses; loss on response tokens, the prompt as context), on CPU. Each run
# starts from the checkpoint under $INIT and keeps its best held-out checkpoint; the shipped
# checkpoints under python/sharpdraft/checkpoints/ came from this script (their RECIPE.md says
# which run and which corpus).
#   bash scripts/train_drafters_cpu.sh [MINUTES_PER_DRAFTER] [OUT_ROOT]
# MINUTES_PER_DRAFTER (default 12): each loop's time budget (its cosine schedule ends with it);
# OUT_ROOT (default runs/stage2): receives <drafter>-smollm2/ (copy config.json,
# model.safetensors, training.json and train_log.jsonl into
# python/sharpdraft/checkpoints/<drafter>-smollm2/).
# Env: DRAFTERS (default "dflash eagle3 pard"; longspark too), INIT (default
# python/sharpdraft/checkpoints), THREADS (default 2), TOKENS (train response tokens taken from
# the corpus, in corpus order; default all). The feature cache is built once (under
# $SHARPDRAFT_HOME/train_cache) and shared by every drafter; a grown corpus caches only its new
# conversations.
set -euo pipefail
cd "$(dirname "$0")/.."
MIN=${1:-12}
OUT=${2:-runs/stage2}
INIT=${INIT:-python/sharpdraft/checkpoints}
THREADS=${THREADS:-2}
TOKENS=${TOKENS:-1000000000}
DRAFTERS=${DRAFTERS:-dflash eagle3 pard}
DATA=(--corpus corpus --tokens "$TOKENS" --eval-tokens 8192 --seq-len 1024 --threads "$THREADS"
      --steps 1000000 --warmup 30 --eval-every 250 --max-minutes "$MIN")
declare -A EXTRA=(
  [dflash]="--lr 1e-3 --gamma 2 --blocks 32 --anchor-warmup 0 --position-skip 0.5"
  [eagle3]="--lr 1e-3 --window 512 --ttt-steps 3"
  [pard]="--lr 3e-4 --window 512"
  [longspark]="--lr 4e-4 --eval-every 500"
)

sharpdraft train dflash "${DATA[@]}" --cache-only --out "$OUT/dflash-smollm2"
for d in $DRAFTERS; do
  # shellcheck disable=SC2086
  sharpdraft train "$d" "${DATA[@]}" --init-from "$INIT/$d-smollm2" ${EXTRA[$d]} \
    --out "$OUT/$d-smollm2"
done
