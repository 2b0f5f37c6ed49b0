// simd_vec.h: the float vector of an ISA unit and its unaligned load, store and broadcast,
// shared by the kernel headers (attention/cpu/tile_kernel.h, cpu_runtime/linear_kernel.h).
// Included inside the unit's ISA namespace, after <cstring> and a `constexpr int VW` (floats per
// vector); no include guard: each ISA unit includes it once, in its own namespace.
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

inline vf load(const float* p) {
  vf x;
  memcpy(&x, p, sizeof x);
  return x;
}
inline void store(float* p, vf x) { memcpy(p, &x, sizeof x); }
inline vf splat(float s) { return s - vf{}; }  // x - 0 folds to x (x + 0 would not)
