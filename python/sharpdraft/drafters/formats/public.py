"""The one load / save / check of a public drafter folder, shared by every public format.

`PublicFormat` is mixed into a public format's Drafter class (`class ZLabDFlashDrafter(
PublicFormat, Drafter)`); the format's own module in this package says only what differs (its
config translation `from_public` / `to_public`, tensor-name map, checks), through the hooks
below. `load(folder)` always runs the same steps, each failing with one line naming the folder,
the file and the field or tensor before the next starts:

    config.json -> config      `read_config` (the config class's `from_public`, then `overrides`)
    folder checks, target      `prepare_config` (e.g. resolve defaults that depend on the target)
    tensor names and shapes    `formats.files.weight_index` (safetensors headers; no weight read)
    the tensors the format reads, the config's weight-dependent fields, the shapes the config
      implies                  `usable_shapes`, `fit_to_weights`, `check_shapes`
    the weights                `formats.files.read_weights`, then `check_state` (values)
    the model                  built on the meta device, the weights assigned (`internal_state`),
                               non-persistent buffers rebuilt on the device (`rebuild_buffers`)
    the target                 `check_target` when a target is given

`save(folder)` writes config.json (`to_public`, the weights' dtype recorded) and
model.safetensors (`public_state_dict`), each to a temporary name then renamed.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, Optional

import torch
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..config_checks import ConfigKindError, check_draft_threshold, is_int
from .files import (CONFIG_FILE, check_tensors, read_config_json, read_weights, save_folder,
                    weight_index, weights_dtype)

DRAFT_THRESHOLD_KEY = "draft_threshold"     # SharpDraft's extension, top level of config.json
EXTRAS_KEY = "sharpdraft"                   # SharpDraft's inference options in config.json
ROPE_TYPES = ("default",) + tuple(ROPE_INIT_FUNCTIONS)


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


class PublicFormat:
    """The shared load / save / check of a public format's Drafter class (see the module
    docstring). Class attributes: `dtype_tensor`, the public name of the tensor whose dtype the
    drafter is built in on load and recorded as on save; `dtype_keys`, the config.json keys
    written with that dtype when config.json has none of dtype / torch_dtype; `optional_tensors`,
    public names the config implies but a folder may lack."""

    dtype_tensor = "fc.weight"
    dtype_keys: tuple = ()
    optional_tensors: frozenset = frozenset()

    # ----- hooks (defaults: nothing differs) -------------------------------------------------
    def public_name(self, name: str) -> Optional[str]:
        """The public tensor name of the state_dict entry `name` (None: not stored)."""
        return name

    def public_state_dict(self) -> Dict[str, torch.Tensor]:
        """{public tensor name: tensor}: what `save` writes."""
        return {self.public_name(k): v for k, v in self.state_dict().items()
                if self.public_name(k) is not None}

    @classmethod
    def prepare_config(cls, folder: Path, config, target):
        """The config `load` builds from, given the folder and the target (None when not
        given), before any weight file is opened. Raises ValueError naming the folder."""
        return config

    @staticmethod
    def usable_shapes(shapes: dict) -> dict:
        """`weight_index`'s {name: (file, shape)} without the tensors the format never reads."""
        return shapes

    @staticmethod
    def fit_to_weights(config, names):
        """The config with the fields that depend on which tensors a folder holds (`names`)."""
        return config

    @classmethod
    def unexpected_hint(cls, config, shapes: dict) -> str:
        """What the check's message adds for this folder's tensors ("; ..." or "")."""
        return ""

    @classmethod
    def check_state(cls, folder: Path, config, state: dict, shapes: dict) -> None:
        """Checks of the tensors' values once read. Raises ValueError naming the folder, the
        file and the tensor."""

    @classmethod
    def internal_state(cls, config, state: dict, dtype: torch.dtype) -> dict:
        """{state_dict name: tensor} the model is assigned from the public tensors `state`
        (default: the same names, in `dtype`)."""
        return {k: v.to(dtype) for k, v in state.items()}

    def rebuild_buffers(self, device: str) -> None:
        """Rebuild on `device` what a model built on the meta device lacks after its weights are
        assigned (non-persistent buffers such as RoPE's frequencies; ties)."""

    # ----- the skeleton ----------------------------------------------------------------------
    @classmethod
    def read_config(cls, folder, overrides: Optional[dict] = None):
        """The config of a public folder's config.json (`config_class.from_public`), with
        `overrides` ({config field: value}) applied and validated.

        Raises:
            FileNotFoundError naming the folder: not a folder, or no config.json.
            ConfigKindError: config.json is another drafter kind's.
            ValueError naming the folder, config.json and the field.
        """
        return read_public_config(folder, cls.config_class, overrides)

    @classmethod
    def expected_shapes(cls, config) -> Dict[str, tuple]:
        """{public tensor name: shape} that `config` implies (built on the meta device)."""
        with torch.device("meta"):
            model = cls(config)
        return {model.public_name(k): tuple(v.shape) for k, v in model.state_dict().items()
                if model.public_name(k) is not None}

    @classmethod
    def check_shapes(cls, folder: Path, config, shapes: dict) -> None:
        """Refuse tensors (`weight_index`'s {name: (file, shape)}) whose names or shapes differ
        from `expected_shapes(config)`. Raises ValueError naming the folder, the file, the
        first difference and how many follow."""
        expected = {k: v for k, v in cls.expected_shapes(config).items()
                    if k in shapes or k not in cls.optional_tensors}
        check_tensors(folder, expected, shapes, cls.unexpected_hint(config, shapes))

    @classmethod
    def check_weights(cls, folder, config, sharp=None) -> None:
        """Check a folder's tensors (names and shapes, from the file headers; a
        pytorch_model.bin is unpickled with weights_only=True to see them) against `config`,
        before any weight is read.

        Raises:
            FileNotFoundError naming the folder: no weights file.
            ValueError naming the folder, the file and the tensor: a shape that differs from the
                one config.json implies, a missing tensor, an unexpected tensor.
        """
        shapes = cls.usable_shapes(weight_index(folder)[1])
        cls.check_shapes(Path(folder), cls.fit_to_weights(config, shapes), shapes)

    @classmethod
    def load(cls, folder, sharp=None, device: Optional[torch.device] = None, target=None,
             overrides: Optional[dict] = None):
        """Build a drafter from a public folder, in the dtype of its `dtype_tensor`, on `device`
        (default CPU), in eval mode.

        Args:
            sharp: the SharpConfig (default: mode "none", n_ref = config.train_context).
            target: the target it drafts for: what `prepare_config` may need, and the drafter
                is checked against it (`check_target`).
            overrides: {config field: value} over config.json.

        Raises:
            FileNotFoundError naming the folder: not a folder, no config.json, no weights file.
            ConfigKindError: config.json is another drafter kind's.
            ValueError naming the folder, the file and the field or tensor: config.json not
                JSON or invalid (`read_config`), what `prepare_config` refuses, tensors that do
                not match config.json (checked from the headers before any weight is read), bad
                tensor values (`check_state`), a `dtype_tensor` that is not floating point, or
                a target it does not fit.
        """
        folder = Path(folder)
        config = cls.prepare_config(folder, cls.read_config(folder, overrides), target)
        _, shapes, state = weight_index(folder)
        shapes = cls.usable_shapes(shapes)
        config = cls.fit_to_weights(config, shapes)
        cls.check_shapes(folder, config, shapes)
        dev = str(device or "cpu")
        state = read_weights(folder, shapes, state, dev)
        cls.check_state(folder, config, state, shapes)
        dtype = weights_dtype(folder, state, cls.dtype_tensor)
        internal = cls.internal_state(config, state, dtype)
        with torch.device("meta"):
            model = cls(config, sharp)
        model.load_state_dict(internal, assign=True)
        model.rebuild_buffers(dev)
        if target is not None:
            model.check_target(target, checkpoint=folder)
        return model.eval()

    def save(self, folder) -> None:
        """Write the public layout into `folder` (created): config.json (`config.to_public()`,
        its dtype / torch_dtype keys, else `dtype_keys`, set to the weights' dtype) and
        model.safetensors (`public_state_dict`), each atomically (`formats.files.save_folder`)."""
        cfg = self.config.to_public()
        state = self.public_state_dict()
        dtype = str(state[self.dtype_tensor].dtype).removeprefix("torch.")
        for key in [k for k in ("dtype", "torch_dtype") if k in cfg] or self.dtype_keys:
            cfg[key] = dtype
        save_folder(folder, cfg, state)


