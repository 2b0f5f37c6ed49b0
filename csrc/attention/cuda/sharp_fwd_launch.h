// sharp_fwd_launch.h: the torch-free entry point of the CUDA forward kernel.
//
//   SplitKV split = {};                                       // num_splits = 1: no workspace
//   split.num_splits = sharp_fwd_num_splits(params, sharp_fwd_num_sms(device));
//   if (split.num_splits > 1) { allocate sharp_fwd_workspace_floats(...) floats ... }
//   run_sharp_fwd(params, split, stream);
//
// params (csrc/attention/sharp_params.h) holds device pointers; dtype float16 or bfloat16 and
// head_dim 64, 128 or 256 (anything else throws std::invalid_argument naming the supported set).
// Errors of the launch itself throw std::runtime_error with the CUDA error string.
// Tiles (sharp_fwd_traits.h): calls with Lq (varlen: max_seqlen_q) <= kSmallM = 16 run a
// one-warp 16-row tile (SmallMTraits), the others DefaultTraits, or AltTraits when the
// environment variable SHARPDRAFT_CUDA_TILE=alt is set (a tuning aid for benchmarks).
// sharp_fwd_num_splits must be called under the same environment as run_sharp_fwd.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attention/sharp_params.h"

namespace sharpdraft {
namespace cuda {

// Split-KV: the keys of every (batch, head, query tile) are cut into num_splits contiguous
// ranges processed by separate CTAs; each writes a normalised float32 partial output and its
// natural-log lse, and a second kernel merges them (lse_merge / lse_weight, sharp_math.h).
struct SplitKV {
  int num_splits = 1;
  // Rows of q over all batches: B * Lq (dense) or total_q (varlen).
  int64_t total_rows = 0;
  // float32 (num_splits, Hq, total_rows, head_dim) and (num_splits, Hq, total_rows); only
  // read when num_splits > 1.
  float* o_accum = nullptr;
  float* lse_accum = nullptr;
};

// The splits that fill `num_sms` multiprocessors for this problem (1 when the query tiles
// alone already do). The result is at most kMaxSplits.
constexpr int kMaxSplits = 64;
int sharp_fwd_num_splits(const SharpParams& params, int num_sms);

// Multiprocessor count of a CUDA device (cached per device).
int sharp_fwd_num_sms(int device);

// Sizes, in floats, of SplitKV::o_accum and SplitKV::lse_accum.
inline int64_t sharp_fwd_oaccum_floats(const SharpParams& p, int num_splits, int64_t total_rows) {
  return int64_t(num_splits) * p.heads_q * total_rows * p.head_dim;
}
inline int64_t sharp_fwd_lseaccum_floats(const SharpParams& p, int num_splits,
                                         int64_t total_rows) {
  return int64_t(num_splits) * p.heads_q * total_rows;
}

// Enqueue the forward on `stream`: writes params.out and, when non-null, params.lse.
void run_sharp_fwd(const SharpParams& params, const SplitKV& split, cudaStream_t stream);

}  // namespace cuda
}  // namespace sharpdraft
