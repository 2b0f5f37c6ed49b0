#!/usr/bin/env bash
# CPU, 2 threads: does position-robust training or a context window keep
# DFlash accurate past its 1,024-token training length, and does SharpDraft add to either?
# Two 12-minute continuations of the stage-2 DFlash checkpoint on the same corpus conversations,
# one plain and one with --position-skip 0.5 (the one shipped as stage 2b), then the
# teacher-forced sweep (frozen vs slope 0.2, by context bucket, 2 held-out texts of 7,168 tokens)
# of stage 2, both continuations, each with and without --context-window 1024. Writes
# benchmarks/results/position-robust-cpu/.
set -euo pipefail
cd "$(dirname "$0")/.."
S2=runs/stage2/dflash-smollm2            # the stage-2 weights, from git history
mkdir -p "$S2"
for f in config.json model.safetensors; do
  git show 9dcd957:python/sharpdraft/checkpoints/dflash-smollm2/$f > "$S2/$f"
done
TRAIN=(--corpus corpus --tokens 186698 --eval-tokens 8192 --seq-len 1024 --threads 2
       --steps 1000000 --warmup 30 --eval-every 250 --max-minutes 12 --init-from "$S2"
       --lr 1e-3 --gamma 2 --blocks 32 --anchor-warmup 0)
sharpdraft train dflash "${TRAIN[@]}" --position-skip 0.5 --out runs/stage2b/dflash-pskip
sharpdraft train dflash "${TRAIN[@]}" --out runs/stage2b/dflash-plain
O=benchmarks/results/position-robust-cpu
SW=(--length 7168 --sequences 3 --per-bucket 48 --scalings "slope 0.2" --threads 2)
for name in stage2 plain pskip; do
  if [ "$name" = stage2 ]; then P=$S2; else P=runs/stage2b/dflash-$name; fi
  sharpdraft analyze sweep --drafter dflash --drafter-path "$P" "${SW[@]}" --out "$O/sweep-$name"
  sharpdraft analyze sweep --drafter dflash --drafter-path "$P" "${SW[@]}" --context-window 1024 \
    --out "$O/sweep-$name-w1024"
done
