"""Checkpoint files, the same for every drafter layout (SharpDraft's own and the public ones):
config.json, the weights and their header, an atomic save.

A drafter folder holds config.json and its weights as model.safetensors, as shards listed by
model.safetensors.index.json ({"weight_map": {tensor name: shard file}}), or as a
pytorch_model.bin, which is read only with `torch.load(..., weights_only=True)` (tensors, never
pickled code); SharpDraft's own layout is always one model.safetensors. Tensor names and shapes
come from the safetensors headers (`safetensors.safe_open`: no weight is read), so a folder is
checked against its config before any weight is loaded. Every error is one line naming the folder
and the file (and the tensor or field).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"


def read_config_json(folder) -> object:
    """The parsed JSON of a checkpoint folder's config.json (any JSON value; callers check its
    type).

    Raises:
        FileNotFoundError naming the folder: it is not a folder or lacks config.json.
        ValueError naming the folder and config.json: not UTF-8 text, or not JSON (with the
            position of the error).
    """
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        why = "a file, not a folder" if folder.exists() else "no such folder"
        raise FileNotFoundError(f"drafter checkpoint {folder}: missing {CONFIG_FILE} ({why})")
    if not path.is_file():
        raise FileNotFoundError(f"drafter checkpoint {folder}: missing {CONFIG_FILE}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"drafter checkpoint {folder}: {CONFIG_FILE} is not UTF-8 text "
                         f"(byte offset {err.start})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"drafter checkpoint {folder}: {CONFIG_FILE} is not JSON "
                         f"({err.msg} at line {err.lineno} column {err.colno})") from None


def tensor_shapes(path) -> Dict[str, tuple]:
    """{tensor name: shape} of a safetensors file, from its header alone (`safetensors.safe_open`,
    which also checks that the header is whole and that the file is exactly as long as the header
    says).

    Raises:
        FileNotFoundError: no such file.
        ValueError naming the file: not a safetensors file (too short for a header, a header that
            is not safetensors JSON), or truncated (or padded) against its header.
    """
    path = Path(path)
    size = path.stat().st_size
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except SafetensorError as err:
        raise ValueError(_refusal(path, size, str(err))) from None


def _refusal(path: Path, size: int, message: str) -> str:
    """One line on why safetensors refused the file at `path` ({size} bytes; `message`: its
    error, "Error while deserializing header: <reason>")."""
    reason = message.split(": ", 1)[-1]
    if "not fully covered" in reason:          # the header is valid; the length is not its own
        expected = _described_size(path)
        if size < expected:
            return f"{path.name} is truncated ({size} bytes, header says {expected})"
        return (f"{path.name} has {size - expected} bytes past its last tensor ({size} bytes, "
                f"header says {expected}): not a whole safetensors file")
    if "invalid header length" in reason:
        return (f"{path.name} is truncated or not a safetensors file ({size} bytes, fewer than "
                f"the header its first 8 bytes announce)")
    if "invalid JSON in header" in reason:
        return (f"{path.name} is not a safetensors file (its header is not JSON of tensor "
                f"entries: {reason.split(': ', 1)[-1]})")
    return f"{path.name} is not a safetensors file ({size} bytes: {reason})"


def _described_size(path: Path) -> int:
    """The file length a safetensors header describes (8 + header + the end of its last
    tensor), read only to word the error of a header safetensors parsed but found the file
    not fully covered by."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return 8 + n + max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"),
                       default=0)


def weights_problems(expected: Dict[str, tuple], found: Dict[str, tuple]) -> List[str]:
    """How the tensors `found` ({name: shape}, e.g. `tensor_shapes`) differ from the `expected`
    ({name: shape}, a state_dict's names and shapes): each mismatching shape (file vs config),
    then the missing and the unexpected tensor names; empty when they match."""
    problems = []
    for name, shape in expected.items():
        if name in found and tuple(found[name]) != tuple(shape):
            problems.append(f"{name} has shape {tuple(found[name])} in the file, the "
                            f"config implies {tuple(shape)}")
    missing = [k for k in expected if k not in found]
    if missing:
        problems.append(f"missing tensor(s) {', '.join(missing[:4])}"
                        + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                        + f" (the config implies {tuple(expected[missing[0]])} for {missing[0]})")
    unexpected = [k for k in found if k not in expected]
    if unexpected:
        problems.append(f"unexpected tensor(s) {', '.join(unexpected[:4])}"
                        + (f" and {len(unexpected) - 4} more" if len(unexpected) > 4 else "")
                        + " (no place for them in a model of this config)")
    return problems


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
            header = tensor_shapes(path)
        except ValueError as err:
            raise ValueError(f"drafter checkpoint {folder}: {err}") from None
        for name in (listed if listed is not None else header):
            if name not in header:
                raise ValueError(f"drafter checkpoint {folder}: {INDEX_FILE} puts tensor {name} "
                                 f"in {fname}, which lacks it")
            shapes[name] = (fname, header[name])
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
    problems = weights_problems(expected, {k: s for k, (_, s) in shapes.items()})
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


def replace_atomically(path: Path, write) -> None:
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
    replace_atomically(folder / WEIGHTS_FILE,
                        lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    replace_atomically(folder / CONFIG_FILE,
                        lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))
    for name in drop:
        (folder / name).unlink(missing_ok=True)
    return folder
