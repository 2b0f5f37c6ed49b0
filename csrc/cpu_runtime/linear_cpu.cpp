// linear_cpu.cpp: packing, work split over panels and run-time ISA dispatch of the CPU linear
// layer (linear_cpu.h). Torch-free.
#include "cpu_runtime/linear_cpu.h"

#include <cstring>

#include "common/cpu_features.h"

namespace sharpdraft {
namespace cpu {
namespace {

struct PanelIsa {
  PanelFn fn;
  int64_t width;
};

const PanelIsa& panel_isa() {  // common/cpu_features.h's level, as the attention tile kernel
  static const PanelIsa table[3] = {{panel_base, kPanelWidthBase},
                                    {panel_avx2, kPanelWidthAvx2},
                                    {panel_avx512, kPanelWidthAvx512}};
  return table[isa_level()];
}

void run(int64_t n, const ParallelFor& pf, const std::function<void(int64_t, int64_t)>& body) {
  if (pf) {
    pf(n, body);
  } else {
    body(0, n);
  }
}

}  // namespace

int64_t panel_width() { return panel_isa().width; }

int64_t panel_count(int64_t n) { return (n + panel_width() - 1) / panel_width(); }

int64_t packed_floats(int64_t n, int64_t k) { return panel_count(n) * k * panel_width(); }

void pack_panels(const float* w, int64_t n, int64_t k, float* packed, const ParallelFor& pf) {
  const int64_t np = panel_width();
  run(panel_count(n), pf, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* dst = packed + p * k * np;
      for (int64_t kk = 0; kk < k; ++kk) {
        for (int64_t j = 0; j < np; ++j) {
          const int64_t col = p * np + j;
          dst[kk * np + j] = col < n ? w[col * k + kk] : 0.f;
        }
      }
    }
  });
}

void panel_linear(const float* x, int64_t rows, int64_t ldx, const float* packed, int64_t n,
                  int64_t k, const float* bias, float* y, int64_t ldy, const ParallelFor& pf) {
  const PanelIsa& isa = panel_isa();
  const int64_t np = isa.width;
  const float* packed_end = packed + packed_floats(n, k);
  run(panel_count(n), pf, [&](int64_t begin, int64_t end) {
    float bias_tail[kPanelWidthAvx512];  // the last panel's bias, zero padded
    for (int64_t p = begin; p < end; ++p) {
      PanelTask t;
      t.x = x;
      t.rows = rows;
      t.ldx = ldx;
      t.k = k;
      t.panel = packed + p * k * np;
      t.end = packed_end;
      t.y = y + p * np;
      t.ldy = ldy;
      t.cols = static_cast<int>(n - p * np < np ? n - p * np : np);
      t.bias = bias ? bias + p * np : nullptr;
      if (bias && t.cols < np) {
        std::memset(bias_tail, 0, sizeof bias_tail);
        std::memcpy(bias_tail, bias + p * np, t.cols * sizeof(float));
        t.bias = bias_tail;
      }
      isa.fn(t);
    }
  });
}

}  // namespace cpu
}  // namespace sharpdraft
