// quant_linear.cpp: GGUF block packing, activation quantisation, the scalar panel kernel, work
// split over panels and run-time ISA dispatch of the quantised CPU linear layer
// (quant_linear.h). Torch-free.
#include "cpu_runtime/quant_linear.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/cpu_features.h"

namespace sharpdraft {
namespace cpu {
namespace {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
  } else if (exp == 31) {
    mag = man ? NAN : INFINITY;
  } else {
    mag = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  memcpy(&bits, &mag, 4);
  bits |= sign;
  memcpy(&mag, &bits, 4);
  return mag;
}

// float -> float16, round to nearest even (used for exact values: Q4_0's -8 d).
uint16_t float_to_half(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00u;
  if (a >= 65520.f) return sign | 0x7c00u;                    // overflows to infinity
  if (a < 6.103515625e-05f) {                                  // subnormal half: units of 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.f));
  }
  int e;
  const float m = std::frexp(a, &e);                           // a = m 2^e, m in [0.5, 1)
  uint32_t man = static_cast<uint32_t>(std::nearbyint(m * 2048.f));  // 11 significant bits
  if (man == 2048) {
    man = 1024;
    ++e;
  }
  return sign | static_cast<uint16_t>(((e + 14) << 10) | (man & 0x3ffu));
}

uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

bool four_bit(QuantType t) { return t != QuantType::Q8_0; }

struct QuantIsa {
  QuantFn fn;
  QuantizeFn quantize;
  int64_t width, rows;  // panel columns, rows per register block
  const char* name;
};

const QuantIsa& quant_isa() {  // common/cpu_features.h's level; VNNI where present
  static const QuantIsa chosen = [] {
    const int level = isa_level();
    if (level == 2) {
      // SHARPDRAFT_CPU_ISA=avx512 keeps AVX-512 without VNNI (to test that path)
      const char* cap = std::getenv("SHARPDRAFT_CPU_ISA");
      const bool vnni = __builtin_cpu_supports("avx512vnni") &&
                        !(cap && std::strcmp(cap, "avx512") == 0);
      return vnni ? QuantIsa{quant_panel_avx512vnni, quantize_row_avx512, kQuantWidthAvx512,
                             kQuantRowsAvx512, "avx512_vnni"}
                  : QuantIsa{quant_panel_avx512, quantize_row_avx512, kQuantWidthAvx512,
                             kQuantRowsAvx512, "avx512"};
    }
    if (level == 1) {
      return QuantIsa{quant_panel_avx2, quantize_row_avx2, kQuantWidthAvx2, kQuantRowsAvx2, "avx2"};
    }
    return QuantIsa{quant_panel_base, quantize_row_base, kQuantWidthBase, kQuantRowsBase, "base"};
  }();
  return chosen;
}

void run(int64_t n, const ParallelFor& pf, const std::function<void(int64_t, int64_t)>& body) {
  if (pf) {
    pf(n, body);
  } else {
    body(0, n);
  }
}

int64_t panels(int64_t n, int64_t width) { return (n + width - 1) / width; }

}  // namespace

int64_t gguf_block_bytes(QuantType t) {
  return t == QuantType::Q4_0 ? 18 : t == QuantType::Q4_1 ? 20 : 34;
}

int64_t quant_panel_width() { return quant_isa().width; }

const char* quant_isa_name() { return quant_isa().name; }

int64_t quant_packed_bytes(QuantType t, int64_t n, int64_t k) {
  const int64_t w = quant_panel_width();
  return panels(n, w) * (k / kQuantBlock) * quant_block_bytes(four_bit(t), w);
}

void pack_quant(QuantType t, const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed,
                const ParallelFor& pf) {
  const int64_t w = quant_panel_width(), nb = k / kQuantBlock;
  const int64_t src_block = gguf_block_bytes(t), dst_block = quant_block_bytes(four_bit(t), w);
  const int64_t src_row = nb * src_block;
  run(panels(n, w), pf, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* dst = packed + (p * nb + b) * dst_block;
        memset(dst, 0, dst_block);
        for (int64_t c = 0; c < w; ++c) {
          const int64_t col = p * w + c;
          if (col >= n) break;
          const uint8_t* src = blocks + col * src_row + b * src_block;
          if (four_bit(t)) {
            // GGUF: qs[j] holds input j (low nibble) and j + 16 (high): group g's byte t is qs[4g+t]
            const uint8_t* qs = src + (t == QuantType::Q4_1 ? 4 : 2);
            for (int g = 0; g < 4; ++g) memcpy(dst + (g * w + c) * 4, qs + 4 * g, 4);
            const uint16_t d = read_u16(src);
            const uint16_t m = t == QuantType::Q4_1 ? read_u16(src + 2)
                                                    : float_to_half(-8.f * half_to_float(d));
            memcpy(dst + 16 * w + 2 * c, &d, 2);
            memcpy(dst + 18 * w + 2 * c, &m, 2);
          } else {
            for (int g = 0; g < 8; ++g) memcpy(dst + (g * w + c) * 4, src + 2 + 4 * g, 4);
            memcpy(dst + 32 * w + 2 * c, src, 2);
          }
        }
      }
    }
  });
}

