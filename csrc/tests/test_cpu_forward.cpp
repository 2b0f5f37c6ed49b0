// The torch-free CPU forward (csrc/attention/cpu/sharp_cpu.h) against a naive float64
// implementation written here from spec §2-§3 (it shares no code with the kernel), run on 2
// std::threads.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.h"
#include "attention/cpu/sharp_cpu.h"
#include "attention/sharp_math.h"  // only for the 16-bit conversions of inputs and outputs

using namespace sharpdraft;

namespace {

struct Case {
  Case(const char* n, int64_t b, int64_t hq, int64_t hk, int64_t lq, int64_t lk, int64_t d)
      : name(n), B(b), Hq(hq), Hk(hk), Lq(lq), Lk(lk), D(d) {}
  const char* name;
  int64_t B, Hq, Hk, Lq, Lk, D;
  bool causal = false;
  int64_t window = 0;
  bool mask = false;
  std::vector<int32_t> kv_lens;       // dense, optional
  std::vector<int32_t> cu_q, cu_k;    // varlen, optional
  DType dtype = DType::kFloat32;
  ScaleMode mode = ScaleMode::kFixedSlope;
  double slope = 0.3;
  int64_t n_ref = 16;
};

float round_to(DType dt, float x) {
  if (dt == DType::kBFloat16) return bf16_to_float(float_to_bf16(x));
  if (dt == DType::kFloat16) return fp16_to_float(float_to_fp16(x));
  return x;
}

void run_case(const Case& c) {
  const bool varlen = !c.cu_q.empty();
  const int64_t B = varlen ? int64_t(c.cu_q.size()) - 1 : c.B;
  const int64_t Tq = varlen ? c.cu_q.back() : B * c.Lq, Tk = varlen ? c.cu_k.back() : B * c.Lk;
  const int64_t D = c.D, Hq = c.Hq, Hk = c.Hk, G = Hq / Hk;
  // Layout (token, head, dim) for both modes: dense batch b, row i is token b * L + i.
  Rng rng(uint64_t(B * 131 + Hq * 17 + c.Lq * 7 + c.Lk + D));
  std::vector<float> q(Tq * Hq * D), k(Tk * Hk * D), v(Tk * Hk * D);
  for (auto& x : q) x = round_to(c.dtype, float(rng.next()));
  for (auto& x : k) x = round_to(c.dtype, float(rng.next()));
  for (auto& x : v) x = round_to(c.dtype, float(rng.next()));
  std::vector<uint8_t> mask_store(c.mask ? B * Hq * c.Lq * c.Lk : 0);
  for (auto& m : mask_store) m = rng.next() > -1.0;  // about 3/4 visible
  const bool* mask = reinterpret_cast<const bool*>(mask_store.data());

  // Kernel inputs in the case's dtype.
  auto pack = [&](const std::vector<float>& src) {
    std::vector<uint16_t> h(src.size());
    for (size_t e = 0; e < src.size(); ++e)
      h[e] = c.dtype == DType::kBFloat16 ? float_to_bf16(src[e]) : float_to_fp16(src[e]);
    return h;
  };
  std::vector<uint16_t> q16, k16, v16, o16;
  if (c.dtype != DType::kFloat32) {
    q16 = pack(q); k16 = pack(k); v16 = pack(v); o16.assign(q.size(), 0);
  }
  std::vector<float> out(q.size(), 12345.f), lse(Hq * Tq, 12345.f);

  SharpParams p;
  p.dtype = c.dtype;
  p.q = c.dtype == DType::kFloat32 ? static_cast<const void*>(q.data()) : q16.data();
  p.k = c.dtype == DType::kFloat32 ? static_cast<const void*>(k.data()) : k16.data();
  p.v = c.dtype == DType::kFloat32 ? static_cast<const void*>(v.data()) : v16.data();
  p.out = c.dtype == DType::kFloat32 ? static_cast<void*>(out.data()) : o16.data();
  p.lse = lse.data();
  p.batch = B; p.heads_q = Hq; p.heads_k = Hk; p.seqlen_q = c.Lq; p.seqlen_k = c.Lk; p.head_dim = D;
  p.q_row_stride = Hq * D; p.q_head_stride = D; p.q_batch_stride = c.Lq * Hq * D;
  p.k_row_stride = Hk * D; p.k_head_stride = D; p.k_batch_stride = c.Lk * Hk * D;
  p.v_row_stride = Hk * D; p.v_head_stride = D; p.v_batch_stride = c.Lk * Hk * D;
  p.o_row_stride = Hq * D; p.o_head_stride = D; p.o_batch_stride = c.Lq * Hq * D;
  p.lse_row_stride = 1; p.lse_head_stride = varlen ? Tq : c.Lq; p.lse_batch_stride = Hq * c.Lq;
  if (varlen) { p.cu_seqlens_q = c.cu_q.data(); p.cu_seqlens_k = c.cu_k.data(); }
  if (!c.kv_lens.empty()) p.kv_lens = c.kv_lens.data();
  p.causal = c.causal;
  p.window = c.window;
  if (c.mask) {
    p.mask = mask;
    p.mask_batch_stride = Hq * c.Lq * c.Lk; p.mask_head_stride = c.Lq * c.Lk; p.mask_row_stride = c.Lk;
  }
  p.softmax_scale = float(1.0 / std::sqrt(double(D)));
  p.sp.mode = c.mode;
  p.sp.slope = c.slope;
  p.sp.n_ref = c.n_ref;
  cpu::sharp_attention_forward(p, 4, two_threads);  // 4 "threads": decode cases split the keys
  if (c.dtype != DType::kFloat32) {
    for (size_t e = 0; e < out.size(); ++e)
      out[e] = c.dtype == DType::kBFloat16 ? bf16_to_float(o16[e]) : fp16_to_float(o16[e]);
  }

  // Naive float64 reference, straight from docs/spec.md.
  const double tol = c.dtype == DType::kFloat32 ? 2e-5 : c.dtype == DType::kFloat16 ? 4e-3 : 3e-2;
  double worst = 0, worst_lse = 0;
  int bad_empty = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = varlen ? c.cu_q[b] : b * c.Lq, k0 = varlen ? c.cu_k[b] : b * c.Lk;
    const int64_t lq = varlen ? c.cu_q[b + 1] - c.cu_q[b] : c.Lq;
    const int64_t kv = varlen ? c.cu_k[b + 1] - c.cu_k[b] : c.kv_lens.empty() ? c.Lk : c.kv_lens[b];
    for (int64_t h = 0; h < Hq; ++h) {
      for (int64_t i = 0; i < lq; ++i) {
        const int64_t pos = i + kv - lq;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j < kv; ++j) {
          bool vis = true;
          if (c.causal) vis = j <= pos && (c.window == 0 || j > pos - c.window);
          if (c.mask) vis = vis && mask[((b * Hq + h) * c.Lq + i) * c.Lk + j];
          if (vis) keys.push_back(j);
        }
        const int64_t n = int64_t(keys.size());
        double beta = 1.0;
        if (c.mode == ScaleMode::kFixedSlope && n > 0)
          beta = std::max(1.0, 1.0 + c.slope * std::log(double(n) / double(c.n_ref)));
        const float* qi = &q[((q0 + i) * Hq + h) * D];
        const float* oi = &out[((q0 + i) * Hq + h) * D];
        const float li = lse[varlen ? h * Tq + q0 + i : (b * Hq + h) * c.Lq + i];
        if (n == 0) {
          for (int64_t d = 0; d < D; ++d) bad_empty += oi[d] != 0.f;
          bad_empty += !(li == -__builtin_inff());
          continue;
        }
        std::vector<double> s(n);
        double mx = -1e300;
        for (int64_t t = 0; t < n; ++t) {
          const float* kj = &k[((k0 + keys[t]) * Hk + h / G) * D];
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += double(qi[d]) * kj[d];
          s[t] = beta * dot / std::sqrt(double(D));
          mx = std::max(mx, s[t]);
        }
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (int64_t d = 0; d < D; ++d) {
          double o = 0;
          for (int64_t t = 0; t < n; ++t) o += s[t] * v[((k0 + keys[t]) * Hk + h / G) * D + d];
          worst = std::max(worst, std::fabs(o / sum - oi[d]));
        }
        worst_lse = std::max(worst_lse, std::fabs(mx + std::log(sum) - li));
      }
    }
  }
  std::printf("  %-28s max|out - ref| = %.3g  max|lse - ref| = %.3g\n", c.name, worst, worst_lse);
  CHECK(worst <= tol);
  CHECK(worst_lse <= 1e-4);
  CHECK(bad_empty == 0);
}

}  // namespace

