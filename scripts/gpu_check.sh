#!/usr/bin/env bash
# On a fresh GPU machine: build the extensions (CPU + CUDA), run tests/test_cuda.py, run the
# CUDA benchmark, and write everything under $OUT (default build/gpu_check):
#   build.log, smoke.log, test_unsupported.log (+ a crash diagnosis when that test crashes),
#   test_cuda.log, bench.log, results_cuda.md (+ .json), nvidia-smi.txt: 8 files, the most
#   the device tool brings back.
# Env: PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default 9.0a), MAX_JOBS (default nproc),
# BENCH_ARGS (extra bench_cuda.py arguments), TEST_TIMEOUT / BENCH_TIMEOUT (seconds; BENCH_TIMEOUT=0
# skips the benchmark),
# SHARPDRAFT_COMMIT (the commit the results are written against; else `git rev-parse HEAD`),
# TOTAL_BUDGET (seconds for the whole script: shortens the test run to keep the benchmark).
# Pure-Python test dependencies missing on the machine may be supplied in build/gpu_pydeps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/build/gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 SHARPDRAFT_CUDA=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if ! "$PY" -c "import pytest" 2>/dev/null && [[ -d build/gpu_pydeps ]]; then
  export PYTHONPATH="$PWD/build/gpu_pydeps${PYTHONPATH:+:$PYTHONPATH}"
fi
status=0
script_start=$(date +%s)

{ nvidia-smi; "$PY" -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; nvcc --version | tail -2; } \
  >"$OUT/nvidia-smi.txt" 2>&1
cat "$OUT/nvidia-smi.txt"

echo "== build"
# Build with the system compiler: one GPU image sets CXX to a wrapper that links libstdc++
# statically into each extension, whose private, uninitialised locale then crashes the process
# the first time an error message formats a number (benchmarks/results/kernel-gpu/results_cuda_h200.md).
if [[ -x /usr/bin/g++ && -x /usr/bin/gcc ]]; then
  export CXX=/usr/bin/g++ CC=/usr/bin/gcc
fi
start=$(date +%s)
if ! "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  echo "gpu_check: build failed (see build.log)"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
for so in sharpdraft_ext/_C*.so sharpdraft_ext/_cpu_runtime*.so sharpdraft_ext/_cuda*.so; do
  if ! ldd "$so" | grep -q "libstdc++"; then
    echo "gpu_check: $so does not link libstdc++ dynamically (static copy: errors would crash); set CXX"
    exit 1
  fi
done
grep -iE "spill|warning" "$OUT/build.log" | grep -v "0 bytes spill" | head -20

echo "== smoke"
"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/smoke.log"
import torch, sharpdraft_ext as ext
q = torch.randn(1, 2, 5, 64, device="cuda", dtype=torch.bfloat16)
out, lse = ext.sharp_attention(q, q, q, causal=True, return_lse=True)
torch.cuda.synchronize()
print("smoke ok", out.float().abs().sum().item(), lse.tolist())
PYEOF

# Tests run with Python's faulthandler (a crash prints the Python traceback of every thread).
# test_unsupported_inputs_raise runs first in a process of its own: it once segfaulted after
# the rest of the file had run, so a crash there must not hide the other tests.
export PYTHONFAULTHANDLER=1
UNSUPPORTED=tests/test_cuda.py::test_unsupported_inputs_raise
echo "== test_cuda: $UNSUPPORTED (own process)"
timeout 120 "$PY" -X faulthandler -m pytest -q -p no:cacheprovider "$UNSUPPORTED" -rfE \
  2>&1 | tee "$OUT/test_unsupported.log" | tail -40
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then
  status=1
  echo "gpu_check: $UNSUPPORTED exited with $rc; step-by-step repro appended to test_unsupported.log"
  diag="$(mktemp -d)/segv_diag.py"
  cat >"$diag" <<'PYEOF'
import faulthandler, sys
faulthandler.enable()
def step(msg):
    print(msg, flush=True)
step("import torch")
import torch
step("import sharpdraft_ext")
import sharpdraft_ext as ext
for dtype, d in ((torch.float32, 64), (torch.float16, 96), (torch.bfloat16, 96), (torch.float16, 32)):
    step(f"randn cpu {dtype} D={d}")
    q = torch.randn(1, 2, 8, d, dtype=dtype)
    step("to cuda")
    qc = q.cuda()
    torch.cuda.synchronize()
    step("sharp_attention")
    try:
        ext.sharp_attention(qc, qc, qc)
        step("returned (no error!)")
    except Exception as err:  # noqa: BLE001
        step(f"raised {type(err).__name__}: {str(err)[:200]}")
step("done")
PYEOF
  # A host-side backtrace of the crash: gdb, or cuda-gdb (which also debugs host code).
  gdb_bin="$(command -v gdb || command -v cuda-gdb || true)"
  { echo "== segv_diag.py"; timeout 60 "$PY" -X faulthandler "$diag"; echo "exit $?";
    if [[ -n "$gdb_bin" ]]; then
      echo "== $gdb_bin backtrace"
      timeout 60 "$gdb_bin" -q -batch -ex run -ex bt --args "$PY" "$diag"
    fi; } 2>&1 | tee -a "$OUT/test_unsupported.log" | tail -60
fi

echo "== test_cuda (the rest) and test_errors (error messages: a broken C++ runtime shows here)"
# With TOTAL_BUDGET (seconds for the whole script), the tests get what is left after keeping
# BENCH_TIMEOUT + 15 s for the benchmark, so a slow build cannot crowd the benchmark out.
test_timeout="${TEST_TIMEOUT:-200}"
if [[ -n "${TOTAL_BUDGET:-}" ]]; then
  left=$(( TOTAL_BUDGET - ($(date +%s) - script_start) - ${BENCH_TIMEOUT:-170} - 15 ))
  (( left < test_timeout )) && test_timeout=$left
  (( test_timeout < 30 )) && test_timeout=30
  echo "tests get ${test_timeout} s"
fi
timeout "$test_timeout" "$PY" -X faulthandler -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_errors.py \
  --deselect "$UNSUPPORTED" -rfE --maxfail=40 2>&1 | tee "$OUT/test_cuda.log" | tail -60
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
# the vLLM plugin's operation on CUDA (its own run: it imports transformers, which a bare GPU
# image may lack; appended to the same log)
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_vllm_plugin.py -k scaled_query \
  -rfE 2>&1 | tee -a "$OUT/test_cuda.log" | tail -15
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

if [[ "${BENCH_TIMEOUT:-170}" == 0 ]]; then
  echo "gpu_check: benchmark skipped (BENCH_TIMEOUT=0); done (status $status)"
  exit $status
fi
echo "== benchmark"
if [[ -z "${SHARPDRAFT_COMMIT:-}" ]]; then
  SHARPDRAFT_COMMIT="$(git rev-parse --short HEAD 2>/dev/null || true)"
fi
export SHARPDRAFT_COMMIT
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-170}" "$PY" benchmarks/bench_cuda.py --out "$OUT/results_cuda.md" ${BENCH_ARGS:-} \
  >"$OUT/bench.log" 2>&1
[[ $? -eq 0 ]] || { status=1; tail -30 "$OUT/bench.log"; }
[[ -f "$OUT/results_cuda.md" ]] && cat "$OUT/results_cuda.md"
echo "gpu_check: done (status $status)"
exit $status
