"""Python source rewriting for the stdlib prompts of the corpus: cut a module into its
functions, remove a function's docstring, plant a one-token bug."""
from __future__ import annotations

import ast
import io
import random
import textwrap
import tokenize
from typing import List, Optional, Tuple

# one-token bugs: each operator / keyword / boolean and what it becomes
MUTATIONS = {"<": "<=", ">": ">=", "<=": "<", ">=": ">", "==": "!=", "!=": "==", "+": "-",
             "-": "+", "and": "or", "or": "and", "True": "False", "False": "True"}


def functions(source: str, min_chars: int, max_chars: int
              ) -> List[Tuple[str, Optional[Tuple[int, int]]]]:
    """The functions (methods and nested ones included) of a module's source whose dedented
    text has min_chars to max_chars characters, in `ast.walk` order.

    Returns:
        (dedented source, docstring line span [start, stop) relative to it, or None when the
        function has no docstring or nothing but one) per function; [] when `source` does not
        parse.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        text = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        if not min_chars <= len(text) <= max_chars:
            continue
        first = node.body[0]
        doc_span = None
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str) and len(node.body) > 1):
            doc_span = (first.lineno - node.lineno, first.end_lineno - node.lineno + 1)
        out.append((text, doc_span))
    return out


def without_lines(code: str, span: Tuple[int, int]) -> str:
    """`code` without its lines [span[0], span[1]) (a docstring span from `functions`)."""
    lines = code.split("\n")
    return "\n".join(lines[:span[0]] + lines[span[1]:])


def mutate(code: str, rng: random.Random) -> Optional[str]:
    """`code` with one token of MUTATIONS (chosen with `rng`) replaced by its counterpart, or
    None when it has none (or does not tokenize)."""
    try:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(code).readline)
                if t.type in (tokenize.OP, tokenize.NAME) and t.string in MUTATIONS
                and t.start[0] == t.end[0]]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    if not toks:
        return None
    t = rng.choice(toks)
    lines = code.split("\n")
    row, col = t.start[0] - 1, t.start[1]
    line = lines[row]
    lines[row] = line[:col] + MUTATIONS[t.string] + line[t.end[1]:]
    return "\n".join(lines)
