// check.h: a minimal assertion helper for the C++ unit tests (no test framework needed).
#pragma once

#include <cmath>
#include <cstdio>

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
