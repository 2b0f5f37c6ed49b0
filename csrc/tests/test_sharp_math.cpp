// Unit tests of the shared row maths (csrc/attention/sharp_math.h) against hand-computed values.
#include <cstdint>
#include <cstdio>
#include <limits>

#include "check.h"
#include "attention/sharp_math.h"

using namespace sharpdraft;

static const double kInf = std::numeric_limits<double>::infinity();

static void test_query_scale() {
  const ScaleMode F = ScaleMode::kFixedSlope, E = ScaleMode::kExactTopk, N = ScaleMode::kNone;
  // beta_fixed(n) = 1 + slope ln(n / n_ref): ln 2 = 0.69314718056
  CHECK_NEAR(query_scale(4096, F, 0.2, 2048, 32, 5.0, 1.0, kInf), 1.138629436112, 1e-12);
  CHECK_NEAR(query_scale(2048, F, 0.2, 2048, 32, 5.0, 1.0, kInf), 1.0, 1e-15);
  // below n_ref: 1 - 0.2 ln 2, clamped to beta_min
  CHECK_NEAR(query_scale(1024, F, 0.2, 2048, 32, 5.0, 1.0, kInf), 1.0, 0);
  CHECK_NEAR(query_scale(1024, F, 0.2, 2048, 32, 5.0, 0.5, kInf), 0.861370563888, 1e-12);
  // 2^20 keys: 1 + 0.2 ln 512 = 2.247664925, and the beta_max clamp
  CHECK_NEAR(query_scale(1 << 20, F, 0.2, 2048, 32, 5.0, 1.0, kInf), 2.247664925004, 1e-11);
  CHECK_NEAR(query_scale(1 << 20, F, 0.2, 2048, 32, 5.0, 1.0, 2.0), 2.0, 0);
  CHECK_NEAR(query_scale(0, F, 0.2, 2048, 32, 5.0, 0.5, kInf), 0.5, 0);  // empty row
  // beta_exact(n) = 1 + ln((n - k) / (n_ref - k)) / Delta: (4128 - 32) / (2080 - 32) = 2
  CHECK_NEAR(query_scale(4128, E, 0.2, 2080, 32, 5.0, 1.0, kInf), 1.138629436112, 1e-12);
  CHECK_NEAR(query_scale(32, E, 0.2, 2080, 32, 5.0, 1.0, kInf), 1.0, 0);  // n <= k
  // (40 - 32) / 2048 = 1/256: 1 - ln(256) / 5 = -0.109035489, unclamped with beta_min = -inf
  CHECK_NEAR(query_scale(40, E, 0.2, 2080, 32, 5.0, -kInf, kInf), -0.109035488895, 1e-11);
  // mode none ignores the clamps
  CHECK_NEAR(query_scale(99999, N, 0.2, 2048, 32, 5.0, 2.0, 3.0), 1.0, 0);
  // per-head slopes
  const float slopes[2] = {0.1f, 0.3f};
  ScaleParams sp;
  sp.slope_per_head = slopes;
  CHECK_NEAR(query_scale(4096, sp, 1), 1.0 + double(0.3f) * 0.693147180560, 1e-9);
  CHECK_NEAR(query_scale(4096, sp, 0), 1.0 + double(0.1f) * 0.693147180560, 1e-9);
  // c_i = beta * scale * log2(e)
  CHECK_NEAR(exponent_factor(2.0, 0.125f), 0.360673760222, 1e-7);
  CHECK(score_factor(1.0, 0.125f) == 0.125f);  // exact: no rounding for plain attention
}

static void test_visible_range() {
  KeyRange r = visible_range(0, 3, 5, false, 0);
  CHECK(r.lo == 0 && r.hi == 5 && range_count(r) == 5);
  r = visible_range(0, 3, 5, true, 0);  // bottom-right: row 0 sits at position 2
  CHECK(r.lo == 0 && r.hi == 3);
  r = visible_range(2, 3, 5, true, 0);
  CHECK(r.lo == 0 && r.hi == 5);
  r = visible_range(0, 3, 5, true, 2);  // window 2: keys 1, 2
  CHECK(r.lo == 1 && r.hi == 3 && range_count(r) == 2);
  // more queries than keys: the first rows see nothing
  CHECK(range_count(visible_range(0, 4, 2, true, 0)) == 0);
  CHECK(range_count(visible_range(1, 4, 2, true, 0)) == 0);
  r = visible_range(2, 4, 2, true, 0);
  CHECK(r.lo == 0 && r.hi == 1);
  CHECK(range_count(visible_range(3, 4, 2, true, 0)) == 2);
  CHECK(range_count(visible_range(0, 1, 0, false, 0)) == 0);  // no keys
}

