// quant_linear.h: the torch-free CPU linear layer on GGUF block-quantised weights (Q4_0, Q4_1,
// Q8_0) with int8 activations: y = x W^T + b for the 1 to ~96 rows of a decode or verification
// step, reading each weight block once per call.
//
// The formats are GGML's (ggml-common.h; gguf-py's quants.py): every run of 32 weights along the
// input dimension is one block with a float16 scale d (and, for Q4_1, a float16 minimum m):
//   Q4_0: w = d * (q - 8), q in 0..15 (18 bytes a block)
//   Q4_1: w = d * q + m,   q in 0..15 (20 bytes a block)
//   Q8_0: w = d * q,       q in -128..127 (34 bytes a block)
// Q4_0 is kept as Q4_1 with m = -8 d (exact in float16), so one 4-bit kernel serves both.
//
// Activations are quantised per row in blocks of 32 as llama.cpp does for its integer dot
// products: dx = max|x| / 127, qx = nearest(x / dx) in -127..127, with sum(qx) kept for the
// Q4 minimum. A block's contribution to y[c] is dx * (d_c * sum(q * qx) + m_c * sum(qx)): the
// integer sum is exact, the rest float32 in block order. Each row is computed alone in the same
// operation order whatever the number of rows in the call (the lossless engine relies on it).
//
// Packed layout (pack_quant): panels of quant_panel_width() output columns (the int32 lanes of
// the instruction set: 16 with AVX-512, else 8); per panel, per block of 32 inputs, the weights
// as groups of 4 consecutive inputs for every column (byte 4c + t of group g is column c, input
// 4g + t), which is what one u8 x s8 4-way dot product (AVX2 maddubs + madd, AVX-512 VNNI
// vpdpbusd) consumes against 4 broadcast activations:
//   4-bit: 4 groups of 4 * width bytes; group g's low nibbles are inputs 4g..4g+3, its high
//          nibbles inputs 16+4g..16+4g+3; then d[width], m[width] as float16
//   8-bit: 8 groups of 4 * width bytes (int8), then d[width] as float16
// Columns past out_features are zero (d = m = 0).
#pragma once

#include <cstdint>

#include "common/parallel.h"

namespace sharpdraft {
namespace cpu {

enum class QuantType { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

constexpr int64_t kQuantBlock = 32;  // weights (and activations) per block

// Bytes of one GGUF block of this type (18, 20, 34).
int64_t gguf_block_bytes(QuantType t);

// Output columns per packed panel on the instruction set chosen at run time.
int64_t quant_panel_width();

// Bytes of the packed form of an (n, k) weight of this type; k % 32 == 0.
int64_t quant_packed_bytes(QuantType t, int64_t n, int64_t k);

// blocks: the GGUF tensor's rows, n rows of (k / 32) blocks -> packed (quant_packed_bytes).
void pack_quant(QuantType t, const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed,
                const ParallelFor& pf);

// The float32 weight (n, k) the packed form holds: w[c, i] as in the formats above.
void unpack_quant(QuantType t, const uint8_t* packed, int64_t n, int64_t k, float* w,
                  const ParallelFor& pf);

// The activation quantisation of one row of k floats (k % 32 == 0): qx[k], dx[k / 32],
// sx[k / 32] = sum of each block's qx. Runs the instruction set's version; for finite x every
// version gives the same bits: amax is exact, dx = amax / 127 and 1 / dx are scalar, and qx is
// x * (1 / dx) rounded once to float32, then to the nearest integer (ties to even), clamped to
// +-127.
void quantize_row(const float* x, int64_t k, int8_t* qx, float* dx, int32_t* sx);

// y[m, :n] = x[m, :k] W^T + bias for m < rows (x row stride ldx, y row stride ldy); bias may be
// null; `packed` as written by pack_quant for (t, n, k) on this machine.
void quant_linear(QuantType t, const float* x, int64_t rows, int64_t ldx, const uint8_t* packed,
                  int64_t n, int64_t k, const float* bias, float* y, int64_t ldy,
                  const ParallelFor& pf);

// --- internal: the ISA-specific panel kernels ---------------------------------------------
// The activations in row blocks of the kernel's MR rows (kQuantRows*; the last block has the
// R = rows - rb * MR <= MR rows left): for row block rb of R rows, input block b and row r < R,
//   qx: the 8 four-byte groups (inputs 4g..4g+3) at qx + rb * MR * k + ((b * 8 + g) * R + r) * 4
//   dx, sx: the block's scale and sum(qx) (exact in float) at [rb * MR * nb + b * R + r]
// A block of one row (MR = 1, or one row left) is the row-major layout.
struct QuantTask {
  const int8_t* qx;     // quantised activations, row-block layout
  const float* dx;      // their scales
  const float* sx;      // their block sums
  int64_t rows, k;
  const uint8_t* panel; // this panel's packed blocks
  const float* bias;    // width floats (zero padded) or null
  float* y;             // column 0 of this panel in row 0
  int64_t ldy;
  int cols;             // valid columns of this panel (<= width)
  bool four_bit;
};
using QuantFn = void (*)(const QuantTask&);
void quant_panel_base(const QuantTask&);
void quant_panel_avx2(const QuantTask&);
void quant_panel_avx512(const QuantTask&);
void quant_panel_avx512vnni(const QuantTask&);
using QuantizeFn = void (*)(const float*, int64_t, int8_t*, float*, int32_t*);
void quantize_row_base(const float* x, int64_t k, int8_t* qx, float* dx, int32_t* sx);
void quantize_row_avx2(const float* x, int64_t k, int8_t* qx, float* dx, int32_t* sx);
void quantize_row_avx512(const float* x, int64_t k, int8_t* qx, float* dx, int32_t* sx);
constexpr int kQuantWidthBase = 8, kQuantWidthAvx2 = 8, kQuantWidthAvx512 = 16;
// Rows per register block (QuantTask's MR) of each kernel.
constexpr int kQuantRowsBase = 1, kQuantRowsAvx2 = 4, kQuantRowsAvx512 = 8;

// Bytes of one packed block of `width` columns.
constexpr int64_t quant_block_bytes(bool four_bit, int64_t width) {
  return four_bit ? 16 * width + 4 * width : 32 * width + 2 * width;
}

// The quantisation kernel name ("base", "avx2", "avx512", "avx512_vnni").
const char* quant_isa_name();

}  // namespace cpu
}  // namespace sharpdraft
