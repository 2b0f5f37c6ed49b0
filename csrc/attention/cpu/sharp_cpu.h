// sharp_cpu.h: the torch-free CPU sharp-attention forward (spec §2-§3).
//
// The driver (sharp_cpu.cpp) splits a call into independent work items, each a tile of query
// rows of one (batch, kv head) against a range of keys, and runs them through a caller-given
// parallel-for. The per-tile compute lives in ISA-specific units (tile_<isa>.cpp) chosen at run
// time, so shipped builds never need -march=native.
#pragma once

#include <cstdint>

#include "attention/sharp_params.h"
#include "common/parallel.h"

namespace sharpdraft {
namespace cpu {

// out = sharp_attention(params); writes params.out and, if non-null, params.lse.
// parallel_for may be empty (serial); num_threads sizes the split-KV decision.
void sharp_attention_forward(const SharpParams& params, int num_threads,
                             const ParallelFor& parallel_for);

// The cardinality each row's beta uses (n_visible when given, else the count of visible keys),
// written like lse: dense (B, Hq, Lq), varlen (Hq, total_q) via params' lse strides.
void visible_counts(const SharpParams& params, int64_t* counts);

// The instruction set the tile kernel was dispatched to on this machine (common/cpu_features.h):
// "avx512", "avx2", "base".
const char* isa_name();

// --- internal: the ISA-specific tile kernel -----------------------------------------------

constexpr int kMaxTileRows = 64;  // query rows per work item
constexpr int kMaxHeadDim = 256;

// One tile: `rows` query rows of one (batch, kv head) attending to keys [k_begin, k_end).
// Per-row arrays have rows_padded entries; padding rows have lo = hi = 0 (see nothing).
struct TileTask {
  int rows = 0;
  int rows_padded = 0;          // rows rounded up to a multiple of the ISA's vector width
  int64_t head_dim = 0;
  int64_t dim_padded = 0;       // head_dim rounded up to a multiple of 16; acc row stride
  const float* qt = nullptr;    // (head_dim, rows_padded): q^T times c_i = beta_i * scale, zero padded
  const float* q_rows = nullptr;  // (rows, dim_padded): the same q, row-major, zero padded
  const int64_t* lo = nullptr;  // first visible key of each row (within the split)
  const int64_t* hi = nullptr;  // one past the last visible key
  const bool* const* mask_rows = nullptr;  // mask row pointers (key index j), or null: no mask
  DType dtype = DType::kFloat32;
  const void* k = nullptr;      // key row 0 of this (batch, kv head)
  int64_t k_row_stride = 0;
  const void* v = nullptr;
  int64_t v_row_stride = 0;
  int64_t k_begin = 0, k_end = 0;  // union of the rows' ranges
  float* acc = nullptr;         // (rows, dim_padded) unnormalised output, zero on entry
  float* m = nullptr;           // running max of the scores (natural-log units); -inf on entry
  float* l = nullptr;           // running sum; 0 on entry
  float* scratch = nullptr;     // tile_scratch_floats() floats
  // Two-pass softmax (the whole range's scores before any weight; k_end - k_begin <=
  // kExactSpan): a row's bits depend only on its visible keys, in order (step-sized calls).
  bool exact = false;
  // Tiles of more than kDotRows rows score in the dot-product path's order (set on exact
  // tiles when a KV head has at most kDotRows query heads: its decode takes that path).
  bool dot_order = false;
};

// Tiles of at most this many rows (decode) compute scores with lanes over the head dim: with
// lanes over rows most lanes would idle.
constexpr int kDotRows = 2;

constexpr int kKeyBlock = 64;     // keys per block of the tile kernel
constexpr int kExactSpan = 1024;  // most keys a two-pass (exact) tile spans

// Floats of scratch a TileTask needs: a K block and a V block converted to float32, and the
// scores (keys x rows) of a block, or of the whole range of an exact tile.
constexpr int64_t tile_scratch_floats() {
  return 2 * int64_t(kKeyBlock) * kMaxHeadDim + int64_t(kExactSpan) * kMaxTileRows;
}

// Floats per vector of each ISA's tile kernel (SHARP_VEC_WIDTH of tile_<isa>.cpp).
constexpr int kTileVecBase = 4, kTileVecAvx2 = 8, kTileVecAvx512 = 16;

using TileFn = void (*)(const TileTask&);
void attend_tile_base(const TileTask&);
void attend_tile_avx2(const TileTask&);
void attend_tile_avx512(const TileTask&);

}  // namespace cpu
}  // namespace sharpdraft
