// sharp_fwd_kernel.h: the FlashAttention-2-style forward kernel of sharp attention
// (spec §2-§3) and its templated launcher. Included by the per-instantiation .cu files.
//
// Grid: (query tiles, Hq, B * num_splits); one CTA = kBlockM query rows of one (b, h) against
// its visible key blocks (or one split's share of them). Per row i the CTA computes the
// cardinality n_i (closed form, counted from attn_mask, or the n_visible override), then
// c_i = beta(n_i) * scale * log2(e) (sharp_math.h). Scores stay raw <q_i, k_j> in float32;
// the online softmax runs in base 2 with c_i folded into the exponent:
//   p_ij = exp2(fma(s_ij, c_i, -m_i)),  m_i = running max of c_i * s_ij.
// Key blocks wholly outside a CTA's causal / window band are never visited; blocks that are
// partly visible (band edges, the ragged last block, every block under an attn_mask) run a
// masked instance of the block step, all others an unmasked one.
//
// The kernel composes one header per concern: the row scale (n_i and beta_i, the SharpDraft
// part: sharp_fwd_row_scale.h), masking (sharp_fwd_mask.h), the online softmax
// (sharp_fwd_softmax.h) and the epilogue (sharp_fwd_epilogue.h); copies and MMAs use
// sharp_fwd_primitives.h, tile shapes sharp_fwd_traits.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention/cuda/sharp_fwd_dispatch.h"
#include "attention/cuda/sharp_fwd_epilogue.h"
#include "attention/cuda/sharp_fwd_launch.h"
#include "attention/cuda/sharp_fwd_mask.h"
#include "attention/cuda/sharp_fwd_primitives.h"
#include "attention/cuda/sharp_fwd_row_scale.h"
#include "attention/cuda/sharp_fwd_softmax.h"
#include "attention/cuda/sharp_fwd_traits.h"
#include "attention/sharp_math.h"