static void test_online_softmax() {
  // base-2 scores in three blocks {1, 3}, {-inf, 2}, {5}: sum 2^s = 2 + 8 + 4 + 32 = 46
  float m = -__builtin_inff(), l = 0.f;
  float alpha = online_rescale(m, 3.f);
  CHECK(alpha == 0.f && m == 3.f);
  l = l * alpha + exp2f(1.f - safe_max(m)) + exp2f(3.f - safe_max(m));
  alpha = online_rescale(m, 2.f);
  CHECK(alpha == 1.f && m == 3.f);
  l = l * alpha + exp2f(-__builtin_inff() - safe_max(m)) + exp2f(2.f - safe_max(m));
  alpha = online_rescale(m, 5.f);
  CHECK_NEAR(alpha, 0.25, 0);
  l = l * alpha + exp2f(5.f - safe_max(m));
  CHECK_NEAR(l, 1.4375, 1e-6);
  CHECK_NEAR(finalize_lse(m, l), 3.828641396490, 1e-6);  // ln 46
  // natural-log row state: scores ln 2, ln 8, ln 4, ln 32 -> m = ln 32, l = 46 / 32
  CHECK_NEAR(finalize_lse_natural(3.465735903f, 1.4375f), 3.828641396490, 1e-6);
  CHECK_NEAR(finalize_inv_sum(l), 1.0 / 1.4375, 1e-7);
  // a row that saw only masked keys
  float m0 = -__builtin_inff(), l0 = 0.f;
  alpha = online_rescale(m0, -__builtin_inff());
  CHECK(alpha == 0.f && m0 == -__builtin_inff() && safe_max(m0) == 0.f);
  CHECK(exp2f(-__builtin_inff() - safe_max(m0)) == 0.f);
  CHECK(finalize_lse(m0, l0) == -__builtin_inff() && finalize_inv_sum(l0) == 0.f);
  CHECK(finalize_lse_natural(m0, l0) == -__builtin_inff());
}

static void test_lse_merge() {
  CHECK_NEAR(lse_merge(0.693147181f, 1.098612289f), 1.609437912, 1e-6);  // ln 2 (+) ln 3 = ln 5
  CHECK(lse_merge(-__builtin_inff(), 1.5f) == 1.5f);
  CHECK(lse_merge(1.5f, -__builtin_inff()) == 1.5f);
  CHECK(lse_merge(-__builtin_inff(), -__builtin_inff()) == -__builtin_inff());
  CHECK_NEAR(lse_weight(0.693147181f, 1.609437912f), 0.4, 1e-6);
  CHECK(lse_weight(-__builtin_inff(), 0.f) == 0.f);
}

static void test_half_conversions() {
  CHECK(float_to_fp16(1.0f) == 0x3C00);
  CHECK(float_to_fp16(-2.0f) == 0xC000);
  CHECK(float_to_fp16(65504.0f) == 0x7BFF);
  CHECK(float_to_fp16(65520.0f) == 0x7C00);             // rounds up to inf
  CHECK(float_to_fp16(5.9604644775390625e-8f) == 0x0001);  // 2^-24, smallest subnormal
  CHECK(float_to_fp16(2.98023223876953125e-8f) == 0x0000);  // 2^-25: tie to even (zero)
  CHECK(float_to_fp16(4.470348358154297e-8f) == 0x0001);    // 1.5 * 2^-25
  CHECK(float_to_fp16(1.0f + 0.00048828125f) == 0x3C00);    // 1 + 2^-11: tie to even
  CHECK(float_to_fp16(1.0f + 3 * 0.00048828125f) == 0x3C02);  // 1 + 3 * 2^-11: tie to even
  CHECK((float_to_fp16(__builtin_nanf("")) & 0x7C00) == 0x7C00 &&
        (float_to_fp16(__builtin_nanf("")) & 0x3FF) != 0);
  CHECK(fp16_to_float(0x0001) == 5.9604644775390625e-8f);
  CHECK(fp16_to_float(0x3555) == 0.333251953125f);
  CHECK(fp16_to_float(0x7C00) == __builtin_inff());
  CHECK(fp16_to_float(0x8000) == 0.0f && std::signbit(fp16_to_float(0x8000)));
  CHECK(float_to_bf16(1.0f) == 0x3F80);
  CHECK(float_to_bf16(1.0f + 0.00390625f) == 0x3F80);        // 1 + 2^-8: tie to even
  CHECK(float_to_bf16(1.0f + 3 * 0.00390625f) == 0x3F82);    // 1 + 3 * 2^-8: tie to even
  CHECK(bf16_to_float(0x4049) == 3.140625f);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(__builtin_nanf("")))));
  // every non-NaN 16-bit pattern survives a round trip through float
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t x = uint16_t(h);
    if ((x & 0x7C00) != 0x7C00 || (x & 0x3FF) == 0) bad += float_to_fp16(fp16_to_float(x)) != x;
    if ((x & 0x7F80) != 0x7F80 || (x & 0x7F) == 0) bad += float_to_bf16(bf16_to_float(x)) != x;
  }
  CHECK(bad == 0);
}

int main() {
  test_query_scale();
  test_visible_range();
  test_online_softmax();
  test_lse_merge();
  test_half_conversions();
  return finish("test_sharp_math");
}
