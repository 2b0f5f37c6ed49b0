"""sharpdraft_ext.cpu_runtime: the CPU ops of the target runtime
(torch.ops.sharpdraft_cpu_runtime, the extension module sharpdraft_ext._cpu_runtime), for the 1
to ~96 rows of a decode or verification step (a prefill's many rows go to torch's GEMMs).

- float32 weights: `pack_linear_weight` / `packed_linear` (panels of output columns, each weight
  read once per call).
- GGUF block-quantised weights (Q4_0, Q4_1, Q8_0; the formats of GGML's ggml-common.h and
  gguf-py's quants.py): `quant_pack` / `quant_linear`, int8 activations and integer dot products
  (AVX2 maddubs, AVX-512 VNNI vpdpbusd), as llama.cpp computes them. `quant_unpack` gives the
  float32 weight the packed blocks hold; `quantize_activations` the int8 rows the kernel uses.
- `llama_layers`: a Llama-style decoder stack on the packed blocks in one call (the attention
  through the kernel's own op, sharpdraft::sharp_attention); `eagle3_layer`: the EAGLE-3
  drafter's layer and draft-vocabulary head in one call (the attention with SharpDraft's
  scaling); `pard_layers` and `dflash_layers`: the PARD and DFlash drafters' draft steps (layers,
  final norm and head) in one call.

Packed layouts are this machine's (they follow the instruction set): pack again on another one.
"""
from typing import List, Optional, Sequence

import torch

from ._ops import ops

QTYPES = ("q4_0", "q4_1", "q8_0")
# GGUF bytes per block of 32 weights (a float16 scale, a float16 minimum for Q4_1, the values)
GGUF_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """Repack a linear layer's weight for `packed_linear` (CPU, float32).

    The layout is this machine's: panels of `panel_width()` output columns (48 with AVX-512,
    16 with AVX2, 8 otherwise), each a contiguous (in_features, panel_width) block, zero padded
    past out_features. Pack again after the weight changes or on another machine.

    Args:
        weight: (out_features, in_features) float32 CPU tensor (an `nn.Linear` weight).

    Returns:
        (ceil(out_features / panel_width()), in_features, panel_width()) float32 tensor.

    Raises:
        ValueError naming `weight`: not a 2-D float32 CPU tensor.
    """
    ops.check_pack_linear_weight(weight)
    return ops.pack_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ weight.T + bias from the packed weight: `F.linear` for the few rows of a decode or
    verification step (1 to ~16), where it reads each weight once per call.

    Forward only (no autograd). float32 accumulation in the order k = 0 .. in_features - 1, so
    results equal `F.linear` up to float32 rounding.

    Args:
        x: (..., in_features) float32 CPU tensor.
        packed: `pack_linear_weight(weight)` on this machine.
        out_features: weight.shape[0].
        bias: (out_features,) float32 or None.

    Returns:
        (..., out_features) float32.

    Raises:
        ValueError naming the argument: a dtype or device other than float32 on the CPU, an x
        whose last dimension is not in_features, a `packed` made for another panel width (pack
        again on this machine), an out_features or bias that does not match the packed weight.
    """
    ops.check_packed_linear(x, packed, out_features, bias, panel_width())
    return ops.packed_linear(x, packed, out_features, bias)


def panel_width() -> int:
    """Output columns per panel of `pack_linear_weight` on this machine's instruction set."""
    return ops.panel_width()


def quant_panel_width() -> int:
    """Output columns per panel of `quant_pack` on this machine (16 with AVX-512, else 8)."""
    return ops.quant_panel_width()


def quant_isa() -> str:
    """The quantised kernel's instruction set: "avx512_vnni", "avx512", "avx2" or "base"
    (SHARPDRAFT_CPU_ISA=base|avx2|avx512 caps it, as for the attention kernel)."""
    return ops.quant_isa()


