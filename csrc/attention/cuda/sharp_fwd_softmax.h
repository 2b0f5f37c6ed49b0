// sharp_fwd_softmax.h: the online softmax of the forward kernel, in base 2 with each row's
// exponent factor c_i (sharp_fwd_row_scale.h) folded into the exponent:
//   p_ij = exp2(fma(s_ij, c_i, -m_i)),  m_i = running max of c_i * s_ij,
// on the lane's accumulators of rows r(mi, hh) (one quad of lanes per row).
#pragma once

#include "attention/cuda/sharp_fwd_primitives.h"
#include "attention/sharp_math.h"

namespace sharpdraft {
namespace cuda {

// One key block: S scores -> P (in place, unnormalised), the running max / sum updated, and
// the output accumulators rescaled by exp2(m_old - m_new) before P V is added.
template <int MI, int NI, int DI>
__device__ __forceinline__ void softmax_step(float (&acc_s)[MI][NI][4], float (&acc_o)[MI][DI][4],
                                             float (&row_m)[MI][2], float (&row_l)[MI][2],
                                             const float (&row_c)[MI][2]) {
  constexpr float kNegInf = -__builtin_inff();
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = kNegInf;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
        mx = fmaxf(mx, fmaxf(acc_s[mi][ni][2 * hh], acc_s[mi][ni][2 * hh + 1]));
      mx = quad_max(mx);
      const float c = row_c[mi][hh];
      const float alpha = online_rescale(row_m[mi][hh], mx == kNegInf ? kNegInf : mx * c);
      const float neg_m = -safe_max(row_m[mi][hh]);
      float sum = 0.f;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = fast_exp2(fmaf(acc_s[mi][ni][2 * hh + e], c, neg_m));
          acc_s[mi][ni][2 * hh + e] = pe;
          sum += pe;
        }
      row_l[mi][hh] = row_l[mi][hh] * alpha + sum;
#pragma unroll
      for (int di = 0; di < DI; ++di) {
        acc_o[mi][di][2 * hh] *= alpha;
        acc_o[mi][di][2 * hh + 1] *= alpha;
      }
    }
}

// After the last key block: O /= l (0 for a row that saw no key) and the row's lse (base 2
// running max and sum -> natural log; -inf for an empty row).
template <int MI, int DI>
__device__ __forceinline__ void softmax_finalize(float (&acc_o)[MI][DI][4],
                                                 const float (&row_m)[MI][2],
                                                 const float (&row_l)[MI][2],
                                                 float (&row_lse)[MI][2]) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float l = quad_sum(row_l[mi][hh]);
      const float inv = finalize_inv_sum(l);
      row_lse[mi][hh] = finalize_lse(row_m[mi][hh], l);
#pragma unroll
      for (int di = 0; di < DI; ++di) {
        acc_o[mi][di][2 * hh] *= inv;
        acc_o[mi][di][2 * hh + 1] *= inv;
      }
    }
}

}  // namespace cuda
}  // namespace sharpdraft
