#!/usr/bin/env bash
# Compile-only check of every CUDA kernel unit (csrc/attention/cuda/*.cu; torch-free) for sm_80
# and sm_90a with warnings as errors. Needs only nvcc. Writes one ptxas resource report per unit
# and architecture to the directory given as $1 (default build/ptxas) plus a summary, and
# fails when a unit does not compile, warns, or any kernel spills registers.
#   scripts/cuda_compile_check.sh [report_dir]      (MAX_JOBS=N runs N compiles at once)
set -euo pipefail

cd "$(dirname "$0")/.."
out_dir="${1:-build/ptxas}"
mkdir -p "$out_dir"
NVCC="${NVCC:-nvcc}"
jobs="${MAX_JOBS:-2}"
archs=(sm_80 sm_90a)

command -v "$NVCC" >/dev/null || { echo "cuda_compile_check: nvcc not found" >&2; exit 2; }

compile_one() {  # unit arch -> writes $out_dir/<unit>.<arch>.txt, returns nvcc's status
  local src="$1" arch="$2" name
  name="$(basename "$src" .cu)"
  "$NVCC" -c -std=c++17 -arch="$arch" -Icsrc -Xptxas -v -Werror all-warnings \
    -o /dev/null "$src" >"$out_dir/$name.$arch.txt" 2>&1
}
export -f compile_one
export NVCC out_dir

units=(csrc/attention/cuda/*.cu)
printf '%s\n' "${archs[@]}" | while read -r arch; do
  for src in "${units[@]}"; do printf '%s %s\n' "$src" "$arch"; done
done | xargs -P "$jobs" -L 1 bash -c 'compile_one "$0" "$1" || echo "FAILED $0 $1" >>"$out_dir/failures.txt"' || true

status=0
if [[ -s "$out_dir/failures.txt" ]]; then
  echo "cuda_compile_check: compile errors or warnings:" >&2
  while read -r _ src arch; do
    echo "== $src ($arch)" >&2
    cat "$out_dir/$(basename "$src" .cu).$arch.txt" >&2
  done <"$out_dir/failures.txt"
  status=1
fi

# Summary: kernel, architecture, registers, spill bytes.
summary="$out_dir/summary.txt"
: >"$summary"
for report in "$out_dir"/*.sm_*.txt; do
  awk -v unit="$(basename "$report" .txt)" '
    /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); fn = substr($0, RSTART + 1, RLENGTH - 2) }
    /spill stores/ { spill = $5 + $9 }
    /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15);
                              printf "%-36s regs %3d  spill_bytes %4d  %s\n", unit, regs, spill, fn }
  ' "$report" >>"$summary"
done
sort -o "$summary" "$summary"
cat "$summary"
if awk '$5 > 0 { bad = 1 } END { exit !bad }' "$summary"; then
  echo "cuda_compile_check: register spills (spill_bytes > 0) above" >&2
  status=1
fi
rm -f "$out_dir/failures.txt"
[[ $status -eq 0 ]] && echo "cuda_compile_check: OK ($(wc -l <"$summary") kernels, no warnings, no spills)"
exit $status
