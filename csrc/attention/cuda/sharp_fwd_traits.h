// sharp_fwd_traits.h: compile-time tile configuration of the forward kernel, and the
// configuration chosen for each supported head dimension.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace sharpdraft {
namespace cuda {

// One CTA computes kBlockM query rows of one (batch, head) against key blocks of kBlockN
// rows. Warp w owns rows [w * 16 * kMI, (w + 1) * 16 * kMI) as kMI m16 MMA fragments.
// kQInRegs: the Q tile's MMA fragments stay in registers for the whole key loop; otherwise
// they are re-read from shared memory at every k-step (head dims whose accumulators leave no
// room for them).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool kQInRegs_,
          int kMinBlocksPerSm_, typename Element_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;  // also the split-KV occupancy

  static constexpr int kMI = kBlockM / (16 * kNWarps);  // m16 fragments per warp
  static constexpr int kNI = kBlockN / 8;               // n8 fragments of S = Q K^T
  static constexpr int kDI = kHeadDim / 8;              // n8 fragments of O
  static constexpr int kKQ = kHeadDim / 16;             // k16 steps of Q K^T
  static constexpr int kKP = kBlockN / 16;              // k16 steps of P V
  static constexpr int kChunksPerRow = kHeadDim / 8;    // 16-byte chunks per tile row

  // Shared memory, in elements: two stages of (K tile, V tile); then Q. With kQInRegs the Q
  // tile is staged in the second K/V stage, which is free until the first prefetch.
  static constexpr int kTileKV = kBlockN * kHeadDim;
  static constexpr int kTileQ = kBlockM * kHeadDim;
  static constexpr int kStageElems = 2 * kTileKV;
  static constexpr bool kQAliased = kQInRegs && kTileQ <= kStageElems;
  static constexpr int kQOffset = kQAliased ? kStageElems : 2 * kStageElems;
  static constexpr int kSmemElems = kQAliased ? 2 * kStageElems : 2 * kStageElems + kTileQ;
  static constexpr int kSmemBytes = kSmemElems * 2;

  static_assert(kBlockM % (16 * kNWarps) == 0, "kBlockM must be a multiple of 16 * warps");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 64 == 0, "tile shape");
  static_assert(kTileQ <= kSmemElems, "the output tile is staged in shared memory");
  static_assert((kBlockM * kChunksPerRow) % kNThreads == 0, "Q copy must divide evenly");
  static_assert((kBlockN * kChunksPerRow) % kNThreads == 0, "K/V copy must divide evenly");
};

// The configuration used for each head dimension: no register spills on sm_80 / sm_90a
// (scripts/cuda_compile_check.sh), kMinBlocksPerSm CTAs resident per SM. Head dims 64 and
// 128 keep Q in registers; 256 cannot next to its 128 output accumulators per thread.
template <int kHeadDim, typename Element>
struct DefaultTraits;
template <typename Element>
struct DefaultTraits<64, Element> {
  using type = FwdTraits<64, 128, 64, 4, true, 2, Element>;
};
template <typename Element>
struct DefaultTraits<128, Element> {
  using type = FwdTraits<128, 128, 64, 8, true, 1, Element>;
};
template <typename Element>
struct DefaultTraits<256, Element> {
  using type = FwdTraits<256, 64, 16, 4, false, 2, Element>;
};

// An alternative prefill configuration per head dim, selected at run time with the
// environment variable SHARPDRAFT_CUDA_TILE=alt (tuning aid: benchmarks/bench_cuda.py times
// both on the same machine). Head dim 64: 64 x 128 tiles, one m16 fragment per warp, half
// the softmax bookkeeping per key; head dim 128: 64 x 64 tiles of 4 warps, two CTAs per SM
// (the same 8 warps per SM as the default, but in two independent CTAs). Head dim 256 has
// none. (128 x 64 and 128 x 32 tiles of 4 warps with Q re-read from shared memory spill.)
template <int kHeadDim, typename Element>
struct AltTraits {
  using type = typename DefaultTraits<kHeadDim, Element>::type;
};
template <typename Element>
struct AltTraits<64, Element> {
  using type = FwdTraits<64, 64, 128, 4, true, 2, Element>;
};
template <typename Element>
struct AltTraits<128, Element> {
  using type = FwdTraits<128, 64, 64, 4, true, 2, Element>;
};

// Prefill tiles of 32 query rows per warp (two m16 fragments: every K / V fragment read from
// shared memory feeds twice the MMAs, as FlashAttention-2 runs head dim 128), selected with
// SHARPDRAFT_CUDA_TILE=wide until a GPU run confirms them (benchmarks/bench_cuda.py). Head dim
// 128: 128 x 16 tiles of 4 warps with Q re-read from shared memory (128 output and 16 score
// accumulators per thread: 235-240 registers, no spills on sm_80 / sm_90a; 128 x 32 spills
// 148 bytes, and so does 64 x 32 with 2 warps). The other head dims keep their default.
template <int kHeadDim, typename Element>
struct WideTraits {
  using type = typename DefaultTraits<kHeadDim, Element>::type;
};
template <typename Element>
struct WideTraits<128, Element> {
  using type = FwdTraits<128, 128, 16, 4, false, 1, Element>;
};

// The configuration for calls whose query rows per sequence fit one m16 fragment (decode,
// DFlash blocks: Lq <= kSmallM): one warp, 16 rows, so no warp idles on rows past Lq; the
// small CTAs fill the SMs through split-KV (kMinBlocksPerSm of them resident, bounded by
// shared memory). Head dim 256 keeps its default configuration.
constexpr int kSmallM = 16;
template <int kHeadDim, typename Element>
struct SmallMTraits {
  using type = typename DefaultTraits<kHeadDim, Element>::type;
};
template <typename Element>
struct SmallMTraits<64, Element> {
  using type = FwdTraits<64, kSmallM, 64, 1, true, 6, Element>;  // 32 KB shared memory
};
template <typename Element>
struct SmallMTraits<128, Element> {
  using type = FwdTraits<128, kSmallM, 64, 1, true, 3, Element>;  // 64 KB shared memory
};

}  // namespace cuda
}  // namespace sharpdraft
