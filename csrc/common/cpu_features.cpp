// cpu_features.cpp: the run-time instruction-set choice (cpu_features.h). Torch-free.
#include "common/cpu_features.h"

#include <cstdlib>
#include <cstring>

namespace sharpdraft {
namespace cpu {
namespace {

int select_level() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  // SHARPDRAFT_CPU_ISA=base|avx2 caps the choice (for testing the fallbacks).
  const char* cap = std::getenv("SHARPDRAFT_CPU_ISA");
  const int limit = !cap ? 2 : std::strcmp(cap, "base") == 0 ? 0 : std::strcmp(cap, "avx2") == 0 ? 1 : 2;
  if (avx512 && limit >= 2) return 2;
  if (avx2 && limit >= 1) return 1;
  return 0;
}

}  // namespace

int isa_level() {
  static const int level = select_level();
  return level;
}

}  // namespace cpu
}  // namespace sharpdraft
