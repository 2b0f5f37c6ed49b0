"""The target runtime's plan (`RuntimePlan`): which path each CPU linear shape takes in each row
regime (`linears.ROW_REGIMES`), and whether step-sized forwards take the fused `llama_layers`
call (`fused`). `TargetRuntime.prepare` takes one of:

- "auto" (the default, what the engine uses): `auto_plan`, a fixed rule of the CPU's instruction
  set (`sharpdraft_ext.cpu_isa()`), oneDNN's availability, the weight's dtype and its shape,
  derived from the measurements in benchmarks/results/linear-cpu (AVX-512) and
  benchmarks/results/linear-cpu-avx2 (AVX2). Nothing is timed.
- "measure": `measured_plan`, each shape timed on this machine (`linears.plan_linears`, a few
  seconds for a 135M model on 2 cores).
- a path (str or Path): a plan saved by `RuntimePlan.save` (e.g. one measured once), read by
  `RuntimePlan.load`.
- a `RuntimePlan`.

A plan file is JSON: {"version": 1, "fused": true, "kv_dtype": "float16", "linears": {"576x576
float32": ["panel", "panel", "panel"], ...}} (kv_dtype optional; null or absent: the model's
dtype): one path of `LINEAR_PATHS` per `ROW_REGIMES` entry for each
"<out_features>x<in_features> <dtype>" shape (the keys of `TargetRuntime.info["linear_plan"]`).
A shape the plan does not name runs F.linear; an entry no linear of the model has is unused.

Layer: within sharpdraft.target (reads `linears`; `runtime` resolves plans through `resolve_plan`).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import sharpdraft_ext as ext
import torch
from torch import nn

from .. import settings
from .linears import LINEAR_PATHS, ROW_REGIMES, _packable, linear_paths, paths_for, plan_linears

PLAN_VERSION = 1
PLAN_FIELDS = ("version", "fused", "linears")
OPTIONAL_FIELDS = ("kv_dtype",)             # absent in older plan files: the model's dtype
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
Shape = Tuple[int, int, torch.dtype]            # (out_features, in_features, weight dtype)

# A weight this large (4M elements, 16 MB of float32) is an LM head, not a decoder projection:
# the one-row rules below treat it apart (linear.md: 49152x576 vs the decoder's <= 1536x576).
LARGE_WEIGHT = 1 << 22
_DTYPES = {str(d)[6:]: d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}
_SHAPE_KEY = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*) ([a-z0-9]+)$")


def shape_key(shape: Shape) -> str:
    """"<out>x<in> <dtype>" of a plan shape, e.g. "576x576 float32" (plan files, `info`)."""
    out_features, in_features, dtype = shape
    return f"{out_features}x{in_features} {str(dtype)[6:]}"


def _parse_key(key, where: str) -> Shape:
    m = _SHAPE_KEY.match(key) if isinstance(key, str) else None
    if m is None or m.group(3) not in _DTYPES:
        raise ValueError(f"{where}: shape {key!r}: want '<out_features>x<in_features> <dtype>' "
                         f"with dtype one of {', '.join(_DTYPES)}, e.g. '576x576 float32'")
    return int(m.group(1)), int(m.group(2)), _DTYPES[m.group(3)]


def _check_paths(choice, where: str) -> Tuple[str, ...]:
    if (not isinstance(choice, (list, tuple)) or len(choice) != len(ROW_REGIMES)
            or any(p not in LINEAR_PATHS for p in choice)):
        raise ValueError(f"{where}: want {len(ROW_REGIMES)} paths (one per ROW_REGIMES entry: "
                         f"1, <= 32, <= 96 rows), each one of {', '.join(LINEAR_PATHS)}; got "
                         f"{choice!r}")
    return tuple(choice)


@dataclass(frozen=True)
class RuntimePlan:
    """What `TargetRuntime.prepare` does to the linears and the decoder of its copy of a model.

    Attributes:
        linears: {(out_features, in_features, dtype): one path of `LINEAR_PATHS` per
            `ROW_REGIMES` entry (one row, up to 32, up to 96)}, as `linears.plan_linears`
            returns it; a shape left out runs F.linear.
        fused: take the one-call `llama_layers` decoder for step-sized forwards where the model
            qualifies (`fused.fused_layers`; SHARPDRAFT_FUSED_LAYERS=0 still turns it off).
        kv_dtype: the KV cache's dtype, one of `KV_DTYPES` ("float32", "float16", "bfloat16"),
            or None (the model's own, as its modules write the keys); a 16-bit cache under a
            float32 model rounds every key and value and runs the attention in its dtype, the
            same for every row (a row decoded alone and verified keeps its bits).
        source: where the plan came from ("auto", "measure", "given" or the file it was loaded
            from); not saved, not compared.

    Raises (construction):
        ValueError naming the field: a shape that is not (int > 0, int > 0, torch.dtype), or
            paths that are not one of LINEAR_PATHS per ROW_REGIMES entry; fused not a bool.
    """

    linears: Mapping[Shape, Tuple[str, ...]] = field(default_factory=dict)
    fused: bool = True
    source: str = field(default="given", compare=False)
    kv_dtype: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.fused, bool):
            raise ValueError(f"RuntimePlan.fused: want True or False, got {self.fused!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"RuntimePlan.kv_dtype: want None or one of {', '.join(KV_DTYPES)}, "
                             f"got {self.kv_dtype!r}")
        linears = {}
        for shape, choice in dict(self.linears).items():
            if (not isinstance(shape, tuple) or len(shape) != 3
                    or not all(isinstance(n, int) and n > 0 for n in shape[:2])
                    or not isinstance(shape[2], torch.dtype)):
                raise ValueError(f"RuntimePlan.linears: shape {shape!r}: want (out_features, "
                                 f"in_features, torch dtype)")
            linears[shape] = _check_paths(choice, f"RuntimePlan.linears[{shape_key(shape)!r}]")
        object.__setattr__(self, "linears", linears)

    def info(self) -> Dict[str, list]:
        """{"<out>x<in> <dtype>": [paths]}: the plan as `TargetRuntime.info["linear_plan"]` and
        the reports print it."""
        return {shape_key(s): list(p) for s, p in self.linears.items()}

    def to_json(self) -> dict:
        return {"version": PLAN_VERSION, "fused": self.fused, "kv_dtype": self.kv_dtype,
                "linears": self.info()}

    @classmethod
    def from_json(cls, data, where: str = "plan", source: str = "given") -> "RuntimePlan":
        """The plan of a `to_json` dict.

        Raises:
            ValueError naming `where` and the field: not an object, a missing or unknown field,
                a version other than PLAN_VERSION, fused not a boolean, a bad shape key or path
                list.
        """
        if not isinstance(data, dict):
            raise ValueError(f"{where}: want a JSON object with fields {', '.join(PLAN_FIELDS)}, "
                             f"got {type(data).__name__}")
        unknown = sorted(set(data) - set(PLAN_FIELDS) - set(OPTIONAL_FIELDS))
        missing = [f for f in PLAN_FIELDS if f not in data]
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} (a plan has "
                             f"{', '.join(PLAN_FIELDS + OPTIONAL_FIELDS)})")
        if missing:
            raise ValueError(f"{where}: missing field {missing[0]!r}")
        if data["version"] != PLAN_VERSION or isinstance(data["version"], bool):
            raise ValueError(f"{where}: field 'version': want {PLAN_VERSION}, got "
                             f"{data['version']!r}")
        if not isinstance(data["fused"], bool):
            raise ValueError(f"{where}: field 'fused': want true or false, got {data['fused']!r}")
        if not isinstance(data["linears"], dict):
            raise ValueError(f"{where}: field 'linears': want an object of shape: paths, got "
                             f"{type(data['linears']).__name__}")
        kv = data.get("kv_dtype")
        if kv is not None and kv not in KV_DTYPES:
            raise ValueError(f"{where}: field 'kv_dtype': want null or one of "
                             f"{', '.join(KV_DTYPES)}, got {kv!r}")
        linears = {}
        for key, choice in data["linears"].items():
            shape = _parse_key(key, f"{where}: field 'linears'")
            linears[shape] = _check_paths(choice, f"{where}: field 'linears' {key!r}")
        return cls(linears, data["fused"], source, kv)

    def save(self, path: Union[str, Path]) -> Path:
        """Write the plan as JSON to `path` (its folder created), atomically: to a temporary
        sibling first, then renamed over `path`, so a killed save leaves no partial file.
        Returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=2)
                f.write("\n")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "RuntimePlan":
        """The plan `save` wrote to `path`.

        Raises:
            ValueError naming the file (and the field, see `from_json`): a file that cannot be
                read, is not JSON, or holds a bad plan.
        """
        path = Path(path)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else err
            raise ValueError(f"{path}: cannot read the plan file ({reason})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not a JSON plan file (line {err.lineno}: {err.msg})") \
                from None
        return cls.from_json(data, str(path), source=str(path))


