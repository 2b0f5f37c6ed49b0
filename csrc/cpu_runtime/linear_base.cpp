// The panel kernel of the CPU linear layer built for the base instruction set; chosen at run
// time by linear_cpu.cpp.
#define SHARP_CPU_ISA linear_base
#define SHARP_VEC_WIDTH 4
#define SHARP_PANEL_VECS 2
#define SHARP_PANEL_ROWS 6
#define SHARP_CPU_TARGET /* baseline x86-64 */
#include "cpu_runtime/linear_kernel.h"

namespace sharpdraft {
namespace cpu {

static_assert(SHARP_VEC_WIDTH * SHARP_PANEL_VECS == kPanelWidthBase, "panel width of base");

void panel_base(const PanelTask& t) { linear_base::panel(t); }

}  // namespace cpu
}  // namespace sharpdraft

#pragma GCC pop_options
