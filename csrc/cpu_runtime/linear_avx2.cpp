// The panel kernel of the CPU linear layer built for the avx2 instruction set; chosen at run
// time by linear_cpu.cpp.
#define SHARP_CPU_ISA linear_avx2
#define SHARP_VEC_WIDTH 8
#define SHARP_PANEL_VECS 2
#define SHARP_PANEL_ROWS 6
#define SHARP_CPU_TARGET _Pragma("GCC target(\"avx2,fma\")")
#include "cpu_runtime/linear_kernel.h"

namespace sharpdraft {
namespace cpu {

static_assert(SHARP_VEC_WIDTH * SHARP_PANEL_VECS == kPanelWidthAvx2, "panel width of avx2");

void panel_avx2(const PanelTask& t) { linear_avx2::panel(t); }

}  // namespace cpu
}  // namespace sharpdraft

#pragma GCC pop_options
