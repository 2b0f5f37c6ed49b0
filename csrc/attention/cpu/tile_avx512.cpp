// The tile kernel built for the avx512 instruction set; chosen at run time by sharp_cpu.cpp.
#define SHARP_CPU_ISA isa_avx512
#define SHARP_VEC_WIDTH 16
#define SHARP_HAS_F16C 1
#define SHARP_CPU_TARGET _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c\")")
#include "attention/cpu/tile_kernel.h"

namespace sharpdraft {
namespace cpu {

static_assert(isa_avx512::VW == kTileVecAvx512, "the driver pads rows to kTileVecAvx512");

void attend_tile_avx512(const TileTask& t) {
  switch (t.head_dim) {
    case 64: isa_avx512::attend<64>(t); break;
    case 128: isa_avx512::attend<128>(t); break;
    default: isa_avx512::attend<0>(t); break;
  }
}

}  // namespace cpu
}  // namespace sharpdraft

#pragma GCC pop_options
