// sharp_fwd_mask.h: visibility of one key block's scores (spec §2): keys past kv_len, after a
// row's causal position, before its window, or false in attn_mask get -inf.
#pragma once

#include <cstdint>

namespace sharpdraft {
namespace cuda {

// acc_s: the lane's S = Q K^T accumulators of key block `key0` .. key0 + 8 * NI - 1, rows
// r(mi, hh) = lane_row0 + mi * 16 + 8 * hh (global row indices), columns 8 ni + 2 t + e.
// Rows past len_q see no key. Under an attn_mask lane_row0 goes through an opaque move: the
// mask row addresses are then recomputed per masked block instead of being hoisted out of the
// key loop, where they would hold (or spill) registers throughout.
template <int MI, int NI, bool kCausal, bool kMask>
__device__ __forceinline__ void mask_scores(float (&acc_s)[MI][NI][4], int key0, int lane_row0,
                                            int t, int len_q, int kv_len, int offset,
                                            bool has_window, int window, const bool* mask_ptr,
                                            int64_t mask_row_stride) {
  constexpr float kNegInf = -__builtin_inff();
  if constexpr (kMask) asm volatile("mov.b32 %0, %0;\n" : "+r"(lane_row0));
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      // Row i sees keys lo <= j < hi (visible_range, in int32; j >= 0 makes its clamps
      // redundant).
      const int i = lane_row0 + mi * 16 + 8 * hh;
      const int pos = i + offset;
      const int hi = i >= len_q ? 0 : kCausal ? min(kv_len, pos + 1) : kv_len;
      const int lo = has_window ? pos - window + 1 : 0;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = key0 + ni * 8 + 2 * t + e;
          bool visible = j >= lo && j < hi;
          if constexpr (kMask) visible = visible && mask_ptr[int64_t(i) * mask_row_stride + j];
          if (!visible) acc_s[mi][ni][2 * hh + e] = kNegInf;
        }
    }
}

}  // namespace cuda
}  // namespace sharpdraft
