// sharp_fwd_row_scale.h: the SharpDraft part of the forward kernel. Each query row's
// cardinality n_i (spec §2: the closed form of its visible range, the n_visible override, or
// a count of attn_mask over that range) and its exponent factor c_i = beta(n_i) * scale *
// log2(e) (sharp_math.h), handed to the lanes that hold the row's accumulators.
#pragma once

#include <cstdint>

#include "attention/sharp_math.h"

namespace sharpdraft {
namespace cuda {

// Warp-level: the warp owns the 16 * MI <= 32 local rows first_row + l (first_row = the
// tile's first row + the warp's); lane l computes n_i and c_i of row l once (one beta per
// row, not per lane of its quad), and each lane then fetches, by shuffle, the factors of its
// accumulator rows r(mi, hh) = mi * 16 + g + 8 * hh.
//   row_c[mi][hh]:    |c_i|, at least 1e-30 (a zero factor becomes a uniform softmax, and
//                     masked scores still give 0 instead of NaN);
//   row_sign[mi][hh]: 0x80008000 where c_i < 0 (beta * scale < 0): the row's Q fragment is
//                     negated instead, so the running max of c * s stays the max of c
//                     times the max of s.
template <int MI, bool kCausal, bool kMask>
__device__ __forceinline__ void row_scales(const SharpParams& p, int b, int h, int first_row,
                                           int len_q, int kv_len, const bool* mask_ptr,
                                           int lane, int g, float (&row_c)[MI][2],
                                           uint32_t (&row_sign)[MI][2]) {
  static_assert(16 * MI <= 32, "one lane per row of a warp's rows");
  const int my_i = first_row + lane;
  const bool my_row_valid = lane < 16 * MI && my_i < len_q;
  int64_t my_n = range_count(visible_range(my_i, len_q, kv_len, kCausal, p.window));
  if (p.n_visible != nullptr) {
    if (my_row_valid)
      my_n = p.n_visible[row_offset(p.cu_seqlens_q, b, h, my_i, p.nv_batch_stride,
                                    p.nv_head_stride, p.nv_row_stride)];
  } else if (kMask) {
    // Count the mask over each row's visible range, the whole warp per row.
    for (int rr = 0; rr < 16 * MI; ++rr) {
      const int i = first_row + rr;
      if (i >= len_q) break;
      const KeyRange kr = visible_range(i, len_q, kv_len, kCausal, p.window);
      const bool* mrow = mask_ptr + int64_t(i) * p.mask_row_stride;
      unsigned cnt = 0;
      for (int64_t j = kr.lo + lane; j < kr.hi; j += 32) cnt += mrow[j] ? 1u : 0u;
      cnt = __reduce_add_sync(0xffffffffu, cnt);
      if (lane == rr) my_n = cnt;
    }
  }
  const float my_c = exponent_factor(query_scale(my_n, p.sp, h), p.softmax_scale);
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float c = __shfl_sync(0xffffffffu, my_c, mi * 16 + g + 8 * hh);
      row_sign[mi][hh] = c < 0.f ? 0x80008000u : 0u;
      row_c[mi][hh] = fmaxf(fabsf(c), 1e-30f);
    }
}

}  // namespace cuda
}  // namespace sharpdraft
