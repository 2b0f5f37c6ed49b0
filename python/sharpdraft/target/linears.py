"""Linear layers of the target runtime: `PackedLinear` and the measured per-shape plan
(`plan_linears`) that picks, for each weight shape and row regime, the fastest of F.linear,
oneDNN's prepacked weight and sharpdraft_ext.cpu_runtime's panel kernel, as timed on this machine (what
`TargetRuntime.prepare(model, "measure")` uses; the default plan, `plan.auto_plan`, is a rule
derived from such measurements and times nothing)."""
from __future__ import annotations

import bisect
import time
from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from sharpdraft_ext import cpu_runtime
from torch import nn

from .. import settings

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
# and "panel" (sharpdraft_ext.cpu_runtime.packed_linear: our few-row kernel, float32), all the
# layer's own maths up to float rounding; and QUANT_PATH, the weight re-quantised to GGUF Q8_0
# blocks with int8 activations (sharpdraft_ext.cpu_runtime.quant_linear), which a drafter may
# take when the target itself runs on quantised blocks (`prepare_drafter(quantised=True)`), never
# the target.
LINEAR_PATHS = ("dense", "onednn", "panel")
QUANT_PATH = "q8_0"
# The row counts a plan tells apart: one row (a decode step), 2 .. 32 (a chain, block or small
# tree verification) and 33 .. 96 (a wide tree's), each measured at one representative count.
ROW_REGIMES = ((1, 1), (32, 8), (96, 64))          # (largest row count, rows measured at)
_REGIME_TOPS = tuple(top for top, _ in ROW_REGIMES)
# The panel kernel re-reads x for every panel: past this many rows (a prefill) F.linear runs.
# Measured on an AVX2 CPU (benchmarks/results/linear-cpu-avx2): the panel kernel beats F.linear and
# oneDNN up to about 64 rows on every target shape, ties at 96 and loses from 128.
PANEL_MAX_ROWS = ROW_REGIMES[-1][0]


def linear_paths() -> tuple:
    """The paths a runtime plan may choose from: all of `LINEAR_PATHS`, or those listed in
    SHARPDRAFT_LINEAR_PATHS (`sharpdraft.settings`; comma-separated, e.g. "dense,onednn" to
    compare against the runtime without the panel kernel).

    Raises:
        ValueError naming SHARPDRAFT_LINEAR_PATHS: an unknown path or none at all.
    """
    paths = settings.get("SHARPDRAFT_LINEAR_PATHS")
    if paths is None:
        return LINEAR_PATHS
    bad = [p for p in paths if p not in LINEAR_PATHS]
    if bad:
        raise ValueError(f"SHARPDRAFT_LINEAR_PATHS: {', '.join(bad)} is not a path; give a "
                         f"comma-separated subset of {', '.join(LINEAR_PATHS)}")
    return paths


def paths_for(weight: torch.Tensor) -> tuple:
    """The paths this weight can take (dense always; the others by device and dtype)."""
    paths = ["dense"]
    if _packable(weight):
        paths.append("onednn")
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        paths.append("panel")
        if weight.shape[1] % 32 == 0:
            paths.append(QUANT_PATH)
    return tuple(paths)


def pack_weight(weight: torch.Tensor, path: str):
    """The prepacked form of `weight` for `path` (None for dense)."""
    if path == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
    if path == "panel":
        return cpu_runtime.pack_linear_weight(weight)
    if path == QUANT_PATH:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        blocks = quantize(weight.float().cpu().numpy(), GGMLQuantizationType.Q8_0)
        return cpu_runtime.quant_pack(torch.from_numpy(blocks.copy()), QUANT_PATH,
                                      weight.shape[0], weight.shape[1])
    return None


def run_path(path: str, x2d, weight, packed, bias):
    if path == "onednn":
        return _packed_linear(x2d, packed, bias)
    if path == "panel":   # the op itself checks its arguments (the wrapper would check twice)
        return torch.ops.sharpdraft_cpu_runtime.packed_linear(x2d, packed, weight.shape[0], bias)
    if path == QUANT_PATH:
        return torch.ops.sharpdraft_cpu_runtime.quant_linear(x2d.contiguous(), packed, QUANT_PATH,
                                                             weight.shape[0], bias)
    return F.linear(x2d, weight, bias)


class PackedLinear(nn.Linear):
    """An `nn.Linear` (same `weight` and `bias` parameters) with prepacked copies of its weight.
    `use_packed` = one path per row regime of `ROW_REGIMES` (one row, up to 32, up to 96), each
    one of `LINEAR_PATHS` or `QUANT_PATH` (True means "onednn", False "dense"; see
    `plan_linears`); rows past
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
        bad = [p for p in self.use_packed if p not in LINEAR_PATHS + (QUANT_PATH,)]
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
        able = paths_for(self.weight)
        with torch.no_grad():
            self.packed = {p: pack_weight(self.weight.detach(), p) for p in set(self.use_packed)
                           if p != "dense" and p in able}
        self.packed_version = self._version()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        path = self.use_packed[min(bisect.bisect_left(_REGIME_TOPS, rows), len(_REGIME_TOPS) - 1)]
        if path in ("panel", QUANT_PATH) and rows > PANEL_MAX_ROWS:
            path = "dense"                     # a prefill: past the rows the plan measured
        if (path == "dense" or x.dtype != self.weight.dtype or rows == 0
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        if self.packed_version != self._version():
            self.repack()
        packed = self.packed.get(path)
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        out = run_path(path, x.reshape(rows, x.shape[-1]), self.weight, packed,
                   None if self.bias is None else self.bias.detach())
        return out.view(*x.shape[:-1], self.out_features)


def interleaved_medians(fns: Dict[str, object], repeats: int,
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
    `paths` it can take (`F.linear`, the oneDNN-packed weight, sharpdraft_ext.cpu_runtime's panel
    kernel) at the row count each `ROW_REGIMES` entry is measured at (one row, a verification, a
    wide tree's verification; medians of `repeats`, a third of them past 8 rows, the paths timed
    in turn), and keep the fastest for each.

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
        able = [p for p in paths_for(mod.weight) if p in paths]
        if len(able) <= 1:                # nothing to choose: F.linear, or the one path left
            if able and able[0] != "dense":
                plan[key] = (able[0],) * len(ROW_REGIMES)
            continue
        if flush is None:
            flush = torch.ones(_COLD_BYTES // 4)
        w = mod.weight.detach()
        packed = {p: pack_weight(w, p) for p in able}
        choice = []
        for _, m in ROW_REGIMES:
            x = torch.randn(m, mod.in_features, dtype=w.dtype)
            # a call over many rows is long, so less noisy: a third of the repeats past 8 rows
            reps = repeats if m <= 8 else max(3, repeats // 3)
            s = interleaved_medians({p: (lambda p=p: run_path(p, x, w, packed[p], None))
                                      for p in able}, reps, flush)
            choice.append(min(able, key=s.get))
        plan[key] = _PLANS[(key, torch.get_num_threads(), tuple(paths))] = tuple(choice)
    return plan


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
    sharing its parameters (tied weights stay tied), and give a `PackedLinear` already there
    the plan's paths. Returns the number replaced or re-planned."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                choice = plan.get((child.out_features, child.in_features, child.weight.dtype))
                if choice and tuple(choice) != child.use_packed:
                    child.use_packed = tuple(choice)
                    child.repack()
                    count += 1
                continue
            new = as_packed(child, plan)
            if new is not child:
                setattr(parent, name, new)
                count += 1
    return count


