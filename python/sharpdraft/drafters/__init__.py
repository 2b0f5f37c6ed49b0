"""Drafters: small models that propose blocks of tokens for the target to verify."""
from .dflash import DFlashConfig, DFlashDrafter

__all__ = ["DFlashConfig", "DFlashDrafter"]
