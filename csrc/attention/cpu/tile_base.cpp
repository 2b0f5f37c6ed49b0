// The tile kernel built for the base instruction set; chosen at run time by sharp_cpu.cpp.
#define SHARP_CPU_ISA isa_base
#define SHARP_VEC_WIDTH 4
#define SHARP_HAS_F16C 0
#define SHARP_CPU_TARGET /* baseline x86-64 */
#include "attention/cpu/tile_kernel.h"

namespace sharpdraft {
namespace cpu {

static_assert(isa_base::VW == kTileVecBase, "the driver pads rows to kTileVecBase");

void attend_tile_base(const TileTask& t) {
  switch (t.head_dim) {
    case 64: isa_base::attend<64>(t); break;
    case 128: isa_base::attend<128>(t); break;
    default: isa_base::attend<0>(t); break;
  }
}

}  // namespace cpu
}  // namespace sharpdraft

#pragma GCC pop_options
