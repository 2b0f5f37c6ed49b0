// The quantised panel kernel (quant_kernel.h) built for AVX2: u8 x s8 4-way dot products from
// maddubs (pairs into int16; 15 * 127 * 2 and 128 * 127 * 2 stay below 32767) and madd against
// ones (int32). Chosen at run time by quant_linear.cpp.
#include <cstring>

#include "cpu_runtime/quant_linear.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace sharpdraft {
namespace cpu {
namespace quant_avx2 {
namespace {

typedef __m256i VI;
typedef __m256 VF;
constexpr int W = kQuantWidthAvx2;
// 2 accumulators a row + 5 for weights and constants in 16 registers
constexpr int MR = kQuantRowsAvx2;

inline VI vload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const VI*>(p)); }
inline VI bcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline VI lo_nibbles(VI v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline VI hi_nibbles(VI v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
inline VI dot_u8s8(VI acc, VI a, VI b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
// 4-bit blocks: the u8 x s8 pair sums stay int16 for the whole block (one madd a block)
inline VI dot4_nibbles(VI acc, VI q, VI xb) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(q, xb)); }
inline VI widen_nibble_sum(VI acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
// |w| (unsigned; 128 for -128) against x carrying w's sign (x is within -127..127)
inline VI w8_operand(VI w) { return w; }
inline VI dot_w8(VI acc, VI w, VI xb) {
  return dot_u8s8(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(xb, w));
}
inline VF w8_sum(VI acc, float) { return _mm256_cvtepi32_ps(acc); }
inline void in_register(VI& v) { asm("" : "+x"(v)); }
inline VF to_float(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF halfs(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VF fsplat(float s) { return _mm256_set1_ps(s); }
inline VF fmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF fzero() { return _mm256_setzero_ps(); }
inline VF fload(const float* p) { return _mm256_loadu_ps(p); }
inline void fstore(float* p, VF v) { _mm256_storeu_ps(p, v); }

#include "cpu_runtime/quant_kernel.h"

}  // namespace
}  // namespace quant_avx2

void quant_panel_avx2(const QuantTask& t) { quant_avx2::quant_panel(t); }

// quantize_row (quant_linear.h) on 8 lanes: the same bits as quantize_row_base for finite x.
void quantize_row_avx2(const float* x, int64_t k, int8_t* qx, float* dx, int32_t* sx) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      m = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), m);  // (a > m) ? a : m
    }
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xb1));
    const float d = _mm256_cvtss_f32(m) / 127.f;
    const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], id),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                             _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + b * kQuantBlock),
                        _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    dx[b] = d;
    sx[b] = _mm_cvtsi128_si32(s4);
  }
}

}  // namespace cpu
}  // namespace sharpdraft

#pragma GCC pop_options
