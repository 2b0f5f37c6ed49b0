// linear_cpu.h: the torch-free CPU linear layer for the few rows of a decode or verification
// step, y = x W^T + b with W prepacked into column panels.
//
// A speculative-decoding step runs the target over 1 to ~17 rows. Its linear layers are then
// bound by streaming the weights from memory, yet a general GEMM tuned for large row counts
// spends more time per row than the bytes require (measured: benchmarks/results/linear-cpu). This kernel
// reads each weight once per call: W (N, K) is repacked once into panels of panel_width()
// output columns, each a contiguous (K, panel_width) block, and every panel is multiplied by
// blocks of rows held in registers (rows x panel_width accumulators, x broadcast one scalar at
// a time, no horizontal sums). Panels are the unit of parallel work.
#pragma once

#include <cstdint>

#include "common/parallel.h"

namespace sharpdraft {
namespace cpu {

// Output columns per panel of the instruction set chosen at run time (48 with AVX-512, 16 with
// AVX2, 8 otherwise): the packed layout depends on it.
int64_t panel_width();

// Panels of an n-column weight: ceil(n / panel_width()).
int64_t panel_count(int64_t n);

// Floats of the packed form of an (n, k) weight: panel_count(n) * k * panel_width().
int64_t packed_floats(int64_t n, int64_t k);

// packed[p][kk][j] = w[(p * panel_width() + j) * k + kk], zero for columns >= n.
void pack_panels(const float* w, int64_t n, int64_t k, float* packed, const ParallelFor& pf);

// y[m, :n] = x[m, :k] W^T + bias for m < rows (x row stride ldx, y row stride ldy); bias may be
// null. `packed` as written by pack_panels for this (n, k).
void panel_linear(const float* x, int64_t rows, int64_t ldx, const float* packed, int64_t n,
                  int64_t k, const float* bias, float* y, int64_t ldy, const ParallelFor& pf);

// --- internal: the ISA-specific panel kernels ---------------------------------------------
struct PanelTask {
  const float* x;
  int64_t rows, ldx, k;
  const float* panel;   // (k, width) floats
  const float* end;     // one past the packed weight (prefetches stay below it)
  const float* bias;    // width floats (zero padded) or null
  float* y;             // column 0 of this panel in row 0
  int64_t ldy;
  int cols;             // valid columns of this panel (<= width)
};
using PanelFn = void (*)(const PanelTask&);
void panel_base(const PanelTask&);
void panel_avx2(const PanelTask&);
void panel_avx512(const PanelTask&);
constexpr int kPanelWidthBase = 8, kPanelWidthAvx2 = 16, kPanelWidthAvx512 = 48;

}  // namespace cpu
}  // namespace sharpdraft
