"""The `sharpdraft` command line (thin: it parses, validates once and calls the library)."""
from .commands import main, parser

__all__ = ["main", "parser"]
