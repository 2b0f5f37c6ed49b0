"""What every drafter shares: a reduced draft vocabulary borrowed from the target's LM head, and
a checkpoint folder holding only the drafter's own weights.

A drafter subclasses `Drafter`, sets `config_class` (a dataclass serialised as config.json) and
implements `start(target, prompt_ids, hidden_states, target_cache=None)`, which returns a draft
session (`target_cache`: the target runtime's KV cache after the prefill, which a drafter may
read in place but never writes; the engine always passes it):

    session.propose(last, position, draw) -> (drafts, logits): n <= max_drafts draft tokens
        and their float32 logits (n, target vocab); row j - 1 is the distribution draft j was
        drawn from (`draw(row) -> token id`, argmax or a sample), given the committed tokens,
        `last` (committed, at `position`) and drafts 1 .. j - 1.
    session.commit(accepted, hidden_states) -> None; `accepted` are the tokens the verification
        committed after `last` (accepted drafts, then the target's own token), `hidden_states`
        the target's hidden states of the verification rows ([last] + drafts), or None when the
        drafter does not read them (`needs_hidden_states` False).
    session.state_bytes() -> int: bytes of the session's own state (its caches and pending
        features; not the weights, the target or the target's cache), what grows with the
        context for a full-prefix drafter.

`hidden_states` maps an index of transformers' output_hidden_states (0 = embeddings, l + 1 =
decoder layer l's output) to a (1, rows, hidden) tensor; it holds the indices listed by the
drafter's `hidden_layers` (a full output_hidden_states tuple also works).
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import List, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache, LlamaConfig

from sharpdraft_ext.defaults import DEFAULT_N_REF

from ..target.kv_cache import PreallocatedCache
from ..target.linears import as_packed, plan_linears

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# SharpDraft's n_ref for a public checkpoint whose config records no training length
DEFAULT_TRAIN_CONTEXT = DEFAULT_N_REF


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
            (where the config has one) outside [0, 1]; a Llama geometry
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


class HeadProjections(nn.Module):
    """q/k/v projections from `in_features` and the output projection back to hidden_size, as
    in a Llama attention block (no biases), with the head split/merge helpers."""

    def __init__(self, config, in_features: int):
        super().__init__()
        d = config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads,
                                                            config.num_key_value_heads, d)
        self.q_proj = nn.Linear(in_features, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, config.hidden_size, bias=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """(B, L, n * d) -> (B, n, L, d)."""
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """(B, Hq, L, d) attention output -> (B, L, hidden)."""
        return self.o_proj(o.transpose(1, 2).flatten(2))


def last_keys(k: torch.Tensor, v: torch.Tensor, window: Optional[int], own: int = 0,
              attn_mask: Optional[torch.Tensor] = None) -> tuple:
    """Views of the last `window` context keys (plus the `own` rows of the current step at the
    end), and the matching columns of `attn_mask`; everything when window is None."""
    if window is None or k.shape[2] <= window + own:
        return k, v, attn_mask
    keep = window + own
    return (k[:, :, -keep:], v[:, :, -keep:],
            None if attn_mask is None else attn_mask[..., -keep:])


def window_mask(rows: torch.Tensor, first_draft: int,
                window: Optional[int]) -> Optional[torch.Tensor]:
    """(1, 1, L, rows[-1] + 1) bool inference mask of rows at positions `rows` (increasing,
    contiguous, ending the keys): causal, and row p sees keys >= min(p, first_draft) - window.
    None when window is None or no row would lose a key (plain bottom-right causal)."""
    if window is None or min(int(rows[-1]), first_draft) - window <= 0:
        return None
    keys = torch.arange(int(rows[-1]) + 1, device=rows.device)
    start = torch.minimum(rows, torch.full_like(rows, first_draft)) - window
    return ((keys[None, :] <= rows[:, None]) & (keys[None, :] >= start[:, None]))[None, None]


def state_bytes(*parts) -> int:
    """Bytes held by tensors, transformers caches (their layers' keys and values) and lists of
    them: what a session's `state_bytes` reports."""
    total = 0
    for x in parts:
        if isinstance(x, torch.Tensor):
            total += x.nbytes
        elif isinstance(x, (list, tuple)):
            total += state_bytes(*x)
        elif hasattr(x, "layers"):                     # a transformers Cache
            total += state_bytes(*[t for layer in x.layers
                                   for t in (getattr(layer, "keys", None),
                                             getattr(layer, "values", None)) if t is not None])
    return total


def session_cache(target_cache, num_layers: int, extra: int):
    """A drafter session's KV cache of `num_layers` layers: a `PreallocatedCache` (keys and values
    written in place) sized for the run, the target runtime cache's capacity plus `extra` rows
    that one step may append past the committed ones, when `target_cache` has a capacity; else
    a DynamicCache (which copies all of its rows on every append)."""
    capacity = getattr(target_cache, "capacity", None)
    return PreallocatedCache(num_layers, capacity + extra) if capacity else DynamicCache()


def crop_to(cache, length: int) -> None:
    """Drop the entries of a session cache (`session_cache`) past the first `length`
    positions."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def draw_rows(logits: torch.Tensor, draw) -> tuple:
    """Parallel drafters: draft j is drawn from row j - 1 alone; returns (drafts, logits)."""
    return [draw(row) for row in logits], logits


class ConfigKindError(ValueError):
    """A checkpoint's config.json holds the fields of another drafter kind (`read_config`)."""


def _json_type_problem(value, hint) -> Optional[str]:
    """Why a JSON value does not fit a config field's annotation (int, float, bool, str,
    list / List[X], dict, Optional[X]), as "an int" etc.; None when it fits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        problems = [_json_type_problem(value, a) for a in args]
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
        bad = [_json_type_problem(v, args[0]) for v in value] if args else []
        return next((f"a list of {p.split(' ', 1)[-1]}s" for p in bad if p), None)
    if hint is dict or origin is dict:
        return None if isinstance(value, dict) else "an object"
    return None


def read_safetensors_header(path) -> dict:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a safetensors file, read from its
    header alone (an 8-byte little-endian header length, then that many bytes of JSON), after
    checking that the file is as long as the header says.

    Raises:
        FileNotFoundError: no such file.
        ValueError naming the file: too short for a header, a header that is not safetensors
            JSON, or a file truncated (or padded) against its header's data offsets.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} is not a safetensors file ({size} bytes, fewer than "
                             f"its 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"{path.name} is truncated or not a safetensors file ({size} "
                             f"bytes, its first 8 bytes announce a {n}-byte header)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path.name} is not a safetensors file (its header is not JSON: "
                         f"{err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} is not a safetensors file (its header is not a JSON "
                         f"object)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = 0
    for name, entry in tensors.items():
        ok = (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
              and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
              and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
              and all(isinstance(o, int) for o in entry["data_offsets"]))
        if not ok:
            raise ValueError(f"{path.name} is not a safetensors file (header entry {name!r} "
                             f"lacks a shape or data offsets)")
        end = max(end, entry["data_offsets"][1])
    expected = 8 + n + end
    if size < expected:
        raise ValueError(f"{path.name} is truncated ({size} bytes, header says {expected})")
    if size > expected:
        raise ValueError(f"{path.name} has {size - expected} bytes past its last tensor "
                         f"({size} bytes, header says {expected}): not a whole safetensors file")
    return tensors


def weights_problems(expected: dict, header: dict) -> List[str]:
    """How the tensors of a safetensors header ({name: {"shape": ...}}) differ from the
    `expected` ({name: shape tuple}, a state_dict's names and shapes): each mismatching shape
    (file vs config), then the missing and the unexpected tensor names; empty when they match."""
    problems = []
    for name, shape in expected.items():
        if name in header and tuple(header[name]["shape"]) != tuple(shape):
            problems.append(f"{name} has shape {tuple(header[name]['shape'])} in the file, the "
                            f"config implies {tuple(shape)}")
    missing = [k for k in expected if k not in header]
    if missing:
        problems.append(f"missing tensor(s) {', '.join(missing[:4])}"
                        + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                        + f" (the config implies {tuple(expected[missing[0]])} for {missing[0]})")
    unexpected = [k for k in header if k not in expected]
    if unexpected:
        problems.append(f"unexpected tensor(s) {', '.join(unexpected[:4])}"
                        + (f" and {len(unexpected) - 4} more" if len(unexpected) > 4 else "")
                        + " (no place for them in a model of this config)")
    return problems


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


class Drafter(nn.Module):
    """Base class: draft vocabulary (`d2t` buffer), LM head borrowed from the target, save/load."""

    config_class = None
    needs_hidden_states = True
    drafts_trees = False          # sessions also have propose_tree (tree_speculative_generate)
    # Sessions draft one token per drafter forward and take propose(..., stop_below=p): they
    # stop after the first draft whose drafter probability (temperature 1) is below p, the
    # draft at which the engine's draft_threshold cuts anyway, sparing the forwards after it.
    drafts_one_by_one = False
    # The config fields that shape a draft tree (inference options, no effect on the weights),
    # settable at load time (`load_drafter(overrides=...)`, the CLI's --tree-* flags).
    tree_options: tuple = ()
    # Inference option: attend only to the last `context_window` context keys (None: all of
    # them). Drafters that honour it set supports_context_window (a drafter trained on
    # short sequences misplaces attention at distances it never saw; a window keeps it in
    # distribution, and n_i, hence SharpDraft's beta, counts the keys actually seen).
    context_window: Optional[int] = None
    supports_context_window = False
    # Each attention row's softmax is one kernel call (what `analysis.mass` probes); False for
    # a drafter that splits one softmax over several calls merged by log-sum-exp.
    one_softmax_per_call = True
    # Teacher-forced blocks that online fine-tuning can train on (`eval.adapt.OnlineAdapter`).
    adapts_online = False

    def _apply(self, fn, recurse=True):
        """`nn.Module._apply` (what .to / .half / .cuda run), keeping RoPE's inverse frequencies
        (buffers named *inv_freq) in float32: the reference implementations compute the angles
        in float32, and a bfloat16 inv_freq is off by up to 0.4%, radians at long positions."""
        kept = {name: buf for name, buf in self.named_buffers()
                if name.endswith("inv_freq") and buf.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            owner, _, attr = name.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            now = module._buffers[attr]
            if now.dtype != torch.float32 and now.device.type != "meta":
                module._buffers[attr] = buf.to(now.device)
        return self

    @property
    def hidden_layers(self) -> list:
        """Indices of the target hidden states the drafter reads, numbered as transformers'
        output_hidden_states (layer l's output is index l + 1): what the target runtime
        captures; empty when `needs_hidden_states` is False."""
        if not self.needs_hidden_states:
            return []
        return [i + 1 for i in self.config.target_layer_ids]

    def _init_draft_vocab(self, draft_vocab_size: Optional[int]) -> None:
        if draft_vocab_size is not None:  # draft id -> target id (set by training)
            self.register_buffer("d2t", torch.arange(draft_vocab_size), persistent=True)
        else:
            self.d2t = None

    @property
    def default_draft_threshold(self) -> float:
        """Chain drafting's draft threshold when the caller gives none (`sharpdraft.generate`,
        the CLI's --draft-threshold): the config's measured `draft_threshold`, else 0.0 (every
        draft verified; a public config.json carries it as the top-level `draft_threshold` when
        our export wrote it, and others have none)."""
        return float(getattr(getattr(self, "config", None), "draft_threshold", 0.0) or 0.0)

    @property
    def max_tree_nodes(self) -> int:
        """Nodes of the largest draft tree a session proposes (0 for a chain-only drafter)."""
        return 0

    @property
    def max_tree_depth(self) -> int:
        """Depth of the deepest draft tree a session proposes (0 for a chain-only drafter)."""
        return 0

    def tree_shape(self) -> dict:
        """{field: value} of the `tree_options` config fields ({} for a chain-only drafter)."""
        return {f: getattr(self.config, f) for f in self.tree_options}

    def sharp_variants(self) -> dict:
        """{suffix: drafter} of the ways SharpDraft can act on this drafter, for the bench to
        compare ("" : itself, when there is one way)."""
        return {"": self}

    # ----- vocabulary -----------------------------------------------------------------------
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Set the draft vocabulary: `target_ids` (draft_vocab_size,) distinct target token ids.

        Raises:
            ValueError: the drafter has no draft vocabulary, or target_ids has the wrong shape or
                repeats an id.
        """
        if self.d2t is None:
            raise ValueError("set_draft_vocab: this drafter drafts over the full target vocabulary"
                             " (config.draft_vocab_size is None)")
        ids = torch.as_tensor(target_ids, dtype=torch.long)
        if ids.shape != self.d2t.shape or ids.unique().numel() != ids.numel():
            raise ValueError(f"set_draft_vocab: target_ids must be {tuple(self.d2t.shape)} "
                             f"distinct ids, got shape {tuple(ids.shape)}")
        self.d2t.copy_(ids)

    def head(self, target, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary through the target's LM head (rows d2t), float32."""
        lm_head = target.get_output_embeddings()
        if self.d2t is None:
            return lm_head(h).float()
        if torch.is_grad_enabled() and lm_head.weight.requires_grad:
            bias = lm_head.bias[self.d2t] if getattr(lm_head, "bias", None) is not None else None
            return torch.nn.functional.linear(h, lm_head.weight[self.d2t], bias).float()
        return self._draft_head(lm_head)(h).float()

    def _draft_head(self, lm_head: nn.Module) -> nn.Module:
        """The target LM head's rows d2t as one linear layer (prepacked like the target's, see
        sharpdraft.target), gathered once and again only when the head's weight, its dtype
        or d2t change, instead of gathering (draft vocab x hidden) floats on every call."""
        w = lm_head.weight
        paths = getattr(self, "_sharpdraft_packed", None)     # prepare_drafter's path set
        paths = paths if isinstance(paths, tuple) else None
        key = (w.data_ptr(), w._version, w.dtype, self.d2t.data_ptr(), self.d2t._version,
               paths)
        cached = self.__dict__.get("_draft_head_cache")
        if cached is None or cached[0] != key:
            bias = getattr(lm_head, "bias", None)
            linear = nn.Linear(w.shape[1], self.d2t.numel(), bias=bias is not None,
                               device=w.device, dtype=w.dtype).requires_grad_(False)
            with torch.no_grad():
                linear.weight.copy_(w[self.d2t])
                if bias is not None:
                    linear.bias.copy_(bias[self.d2t])
            cached = (key, as_packed(linear, plan_linears(linear, paths=paths)))
            self.__dict__["_draft_head_cache"] = cached     # not a submodule: no state_dict
        return cached[1]

    def to_target_vocab(self, target, logits: torch.Tensor) -> torch.Tensor:
        """(n, draft vocab) logits -> (n, target vocab), -inf outside the draft vocabulary (so
        the draft assigns those tokens probability 0 and sampling stays lossless)."""
        if self.d2t is None:
            return logits
        full = logits.new_full((logits.shape[0], target.get_output_embeddings().weight.shape[0]),
                               float("-inf"))
        return full.index_copy_(1, self.d2t, logits)

    # ----- fitting a target -------------------------------------------------------------------
    def target_problems(self, target) -> List[str]:
        """Why this drafter cannot draft for `target` (a transformers causal LM), one line per
        config field; empty when it can. The base checks what every drafter borrows from the
        target (token embeddings and LM head: hidden_size, the draft vocabulary); a drafter
        extends it with its own fields."""
        c, t = self.config, target.config
        problems = []
        if c.hidden_size != t.hidden_size:
            problems.append(f"hidden_size is {c.hidden_size}, the target's hidden_size is "
                            f"{t.hidden_size} (the drafter uses the target's token embeddings "
                            f"and LM head)")
        vocab = target.get_output_embeddings().weight.shape[0]
        if self.d2t is not None:
            if self.d2t.numel() > vocab:
                problems.append(f"draft_vocab_size is {self.d2t.numel()}, larger than the "
                                f"target's vocabulary of {vocab} tokens")
            elif self.d2t.numel() and not 0 <= int(self.d2t.min()) <= int(self.d2t.max()) < vocab:
                problems.append(f"the draft vocabulary (d2t) maps to target token ids up to "
                                f"{int(self.d2t.max())}, the target's vocabulary has {vocab} "
                                f"tokens")
        return problems

    def check_target(self, target, checkpoint=None) -> None:
        """Check that this drafter can draft for `target` (see `target_problems`).

        Raises:
            ValueError naming the checkpoint's config.json (when a folder is given) and every
                mismatching field.
        """
        problems = self.target_problems(target)
        if problems:
            where = (f"drafter checkpoint {Path(checkpoint) / CONFIG_FILE}"
                     if checkpoint is not None else f"this {type(self).__name__}")
            raise ValueError(f"{where} does not fit the target "
                             f"({getattr(target.config, 'name_or_path', '') or 'given'}): "
                             + "; ".join(problems))

    # ----- checkpoints ------------------------------------------------------------------------
    def save(self, folder) -> None:
        """Write config.json and model.safetensors (the drafter's own weights) to `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(self.config), indent=2))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()},
                  str(folder / WEIGHTS_FILE))

    @classmethod
    def read_config(cls, folder, overrides: Optional[dict] = None):
        """The `config_class` instance of a checkpoint folder's config.json, with `overrides`
        ({field: value}, validated like the file's own fields) applied.

        Raises:
            FileNotFoundError naming the folder: it is not a folder or lacks config.json.
            ValueError naming the folder, config.json and the field: config.json is not JSON
                (with the position of the error), is not a config of this drafter kind
                (unknown or missing fields, e.g. a checkpoint of another kind), holds a value of
                the wrong JSON type or an invalid value (the config's own validation).
        """
        kind = cls.config_class.__name__
        folder = Path(folder)
        raw = read_config_json(folder)
        if not isinstance(raw, dict):
            raise ValueError(f"drafter checkpoint {folder}: {CONFIG_FILE} must hold a JSON "
                             f"object of {kind} fields")
        fields = dataclasses.fields(cls.config_class)
        names = {f.name for f in fields}
        required = {f.name for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING}
        bad = sorted(set(overrides or {}) - names)
        if bad:
            raise ValueError(f"overrides: {', '.join(bad)} not field(s) of {kind}")
        raw = dict(raw, **(overrides or {}))
        unknown, missing = sorted(set(raw) - names), sorted(required - set(raw))
        if unknown or missing:
            parts = ([f"unknown field(s) {', '.join(unknown)}"] if unknown else []) + (
                [f"missing field(s) {', '.join(missing)}"] if missing else [])
            raise ConfigKindError(f"drafter checkpoint {folder}: {CONFIG_FILE} is not a "
                                  f"{kind} ({'; '.join(parts)}): a checkpoint of another "
                                  f"drafter kind?")
        hints = typing.get_type_hints(cls.config_class)
        for f in fields:
            if f.name in raw:
                want = _json_type_problem(raw[f.name], hints.get(f.name, typing.Any))
                if want:
                    raise ValueError(f"drafter checkpoint {folder}: {CONFIG_FILE}: {f.name} "
                                     f"must be {want}, got {json.dumps(raw[f.name])}")
        try:
            return cls.config_class(**raw)
        except (TypeError, ValueError) as err:
            raise ValueError(f"drafter checkpoint {folder}: {CONFIG_FILE}: {err}") from None

    @classmethod
    def check_weights(cls, folder, config, sharp=None) -> None:
        """Check a checkpoint's model.safetensors against `config` before loading it: the file
        is whole (`read_safetensors_header`) and holds exactly the tensors, with the shapes, of
        the state_dict of `cls(config)` (built on the meta device: no memory, no weights read).

        Raises:
            FileNotFoundError naming the folder: no model.safetensors.
            ValueError naming the folder and the first mismatching tensor with its shape in the
                file and the shape the config implies, the missing or unexpected tensors, or a
                truncated / unreadable file.
        """
        folder = Path(folder)
        path = folder / WEIGHTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"drafter checkpoint {folder}: missing {WEIGHTS_FILE}")
        try:
            header = read_safetensors_header(path)
        except ValueError as err:
            raise ValueError(f"drafter checkpoint {folder}: {err}") from None
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in cls(config, sharp).state_dict().items()}
        problems = weights_problems(expected, header)
        if problems:
            raise ValueError(f"drafter checkpoint {folder}: {WEIGHTS_FILE} does not match its "
                             f"{CONFIG_FILE}: {problems[0]}"
                             + (f" (and {len(problems) - 1} more difference(s))"
                                if len(problems) > 1 else ""))

    @classmethod
    def load(cls, folder, sharp=None, device: Optional[torch.device] = None, target=None,
             overrides: Optional[dict] = None):
        """Build a drafter from a folder written by `save`.

        Args:
            overrides: {config field: value} applied over config.json (e.g. the tree shape).
            target: the target model it will draft for; when given the drafter is checked
                against it (`check_target`) before it is returned.

        Raises:
            FileNotFoundError naming the folder: not a folder, or no config.json or
                model.safetensors.
            ValueError naming the folder: config.json is not JSON, not of this drafter kind
                or invalid (`read_config`), the weights do not match it (`check_weights`, before
                any weight is read), or the drafter does not fit `target` (naming each
                mismatching field).
        """
        folder = Path(folder)
        config = cls.read_config(folder, overrides)
        cls.check_weights(folder, config, sharp)
        model = cls(config, sharp)
        try:
            model.load_state_dict(load_file(str(folder / WEIGHTS_FILE),
                                            device=str(device or "cpu")))
        except (RuntimeError, SafetensorError) as err:    # what check_weights cannot see
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"drafter checkpoint {folder}: {WEIGHTS_FILE} cannot be loaded "
                             f"into its {CONFIG_FILE}'s model: {first}") from err
        if target is not None:
            model.check_target(target, checkpoint=folder)
        return model.eval()
