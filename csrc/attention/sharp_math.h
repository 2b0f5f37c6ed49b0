// sharp_math.h: the per-row maths of sharp attention, shared by the CPU kernel, the CUDA
// kernel and the C++ unit tests (spec §1-§3). Torch-free; compiles as C++17 and CUDA.
//
// Every function has internal linkage (static inline), so CPU units compiled for different
// instruction sets never share an out-of-line copy.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention/sharp_params.h"

#if defined(__CUDACC__)
#define SHARP_HD static __host__ __device__ __forceinline__
#define SHARP_HD_MEMBER __host__ __device__ __forceinline__
#else
#define SHARP_HD static inline
#define SHARP_HD_MEMBER inline
#endif

namespace sharpdraft {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e)
constexpr float kLn2 = 0.6931471805599453f;    // ln(2)

// ---------------------------------------------------------------------------------------
// Addressing (see SharpParams): the element offset of row i of batch b, head h.
SHARP_HD int64_t row_offset(const int32_t* cu_seqlens, int64_t b, int64_t h, int64_t i,
                            int64_t batch_stride, int64_t head_stride, int64_t row_stride) {
  return cu_seqlens ? (static_cast<int64_t>(cu_seqlens[b]) + i) * row_stride + h * head_stride
                    : b * batch_stride + h * head_stride + i * row_stride;
}

// Sequence lengths of batch b (spec §2: kv_len_b = kv_lens[b] if given, else Lk).
SHARP_HD int64_t seqlen_q_of(const SharpParams& p, int64_t b) {
  return p.cu_seqlens_q ? int64_t(p.cu_seqlens_q[b + 1]) - p.cu_seqlens_q[b] : p.seqlen_q;
}
SHARP_HD int64_t seqlen_k_of(const SharpParams& p, int64_t b) {
  if (p.cu_seqlens_k) return int64_t(p.cu_seqlens_k[b + 1]) - p.cu_seqlens_k[b];
  return p.kv_lens ? int64_t(p.kv_lens[b]) : p.seqlen_k;
}

// ---------------------------------------------------------------------------------------
// Visible keys (spec §2). Without an attn_mask the visible set of row i is the contiguous
// key range [lo, hi); with a mask it is the subset of that range the mask keeps.
struct KeyRange {
  int64_t lo, hi;  // empty when hi <= lo
};

// Bottom-right alignment: query row i sits at absolute position i + kv_len - len_q.
SHARP_HD KeyRange visible_range(int64_t i, int64_t len_q, int64_t kv_len, bool causal,
                                int64_t window) {
  KeyRange r{0, kv_len};
  if (causal) {
    const int64_t pos = i + kv_len - len_q;
    r.hi = pos + 1 < kv_len ? pos + 1 : kv_len;
    if (window > 0) r.lo = pos - window + 1 > 0 ? pos - window + 1 : 0;
  }
  if (r.hi < r.lo) r.hi = r.lo;
  if (r.hi < 0) r.lo = r.hi = 0;
  return r;
}

// Closed-form cardinality n_i when no mask is given.
SHARP_HD int64_t range_count(KeyRange r) { return r.hi > r.lo ? r.hi - r.lo : 0; }

// ---------------------------------------------------------------------------------------
// beta(n) (spec §1, §3), clamped to [beta_min, beta_max]; mode kNone returns exactly 1.
// `slope` is the lambda of this row's head.
SHARP_HD double query_scale(int64_t n, ScaleMode mode, double slope, int64_t n_ref,
                            int64_t topk, double contrast, double beta_min, double beta_max) {
  double beta = 1.0;
  if (mode == ScaleMode::kNone) return 1.0;
  if (mode == ScaleMode::kFixedSlope) {
    // n = 0 gives ln(0) = -inf; a row with no keys is empty anyway and clamps to beta_min.
    beta = n > 0 ? 1.0 + slope * log(double(n) / double(n_ref)) : -__builtin_inf();
    if (slope == 0.0) beta = 1.0;
  } else {  // kExactTopk: beta_exact(n) = 1 + ln((n - k) / (n_ref - k)) / Delta for n > k
    beta = n > topk ? 1.0 + log(double(n - topk) / double(n_ref - topk)) / contrast : 1.0;
  }
  beta = beta < beta_min ? beta_min : beta;
  beta = beta > beta_max ? beta_max : beta;
  return beta;
}

SHARP_HD double query_scale(int64_t n, const ScaleParams& sp, int64_t head) {
  const double slope = sp.slope_per_head ? double(sp.slope_per_head[head]) : sp.slope;
  return query_scale(n, sp.mode, slope, sp.n_ref, sp.topk, sp.contrast, sp.beta_min,
                     sp.beta_max);
}

