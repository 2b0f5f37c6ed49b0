// sharp_fwd_combine.cu: the split-KV merge pass. One warp per (head, query row): the
// partial lses are merged with lse_merge, each partial output is weighted by lse_weight
// (sharp_math.h), and the row is written in the output dtype with its lse.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention/cuda/sharp_fwd_dispatch.h"
#include "attention/cuda/sharp_fwd_primitives.h"
#include "attention/sharp_math.h"

namespace sharpdraft {
namespace cuda {

constexpr int kCombineWarps = 4;

template <int kHeadDim, typename T>
__global__ void __launch_bounds__(32 * kCombineWarps, 8)
    sharp_fwd_combine_kernel(const __grid_constant__ SharpParams p,
                             const __grid_constant__ SplitKV split) {
  constexpr int kPerLane = kHeadDim / 32;  // 2, 4 or 8 consecutive elements per lane
  const int lane = threadIdx.x & 31;
  const int64_t idx = int64_t(blockIdx.x) * kCombineWarps + (threadIdx.x >> 5);
  if (idx >= p.heads_q * split.total_rows) return;
  const int64_t h = idx / split.total_rows, grow = idx % split.total_rows;
  const int64_t split_stride = p.heads_q * split.total_rows;  // rows between two splits

  const float* lse_part = split.lse_accum + h * split.total_rows + grow;
  float lse = -__builtin_inff();
  for (int s = 0; s < split.num_splits; ++s) lse = lse_merge(lse, lse_part[s * split_stride]);

  float acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.f;
  const float* o_part = split.o_accum + (h * split.total_rows + grow) * kHeadDim + lane * kPerLane;
  for (int s = 0; s < split.num_splits; ++s) {
    const float w = lse_weight(lse_part[s * split_stride], lse);
    const float* src = o_part + s * split_stride * kHeadDim;
#pragma unroll
    for (int e = 0; e < kPerLane; e += 2) {
      const float2 x = *reinterpret_cast<const float2*>(src + e);
      acc[e] += w * x.x;
      acc[e + 1] += w * x.y;
    }
  }

  // Dense rows are numbered b * Lq + i; varlen rows are the global row cu_seqlens_q[b] + i.
  int64_t o_off, lse_off;
  if (p.cu_seqlens_q) {
    o_off = grow * p.o_row_stride + h * p.o_head_stride;
    lse_off = grow * p.lse_row_stride + h * p.lse_head_stride;
  } else {
    const int64_t b = grow / p.seqlen_q, i = grow % p.seqlen_q;
    o_off = b * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride;
    lse_off = b * p.lse_batch_stride + h * p.lse_head_stride + i * p.lse_row_stride;
  }
  T* out = static_cast<T*>(p.out) + o_off + lane * kPerLane;
#pragma unroll
  for (int e = 0; e < kPerLane; e += 2)
    *reinterpret_cast<uint32_t*>(out + e) = MmaOps<T>::pack(acc[e], acc[e + 1]);
  if (lane == 0 && p.lse != nullptr) p.lse[lse_off] = lse;
}

template <int kHeadDim, typename T>
void launch_sharp_combine(const SharpParams& p, const SplitKV& split, cudaStream_t stream) {
  const int64_t rows = p.heads_q * split.total_rows;
  const dim3 grid(unsigned((rows + kCombineWarps - 1) / kCombineWarps));
  sharp_fwd_combine_kernel<kHeadDim, T><<<grid, 32 * kCombineWarps, 0, stream>>>(p, split);
  check_launch(cudaGetLastError(), "sharp_fwd_combine_kernel launch");
}

template void launch_sharp_combine<64, __half>(const SharpParams&, const SplitKV&, cudaStream_t);
template void launch_sharp_combine<128, __half>(const SharpParams&, const SplitKV&, cudaStream_t);
template void launch_sharp_combine<256, __half>(const SharpParams&, const SplitKV&, cudaStream_t);
template void launch_sharp_combine<64, __nv_bfloat16>(const SharpParams&, const SplitKV&,
                                                      cudaStream_t);
template void launch_sharp_combine<128, __nv_bfloat16>(const SharpParams&, const SplitKV&,
                                                       cudaStream_t);
template void launch_sharp_combine<256, __nv_bfloat16>(const SharpParams&, const SplitKV&,
                                                       cudaStream_t);

}  // namespace cuda
}  // namespace sharpdraft