def quant_pack(blocks: torch.Tensor, qtype: str, out_features: int,
               in_features: int) -> torch.Tensor:
    """Pack a GGUF block-quantised weight for `quant_linear` (the bytes are kept, not
    dequantised: Q4_1 stays 5 bits a weight, Q8_0 8.5; Q4_0 is stored as Q4_1 with m = -8 d).

    Args:
        blocks: the GGUF tensor's raw data, uint8 (out_features, in_features / 32 * B) on the
            CPU, B = GGUF_BLOCK_BYTES[qtype] (gguf-py's `ReaderTensor.data` has this shape).
        qtype: "q4_0", "q4_1" or "q8_0".
        out_features, in_features: the weight's (N, K); K a multiple of 32.

    Returns:
        uint8 (ceil(N / quant_panel_width()), K / 32, packed block bytes).

    Raises:
        ValueError naming the argument: an unknown qtype, K not a multiple of 32, blocks of
        another dtype, device or shape.
    """
    ops.check_quant_pack(blocks, qtype, out_features, in_features)
    return ops.quant_pack(blocks, qtype, out_features, in_features)


def quant_unpack(packed: torch.Tensor, qtype: str, out_features: int) -> torch.Tensor:
    """The float32 (out_features, in_features) weight `packed` holds: d * q + m per block, equal
    to gguf-py's `quants.dequantize` of the blocks it was packed from.

    Raises:
        ValueError naming the argument (as `quant_linear`).
    """
    return ops.quant_unpack(packed, qtype, out_features)


def quantize_activations(x: torch.Tensor):
    """The int8 form `quant_linear` gives each row of x: per block of 32, dx = max|x| / 127 and
    qx = nearest(x / dx) (ties to even) within -127..127.

    Args:
        x: (..., K) float32 CPU tensor, K a multiple of 32.

    Returns:
        (qx int8 (..., K), dx float32 (..., K / 32), sum of each block's qx int32 (..., K / 32)).
    """
    return ops.quantize_activations(x)