// The per-row factor the kernels fold into the scores, computed once per row in double.
// Base-2 softmax (CUDA): s_ij = c_i <q_i, k_j> with c_i = beta_i * scale * log2(e).
SHARP_HD float exponent_factor(double beta, float softmax_scale) {
  return float(beta * double(softmax_scale) * double(kLog2e));
}
// Natural-log softmax (CPU): c_i = beta_i * scale, exact when both are powers of two (the
// common 1/sqrt(D) with beta = 1), so plain attention rounds no more than SDPA does.
SHARP_HD float score_factor(double beta, float softmax_scale) {
  return float(beta * double(softmax_scale));
}

// ---------------------------------------------------------------------------------------
// Online softmax, base 2. A row keeps its running max m (in base-2 logit units) and its
// running sum l of exp2(s - m). Before adding a block whose max is block_max:
//   alpha = online_rescale(m, block_max, exp2)   ->  l *= alpha, acc *= alpha, then
//   p_j = exp2(s_j - safe_max(m)) and l += sum_j p_j.
// A row that has seen only masked keys keeps m = -inf and l = 0.
// T is float, or a GCC vector of floats (the CPU kernel runs one lane per query row); `exp2`
// is the caller's base-2 exponential for T (exp2f on CUDA, a polynomial on the CPU).
template <class T, class Exp2>
SHARP_HD T online_rescale(T& m, T block_max, Exp2 exp2) {
  const T m_new = m > block_max ? m : block_max;
  const T alpha = m == -__builtin_inff() ? T{} : exp2(m - m_new);
  m = m_new;
  return alpha;
}
struct Exp2f {
  SHARP_HD_MEMBER float operator()(float x) const { return exp2f(x); }
};
// The scalar step with the C library's exp2f.
SHARP_HD float online_rescale(float& m, float block_max) {
  return online_rescale(m, block_max, Exp2f{});
}
// The max to subtract: 0 for a row with no visible key yet, so exp2(-inf - 0) = 0, not NaN.
template <class T>
SHARP_HD T safe_max(T m) { return m == -__builtin_inff() ? T{} : m; }

// Final row values: out = acc * inv_sum, lse in natural log (from a base-2 row state);
// empty rows give 0 and -inf.
SHARP_HD float finalize_inv_sum(float l) { return l > 0.f ? 1.f / l : 0.f; }
SHARP_HD float finalize_lse(float m, float l) {
  return l > 0.f ? (m + log2f(l)) * kLn2 : -__builtin_inff();
}
// The same for a row kept in natural-log units (m a natural-log max, l a sum of exp(s - m)).
SHARP_HD float finalize_lse_natural(float m, float l) {
  return l > 0.f ? m + logf(l) : -__builtin_inff();
}

// Merge of split-KV partial results (each normalised, with its natural-log lse):
// lse = log(sum_s exp(lse_s)), out = sum_s w_s * out_s with w_s = exp(lse_s - lse).
SHARP_HD float lse_merge(float a, float b) {
  if (a == -__builtin_inff()) return b;
  if (b == -__builtin_inff()) return a;
  const float mx = a > b ? a : b;
  const float mn = a > b ? b : a;
  return mx + log1pf(expf(mn - mx));
}
SHARP_HD float lse_weight(float lse_part, float lse_total) {
  return lse_part == -__builtin_inff() ? 0.f : expf(lse_part - lse_total);
}

// ---------------------------------------------------------------------------------------
// Host-side 16-bit float conversions (IEEE binary16 and bfloat16), round to nearest even.
SHARP_HD float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
SHARP_HD uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
SHARP_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    u = sign;  // signed zero
  } else {     // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400u));
    u = sign | (uint32_t(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}
SHARP_HD uint16_t float_to_fp16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);       // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);      // rounds to >= 65520: inf
  if (a >= 0x38800000u) {                                     // normal half
    uint32_t r = a - (112u << 23);                            // rebias exponent
    r += 0xfffu + ((r >> 13) & 1u);                           // round to nearest even
    return uint16_t(sign | (r >> 13));
  }
  if (a < 0x33000000u) return sign;                           // < 2^-25: rounds to zero
  // subnormal half: value = man * 2^-24
  const uint32_t e = a >> 23;                                 // 102..112
  const uint32_t man = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;                            // 14..24
  uint32_t r = man >> shift;
  const uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return uint16_t(sign | r);
}

}  // namespace sharpdraft