int main() {
  std::printf("test_cpu_forward (isa %s)\n", cpu::isa_name());
  Case c1("gqa kv_lens", 2, 4, 2, 37, 100, 64);
  c1.kv_lens = {100, 53};
  run_case(c1);
  Case c2("causal window mask d80", 1, 3, 3, 50, 50, 80);
  c2.causal = true;
  c2.window = 7;
  c2.mask = true;
  run_case(c2);
  run_case(Case("decode split-kv d128", 1, 3, 1, 1, 3000, 128));
  Case c4("more queries than keys", 1, 2, 1, 10, 4, 32);
  c4.causal = true;
  run_case(c4);
  Case c5("bf16 causal d64", 1, 2, 1, 70, 90, 64);
  c5.dtype = DType::kBFloat16;
  c5.causal = true;
  run_case(c5);
  Case c6("fp16 mode none d40", 1, 2, 2, 20, 200, 40);
  c6.dtype = DType::kFloat16;
  c6.mode = ScaleMode::kNone;
  run_case(c6);
  Case c7("varlen causal, empty seq", 0, 4, 2, 12, 28, 64);
  c7.causal = true;
  c7.cu_q = {0, 5, 5, 17};
  c7.cu_k = {0, 9, 12, 40};
  run_case(c7);
  return finish("test_cpu_forward");
}
