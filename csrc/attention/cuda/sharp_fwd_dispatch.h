// sharp_fwd_dispatch.h: declarations shared by the launcher (sharp_fwd_launch.cu) and the
// per-configuration instantiation files (sharp_fwd_hdim*.cu, sharp_fwd_combine.cu). Every
// template declared here is explicitly instantiated in exactly one .cu file.
#pragma once

#include <cuda_runtime_api.h>

#include "attention/cuda/sharp_fwd_launch.h"
#include "attention/sharp_params.h"

namespace sharpdraft {
namespace cuda {

// The forward kernel of one tile configuration (sharp_fwd_traits.h) and masking mode.
template <typename Kt, bool kCausal, bool kMask>
void launch_sharp_fwd(const SharpParams& p, const SplitKV& split, cudaStream_t stream);

// The split-KV merge: reads split.o_accum / split.lse_accum, writes p.out and p.lse.
template <int kHeadDim, typename Element>
void launch_sharp_combine(const SharpParams& p, const SplitKV& split, cudaStream_t stream);

// Throws std::runtime_error naming `what` when err is not cudaSuccess.
void check_launch(cudaError_t err, const char* what);

}  // namespace cuda
}  // namespace sharpdraft
