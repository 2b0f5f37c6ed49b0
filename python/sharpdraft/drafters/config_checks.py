"""Drafter config checks: the Llama geometry a drafter config copies from its target, the
validation every config runs in `__post_init__` (before any module is built), the check of a
config.json value against a field's annotation, and what keeps a drafter from reading a target's
hidden states. Raised errors are one line naming the config class (or file) and the field."""
from __future__ import annotations

import types
import typing
from typing import List, Optional

from transformers import LlamaConfig

from sharpdraft_ext.defaults import DEFAULT_N_REF

# SharpDraft's n_ref for a public checkpoint whose config records no training length
DEFAULT_TRAIN_CONTEXT = DEFAULT_N_REF


class ConfigKindError(ValueError):
    """A checkpoint's config.json holds the fields of another drafter kind (`Drafter.read_config`,
    a public format's `from_public`)."""


def is_int(v) -> bool:
    """An int that is not a bool (JSON integers)."""
    return isinstance(v, int) and not isinstance(v, bool)


def target_geometry(target_config) -> dict:
    """The Llama geometry a drafter config copies from its target's transformers config
    (hidden_size .. rope_parameters; head_dim defaults to hidden_size / heads)."""
    t = target_config
    return dict(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                num_attention_heads=t.num_attention_heads,
                num_key_value_heads=t.num_key_value_heads,
                head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
                rms_norm_eps=t.rms_norm_eps, hidden_act=t.hidden_act,
                max_position_embeddings=t.max_position_embeddings,
                rope_parameters=dict(t.rope_parameters))


def require_llama_layers(target, kind: str) -> None:
    """Refuse to start a drafter of `kind` from the target's decoder layers unless they are Llama
    layers (no q/k norms, no biases), the only ones its modules reproduce.

    Raises:
        ValueError naming the target's model_type and what to use instead.
    """
    model_type = getattr(target.config, "model_type", None)
    if model_type not in ("llama", None):
        raise ValueError(f"target model_type {model_type!r}: the {kind} drafter starts from the "
                         f"target's Llama decoder layers, and this target's differ (q/k norms or "
                         f"biases); use a Llama-family target, or a public drafter format (the "
                         f"public kinds take any Llama, Qwen2 or Qwen3 target)")


def llama_config(config, num_layers: int) -> LlamaConfig:
    """The transformers LlamaConfig a drafter's layers (MLP, norms, RoPE) are built from: the
    geometry fields of a drafter config (see `target_geometry`) and `num_layers` layers."""
    return LlamaConfig(hidden_size=config.hidden_size,
                       intermediate_size=config.intermediate_size,
                       num_attention_heads=config.num_attention_heads,
                       num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                       num_hidden_layers=num_layers, rms_norm_eps=config.rms_norm_eps,
                       hidden_act=config.hidden_act,
                       max_position_embeddings=config.max_position_embeddings,
                       rope_parameters=dict(config.rope_parameters))


def check_config(config, minimums: dict) -> None:
    """Validate a drafter config in its `__post_init__`, before any module is built.

    Raises:
        ValueError naming the config class and field(s): a field of `minimums` ({field: least
            value}) below its minimum; draft_vocab_size neither None nor >= 2; draft_threshold
            (where the config has one) outside [0, 1]; context_window (where it has one)
            neither None nor >= 1; a Llama geometry
            no attention can have (see `check_geometry`).
    """
    name = type(config).__name__
    check_geometry(config)
    for field_name, lo in minimums.items():
        value = getattr(config, field_name)
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"{name}.{field_name} must be >= {lo}, got {value!r}")
    if config.draft_vocab_size is not None and (
            isinstance(config.draft_vocab_size, bool)
            or not isinstance(config.draft_vocab_size, int) or config.draft_vocab_size < 2):
        raise ValueError(f"{name}.draft_vocab_size must be None or >= 2, got "
                         f"{config.draft_vocab_size}")
    check_draft_threshold(getattr(config, "draft_threshold", 0.0), f"{name}.draft_threshold")
    window = getattr(config, "context_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"{name}.context_window must be None or >= 1, got {window!r}")


def check_draft_threshold(value, where: str) -> float:
    """A config's draft threshold (chain drafting's measured default, `default_draft_threshold`)
    as a float.

    Raises:
        ValueError naming `where`: not a number in [0, 1].
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{where} must be a number in [0, 1], got {value!r}")
    return float(value)


GEOMETRY_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "head_dim")


def check_geometry(config) -> None:
    """The Llama geometry of a drafter config (the `GEOMETRY_FIELDS` it has) must describe an
    attention: every size >= 1, hidden_size a multiple of num_attention_heads (transformers'
    LlamaConfig, which builds the drafter's MLP, norms and RoPE, requires it) and
    num_attention_heads a multiple of num_key_value_heads (grouped-query attention).

    Raises:
        ValueError naming the config class and the fields (hidden_size, num_attention_heads,
            num_key_value_heads, head_dim) with their values.
    """
    name = type(config).__name__
    have = {f: getattr(config, f) for f in GEOMETRY_FIELDS if hasattr(config, f)}
    for f, v in have.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}.{f} must be an integer >= 1, got {v!r}")
    heads, kv = have.get("num_attention_heads"), have.get("num_key_value_heads")
    hidden, head_dim = have.get("hidden_size"), have.get("head_dim")
    if hidden is not None and heads is not None and hidden % heads:
        near = [h for h in range(heads - 1, 0, -1) if hidden % h == 0][:1] + \
            [h for h in range(heads + 1, hidden + 1) if hidden % h == 0][:1]
        raise ValueError(f"{name}: hidden_size {hidden} is not a multiple of "
                         f"num_attention_heads {heads} (head_dim {head_dim}); e.g. "
                         f"num_attention_heads {' or '.join(map(str, near))}")
    if heads is not None and kv is not None and heads % kv:
        raise ValueError(f"{name}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv} (grouped-query attention)")


def feature_layer_problems(config, target_config) -> List[str]:
    """What keeps a drafter that reads the target's hidden states (`target_hidden_size`-wide
    outputs of the decoder layers `target_layer_ids`) from reading those of this target; the
    DFlash and EAGLE-3 hooks of `Drafter.target_problems` call it."""
    problems = []
    if config.target_hidden_size != target_config.hidden_size:
        problems.append(f"target_hidden_size is {config.target_hidden_size}, the target's "
                        f"hidden_size is {target_config.hidden_size}")
    layers = target_config.num_hidden_layers
    bad = [i for i in config.target_layer_ids if not 0 <= i < layers]
    if bad:
        problems.append(f"target_layer_ids {list(config.target_layer_ids)} name layer(s) {bad}, "
                        f"the target has {layers} decoder layers (0 .. {layers - 1})")
    return problems



def json_type_problem(value, hint) -> Optional[str]:
    """Why a JSON value does not fit a config field's annotation (int, float, bool, str,
    list / List[X], dict, Optional[X]), as "an int" etc.; None when it fits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        problems = [json_type_problem(value, a) for a in args]
        return None if None in problems else " or ".join(p for p in problems if p)
    if hint is type(None):
        return None if value is None else "null"
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        return (None if isinstance(value, (int, float)) and not isinstance(value, bool)
                else "a number")
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if hint is list or origin is list:
        if not isinstance(value, list):
            return "a list"
        bad = [json_type_problem(v, args[0]) for v in value] if args else []
        return next((f"a list of {p.split(' ', 1)[-1]}s" for p in bad if p), None)
    if hint is dict or origin is dict:
        return None if isinstance(value, dict) else "an object"
    return None

