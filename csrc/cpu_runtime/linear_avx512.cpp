// The panel kernel of the CPU linear layer built for the avx512 instruction set; chosen at run
// time by linear_cpu.cpp.
#define SHARP_CPU_ISA linear_avx512
#define SHARP_VEC_WIDTH 16
#define SHARP_PANEL_VECS 3
#define SHARP_PANEL_ROWS 8
#define SHARP_CPU_TARGET _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx2,fma\")")
#include "cpu_runtime/linear_kernel.h"

namespace sharpdraft {
namespace cpu {

static_assert(SHARP_VEC_WIDTH * SHARP_PANEL_VECS == kPanelWidthAvx512, "panel width of avx512");

void panel_avx512(const PanelTask& t) { linear_avx512::panel(t); }

}  // namespace cpu
}  // namespace sharpdraft

#pragma GCC pop_options
