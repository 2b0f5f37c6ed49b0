#!/usr/bin/env bash
# EAGLE-3, CPU, 2 threads: does position-robust training keep EAGLE-3
# accurate past its 512-token training windows, with or without a context window of 512 and
# SharpDraft? The ablation: the stage-3 checkpoint (shipped until stage 4 continued it; taken
# from git history here) is 14 minutes of plain training from
# the stage-2 weights on the first 2,320 corpus conversations; the position-robust run repeats
# it exactly (same weights, data, budget and seed) with --position-skip 0.5. Then the
# teacher-forced sweep (frozen vs slope 0.2, by context bucket, the 2 held-out texts of 7,168
# tokens) of both, each with and without --context-window 512, and their anchor-by-anchor
# comparison against stage 3's frozen drafter (float32, as the earlier sweeps on CPUs where
# --dtype auto picks it). Writes benchmarks/results/position-robust-eagle3-cpu/ (sweep-shipped* are
# stage 3's, the checkpoint shipped when they were run).
set -euo pipefail
cd "$(dirname "$0")/.."
S2=runs/stage2/eagle3-smollm2            # the stage-2 and stage-3 weights, from git history
SHIPPED=runs/stage3/eagle3-smollm2
PSKIP=runs/stage3/eagle3-pskip
mkdir -p "$S2" "$SHIPPED"
for f in config.json model.safetensors training.json; do
  git show 53bb664:python/sharpdraft/checkpoints/eagle3-smollm2/$f > "$S2/$f"
  git show 03fd01a:python/sharpdraft/checkpoints/eagle3-smollm2/$f > "$SHIPPED/$f"
done
sharpdraft train eagle3 --corpus corpus --tokens 456971 --eval-tokens 8192 --seq-len 1024 \
  --threads 2 --steps 1000000 --warmup 30 --eval-every 250 --max-minutes 14 --init-from "$S2" \
  --lr 1e-3 --window 512 --ttt-steps 3 --position-skip 0.5 --out "$PSKIP"
O=benchmarks/results/position-robust-eagle3-cpu
SW=(--length 7168 --sequences 3 --per-bucket 96 --scalings "slope 0.2" --dtype float32 --threads 2)
for name in shipped pskip; do
  if [ "$name" = shipped ]; then P=$SHIPPED; else P=$PSKIP; fi
  sharpdraft analyze sweep --drafter eagle3 --drafter-path "$P" "${SW[@]}" --out "$O/sweep-$name"
  sharpdraft analyze sweep --drafter eagle3 --drafter-path "$P" "${SW[@]}" --context-window 512 \
    --out "$O/sweep-$name-w512"
done
sharpdraft analyze compare "$O/sweep-shipped" "$O/sweep-shipped-w512" "$O/sweep-pskip" \
  "$O/sweep-pskip-w512" --out "$O/compare"
