// tile_kernel.h: the per-tile compute of the CPU sharp-attention forward.
//
// Included once by each ISA unit (tile_base.cpp, tile_avx2.cpp, tile_avx512.cpp) after it
// defines SHARP_CPU_ISA (a namespace name), SHARP_VEC_WIDTH (floats per SIMD register),
// SHARP_HAS_F16C (0/1) and SHARP_CPU_TARGET (a _Pragma("GCC target(...)") or nothing). The
// target pragma is applied after every include, so only this file's code (internal linkage or
// inside the ISA namespace) is built for that instruction set; the unit pops it after defining
// its entry point. No std containers here: only raw buffers.
//
// Algorithm (one tile of rows, one key block of BK keys at a time, SPEC §3):
//   pack K^T and V of the block to float32, S = Q K^T (Q already carries c_i = beta_i * scale *
//   log2 e, so S is in base-2 units), mask only on blocks some row does not fully see, online
//   softmax in base 2, acc += P V. Register-blocked micro-kernels: 4 rows x 4 vectors.
#include <immintrin.h>

#include <cstring>

#include "cpu/sharp_cpu.h"
#include "sharp_math.h"

#pragma GCC push_options
SHARP_CPU_TARGET

namespace sharpdraft {
namespace cpu {
namespace SHARP_CPU_ISA {
namespace {

constexpr int VW = SHARP_VEC_WIDTH;  // floats per vector
constexpr int NVK = 4;               // vectors per key block
constexpr int BK = NVK * VW;         // keys per block
constexpr int MR = 4;                // rows per micro-kernel
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));
static_assert(BK <= 64, "scratch is sized for blocks of at most 64 keys");

inline vf load(const float* p) {
  vf x;
  memcpy(&x, p, sizeof x);
  return x;
}
inline void store(float* p, vf x) { memcpy(p, &x, sizeof x); }
inline vf splat(float s) { return vf{} + s; }

// 2^x with relative error below 1e-8 for x >= -126; exactly 0 below (so masked scores of -inf
// give weight 0); NaN stays NaN. Degree-7 Taylor series of 2^f on f in [-1/2, 1/2].
inline vf exp2v(vf x) {
  const vf lo = splat(-126.f), hi = splat(127.f);
  vf xc = x > hi ? hi : x;
  xc = xc < lo ? lo : xc;
  const vf y = xc + 0.5f;
  vi ti = __builtin_convertvector(y, vi);  // truncates toward zero
  ti += (__builtin_convertvector(ti, vf) > y);  // comparison is -1 where true: floor(y)
  const vf f = xc - __builtin_convertvector(ti, vf);
  vf p = splat(1.5252733804059841e-05f);  // ln2^7 / 7!
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  vi bits = (ti + 127) << 23;
  vf scale;
  memcpy(&scale, &bits, sizeof scale);
  const vf r = p * scale;
  return x < lo ? vf{} : r;
}

inline float hmax(vf x) {
  float m = x[0];
  for (int i = 1; i < VW; ++i) m = x[i] > m ? x[i] : m;
  return m;
}
inline float hsum(vf x) {
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += x[i];
  return s;
}

// ---- packing: source rows (any of the three dtypes) to float32 --------------------------
inline void row_to_float(const void* src, DType dt, int64_t n, float* dst) {
  if (dt == DType::kFloat32) {
    memcpy(dst, src, n * sizeof(float));
  } else if (dt == DType::kBFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t d = 0; d < n; ++d) dst[d] = bf16_to_float(s[d]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    int64_t d = 0;
#if SHARP_HAS_F16C
    for (; d + 8 <= n; d += 8) {
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(s + d))));
    }
#endif
    for (; d < n; ++d) dst[d] = fp16_to_float(s[d]);
  }
}

