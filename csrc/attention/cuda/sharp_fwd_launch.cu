// sharp_fwd_launch.cu: run_sharp_fwd (dtype / head-dim / masking dispatch onto the
// instantiations in sharp_fwd_hdim*.cu) and the split-KV heuristic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "attention/cuda/sharp_fwd_dispatch.h"
#include "attention/cuda/sharp_fwd_launch.h"
#include "attention/cuda/sharp_fwd_traits.h"

namespace sharpdraft {
namespace cuda {

void check_launch(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("sharpdraft CUDA: ") + what + " failed: " +
                             cudaGetErrorString(err));
}

namespace {

// The one tile heuristic: which configuration (sharp_fwd_traits.h) serves a call. Lq (varlen:
// max_seqlen_q) of at most kSmallM rows runs the one-warp tile; otherwise the default tile,
// unless SHARPDRAFT_CUDA_TILE names another (read at every call, so a benchmark can switch it;
// getenv is far cheaper than a launch): "alt" (AltTraits) or "wide" (WideTraits: 32 query rows
// per warp, kept behind the switch until a GPU run confirms it).
enum class Tile { kDefault, kSmallM, kAlt, kWide };

Tile choose_tile(const SharpParams& p) {
  if (p.seqlen_q <= kSmallM) return Tile::kSmallM;
  const char* v = std::getenv("SHARPDRAFT_CUDA_TILE");
  if (v != nullptr && std::strcmp(v, "alt") == 0) return Tile::kAlt;
  if (v != nullptr && std::strcmp(v, "wide") == 0) return Tile::kWide;
  return Tile::kDefault;
}

// Calls f(Kt{}) with the traits type of `tile` for this head dim and element type: the
// launcher and the split heuristic both go through it, so they cannot disagree.
template <int kHeadDim, typename T, typename F>
void with_tile(Tile tile, F&& f) {
  switch (tile) {
    case Tile::kSmallM: return f(typename SmallMTraits<kHeadDim, T>::type{});
    case Tile::kAlt: return f(typename AltTraits<kHeadDim, T>::type{});
    case Tile::kWide: return f(typename WideTraits<kHeadDim, T>::type{});
    default: return f(typename DefaultTraits<kHeadDim, T>::type{});
  }
}

template <typename Kt>
void run_tile(const SharpParams& p, const SplitKV& split, cudaStream_t stream) {
  const bool mask = p.mask != nullptr;
  if (p.causal) {
    if (mask) launch_sharp_fwd<Kt, true, true>(p, split, stream);
    else launch_sharp_fwd<Kt, true, false>(p, split, stream);
  } else {
    if (mask) launch_sharp_fwd<Kt, false, true>(p, split, stream);
    else launch_sharp_fwd<Kt, false, false>(p, split, stream);
  }
}

template <int kHeadDim, typename T>
void run_config(const SharpParams& p, const SplitKV& split, cudaStream_t stream) {
  with_tile<kHeadDim, T>(choose_tile(p), [&](auto kt) { run_tile<decltype(kt)>(p, split, stream); });
  if (split.num_splits > 1) launch_sharp_combine<kHeadDim, T>(p, split, stream);
}

template <typename T>
void run_dtype(const SharpParams& p, const SplitKV& split, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return run_config<64, T>(p, split, stream);
    case 128: return run_config<128, T>(p, split, stream);
    case 256: return run_config<256, T>(p, split, stream);
    default:
      throw std::invalid_argument(
          "sharpdraft CUDA: head_dim must be one of 64, 128, 256 on CUDA (got " +
          std::to_string(p.head_dim) + ")");
  }
}

// Tile sizes and resident CTAs per SM of the configuration serving a call (the same for
// both dtypes).
struct TileShape {
  int block_m, block_n, ctas_per_sm;
};
TileShape tile_shape(const SharpParams& p) {
  TileShape shape{};
  auto read = [&](auto kt) {
    using Kt = decltype(kt);
    shape = {Kt::kBlockM, Kt::kBlockN, Kt::kMinBlocksPerSm};
  };
  const Tile tile = choose_tile(p);
  if (p.head_dim == 64) with_tile<64, __half>(tile, read);
  else if (p.head_dim == 128) with_tile<128, __half>(tile, read);
  else with_tile<256, __half>(tile, read);
  return shape;
}

}  // namespace

int sharp_fwd_num_splits(const SharpParams& p, int num_sms) {
  const TileShape shape = tile_shape(p);
  const int block_m = shape.block_m, block_n = shape.block_n, ctas_per_sm = shape.ctas_per_sm;
  const int64_t ctas = p.batch * p.heads_q * ((p.seqlen_q + block_m - 1) / block_m);
  const int64_t n_blocks = (p.seqlen_k + block_n - 1) / block_n;
  const int64_t slots = int64_t(num_sms) * ctas_per_sm;
  // Enough CTAs already, or too few key blocks to share out (each split gets >= 2 blocks).
  if (ctas >= (slots * 4) / 5 || n_blocks < 4) return 1;
  int64_t max_splits = n_blocks / 2;
  if (max_splits > kMaxSplits) max_splits = kMaxSplits;
  // Wave efficiency of s splits: useful CTA slots over occupied ones. Take the smallest s
  // within 90% of the best, since every extra split adds merge traffic.
  auto efficiency = [&](int64_t s) {
    const int64_t work = ctas * s, waves = (work + slots - 1) / slots;
    return double(work) / double(waves * slots);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) best = efficiency(s) > best ? efficiency(s) : best;
  for (int64_t s = 1; s <= max_splits; ++s)
    if (efficiency(s) >= 0.9 * best) return int(s);
  return 1;
}

int sharp_fwd_num_sms(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  if (device >= 0 && device < kMaxDevices && cache[device].load() > 0) return cache[device];
  int count = 0;
  check_launch(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device),
               "cudaDeviceGetAttribute(MultiProcessorCount)");
  if (device >= 0 && device < kMaxDevices) cache[device].store(count);
  return count;
}

void run_sharp_fwd(const SharpParams& p, const SplitKV& split, cudaStream_t stream) {
  if (split.num_splits < 1 || split.num_splits > kMaxSplits)
    throw std::invalid_argument("sharpdraft CUDA: num_splits must be in [1, " +
                                std::to_string(kMaxSplits) + "] (got " +
                                std::to_string(split.num_splits) + ")");
  if (split.num_splits > 1 &&
      (split.o_accum == nullptr || split.lse_accum == nullptr || split.total_rows < 1))
    throw std::invalid_argument("sharpdraft CUDA: split-KV needs o_accum, lse_accum, total_rows");
  if (p.heads_q > 65535 || p.batch * split.num_splits > 65535)
    throw std::invalid_argument("sharpdraft CUDA: heads_q and batch * num_splits must be <= 65535");
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads_q == 0) return;
  switch (p.dtype) {
    case DType::kFloat16: return run_dtype<__half>(p, split, stream);
    case DType::kBFloat16: return run_dtype<__nv_bfloat16>(p, split, stream);
    default:
      throw std::invalid_argument(
          "sharpdraft CUDA: q, k, v must be bfloat16 or float16 on CUDA (got float32)");
  }
}

}  // namespace cuda
}  // namespace sharpdraft
