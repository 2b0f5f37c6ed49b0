// Instantiation: head_dim 256, bf16, causal (with or without window); with and without attn_mask.
#include "attention/cuda/sharp_fwd_kernel.h"

namespace sharpdraft {
namespace cuda {

using Kt = DefaultTraits<256, __nv_bfloat16>::type;
template void launch_sharp_fwd<Kt, true, false>(const SharpParams&, const SplitKV&, cudaStream_t);
template void launch_sharp_fwd<Kt, true, true>(const SharpParams&, const SplitKV&, cudaStream_t);

}  // namespace cuda
}  // namespace sharpdraft
