// sharp_fwd_primitives.h: the warp-level building blocks of the CUDA forward kernel (sm_80+):
// cp.async global->shared copies, ldmatrix fragment loads, the m16n8k16 tensor-core MMA for
// float16 / bfloat16 inputs with float32 accumulators, packing, exp2 and the swizzled
// shared-memory tile layout. Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace sharpdraft {
namespace cuda {

// ---------------------------------------------------------------------------------------
// Shared-memory tiles hold rows of kHeadDim 16-bit elements, split into 16-byte chunks of 8
// elements. The chunk index is XORed with (row % 8), so the 8 row addresses of one ldmatrix
// 8x8 matrix (same logical chunk, 8 consecutive rows) fall into 8 distinct bank groups.
template <int kHeadDim>
__device__ __forceinline__ int swizzle(int row, int col) {
  static_assert(kHeadDim % 64 == 0, "rows must span whole 128-byte bank cycles");
  return row * kHeadDim + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Shared-memory byte addresses of one lane's ldmatrix rows in a swizzled tile. The lane
// reads tile row `lane_row + row_const` (row_const a multiple of 8, so the XOR term stays
// lane_row & 7) at 16-element column group `pair`, taking chunk 2 * pair + lane_chunk. With
// chunk = hi + lo (hi a multiple of 8, lo = (2 * pair) % 8 even) the swizzled chunk is
// hi + (lo ^ y), y = (lane_row & 7) ^ lane_chunk, so four per-lane bases plus a compile-time
// offset address every fragment.
template <int kHeadDim>
struct LaneTileAddr {
  uint32_t base[4];
  __device__ __forceinline__ LaneTileAddr(uint32_t tile, int lane_row, int lane_chunk) {
    const int y = (lane_row & 7) ^ lane_chunk;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      base[j] = tile + uint32_t(lane_row * kHeadDim * 2 + ((2 * j) ^ y) * 16);
  }
  __device__ __forceinline__ uint32_t at(int row_const, int pair) const {
    return base[pair & 3] + uint32_t(row_const * kHeadDim * 2 + ((2 * pair) & ~7) * 16);
  }
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy; when !valid the destination is zero-filled and src is not read.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 b16 matrices; lanes 8m..8m+7 give the row addresses of matrix m, and register m of
// lane l receives row l/4, columns 2(l%4) and 2(l%4)+1 of matrix m (transposed with .trans).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Element-type traits: D(16x8, f32) += A(16x16, row) * B(16x8, col), and float pair packing
// (the first float goes to the low 16 bits, i.e. the lower column).
template <typename T>
struct MmaOps;

template <>
struct MmaOps<__half> {
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

template <>
struct MmaOps<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

// 2^x with the hardware approximation (flushes denormals; 2^-inf = +0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Max over the four lanes of a quad (the lanes that share an accumulator row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace cuda
}  // namespace sharpdraft