void unpack_quant(QuantType t, const uint8_t* packed, int64_t n, int64_t k, float* out,
                  const ParallelFor& pf) {
  const int64_t w = quant_panel_width(), nb = k / kQuantBlock;
  const int64_t bytes = quant_block_bytes(four_bit(t), w);
  run(panels(n, w), pf, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = packed + (p * nb + b) * bytes;
        for (int64_t c = 0; c < w && p * w + c < n; ++c) {
          float* row = out + (p * w + c) * k + b * kQuantBlock;
          if (four_bit(t)) {
            const float d = half_to_float(read_u16(blk + 16 * w + 2 * c));
            const float m = half_to_float(read_u16(blk + 18 * w + 2 * c));
            for (int g = 0; g < 4; ++g) {
              for (int j = 0; j < 4; ++j) {
                const uint8_t byte = blk[(g * w + c) * 4 + j];
                row[4 * g + j] = d * static_cast<float>(byte & 15) + m;
                row[16 + 4 * g + j] = d * static_cast<float>(byte >> 4) + m;
              }
            }
          } else {
            const float d = half_to_float(read_u16(blk + 32 * w + 2 * c));
            for (int g = 0; g < 8; ++g) {
              for (int j = 0; j < 4; ++j) {
                row[4 * g + j] = d * static_cast<float>(static_cast<int8_t>(blk[(g * w + c) * 4 + j]));
              }
            }
          }
        }
      }
    }
  });
}

void quantize_row(const float* x, int64_t k, int8_t* qx, float* dx, int32_t* sx) {
  quant_isa().quantize(x, k, qx, dx, sx);
}

void quantize_row_base(const float* x, int64_t k, int8_t* qx, float* dx, int32_t* sx) {
  // Plain float operations (no libm calls: this runs for every row of every call). Rounding:
  // adding and subtracting 1.5 * 2^23 rounds |v| <= 127 to the nearest integer, ties to even,
  // in the default rounding mode (the baseline instruction set has no FMA to fuse it with the
  // product, so v is the float32 product, as in the vector versions).
  constexpr float kRound = 12582912.f;
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    float amax = 0.f;
    for (int j = 0; j < kQuantBlock; ++j) {
      const float a = xb[j] < 0.f ? -xb[j] : xb[j];
      amax = a > amax ? a : amax;
    }
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int32_t s = 0;
    for (int j = 0; j < kQuantBlock; ++j) {
      float q = (xb[j] * id + kRound) - kRound;
      q = q > 127.f ? 127.f : q < -127.f ? -127.f : q;
      qx[b * kQuantBlock + j] = static_cast<int8_t>(q);
      s += static_cast<int32_t>(q);
    }
    dx[b] = d;
    sx[b] = s;
  }
}

