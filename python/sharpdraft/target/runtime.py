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
  one of `F.linear`, oneDNN's prepacked weight and our panel kernel
  (`sharpdraft_ext.cpu_runtime.packed_linear`, float32, up to PANEL_MAX_ROWS rows), as the runtime's
  `RuntimePlan` says (`plan`: by default a rule of the CPU's features and the shapes derived
  from benchmarks/results/linear-cpu*, no timing; "measure" times each shape here,
  `plan_linears`; SHARPDRAFT_LINEAR_PATHS restricts the choice). Autograd, other devices and
  other dtypes take `F.linear`.

All of it happens on the runtime's own copy of the module tree (`shared_copy`: the model's
parameters, buffers and tensor attributes, its own modules and config): the caller's model is
left exactly as it was, and `TargetRuntime.prepare` is the one way in.

The numbers differ from the Hugging Face forward only by float rounding (tests hold the runtime
to the spec §6 tolerance against the model's own forward with SDPA and a DynamicCache).
"""
from __future__ import annotations

import copy
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence

import torch
from sharpdraft_ext import cpu_runtime
from torch import nn

from ..attention import SharpConfig, register, set_sharp_config
from .kv_cache import CACHE_KWARG, PreallocatedCache
from .fused import FusedLayers, fused_layers
from .linears import QUANT_PATH, linear_paths, pack_linears, plan_linears
from .logits import RowLogits
from .plan import KV_DTYPES, PlanSpec, RuntimePlan, resolve_plan
from .quantized import QUANT_MAX_ROWS


@dataclass
class StepOutput:
    """row_logits: the `RowLogits` of the rows asked for (the fused path runs the LM head on a
    row when it is first read; `logits` is every row, (rows, vocab) float32). hidden:
    {hidden-state index: (1, L, hidden)}, index i as in transformers' output_hidden_states
    (0 = embeddings, i = output of decoder layer i - 1, num_layers = after the final norm)."""

    row_logits: RowLogits
    hidden: Dict[int, torch.Tensor]

    @property
    def logits(self) -> torch.Tensor:
        return self.row_logits.all()


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


def prepare_drafter(drafter: nn.Module, *, quantised: bool = False,
                    target: Optional[nn.Module] = None) -> nn.Module:
    """Prepack a drafter's own CPU linear layers by the same measured rule as the target's
    (`plan_linears`), once per setting; parameters and state_dict are untouched, and a packed
    weight is repacked when training changes it (training itself runs F.linear). With `target`,
    also the drafter's own preparation for it (its `prepare_for_target(target, quantised)` hook
    where it has one: the draft head's packed rows, a fused CPU draft step), so that nothing is
    measured or packed inside a timed draft.

    Args:
        quantised: let the plan also weigh `QUANT_PATH` (the weight re-quantised to Q8_0, int8
            activations) where it measures faster, and let the drafter's hook build a fused
            step on Q8_0 blocks; for a target that runs on quantised blocks itself, whose
            drafts then cost what its own steps cost. The drafts may change slightly (8-bit
            weights); what is committed does not (the target verifies).
        target: the model the drafter will draft for (the runtime's prepared copy), or None.
    """
    done = getattr(drafter, "_sharpdraft_packed", None)
    if done is True:                 # a drafter that opts out (weights that train online)
        return drafter
    paths = linear_paths() + ((QUANT_PATH,) if quantised else ())
    if done != paths:
        pack_linears(drafter, plan_linears(drafter, paths=paths))
        drafter._sharpdraft_packed = paths
    hook = getattr(drafter, "prepare_for_target", None)
    if target is not None and hook is not None:
        hook(target, quantised)
    return drafter


BUSY = ("TargetRuntime: in use by another generation; prepare one runtime per thread "
        "(TargetRuntime.prepare)")


def _tensors_in(value, add, depth: int = 3) -> None:
    """Pass every tensor in `value` (itself, or inside dicts, lists, tuples and sets, `depth`
    levels down) to `add`."""
    if isinstance(value, torch.Tensor):
        add(value)
    elif depth > 0 and isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, add, depth - 1)
    elif depth > 0 and isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _tensors_in(v, add, depth - 1)


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of `model`'s module tree (modules, configs, hooks) that shares every parameter,
    buffer and tensor attribute of its modules (a QuantLinear's `packed`, a rotary embedding's
    tables) with `model`: `copy.deepcopy` with a memo that maps each of them to itself. Nothing
    large is copied, tied weights stay tied, and in-place updates of the model's tensors
    (`load_state_dict`, an optimizer step, `model.to(dtype)` on a parameter) reach the copy;
    replacing a module, a parameter or a buffer of `model` afterwards does not.

    Raises:
        RuntimeError: the copy does not share the model's parameters (a module whose own
            `__deepcopy__` copies them).
    """
    memo: Dict[int, object] = {}

    def add(t):
        memo[id(t)] = t

    for mod in model.modules():
        for name, value in vars(mod).items():
            if name != "_modules":
                _tensors_in(value, add)
    twin = copy.deepcopy(model, memo)
    if any(a is not b for a, b in zip(model.parameters(), twin.parameters())):
        raise RuntimeError(f"TargetRuntime.prepare: copying {type(model).__name__} did not "
                           f"share its parameters")
    return twin


class TargetRuntime:
    """Runs a causal LM for the decoding loops over a `PreallocatedCache`, on its own prepared
    copy of the model's module tree (`model`), leaving the caller's model exactly as it was.

    Make one with `TargetRuntime.prepare(model, plan)` (the constructor takes the same
    arguments). Usage: `start(capacity)`, then `forward(ids, ...)` for the prefill and every
    step; `length` is the committed cache length; `crop(length)` and `keep(start, rows)` roll
    back; `finish()` ends the session (or `with runtime.session(capacity): ...`).

    One session at a time: the KV cache is the runtime's. A session belongs to the thread
    that started it until `finish()` (or until that thread ends); `start` or `session` from
    another thread meanwhile, and `session` on a runtime whose session is open, raise
    RuntimeError(BUSY). Prepare one runtime per thread (the decoding loops do so for a bare
    model, see `sharpdraft.inference.engine.runtime_session`).

    Attributes:
        model: the prepared copy (sharp attention, mode "none"; `PackedLinear`s per the plan).
        plan: the `RuntimePlan` it was prepared with (an empty `linears` with pack=False).
        fused: the `llama_layers` arguments (`fused.FusedLayers`) or None.
        info: {"linear_plan": {"<out>x<in> <dtype>": [paths]}, "packed_linears": count,
            "fused_layers": bool}, what reports print.
        hidden_layers: the hidden-state indices every forward returns (this session's).
    """

    def __init__(self, model: nn.Module, plan: PlanSpec = "auto", *,
                 hidden_layers: Iterable[int] = (), pack: bool = True):
        self.num_layers = len(_decoder(model).layers)
        self._hidden = list(hidden_state_modules(model, hidden_layers))    # checked first
        plan = resolve_plan(plan, model, measure=pack)                     # a bad file too
        if not pack:
            plan = RuntimePlan({}, plan.fused, plan.source, plan.kv_dtype)
        twin = shared_copy(model)
        register()
        if twin.config._attn_implementation != "sharp":
            twin.set_attn_implementation("sharp")
        set_sharp_config(twin, SharpConfig(mode="none"))
        self._packed = pack_linears(twin, plan.linears) if plan.linears else 0
        self.fused: Optional[FusedLayers] = fused_layers(twin) if plan.fused else None
        self.model, self.plan = twin, plan
        self.hidden_layers = list(self._hidden)
        self.cache: Optional[PreallocatedCache] = None
        self._owner: Optional[threading.Thread] = None
        self._owner_lock = threading.Lock()

    @classmethod
    def prepare(cls, model: nn.Module, plan: PlanSpec = "auto", *,
                hidden_layers: Iterable[int] = (), pack: bool = True) -> "TargetRuntime":
        """A runtime for `model` (a transformers causal LM with a standard decoder: CPU or CUDA,
        dense or on `QuantLinear` blocks), which is left exactly as it was: no attribute added,
        no module replaced, its config (attention implementation included) and its tensors
        unchanged.

        The runtime works on `shared_copy(model)`: the same parameters, buffers and tensor
        attributes, its own modules and config. There the attention runs the sharp kernel with
        mode "none", CPU `nn.Linear`s become `PackedLinear`s by the plan's paths (pack=True;
        their prepacked weights are the runtime's, as the in-place preparation's were), and a
        Llama on quantised blocks gets the fused `llama_layers` decoder (`fused`). Memory: the
        fused q/k/v and gate/up packs are the runtime's own copies (the model's packs stay
        as they were), so while the model lives the runtime holds those five projections'
        blocks a second time: 30 x 4032 x 576 Q4_1 weights, 44 MB, for SmolLM2-135M on its
        GGUF; each further runtime (one per thread) adds its packs again.

        Args:
            model: the causal LM.
            plan: "auto" (`plan.auto_plan`, a rule of the CPU's features and the weight
                shapes, no timing), "measure" (`plan.measured_plan`, each shape timed here), a
                plan file's path (`RuntimePlan.load`) or a `RuntimePlan`.
            hidden_layers: hidden-state indices (as in output_hidden_states: 0 = embeddings,
                i = decoder layer i - 1's output, num_layers = after the final norm) every
                forward returns by default; empty for none.
            pack: prepack CPU linears by the plan (False: F.linear everywhere, nothing timed).

        Raises:
            ValueError: a hidden-layer index outside [0, num_layers]; a plan file that cannot
                be read or holds a bad plan (naming the file and the field), both before any
                work.
            TypeError: a plan that is none of the above.
        """
        return cls(model, plan, hidden_layers=hidden_layers, pack=pack)

    @property
    def info(self) -> dict:
        return {"linear_plan": self.plan.info(), "packed_linears": self._packed,
                "fused_layers": self.fused is not None, "kv_dtype": self.plan.kv_dtype}

    @property
    def length(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    @property
    def busy(self) -> bool:
        """Whether a session is open (started by a thread that is still running)."""
        owner = self._owner
        return owner is not None and owner.is_alive()

    def start(self, capacity: int, *, hidden_layers: Optional[Iterable[int]] = None) -> None:
        """Open a session with a fresh cache of `capacity` positions (the thread that holds the
        session may start again: its old session ends).

        Args:
            hidden_layers: hidden-state indices the forwards of this session return (default:
                the runtime's own, `prepare`'s hidden_layers).

        Raises:
            RuntimeError(BUSY): another thread's session is open.
            ValueError: a hidden-layer index outside [0, num_layers].
        """
        hidden = (list(self._hidden) if hidden_layers is None
                  else list(hidden_state_modules(self.model, hidden_layers)))
        me = threading.current_thread()
        with self._owner_lock:
            if self._owner is not me and self.busy:
                raise RuntimeError(BUSY)
            self._owner = me
        self.hidden_layers = hidden
        kv = self.plan.kv_dtype
        self.cache = PreallocatedCache(self.num_layers, capacity, kv and KV_DTYPES[kv])

    def finish(self) -> None:
        """End the session: drop the cache and free the runtime for any thread. Does nothing
        when no session is open.

        Raises:
            RuntimeError: another thread's session is open.
        """
        with self._owner_lock:
            if self._owner is None:
                return
            if self._owner is not threading.current_thread() and self.busy:
                raise RuntimeError("TargetRuntime.finish: the session belongs to another thread")
            self.cache, self.hidden_layers = None, list(self._hidden)
            self._owner = None

    @contextmanager
    def session(self, capacity: int, *, hidden_layers: Optional[Iterable[int]] = None):
        """`start(capacity, hidden_layers=...)` for the block, `finish()` after it (exceptions
        included); yields the runtime.

        Raises:
            RuntimeError(BUSY): a session is open (any thread's, this one's included).
            ValueError: as `start`.
        """
        with self._owner_lock:
            if self.busy:
                raise RuntimeError(BUSY)
            self._owner = threading.current_thread()
        try:
            self.start(capacity, hidden_layers=hidden_layers)
            yield self
        finally:
            self.finish()

    def _check_session(self, what: str) -> None:
        if self._owner is not threading.current_thread():
            if self.busy:
                raise RuntimeError(BUSY)
            raise RuntimeError(f"TargetRuntime.{what}: call start(capacity) first")
        if self.cache is None:
            raise RuntimeError(f"TargetRuntime.{what}: call start(capacity) first")

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
        self._check_session("forward")
        if self.fused is not None and ids.shape[0] == 1 and ids.shape[1] <= QUANT_MAX_ROWS:
            return self._fused_forward(ids, position_ids, attention_mask, last_only)
        with captured_hidden_states(self.model, self.hidden_layers) as hidden:
            out = self.model(input_ids=ids, position_ids=position_ids,
                             attention_mask=attention_mask, **{CACHE_KWARG: self.cache},
                             use_cache=True,
                             logits_to_keep=1 if last_only else 0)
        return StepOutput(RowLogits.computed(out.logits[0].float()), dict(hidden))

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
        return StepOutput(RowLogits(normed[-1:] if last_only else normed,
                                    self.model.get_output_embeddings()), hidden)

    def crop(self, length: int) -> None:
        """Drop the cache rows past `length`."""
        self._check_session("crop")
        self.cache.crop_to(length)

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Keep rows [0, start) and then start + rows, in that order (a tree's accepted
        path)."""
        self._check_session("keep")
        self.cache.keep(start, rows)