# ----- config.json fields every public format reads the same way ------------------------------
def check_int_fields(config, minimums: dict) -> None:
    """In a config's `__post_init__`: each field of `minimums` ({field: least value}) an integer
    (not a bool) >= its least value.

    Raises:
        ValueError naming the config class and the field.
    """
    for f, lo in minimums.items():
        v = getattr(config, f)
        if not is_int(v) or v < lo:
            raise ValueError(f"{type(config).__name__}.{f} must be an integer >= {lo}, got {v!r}")


def check_layer_fields(config) -> None:
    """In a config's `__post_init__`: rms_norm_eps a number > 0 and hidden_act an activation
    transformers knows.

    Raises:
        ValueError naming the config class and the field.
    """
    name, eps = type(config).__name__, config.rms_norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"{name}.rms_norm_eps must be a number > 0, got {eps!r}")
    if config.hidden_act not in ACT2FN:
        raise ValueError(f"{name}.hidden_act {config.hidden_act!r} is not an activation "
                         f"transformers knows")


def read_extensions(raw: dict, where) -> dict:
    """SharpDraft's top-level extensions of a public config.json, as config fields:
    {"train_context": the recorded training length or None, "sharp_slopes": calibrated slopes or
    None, "draft_threshold": `read_draft_threshold`}.

    Raises:
        ValueError naming `where` and the field: train_context not an integer >= 1, sharp_slopes
            not a list, draft_threshold not a number in [0, 1].
    """
    train, slopes = raw.get("train_context"), raw.get("sharp_slopes")
    if train is not None and (not is_int(train) or train < 1):
        raise ValueError(f"{where}: train_context must be an integer >= 1, got "
                         f"{json.dumps(train)}")
    if slopes is not None and not isinstance(slopes, list):
        raise ValueError(f"{where}: sharp_slopes must be a list, got {json.dumps(slopes)}")
    return {"train_context": train, "sharp_slopes": slopes,
            "draft_threshold": read_draft_threshold(raw, where)}


