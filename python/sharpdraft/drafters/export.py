"""Export: the project's drafters written in the public layouts that other tools read (vLLM's
`qwen3_dflash.py` / `llama_eagle3.py` and draft-model loaders, the public repositories' code).

Each of the project's kinds names the public format it exports to (`DrafterKind.public`); that
format's class converts a drafter exactly (`from_drafter(drafter, target, tokenizer)`, or a
ValueError naming the config field with no public equivalent) and writes its folder (`save`).
The written folder is then read back through the public adapter and its drafts compared with
the original's on a probe prompt, so an export that would not round-trip is never reported as
done.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from . import registry
from .base import Drafter
from .formats.files import CONFIG_FILE


def public_kind(drafter: Drafter) -> registry.DrafterKind:
    """The public format `drafter`'s kind exports to.

    Raises:
        ValueError naming the kind: it has no public format (LongSpark).
    """
    kind = registry.kind_of(drafter)
    if not kind.public:
        exportable = [n for n in registry.names() if registry.get(n).public]
        raise ValueError(f"drafter: the {kind.title} drafter has no public format to export to "
                         f"(exportable: {', '.join(exportable)})")
    return registry.get(kind.public)


def _probe_drafts(drafter: Drafter, target, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits of one chain propose after `ids` (1, T), greedy."""
    with torch.no_grad():
        out = target(ids[:, :-1], output_hidden_states=drafter.needs_hidden_states)
        session = drafter.start(target, ids[:, :-1], out.hidden_states)
        return session.propose(int(ids[0, -1]), ids.shape[1] - 1, lambda r: int(r.argmax()))[1]


def export_drafter(drafter: Drafter, target, out, tokenizer=None,
                   dtype: torch.dtype = torch.bfloat16,
                   probe: Optional[torch.Tensor] = None) -> dict:
    """Write `drafter` (one of the project's kinds) to folder `out` in its public layout, with
    weights in `dtype` (public checkpoints ship bfloat16; so do the project's), read it back
    with the public adapter and compare their drafts on `probe` ((1, T) token ids; default: 64
    tokens drawn from the target's vocabulary with a fixed seed), the drafter itself rounded
    to `dtype` first so that both hold the same numbers.

    Returns:
        {"out", "format" (the public kind), "architectures", "tensors", "bytes",
         "probe_max_abs_diff" (largest |logit difference| of the probe drafts, float32),
         "probe_same_drafts" (whether the greedy drafts agree)}.

    Raises:
        ValueError naming the kind or the config field: no public format, or a drafter whose
            architecture differs from the public one (the public class's `from_drafter`), or an
            export whose read-back drafts differently (then nothing is written to `out`).
    """
    fmt = public_kind(drafter)
    compute = drafter_dtype(drafter)
    drafter = copy.deepcopy(drafter)
    with torch.no_grad():             # the numbers the folder will hold (buffers such as RoPE
        for p in drafter.parameters():   # frequencies stay in float32, as the loaders keep them)
            p.copy_(p.to(dtype))
    public = fmt.cls.from_drafter(drafter, target, tokenizer=tokenizer).to(dtype)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        public.save(staging)
        report = _check_round_trip(fmt, drafter, target, staging, compute, probe)
        out.mkdir(exist_ok=True)
        for f in staging.iterdir():       # only a folder that read back right is published
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    config = json.loads((out / CONFIG_FILE).read_text())
    return {"out": str(out), "format": fmt.name, "architectures": config.get("architectures"),
            "tensors": len(public.state_dict()),
            "bytes": sum(p.stat().st_size for p in out.iterdir() if p.is_file()), **report}


def _check_round_trip(fmt, drafter: Drafter, target, folder: Path, compute: torch.dtype,
                      probe: Optional[torch.Tensor]) -> dict:
    """Read `folder` back with the public adapter and compare its drafts with `drafter`'s on
    `probe`; raises ValueError when the greedy drafts differ."""
    loaded = fmt.cls.load(folder, target=target).to(compute)
    loaded.sharp = drafter.sharp
    if probe is None:
        vocab = target.get_input_embeddings().weight.shape[0]
        probe = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    probe = probe.to(target.get_input_embeddings().weight.device)
    want, got = _probe_drafts(drafter, target, probe), _probe_drafts(loaded, target, probe)
    diff = float((want - got).abs().nan_to_num(0.0, 0.0, 0.0).max())
    same = bool((want.argmax(-1) == got.argmax(-1)).all())
    if not same:
        raise ValueError(f"export: the {fmt.name} folder read back drafts differently from the "
                         f"drafter (max |logit difference| {diff:.3g}); nothing was written")
    return {"probe_max_abs_diff": diff, "probe_same_drafts": same}


def drafter_dtype(drafter: Drafter) -> torch.dtype:
    """The floating-point dtype of the drafter's parameters."""
    return next(p.dtype for p in drafter.parameters() if p.is_floating_point())
