// cpu_features.h: the instruction set the CPU kernels dispatch to at run time, one choice per
// process for the attention tile kernel and the runtime's linear layers alike (so shipped
// builds never need -march=native). Torch-free.
#pragma once

namespace sharpdraft {
namespace cpu {

// 0 base, 1 avx2 (with FMA), 2 avx512 (F, BW, VL, DQ): the highest this CPU supports, capped by
// SHARPDRAFT_CPU_ISA=base|avx2 (for testing the fallbacks). Chosen on the first call.
int isa_level();

}  // namespace cpu
}  // namespace sharpdraft
