// tile_kernel.h: the per-tile compute of the CPU sharp-attention forward.
//
// Included once by each ISA unit (tile_base.cpp, tile_avx2.cpp, tile_avx512.cpp) after it
// defines SHARP_CPU_ISA (a namespace name), SHARP_VEC_WIDTH (floats per SIMD register),
// SHARP_HAS_F16C (0/1) and SHARP_CPU_TARGET (a _Pragma("GCC target(...)") or nothing). The
// target pragma is applied after the standard headers, so only internal-linkage code and code
// inside the ISA namespace is built for that instruction set (nothing another unit could share);
// the unit pops it after defining its entry point. No std containers here: only raw buffers.
//
// Algorithm (spec §3), one block of kKeyBlock keys at a time (two passes when TileTask::exact,
// see attend_exact):
//   S^T = K Q^T with the SIMD lanes running over query rows (Q^T is packed once per tile and
//   already carries c_i = beta_i * scale, so the scaling costs nothing per score); K is read in
//   place (float32) or converted once per block (16-bit); masking only on blocks some row does
//   not fully see; online softmax (exp via a base-2 polynomial), one lane per row; acc += P V
//   with the lanes over the head dim. Register-blocked micro-kernels sized per instruction set.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "attention/cpu/sharp_cpu.h"

#pragma GCC push_options
SHARP_CPU_TARGET
// After the target pragma: its static inline (internal-linkage) maths is built for this ISA.
#include "attention/sharp_math.h"

