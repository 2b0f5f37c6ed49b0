"""The `sharpdraft` command line (thin: it parses, validates once and calls the library).

`parser` (cli/parser.py): the flags and their one validation pass; `commands` (cli/commands.py):
the command bodies and `main`, which reports every error as one line (--debug: the traceback).
"""
from .commands import main
from .parser import parser

__all__ = ["main", "parser"]
