// The quantised panel kernel (quant_kernel.h) built twice for AVX-512: with VNNI (vpdpbusd: the
// u8 x s8 4-way dot product into int32 in one instruction) and without it (maddubs + madd, as
// AVX2 does, on 16 lanes). AVX-512 has no vpsignb: Q8_0's signed weights give x their sign by a
// masked negation without VNNI, and become unsigned by an offset of 128 with it. Chosen at run
// time by quant_linear.cpp.
// GCC 12 reports its own _mm512_undefined_ps (used by _mm512_cvtph_ps / _mm512_cvtepi32_ps in
// avx512fintrin.h) as maybe-uninitialized once inlined; the value is never read.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <cstring>

#include "cpu_runtime/quant_linear.h"

#include <immintrin.h>

namespace sharpdraft {
namespace cpu {

#define SHARP_QUANT_AVX512_BODY                                                                 \
  typedef __m512i VI;                                                                          \
  typedef __m512 VF;                                                                           \
  constexpr int W = kQuantWidthAvx512;                                                         \
  constexpr int MR = kQuantRowsAvx512;                                                         \
  inline VI vload(const uint8_t* p) { return _mm512_loadu_si512(p); }                          \
  inline VI bcast4(const int8_t* p) {                                                          \
    int32_t v;                                                                                 \
    memcpy(&v, p, 4);                                                                          \
    return _mm512_set1_epi32(v);                                                               \
  }                                                                                            \
  inline VI lo_nibbles(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }             \
  inline VI hi_nibbles(VI v) {                                                                 \
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));                   \
  }                                                                                            \
  inline void in_register(VI& v) { asm("" : "+v"(v)); }                                       \
  inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }                                   \
  inline VF halfs(const uint8_t* p) {                                                          \
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));           \
  }                                                                                            \
  inline VF fsplat(float s) { return _mm512_set1_ps(s); }                                      \
  inline VF fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }                                   \
  inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }                      \
  inline VF fzero() { return _mm512_setzero_ps(); }                                            \
  inline VF fload(const float* p) { return _mm512_loadu_ps(p); }                              \
  inline void fstore(float* p, VF v) { _mm512_storeu_ps(p, v); }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace quant_avx512 {
namespace {
inline __m512i dot_u8s8(__m512i acc, __m512i a, __m512i b) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)));
}
inline __m512i dot4_nibbles(__m512i acc, __m512i q, __m512i xb) {
  return _mm512_add_epi16(acc, _mm512_maddubs_epi16(q, xb));
}
inline __m512i widen_nibble_sum(__m512i acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
// |w| against x carrying w's sign (a masked negation: AVX-512 has no vpsignb)
inline __m512i w8_operand(__m512i w) { return w; }
inline __m512i dot_w8(__m512i acc, __m512i w, __m512i xb) {
  const __m512i x = _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(w), _mm512_setzero_si512(), xb);
  return dot_u8s8(acc, _mm512_abs_epi8(w), x);
}
inline __m512 w8_sum(__m512i acc, float) { return _mm512_cvtepi32_ps(acc); }
SHARP_QUANT_AVX512_BODY
#include "cpu_runtime/quant_kernel.h"
}  // namespace
}  // namespace quant_avx512
void quant_panel_avx512(const QuantTask& t) { quant_avx512::quant_panel(t); }

// quantize_row (quant_linear.h) on 16 lanes: the same bits as quantize_row_base for finite x.
void quantize_row_avx512(const float* x, int64_t k, int8_t* qx, float* dx, int32_t* sx) {
  const __m512 hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f), zero = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    // (a > m) ? a : m, so a NaN never becomes the maximum, as in the scalar rule
    const __m512 m = _mm512_max_ps(_mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), zero));
    const float d = _mm512_reduce_max_ps(m) / 127.f;
    const __m512 id = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    const __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(v0, id),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(v1, id),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r0, lo), hi));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r1, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + b * kQuantBlock), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + b * kQuantBlock + 16),
                     _mm512_cvtepi32_epi8(q1));
    dx[b] = d;
    sx[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

namespace quant_avx512vnni {
namespace {
inline __m512i dot_u8s8(__m512i acc, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(acc, a, b); }
inline __m512i dot4_nibbles(__m512i acc, __m512i q, __m512i xb) { return dot_u8s8(acc, q, xb); }
inline __m512i widen_nibble_sum(__m512i acc) { return acc; }
// vpdpbusd takes w unsigned: w + 128 (its sign bit flipped) against x sums to the block's sum
// plus 128 * sum(x), taken off in float, exactly: both sums stay below 2^24 in magnitude
inline __m512i w8_operand(__m512i w) { return _mm512_xor_si512(w, _mm512_set1_epi8(-128)); }
inline __m512i dot_w8(__m512i acc, __m512i w, __m512i xb) { return dot_u8s8(acc, w, xb); }
inline __m512 w8_sum(__m512i acc, float sx) {
  return _mm512_fnmadd_ps(_mm512_set1_ps(128.f), _mm512_set1_ps(sx), _mm512_cvtepi32_ps(acc));
}
SHARP_QUANT_AVX512_BODY
#include "cpu_runtime/quant_kernel.h"
}  // namespace
}  // namespace quant_avx512vnni
void quant_panel_avx512vnni(const QuantTask& t) { quant_avx512vnni::quant_panel(t); }
#pragma GCC pop_options

#undef SHARP_QUANT_AVX512_BODY

}  // namespace cpu
}  // namespace sharpdraft