def write_extensions(out: dict, config) -> None:
    """Write into config.json's dict `out` what `read_extensions` reads back from `config`:
    train_context (when the config records one), sharp_slopes (when calibrated) and
    draft_threshold (when measured, > 0)."""
    if config.records_train_context:
        out["train_context"] = config.train_context
    if config.sharp_slopes is not None:
        out["sharp_slopes"] = config.sharp_slopes
    if config.draft_threshold:
        out[DRAFT_THRESHOLD_KEY] = config.draft_threshold


def read_options(raw: dict, where, options: tuple, nullable: tuple = ()) -> dict:
    """SharpDraft's inference options of a public config.json, the object under "sharpdraft"
    ({option: integer >= 1}; an option of `nullable` may be null, then left out): {option: value}
    of those present.

    Raises:
        ValueError naming `where` and the key: not an object, a key not among `options`, a value
            that is not an integer >= 1.
    """
    found = raw.get(EXTRAS_KEY)
    if found is None:
        return {}
    if not isinstance(found, dict):
        raise ValueError(f"{where}: {EXTRAS_KEY} must be an object of {', '.join(options)}, "
                         f"got {json.dumps(found)}")
    unknown = [k for k in found if k not in options]
    if unknown:
        raise ValueError(f"{where}: {EXTRAS_KEY} has unknown key(s) "
                         f"{', '.join(f'{EXTRAS_KEY}.{k}' for k in unknown)} (known: "
                         f"{', '.join(options)})")
    out = {}
    for key, v in found.items():
        if v is None and key in nullable:
            continue
        if not is_int(v) or v < 1:
            raise ValueError(f"{where}: {EXTRAS_KEY}.{key} must be an integer >= 1, got "
                             f"{json.dumps(v)}")
        out[key] = v
    return out


def read_int(raw: dict, key: str, where, default: Optional[int] = None, lo: int = 1) -> int:
    """The integer config.json field `key` (>= `lo`), `default` when it is absent or null.

    Raises:
        ValueError naming `where` and the field: missing (and no default), or not an integer
            >= lo.
    """
    if raw.get(key) is None:
        if default is None:
            raise ValueError(f"{where}: missing {key}")
        return default
    v = raw[key]
    if not is_int(v) or v < lo:
        raise ValueError(f"{where}: {key} must be an integer >= {lo}, got {json.dumps(v)}")
    return v


def read_number(raw: dict, key: str, where, default: float) -> float:
    """The number config.json field `key` (> 0), `default` when it is absent.

    Raises:
        ValueError naming `where` and the field: not a number > 0.
    """
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"{where}: {key} must be a number > 0, got {json.dumps(v)}")
    return float(v)


def read_rope(raw: dict, where) -> dict:
    """The RoPE of a Llama-style public config.json as transformers' rope_parameters
    ({"rope_type", "rope_theta", ...}): its rope_parameters (transformers 5), else rope_theta
    (default 10000) with rope_scaling.

    Raises:
        ValueError naming `where` and the field: not an object, a rope_theta that is not a
            number > 0, a rope_type transformers does not know, multimodal RoPE (mrope_section),
            a scaled type without a numeric factor.
    """
    if raw.get("rope_parameters") is not None:
        rope = raw["rope_parameters"]
        if not isinstance(rope, dict) or not isinstance(rope.get("rope_theta"), (int, float)):
            raise ValueError(f"{where}: rope_parameters must be an object with a numeric "
                             f"rope_theta, got {json.dumps(rope)}")
        rope, label = dict(rope), "rope_parameters"
    else:
        theta = read_number(raw, "rope_theta", where, 10000.0)
        scaling = raw.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ValueError(f"{where}: rope_scaling must be an object or null, got "
                             f"{json.dumps(scaling)}")
        rope, label = dict(scaling, rope_theta=theta), "rope_scaling"
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    rope.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: {label}.rope_type {json.dumps(rope_type)} is not one of "
                         f"{', '.join(ROPE_TYPES)}")
    if "mrope_section" in rope:
        raise ValueError(f"{where}: {label}.mrope_section (multimodal RoPE) is not supported")
    if rope_type in ("linear", "dynamic", "llama3", "yarn") and not isinstance(
            rope.get("factor"), (int, float)):
        raise ValueError(f"{where}: {label} of type {rope_type} needs a numeric factor")
    return {"rope_type": rope_type, **rope}
