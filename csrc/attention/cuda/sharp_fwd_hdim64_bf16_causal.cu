// Instantiation: head_dim 64, bf16, causal (with or without window); with and without attn_mask;
// the default tile, the one-warp tile of Lq <= kSmallM and the alternative prefill tile.
#include "attention/cuda/sharp_fwd_kernel.h"

namespace sharpdraft {
namespace cuda {

using Kt = DefaultTraits<64, __nv_bfloat16>::type;
using KtSmall = SmallMTraits<64, __nv_bfloat16>::type;  // Lq <= kSmallM
using KtAlt = AltTraits<64, __nv_bfloat16>::type;  // SHARPDRAFT_CUDA_TILE=alt
template void launch_sharp_fwd<Kt, true, false>(const SharpParams&, const SplitKV&, cudaStream_t);
template void launch_sharp_fwd<Kt, true, true>(const SharpParams&, const SplitKV&, cudaStream_t);
template void launch_sharp_fwd<KtSmall, true, false>(const SharpParams&, const SplitKV&, cudaStream_t);
template void launch_sharp_fwd<KtSmall, true, true>(const SharpParams&, const SplitKV&, cudaStream_t);
template void launch_sharp_fwd<KtAlt, true, false>(const SharpParams&, const SplitKV&, cudaStream_t);
template void launch_sharp_fwd<KtAlt, true, true>(const SharpParams&, const SplitKV&, cudaStream_t);

}  // namespace cuda
}  // namespace sharpdraft
