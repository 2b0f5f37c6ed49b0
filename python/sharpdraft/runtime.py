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
  (`sharpdraft_ext.packed_linear`, float32, up to PANEL_MAX_ROWS rows) is fastest, as
  measured on this machine when the runtime is set up (`plan_linears`;
  SHARPDRAFT_LINEAR_PATHS restricts the choice). Autograd, other devices and other dtypes take
  `F.linear`.

The numbers differ from the Hugging Face forward only by float rounding (tests hold the runtime
to the SPEC section 6 tolerance against the model's own forward with SDPA and a DynamicCache).
"""
from __future__ import annotations

import bisect
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence

import sharpdraft_ext as ext
import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import SharpConfig, register, set_sharp_config


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------
class PreallocatedLayer(CacheLayerMixin):
    """One layer's keys and values in buffers of `capacity` rows, (B, Hk, capacity, D).

    `keys` / `values` are views of the first `length` rows (strided: the kernel reads any
    strides with a unit last stride).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = int(capacity)
        self.length = 0
        self.key_buffer: Optional[torch.Tensor] = None
        self.value_buffer: Optional[torch.Tensor] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.key_buffer = key_states.new_empty((b, h, self.capacity, d))
        self.value_buffer = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
        self.device = key_states.device
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self.key_buffer[:, :, :self.length]
        self.values = self.value_buffer[:, :, :self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"PreallocatedCache: {end} positions exceed its capacity "
                               f"{self.capacity}; start the runtime with a larger capacity")
        self.key_buffer[:, :, self.length:end].copy_(key_states)
        self.value_buffer[:, :, self.length:end].copy_(value_states)
        self.length = end
        self._views()
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        """HF convention: a negative count removes that many trailing rows."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of rows to remove")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self._views()

    def keep(self, start: int, rows: torch.Tensor) -> None:
        """Keep rows [0, start) and then start + rows (in that order); the length becomes
        start + len(rows)."""
        if self.is_initialized:
            src = start + rows
            n = rows.numel()
            for buf in (self.key_buffer, self.value_buffer):
                buf[:, :, start:start + n].copy_(buf.index_select(2, src))
        self.length = start + rows.numel()
        if self.is_initialized:
            self._views()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._views()


class PreallocatedCache(Cache):
    """A transformers Cache of `PreallocatedLayer`s (one per decoder layer)."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])
        self.capacity = int(capacity)

    def crop_to(self, length: int) -> None:
        """Drop every row past the first `length`."""
        for layer in self.layers:
            layer.crop(min(0, length - layer.length))

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Keep rows [0, start) and then start + rows of every layer (a tree's accepted path)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        for layer in self.layers:
            layer.keep(start, idx.to(layer.device) if layer.is_initialized else idx)


# ---------------------------------------------------------------------------------------------
# Linear layers
# ---------------------------------------------------------------------------------------------
_PACK_ROWS = 16          # oneDNN picks its blocking for this many rows (verification sizes)


def _packable(weight: torch.Tensor) -> bool:
    """oneDNN packs float32 weights on any x86 CPU, bfloat16 only where it has a native path."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def _packed_linear(x2d, packed, bias):
    return torch.ops.mkldnn._linear_pointwise(x2d, packed, bias, "none", [], "")


# The ways a CPU linear layer can run: "dense" (F.linear), "onednn" (oneDNN's prepacked weight)
# and "panel" (sharpdraft_ext.packed_linear: our few-row kernel, float32).
LINEAR_PATHS = ("dense", "onednn", "panel")
# The row counts a plan tells apart: one row (a decode step), 2 .. 32 (a chain, block or small
# tree verification) and 33 .. 96 (a wide tree's), each measured at one representative count.
ROW_REGIMES = ((1, 1), (32, 8), (96, 64))          # (largest row count, rows measured at)
_REGIME_TOPS = tuple(top for top, _ in ROW_REGIMES)
# The panel kernel re-reads x for every panel: past this many rows (a prefill) F.linear runs.
# Measured on an AVX2 CPU (benchmarks/linear-cpu-avx2): the panel kernel beats F.linear and
# oneDNN up to about 64 rows on every target shape, ties at 96 and loses from 128.
PANEL_MAX_ROWS = ROW_REGIMES[-1][0]


def linear_paths() -> tuple:
    """The paths `prepare_target` may choose from: all of `LINEAR_PATHS`, or those listed in
    the environment variable SHARPDRAFT_LINEAR_PATHS (comma-separated, e.g. "dense,onednn" to
    compare against the runtime without the panel kernel).

    Raises:
        ValueError naming SHARPDRAFT_LINEAR_PATHS: an unknown path or none at all.
    """
    raw = os.environ.get("SHARPDRAFT_LINEAR_PATHS")
    if raw is None:
        return LINEAR_PATHS
    paths = tuple(p.strip() for p in raw.split(",") if p.strip())
    bad = [p for p in paths if p not in LINEAR_PATHS]
    if bad or not paths:
        raise ValueError(f"SHARPDRAFT_LINEAR_PATHS={raw!r}: give a comma-separated subset of "
                         f"{', '.join(LINEAR_PATHS)}")
    return paths


def _paths_for(weight: torch.Tensor) -> tuple:
    """The paths this weight can take (dense always; the others by device and dtype)."""
    paths = ["dense"]
    if _packable(weight):
        paths.append("onednn")
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        paths.append("panel")
    return tuple(paths)


def _pack(weight: torch.Tensor, path: str):
    """The prepacked form of `weight` for `path` (None for dense)."""
    if path == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
    if path == "panel":
        return ext.pack_linear_weight(weight)
    return None


def _run(path: str, x2d, weight, packed, bias):
    if path == "onednn":
        return _packed_linear(x2d, packed, bias)
    if path == "panel":   # the op itself checks its arguments (the wrapper would check twice)
        return torch.ops.sharpdraft.packed_linear(x2d, packed, weight.shape[0], bias)
    return F.linear(x2d, weight, bias)


class PackedLinear(nn.Linear):
    """An `nn.Linear` (same `weight` and `bias` parameters) with prepacked copies of its weight.
    `use_packed` = one path per row regime of `ROW_REGIMES` (one row, up to 32, up to 96), each
    one of `LINEAR_PATHS` (True means "onednn", False "dense"; see `plan_linears`); rows past
    the last regime take its path. A path the weight cannot take (another
    device or dtype) and autograd fall back to `F.linear`, as the panel kernel does past
    PANEL_MAX_ROWS rows."""

    def __init__(self, linear: nn.Linear, use_packed=(False, True, True)):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.use_packed = tuple("onednn" if p is True else "dense" if p is False else p
                                for p in use_packed)
        bad = [p for p in self.use_packed if p not in LINEAR_PATHS]
        if len(self.use_packed) != len(ROW_REGIMES) or bad:
            raise ValueError(f"use_packed must be {len(ROW_REGIMES)} of {LINEAR_PATHS} (or "
                             f"booleans), one per ROW_REGIMES entry, got {use_packed!r}")
        self.repack()

    def _version(self) -> tuple:
        w = self.weight
        return (w.data_ptr(), w._version, w.dtype, w.device)

    def repack(self) -> None:
        """Pack the current weight for each path in use that it can take. Done again
        automatically once the weight changes (moved, cast, or updated in place by an
        optimizer step: its version counter moves)."""
        able = _paths_for(self.weight)
        with torch.no_grad():
            self.packed = {p: _pack(self.weight.detach(), p) for p in set(self.use_packed)
                           if p != "dense" and p in able}
        self.packed_version = self._version()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        path = self.use_packed[min(bisect.bisect_left(_REGIME_TOPS, rows), len(_REGIME_TOPS) - 1)]
        if path == "panel" and rows > PANEL_MAX_ROWS:
            path = "dense"                     # a prefill: past the rows the plan measured
        if (path == "dense" or x.dtype != self.weight.dtype or rows == 0
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        if self.packed_version != self._version():
            self.repack()
        packed = self.packed.get(path)
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        out = _run(path, x.reshape(rows, x.shape[-1]), self.weight, packed,
                   None if self.bias is None else self.bias.detach())
        return out.view(*x.shape[:-1], self.out_features)


def _interleaved_medians(fns: Dict[str, object], repeats: int,
                         flush: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """{name: median seconds of fns[name]()}, the candidates timed in turn within each repeat
    (so that a drift of the machine's speed reaches them all alike), each after a warm-up
    call and, with `flush`, a read of that buffer that evicts what it reads from the caches."""
    for fn in fns.values():
        fn()
    times: Dict[str, list] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if flush is not None:
                flush.sum()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


_COLD_BYTES = 64 << 20   # more than the last-level caches of the CPUs we run on
_PLANS: Dict[tuple, tuple] = {}   # measured choices of this process, by shape and threads


def plan_linears(model: nn.Module, repeats: int = 11,
                 paths: Optional[Sequence[str]] = None) -> Dict[tuple, tuple]:
    """Measure, for every distinct (out, in, dtype) of the model's CPU `nn.Linear`s, each of
    `paths` it can take (`F.linear`, the oneDNN-packed weight, sharpdraft_ext's panel kernel)
    at the row count each `ROW_REGIMES` entry is measured at (one row, a verification, a wide
    tree's verification; medians of `repeats`, a third of them past 8 rows, the paths timed in
    turn), and keep the fastest for each.

    A forward streams every weight from memory once, so each call is timed with the weight
    evicted from the caches (a read of _COLD_BYTES before it), as in the model; a weight
    measured hot in cache favours the wrong path (F.linear at one row, on our AVX2 machine).
    Choices are remembered per shape, thread count and path set for the rest of the process.
    `paths` defaults to `linear_paths()` (SHARPDRAFT_LINEAR_PATHS); "dense" is the fallback of a
    weight that can take none of them.

    Returns:
        {(out_features, in_features, dtype): one path of `LINEAR_PATHS` per `ROW_REGIMES`
        entry}, as `PackedLinear` takes them.
    """
    paths = tuple(linear_paths() if paths is None else paths)
    plan = {}
    flush = None
    for mod in model.modules():
        if not isinstance(mod, nn.Linear) or mod.weight.device.type != "cpu":
            continue
        key = (mod.out_features, mod.in_features, mod.weight.dtype)
        if key in plan:
            continue
        known = _PLANS.get((key, torch.get_num_threads(), tuple(paths)))
        if known is not None:             # measured before in this process (target, drafter)
            plan[key] = known
            continue
        able = [p for p in _paths_for(mod.weight) if p in paths]
        if len(able) <= 1:                # nothing to choose: F.linear, or the one path left
            if able and able[0] != "dense":
                plan[key] = (able[0],) * len(ROW_REGIMES)
            continue
        if flush is None:
            flush = torch.ones(_COLD_BYTES // 4)
        w = mod.weight.detach()
        packed = {p: _pack(w, p) for p in able}
        choice = []
        for _, m in ROW_REGIMES:
            x = torch.randn(m, mod.in_features, dtype=w.dtype)
            # a call over many rows is long, so less noisy: a third of the repeats past 8 rows
            reps = repeats if m <= 8 else max(3, repeats // 3)
            s = _interleaved_medians({p: (lambda p=p: _run(p, x, w, packed[p], None))
                                      for p in able}, reps, flush)
            choice.append(min(able, key=s.get))
        plan[key] = _PLANS[(key, torch.get_num_threads(), tuple(paths))] = tuple(choice)
    return plan


def choose_dtype(model: nn.Module, rows=(1, 8), repeats: int = 9) -> tuple:
    """The measured rule behind `--dtype auto`: bfloat16 weights only where this CPU runs the
    model's largest decoder linear faster in bfloat16 than in float32, at one row (decode)
    and at rows[1] rows (verification), each through the fastest path it can take
    (`LINEAR_PATHS`: F.linear, oneDNN's packed weight, the panel kernel for float32). Without
    AVX-512 BF16 or AMX, bfloat16 matmuls are emulated and lose; with them they read half the
    bytes.

    Returns:
        (torch.float32 or torch.bfloat16, {"float32": [ms per row count], "bfloat16": [...]}).
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)
               and m.weight.device.type == "cpu" and m is not model.get_output_embeddings()]
    if not linears or not torch.backends.mkldnn.is_available():
        return torch.float32, {}
    w32 = max(linears, key=lambda m: m.weight.numel()).weight.detach().float()
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    allowed = linear_paths()
    cands = {}                           # (dtype name, path) -> (weight, packed weight)
    for dtype, name in names.items():
        w = w32.to(dtype)
        able = [p for p in _paths_for(w) if p in allowed] or ["dense"]
        cands.update({(name, p): (w, _pack(w, p)) for p in able})
    ms = {name: [] for name in names.values()}
    for m in rows:
        xs = {name: torch.randn(m, w32.shape[1], dtype=dtype) for dtype, name in names.items()}
        t = _interleaved_medians({(n, p): (lambda n=n, p=p: _run(p, xs[n], *cands[(n, p)],
                                                                  None)) for n, p in cands},
                                 repeats)
        for name in ms:
            ms[name].append(round(1e3 * min(v for (n, _), v in t.items() if n == name), 4))
    faster = all(b < f for b, f in zip(ms["bfloat16"], ms["float32"]))
    return (torch.bfloat16 if faster else torch.float32), ms


def choose_autocast(model: nn.Module, rows: int = 512, repeats: int = 5) -> tuple:
    """The measured rule behind training's `--autocast auto` and `--cache-dtype auto`: bfloat16
    autocast only where the model's largest decoder linear, at `rows` rows (a training window
    or a cache-filling forward), runs faster under `torch.autocast(bfloat16)` than in float32,
    on the device holding the model (medians of `repeats`, timed in turn; the autocast call
    includes casting the float32 weight, as a training step does).

    Measured (README, "An AVX2-only CPU"): target forwards under bfloat16 autocast are about
    1.6x faster than float32 on a CPU with AMX and 4.4x slower on a CPU with AVX2 only, where
    bfloat16 matmuls are emulated.

    Returns:
        (torch.bfloat16, or None for no autocast; {"float32": ms, "bfloat16": ms}), ({} and
        None when the model has no linear layer).
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)
               and m is not model.get_output_embeddings()]
    if not linears:
        return None, {}
    w = max(linears, key=lambda m: m.weight.numel()).weight.detach().float()
    x = torch.randn(rows, w.shape[1], device=w.device)
    dev = w.device

    def call(enabled: bool):
        def fn():
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=enabled):
                F.linear(x, w)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        return fn

    t = _interleaved_medians({"float32": call(False), "bfloat16": call(True)}, repeats)
    ms = {name: round(1e3 * s, 4) for name, s in t.items()}
    return (torch.bfloat16 if ms["bfloat16"] < ms["float32"] else None), ms


def as_packed(linear: nn.Module, plan: Dict[tuple, tuple]) -> nn.Module:
    """`linear` as a `PackedLinear` sharing its parameters where `plan` (see `plan_linears`)
    packs its shape at some row count; else `linear` itself."""
    if type(linear) is not nn.Linear or linear.weight.device.type != "cpu":
        return linear
    choice = plan.get((linear.out_features, linear.in_features, linear.weight.dtype))
    return (PackedLinear(linear, choice) if choice and any(p != "dense" for p in choice)
            else linear)


def pack_linears(model: nn.Module, plan: Dict[tuple, tuple]) -> int:
    """Replace every CPU `nn.Linear` below `model` that `plan` packs by a `PackedLinear`
    sharing its parameters (tied weights stay tied). Returns the number replaced."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = as_packed(child, plan)
            if new is not child:
                setattr(parent, name, new)
                count += 1
    return count


# ---------------------------------------------------------------------------------------------
# The runtime
# ---------------------------------------------------------------------------------------------
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


def prepare_drafter(drafter: nn.Module) -> nn.Module:
    """Prepack a drafter's own CPU linear layers by the same measured rule as the target's
    (`plan_linears`), once; parameters and state_dict are untouched, and a packed weight is
    repacked when training changes it."""
    if not getattr(drafter, "_sharpdraft_packed", False):
        pack_linears(drafter, plan_linears(drafter))
        drafter._sharpdraft_packed = True
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
        self.cache: Optional[PreallocatedCache] = None

    @property
    def info(self) -> dict:
        return dict(self.model._sharpdraft_runtime)

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
        with captured_hidden_states(self.model, self.hidden_layers) as hidden:
            out = self.model(input_ids=ids, position_ids=position_ids,
                             attention_mask=attention_mask, cache=self.cache, use_cache=True,
                             logits_to_keep=1 if last_only else 0)
        return StepOutput(out.logits[0].float(), dict(hidden))

    def crop(self, length: int) -> None:
        self.cache.crop_to(length)

    def keep(self, start: int, rows: Sequence[int]) -> None:
        self.cache.keep(start, rows)