namespace sharpdraft {
namespace cpu {
namespace SHARP_CPU_ISA {
namespace {

constexpr int VW = SHARP_VEC_WIDTH;  // floats per vector
constexpr int BK = kKeyBlock;
// Micro-kernel shapes: accumulators plus operands must fit the register file (32 vector
// registers with AVX-512, 16 below; AVX-512 also broadcasts straight from memory).
constexpr bool kWide = VW >= 16;
// Keys per QK micro-kernel for NR row vectors: enough independent accumulators (>= 8) to hide
// the FMA latency when few rows leave few row vectors, within the register budget.
constexpr int qk_keys_for(int nr) {
  return kWide ? (nr >= 4 ? 6 : nr == 3 ? 8 : 12) : (nr >= 2 ? 6 : 12);
}
constexpr int QK_RV = kWide ? 4 : 2;     // row vectors per QK micro-kernel
constexpr int PV_ROWS = kWide ? 6 : 3;   // rows per PV micro-kernel
constexpr int PV_DV = kWide ? 4 : 3;     // head-dim vectors per PV micro-kernel
#include "common/simd_vec.h"  // vf, load, store, splat
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));

// 2^x with relative error below 1e-8 for x >= -126; exactly 0 below (so masked scores of -inf
// give weight 0); NaN stays NaN. Degree-7 Taylor series of 2^f on f in [-1/2, 1/2].
struct Exp2v {
  vf operator()(vf x) const {
    const vf lo = splat(-126.f), hi = splat(127.f);
    vf xc = x > hi ? hi : x;
    xc = xc < lo ? lo : xc;
    const vf y = xc + 0.5f;
    vi ti = __builtin_convertvector(y, vi);       // truncates toward zero
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
    const vi bits = (ti + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    const vf r = p * scale;
    return x < lo ? vf{} : r;
  }
};

// e^x = 2^(x log2 e). Scores stay in natural units so that s - m is formed before the
// conversion: its rounding then scales with |s - m|, not with |s|.
struct Expv {
  vf operator()(vf x) const { return Exp2v{}(x * kLog2e); }
};

// ---- conversion of source rows (any of the three dtypes) to float32 ----------------------
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

// dst[j * ld + d] = src row (k0 + j), d < D, zero padded up to ld, for j < nk.
inline void convert_block(const void* src, int64_t row_stride, DType dt, int64_t k0, int nk,
                          int64_t D, int64_t ld, float* dst) {
  const char* base = static_cast<const char*>(src);
  const int64_t eb = elem_bytes(dt);
  for (int j = 0; j < nk; ++j) {
    float* o = dst + j * ld;
    row_to_float(base + (k0 + j) * row_stride * eb, dt, D, o);
    for (int64_t d = D; d < ld; ++d) o[d] = 0.f;
  }
}

// Rows k0 .. k0 + nk of K or V as float32: read in place when `in_place` (a float32 source),
// else converted into buf (row stride Dp). Sets `stride` to the row stride of the result.
inline const float* block_rows(const void* src, int64_t row_stride, bool in_place, DType dt,
                               int64_t k0, int nk, int64_t D, int64_t Dp, float* buf,
                               int64_t& stride) {
  if (in_place) {
    stride = row_stride;
    return static_cast<const float*>(src) + k0 * row_stride;
  }
  convert_block(src, row_stride, dt, k0, nk, D, Dp, buf);
  stride = Dp;
  return buf;
}

// ---- QK: st[j * Rp + r] = sum_d k[j * ks + d] * qt[d * Rp + r] ---------------------------
// acc[j][n] += k[j * ks + d] * qt[d * Rp + n * VW] for d = d0, d0 + step, ... below d1, in
// that order (NK keys x NR row vectors).
template <int NK, int NR>
__attribute__((always_inline)) inline void qk_accumulate(vf (&acc)[NK][NR], const float* k,
                                                         int64_t ks, const float* qt, int64_t Rp,
                                                         int64_t d0, int64_t d1, int64_t step) {
  for (int64_t d = d0; d < d1; d += step) {
    vf qv[NR];
    for (int n = 0; n < NR; ++n) qv[n] = load(qt + d * Rp + n * VW);
    for (int j = 0; j < NK; ++j) {
      const vf kb = splat(k[j * ks + d]);
      for (int n = 0; n < NR; ++n) acc[j][n] += kb * qv[n];
    }
  }
}

// NK keys x NR row vectors; k, qt and st already point at the first key / row of the block.
template <int NK, int NR, int kD>
__attribute__((noinline)) void qk_micro(const float* k, int64_t ks, const float* qt, int64_t Rp, int64_t D_rt,
                     float* st) {
  const int64_t D = kD ? kD : D_rt;
  vf acc[NK][NR];
  for (int j = 0; j < NK; ++j)
    for (int n = 0; n < NR; ++n) acc[j][n] = vf{};
  qk_accumulate(acc, k, ks, qt, Rp, 0, D, 1);
  for (int j = 0; j < NK; ++j)
    for (int n = 0; n < NR; ++n) store(st + j * Rp + n * VW, acc[j][n]);
}

// ---- QK in the dot-product path's order (TileTask::dot_order) -----------------------------
// The same sums as qk_dot_row forms them, with the lanes over rows: head-dim lane i gathers
// d = i, i + VW, ... in turn, the lanes are then added 0 .. VW - 1, and the tail past the last
// full vector comes last. An exact tile of many rows (a verification) then scores a row with
// the bits a decode step of 1-2 rows a KV head gets from the dot-product path. Twice the
// accumulators of qk_micro, so fewer keys per call (qk_dot_keys_for).
constexpr int qk_dot_keys_for(int nr) {
  return kWide ? (nr >= 4 ? 3 : nr == 3 ? 4 : nr == 2 ? 6 : 12) : (nr >= 2 ? 3 : 6);
}
template <int NK, int NR, int kD>
__attribute__((noinline)) void qk_micro_dot(const float* k, int64_t ks, const float* qt,
                                            int64_t Rp, int64_t D_rt, float* st) {
  const int64_t D = kD ? kD : D_rt, Dv = D / VW * VW;
  vf tot[NK][NR];
  for (int j = 0; j < NK; ++j)
    for (int n = 0; n < NR; ++n) tot[j][n] = vf{};
  for (int i = 0; i < VW; ++i) {
    vf part[NK][NR];
    for (int j = 0; j < NK; ++j)
      for (int n = 0; n < NR; ++n) part[j][n] = vf{};
    qk_accumulate(part, k, ks, qt, Rp, i, Dv, VW);
    for (int j = 0; j < NK; ++j)
      for (int n = 0; n < NR; ++n) tot[j][n] += part[j][n];
  }
  qk_accumulate(tot, k, ks, qt, Rp, Dv, D, 1);
  for (int j = 0; j < NK; ++j)
    for (int n = 0; n < NR; ++n) store(st + j * Rp + n * VW, tot[j][n]);
}

// Picks the micro-kernel for nr_left row vectors at compile time (kDotOrder: qk_micro_dot):
// full micro-kernels of qk_keys_for(NR) keys, then the remaining keys one at a time.
template <int kD, bool kDotOrder, int NR = QK_RV>
inline void qk_rows(int nr_left, int nk, const float* k, int64_t ks, const float* qt, int64_t Rp,
                    int64_t D, float* st) {
  if (nr_left == NR) {
    if constexpr (kDotOrder) {
      constexpr int NK = qk_dot_keys_for(NR);
      int j = 0;
      for (; j + NK <= nk; j += NK) {
        qk_micro_dot<NK, NR, kD>(k + j * ks, ks, qt, Rp, D, st + j * Rp);
      }
      for (; j < nk; ++j) qk_micro_dot<1, NR, kD>(k + j * ks, ks, qt, Rp, D, st + j * Rp);
    } else {
      constexpr int NK = qk_keys_for(NR);
      int j = 0;
      for (; j + NK <= nk; j += NK) qk_micro<NK, NR, kD>(k + j * ks, ks, qt, Rp, D, st + j * Rp);
      for (; j < nk; ++j) qk_micro<1, NR, kD>(k + j * ks, ks, qt, Rp, D, st + j * Rp);
    }
  } else if constexpr (NR > 1) {
    qk_rows<kD, kDotOrder, NR - 1>(nr_left, nk, k, ks, qt, Rp, D, st);
  }
}

// ---- QK for very few rows (decode): lanes over the head dim ------------------------------
// st[j * Rp + r] = <q_r, k_j> for 4 keys at a time, with q_r read from `qrow` (Dp floats, zero
// padded) and keys from k (row stride ks, Dp-padded when converted; in place when float32, in
// which case the head-dim tail past the last full vector is added in scalar form).
inline void qk_dot_row(const float* qrow, int64_t D, const float* k, int64_t ks, int nk,
                       float* st, int64_t Rp) {
  const int64_t Dv = D / VW * VW;
  int j = 0;
  for (; j + 4 <= nk; j += 4) {
    vf acc[4] = {};
    for (int64_t c = 0; c < Dv; c += VW) {
      const vf qv = load(qrow + c);
      for (int kk = 0; kk < 4; ++kk) acc[kk] += qv * load(k + (j + kk) * ks + c);
    }
    for (int kk = 0; kk < 4; ++kk) {
      float sum = 0.f;
      for (int i = 0; i < VW; ++i) sum += acc[kk][i];
      for (int64_t d = Dv; d < D; ++d) sum += qrow[d] * k[(j + kk) * ks + d];
      st[(j + kk) * Rp] = sum;
    }
  }
  for (; j < nk; ++j) {
    vf acc = vf{};
    for (int64_t c = 0; c < Dv; c += VW) acc += load(qrow + c) * load(k + j * ks + c);
    float sum = 0.f;
    for (int i = 0; i < VW; ++i) sum += acc[i];
    for (int64_t d = Dv; d < D; ++d) sum += qrow[d] * k[j * ks + d];
    st[j * Rp] = sum;
  }
}

// ---- PV: acc[r * Dp + c] += sum_j st[j * Rp + r] * v[j * vs + c] -------------------------
// kSafe (a block holding a non-finite value, where some row of the group is masked): a weight
// of 0 contributes exactly 0, so a NaN or inf value of a key a row cannot see never reaches that
// row (spec §5). The micro-kernels are kept out of line so each gets the whole register file.
template <int R, int NV, bool kSafe>
__attribute__((noinline)) void pv_micro(const float* pt, int64_t Rp, const float* v, int64_t vs, int nk, float* acc,
                     int64_t Dp) {
  vf a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) a[r][n] = load(acc + r * Dp + n * VW);
  for (int j = 0; j < nk; ++j) {
    vf vv[NV];
    for (int n = 0; n < NV; ++n) vv[n] = load(v + j * vs + n * VW);
    for (int r = 0; r < R; ++r) {
      const vf pb = splat(pt[j * Rp + r]);
      for (int n = 0; n < NV; ++n) {
        if constexpr (kSafe) {
          a[r][n] += pb != 0.f ? pb * vv[n] : vf{};
        } else {
          a[r][n] += pb * vv[n];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) store(acc + r * Dp + n * VW, a[r][n]);
}

template <int R, bool kSafe, int NV = PV_DV>
inline void pv_dims(int nv_left, const float* pt, int64_t Rp, const float* v, int64_t vs, int nk,
                    float* acc, int64_t Dp) {
  if (nv_left == NV) {
    pv_micro<R, NV, kSafe>(pt, Rp, v, vs, nk, acc, Dp);
  } else if constexpr (NV > 1) {
    pv_dims<R, kSafe, NV - 1>(nv_left, pt, Rp, v, vs, nk, acc, Dp);
  }
}

template <int R = PV_ROWS>
inline void pv_rows(int nr_left, int nv, bool safe, const float* pt, int64_t Rp, const float* v,
                    int64_t vs, int nk, float* acc, int64_t Dp) {
  if (nr_left == R) {
    if (safe) {
      pv_dims<R, true>(nv, pt, Rp, v, vs, nk, acc, Dp);
    } else {
      pv_dims<R, false>(nv, pt, Rp, v, vs, nk, acc, Dp);
    }
  } else if constexpr (R > 1) {
    pv_rows<R - 1>(nr_left, nv, safe, pt, Rp, v, vs, nk, acc, Dp);
  }
}

// ---- masking: -inf for the keys a row cannot see ------------------------------------------
// Rows r0 .. r0 + VW of block [k0, k0 + nk); rows that see the whole block are left alone.
inline void mask_block(const TileTask& t, int r0, int64_t k0, int nk, const bool* row_full,
                       float* st) {
  const int64_t Rp = t.rows_padded;
  for (int r = r0; r < r0 + VW && r < t.rows; ++r) {
    if (row_full[r]) continue;
    const int64_t lo = t.lo[r], hi = t.hi[r];
    const bool* mrow = t.mask_rows ? t.mask_rows[r] : nullptr;
    for (int j = 0; j < nk; ++j) {
      const int64_t key = k0 + j;
      const bool vis = key >= lo && key < hi && (!mrow || mrow[key]);
      if (!vis) st[j * Rp + r] = -__builtin_inff();
    }
  }
}

// ---- online softmax over one row vector (lanes = rows r0 .. r0 + VW) ----------------------
// Masks what each row cannot see, turns scores into weights in place, updates m and l, and
// rescales the rows' accumulators.
inline void softmax_rows(const TileTask& t, int r0, int64_t k0, int nk, const bool* row_full,
                         float* st) {
  const int64_t Rp = t.rows_padded;
  mask_block(t, r0, k0, nk, row_full, st);
  vf bmax = load(st + r0);
  for (int j = 1; j < nk; ++j) {
    const vf x = load(st + j * Rp + r0);
    bmax = x > bmax ? x : bmax;
  }
  vf m = load(t.m + r0);
  const vf alpha = online_rescale(m, bmax, Expv{});
  store(t.m + r0, m);
  const vf ms = safe_max(m);
  vf sum = vf{};
  for (int j = 0; j < nk; ++j) {
    const vf p = Expv{}(load(st + j * Rp + r0) - ms);
    store(st + j * Rp + r0, p);
    sum += p;
  }
  store(t.l + r0, load(t.l + r0) * alpha + sum);
  for (int i = 0; i < VW && r0 + i < t.rows; ++i) {
    if (alpha[i] == 1.f) continue;
    float* a = t.acc + (r0 + i) * t.dim_padded;
    const vf av = splat(alpha[i]);
    for (int64_t c = 0; c < t.dim_padded; c += VW) store(a + c, load(a + c) * av);
  }
}

// No NaN or inf among the first nk rows (Dp floats each) of a value block.
inline bool all_finite(const float* v, int64_t vs, int nk, int64_t Dp) {
  const vf big = splat(3.4028234663852886e38f);
  vi ok = vi{} - 1;
  for (int j = 0; j < nk; ++j)
    for (int64_t c = 0; c < Dp; c += VW) {
      const vf x = load(v + j * vs + c);
      ok &= (x <= big) & (x >= -big);  // false for NaN and +-inf
    }
  for (int i = 0; i < VW; ++i)
    if (!ok[i]) return false;
  return true;
}

inline bool sees_block(const TileTask& t, int r, int64_t k0, int nk) {
  return t.lo[r] < k0 + nk && t.hi[r] > k0;
}
// n bytes of a bool mask row are all true (8 at a time).
inline bool all_true(const bool* m, int n) {
  constexpr uint64_t kOnes = 0x0101010101010101ull;
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t w;
    memcpy(&w, m + j, 8);
    if (w != kOnes) return false;
  }
  for (; j < n; ++j)
    if (!m[j]) return false;
  return true;
}

// Row r sees every key of the block: no masking needed (a tree mask's prefix blocks, say).
inline bool sees_all(const TileTask& t, int r, int64_t k0, int nk) {
  return t.lo[r] <= k0 && t.hi[r] >= k0 + nk &&
         (!t.mask_rows || all_true(t.mask_rows[r] + k0, nk));
}

// Raw scores of block [k0, k0 + nk) into st (keys x rows_padded), for row chunks of QK_RV
// vectors that see the block; chunks whose rows all miss it get `dead` (and chunk_live false).
template <int kD>
void block_scores(const TileTask& t, int64_t k0, int nk, const float* k, int64_t ks, float* st,
                  float dead, bool* chunk_live) {
  const int64_t D = kD ? kD : t.head_dim, Rp = t.rows_padded;
  for (int c = 0, ci = 0; c < Rp; c += QK_RV * VW, ++ci) {
    const int nr = static_cast<int>((Rp - c) / VW < QK_RV ? (Rp - c) / VW : QK_RV);
    chunk_live[ci] = false;
    for (int r = c; r < c + nr * VW && r < t.rows; ++r) chunk_live[ci] |= sees_block(t, r, k0, nk);
    if (!chunk_live[ci]) {  // a PV row group may straddle live and dead chunks
      const vf fill = splat(dead);
      for (int j = 0; j < nk; ++j)
        for (int n = 0; n < nr; ++n) store(st + j * Rp + c + n * VW, fill);
    } else if (t.rows > kDotRows && t.dot_order) {
      qk_rows<kD, true>(nr, nk, k, ks, t.qt + c, Rp, D, st + c);
    } else if (t.rows > kDotRows) {
      qk_rows<kD, false>(nr, nk, k, ks, t.qt + c, Rp, D, st + c);
    }
  }
  if (t.rows <= kDotRows && chunk_live[0]) {
    for (int r = 0; r < t.rows; ++r) {
      qk_dot_row(t.q_rows + r * t.dim_padded, D, k, ks, nk, st + r, Rp);
    }
  }
}

// acc += P V over block [k0, k0 + nk) (weights in st), head-dim chunks outermost so each chunk
// of V stays in L1 across row groups.
inline void block_pv(const TileTask& t, int64_t k0, int nk, const bool* row_full, const float* st,
                     const float* v, int64_t vs) {
  const int64_t Dp = t.dim_padded, Rp = t.rows_padded;
  bool group_live[kMaxTileRows] = {}, group_masked[kMaxTileRows] = {}, any_masked = false;
  for (int r0 = 0, g = 0; r0 < t.rows; r0 += PV_ROWS, ++g) {
    for (int r = r0; r < r0 + PV_ROWS && r < t.rows; ++r) {
      group_live[g] |= sees_block(t, r, k0, nk);
      group_masked[g] |= !row_full[r];
    }
    any_masked |= group_live[g] && group_masked[g];
  }
  const bool v_finite = !any_masked || all_finite(v, vs, nk, Dp);
  for (int64_t c = 0; c < Dp; c += PV_DV * VW) {
    const int nv = static_cast<int>((Dp - c) / VW < PV_DV ? (Dp - c) / VW : PV_DV);
    for (int r0 = 0, g = 0; r0 < t.rows; r0 += PV_ROWS, ++g) {
      const int nr = t.rows - r0 < PV_ROWS ? t.rows - r0 : PV_ROWS;
      if (group_live[g]) {
        pv_rows(nr, nv, group_masked[g] && !v_finite, st + r0, Rp, v + c, vs, nk,
                t.acc + r0 * Dp + c, Dp);
      }
    }
  }
}

// One pass, online softmax: a running max per row, rescaled block by block.
template <int kD>
void attend_online(const TileTask& t) {
  const int64_t D = kD ? kD : t.head_dim, Dp = t.dim_padded, Rp = t.rows_padded;
  float* kb = t.scratch;            // (BK, Dp) converted keys
  float* vb = kb + BK * kMaxHeadDim;  // (BK, Dp) converted values
  float* st = vb + BK * kMaxHeadDim;  // (BK, Rp) scores, then weights
  const bool f32 = t.dtype == DType::kFloat32;
  const bool v_in_place = f32 && D == Dp;  // float32 values read where they are
  for (int64_t k0 = t.k_begin; k0 < t.k_end; k0 += BK) {
    const int nk = static_cast<int>(t.k_end - k0 < BK ? t.k_end - k0 : BK);
    int64_t ks, vs;
    const float* k = block_rows(t.k, t.k_row_stride, f32, t.dtype, k0, nk, D, Dp, kb, ks);
    const float* v = block_rows(t.v, t.v_row_stride, v_in_place, t.dtype, k0, nk, D, Dp, vb, vs);
    bool chunk_live[kMaxTileRows];
    block_scores<kD>(t, k0, nk, k, ks, st, 0.f, chunk_live);  // dead rows: weights of 0
    bool row_full[kMaxTileRows];
    for (int r = 0; r < t.rows; ++r) row_full[r] = sees_all(t, r, k0, nk);
    for (int r0 = 0; r0 < Rp; r0 += VW) {
      if (chunk_live[r0 / (QK_RV * VW)]) softmax_rows(t, r0, k0, nk, row_full, st);
    }
    block_pv(t, k0, nk, row_full, st, v, vs);
  }
}

// Two passes (t.exact): every score of the range first, so each row's max is final before any
// weight; then weights, their sum and acc += P V, one key after another. Masked keys add exact
// zeros and no rescaling happens, so a row's result depends only on its visible keys' values
// in key order, not on where block boundaries or masked keys fall: a tree node's row is the
// same bits as the row decoded alone (the lossless engine's premise, docs/runtime.md).
template <int kD>
void attend_exact(const TileTask& t) {
  const int64_t D = kD ? kD : t.head_dim, Dp = t.dim_padded, Rp = t.rows_padded;
  float* kb = t.scratch;            // (BK, Dp) converted keys
  float* vb = kb + BK * kMaxHeadDim;  // (BK, Dp) converted values
  float* sc = vb + BK * kMaxHeadDim;  // (k_end - k_begin, Rp) scores, then weights
  const bool f32 = t.dtype == DType::kFloat32;
  const bool v_in_place = f32 && D == Dp;
  for (int64_t k0 = t.k_begin; k0 < t.k_end; k0 += BK) {
    const int nk = static_cast<int>(t.k_end - k0 < BK ? t.k_end - k0 : BK);
    float* st = sc + (k0 - t.k_begin) * Rp;
    int64_t ks;
    const float* k = block_rows(t.k, t.k_row_stride, f32, t.dtype, k0, nk, D, Dp, kb, ks);
    bool chunk_live[kMaxTileRows];
    block_scores<kD>(t, k0, nk, k, ks, st, -__builtin_inff(), chunk_live);  // dead: weight 0
    bool row_full[kMaxTileRows];
    for (int r = 0; r < t.rows; ++r) row_full[r] = sees_all(t, r, k0, nk);
    for (int r0 = 0; r0 < Rp; r0 += VW) {
      if (chunk_live[r0 / (QK_RV * VW)]) mask_block(t, r0, k0, nk, row_full, st);
    }
  }
  // Every row vector, dead ones too: a row that sees nothing keeps m = -inf, gets weights of
  // exp(-inf) = 0 and l = 0 (a PV row group may straddle it and live rows).
  const int64_t span = t.k_end - t.k_begin;
  for (int r0 = 0; r0 < Rp; r0 += VW) {
    vf m = load(t.m + r0);
    for (int64_t j = 0; j < span; ++j) {
      const vf x = load(sc + j * Rp + r0);
      m = x > m ? x : m;
    }
    store(t.m + r0, m);
  }
  for (int64_t k0 = t.k_begin; k0 < t.k_end; k0 += BK) {
    const int nk = static_cast<int>(t.k_end - k0 < BK ? t.k_end - k0 : BK);
    float* st = sc + (k0 - t.k_begin) * Rp;
    for (int r0 = 0; r0 < Rp; r0 += VW) {
      const vf ms = safe_max(load(t.m + r0));
      vf l = load(t.l + r0);
      for (int j = 0; j < nk; ++j) {
        const vf p = Expv{}(load(st + j * Rp + r0) - ms);
        store(st + j * Rp + r0, p);
        l += p;
      }
      store(t.l + r0, l);
    }
    int64_t vs;
    const float* v = block_rows(t.v, t.v_row_stride, v_in_place, t.dtype, k0, nk, D, Dp, vb, vs);
    bool row_full[kMaxTileRows];
    for (int r = 0; r < t.rows; ++r) row_full[r] = sees_all(t, r, k0, nk);
    block_pv(t, k0, nk, row_full, st, v, vs);
  }
}

template <int kD>
void attend(const TileTask& t) {
  if (t.exact) {
    attend_exact<kD>(t);
  } else {
    attend_online<kD>(t);
  }
}

}  // namespace
}  // namespace SHARP_CPU_ISA
}  // namespace cpu
}  // namespace sharpdraft
