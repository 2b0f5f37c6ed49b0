// linear_kernel.h: the register-blocked panel kernel of the CPU linear layer (linear_cpu.h).
//
// Included once by each ISA unit (linear_base.cpp, linear_avx2.cpp, linear_avx512.cpp) after it
// defines SHARP_CPU_ISA (a namespace name), SHARP_VEC_WIDTH (floats per vector),
// SHARP_PANEL_VECS (vectors per panel row), SHARP_PANEL_ROWS (rows per register block) and
// SHARP_CPU_TARGET, as tile_kernel.h does. Accumulators: SHARP_PANEL_ROWS x SHARP_PANEL_VECS
// vectors, plus SHARP_PANEL_VECS weight vectors and one broadcast, within the register file.
#include <cstring>

#include "cpu_runtime/linear_cpu.h"

#pragma GCC push_options
SHARP_CPU_TARGET

namespace sharpdraft {
namespace cpu {
namespace SHARP_CPU_ISA {
namespace {

constexpr int VW = SHARP_VEC_WIDTH;
constexpr int NV = SHARP_PANEL_VECS;
constexpr int MR = SHARP_PANEL_ROWS;
constexpr int NP = NV * VW;  // panel width
// Software prefetch (to all cache levels) about 3 KB ahead in the panel, one per cache line of
// a panel row: the hardware prefetcher alone let the FMAs wait for memory (one streamed pass
// over all the default target's decoder linears at 8 rows, 2 Xeon cores: 33 -> 26 ms).
constexpr int64_t kAheadFloats = (3072 / (NP * 4)) * NP;
constexpr int kLinesPerRow = NP * 4 / 64 > 0 ? NP * 4 / 64 : 1;
#include "common/simd_vec.h"  // vf, load, store, splat

// R rows (R <= MR) of x times one panel.
template <int R>
void block(const PanelTask& t, const float* x, float* y) {
  vf acc[R][NV];
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[m][j] = t.bias ? load(t.bias + j * VW) : vf{};
  }
  const float* w = t.panel;
  for (int64_t kk = 0; kk < t.k; ++kk, w += NP) {
    if (t.end - w > kAheadFloats + NP) {  // within the packed weight (the next panel too)
#pragma GCC unroll 4
      for (int l = 0; l < kLinesPerRow; ++l) __builtin_prefetch(w + kAheadFloats + 16 * l, 0, 3);
    }
    vf wv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) wv[j] = load(w + j * VW);
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) {
      const vf xs = splat(x[m * t.ldx + kk]);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[m][j] += xs * wv[j];
    }
  }
  for (int m = 0; m < R; ++m) {
    float* out = y + m * t.ldy;
    if (t.cols == NP) {
      for (int j = 0; j < NV; ++j) store(out + j * VW, acc[m][j]);
    } else {  // the last panel of a width that is not a multiple of NP
      float tmp[NP];
      for (int j = 0; j < NV; ++j) store(tmp + j * VW, acc[m][j]);
      memcpy(out, tmp, t.cols * sizeof(float));
    }
  }
}

template <int R>
void block_rows(int r, const PanelTask& t, const float* x, float* y) {
  if (r == R) {
    block<R>(t, x, y);
  } else if constexpr (R > 1) {
    block_rows<R - 1>(r, t, x, y);
  }
}

}  // namespace

inline void panel(const PanelTask& t) {
  for (int64_t m0 = 0; m0 < t.rows; m0 += MR) {
    const int r = static_cast<int>(t.rows - m0 < MR ? t.rows - m0 : MR);
    block_rows<MR>(r, t, t.x + m0 * t.ldx, t.y + m0 * t.ldy);
  }
}

}  // namespace SHARP_CPU_ISA
}  // namespace cpu
}  // namespace sharpdraft
