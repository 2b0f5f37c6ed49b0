// The torch-free CPU linear layer (csrc/cpu_runtime/linear_cpu.h) against a float64 x W^T + b
// written here, for row counts on both sides of the register block, widths that are and are not
// a multiple of the panel width, strided x and y, with and without bias, serial and on 2 threads.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.h"
#include "common/cpu_features.h"
#include "cpu_runtime/linear_cpu.h"

using namespace sharpdraft;

namespace {

void run_case(int64_t rows, int64_t n, int64_t k, bool bias, bool threads) {
  Rng rng(uint64_t(rows * 1009 + n * 31 + k));
  const int64_t ldx = k + 3, ldy = n + 5;  // strided rows
  std::vector<float> x(rows * ldx), w(n * k), b(n), y(rows * ldy, -7.f);
  for (auto& v : x) v = float(rng.next());
  for (auto& v : w) v = float(rng.next());
  for (auto& v : b) v = float(rng.next());
  std::vector<float> packed(cpu::packed_floats(n, k), -1.f);
  const cpu::ParallelFor pf = threads ? cpu::ParallelFor(two_threads) : cpu::ParallelFor();
  cpu::pack_panels(w.data(), n, k, packed.data(), pf);
  cpu::panel_linear(x.data(), rows, ldx, packed.data(), n, k, bias ? b.data() : nullptr,
                    y.data(), ldy, pf);
  double worst = 0;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = bias ? b[j] : 0.0, mag = std::fabs(ref);
      for (int64_t kk = 0; kk < k; ++kk) {
        ref += double(x[m * ldx + kk]) * w[j * k + kk];
        mag += std::fabs(double(x[m * ldx + kk]) * w[j * k + kk]);
      }
      // float32 sum of k products and the bias, in any order: error <= gamma_{k+1} sum |terms|
      const double n1 = double(k + 1), u = std::ldexp(1.0, -24), gamma = n1 * u / (1 - n1 * u);
      const double err = std::fabs(y[m * ldy + j] - ref) / (mag * gamma + 1e-300);
      worst = err > worst ? err : worst;
    }
    for (int64_t j = n; j < ldy; ++j) CHECK(y[m * ldy + j] == -7.f);  // nothing past n written
  }
  if (worst > 1.0) {
    std::printf("rows %lld n %lld k %lld bias %d: error %.3g of the bound\n", (long long)rows,
                (long long)n, (long long)k, int(bias), worst);
  }
  CHECK(worst <= 1.0);
}

}  // namespace

int main() {
  std::printf("test_cpu_linear (isa level %d, panel width %lld)\n", cpu::isa_level(),
              (long long)cpu::panel_width());
  const int64_t width = cpu::panel_width();
  CHECK(cpu::panel_count(width) == 1 && cpu::panel_count(width + 1) == 2);
  CHECK(cpu::packed_floats(50, 7) == (50 + width - 1) / width * 7 * width);
  for (int64_t rows : {1, 2, 5, 8, 9, 17}) {
    for (int64_t n : {1, 7, 48, 50, 97}) {
      run_case(rows, n, 37, rows % 2 == 1, n % 2 == 0);
    }
  }
  run_case(8, 576, 576, true, true);
  run_case(3, 40, 1, false, false);
  return finish("test_cpu_linear");
}
