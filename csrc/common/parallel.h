// parallel.h: the parallel-for the torch-free CPU kernels (the attention driver, the runtime's
// linear layers) split their work through; the torch bindings pass one over at::parallel_for,
// embedders and the C++ tests their own.
#pragma once

#include <cstdint>
#include <functional>

namespace sharpdraft {
namespace cpu {

// Runs body(begin, end) over a partition of [0, n); may call body concurrently.
using ParallelFor =
    std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& body)>;

}  // namespace cpu
}  // namespace sharpdraft
