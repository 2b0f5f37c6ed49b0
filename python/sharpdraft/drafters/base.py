"""The Drafter base class: what every drafter shares. A reduced draft vocabulary borrowed from the
target's LM head (`d2t`), the checks that a drafter fits a target, and a checkpoint folder
holding only the drafter's own weights (config.json + model.safetensors, `formats.files`).

A drafter subclasses `Drafter`, sets `config_class` (a dataclass serialised as config.json) and
implements `start(target, prompt_ids, hidden_states, target_cache=None)`, which returns a draft
session: the protocol the engine calls (`propose`, `commit`, `state_bytes`, and `propose_tree`
for a drafter that drafts trees) is `protocol.DraftSession`, with the shapes and meanings of its
arguments.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import List, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..target.linears import as_packed, plan_linears
from .config_checks import ConfigKindError, json_type_problem
from .formats.files import (CONFIG_FILE, WEIGHTS_FILE, read_config_json, replace_atomically,
                            tensor_shapes, weights_problems)


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
    # With a context window: the first `attention_sinks` positions stay visible to every row
    # too (StreamingLLM's attention sinks: softmax mass that has nowhere else to go lands on
    # the first tokens; `layers.last_keys`). n_i counts them.
    attention_sinks: int = 0
    # Each attention row's softmax is one kernel call (what `eval.mass` probes); False for
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
    def fused_step(self) -> Optional[str]:
        """The name of the fused CPU op this drafter drafts through since its last preparation
        for a target (`prepare_drafter`), or None: its modules draft (what `generate`'s JSON
        report gives as `fused_draft_step`)."""
        step = self.__dict__.get("_fused_step")
        return None if step is None else step.name

    def _fused(self):
        """The fused CPU step `prepare_for_target` built (`drafters.fused`), or None."""
        return self.__dict__.get("_fused_step")

    def _set_fused_step(self, kind, target, quantised: bool) -> None:
        """`prepare_for_target`'s part for a drafter with a fused CPU step class `kind`
        (`kind.build(drafter, target, reuse)`): built for a quantised target, the old one reused
        while its weights are unchanged; none for a float target."""
        self.__dict__["_fused_step"] = (kind.build(self, target, self._fused()) if quantised
                                        else None)

    def _refresh_fused_step(self, target) -> None:
        """Rebuild the fused step when the weights changed since it was built (a session's
        start: training or a load_state_dict in between)."""
        step = self._fused()
        if step is not None and not step.fresh(self, target):
            self.prepare_for_target(target, quantised=True)

    @property
    def default_draft_threshold(self) -> float:
        """Chain drafting's draft threshold when the caller gives none (`sharpdraft.generate`,
        the CLI's --draft-threshold): the config's measured `draft_threshold`, else 0.0 (every
        draft verified; a public config.json carries it as the top-level `draft_threshold` when
        our export wrote it, and others have none)."""
        return float(getattr(getattr(self, "config", None), "draft_threshold", 0.0) or 0.0)

    @property
    def default_context_window(self) -> Optional[int]:
        """The context window `load_drafter` sets when the caller gives none: the config's
        measured `context_window` (the shipped EAGLE-3: 512, docs/premise.md), else None (every
        key)."""
        return getattr(getattr(self, "config", None), "context_window", None)

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

    def draft_head_weight(self, target) -> torch.Tensor:
        """The (draft vocab, H) weight `head` applies: the target LM head's rows d2t (all of
        them without a draft vocabulary); a drafter with its own head overrides it (what the
        fused CPU steps pack, `drafters.fused`)."""
        w = target.get_output_embeddings().weight
        return w if self.d2t is None else w[self.d2t]

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
        """Write config.json and model.safetensors (the drafter's own weights) to `folder`, each
        to a temporary name first and then renamed (never half-written)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in self.state_dict().items()}
        config = json.dumps(dataclasses.asdict(self.config), indent=2)
        replace_atomically(folder / WEIGHTS_FILE, lambda path: save_file(tensors, path))
        replace_atomically(folder / CONFIG_FILE, lambda path: Path(path).write_text(config))

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
                want = json_type_problem(raw[f.name], hints.get(f.name, typing.Any))
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
        is whole (`formats.files.tensor_shapes`) and holds exactly the tensors, with the shapes, of
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
            found = tensor_shapes(path)
        except ValueError as err:
            raise ValueError(f"drafter checkpoint {folder}: {err}") from None
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in cls(config, sharp).state_dict().items()}
        problems = weights_problems(expected, found)
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
