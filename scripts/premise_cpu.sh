#!/usr/bin/env bash
# SharpDraft's premise, tested where it can hold (docs/premise.md): a DFlash drafter trained on
# short key windows (WINDOW keys, default 256) with position-robust positions spanning the
# target's 8k context, measured at contexts from 1x to 32x its window against the shipped DFlash
# (trained on 1,024 keys) on held-out text, frozen vs every SharpDraft scaling.
#   bash scripts/premise_cpu.sh [MINUTES] [OUT_ROOT]
# MINUTES (default 30): the training run's time budget; OUT_ROOT (default runs/premise) receives
# the checkpoints (dflash-w<WINDOW>/, a copy of the shipped one, each calibrated); the reports go
# to $RESULTS (default benchmarks/results/premise-cpu). Each step is skipped when its output
# exists, so a cut run resumes. Takes about 80 minutes on 2 cores; time nothing else meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
MIN=${1:-30}
OUT=${2:-runs/premise}
WINDOW=${WINDOW:-256}
RESULTS=${RESULTS:-benchmarks/results/premise-cpu}
SHIPPED=python/sharpdraft/checkpoints/dflash-smollm2
SHORT=$OUT/dflash-w$WINDOW
PINNED=(--dtype float32 --weights float32 --threads 2)   # the float32 target everywhere

if [[ ! -f $SHORT/training.json ]]; then
  # the shipped DFlash continued on WINDOW-key sequences of the corpus; half the steps skip
  # their positions forward (one random gap) so distances up to 8,192 stay in distribution
  sharpdraft train dflash --corpus corpus --seq-len "$WINDOW" --tokens 120000 --eval-tokens 8192 \
    --threads 2 --steps 1000000 --warmup 30 --eval-every 250 --max-minutes "$MIN" --seed 11 \
    --cache-dtype auto --autocast auto --init-from "$SHIPPED" --lr 3e-4 --gamma 2 --blocks 32 \
    --position-skip 0.5 --max-position 8192 --draft-vocab 0 --out "$SHORT"
fi
if [[ ! -f $OUT/dflash-shipped/config.json ]]; then
  mkdir -p "$OUT/dflash-shipped"
  cp "$SHIPPED/config.json" "$SHIPPED/model.safetensors" "$OUT/dflash-shipped/"
fi

for name in shipped "w$WINDOW"; do
  path=$OUT/dflash-$name
  # per-layer slopes from each layer's top-k mass at n_ref, written into the copy's config.json
  if ! grep -q '"sharp_slopes": \[' "$path/config.json"; then
    sharpdraft analyze calibrate --drafter-path "$path" "${PINNED[@]}" \
      --out "$RESULTS/calibrate-$name"
  fi
  # teacher-forced acceptance by context bucket (1x-32x of 256 keys), every scaling, paired
  [[ -f $RESULTS/sweep-$name/sweep.json ]] || sharpdraft analyze sweep --drafter-path "$path" \
    "${PINNED[@]}" --length 8064 --sequences 3 --edges 128 256 512 1024 2048 4096 8064 \
    --per-bucket 24 --out "$RESULTS/sweep-$name"
  # top-k mass, recent / far share and argmax distance of each layer against context
  [[ -f $RESULTS/mass-$name/mass.json ]] || sharpdraft analyze mass --drafter-path "$path" \
    "${PINNED[@]}" --lengths 256 1024 2048 4096 7680 --no-target --out "$RESULTS/mass-$name"
done

# real decoding tau on held-out licence documents at 1x-30x of 256 keys
[[ -f $RESULTS/decode/premise_decode.json ]] || python benchmarks/premise_cpu.py \
  --drafter shipped="$OUT/dflash-shipped" "w$WINDOW=$SHORT" --out "$RESULTS/decode"
