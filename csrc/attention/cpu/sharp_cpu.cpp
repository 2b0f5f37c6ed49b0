// sharp_cpu.cpp: work decomposition, per-row set-up (n_i, beta, scaled q), split-KV merge and
// run-time ISA dispatch of the CPU sharp-attention forward. Torch-free.
#include "attention/cpu/sharp_cpu.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "attention/sharp_math.h"
#include "common/cpu_features.h"

namespace sharpdraft {
namespace cpu {
namespace {

// ---- ISA dispatch ------------------------------------------------------------------------
struct Isa {
  TileFn fn;
  const char* name;
  int64_t row_align;  // floats per vector of the tile kernel: a tile's rows are padded to it
};

const Isa& isa() {
  static const Isa table[3] = {{attend_tile_base, "base", kTileVecBase},
                               {attend_tile_avx2, "avx2", kTileVecAvx2},
                               {attend_tile_avx512, "avx512", kTileVecAvx512}};
  return table[isa_level()];
}

// ---- element access ----------------------------------------------------------------------
inline int64_t elem_bytes(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

inline float load_elem(const void* base, int64_t idx, DType dt) {
  if (dt == DType::kFloat32) return static_cast<const float*>(base)[idx];
  const uint16_t h = static_cast<const uint16_t*>(base)[idx];
  return dt == DType::kBFloat16 ? bf16_to_float(h) : fp16_to_float(h);
}

inline void store_elem(void* base, int64_t idx, DType dt, float x) {
  if (dt == DType::kFloat32) {
    static_cast<float*>(base)[idx] = x;
  } else {
    static_cast<uint16_t*>(base)[idx] = dt == DType::kBFloat16 ? float_to_bf16(x) : float_to_fp16(x);
  }
}

// ---- one query row -----------------------------------------------------------------------
struct RowInfo {
  int64_t h, i;
  KeyRange range;
  const bool* mask_row;
};

inline RowInfo row_info(const SharpParams& p, int64_t b, int64_t hk, int64_t row, int64_t len_q,
                        int64_t kv_len) {
  const int64_t G = p.heads_q / p.heads_k;
  RowInfo r;
  r.i = row / G;
  r.h = hk * G + row % G;
  r.range = visible_range(r.i, len_q, kv_len, p.causal, p.window);
  r.mask_row = p.mask ? p.mask + b * p.mask_batch_stride + r.h * p.mask_head_stride +
                            r.i * p.mask_row_stride
                      : nullptr;
  return r;
}

// n_i as beta sees it (spec §2): the override if given, else the visible keys counted from
// the mask actually applied, else the closed form.
inline int64_t cardinality(const SharpParams& p, int64_t b, const RowInfo& r) {
  if (p.n_visible) {
    return p.n_visible[row_offset(p.cu_seqlens_q, b, r.h, r.i, p.nv_batch_stride,
                                  p.nv_head_stride, p.nv_row_stride)];
  }
  if (!r.mask_row) return range_count(r.range);
  int64_t n = 0;
  for (int64_t j = r.range.lo; j < r.range.hi; ++j) n += r.mask_row[j];
  return n;
}

// Calls of at most kStepTokens query tokens split their keys in chunks of kStepChunkKeys.
constexpr int64_t kStepTokens = 128, kStepChunkKeys = 512;

inline bool step_sized(int64_t len_q) { return len_q <= kStepTokens; }
inline int64_t step_chunks(int64_t kv_len) {
  return std::max<int64_t>(1, (kv_len + kStepChunkKeys - 1) / kStepChunkKeys);
}

// n_i of every row of (batch, kv head) bh = b * Hk + hk, written like lse (SharpParams strides).
void count_rows(const SharpParams& p, int64_t bh, int64_t* counts) {
  const int64_t G = p.heads_q / p.heads_k, b = bh / p.heads_k, hk = bh % p.heads_k;
  const int64_t len_q = seqlen_q_of(p, b), kv_len = seqlen_k_of(p, b);
  for (int64_t row = 0; row < len_q * G; ++row) {
    const RowInfo ri = row_info(p, b, hk, row, len_q, kv_len);
    counts[row_offset(p.cu_seqlens_q, b, ri.h, ri.i, p.lse_batch_stride, p.lse_head_stride,
                      p.lse_row_stride)] = cardinality(p, b, ri);
  }
}

// A masked row's visible keys in [lo, hi): returns their count; with `bounds` (nb + 1 entries)
// also where its chunks of kStepChunkKeys visible keys begin: bounds[0] = lo, bounds[c] = the
// position of visible key number c * kStepChunkKeys (hi if there are fewer), bounds[nb] = hi.
// Eight mask bytes at a time (bool bytes are 0 or 1).
int64_t scan_mask_row(const bool* m, int64_t lo, int64_t hi, int64_t* bounds, int64_t nb) {
  int64_t n = 0, c = 1;
  int64_t next = INT64_MAX;  // the visible key number the next bound waits for
  if (bounds) {
    bounds[0] = lo;
    for (int64_t i = 1; i <= nb; ++i) bounds[i] = hi;
    if (nb > 1) next = kStepChunkKeys;
  }
  auto one = [&](int64_t j) {
    if (!m[j]) return;
    if (n == next) {
      bounds[c++] = j;
      next = c < nb ? next + kStepChunkKeys : INT64_MAX;
    }
    ++n;
  };
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8) {
    uint64_t w;
    std::memcpy(&w, m + j, 8);
    const int64_t cnt = __builtin_popcountll(w);
    if (n + cnt > next) {
      for (int64_t e = j; e < j + 8; ++e) one(e);
    } else {
      n += cnt;
    }
  }
  for (; j < hi; ++j) one(j);
  return n;
}

// Per dense row (b, h, i) of a masked call: n_i (`counts`, when no override is given) and,
// for step-sized batches, the chunk bounds (`bounds`, nb + 1 per row) of every row of
// (batch, kv head) bh = b * Hk + hk.
void scan_rows(const SharpParams& p, int64_t bh, int64_t* counts, int64_t* bounds, int64_t nb) {
  const int64_t G = p.heads_q / p.heads_k, b = bh / p.heads_k, hk = bh % p.heads_k;
  const int64_t len_q = seqlen_q_of(p, b), kv_len = seqlen_k_of(p, b);
  const bool step = bounds && step_sized(len_q);
  for (int64_t row = 0; row < len_q * G; ++row) {
    const RowInfo ri = row_info(p, b, hk, row, len_q, kv_len);
    const int64_t at = (b * p.heads_q + ri.h) * p.seqlen_q + ri.i;
    const int64_t n = scan_mask_row(ri.mask_row, ri.range.lo, ri.range.hi,
                                    step ? bounds + at * (nb + 1) : nullptr, nb);
    if (counts) counts[at] = n;
  }
}

// ---- work decomposition ------------------------------------------------------------------
struct WorkItem {
  int64_t b, hk, row0, rows, len_q, kv_len;
  int64_t k_lo, k_hi;  // key split
  int64_t slot;        // split-KV workspace slot (rows of kMaxTileRows), -1: write the output
  int64_t cost;        // rough amount of work, for longest-first scheduling
  int64_t chunk;       // step-sized calls: which chunk of each row's visible keys; -1: k_lo..k_hi
};

struct Plan {
  std::vector<WorkItem> items;
  struct Merge {
    int64_t b, hk, row0, rows, len_q, kv_len, slot0, splits;
  };
  std::vector<Merge> merges;
  int64_t slots = 0;
};

Plan make_plan(const SharpParams& p, int num_threads) {
  const int64_t G = p.heads_q / p.heads_k;
  struct Tile {
    int64_t b, hk, row0, rows, len_q, kv_len;
  };
  std::vector<Tile> tiles;
  int64_t max_kv = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len_q = seqlen_q_of(p, b), kv_len = seqlen_k_of(p, b);
    const int64_t rows = len_q * G;
    if (rows == 0) continue;
    max_kv = std::max(max_kv, kv_len);
    const int64_t ntiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
    const int64_t per = (rows + ntiles - 1) / ntiles;
    for (int64_t hk = 0; hk < p.heads_k; ++hk)
      for (int64_t r0 = 0; r0 < rows; r0 += per)
        tiles.push_back({b, hk, r0, std::min(per, rows - r0), len_q, kv_len});
  }
  // Split the keys when there are too few tiles to keep every thread busy (decode, drafter
  // blocks); each split keeps at least 512 keys.
  const int64_t target = 4 * std::max(num_threads, 1);
  int64_t splits = 1;
  if (!tiles.empty() && static_cast<int64_t>(tiles.size()) < target) {
    splits = std::min<int64_t>((target + tiles.size() - 1) / tiles.size(), max_kv / 512);
    splits = std::max<int64_t>(splits, 1);
  }
  Plan plan;
  for (const Tile& t : tiles) {
    // A step-sized call (decode, verification): each row's visible keys split in chunks of
    // kStepChunkKeys counted in key order (for a row without a mask, at fixed positions from
    // its first key), each chunk computed in two passes (TileTask::exact). A row's arithmetic
    // then depends on its own visible keys only, never on how many rows or keys the call
    // holds nor on where masked keys fall: a row decoded alone and the same row verified
    // among others, or as a node of a tree, give the same bits (the lossless engine needs
    // it). A single live chunk merges to exactly the unsplit result.
    const bool step = step_sized(t.len_q);
    const int64_t s_here =
        step ? step_chunks(t.kv_len)
             : std::min<int64_t>(splits, std::max<int64_t>(1, t.kv_len / 512));
    if (s_here == 1) {
      plan.items.push_back({t.b, t.hk, t.row0, t.rows, t.len_q, t.kv_len, 0, t.kv_len, -1,
                            t.rows * std::max<int64_t>(t.kv_len, 1), step ? 0 : -1});
      continue;
    }
    const int64_t chunk = step ? kStepChunkKeys : ((t.kv_len + s_here - 1) / s_here + 63) / 64 * 64;
    const int64_t slot0 = plan.slots;
    int64_t n = 0;
    for (int64_t k0 = 0; k0 < t.kv_len; k0 += chunk, ++n) {
      const int64_t k1 = std::min(k0 + chunk, t.kv_len);
      plan.items.push_back({t.b, t.hk, t.row0, t.rows, t.len_q, t.kv_len, k0, k1, slot0 + n,
                            t.rows * (k1 - k0), step ? n : -1});
    }
    plan.merges.push_back({t.b, t.hk, t.row0, t.rows, t.len_q, t.kv_len, slot0, n});
    plan.slots += n;
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return plan;
}

// The tile kernel's workspace (tile_scratch_floats() floats), one per thread, kept across calls:
// the kernel writes every float it reads, so it is neither zeroed nor reallocated per call.
float* tile_workspace() {
  thread_local std::vector<float> buf(tile_scratch_floats());
  return buf.data();
}

struct Scratch {
  std::vector<float> q, q_rows, acc, m, l, row;
  std::vector<int64_t> lo, hi;
  std::vector<const bool*> mask_rows;
  explicit Scratch(int64_t dp)
      : q(kMaxTileRows * dp), q_rows(kMaxTileRows * dp), acc(kMaxTileRows * dp), m(kMaxTileRows), l(kMaxTileRows),
        row(dp), lo(kMaxTileRows), hi(kMaxTileRows),
        mask_rows(kMaxTileRows) {}
};

// Runs fn(index, scratch) for index in [0, n) on the caller's parallel-for with dynamic
// scheduling: each worker owns one Scratch and takes the next index from a shared counter, so
// uneven items balance out whatever partition the parallel-for chooses.
template <class Fn>
void run_dynamic(int64_t n, int num_threads, const ParallelFor& pf, int64_t dp, const Fn& fn) {
  if (n == 0) return;
  const int64_t workers = std::min<int64_t>(std::max(num_threads, 1), n);
  std::atomic<int64_t> next{0};
  auto worker = [&](int64_t, int64_t) {
    Scratch sc(dp);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i, sc);
  };
  if (pf && workers > 1) {
    pf(workers, worker);
  } else {
    worker(0, n);
  }
}

// counts: n_i of every dense row (b, h, i) when a mask is given (counted once, not per split);
// bounds: the chunk bounds of every dense row of a masked step-sized call (nb + 1 per row).
void run_item(const SharpParams& p, const WorkItem& w, const int64_t* counts,
              const int64_t* bounds, int64_t nb, Scratch& sc, float* ws_out, float* ws_lse) {
  const int64_t D = p.head_dim, Dp = (D + 15) / 16 * 16;
  // rows padded to one vector of the kernel's lanes (a decode step's 3 rows of a 9/3-head
  // model: 8 lanes on AVX2, not 16); the lanes are independent, so a row's bits do not depend
  // on the padding
  const int64_t align = isa().row_align, Rp = (w.rows + align - 1) / align * align;
  const int64_t eb = elem_bytes(p.dtype);
  TileTask t;
  t.rows = static_cast<int>(w.rows);
  t.rows_padded = static_cast<int>(Rp);
  t.head_dim = D;
  t.dim_padded = Dp;
  t.dtype = p.dtype;
  t.k = static_cast<const char*>(p.k) +
        row_offset(p.cu_seqlens_k, w.b, w.hk, 0, p.k_batch_stride, p.k_head_stride, p.k_row_stride) * eb;
  t.v = static_cast<const char*>(p.v) +
        row_offset(p.cu_seqlens_k, w.b, w.hk, 0, p.v_batch_stride, p.v_head_stride, p.v_row_stride) * eb;
  t.k_row_stride = p.k_row_stride;
  t.v_row_stride = p.v_row_stride;
  t.k_begin = w.k_hi;
  t.k_end = w.k_lo;
  std::fill(sc.q.begin(), sc.q.begin() + D * Rp, 0.f);
  for (int64_t r = 0; r < Rp; ++r) {
    sc.lo[r] = sc.hi[r] = 0;
    sc.mask_rows[r] = nullptr;
    if (r >= w.rows) continue;
    const RowInfo ri = row_info(p, w.b, w.hk, w.row0 + r, w.len_q, w.kv_len);
    const int64_t n = counts ? counts[(w.b * p.heads_q + ri.h) * p.seqlen_q + ri.i]
                             : cardinality(p, w.b, ri);
    const double beta = query_scale(n, p.sp, ri.h);
    const float c = score_factor(beta, p.softmax_scale);
    const int64_t qo = row_offset(p.cu_seqlens_q, w.b, ri.h, ri.i, p.q_batch_stride,
                                  p.q_head_stride, p.q_row_stride);
    float* qr = sc.q_rows.data() + r * Dp;
    for (int64_t d = 0; d < D; ++d) {
      qr[d] = load_elem(p.q, qo + d, p.dtype) * c;
      sc.q[d * Rp + r] = qr[d];
    }
    std::fill(qr + D, qr + Dp, 0.f);
    if (w.chunk < 0) {
      sc.lo[r] = std::max(ri.range.lo, w.k_lo);
      sc.hi[r] = std::min(ri.range.hi, w.k_hi);
    } else if (ri.mask_row) {
      const int64_t* bd = bounds + ((w.b * p.heads_q + ri.h) * p.seqlen_q + ri.i) * (nb + 1);
      sc.lo[r] = bd[w.chunk];
      sc.hi[r] = bd[w.chunk + 1];
    } else {
      sc.lo[r] = std::min(ri.range.lo + w.chunk * kStepChunkKeys, ri.range.hi);
      sc.hi[r] = std::min(sc.lo[r] + kStepChunkKeys, ri.range.hi);
    }
    sc.mask_rows[r] = ri.mask_row;
    if (sc.hi[r] > sc.lo[r]) {
      t.k_begin = std::min(t.k_begin, sc.lo[r]);
      t.k_end = std::max(t.k_end, sc.hi[r]);
    }
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + w.rows * Dp, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + Rp, -__builtin_inff());
  std::fill(sc.l.begin(), sc.l.begin() + Rp, 0.f);
  t.qt = sc.q.data();
  t.q_rows = sc.q_rows.data();
  t.lo = sc.lo.data();
  t.hi = sc.hi.data();
  t.mask_rows = p.mask ? sc.mask_rows.data() : nullptr;
  t.acc = sc.acc.data();
  t.m = sc.m.data();
  t.l = sc.l.data();
  t.scratch = tile_workspace();
  t.exact = w.chunk >= 0 && t.k_end - t.k_begin <= kExactSpan;
  t.dot_order = t.exact && p.heads_q / p.heads_k <= kDotRows;
  if (t.k_end > t.k_begin) isa().fn(t);

  for (int64_t r = 0; r < w.rows; ++r) {
    const float inv = finalize_inv_sum(sc.l[r]);
    const float lse = finalize_lse_natural(sc.m[r], sc.l[r]);
    const float* a = sc.acc.data() + r * Dp;
    if (w.slot >= 0) {  // split-KV partial: normalised output and its lse
      float* o = ws_out + (w.slot * kMaxTileRows + r) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
      ws_lse[w.slot * kMaxTileRows + r] = lse;
      continue;
    }
    const RowInfo ri = row_info(p, w.b, w.hk, w.row0 + r, w.len_q, w.kv_len);
    const int64_t oo = row_offset(p.cu_seqlens_q, w.b, ri.h, ri.i, p.o_batch_stride,
                                  p.o_head_stride, p.o_row_stride);
    for (int64_t d = 0; d < D; ++d) store_elem(p.out, oo + d, p.dtype, a[d] * inv);
    if (p.lse) {
      p.lse[row_offset(p.cu_seqlens_q, w.b, ri.h, ri.i, p.lse_batch_stride, p.lse_head_stride,
                       p.lse_row_stride)] = lse;
    }
  }
}

void run_merge(const SharpParams& p, const Plan::Merge& mg, const float* ws_out,
               const float* ws_lse, float* row) {
  const int64_t D = p.head_dim;
  for (int64_t r = 0; r < mg.rows; ++r) {
    float lse = -__builtin_inff();
    for (int64_t s = 0; s < mg.splits; ++s) lse = lse_merge(lse, ws_lse[(mg.slot0 + s) * kMaxTileRows + r]);
    std::fill(row, row + D, 0.f);
    for (int64_t s = 0; s < mg.splits; ++s) {
      const int64_t idx = (mg.slot0 + s) * kMaxTileRows + r;
      const float wgt = lse_weight(ws_lse[idx], lse);
      if (wgt == 0.f) continue;
      const float* o = ws_out + idx * D;
      for (int64_t d = 0; d < D; ++d) row[d] += wgt * o[d];
    }
    const RowInfo ri = row_info(p, mg.b, mg.hk, mg.row0 + r, mg.len_q, mg.kv_len);
    const int64_t oo = row_offset(p.cu_seqlens_q, mg.b, ri.h, ri.i, p.o_batch_stride,
                                  p.o_head_stride, p.o_row_stride);
    for (int64_t d = 0; d < D; ++d) store_elem(p.out, oo + d, p.dtype, row[d]);
    if (p.lse) {
      p.lse[row_offset(p.cu_seqlens_q, mg.b, ri.h, ri.i, p.lse_batch_stride, p.lse_head_stride,
                       p.lse_row_stride)] = lse;
    }
  }
}

}  // namespace

const char* isa_name() { return isa().name; }

void sharp_attention_forward(const SharpParams& p, int num_threads, const ParallelFor& pf) {
  const Plan plan = make_plan(p, num_threads);
  const int64_t Dp = (p.head_dim + 15) / 16 * 16;
  // With a mask, scan each row's visible keys once up front: n_i (dense layout: masks are
  // dense) and, for step-sized batches, where its chunks of visible keys begin.
  std::vector<int64_t> counts, bounds;
  int64_t nb = 0;
  if (p.mask) {
    bool any_step = false;
    for (int64_t b = 0; b < p.batch; ++b) {
      if (!step_sized(seqlen_q_of(p, b))) continue;
      any_step = true;
      nb = std::max(nb, step_chunks(seqlen_k_of(p, b)));
    }
    if (!p.n_visible) counts.resize(p.batch * p.heads_q * p.seqlen_q);
    if (any_step) bounds.resize(p.batch * p.heads_q * p.seqlen_q * (nb + 1));
    if (!counts.empty() || !bounds.empty()) {
      run_dynamic(p.batch * p.heads_k, num_threads, pf, Dp, [&](int64_t bh, Scratch&) {
        scan_rows(p, bh, counts.empty() ? nullptr : counts.data(),
                  bounds.empty() ? nullptr : bounds.data(), nb);
      });
    }
  }
  const int64_t* cnt = counts.empty() ? nullptr : counts.data();
  std::vector<float> ws_out(plan.slots * kMaxTileRows * p.head_dim);
  std::vector<float> ws_lse(plan.slots * kMaxTileRows);
  run_dynamic(static_cast<int64_t>(plan.items.size()), num_threads, pf, Dp,
              [&](int64_t i, Scratch& sc) {
                run_item(p, plan.items[i], cnt, bounds.data(), nb, sc, ws_out.data(),
                         ws_lse.data());
              });
  run_dynamic(static_cast<int64_t>(plan.merges.size()), num_threads, pf, Dp,
              [&](int64_t i, Scratch& sc) {
                run_merge(p, plan.merges[i], ws_out.data(), ws_lse.data(), sc.row.data());
              });
}

void visible_counts(const SharpParams& p, int64_t* counts) {
  for (int64_t bh = 0; bh < p.batch * p.heads_k; ++bh) count_rows(p, bh, counts);
}

}  // namespace cpu
}  // namespace sharpdraft
