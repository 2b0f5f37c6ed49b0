// Instantiation: head_dim 256, fp16, non-causal; with and without attn_mask.
#include "attention/cuda/sharp_fwd_kernel.h"

namespace sharpdraft {
namespace cuda {

using Kt = DefaultTraits<256, __half>::type;
template void launch_sharp_fwd<Kt, false, false>(const SharpParams&, const SplitKV&, cudaStream_t);
template void launch_sharp_fwd<Kt, false, true>(const SharpParams&, const SplitKV&, cudaStream_t);

}  // namespace cuda
}  // namespace sharpdraft