def quant_linear(x: torch.Tensor, packed: torch.Tensor, qtype: str, out_features: int,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ W.T + bias with W in GGUF blocks (`quant_pack`) and x quantised to int8 per row
    and block (`quantize_activations`): for each block, dx * (d * sum(q * qx) + m * sum(qx)),
    the integer sums exact and the blocks accumulated in float32 in order. A row's result does
    not depend on the other rows of the call.

    Forward only (no autograd).

    Args:
        x: (..., in_features) float32 CPU tensor.
        packed: `quant_pack(...)` of this qtype on this machine.
        qtype: the format it was packed from.
        out_features: the weight's N.
        bias: (out_features,) float32 or None.

    Returns:
        (..., out_features) float32.

    Raises:
        ValueError naming the argument: x not float32 on the CPU or of the wrong width, a
        `packed` made for another qtype or panel width (pack again on this machine), an
        out_features or bias that does not match.
    """
    ops.check_quant_linear(x, packed, qtype, out_features, bias, quant_panel_width())
    return ops.quant_linear(x, packed, qtype, out_features, bias)


def llama_layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 key_cache: Sequence[torch.Tensor], value_cache: Sequence[torch.Tensor],
                 start: int, attn_mask: Optional[torch.Tensor],
                 input_norm: Sequence[torch.Tensor], post_norm: Sequence[torch.Tensor],
                 qkv: Sequence[torch.Tensor], o_proj: Sequence[torch.Tensor],
                 gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                 qtypes: Sequence[int], num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, eps: float, capture: Sequence[int],
                 seq_starts: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """A Llama-style decoder stack on `quant_pack`ed weights in one call (CPU, float32): per layer
    RMSNorm, the fused q/k/v projection, rotary embedding, the KV cache write, plain attention
    (the sharp kernel with mode "none"), the output projection and residual, RMSNorm, the fused
    gate/up projection, SiLU(gate) * up, the down projection and residual. Each row's result
    depends on that row and the cache only. `sharpdraft.target.fused` builds the per-layer
    arguments from a model.

    Args:
        x: (rows, hidden) float32; cos, sin: (rows, head_dim) float32 rotary tables.
        key_cache, value_cache: per layer (batch, num_kv_heads, capacity, head_dim) float32,
            float16 or bfloat16 (a 16-bit cache: keys and values rounded to nearest even, the
            queries converted to its dtype for the attention), written in place; batch 1, or one
            per row with `seq_starts`.
        start: the position of row 0 (the rows are one sequence's, written from `start`).
        attn_mask: bool, broadcastable to (1, num_heads, rows, start + rows), or None (causal).
        input_norm, post_norm: per layer RMSNorm weights (hidden,).
        qkv, o_proj, gate_up, down: per layer contiguous `quant_pack` weights (q/k/v and gate/up
            side by side), every output width a multiple of `quant_panel_width()`.
        qtypes: 4 a layer (qkv, o_proj, gate_up, down): 0 q4_0, 1 q4_1, 2 q8_0.
        num_heads, num_kv_heads, head_dim, intermediate_size, eps: the model's geometry.
        capture: the hidden states to return besides the output: 0 the input x, i layer i - 1's
            output.
        seq_starts: batched decoding: int64 (rows,), row r is the next token of sequence r
            (batch r of every cache), written at seq_starts[r], seeing keys 0 .. seq_starts[r]
            (excludes attn_mask).

    Returns:
        [the last layer's output (rows, hidden)] + the states asked for in `capture`.

    Raises:
        ValueError naming the argument whose shape, dtype or layout does not fit.
    """
    return ops.llama_layers(x, cos, sin, key_cache, value_cache, start, attn_mask, input_norm,
                            post_norm, qkv, o_proj, gate_up, down, qtypes, num_heads,
                            num_kv_heads, head_dim, intermediate_size, eps, capture, seq_starts)


def eagle3_layer(embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 start: int, attn_mask: Optional[torch.Tensor], input_norm: torch.Tensor,
                 hidden_norm: torch.Tensor, post_norm: torch.Tensor, final_norm: torch.Tensor,
                 qkv: torch.Tensor, o_proj: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, head: Optional[torch.Tensor], qtypes: Sequence[int],
                 head_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, eps: float, mode: str = "none", slope: float = 0.0,
                 slopes: Optional[torch.Tensor] = None, n_ref: int = 1, topk: int = 0,
                 contrast: float = 1.0, beta_min: float = 1.0, beta_max: float = 1.0,
                 window: Optional[int] = None, sinks: int = 0) -> List[torch.Tensor]:
    """The EAGLE-3 drafter's decoder layer and head on `quant_pack`ed weights in one call (CPU,
    float32; the architecture of `sharpdraft.drafters.eagle3`, from the EAGLE-3 paper and its
    public code): in = [RMSNorm(embeds) ; RMSNorm(hidden)], the fused q/k/v projection of that
    2 * hidden input, rotary embedding, the KV cache write, SharpDraft attention (the sharp
    kernel with `mode` and its parameters, as `sharpdraft_ext.sharp_attention` takes them),
    x = hidden + o_proj(attention), x += down(SiLU(gate) * up) of RMSNorm(x), normed =
    RMSNorm(x, final_norm) and logits = normed @ head.T. Each row's result depends on that row
    and the cache only. `sharpdraft.drafters.eagle3_fused` builds the arguments from a drafter.

    Args:
        embeds, hidden: (rows, hidden) float32: the rows' token embeddings and hidden inputs
            (fused target features or the previous draft's output).
        cos, sin: (rows, head_dim) float32 rotary tables of the rows' positions.
        key_cache, value_cache: (1, num_kv_heads, capacity, head_dim) float32, rows written in
            place at start .. start + rows - 1.
        start: the cache position of row 0; the rows attend over keys 0 .. start + rows - 1.
        attn_mask: bool, broadcastable to (1, num_heads, rows, start + rows), True = visible, or
            None (bottom-right causal).
        input_norm, hidden_norm, post_norm, final_norm: RMSNorm weights (hidden,) float32.
        qkv: q/k/v side by side, (num_heads + 2 num_kv_heads) head_dim outputs of 2 hidden
            inputs; o_proj, gate_up (gate and up side by side), down: `quant_pack` weights,
            every output width a multiple of `quant_panel_width()`.
        head: the LM head's rows of the draft vocabulary, (head_size, hidden) packed, or None.
        qtypes: formats of qkv, o_proj, gate_up, down (and head): 0 q4_0, 1 q4_1, 2 q8_0.
        num_heads, num_kv_heads, head_dim, intermediate_size, eps: the layer's geometry.
        mode, slope, slopes, n_ref, topk, contrast, beta_min, beta_max: the attention's
            scaling (spec §1); slopes a per-head float32 (num_heads,) tensor or None.
        window, sinks: a sliding window (None or >= 1): the rows attend over the first
            `sinks` keys and the last window + rows ones only (and attn_mask's matching
            columns), as `sharpdraft.drafters.layers.last_keys` keeps them for the modules.

    Returns:
        [normed (rows, hidden), x (rows, hidden)] and with a head its logits
        (rows, head_size), float32.

    Raises:
        ValueError naming the argument whose shape, dtype or layout does not fit.
    """
    return ops.eagle3_layer(embeds, hidden, cos, sin, key_cache, value_cache, start, attn_mask,
                            input_norm, hidden_norm, post_norm, final_norm, qkv, o_proj,
                            gate_up, down, head, qtypes, head_size, num_heads, num_kv_heads,
                            head_dim, intermediate_size, eps, mode, slope, slopes, n_ref, topk,
                            contrast, beta_min, beta_max, window, sinks)


def pard_layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: Sequence[torch.Tensor], value_cache: Sequence[torch.Tensor],
                start: int, attn_mask: Optional[torch.Tensor],
                input_norm: Sequence[torch.Tensor], post_norm: Sequence[torch.Tensor],
                qkv: Sequence[torch.Tensor], o_proj: Sequence[torch.Tensor],
                gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                qtypes: Sequence[int], num_heads: int, num_kv_heads: int, head_dim: int,
                intermediate_size: int, eps: float, final_norm: torch.Tensor,
                head: torch.Tensor, head_qtype: int, head_size: int, head_from: int,
                mode: str, slope: Sequence[float], slopes: Sequence[Optional[torch.Tensor]],
                n_ref: int = 1, topk: int = 0, contrast: float = 1.0, beta_min: float = 1.0,
                beta_max: float = 1.0) -> torch.Tensor:
    """The PARD drafter's decoder layers, final norm and LM head on `quant_pack`ed weights in one
    call (CPU, float32; the architecture of `sharpdraft.drafters.pard`, after the PARD paper and
    AMD's public checkpoints): `llama_layers`' stack with SharpDraft attention (the sharp kernel
    with `mode` and layer l's slope), then logits = RMSNorm(x, final_norm) @ head.T for rows
    head_from .. rows - 1. Each row's result depends on that row and the cache only.
    `sharpdraft.drafters.pard_fused` builds the arguments from a drafter.

    Args:
        x .. eps: as `llama_layers` (one sequence, batch-1 caches, rows written from `start`,
            attn_mask bool broadcastable to (1, num_heads, rows, start + rows) or None: causal).
        final_norm: RMSNorm weight (hidden,) float32.
        head: the LM head (its draft-vocabulary rows), (head_size, hidden) `quant_pack`ed in
            format `head_qtype` (0 q4_0, 1 q4_1, 2 q8_0).
        head_from: the first row whose logits are returned (0 .. rows).
        mode, n_ref, topk, contrast, beta_min, beta_max: the attention's scaling (spec §1);
            slope: one float a layer; slopes: a layer's per-head float32 (num_heads,) slopes,
            which replace its float, or None.

    Returns:
        (rows - head_from, head_size) float32 logits.

    Raises:
        ValueError naming the argument whose shape, dtype or layout does not fit.
    """
    return ops.pard_layers(x, cos, sin, key_cache, value_cache, start, attn_mask, input_norm,
                           post_norm, qkv, o_proj, gate_up, down, qtypes, num_heads,
                           num_kv_heads, head_dim, intermediate_size, eps, final_norm, head,
                           head_qtype, head_size, head_from, mode, [float(s) for s in slope],
                           list(slopes), n_ref, topk, contrast, beta_min, beta_max)


def dflash_layers(block: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  context: torch.Tensor, context_cos: torch.Tensor, context_sin: torch.Tensor,
                  fc: torch.Tensor, fc_qtype: int, hidden_norm: torch.Tensor,
                  key_cache: Sequence[torch.Tensor], value_cache: Sequence[torch.Tensor],
                  start: int, input_norm: Sequence[torch.Tensor],
                  post_norm: Sequence[torch.Tensor], qkv: Sequence[torch.Tensor],
                  kv: Sequence[torch.Tensor], o_proj: Sequence[torch.Tensor],
                  gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                  qtypes: Sequence[int], q_norm: Sequence[torch.Tensor],
                  k_norm: Sequence[torch.Tensor], num_heads: int, num_kv_heads: int,
                  head_dim: int, intermediate_size: int, eps: float, final_norm: torch.Tensor,
                  head: torch.Tensor, head_qtype: int, head_size: int, head_from: int,
                  mode: str, slope: Sequence[float], slopes: Sequence[Optional[torch.Tensor]],
                  n_ref: int = 1, topk: int = 0, contrast: float = 1.0, beta_min: float = 1.0,
                  beta_max: float = 1.0) -> torch.Tensor:
    """The DFlash drafter's draft step on `quant_pack`ed weights in one call (CPU, float32; the
    architecture of `sharpdraft.drafters.dflash`, after the DFlash paper and z-lab's public
    code): ctx = RMSNorm(context @ fc.T, hidden_norm); per layer the context's keys and values
    (k/v projections of ctx, k norm, rotary at the context positions) written to the cache at
    start .., then the layer over the block rows, whose queries see every cached key and the
    whole block (no causal mask; SharpDraft attention with `mode` and layer l's slope; the
    block's keys written past the context); logits = RMSNorm(x, final_norm) @ head.T of block
    rows head_from ... `sharpdraft.drafters.dflash_fused` builds the arguments from a drafter.

    Args:
        block: (b, hidden) float32 block embeddings; cos, sin: (b, head_dim) their rotary tables.
        context: (Tn, features) float32 new context features (Tn may be 0); context_cos,
            context_sin: (Tn, head_dim) their rotary tables.
        fc: the context projection (hidden, features), `quant_pack`ed in format fc_qtype;
            hidden_norm: its RMSNorm weight (hidden,).
        key_cache, value_cache: per layer (1, num_kv_heads, capacity >= start + Tn + b,
            head_dim) float32, written in place.
        start: the number of context rows the cache holds.
        input_norm, post_norm, qkv, o_proj, gate_up, down, qtypes: as `llama_layers`; kv: per
            layer the k and v projections side by side (the context's), in qkv's format.
        q_norm, k_norm: per layer per-head RMSNorm weights (head_dim,), or both empty.
        num_heads .. eps: the layers' geometry. final_norm, head, head_qtype, head_size,
            head_from, mode, slope, slopes, n_ref .. beta_max: as `pard_layers`.

    Returns:
        (b - head_from, head_size) float32 logits.

    Raises:
        ValueError naming the argument whose shape, dtype or layout does not fit.
    """
    return ops.dflash_layers(block, cos, sin, context, context_cos, context_sin, fc, fc_qtype,
                             hidden_norm, key_cache, value_cache, start, input_norm, post_norm,
                             qkv, kv, o_proj, gate_up, down, qtypes, list(q_norm), list(k_norm),
                             num_heads, num_kv_heads, head_dim, intermediate_size, eps,
                             final_norm, head, head_qtype, head_size, head_from, mode,
                             [float(s) for s in slope], list(slopes), n_ref, topk, contrast,
                             beta_min, beta_max)