namespace sharpdraft {
namespace cuda {

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

template <typename Kt, bool kCausal, bool kMask>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocksPerSm)
    sharp_fwd_kernel(const __grid_constant__ SharpParams p, const __grid_constant__ SplitKV split) {
  using T = typename Kt::Element;
  using Ops = MmaOps<T>;
  constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN;
  constexpr int MI = Kt::kMI, NI = Kt::kNI, DI = Kt::kDI, KQ = Kt::kKQ, KP = Kt::kKP;
  constexpr int NT = Kt::kNThreads, CPR = Kt::kChunksPerRow;
  constexpr float kNegInf = -__builtin_inff();

  extern __shared__ uint4 smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const uint32_t smem_base = smem_u32(smem);

  const int tid = threadIdx.x, lane = tid & 31;
  // The warp index through a shuffle from lane 0: the compiler then knows it is warp-uniform,
  // so the per-warp / per-fragment guards below are uniform branches and the mma.sync / shfl
  // instructions need no WARPSYNC in front of them.
  const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
  const int g = lane >> 2, t = lane & 3;  // accumulator row group / column pair of this lane
  const int warp_row0 = warp * 16 * MI;   // first local row of this warp

  // ---- which rows and keys this CTA sees --------------------------------------------------
  const int m_block = kCausal ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int h = int(blockIdx.y);
  const int b = int(blockIdx.z) / split.num_splits, split_idx = int(blockIdx.z) % split.num_splits;
  const int hk = h / int(p.heads_q / p.heads_k);
  const int len_q = int(seqlen_q_of(p, b));
  const int row0 = m_block * BM;
  if (row0 >= len_q) return;
  const int kv_len = int(seqlen_k_of(p, b));
  const int offset = kv_len - len_q;  // bottom-right alignment
  // Windows past any sequence length act as none; the clamp keeps the int32 band maths exact.
  const int window = int(min(p.window, int64_t(1) << 30));
  const bool has_window = kCausal && window > 0;
  const int rows_here = min(BM, len_q - row0);
  const int pos_first = row0 + offset, pos_last = row0 + rows_here - 1 + offset;

  // Visited key blocks [n_min, n_max); blocks in [n_full_lo, n_full_hi) are visible to every
  // row of the tile (before any attn_mask).
  const int key_end = kCausal ? max(0, min(kv_len, pos_last + 1)) : kv_len;
  const int key_begin = has_window ? max(0, pos_first - window + 1) : 0;
  int n_max = ceil_div(key_end, BN);
  int n_min = min(key_begin / BN, n_max);
  const int n_full_hi = (kCausal ? max(0, min(kv_len, pos_first + 1)) : kv_len) / BN;
  const int n_full_lo = has_window ? ceil_div(max(0, pos_last - window + 1), BN) : 0;
  if (split.num_splits > 1) {
    const int per_split = ceil_div(ceil_div(kv_len, BN), split.num_splits);
    n_min = max(n_min, split_idx * per_split);
    n_max = min(n_max, (split_idx + 1) * per_split);
  }

  const T* q_ptr = static_cast<const T*>(p.q) +
                   row_offset(p.cu_seqlens_q, b, h, 0, p.q_batch_stride, p.q_head_stride, p.q_row_stride);
  const T* k_ptr = static_cast<const T*>(p.k) +
                   row_offset(p.cu_seqlens_k, b, hk, 0, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
  const T* v_ptr = static_cast<const T*>(p.v) +
                   row_offset(p.cu_seqlens_k, b, hk, 0, p.v_batch_stride, p.v_head_stride, p.v_row_stride);
  const bool* mask_ptr =
      kMask ? p.mask + int64_t(b) * p.mask_batch_stride + int64_t(h) * p.mask_head_stride
            : nullptr;

  // ---- outputs of an empty CTA -------------------------------------------------------------
  const bool write_partial = split.num_splits > 1;
  const int64_t grow0 =
      (p.cu_seqlens_q ? int64_t(p.cu_seqlens_q[b]) : int64_t(b) * p.seqlen_q) + row0;
  float* oacc_ptr = write_partial ? split.o_accum + ((int64_t(split_idx) * p.heads_q + h) *
                                                         split.total_rows + grow0) * D
                                  : nullptr;
  float* lseacc_ptr =
      write_partial
          ? split.lse_accum + (int64_t(split_idx) * p.heads_q + h) * split.total_rows + grow0
          : nullptr;
  T* o_ptr = static_cast<T*>(p.out) +
             row_offset(p.cu_seqlens_q, b, h, 0, p.o_batch_stride, p.o_head_stride, p.o_row_stride);
  auto lse_index = [&](int i) {
    return row_offset(p.cu_seqlens_q, b, h, i, p.lse_batch_stride, p.lse_head_stride,
                      p.lse_row_stride);
  };

  if (n_max <= n_min) {
    store_empty<Kt>(o_ptr, p.o_row_stride, p.lse, lse_index, oacc_ptr, lseacc_ptr, write_partial,
                    row0, rows_here, tid);
    return;
  }

  // ---- copies ---------------------------------------------------------------------------------
  // The copy loops stay rolled: unrolled, the compiler keeps every iteration's loop-invariant
  // global and shared addresses live in registers across the whole key loop.
  auto load_q = [&]() {
#pragma unroll 1
    for (int it = 0; it < BM * CPR / NT; ++it) {
      const int id = tid + it * NT, r = id / CPR, ch = id % CPR;
      const bool valid = row0 + r < len_q;
      const T* src = q_ptr + (valid ? int64_t(row0 + r) * p.q_row_stride + ch * 8 : 0);
      cp_async_16(smem_base + 2 * (Kt::kQOffset + swizzle<D>(r, ch * 8)), src, valid);
    }
  };
  // K and V rows of key block n into stage `stage`; rows past kv_len are zero-filled.
  auto load_kv = [&](int n, int stage) {
    const int key0 = n * BN;
    const bool ragged = key0 + BN > kv_len;
    const uint32_t k_dst = smem_base + 2 * (stage * Kt::kStageElems);
    const uint32_t v_dst = k_dst + 2 * Kt::kTileKV;
#pragma unroll 1
    for (int it = 0; it < BN * CPR / NT; ++it) {
      const int id = tid + it * NT, r = id / CPR, ch = id % CPR;
      const bool valid = !ragged || key0 + r < kv_len;
      const int64_t key = valid ? key0 + r : 0;
      const uint32_t off = 2 * swizzle<D>(r, ch * 8);
      cp_async_16(k_dst + off, k_ptr + key * p.k_row_stride + ch * 8, valid);
      cp_async_16(v_dst + off, v_ptr + key * p.v_row_stride + ch * 8, valid);
    }
  };

  // ---- prologue -------------------------------------------------------------------------------
  load_q();
  load_kv(n_max - 1, 0);
  cp_async_commit();

  // ---- per-row cardinality and exponent factor (while the first copies are in flight) ------
  float row_c[MI][2];
  uint32_t row_sign[MI][2];
  row_scales<MI, kCausal, kMask>(p, b, h, row0 + warp_row0, len_q, kv_len, mask_ptr, lane, g,
                                 row_c, row_sign);

  // ldmatrix lane addresses (see LaneTileAddr): Q as the A operand, K as B, V as B^T.
  const LaneTileAddr<D> q_addr(smem_base + 2 * Kt::kQOffset, warp_row0 + (lane & 15), lane >> 4);
  const LaneTileAddr<D> k_addr(smem_base, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
  const LaneTileAddr<D> v_addr(smem_base + 2 * Kt::kTileKV, ((lane >> 3) & 1) * 8 + (lane & 7),
                               lane >> 4);

  auto load_q_frag = [&](uint32_t (&a)[4], int mi, int kk) {
    ldmatrix_x4(a, q_addr.at(mi * 16, kk));
    a[0] ^= row_sign[mi][0];
    a[2] ^= row_sign[mi][0];
    a[1] ^= row_sign[mi][1];
    a[3] ^= row_sign[mi][1];
  };

  uint32_t q_frag[Kt::kQInRegs ? MI : 1][Kt::kQInRegs ? KQ : 1][4];
  if constexpr (Kt::kQInRegs) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int kk = 0; kk < KQ; ++kk) load_q_frag(q_frag[mi][kk], mi, kk);
  }

  float acc_o[MI][DI][4];
  float row_m[MI][2], row_l[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int di = 0; di < DI; ++di)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mi][di][e] = 0.f;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      row_m[mi][hh] = kNegInf;
      row_l[mi][hh] = 0.f;
    }
  }
  // Warps whose rows all lie past len_q skip the arithmetic (a warp's other m16 fragments
  // past len_q compute on zero-filled Q rows: unguarded, the MMAs need no predicates).
  const bool warp_active = warp_row0 < rows_here;

  // ---- one key block ----------------------------------------------------------------------
  auto block_step = [&](int n, int stage, auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    const uint32_t stage_bytes = stage * (2 * Kt::kStageElems);

    float acc_s[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[mi][ni][e] = 0.f;

    // S = Q K^T
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk) {
      [[maybe_unused]] uint32_t a[MI][4];
      if constexpr (!Kt::kQInRegs) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) load_q_frag(a[mi], mi, kk);
      }