// The scalar kernel: the vector kernels' arithmetic, one column at a time, on row-major
// activations (a register block of one row).
static_assert(kQuantRowsBase == 1, "quant_panel_base reads the activations row-major");
void quant_panel_base(const QuantTask& t) {
  constexpr int64_t w = kQuantWidthBase;
  const int64_t nb = t.k / kQuantBlock, bytes = quant_block_bytes(t.four_bit, w);
  for (int64_t r = 0; r < t.rows; ++r) {
    const int8_t* xq = t.qx + r * t.k;
    for (int c = 0; c < t.cols; ++c) {
      float acc = t.bias ? t.bias[c] : 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = t.panel + b * bytes;
        const int8_t* x = xq + b * kQuantBlock;
        int32_t sum = 0;
        float v;
        if (t.four_bit) {
          for (int g = 0; g < 4; ++g) {
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = blk[(g * w + c) * 4 + j];
              sum += (byte & 15) * x[4 * g + j] + (byte >> 4) * x[16 + 4 * g + j];
            }
          }
          v = half_to_float(read_u16(blk + 16 * w + 2 * c)) * static_cast<float>(sum);
          v = std::fma(half_to_float(read_u16(blk + 18 * w + 2 * c)),
                       t.sx[r * nb + b], v);
        } else {
          for (int j = 0; j < kQuantBlock; ++j) {
            sum += static_cast<int8_t>(blk[(j / 4 * w + c) * 4 + j % 4]) * x[j];
          }
          v = half_to_float(read_u16(blk + 32 * w + 2 * c)) * static_cast<float>(sum);
        }
        acc = std::fma(v, t.dx[r * nb + b], acc);
      }
      t.y[r * t.ldy + c] = acc;
    }
  }
}

void quant_linear(QuantType t, const float* x, int64_t rows, int64_t ldx, const uint8_t* packed,
                  int64_t n, int64_t k, const float* bias, float* y, int64_t ldy,
                  const ParallelFor& pf) {
  const QuantIsa& isa = quant_isa();
  const int64_t w = isa.width, nb = k / kQuantBlock;
  const int64_t bytes = nb * quant_block_bytes(four_bit(t), w);
  // QuantTask's row-block layout (a block of one row is row-major)
  const int64_t mr = isa.rows;
  std::vector<int8_t> qx(rows * k), qrow(k);
  std::vector<float> dx(rows * nb), sx(rows * nb), drow(nb);
  std::vector<int32_t> srow(nb);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t first = r / mr * mr, block_rows = std::min(mr, rows - first), rr = r - first;
    isa.quantize(x + r * ldx, k, qrow.data(), drow.data(), srow.data());
    for (int64_t b = 0; b < nb; ++b) {
      for (int g = 0; g < kQuantBlock / 4; ++g) {
        memcpy(qx.data() + first * k + ((b * 8 + g) * block_rows + rr) * 4,
               qrow.data() + b * kQuantBlock + 4 * g, 4);
      }
      dx[first * nb + b * block_rows + rr] = drow[b];
      sx[first * nb + b * block_rows + rr] = static_cast<float>(srow[b]);
    }
  }
  run(panels(n, w), pf, [&](int64_t begin, int64_t end) {
    float bias_tail[kQuantWidthAvx512];  // the last panel's bias, zero padded
    for (int64_t p = begin; p < end; ++p) {
      QuantTask task;
      task.qx = qx.data();
      task.dx = dx.data();
      task.sx = sx.data();
      task.rows = rows;
      task.k = k;
      task.panel = packed + p * bytes;
      task.y = y + p * w;
      task.ldy = ldy;
      task.cols = static_cast<int>(n - p * w < w ? n - p * w : w);
      task.four_bit = four_bit(t);
      task.bias = bias ? bias + p * w : nullptr;
      if (bias && task.cols < w) {
        memset(bias_tail, 0, sizeof bias_tail);
        memcpy(bias_tail, bias + p * w, task.cols * sizeof(float));
        task.bias = bias_tail;
      }
      isa.fn(task);
    }
  });
}

}  // namespace cpu
}  // namespace sharpdraft