# ----- the "auto" rule ---------------------------------------------------------------------------
def auto_path(out_features: int, in_features: int, dtype: torch.dtype, regime: int, *,
              isa: str, onednn: bool, paths: Sequence[str] = LINEAR_PATHS) -> str:
    """The path `auto_plan` gives a CPU linear of weight (out_features, in_features) in `dtype`
    for row regime `regime` (an index of `ROW_REGIMES`: 0 = one row, 1 = 2..32 rows, 2 =
    33..96 rows), on a CPU whose kernels dispatch to `isa` (`sharpdraft_ext.cpu_isa()`:
    "avx512", "avx2", "base") with oneDNN able to pack this dtype (`onednn`), choosing among
    `paths` (`linear_paths()`, SHARPDRAFT_LINEAR_PATHS). A pure function: nothing is timed.

    The rule, and the measurements it comes from (float32, 2 threads, each weight evicted from
    the caches before a call; benchmarks/results/linear-cpu/linear.md on AVX-512, panel width
    48, 1/6/8/17 rows; benchmarks/results/linear-cpu-avx2/linear.md on AVX2, panel width 16,
    1..65 rows; shapes 192x576, 576x576, 576x1536, 1536x576 and the 49152x576 LM head):

    1. Not float32: "dense". The panel kernel is float32 only and neither table measures
       oneDNN on another dtype (plan="measure" weighs it).
    2. float32 with the panel kernel ("panel" in `paths`, isa avx2 or avx512); speedups are
       the tables' "panel speedup", over the better of dense and oneDNN:
       - one row on AVX-512: "panel" for a weight of LARGE_WEIGHT elements or more (the LM
         head: 4.92 ms vs 5.81 dense and 5.36 oneDNN, 1.09x), else "dense" (the decoder
         shapes: 0.82x-1.06x, a tie at best; the plan measured there is dense too).
       - one row on AVX2: "panel" (1.36x-1.49x on every shape).
       - 2..32 rows: "panel" (AVX-512 at 6-17 rows: 1.03x-1.55x on every shape and row count;
         AVX2 at 8-33 rows: 1.13x-2.35x).
       - 33..96 rows: "panel" (AVX2 at 49 and 65 rows: 1.00x-1.30x, ties on 192x576 and the
         LM head; AVX-512 has no measurement past 17 rows: its wider panels re-read the input
         less often than AVX2's, so AVX2's result carries over).
    3. float32 without it (SHARPDRAFT_LINEAR_PATHS leaves "panel" out, or the "base" ISA,
       which no table measures), where oneDNN packs the weight and "onednn" is in `paths`:
       - a weight of LARGE_WEIGHT elements or more: "onednn" at every row count (the LM head:
         AVX-512 1.08x over dense at one row, 1.3x-2.6x at 6-17; AVX2 1.6x-3.0x at 1-65).
       - AVX2, more than one row: "onednn" (over dense: 192x576 1.15x-1.39x, 576x576
         0.94x-1.20x, 576x1536 1.02x-1.21x, 1536x576 1.22x-1.56x at 8-65 rows); one row:
         "onednn" where out_features > in_features (1536x576: 1.38x), else "dense" (oneDNN
         0.81x-0.90x).
       - any other ISA (AVX-512's table), more than one row: "onednn" where out_features >=
         in_features (576x576 1.07x/1.12x at 6/8 rows, 0.96x at 17; 1536x576 1.13x-1.21x),
         else "dense" (192x576: oneDNN 0.66x-0.71x; 576x1536 mixed, 0.95x-1.44x); one row:
         "dense" (oneDNN 0.45x-0.82x on the decoder shapes).
    Any other case: "dense".
    """
    allowed = set(paths)
    if dtype != torch.float32:
        return "dense"
    large = out_features * in_features >= LARGE_WEIGHT
    if "panel" in allowed and isa in ("avx2", "avx512"):
        if regime == 0 and isa == "avx512" and not large:
            return "dense" if "dense" in allowed else "panel"
        return "panel"
    if onednn and "onednn" in allowed:
        if large:
            return "onednn"
        if isa == "avx2" and (regime > 0 or out_features > in_features):
            return "onednn"
        if isa != "avx2" and regime > 0 and out_features >= in_features:
            return "onednn"
    return "dense" if "dense" in allowed else next(p for p in LINEAR_PATHS if p in allowed)


