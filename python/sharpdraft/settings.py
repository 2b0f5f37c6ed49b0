"""Every environment variable sharpdraft reads, declared once, typed (after vLLM's `envs.py`).

Each variable is an `EnvVar`: its name, what it parses to, its default, who reads it and what it
does. Python code reads a variable through `get(name)` (or the typed accessor below it), which
parses and validates the value and raises a one-line ValueError naming the variable; nothing
else in the package touches ``os.environ`` for a ``SHARPDRAFT_*`` name (tests/test_settings.py
checks the source tree for it). Variables read outside Python (the C++ kernels, setup.py at build
time, the shell scripts) are declared here too, with the same rule written in `doc`, so this
module is the one list a user reads.

This module imports only the standard library: setup.py loads it by path before anything is
built. The SharpDraft scaling defaults (slope, n_ref) live with the kernel's API, in
`sharpdraft_ext.defaults`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple


@dataclass(frozen=True)
class EnvVar:
    """One environment variable.

    name: the variable. parse: str -> value (raises ValueError with the reason). default: the
    value when unset or empty. read_by: "python", "c++", "build" (setup.py) or "scripts". doc:
    what it does, its accepted values.
    """

    name: str
    parse: Callable[[str], Any]
    default: Any
    read_by: str
    doc: str


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return value
    return parse


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 0 or 1")


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


def _names(raw: str) -> Tuple[str, ...]:
    names = tuple(p.strip() for p in raw.split(",") if p.strip())
    if not names:
        raise ValueError("must name at least one entry, comma-separated")
    return names


def _text(raw: str) -> str:
    return raw.strip()


def _finite_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("must be a finite number")
    return value


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError("must be an integer >= 1")
    return value


VARIABLES: Dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("SHARPDRAFT_HOME", _path, None, "python",
           "The cache folder (converted targets, quantised blocks, training feature caches). "
           "Default $XDG_CACHE_HOME/sharpdraft, else ~/.cache/sharpdraft."),
    EnvVar("SHARPDRAFT_CPU_ISA", _choice("base", "avx2", "avx512"), None, "c++",
           "Caps the instruction set of the CPU kernels (attention and runtime linears): base "
           "(scalar), avx2, avx512 (AVX-512 without VNNI for the quantised linears). Default: "
           "the best this CPU has. For testing the fallbacks."),
    EnvVar("SHARPDRAFT_LINEAR_PATHS", _names, None, "python",
           "Comma-separated subset of dense, onednn, panel: the paths the target runtime's "
           "dense linear plan may choose from. Default: all."),
    EnvVar("SHARPDRAFT_KV_DTYPE", _choice("auto", "float32", "float16", "bfloat16"), "auto",
           "python",
           "The target runtime's KV cache dtype under the auto and measure plans: auto (the "
           "documented rule, `target.plan.auto_kv_dtype`: the model's dtype), or one of "
           "float32, float16, bfloat16 (16-bit: faster at long contexts on AVX-512, slightly "
           "higher perplexity; docs/runtime.md)."),
    EnvVar("SHARPDRAFT_FUSED_LAYERS", _flag, True, "python",
           "0 turns off the one-call decoder (`llama_layers`) of a quantised Llama-style target, "
           "to measure against it."),
    EnvVar("SHARPDRAFT_FUSED_DRAFTERS", _flag, True, "python",
           "0 turns off the drafters' one-call CPU draft steps (EAGLE-3's `eagle3_layer`, "
           "PARD's `pard_layers`, DFlash's `dflash_layers`) for a quantised target, to measure "
           "against them."),
    EnvVar("SHARPDRAFT_VLLM_MODE", _choice("off", "none", "fixed_slope", "exact_topk"), "off",
           "python",
           "The vLLM plugin: off (default: changes nothing), or the SharpDraft mode of the "
           "drafter's attention."),
    EnvVar("SHARPDRAFT_VLLM_SLOPE", _finite_float, None, "python",
           "The vLLM plugin's slope (default: the drafter's calibrated sharp_slopes, else the "
           "kernel's default slope). Only with SHARPDRAFT_VLLM_MODE set."),
    EnvVar("SHARPDRAFT_VLLM_N_REF", _positive_int, None, "python",
           "The vLLM plugin's n_ref (default: the drafter's training context). Only with "
           "SHARPDRAFT_VLLM_MODE set."),
    EnvVar("SHARPDRAFT_CUDA_TILE", _choice("default", "alt", "wide"), "default", "c++",
           "The CUDA kernel's prefill tile (alt / wide: the switchable tiles "
           "benchmarks/bench_cuda.py times)."),
    EnvVar("SHARPDRAFT_CUDA", _choice("auto", "0", "1"), "auto", "build",
           "Build the CUDA extension: auto (when torch has CUDA and nvcc is found), 1 (require "
           "it), 0 (skip)."),
    EnvVar("SHARPDRAFT_SKIP_CUDA_BUILD", _flag, False, "scripts",
           "scripts/test.sh: 1 skips building the CUDA extension against the CUDA torch (the "
           "compile-only check still runs)."),
    EnvVar("SHARPDRAFT_COMMIT", _text, None, "scripts",
           "scripts/gpu_check.sh: the commit its results are written against (default: "
           "`git rev-parse --short HEAD`)."),
)}


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of variable `name` (its default when unset or empty).

    Args:
        name: a key of `VARIABLES`.
        environ: the mapping to read (default os.environ).

    Raises:
        KeyError: `name` is not declared here.
        ValueError naming the variable: a value its parser refuses.
    """
    var = VARIABLES[name]
    raw = (os.environ if environ is None else environ).get(name, "")
    if not raw.strip():
        return var.default
    try:
        return var.parse(raw)
    except ValueError as err:
        raise ValueError(f"{name}={raw!r}: {err}") from None


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Parse every declared variable Python reads that is set, so that a bad value fails before
    any work (the command line calls this after its flags).

    Raises:
        ValueError naming the first variable whose value its parser refuses.
    """
    for var in VARIABLES.values():
        if var.read_by == "python":
            get(var.name, environ)


def sharpdraft_home(environ: Optional[Mapping[str, str]] = None) -> Path:
    """The cache folder: $SHARPDRAFT_HOME, else $XDG_CACHE_HOME/sharpdraft, else
    ~/.cache/sharpdraft."""
    home = get("SHARPDRAFT_HOME", environ)
    if home is not None:
        return home
    env = os.environ if environ is None else environ
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sharpdraft"


def describe() -> str:
    """A Markdown table of every variable (docs/settings.md is this text)."""
    lines = ["| variable | read by | default | what it does |", "|---|---|---|---|"]
    for v in VARIABLES.values():
        default = "unset" if v.default is None else str(v.default).replace("True", "1").replace(
            "False", "0")
        lines.append(f"| `{v.name}` | {v.read_by} | {default} | {v.doc} |")
    return "\n".join(lines) + "\n"
