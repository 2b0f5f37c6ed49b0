"""The target runtime: one Hugging Face causal LM run at its hardware floor for speculative decoding.

The autoregressive baseline, the chain loop and the tree loop all run the target through a
`TargetRuntime`, which keeps the Hugging Face modules (any causal LM with a standard decoder) and
changes only what costs time without changing the maths:

- KV cache: `PreallocatedCache`, one buffer per layer sized for the whole generation (prompt +
  new tokens + the largest draft). A forward writes its rows in place and the attention reads a
  view of the first `length` rows; cropping moves the length; a tree's accepted path is an
  in-place gather. No per-step concatenation.
- Attention: `sharpdraft_ext.sharp_attention` with mode "none" (the target's own attention is
  never scaled), GQA read natively. A chain verification or a decode step is bottom-right causal
  with no mask tensor (the "sharp" mask function returns None where the mask would be plain
  causal); a tree verification passes its boolean mask.
- Logits only where they are used (the last row at prefill), and hidden states only of the
  target layers the drafter reads (forward hooks, no 31-layer tuple).
- Linear layers: `PackedLinear`, which keeps each `nn.Linear`'s parameters and adds the
  prepacked weights its paths need; for each weight shape and for one row (decode), a few
  (verification) or a few dozen (a wide draft tree's verification; `ROW_REGIMES`) it runs
  whichever of `F.linear`, oneDNN's prepacked weight and our panel kernel
  (`sharpdraft_ext.cpu_runtime.packed_linear`, float32, up to PANEL_MAX_ROWS rows) is fastest,
  as measured on this machine when the runtime is set up (`plan_linears`;
  SHARPDRAFT_LINEAR_PATHS restricts the choice). Autograd, other devices and other dtypes take
  `F.linear`.

The numbers differ from the Hugging Face forward only by float rounding (tests hold the runtime
to the spec §6 tolerance against the model's own forward with SDPA and a DynamicCache).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence

import torch
from sharpdraft_ext import cpu_runtime
from torch import nn

from ..attention import SharpConfig, register, set_sharp_config
from .kv_cache import CACHE_KWARG, PreallocatedCache
from .fused import fused_layers
from .linears import QUANT_PATH, linear_paths, pack_linears, plan_linears
from .quantized import QUANT_MAX_ROWS


@dataclass
class StepOutput:
    """logits: (rows, vocab) float32 of the rows asked for. hidden: {hidden-state index: (1, L,
    hidden)}, index i as in transformers' output_hidden_states (0 = embeddings, i = output of
    decoder layer i - 1, num_layers = after the final norm)."""

    logits: torch.Tensor
    hidden: Dict[int, torch.Tensor]


def _decoder(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def hidden_state_modules(model: nn.Module, indices: Iterable[int]) -> Dict[int, nn.Module]:
    """{index: the module whose output is hidden state `index`} (transformers'
    output_hidden_states numbering, see `captured_hidden_states`).

    Raises:
        ValueError: an index outside [0, num_layers].
    """
    decoder = _decoder(model)
    layers = len(decoder.layers)
    modules = {}
    for i in sorted(set(int(i) for i in indices)):
        if not 0 <= i <= layers:
            raise ValueError(f"hidden_layers: index {i} outside [0, {layers}]")
        modules[i] = (decoder.embed_tokens if i == 0 else decoder.norm if i == layers
                      else decoder.layers[i - 1])
    return modules


@contextmanager
def captured_hidden_states(model: nn.Module, indices: Iterable[int]):
    """Within the block, every forward of `model` stores the hidden states of `indices`
    (numbered as transformers' output_hidden_states: 0 = embeddings, i = decoder layer i - 1's
    output, num_layers = after the final norm) in the yielded dict, replacing older entries;
    nothing else is kept (output_hidden_states would hold every layer).

    Raises:
        ValueError: an index outside [0, num_layers].
    """
    captured: Dict[int, torch.Tensor] = {}
    handles = []

    def grab(i):
        def hook(module, args, output):
            captured[i] = output[0] if isinstance(output, tuple) else output
        return hook

    for i, module in hidden_state_modules(model, indices).items():
        handles.append(module.register_forward_hook(grab(i)))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def prepare_target(model: nn.Module, *, pack: bool = True) -> nn.Module:
    """Set a Hugging Face causal LM up for the runtime, once (idempotent): its attention runs
    through the sharp kernel with mode "none", and (pack=True, CPU) its linear layers are
    prepacked by the measured rule of `plan_linears`. The model's outputs are unchanged up to
    float rounding; its parameters and state_dict keys are untouched."""
    state = getattr(model, "_sharpdraft_runtime", None)
    if state is not None:
        return model
    register()
    if model.config._attn_implementation != "sharp":
        model.set_attn_implementation("sharp")
    set_sharp_config(model, SharpConfig(mode="none"))
    plan = plan_linears(model) if pack else {}
    packed = pack_linears(model, plan) if plan else 0
    model._sharpdraft_runtime = {"linear_plan": {f"{o}x{i} {str(d)[6:]}": list(p)
                                                 for (o, i, d), p in plan.items()},
                                 "packed_linears": packed}
    return model


def prepare_drafter(drafter: nn.Module, *, quantised: bool = False) -> nn.Module:
    """Prepack a drafter's own CPU linear layers by the same measured rule as the target's
    (`plan_linears`), once per setting; parameters and state_dict are untouched, and a packed
    weight is repacked when training changes it (training itself runs F.linear).

    Args:
        quantised: let the plan also weigh `QUANT_PATH` (the weight re-quantised to Q8_0, int8
            activations) where it measures faster; for a target that runs on quantised blocks
            itself, whose drafts then cost what its own steps cost. The drafts may change
            slightly (8-bit weights); what is committed does not (the target verifies).
    """
    done = getattr(drafter, "_sharpdraft_packed", None)
    if done is True:                 # a drafter that opts out (weights that train online)
        return drafter
    paths = linear_paths() + ((QUANT_PATH,) if quantised else ())
    if done != paths:
        pack_linears(drafter, plan_linears(drafter, paths=paths))
        drafter._sharpdraft_packed = paths
    return drafter


class TargetRuntime:
    """Runs a prepared target over a `PreallocatedCache`.

    Args:
        model: a transformers causal LM (prepared on first use, see `prepare_target`).
        hidden_layers: hidden-state indices (as in output_hidden_states) to return with every
            forward; empty for none.
        pack: prepack linear layers (CPU) when preparing.

    Usage: `start(capacity)`, then `forward(ids, ...)` for the prefill and every step; `length`
    is the committed cache length; `crop(length)` and `keep(start, rows)` roll back.
    """

    def __init__(self, model: nn.Module, hidden_layers: Iterable[int] = (), pack: bool = True):
        self.num_layers = len(_decoder(model).layers)
        self.hidden_layers = list(hidden_state_modules(model, hidden_layers))  # checked first
        self.model = prepare_target(model, pack=pack)
        state = self.model._sharpdraft_runtime
        if "fused" not in state:          # once per model (its packs become views of the fused)
            state["fused"] = fused_layers(self.model)
            state["fused_layers"] = state["fused"] is not None
        self.fused = state["fused"]
        self.cache: Optional[PreallocatedCache] = None

    @property
    def info(self) -> dict:
        return {k: v for k, v in self.model._sharpdraft_runtime.items() if k != "fused"}

    @property
    def length(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def start(self, capacity: int) -> None:
        """A fresh cache of `capacity` positions."""
        self.cache = PreallocatedCache(self.num_layers, capacity)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, *, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                last_only: bool = False) -> StepOutput:
        """One target forward over `ids` (1, n) on top of the cache.

        Args:
            ids: (1, n) int64 token ids.
            position_ids: (1, n) positions (default: length .. length + n - 1).
            attention_mask: (1, 1, n, length + n) bool (True = visible), e.g. a tree mask;
                default plain causal.
            last_only: logits of the last row only (prefill).
        """
        if self.cache is None:
            raise RuntimeError("TargetRuntime.forward: call start(capacity) first")
        if self.fused is not None and ids.shape[0] == 1 and ids.shape[1] <= QUANT_MAX_ROWS:
            return self._fused_forward(ids, position_ids, attention_mask, last_only)
        with captured_hidden_states(self.model, self.hidden_layers) as hidden:
            out = self.model(input_ids=ids, position_ids=position_ids,
                             attention_mask=attention_mask, **{CACHE_KWARG: self.cache},
                             use_cache=True,
                             logits_to_keep=1 if last_only else 0)
        return StepOutput(out.logits[0].float(), dict(hidden))

    def _fused_forward(self, ids, position_ids, attention_mask, last_only) -> StepOutput:
        """`forward` through one `llama_layers` call (see `fused`): the same maths as the
        modules, each row computed alone."""
        f, decoder = self.fused, _decoder(self.model)
        start, n = self.length, ids.shape[1]
        if start + n > self.cache.capacity:
            raise RuntimeError(f"PreallocatedCache: {start + n} positions exceed its capacity "
                               f"{self.cache.capacity}; start the runtime with a larger capacity")
        if position_ids is None:
            position_ids = torch.arange(start, start + n).unsqueeze(0)
        x = decoder.embed_tokens(ids)
        cos, sin = decoder.rotary_emb(x, position_ids)
        layers = self.cache.layers
        if not layers[0].is_initialized:
            empty = x.new_empty((1, f.num_kv_heads, 0, f.head_dim))
            for layer in layers:
                layer.lazy_initialization(empty, empty)
        capture = [i for i in self.hidden_layers if i < self.num_layers]
        mask = None if attention_mask is None else attention_mask.to(torch.bool)
        outs = cpu_runtime.llama_layers(
            x[0], cos[0].float().contiguous(), sin[0].float().contiguous(),
            [layer.key_buffer for layer in layers], [layer.value_buffer for layer in layers],
            start, mask, f.input_norm, f.post_norm, f.qkv, f.o_proj, f.gate_up, f.down,
            f.qtypes, f.num_heads, f.num_kv_heads, f.head_dim, f.intermediate_size, f.eps,
            capture)
        for layer in layers:
            layer.length = start + n
            layer._views()
        normed = decoder.norm(outs[0])
        hidden = {i: h.unsqueeze(0) for i, h in zip(capture, outs[1:])}
        if self.num_layers in self.hidden_layers:
            hidden[self.num_layers] = normed.unsqueeze(0)
        logits = self.model.get_output_embeddings()(normed[-1:] if last_only else normed)
        return StepOutput(logits.float(), hidden)

    def crop(self, length: int) -> None:
        self.cache.crop_to(length)

    def keep(self, start: int, rows: Sequence[int]) -> None:
        self.cache.keep(start, rows)
