"""Loads the target runtime's extension (`sharpdraft_ext._cpu_runtime`: the ops
torch.ops.sharpdraft_cpu_runtime.* and their CPU kernels) and registers the fake (meta) kernels
used by torch.compile.

The fake kernels check their arguments with the extension's own check ops
(torch.ops.sharpdraft_cpu_runtime.check_*: the shape, dtype and device checks of
csrc/cpu_runtime/api.h, which never read tensor values), so a call on fake or meta tensors is
rejected exactly where the real kernel would reject it.
"""
import torch

# The attention extension first: llama_layers calls its op sharpdraft::sharp_attention through
# the dispatcher, which must know the schema and the CPU kernel.
from .. import _C  # noqa: F401  (registers torch.ops.sharpdraft.*)
from .. import _cpu_runtime  # noqa: F401  (registers torch.ops.sharpdraft_cpu_runtime.*)

ops = torch.ops.sharpdraft_cpu_runtime


@torch.library.register_fake("sharpdraft_cpu_runtime::pack_linear_weight")
def _pack_linear_weight_fake(weight):
    ops.check_pack_linear_weight(weight)
    n, k = weight.shape
    width = ops.panel_width()
    return weight.new_empty(((n + width - 1) // width, k, width))


@torch.library.register_fake("sharpdraft_cpu_runtime::packed_linear")
def _packed_linear_fake(x, packed, out_features, bias):
    ops.check_packed_linear(x, packed, out_features, bias, ops.panel_width())
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("sharpdraft_cpu_runtime::quant_pack")
def _quant_pack_fake(blocks, qtype, out_features, in_features):
    ops.check_quant_pack(blocks, qtype, out_features, in_features)
    width = ops.quant_panel_width()
    block = 34 * width if qtype == "q8_0" else 20 * width
    return blocks.new_empty(((out_features + width - 1) // width, in_features // 32, block))


@torch.library.register_fake("sharpdraft_cpu_runtime::quant_linear")
def _quant_linear_fake(x, packed, qtype, out_features, bias):
    ops.check_quant_linear(x, packed, qtype, out_features, bias, ops.quant_panel_width())
    return x.new_empty((*x.shape[:-1], out_features))
