"""What the drafters' fused CPU steps share (`eagle3_fused`, `pard_fused`): the Q8_0 packing of
their weights, the draft head's blocks, the key that tells when those blocks are stale, the
checks that decide whether a drafter and a call can run fused, the attention's scaling as the
ops take it and the cache rows a call writes.

A fused step runs a drafter's layers and head in one op of the CPU runtime
(`sharpdraft_ext.cpu_runtime`) on its weights re-quantised to GGUF Q8_0 (int8 activations, as
the target's own blocks run); its drafts are the bits of the drafter's modules run on the same
blocks (`target.linears.QUANT_PATH`), and what is committed never depends on them (the target
verifies every draft).
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch
from sharpdraft_ext import cpu_runtime

from .. import attention, settings
from ..target.kv_cache import PreallocatedCache
from ..target.linears import QUANT_PATH, pack_weight
from ..target.quantized import QUANT_MAX_ROWS, QuantLinear

QTYPE_IDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2}       # cpu::QuantType
Q8_0 = QTYPE_IDS[QUANT_PATH]


def q8(*weights: torch.Tensor) -> torch.Tensor:
    """The weights stacked along their output rows as one Q8_0 `quant_pack` tensor."""
    return pack_weight(torch.cat([w.detach() for w in weights]).float(), QUANT_PATH)


def _version(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t._version, t.dtype, tuple(t.shape))


def weights_key(drafter, target) -> tuple:
    """What the packed blocks were made from: every parameter and buffer of the drafter (d2t,
    an own LM head) and the target's LM head weight (data pointer, in-place version, dtype,
    shape)."""
    return (tuple(_version(t) for t in drafter.parameters())
            + tuple(_version(t) for t in drafter.buffers())
            + (_version(target.get_output_embeddings().weight),))


class Head:
    """A draft head as the ops take it: `packed` blocks, their format id `qtype` and `size`
    rows. The target's own quantised LM head (a `QuantLinear` without bias) is borrowed as it is
    (no copy, the modules' bits) where the drafter drafts over all of its rows; any other head
    is re-quantised to Q8_0."""

    def __init__(self, drafter, target, weight: torch.Tensor):
        lm_head = target.get_output_embeddings()
        own = isinstance(lm_head, QuantLinear) and lm_head.bias is None
        if own and drafter.d2t is None and weight is lm_head.weight:
            self.packed, self.qtype = lm_head.packed, QTYPE_IDS[lm_head.qtype]
        else:
            self.packed, self.qtype = q8(weight), Q8_0
        self.size = weight.shape[0]


def problems(drafter, target, head: torch.Tensor, widths: dict, inputs: dict,
             act: str) -> List[str]:
    """Why `drafter` cannot draft through a fused step with `target` (empty: it can): the
    setting, the activation `act` (the config's hidden_act), the parameters' dtype and device,
    the head (`head`: the weight the drafter's `head` applies) and the block geometry: every
    output width in `widths` ({name: n}) a multiple of the packed panel width, every input size
    in `inputs` of the GGUF block."""
    out = []
    if not settings.get("SHARPDRAFT_FUSED_DRAFTERS"):
        out.append("SHARPDRAFT_FUSED_DRAFTERS=0")
    if act != "silu":
        out.append(f"hidden_act {act!r} (the op runs SiLU)")
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in drafter.parameters()):
        out.append("parameters not float32 on the CPU")
    if head.device.type != "cpu" or getattr(target.get_output_embeddings(), "bias", None) is not None:
        out.append("an LM head with a bias or off the CPU")
    width = cpu_runtime.quant_panel_width()
    for name, n in {**widths, "head": head.shape[0]}.items():
        if n % width:
            out.append(f"{name} width {n} not a multiple of the packed panel width {width}")
    for name, k in inputs.items():
        if k % 32:
            out.append(f"{name} size {k} not a multiple of 32 (the GGUF block)")
    return out


def covers(drafter, embeds: torch.Tensor, cache, windowed: bool = False) -> bool:
    """Whether a call with these rows and cache can run fused (else through the modules): a
    `PreallocatedCache`, no context window (unless the op takes one, `windowed`), no autograd,
    no `attention.observe` callback, float32 CPU rows of one sequence, at most QUANT_MAX_ROWS of
    them (a long prompt's rows run faster through the modules' float GEMMs)."""
    return (isinstance(cache, PreallocatedCache)
            and (windowed or drafter.context_window is None)
            and not torch.is_grad_enabled() and not attention.observed()
            and embeds.device.type == "cpu" and embeds.dtype == torch.float32
            and embeds.shape[0] == 1 and embeds.shape[1] <= QUANT_MAX_ROWS)


def scaling(sharp, layer: int) -> Tuple[str, float, Optional[torch.Tensor], dict]:
    """Layer `layer`'s attention scaling as the ops take it: (mode, slope, per-head slopes or
    None, the keywords n_ref, topk, contrast, beta_min, beta_max)."""
    kw = sharp.kernel_kwargs(layer)
    slope = kw["slope"]
    slopes = slope if isinstance(slope, torch.Tensor) else None
    rest = {"n_ref": int(kw["n_ref"]), "topk": int(kw["topk"]),
            "contrast": float(kw["contrast"]), "beta_min": float(kw["beta_min"]),
            "beta_max": float(kw["beta_max"])}
    return kw["mode"], 0.0 if slopes is not None else float(slope), slopes, rest


def claim_rows(layers: Iterable, rows: int, like: torch.Tensor, num_kv_heads: int,
               head_dim: int) -> int:
    """Ready the cache layers (`PreallocatedLayer`) for `rows` new rows: their buffers made
    (float32, one sequence) and room checked. Returns the position of the first new row.

    Raises:
        RuntimeError: the rows exceed the cache's capacity.
    """
    start = None
    for layer in layers:
        if not layer.is_initialized:
            empty = like.new_empty((1, num_kv_heads, 0, head_dim))
            layer.lazy_initialization(empty, empty)
        start = layer.length if start is None else start
        if start + rows > layer.capacity:
            raise RuntimeError(f"PreallocatedCache: {start + rows} positions exceed its capacity "
                               f"{layer.capacity}; start the runtime with a larger capacity")
    return start


def pack_layers(layers, context_kv: bool = False) -> dict:
    """Llama-style decoder layers' weights as the stack ops take them, {name: one entry a layer}:
    input_norm, post_norm, qkv (q/k/v side by side, Q8_0), with `context_kv` kv (k and v side by
    side, DFlash's context keys), o_proj, gate_up (side by side), down."""
    names = ("input_norm", "post_norm", "qkv") + (("kv",) if context_kv else ()) + (
        "o_proj", "gate_up", "down")
    stack = {name: [] for name in names}
    for layer in layers:
        att, mlp = layer.self_attn, layer.mlp
        stack["input_norm"].append(layer.input_layernorm.weight.detach().contiguous())
        stack["post_norm"].append(layer.post_attention_layernorm.weight.detach().contiguous())
        stack["qkv"].append(q8(att.q_proj.weight, att.k_proj.weight, att.v_proj.weight))
        if context_kv:
            stack["kv"].append(q8(att.k_proj.weight, att.v_proj.weight))
        stack["o_proj"].append(q8(att.o_proj.weight))
        stack["gate_up"].append(q8(mlp.gate_proj.weight, mlp.up_proj.weight))
        stack["down"].append(q8(mlp.down_proj.weight))
    return stack


def layer_scalings(sharp, layers: int) -> tuple:
    """The drafter ops' per-layer scaling arguments: (mode, [slope a layer], [per-head slopes or
    None a layer], the shared keywords), from `scaling`."""
    floats, slopes, mode, kw = [], [], "none", {}
    for i in range(layers):
        mode, slope, per_head, kw = scaling(sharp, i)
        floats.append(slope)
        slopes.append(per_head)
    return mode, floats, slopes, kw


class FusedStep:
    """What the fused steps share: `build` (None where the module's `problems` names a reason,
    an unchanged step reused), `fresh` and `covers`. A subclass sets `name` (the op), `problems`
    (drafter, target, head weight) -> [reasons] and builds itself from (drafter, target, head
    weight), setting `key = weights_key(drafter, target)`."""

    name = ""
    key: tuple = ()
    windowed = False        # the op takes the drafter's context window and sinks

    @staticmethod
    def problems(drafter, target, head: Optional[torch.Tensor] = None) -> List[str]:
        raise NotImplementedError

    @classmethod
    def build(cls, drafter, target, reuse: Optional["FusedStep"] = None):
        """The step for `drafter` and `target`: None where `problems` names a reason, else
        `reuse` while its weights are unchanged, else a new one (the draft head's rows are
        gathered once, and not at all for a step reused)."""
        if not settings.get("SHARPDRAFT_FUSED_DRAFTERS"):
            return None
        if reuse is not None and reuse.fresh(drafter, target):
            return reuse
        head = drafter.draft_head_weight(target)
        return None if cls.problems(drafter, target, head) else cls(drafter, target, head)

    def fresh(self, drafter, target) -> bool:
        """Whether the weights the step was made from are unchanged."""
        return self.key == weights_key(drafter, target)

    def covers(self, drafter, embeds: torch.Tensor, cache) -> bool:
        """Whether a call with these rows and cache runs fused (`covers`)."""
        return covers(drafter, embeds, cache, self.windowed)


def commit_rows(layers: Iterable, end: int) -> None:
    """Set the cache layers' length to `end` after an op wrote their rows in place."""
    for layer in layers:
        layer.length = end
        layer._views()
