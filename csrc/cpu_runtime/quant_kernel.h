// quant_kernel.h: the register-blocked panel kernel of the quantised CPU linear layer
// (quant_linear.h), written once over a few vector primitives.
//
// Included once by each vector ISA unit (quant_avx2.cpp, quant_avx512.cpp) inside its namespace,
// after it defines, for its instruction set:
//   VI, VF                  the int32 and float vectors (W lanes, W = the panel width)
//   constexpr int W, MR     lanes per vector, rows per register block
//   vload(p)                4 * W bytes
//   bcast4(p)               the 4 bytes at p in every int32 lane
//   lo_nibbles, hi_nibbles  the low / high 4 bits of every byte
//   dot4_nibbles(acc, q, xb) a 4-bit block's running sum of q (0..15) * xb over 4-byte lanes, in
//                           whatever form the ISA keeps it (int16 pairs under AVX2: 8 products
//                           of 2 * 15 * 127 stay below 32767); widen_nibble_sum(acc) -> int32
//   w8_operand(w)           an 8-bit weight vector in the form dot_w8 takes (once per vector,
//                           shared by the register block's rows)
//   dot_w8(acc, w, xb)      acc (int32) + per lane sum over its 4 bytes of w * xb, w as
//                           w8_operand gives it; w8_sum(acc, sx) -> the block's exact float sum
//                           (sx: the row's block sum of xb as a float, for an offset form of w)
//   to_float, halfs(p), fsplat(s), fmul, fmadd(a, b, c) = a * b + c, fzero, fload, fstore
// and in_register(v), an empty asm that pins a running sum to a register: without it GCC
// reassociates a block's integer sums into a tree, computes every product first and spills
// them (measured: 3x slower at 16 rows on AVX2).
// Per row and block the float work is v = d * sum; v = m * sum(qx) + v; y = v * dx + y (4-bit)
// or v = d * sum; y = v * dx + y (8-bit), the same on every path and for every row count.
// The activations come in QuantTask's row-block layout: one pointer walks a register block's
// rows, each row's four-byte group at a fixed offset from it.

// Software prefetch of the panel's blocks (quant_prefetch): from 8 rows the products take
// about as long as reading the weights, and the hardware prefetcher alone leaves the two one
// after the other (measured on a Zen 4, one thread, 1536 x 576 Q4_1 weights streamed from
// memory: 8 rows 60 -> 53 us, 16 rows 130 -> 107 us; 4 rows unchanged, 1 and 2 rows no
// better). The first row block fetches; the later ones find the panel in cache.
constexpr int64_t kPrefetchRows = 8, kPrefetchBlocks = 8;
inline bool quant_prefetch(const QuantTask& t, int64_t rb) {
  return rb == 0 && t.rows >= kPrefetchRows;
}
// The cache lines of the block kPrefetchBlocks ahead of p (Bytes: one packed block).
template <int64_t Bytes>
inline void prefetch_block(const uint8_t* p) {
#pragma GCC unroll 16
  for (int64_t o = 0; o < Bytes; o += 64) __builtin_prefetch(p + kPrefetchBlocks * Bytes + o);
}

// R rows (R <= MR) of row block rb of the task, all blocks of one panel.
template <int R>
void quant_block(const QuantTask& t, int64_t rb) {
  const int64_t nb = t.k / kQuantBlock;
  const bool prefetch = quant_prefetch(t, rb);
  // the row blocks before this one are full: MR rows; this one has R (QuantTask's layout)
  const int8_t* xq = t.qx + rb * MR * t.k;  // block b, group g, row r: 4 bytes at
  const float* xd = t.dx + rb * MR * nb;    // xq + ((b * 8 + g) * R + r) * 4
  const float* xs = t.sx + rb * MR * nb;
  VF acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = t.bias ? fload(t.bias) : fzero();
  const uint8_t* p = t.panel;
  for (int64_t b = 0; b < nb; ++b) {
    VI sum[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sum[r] = VI{};
    if (t.four_bit) {
      if (prefetch) prefetch_block<quant_block_bytes(true, W)>(p);
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const VI raw = vload(p + g * 4 * W);
        const VI lo = lo_nibbles(raw), hi = hi_nibbles(raw);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          sum[r] = dot4_nibbles(sum[r], lo, bcast4(xq + (g * R + r) * 4));
          sum[r] = dot4_nibbles(sum[r], hi, bcast4(xq + ((4 + g) * R + r) * 4));
          in_register(sum[r]);
        }
      }
      const VF d = halfs(p + 16 * W), m = halfs(p + 18 * W);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        VF v = fmul(d, to_float(widen_nibble_sum(sum[r])));
        v = fmadd(m, fsplat(xs[r]), v);
        acc[r] = fmadd(v, fsplat(xd[r]), acc[r]);
      }
      p += 20 * W;
    } else {
      if (prefetch) prefetch_block<quant_block_bytes(false, W)>(p);
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const VI w = w8_operand(vload(p + g * 4 * W));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          sum[r] = dot_w8(sum[r], w, bcast4(xq + (g * R + r) * 4));
          in_register(sum[r]);
        }
      }
      const VF d = halfs(p + 32 * W);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[r] = fmadd(fmul(d, w8_sum(sum[r], xs[r])), fsplat(xd[r]), acc[r]);
      }
      p += 34 * W;
    }
    xq += kQuantBlock * R;
    xd += R;
    xs += R;
  }
  for (int r = 0; r < R; ++r) {
    float* out = t.y + (rb * MR + r) * t.ldy;
    if (t.cols == W) {
      fstore(out, acc[r]);
    } else {  // the last panel of a width that is not a multiple of W
      float tmp[W];
      fstore(tmp, acc[r]);
      memcpy(out, tmp, t.cols * sizeof(float));
    }
  }
}

template <int R>
void quant_rows(int r, const QuantTask& t, int64_t rb) {
  if (r == R) {
    quant_block<R>(t, rb);
  } else if constexpr (R > 1) {
    quant_rows<R - 1>(r, t, rb);
  }
}

inline void quant_panel(const QuantTask& t) {
  for (int64_t rb = 0; rb * MR < t.rows; ++rb) {
    const int r = static_cast<int>(t.rows - rb * MR < MR ? t.rows - rb * MR : MR);
    quant_rows<MR>(r, t, rb);
  }
}
