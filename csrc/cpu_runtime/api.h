// api.h: argument checks of the target runtime's torch ops (ops.cpp, decoder.cpp).
//
// Each reads only shapes, dtypes, devices and scalar arguments (sizes as c10::SymInt, never
// tensor values), so the check ops (ops.cpp) expose them to the fake kernels
// (sharpdraft_ext/cpu_runtime/_ops.py) and a traced call is rejected exactly like an eager one;
// each message names the offending argument. Header-only.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>

namespace sharpdraft {

// pack_linear_weight's argument: a 2-D float32 CPU weight (out_features, in_features).
inline void check_pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.defined(), "weight must be a tensor");
  TORCH_CHECK_VALUE(weight.device().is_cpu() || weight.device().is_meta(),
                    "weight must be a CPU tensor (the packed linear layer is CPU only), got ",
                    weight.device());
  TORCH_CHECK_VALUE(weight.scalar_type() == at::kFloat, "weight must be float32, got ",
                    weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.sym_size(0) > 0 && weight.sym_size(1) > 0,
                    "weight must have shape (out_features, in_features), both >= 1, got ",
                    weight.sym_sizes());
}

// packed_linear's arguments: x (..., in_features) float32 on the CPU, `packed` as returned by
// pack_linear_weight on a machine whose panel width is `panel_width`, out_features the
// weight's first dimension, bias (out_features,) float32 or none.
inline void check_packed_linear(const at::Tensor& x, const at::Tensor& packed,
                                int64_t out_features, const std::optional<at::Tensor>& bias,
                                int64_t panel_width) {
  TORCH_CHECK_VALUE(x.defined() && packed.defined(), "x and packed must be tensors");
  for (const at::Tensor* t : {&x, &packed}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() || t->device().is_meta(),
                      t == &x ? "x" : "packed", " must be a CPU tensor (the packed linear "
                      "layer is CPU only), got ", t->device());
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat, t == &x ? "x" : "packed",
                      " must be float32, got ", t->scalar_type());
  }
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.sym_size(0) >= 1 && packed.sym_size(1) >= 1,
                    "packed must be the (panels, in_features, panel width) tensor of "
                    "pack_linear_weight, got shape ", packed.sym_sizes());
  TORCH_CHECK_VALUE(packed.sym_size(2) == panel_width, "packed has panels of ",
                    packed.sym_size(2), " columns but this CPU's kernel uses ", panel_width,
                    ": pack the weight again on this machine (pack_linear_weight)");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.sym_size(-1) == packed.sym_size(1),
                    "x must have shape (..., in_features) with in_features = ",
                    packed.sym_size(1), " (the packed weight's), got ", x.sym_sizes());
  const c10::SymInt panels = packed.sym_size(0);
  TORCH_CHECK_VALUE(out_features > (panels - 1) * panel_width &&
                        out_features <= panels * panel_width,
                    "out_features must be the packed weight's out_features, in (",
                    (panels - 1) * panel_width, ", ", panels * panel_width, "], got ",
                    out_features);
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->device() == x.device() && bias->scalar_type() == at::kFloat &&
                          bias->dim() == 1 && bias->sym_size(0) == out_features,
                      "bias must be a float32 (out_features,) = (", out_features, ",) tensor "
                      "on x's device, got ", bias->scalar_type(), " ", bias->sym_sizes(),
                      " on ", bias->device());
  }
}

// The quantised linear layer's formats (quant_linear.h): "q4_0", "q4_1", "q8_0" -> 0, 1, 2
// (cpu::QuantType); GGUF bytes per block of 32 weights and packed bytes per block.
inline int64_t quant_type_id(c10::string_view qtype) {
  if (qtype == "q4_0") return 0;
  if (qtype == "q4_1") return 1;
  if (qtype == "q8_0") return 2;
  TORCH_CHECK_VALUE(false, "qtype must be one of q4_0, q4_1, q8_0, got '", std::string(qtype), "'");
  return -1;
}
inline int64_t quant_gguf_block_bytes(int64_t id) { return id == 0 ? 18 : id == 1 ? 20 : 34; }
inline int64_t quant_packed_block_bytes(int64_t id, int64_t width) {
  return id == 2 ? 34 * width : 20 * width;
}