def auto_kv_dtype() -> Optional[str]:
    """The KV cache dtype the "auto" and "measure" plans carry: SHARPDRAFT_KV_DTYPE where set,
    else None (the model's own dtype), on every CPU.

    Why none is 16-bit by default: A 16-bit cache is the setting's or a
    plan's choice, not the default's: on the default GGUF target it measured 1-7% faster end
    to end on an AVX-512 EPYC (the kernel alone 26-36% at 1-7k keys on a Xeon) and raised
    held-out perplexity by 0.3-0.7% (float16: Genesis 4.707 -> 4.741, GPL-3 19.65 -> 19.71 at
    2k tokens), because the kernel takes one dtype, so the queries and the attention's output
    are rounded to 16 bits too (docs/runtime.md).
    """
    chosen = settings.get("SHARPDRAFT_KV_DTYPE")
    return None if chosen == "auto" else chosen


def auto_plan(model: nn.Module, paths: Optional[Sequence[str]] = None, *,
              isa: Optional[str] = None) -> RuntimePlan:
    """The "auto" plan of `model`: `auto_path` for every distinct (out, in, dtype) of its CPU
    `nn.Linear`s (a shape that can take only F.linear is left out, as `plan_linears` leaves it),
    `fused=True` and `auto_kv_dtype`. Reads the model's shapes and the CPU's features only: no
    timing.

    Args:
        paths: the paths to choose from (default `linear_paths()`, SHARPDRAFT_LINEAR_PATHS).
        isa: the instruction set (default `sharpdraft_ext.cpu_isa()`; tests pass others).
    """
    paths = tuple(linear_paths() if paths is None else paths)
    isa = ext.cpu_isa() if isa is None else isa
    plan = {}
    for mod in model.modules():
        if not isinstance(mod, nn.Linear) or mod.weight.device.type != "cpu":
            continue
        key = (mod.out_features, mod.in_features, mod.weight.dtype)
        if key in plan:
            continue
        able = [p for p in paths_for(mod.weight) if p in paths]
        if len(able) <= 1:            # nothing to choose: F.linear, or the one path left
            if able and able[0] != "dense":
                plan[key] = (able[0],) * len(ROW_REGIMES)
            continue
        plan[key] = tuple(auto_path(*key, regime, isa=isa, onednn=_packable(mod.weight),
                                    paths=able) for regime in range(len(ROW_REGIMES)))
    return RuntimePlan(plan, True, "auto", auto_kv_dtype())