#pragma unroll
      for (int np = 0; np < NI / 2; ++np) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_addr.at(np * 16, kk) + stage_bytes);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          if constexpr (Kt::kQInRegs) {
            Ops::mma(acc_s[mi][2 * np], q_frag[mi][kk], kb[0], kb[1]);
            Ops::mma(acc_s[mi][2 * np + 1], q_frag[mi][kk], kb[2], kb[3]);
          } else {
            Ops::mma(acc_s[mi][2 * np], a[mi], kb[0], kb[1]);
            Ops::mma(acc_s[mi][2 * np + 1], a[mi], kb[2], kb[3]);
          }
        }
      }
    }

    if constexpr (kMasked)
      mask_scores<MI, NI, kCausal, kMask>(acc_s, n * BN, row0 + warp_row0 + g, t, len_q, kv_len,
                                          offset, has_window, window, mask_ptr,
                                          p.mask_row_stride);

    // Online softmax (base 2), then O = O * alpha + P V.
    softmax_step<MI, NI, DI>(acc_s, acc_o, row_m, row_l, row_c);

#pragma unroll
    for (int kp = 0; kp < KP; ++kp) {
      // The S accumulators of n8 fragments 2kp and 2kp+1 form the A fragment of k-step kp.
      uint32_t pa[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        pa[mi][0] = Ops::pack(acc_s[mi][2 * kp][0], acc_s[mi][2 * kp][1]);
        pa[mi][1] = Ops::pack(acc_s[mi][2 * kp][2], acc_s[mi][2 * kp][3]);
        pa[mi][2] = Ops::pack(acc_s[mi][2 * kp + 1][0], acc_s[mi][2 * kp + 1][1]);
        pa[mi][3] = Ops::pack(acc_s[mi][2 * kp + 1][2], acc_s[mi][2 * kp + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DI / 2; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_addr.at(kp * 16, dp) + stage_bytes);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          Ops::mma(acc_o[mi][2 * dp], pa[mi], vb[0], vb[1]);
          Ops::mma(acc_o[mi][2 * dp + 1], pa[mi], vb[2], vb[3]);
        }
      }
    }
  };

  // ---- main loop: key blocks from last to first, K/V double-buffered -----------------------
  int stage = 0;
  for (int n = n_max - 1; n >= n_min; --n, stage ^= 1) {
    cp_async_wait<0>();
    __syncthreads();  // block n has landed; every warp is done with the other stage
    if (n > n_min) {
      load_kv(n - 1, stage ^ 1);
      cp_async_commit();
    }
    if (warp_active) {
      if (kMask || n >= n_full_hi || n < n_full_lo)
        block_step(n, stage, std::true_type{});
      else
        block_step(n, stage, std::false_type{});
    }
  }

  // ---- epilogue ---------------------------------------------------------------------------
  float row_lse[MI][2];
  softmax_finalize<MI, DI>(acc_o, row_m, row_l, row_lse);
  if (write_partial)
    store_partial<Kt>(acc_o, row_lse, oacc_ptr, lseacc_ptr, warp_row0, g, t, rows_here);
  else
    store_output<Kt>(acc_o, row_lse, smem, o_ptr, p.o_row_stride, p.lse, lse_index, row0,
                     rows_here, warp_row0, g, t, tid);
}

// Grid (query tiles, Hq, B * num_splits): blockIdx.z = b * num_splits + split.
template <typename Kt, bool kCausal, bool kMask>
void launch_sharp_fwd(const SharpParams& p, const SplitKV& split, cudaStream_t stream) {
  auto kernel = &sharp_fwd_kernel<Kt, kCausal, kMask>;
  constexpr int kSmem = Kt::kSmemBytes;
  if (kSmem > 48 * 1024)
    check_launch(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                 "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  const dim3 grid(unsigned((p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM), unsigned(p.heads_q),
                  unsigned(p.batch * split.num_splits));
  kernel<<<grid, Kt::kNThreads, kSmem, stream>>>(p, split);
  check_launch(cudaGetLastError(), "sharp_fwd_kernel launch");
}

}  // namespace cuda
}  // namespace sharpdraft
