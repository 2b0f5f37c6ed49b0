"""Drafters: small models that propose tokens for the target to verify (DFlash, EAGLE-3, PARD,
LongSpark).

Every drafter borrows the target's embeddings and LM head, drafts over a reduced vocabulary, runs
its attention through `sharpdraft_ext.sharp_attention` (its `sharp` SharpConfig: mode "none" is the
frozen drafter, "fixed_slope" SharpDraft), and plugs into `sharpdraft.inference` through the
session protocol of `drafters.protocol`. `drafters.registry` lists the kinds (class, untrained
builder, training recipe, shipped checkpoint); `load_drafter` builds one for a target.

Layer: above `target`; below inference, training and the rest.
"""
from .base import Drafter
from .dflash import DFlashConfig, DFlashDrafter
from .eagle3 import Eagle3Config, Eagle3Drafter
from .loading import load_drafter, sharp_config, shipped_checkpoint
from .longspark import LongSparkConfig, LongSparkDrafter
from .pard import PARDConfig, PARDDrafter
from .trees import DraftTree

__all__ = ["Drafter", "DFlashConfig", "DFlashDrafter", "DraftTree", "Eagle3Config",
           "Eagle3Drafter", "LongSparkConfig", "LongSparkDrafter", "PARDConfig", "PARDDrafter",
           "load_drafter", "sharp_config", "shipped_checkpoint"]
