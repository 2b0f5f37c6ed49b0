#!/usr/bin/env bash
# Ship a trained drafter run as the package's checkpoint of its kind: the run's config.json,
# model.safetensors and training.json (with its "stage") go to
# python/sharpdraft/checkpoints/<kind>-smollm2/, the shipped stage's training.json and the run's
# train_log.jsonl to docs/training/<kind>/ (training_stage<old>.json, train_log_stage<new>.jsonl),
# and the model card is rewritten from the new records (with the task suite's rows when SUITE
# names a bench.json). RECIPE.md is written by hand.
#   bash scripts/ship_drafter.sh RUN_FOLDER KIND STAGE
#   e.g. SUITE=benchmarks/results/tasks-cpu/bench.json \
#        bash scripts/ship_drafter.sh runs/broad/eagle3-smollm2 eagle3 13
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 3 ] || { echo "usage: ship_drafter.sh RUN_FOLDER KIND STAGE" >&2; exit 2; }
RUN=$1; KIND=$2; STAGE=$3
DEST=python/sharpdraft/checkpoints/$KIND-smollm2
LOGS=docs/training/$KIND
for f in config.json model.safetensors training.json train_log.jsonl; do
  [ -f "$RUN/$f" ] || { echo "ship_drafter.sh: $RUN/$f: missing" >&2; exit 2; }
done
[ -d "$DEST" ] || { echo "ship_drafter.sh: $DEST: no such checkpoint folder" >&2; exit 2; }
OLD=$(python -c "import json,sys; print(json.load(open(sys.argv[1])).get('stage', ''))" \
      "$DEST/training.json")
[ "$OLD" != "$STAGE" ] || { echo "ship_drafter.sh: $DEST is already stage $STAGE" >&2; exit 2; }
mkdir -p "$LOGS"
[ -z "$OLD" ] || cp "$DEST/training.json" "$LOGS/training_stage$OLD.json"
cp "$RUN/train_log.jsonl" "$LOGS/train_log_stage$STAGE.jsonl"
cp "$RUN/config.json" "$RUN/model.safetensors" "$DEST/"
python - "$RUN/training.json" "$DEST/training.json" "$STAGE" <<'EOF'
import json, os, sys
src, dst, stage = sys.argv[1:]
record = {"stage": stage, **json.load(open(src))}
with open(dst + ".partial", "w") as f:
    f.write(json.dumps(record, indent=2) + "\n")
os.replace(dst + ".partial", dst)
EOF
python -m sharpdraft.training.card "$DEST" ${SUITE:+--suite "$SUITE"}
