// sharp_fwd_epilogue.h: what a forward CTA writes. A CTA whose rows see no key writes zeros
// and lse = -inf (spec §3); a split-KV CTA writes its normalised float32 partial output and
// lse to the workspace (merged by sharp_fwd_combine.cu); otherwise the output tile is staged
// in shared memory and stored as whole 16-byte chunks per row, with the lse when asked for.
#pragma once

#include <cstdint>

#include "attention/cuda/sharp_fwd_primitives.h"

namespace sharpdraft {
namespace cuda {

// Rows row0 .. row0 + rows_here - 1 of a CTA with no visible key (the whole block of threads).
// LseIndex: i -> the index of row i's lse in p.lse.
template <typename Kt, typename LseIndex>
__device__ __forceinline__ void store_empty(typename Kt::Element* o_ptr, int64_t o_row_stride,
                                            float* lse, LseIndex lse_index, float* oacc_ptr,
                                            float* lseacc_ptr, bool write_partial, int row0,
                                            int rows_here, int tid) {
  constexpr int D = Kt::kHeadDim, CPR = Kt::kChunksPerRow, NT = Kt::kNThreads;
  constexpr float kNegInf = -__builtin_inff();
  for (int id = tid; id < rows_here * CPR; id += NT) {
    const int r = id / CPR, ch = id % CPR;
    if (write_partial) {
      float4* dst = reinterpret_cast<float4*>(oacc_ptr + int64_t(r) * D + ch * 8);
      dst[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      dst[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    } else {
      *reinterpret_cast<uint4*>(o_ptr + int64_t(row0 + r) * o_row_stride + ch * 8) =
          make_uint4(0u, 0u, 0u, 0u);
    }
  }
  for (int r = tid; r < rows_here; r += NT) {
    if (write_partial) lseacc_ptr[r] = kNegInf;
    else if (lse) lse[lse_index(row0 + r)] = kNegInf;
  }
}

// A split's partial result: row r of the tile at oacc_ptr + r * D, its lse at lseacc_ptr[r]
// (the lane's rows r(mi, hh) = warp_row0 + mi * 16 + g + 8 * hh).
template <typename Kt>
__device__ __forceinline__ void store_partial(const float (&acc_o)[Kt::kMI][Kt::kDI][4],
                                              const float (&row_lse)[Kt::kMI][2],
                                              float* oacc_ptr, float* lseacc_ptr, int warp_row0,
                                              int g, int t, int rows_here) {
  constexpr int D = Kt::kHeadDim;
#pragma unroll
  for (int mi = 0; mi < Kt::kMI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = warp_row0 + mi * 16 + g + 8 * hh;
      if (r >= rows_here) continue;
#pragma unroll
      for (int di = 0; di < Kt::kDI; ++di)
        *reinterpret_cast<float2*>(oacc_ptr + int64_t(r) * D + di * 8 + 2 * t) =
            make_float2(acc_o[mi][di][2 * hh], acc_o[mi][di][2 * hh + 1]);
      if (t == 0) lseacc_ptr[r] = row_lse[mi][hh];
    }
}

// The final output tile in the element type, through shared memory `smem` (free once every
// warp is done with K/V: the first barrier), and the lse of each valid row.
template <typename Kt, typename LseIndex>
__device__ __forceinline__ void store_output(const float (&acc_o)[Kt::kMI][Kt::kDI][4],
                                             const float (&row_lse)[Kt::kMI][2],
                                             typename Kt::Element* smem,
                                             typename Kt::Element* o_ptr, int64_t o_row_stride,
                                             float* lse, LseIndex lse_index, int row0,
                                             int rows_here, int warp_row0, int g, int t,
                                             int tid) {
  using Ops = MmaOps<typename Kt::Element>;
  constexpr int D = Kt::kHeadDim, CPR = Kt::kChunksPerRow, NT = Kt::kNThreads;
  __syncthreads();  // every warp is done reading K/V
#pragma unroll
  for (int mi = 0; mi < Kt::kMI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = warp_row0 + mi * 16 + g + 8 * hh;
#pragma unroll
      for (int di = 0; di < Kt::kDI; ++di)
        *reinterpret_cast<uint32_t*>(smem + swizzle<D>(r, di * 8 + 2 * t)) =
            Ops::pack(acc_o[mi][di][2 * hh], acc_o[mi][di][2 * hh + 1]);
      if (lse != nullptr && t == 0 && r < rows_here) lse[lse_index(row0 + r)] = row_lse[mi][hh];
    }
  __syncthreads();
#pragma unroll
  for (int it = 0; it < Kt::kBlockM * CPR / NT; ++it) {
    const int id = tid + it * NT, r = id / CPR, ch = id % CPR;
    if (r < rows_here)
      *reinterpret_cast<uint4*>(o_ptr + int64_t(row0 + r) * o_row_stride + ch * 8) =
          *reinterpret_cast<const uint4*>(smem + swizzle<D>(r, ch * 8));
  }
}

}  // namespace cuda
}  // namespace sharpdraft