// quant_pack's arguments: `blocks` the GGUF tensor's data as uint8 (out_features, in_features /
// 32 * block bytes) on the CPU, in_features a multiple of 32.
inline void check_quant_pack(const at::Tensor& blocks, c10::string_view qtype,
                             int64_t out_features, int64_t in_features) {
  const int64_t id = quant_type_id(qtype);
  TORCH_CHECK_VALUE(out_features >= 1, "out_features must be >= 1, got ", out_features);
  TORCH_CHECK_VALUE(in_features >= 32 && in_features % 32 == 0,
                    "in_features must be a positive multiple of 32 (the GGUF block), got ",
                    in_features);
  TORCH_CHECK_VALUE(blocks.defined(), "blocks must be a tensor");
  TORCH_CHECK_VALUE(blocks.device().is_cpu() || blocks.device().is_meta(),
                    "blocks must be a CPU tensor, got ", blocks.device());
  TORCH_CHECK_VALUE(blocks.scalar_type() == at::kByte, "blocks must be uint8 (the GGUF "
                    "tensor's raw bytes), got ", blocks.scalar_type());
  const int64_t row = in_features / 32 * quant_gguf_block_bytes(id);
  TORCH_CHECK_VALUE(blocks.dim() == 2 && blocks.sym_size(0) == out_features &&
                        blocks.sym_size(1) == row,
                    "blocks must have shape (out_features, in_features / 32 * ",
                    quant_gguf_block_bytes(id), ") = (", out_features, ", ", row, ") for ",
                    std::string(qtype), ", got ", blocks.sym_sizes());
}

// quant_linear's arguments: x (..., in_features) float32 on the CPU; `packed` as returned by
// quant_pack for `qtype` on a machine whose panel width is `panel_width`: uint8 (panels,
// in_features / 32, packed block bytes); out_features; bias (out_features,) float32 or none.
inline void check_quant_linear(const at::Tensor& x, const at::Tensor& packed,
                               c10::string_view qtype, int64_t out_features,
                               const std::optional<at::Tensor>& bias, int64_t panel_width) {
  const int64_t id = quant_type_id(qtype);
  TORCH_CHECK_VALUE(x.defined() && packed.defined(), "x and packed must be tensors");
  for (const at::Tensor* t : {&x, &packed}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() || t->device().is_meta(),
                      t == &x ? "x" : "packed", " must be a CPU tensor (the quantised linear "
                      "layer is CPU only), got ", t->device());
  }
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                        packed.sym_size(0) >= 1 && packed.sym_size(1) >= 1,
                    "packed must be the uint8 (panels, in_features / 32, block bytes) tensor "
                    "of quant_pack, got ", packed.scalar_type(), " ", packed.sym_sizes());
  TORCH_CHECK_VALUE(packed.sym_size(2) == quant_packed_block_bytes(id, panel_width),
                    "packed has blocks of ", packed.sym_size(2), " bytes but ",
                    std::string(qtype), " on this CPU's kernel (panels of ", panel_width,
                    " columns) uses ", quant_packed_block_bytes(id, panel_width),
                    ": pack it again for this qtype on this machine (quant_pack)");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.sym_size(-1) == packed.sym_size(1) * 32,
                    "x must have shape (..., in_features) with in_features = ",
                    packed.sym_size(1) * 32, " (the packed weight's), got ", x.sym_sizes());
  const c10::SymInt panels = packed.sym_size(0);
  TORCH_CHECK_VALUE(out_features > (panels - 1) * panel_width &&
                        out_features <= panels * panel_width,
                    "out_features must be the packed weight's out_features, in (",
                    (panels - 1) * panel_width, ", ", panels * panel_width, "], got ",
                    out_features);
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->device() == x.device() && bias->scalar_type() == at::kFloat &&
                          bias->dim() == 1 && bias->sym_size(0) == out_features,
                      "bias must be a float32 (out_features,) = (", out_features, ",) tensor "
                      "on x's device, got ", bias->scalar_type(), " ", bias->sym_sizes(),
                      " on ", bias->device());
  }
}

}  // namespace sharpdraft
