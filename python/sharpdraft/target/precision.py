"""Measured precision rules: `choose_dtype` (`--dtype auto`) and `choose_autocast` (training's
`--autocast auto` / `--cache-dtype auto`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linears import interleaved_medians, linear_paths, pack_weight, paths_for, run_path


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
        able = [p for p in paths_for(w) if p in allowed] or ["dense"]
        cands.update({(name, p): (w, pack_weight(w, p)) for p in able})
    ms = {name: [] for name in names.values()}
    for m in rows:
        xs = {name: torch.randn(m, w32.shape[1], dtype=dtype) for dtype, name in names.items()}
        t = interleaved_medians({(n, p): (lambda n=n, p=p: run_path(p, xs[n], *cands[(n, p)],
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

    t = interleaved_medians({"float32": call(False), "bfloat16": call(True)}, repeats)
    ms = {name: round(1e3 * s, 4) for name, s in t.items()}
    return (torch.bfloat16 if ms["bfloat16"] < ms["float32"] else None), ms


