"""`load_drafter`: a drafter for a target from a kind name (its shipped checkpoint, or an
untrained one) or a checkpoint folder, with its SharpDraft attention configured."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from sharpdraft_ext.defaults import DEFAULT_SLOPE

from ..attention import SharpConfig
from . import registry
from .base import Drafter
from .config_checks import DEFAULT_TRAIN_CONTEXT, ConfigKindError
from .formats.files import CONFIG_FILE

SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints"


def shipped_checkpoint(kind: str) -> Optional[Path]:
    """The folder of kind `kind`'s checkpoint shipped for the default target (SmolLM2-135M-
    Instruct), or None when the kind ships none. Raises ValueError for an unknown kind."""
    folder = SHIPPED / registry.get(kind).checkpoint
    return folder if (folder / CONFIG_FILE).is_file() else None


def detect_kind(folder) -> str:
    """The registered kind whose config class reads `folder`'s config.json.

    Raises:
        FileNotFoundError naming the folder: not a folder, or no config.json.
        ValueError naming the folder: config.json is not JSON, has the fields of a kind but an
            invalid value (that kind's message), or no kind (or several) reads it.
    """
    folder = Path(folder)
    errors = {}
    for name in registry.names():
        try:
            registry.get(name).cls.read_config(folder)
        except ValueError as err:
            errors[name] = err
    fits = [n for n in registry.names() if n not in errors]
    own = [e for e in errors.values() if not isinstance(e, ConfigKindError)]
    if not fits and own:       # the fields of a kind, but a bad value (or not JSON at all)
        raise own[0]
    if len(fits) != 1:
        what = "no drafter kind" if not fits else f"several kinds ({', '.join(fits)})"
        raise ValueError(f"drafter checkpoint {folder}: {CONFIG_FILE} fits {what}; pass kind= "
                         f"(one of {', '.join(registry.names())})")
    return fits[0]


def sharp_config(drafter: Drafter, enabled: bool = True, slope: Optional[float] = None,
                 n_ref: Optional[int] = None) -> SharpConfig:
    """The SharpConfig a drafter runs with: fixed-slope SharpDraft (or frozen, mode "none",
    when not `enabled`) with `slope` (default: the checkpoint's calibrated per-layer slopes
    where its config has them, else DEFAULT_SLOPE) and `n_ref` (default: the drafter's
    training context, `config.train_context`)."""
    calibrated = getattr(drafter.config, "sharp_slopes", None) if slope is None else None
    return SharpConfig(mode="fixed_slope" if enabled else "none",
                       slope=DEFAULT_SLOPE if slope is None else slope,
                       n_ref=drafter.config.train_context if n_ref is None else n_ref,
                       layer_slopes=calibrated)


N_REF_SOURCES = {
    "given": "given (n_ref= / --n-ref)",
    "checkpoint": "the drafter's training context length, recorded in its config",
    "default": f"the default {DEFAULT_TRAIN_CONTEXT}: the checkpoint records no training length",
}


def n_ref_source(drafter: Drafter, n_ref: Optional[int] = None,
                 sharp: Union[bool, SharpConfig] = True) -> str:
    """Where `drafter`'s n_ref comes from (a key of N_REF_SOURCES): "given" (an explicit n_ref
    or SharpConfig), "checkpoint" (its config records the training length: `train_context`),
    or "default" (a public checkpoint that records none: 2048)."""
    if n_ref is not None or isinstance(sharp, SharpConfig):
        return "given"
    return "checkpoint" if getattr(drafter.config, "records_train_context", True) else "default"


def load_drafter(source: Union[str, Path], target, *, kind: Optional[str] = None,
                 tokenizer=None, sharp: Union[bool, SharpConfig] = True,
                 slope: Optional[float] = None, n_ref: Optional[int] = None,
                 context_window: Optional[int] = None, attention_sinks: int = 0,
                 overrides: Optional[dict] = None,
                 untrained: bool = False, layers: int = 2, block_size: int = 8,
                 seed: int = 0) -> Drafter:
    """A drafter for `target`, in eval mode, in the target's dtype, checked to fit it.

    Args:
        source: a drafter kind (`registry.names()`: dflash, eagle3, pard, longspark, ...), which
            loads its shipped checkpoint for the default target; or a checkpoint folder
            (config.json + model.safetensors) of kind `kind` (default: detected from its
            config).
        target: the transformers causal LM it drafts for (`load_target`).
        tokenizer: the target's tokenizer (needed for an untrained DFlash / LongSpark: the mask
            token).
        sharp: True = SharpDraft (fixed slope), False = the frozen drafter, or a SharpConfig
            used as given (then `slope` / `n_ref` are ignored).
        slope: SharpDraft slope (default: calibrated per-layer slopes where the checkpoint has
            them, else 0.2). n_ref: reference cardinality (default: the training context the
            checkpoint records, else 2048; `drafter.n_ref_source` says which, see
            `n_ref_source`).
        context_window: attend to the last W context positions only (drafters whose class has
            `supports_context_window`); 0: every position; None: the checkpoint's measured
            default (`Drafter.default_context_window`: 512 for the shipped EAGLE-3, else every
            position).
        attention_sinks: with a context window, the first S positions stay visible too
            (StreamingLLM's attention sinks).
        overrides: {config field: value} over the checkpoint's config (e.g. `tree_options`).
        untrained: with a kind name: a seeded untrained drafter built for `target` (lossless,
            tau about 1) of `layers` layers and `block_size` (DFlash block, PARD / LongSpark
            drafts + 1).

    Raises:
        FileNotFoundError naming the folder or file: a missing checkpoint file.
        ValueError naming the argument, folder or config field: unknown kind, a kind that ships
            no checkpoint, a config or weights that do not match (checked before loading), a
            drafter that does not fit the target, or an unsupported option.
    """
    name = str(source)
    if name in registry.KINDS:
        if kind is not None and kind != name:
            raise ValueError(f"kind: {kind!r} contradicts source {name!r}")
        kind = name
        if untrained:
            drafter = registry.build_untrained(kind, target, tokenizer, layers=layers,
                                               block_size=block_size, seed=seed,
                                               overrides=overrides)
        else:
            folder = shipped_checkpoint(kind)
            if folder is None:
                raise ValueError(f"source: the {kind} drafter ships no checkpoint; pass a "
                                 f"folder or untrained=True")
            drafter = registry.get(kind).cls.load(folder, target=target, overrides=overrides)
    else:
        if untrained:
            raise ValueError(f"untrained: needs a drafter kind as source, got {name!r}")
        folder = Path(source)
        if not folder.is_dir():
            what = "not a folder" if folder.exists() else "no such folder"
            raise FileNotFoundError(f"drafter checkpoint {folder}: {what} (nor a drafter kind: "
                                    f"{', '.join(registry.names())})")
        kind = kind or detect_kind(folder)
        drafter = registry.get(kind).cls.load(folder, target=target, overrides=overrides)
    if context_window is not None:
        if isinstance(context_window, bool) or not isinstance(context_window, int) or (
                context_window < 0):
            raise ValueError(f"context_window: must be None, 0 (every key) or >= 1, got "
                             f"{context_window!r}")
        if context_window and not drafter.supports_context_window:
            raise ValueError(f"context_window: the {kind} drafter has no context window option")
    window = drafter.default_context_window if context_window is None else (
        context_window or None)
    if attention_sinks < 0 or (attention_sinks and window is None):
        raise ValueError(f"attention_sinks: needs a context window and must be >= 0, got "
                         f"{attention_sinks} (context_window {context_window})")
    drafter.context_window = window
    drafter.attention_sinks = attention_sinks
    drafter.sharp = sharp if isinstance(sharp, SharpConfig) else sharp_config(
        drafter, bool(sharp), slope, n_ref)
    drafter.n_ref_source = n_ref_source(drafter, n_ref, sharp)
    return drafter.to(dtype=target.dtype)
