#!/usr/bin/env bash
# Continue the shipped drafters of SmolLM2-135M-Instruct on the self-distilled corpus in corpus/
# (the target's own responses; loss on response tokens, the prompt as context), on CPU. Each run
# starts from the checkpoint under $INIT and keeps its best held-out checkpoint; the shipped
# checkpoints under python/sharpdraft/checkpoints/ came from this script (their RECIPE.md says
# which run and which corpus).
#   bash scripts/train_drafters_cpu.sh [MINUTES_PER_DRAFTER] [OUT_ROOT]
# MINUTES_PER_DRAFTER (default 12): each loop's time budget (its cosine schedule ends with it);
# OUT_ROOT (default runs/stage2): receives <drafter>-smollm2/ (copy config.json,
# model.safetensors and training.json into python/sharpdraft/checkpoints/<drafter>-smollm2/,
# train_log.jsonl into docs/training/<drafter>/ as train_log_stage<N>.jsonl).
# Env: CORPUS (default corpus; corpus-broad is the broad one, docs/training.md), DRAFTERS
# (default "dflash eagle3 pard"; longspark too), INIT (default
# python/sharpdraft/checkpoints), THREADS (default 2), TOKENS (train response tokens taken from
# the corpus, in corpus order; default all), LR_SCALE (default 1: `--lr-scale`, multiplies each
# recipe's default peak learning rate; continuations of trained weights use 0.5, the shipped
# DFlash's stage 12 0.15), SEED (default 0: which windows and anchors are drawn), CACHE_DTYPE
# (default float32; bfloat16 fills the train cache under autocast, about 1.6x faster on an AMX
# CPU and 4.4x slower on an AVX2-only one), AUTOCAST (default off; bfloat16 runs each training
# step under autocast: 1.6-1.7x faster EAGLE-3 and PARD steps on an AMX CPU, about the same for
# DFlash). auto, for either, measures this machine (bfloat16 where it is faster); the defaults
# stay float32 / off so that the commands of earlier stages run as they did. The feature cache
# is built once (under $SHARPDRAFT_HOME/train_cache) and shared by every drafter; a grown corpus
# caches only its new conversations.
# Every other option is the recipe's default, which is what the shipped weights were trained
# with (`sharpdraft train <drafter> --help`; each RECIPE.md gives the full command): peak
# learning rates dflash 1e-3, eagle3 1e-3, pard 3e-4, longspark 4e-4; --warmup 30, --seq-len
# 1024, --eval-tokens 8192, --eval-every 250 (longspark 500); DFlash --gamma 2 --blocks 64
# --anchor-warmup 0 --position-skip 0.5 (stage 6 and earlier ran --blocks 32); EAGLE-3 and PARD
# --window 512, EAGLE-3 --ttt-steps 3.
set -euo pipefail
cd "$(dirname "$0")/.."
MIN=${1:-12}
OUT=${2:-runs/stage2}
INIT=${INIT:-python/sharpdraft/checkpoints}
THREADS=${THREADS:-2}
TOKENS=${TOKENS:-1000000000}
DRAFTERS=${DRAFTERS:-dflash eagle3 pard}
LR_SCALE=${LR_SCALE:-1}
SEED=${SEED:-0}
CACHE_DTYPE=${CACHE_DTYPE:-float32}
AUTOCAST=${AUTOCAST:-off}
CORPUS=${CORPUS:-corpus}
DATA=(--corpus "$CORPUS" --tokens "$TOKENS" --threads "$THREADS" --steps 1000000
      --max-minutes "$MIN" --seed "$SEED" --cache-dtype "$CACHE_DTYPE" --autocast "$AUTOCAST")

sharpdraft train dflash "${DATA[@]}" --cache-only --out "$OUT/dflash-smollm2"
for d in $DRAFTERS; do
  sharpdraft train "$d" "${DATA[@]}" --init-from "$INIT/$d-smollm2" --lr-scale "$LR_SCALE" \
    --out "$OUT/$d-smollm2"
done