def measured_plan(model: nn.Module, paths: Optional[Sequence[str]] = None) -> RuntimePlan:
    """The "measure" plan: every shape timed on this machine (`linears.plan_linears`; remembered
    per shape for the rest of the process) and `fused=True`."""
    return RuntimePlan(plan_linears(model, paths=paths), True, "measure", auto_kv_dtype())


PlanSpec = Union[str, Path, RuntimePlan]


def resolve_plan(plan: PlanSpec, model: nn.Module, *, measure: bool = True) -> RuntimePlan:
    """The `RuntimePlan` that `plan` names for `model` ("auto", "measure", a plan file's path or
    a RuntimePlan). With measure=False, "measure" times nothing and gives an empty plan (the
    runtime packs nothing).

    Raises:
        ValueError: a plan file that cannot be read or holds a bad plan (`RuntimePlan.load`).
        TypeError naming `plan`: anything else.
    """
    if isinstance(plan, RuntimePlan):
        return plan
    if plan == "auto":
        return auto_plan(model)
    if plan == "measure":
        return measured_plan(model) if measure else RuntimePlan({}, True, "measure",
                                                                auto_kv_dtype())
    if isinstance(plan, (str, Path)):
        return RuntimePlan.load(plan)
    raise TypeError(f"plan: want 'auto', 'measure', a plan file's path or a RuntimePlan, got "
                    f"{type(plan).__name__}")


__all__ = ["KV_DTYPES", "LARGE_WEIGHT", "PLAN_VERSION", "RuntimePlan", "auto_kv_dtype",
           "auto_path", "auto_plan",
           "measured_plan", "resolve_plan", "shape_key"]
