"""Checkpoint folders in the public (Hugging Face) layouts: what every public-format adapter reads
and writes the same way.

A public drafter folder holds config.json and its weights as model.safetensors, as shards listed
by model.safetensors.index.json ({"weight_map": {tensor name: shard file}}), or as a
pytorch_model.bin, which is read only with `torch.load(..., weights_only=True)` (tensors, never
pickled code). Shapes are checked from the safetensors headers before any weight is read.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .base import (CONFIG_FILE, WEIGHTS_FILE, ConfigKindError, check_draft_threshold,
                   read_config_json, read_safetensors_header, weights_problems)

INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"


def read_public_config(folder, config_class, overrides: Optional[dict] = None):
    """`config_class.from_public(raw, where)` of a public folder's config.json, with `overrides`
    ({field: value} of the config dataclass, e.g. a tree shape) applied and validated.

    Raises:
        FileNotFoundError naming the folder: not a folder, or no config.json.
        ConfigKindError: config.json is another kind's (as `from_public` decides).
        ValueError naming the folder, config.json and the field (or the override).
    """
    folder = Path(folder)
    raw = read_config_json(folder)
    where = f"drafter checkpoint {folder}: {CONFIG_FILE}"
    try:
        config = config_class.from_public(raw, where)
    except ConfigKindError:
        raise
    except ValueError as err:
        msg = str(err)
        raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    if overrides:
        names = {f.name for f in dataclasses.fields(config_class) if f.init}
        bad = sorted(set(overrides) - names)
        if bad:
            raise ValueError(f"overrides: {', '.join(bad)} not field(s) of "
                             f"{config_class.__name__}")
        try:
            config = dataclasses.replace(config, **overrides)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where} (with overrides): {err}") from None
    return config


def weight_index(folder) -> Tuple[str, Dict[str, tuple], Optional[dict]]:
    """(kind, {tensor name: (file name, shape)}, state) of a folder's weights: kind
    "safetensors" (model.safetensors), "sharded" (the shards of model.safetensors.index.json)
    or "bin" (pytorch_model.bin, unpickled with weights_only=True and returned as `state`;
    None for the others, whose shapes come from their headers alone).

    Raises:
        FileNotFoundError naming the folder: none of the three weight files, or a shard the
            index names is missing.
        ValueError naming the folder and file: an unreadable or truncated file, an index that
            is not JSON with a weight_map object, or one naming a tensor its shard lacks.
    """
    folder = Path(folder)
    if (folder / WEIGHTS_FILE).is_file():
        files = {WEIGHTS_FILE: None}
    elif (folder / INDEX_FILE).is_file():
        try:
            index = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise ValueError(f"drafter checkpoint {folder}: {INDEX_FILE} is not a safetensors "
                             f"index (JSON with a weight_map object)") from None
        files = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
    elif (folder / BIN_FILE).is_file():
        try:
            state = torch.load(folder / BIN_FILE, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(f"drafter checkpoint {folder}: {BIN_FILE} cannot be read with "
                             f"torch.load(weights_only=True): {err}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                                  for v in state.values()):
            raise ValueError(f"drafter checkpoint {folder}: {BIN_FILE} is not a state dict of "
                             f"tensors")
        return "bin", {k: (BIN_FILE, tuple(v.shape)) for k, v in state.items()}, state
    else:
        raise FileNotFoundError(f"drafter checkpoint {folder}: missing {WEIGHTS_FILE} (nor "
                                f"{INDEX_FILE}, nor {BIN_FILE})")
    shapes = {}
    for fname, listed in files.items():
        path = folder / fname
        if not path.is_file():
            raise FileNotFoundError(f"drafter checkpoint {folder}: {INDEX_FILE} names {fname}, "
                                    f"which is missing")
        try:
            header = read_safetensors_header(path)
        except ValueError as err:
            raise ValueError(f"drafter checkpoint {folder}: {err}") from None
        for name in (listed if listed is not None else header):
            if name not in header:
                raise ValueError(f"drafter checkpoint {folder}: {INDEX_FILE} puts tensor {name} "
                                 f"in {fname}, which lacks it")
            shapes[name] = (fname, tuple(header[name]["shape"]))
    kind = "safetensors" if len(files) == 1 and WEIGHTS_FILE in files else "sharded"
    return kind, shapes, None


def check_tensors(folder, expected: Dict[str, tuple], shapes: Dict[str, tuple],
                  hint: str = "") -> None:
    """Refuse weights whose names or shapes differ from `expected` ({name: shape}, the model the
    config implies), `shapes` being `weight_index`'s {name: (file, shape)}; `hint` is added to
    the message (e.g. what an unexpected tensor means for this format).

    Raises:
        ValueError naming the folder, the file(s), the first difference and how many follow.
    """
    problems = weights_problems(expected, {k: {"shape": list(s)} for k, (_, s) in shapes.items()})
    if not problems:
        return
    files = ", ".join(sorted({f for f, _ in shapes.values()}) or [WEIGHTS_FILE])
    more = f" (and {len(problems) - 1} more difference(s))" if len(problems) > 1 else ""
    raise ValueError(f"drafter checkpoint {folder}: {files} does not match its {CONFIG_FILE}: "
                     f"{problems[0]}{hint}{more}")


def read_weights(folder, shapes: Dict[str, tuple], state: Optional[dict] = None,
                 device="cpu") -> Dict[str, torch.Tensor]:
    """The tensors `shapes` lists (`weight_index`), read from their files onto `device` (or
    taken from the unpickled `state` of a pytorch_model.bin).

    Raises:
        ValueError naming the folder: a file that cannot be read.
    """
    folder, dev = Path(folder), str(device)
    try:
        if state is not None:
            return {k: v.to(dev) for k, v in state.items() if k in shapes}
        out = {}
        for fname in sorted({f for f, _ in shapes.values()}):
            out.update(load_file(str(folder / fname), device=dev))
        return {k: v for k, v in out.items() if k in shapes}
    except (RuntimeError, SafetensorError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"drafter checkpoint {folder}: the weights cannot be read: "
                         f"{first}") from err


def weights_dtype(folder, state: Dict[str, torch.Tensor], name: str) -> torch.dtype:
    """The dtype a public drafter is built in: that of its tensor `name` (e.g. fc.weight).

    Raises:
        ValueError naming the folder and the tensor: not a floating-point dtype.
    """
    dtype = state[name].dtype
    if not dtype.is_floating_point:
        raise ValueError(f"drafter checkpoint {folder}: {name} has dtype {dtype}, not a "
                         f"floating-point type")
    return dtype


def _replace_atomically(path: Path, write) -> None:
    """`write(temporary path)` next to `path`, then rename it to `path` (never half-written)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask)         # as an ordinary new file (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_folder(folder, config: dict, state: Dict[str, torch.Tensor],
                drop: Iterable[str] = (INDEX_FILE, BIN_FILE)) -> Path:
    """Write config.json and model.safetensors (each to a temporary name, then renamed) into
    `folder` (created), removing the other weight files `drop` a previous save may have left.
    Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    _replace_atomically(folder / WEIGHTS_FILE,
                        lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    _replace_atomically(folder / CONFIG_FILE,
                        lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))
    for name in drop:
        (folder / name).unlink(missing_ok=True)
    return folder


DRAFT_THRESHOLD_KEY = "draft_threshold"     # SharpDraft's extension, top level of config.json


def read_draft_threshold(raw: dict, where) -> float:
    """A public config.json's top-level `draft_threshold`: chain drafting's measured default
    (`Drafter.default_draft_threshold`), which our export writes so that an exported drafter
    drafts as it did before export; 0.0 (every draft verified) when absent or null.

    Raises:
        ValueError naming `where` and the field: not a number in [0, 1].
    """
    value = raw.get(DRAFT_THRESHOLD_KEY)
    return 0.0 if value is None else check_draft_threshold(
        value, f"{where}: {DRAFT_THRESHOLD_KEY}")


def is_int(v) -> bool:
    """An int that is not a bool (JSON integers)."""
    return isinstance(v, int) and not isinstance(v, bool)
