"""One place that lists every drafter kind: the CLI, the bench and the training command read it
instead of switching on drafter names.

A `DrafterKind` says which class implements a kind, how to build an untrained one for a target,
which module holds its training recipe (`sharpdraft train <name>`), and the folder name of its
shipped checkpoint for the default target; whether it drafts trees comes from its class.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from .amd_pard import AMDPARDDrafter
from .amd_pard import untrained as _amd_pard
from .base import Drafter
from .common import default_mask_token_id
from .dflash import DFlashConfig, DFlashDrafter
from .eagle3 import Eagle3Config, Eagle3Drafter
from .longspark import LongSparkConfig, LongSparkDrafter
from .pard import PARDConfig, PARDDrafter
from .specforge_eagle3 import SpecForgeEagle3Drafter
from .specforge_eagle3 import untrained as _specforge_eagle3
from .zlab_dflash import ZLabDFlashDrafter
from .zlab_dflash import untrained as _zlab_dflash


@dataclass(frozen=True)
class DrafterKind:
    """name: the CLI's --drafter value; title: its name in prose; cls: the Drafter class;
    untrained(target, tokenizer, layers, block_size, overrides) -> an untrained drafter for that
    target (lossless, tau about 1; `layers` / `block_size` where the kind has them; `overrides`:
    config fields replaced before it is built); recipe: the module
    of its training recipe (`add_arguments(parser)`, `main(args)`; empty for a public
    format loaded as it is); checkpoint: its shipped
    checkpoint folder under sharpdraft/checkpoints for the default target; public: the kind of
    the public format it exports to (`drafters.export`; empty: none), whose class has
    `from_drafter(drafter, target, tokenizer=None)`."""

    name: str
    title: str
    cls: type
    untrained: Callable[..., Drafter]
    recipe: str = ""
    checkpoint: str = ""
    public: str = ""

    @property
    def trainable(self) -> bool:
        """Whether `sharpdraft train <name>` can train it (it has a recipe module)."""
        return bool(self.recipe)

    @property
    def trees(self) -> bool:
        """Whether it drafts trees (its sessions have propose_tree; tree verification)."""
        return bool(self.cls.drafts_trees)


def _dflash(target, tokenizer, layers: int, block_size: int, overrides: dict) -> Drafter:
    cfg = DFlashConfig.from_target(target.config, mask_token_id=default_mask_token_id(tokenizer),
                                   num_layers=layers, block_size=block_size)
    return DFlashDrafter(dataclasses.replace(cfg, **overrides))


def _eagle3(target, tokenizer, layers: int, block_size: int, overrides: dict) -> Drafter:
    return Eagle3Drafter(dataclasses.replace(Eagle3Config.from_target(target.config),
                                             **overrides))


def _pard(target, tokenizer, layers: int, block_size: int, overrides: dict) -> Drafter:
    cfg = PARDConfig.from_target(target.config, num_layers=layers,
                                 num_draft_tokens=block_size - 1)
    drafter = PARDDrafter(dataclasses.replace(cfg, **overrides))
    drafter.init_from_target(target)        # the target's first layers: an early-exit model
    return drafter


def _longspark(target, tokenizer, layers: int, block_size: int, overrides: dict) -> Drafter:
    cfg = LongSparkConfig.from_target(target.config, mask_token_id=default_mask_token_id(tokenizer),
                                      num_layers=layers, num_drafts=block_size - 1)
    drafter = LongSparkDrafter(dataclasses.replace(cfg, **overrides))
    drafter.init_from_target(target)        # draft layers = the paired target layers
    return drafter


KINDS: Dict[str, DrafterKind] = {k.name: k for k in (
    DrafterKind("dflash", "DFlash", DFlashDrafter, _dflash, "sharpdraft.training.dflash",
                checkpoint="dflash-smollm2", public="zlab-dflash"),
    DrafterKind("eagle3", "EAGLE-3", Eagle3Drafter, _eagle3, "sharpdraft.training.eagle3",
                checkpoint="eagle3-smollm2", public="specforge-eagle3"),
    DrafterKind("pard", "PARD", PARDDrafter, _pard, "sharpdraft.training.pard",
                checkpoint="pard-smollm2", public="amd-pard"),
    DrafterKind("longspark", "LongSpark", LongSparkDrafter, _longspark,
                "sharpdraft.training.longspark", checkpoint="longspark-smollm2"),
    DrafterKind("zlab-dflash", "DFlash (z-lab public layout)", ZLabDFlashDrafter, _zlab_dflash),
    DrafterKind("specforge-eagle3", "EAGLE-3 (SafeAILab / SpecForge public layout)",
                SpecForgeEagle3Drafter, _specforge_eagle3),
    DrafterKind("amd-pard", "PARD (AMD public layout)", AMDPARDDrafter, _amd_pard),
)}


def names() -> List[str]:
    """The registered kinds, sorted."""
    return sorted(KINDS)


def get(name: str) -> DrafterKind:
    """The kind registered as `name`.

    Raises:
        ValueError: no such kind (the message lists the known ones).
    """
    if name not in KINDS:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(names())}")
    return KINDS[name]


def kind_of(drafter) -> DrafterKind:
    """The kind whose class `drafter` is an instance of (its most derived registered class),
    for code that holds a drafter and needs its kind's hooks (the recipe's `anchor_leads`...).

    Raises:
        ValueError: no registered kind has the drafter's class.
    """
    by_class = {k.cls: k for k in KINDS.values()}
    for cls in type(drafter).__mro__:
        if cls in by_class:
            return by_class[cls]
    raise ValueError(f"no registered drafter kind for {type(drafter).__name__}; known: "
                     f"{', '.join(names())}")


def build_untrained(name: str, target, tokenizer, *, layers: int = 2, block_size: int = 8,
                    seed: int = 0, overrides: Optional[dict] = None) -> Drafter:
    """An untrained drafter of kind `name` for `target`, seeded, in eval mode; `overrides`
    ({config field: value}) replace fields of the config built for the target before the
    drafter is built (validated by the config).

    Raises:
        ValueError: unknown kind, or an override that is not a field of its config.
    """
    torch.manual_seed(seed)
    kind = get(name)
    if overrides:
        fields = {f.name for f in dataclasses.fields(kind.cls.config_class)}
        bad = sorted(set(overrides) - fields)
        if bad:
            raise ValueError(f"overrides: {', '.join(bad)} not field(s) of "
                             f"{kind.cls.config_class.__name__}")
    return kind.untrained(target, tokenizer, layers, block_size, overrides or {}).eval()
