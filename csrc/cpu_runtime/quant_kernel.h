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
//   dot_w8(acc, w, xb)      acc (int32) + per lane sum over its 4 bytes of w * xb, both signed
//   to_float, halfs(p), fsplat(s), fmul, fmadd(a, b, c) = a * b + c, fzero, fload, fstore
// and in_register(v), an empty asm that pins a running sum to a register: without it GCC
// reassociates a block's integer sums into a tree, computes every product first and spills
// them (measured: 3x slower at 16 rows on AVX2).
// Per row and block the float work is v = d * sum; v = m * sum(qx) + v; y = v * dx + y (4-bit)
// or v = d * sum; y = v * dx + y (8-bit), the same on every path and for every row count.

// R rows (R <= MR) from row r0 of the task, all blocks of one panel.
template <int R>
void quant_block(const QuantTask& t, int64_t r0) {
  const int64_t nb = t.k / kQuantBlock;
  const int8_t* xq[R];
  const float* xd[R];
  const int32_t* xs[R];
  VF acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    xq[r] = t.qx + (r0 + r) * t.k;
    xd[r] = t.dx + (r0 + r) * nb;
    xs[r] = t.sx + (r0 + r) * nb;
    acc[r] = t.bias ? fload(t.bias) : fzero();
  }
  const uint8_t* p = t.panel;
  for (int64_t b = 0; b < nb; ++b) {
    VI sum[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sum[r] = VI{};
    if (t.four_bit) {
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const VI raw = vload(p + g * 4 * W);
        const VI lo = lo_nibbles(raw), hi = hi_nibbles(raw);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xq[r] + b * kQuantBlock;
          sum[r] = dot4_nibbles(sum[r], lo, bcast4(x + 4 * g));
          sum[r] = dot4_nibbles(sum[r], hi, bcast4(x + 16 + 4 * g));
          in_register(sum[r]);
        }
      }
      const VF d = halfs(p + 16 * W), m = halfs(p + 18 * W);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        VF v = fmul(d, to_float(widen_nibble_sum(sum[r])));
        v = fmadd(m, fsplat(static_cast<float>(xs[r][b])), v);
        acc[r] = fmadd(v, fsplat(xd[r][b]), acc[r]);
      }
      p += 20 * W;
    } else {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const VI w = vload(p + g * 4 * W);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          sum[r] = dot_w8(sum[r], w, bcast4(xq[r] + b * kQuantBlock + 4 * g));
          in_register(sum[r]);
        }
      }
      const VF d = halfs(p + 32 * W);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = fmadd(fmul(d, to_float(sum[r])), fsplat(xd[r][b]), acc[r]);
      p += 34 * W;
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = t.y + (r0 + r) * t.ldy;
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
void quant_rows(int r, const QuantTask& t, int64_t r0) {
  if (r == R) {
    quant_block<R>(t, r0);
  } else if constexpr (R > 1) {
    quant_rows<R - 1>(r, t, r0);
  }
}

inline void quant_panel(const QuantTask& t) {
  for (int64_t r0 = 0; r0 < t.rows; r0 += MR) {
    const int r = static_cast<int>(t.rows - r0 < MR ? t.rows - r0 : MR);
    quant_rows<MR>(r, t, r0);
  }
}
