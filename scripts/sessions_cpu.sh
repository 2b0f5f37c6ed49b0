#!/usr/bin/env bash
# The sessions study (issue 54, docs/premise.md): an EAGLE-3 continued from the shipped one on
# 256-key windows (position-robust: half the windows skip their positions forward, so distances
# up to 8,192 stay in distribution; n_ref 256), its per-layer slope calibrated, then the sessions
# suite (benchmarks/sessions_cpu.py) over it, the shipped EAGLE-3 and DFlash, with the window and
# sink rows. Each step is skipped when its output exists, so a cut run resumes.
#   bash scripts/sessions_cpu.sh [MINUTES] [OUT_ROOT]
# MINUTES (default 20): the training budget; OUT_ROOT (default runs/sessions) receives the
# checkpoint; the reports go to $RESULTS (default benchmarks/results/sessions-cpu). About 1.5
# hours on 2 cores (feature cache 20 min, training, the suite 45 min); time nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
MIN=${1:-20}
OUT=${2:-runs/sessions}
RESULTS=${RESULTS:-benchmarks/results/sessions-cpu}
SHORT=$OUT/eagle3-w256
SHIPPED=python/sharpdraft/checkpoints/eagle3-smollm2

if [[ ! -f $SHORT/training.json ]]; then
  sharpdraft train eagle3 --corpus corpus-broad --tokens 60000 --eval-tokens 8192 \
    --seq-len 1024 --threads 2 --steps 1000000 --warmup 30 --eval-every 250 \
    --max-minutes "$MIN" --seed 3 --cache-dtype float32 --autocast off --init-from "$SHIPPED" \
    --lr-scale 0.5 --window 256 --position-skip 0.5 --max-position 8192 --out "$SHORT"
fi
# the per-layer slope from the layer's top-k mass at n_ref, written into its config.json
if ! grep -q '"sharp_slopes": \[' "$SHORT/config.json"; then
  sharpdraft analyze calibrate --drafter-path "$SHORT" --threads 2 --out "$RESULTS/calibrate-w256"
fi
python benchmarks/sessions_cpu.py --short-window "$SHORT" --out "$RESULTS"
