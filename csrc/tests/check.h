// check.h: minimal helpers for the C++ unit tests (no test framework needed): assertions, a
// deterministic generator and a two-thread parallel-for.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <thread>

static int g_failures = 0;

#define CHECK(cond)                                                       \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::printf("%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                       \
    }                                                                     \
  } while (0)

#define CHECK_NEAR(a, b, tol)                                                              \
  do {                                                                                     \
    const double a_ = (a), b_ = (b);                                                       \
    if (!(std::fabs(a_ - b_) <= (tol))) {                                                  \
      std::printf("%s:%d: CHECK_NEAR failed: %s = %.10g, %s = %.10g, tol %.3g\n", __FILE__, \
                  __LINE__, #a, a_, #b, b_, double(tol));                                  \
      ++g_failures;                                                                        \
    }                                                                                      \
  } while (0)

inline int finish(const char* name) {
  if (g_failures) {
    std::printf("%s: %d failure(s)\n", name, g_failures);
    return 1;
  }
  std::printf("%s: all checks passed\n", name);
  return 0;
}

struct Rng {  // small deterministic generator (64-bit LCG), values in [-2, 2)
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  double next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return double(s >> 11) / double(1ull << 53) * 4.0 - 2.0;
  }
};

// 2 threads, each running body on its share of [0, n).
inline void two_threads(int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  std::thread t([&] { body(0, n / 2); });
  body(n / 2, n);
  t.join();
}