inline int64_t elem_bytes(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

// kt[d * BK + j] = K[k0 + j][d] for j < nk, 0 for nk <= j < BK.
template <int kD>
void pack_kt(const TileTask& t, int64_t k0, int nk, float* kt, float* row) {
  const int64_t D = kD ? kD : t.head_dim;
  const char* base = static_cast<const char*>(t.k);
  for (int j = 0; j < nk; ++j) {
    row_to_float(base + (k0 + j) * t.k_row_stride * elem_bytes(t.dtype), t.dtype, D, row);
    for (int64_t d = 0; d < D; ++d) kt[d * BK + j] = row[d];
  }
  for (int j = nk; j < BK; ++j)
    for (int64_t d = 0; d < D; ++d) kt[d * BK + j] = 0.f;
}

// vb[j * Dp + d] = V[k0 + j][d] (d < D), zero padded up to Dp.
void pack_v(const TileTask& t, int64_t k0, int nk, float* vb) {
  const int64_t D = t.head_dim, Dp = t.dim_padded;
  const char* base = static_cast<const char*>(t.v);
  for (int j = 0; j < nk; ++j) {
    float* dst = vb + j * Dp;
    row_to_float(base + (k0 + j) * t.v_row_stride * elem_bytes(t.dtype), t.dtype, D, dst);
    for (int64_t d = D; d < Dp; ++d) dst[d] = 0.f;
  }
}

// ---- micro-kernels -----------------------------------------------------------------------
// s[r * BK + j] = sum_d q[r * Dp + d] * kt[d * BK + j] for r < R (R <= MR rows).
template <int R, int kD>
inline void qk_block(const float* q, int64_t Dp, int64_t D_rt, const float* kt, float* s) {
  const int64_t D = kD ? kD : D_rt;
  vf acc[R][NVK];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NVK; ++n) acc[r][n] = vf{};
  for (int64_t d = 0; d < D; ++d) {
    vf kv[NVK];
    for (int n = 0; n < NVK; ++n) kv[n] = load(kt + d * BK + n * VW);
    for (int r = 0; r < R; ++r) {
      const vf qb = splat(q[r * Dp + d]);
      for (int n = 0; n < NVK; ++n) acc[r][n] += qb * kv[n];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NVK; ++n) store(s + r * BK + n * VW, acc[r][n]);
}

// acc[r * Dp + c + n * VW] += sum_{j < nk} p[r * BK + j] * v[j * vs + c + n * VW], NV vectors.
template <int R, int NV>
inline void pv_block(const float* p, const float* v, int64_t vs, int nk, float* acc, int64_t Dp,
                     int64_t c) {
  vf a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) a[r][n] = load(acc + r * Dp + c + n * VW);
  for (int j = 0; j < nk; ++j) {
    vf vv[NV];
    for (int n = 0; n < NV; ++n) vv[n] = load(v + j * vs + c + n * VW);
    for (int r = 0; r < R; ++r) {
      const vf pb = splat(p[r * BK + j]);
      for (int n = 0; n < NV; ++n) a[r][n] += pb * vv[n];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) store(acc + r * Dp + c + n * VW, a[r][n]);
}

template <int R>
inline void pv_rows(const float* p, const float* v, int64_t vs, int nk, float* acc, int64_t Dp) {
  int64_t c = 0;
  for (; c + 4 * VW <= Dp; c += 4 * VW) pv_block<R, 4>(p, v, vs, nk, acc, Dp, c);
  switch ((Dp - c) / VW) {
    case 3: pv_block<R, 3>(p, v, vs, nk, acc, Dp, c); break;
    case 2: pv_block<R, 2>(p, v, vs, nk, acc, Dp, c); break;
    case 1: pv_block<R, 1>(p, v, vs, nk, acc, Dp, c); break;
    default: break;
  }
}

template <int kD>
inline void qk_rows(const TileTask& t, int r0, int R, const float* kt, float* s) {
  const float* q = t.q + r0 * t.dim_padded;
  float* sr = s + r0 * BK;
  switch (R) {
    case 4: qk_block<4, kD>(q, t.dim_padded, t.head_dim, kt, sr); break;
    case 3: qk_block<3, kD>(q, t.dim_padded, t.head_dim, kt, sr); break;
    case 2: qk_block<2, kD>(q, t.dim_padded, t.head_dim, kt, sr); break;
    default: qk_block<1, kD>(q, t.dim_padded, t.head_dim, kt, sr); break;
  }
}

inline void pv_any(const TileTask& t, int r0, int R, const float* s, const float* v, int64_t vs,
                   int nk) {
  float* acc = t.acc + r0 * t.dim_padded;
  const float* p = s + r0 * BK;
  switch (R) {
    case 4: pv_rows<4>(p, v, vs, nk, acc, t.dim_padded); break;
    case 3: pv_rows<3>(p, v, vs, nk, acc, t.dim_padded); break;
    case 2: pv_rows<2>(p, v, vs, nk, acc, t.dim_padded); break;
    default: pv_rows<1>(p, v, vs, nk, acc, t.dim_padded); break;
  }
}

// Online-softmax step for row r on scores s_r[0, BK) of keys [k0, k0 + BK): masks what the row
// cannot see (only when `full` is false), turns scores into weights in place, rescales acc.
inline void softmax_row(const TileTask& t, int r, int64_t k0, int nk, bool full, float* s_r) {
  if (!full) {
    const int64_t lo = t.lo[r], hi = t.hi[r];
    const bool* mrow = t.mask_rows ? t.mask_rows[r] : nullptr;
    for (int j = 0; j < BK; ++j) {
      const int64_t key = k0 + j;
      const bool vis = j < nk && key >= lo && key < hi && (!mrow || mrow[key]);
      if (!vis) s_r[j] = -__builtin_inff();
    }
  }
  vf mx = load(s_r);
  for (int n = 1; n < NVK; ++n) {
    const vf x = load(s_r + n * VW);
    mx = x > mx ? x : mx;
  }
  const float alpha = online_rescale(t.m[r], hmax(mx));
  const vf ms = splat(safe_max(t.m[r]));
  vf sum = vf{};
  for (int n = 0; n < NVK; ++n) {
    const vf p = exp2v(load(s_r + n * VW) - ms);
    store(s_r + n * VW, p);
    sum += p;
  }
  t.l[r] = t.l[r] * alpha + hsum(sum);
  if (alpha != 1.f) {
    float* a = t.acc + r * t.dim_padded;
    const vf av = splat(alpha);
    for (int64_t c = 0; c < t.dim_padded; c += VW) store(a + c, load(a + c) * av);
  }
}

template <int kD>
void attend(const TileTask& t) {
  const int64_t D = kD ? kD : t.head_dim, Dp = t.dim_padded;
  float* kt = t.scratch;                 // (D, BK)
  float* vb = kt + kMaxHeadDim * 64;     // (BK, Dp)
  float* s = vb + kMaxHeadDim * 64;      // (rows, BK)
  float row[kMaxHeadDim];
  // float32 V whose rows are already padded-width vectors is read in place.
  const bool v_in_place = t.dtype == DType::kFloat32 && D == Dp;
  for (int64_t k0 = t.k_begin; k0 < t.k_end; k0 += BK) {
    const int nk = static_cast<int>(t.k_end - k0 < BK ? t.k_end - k0 : BK);
    pack_kt<kD>(t, k0, nk, kt, row);
    const float* v = vb;
    int64_t vs = Dp;
    if (v_in_place) {
      v = static_cast<const float*>(t.v) + k0 * t.v_row_stride;
      vs = t.v_row_stride;
    } else {
      pack_v(t, k0, nk, vb);
    }
    for (int r0 = 0; r0 < t.rows; r0 += MR) {
      const int R = t.rows - r0 < MR ? t.rows - r0 : MR;
      // Rows that see no key of this block are skipped entirely.
      bool any = false;
      for (int r = r0; r < r0 + R; ++r) any |= t.lo[r] < k0 + nk && t.hi[r] > k0;
      if (!any) continue;
      qk_rows<kD>(t, r0, R, kt, s);
      for (int r = r0; r < r0 + R; ++r) {
        const bool full = nk == BK && !t.mask_rows && t.lo[r] <= k0 && t.hi[r] >= k0 + BK;
        softmax_row(t, r, k0, nk, full, s + r * BK);
      }
      pv_any(t, r0, R, s, v, vs, nk);
    }
  }
}

}  // namespace
}  // namespace SHARP_CPU_ISA
}  // namespace cpu
}  // namespace sharpdraft
