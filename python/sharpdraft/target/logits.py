"""`RowLogits`: the LM head of a verification forward, applied only to the rows that are read.

A verification of k drafts runs the target over k + 1 rows, but the engine reads row j only
while drafts 0 .. j - 1 were all accepted (a chain), or only along the accepted path and its
children (a tree). On a CPU the LM head is the largest weight of a small target (SmolLM2-135M:
49,152 x 576, 30 MB in Q8_0, a fifth of the model's multiply-adds), and past a few rows its cost
grows with the rows (measured on a 2-core AVX2 EPYC: 1.7 ms for 1 row, 3.9 for 4, 7.4 for 8,
14.4 for 16), so computing every row up front spends most of it on rows nobody reads.

`RowLogits` keeps the forward's final hidden states and runs the head when a row is first read,
on a chunk of rows at once (one pass over the head's weights): the row asked for and the rows
after it, the chunk doubling at every call (2, 4, 8, ...; `FIRST_CHUNK`), or the rows the caller
names (a tree node's children). The head of the quantised runtime computes every row alone
(`QuantLinear`), so a row's logits are the same bits whichever chunk computed it; a dense head
differs from an all-rows call by float rounding only.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Sequence

import torch

# Rows of the first head call of a chain verification: the row of the first draft and the one
# after it (the first draft is accepted about half the time); each later call doubles it.
FIRST_CHUNK = 2


class RowLogits:
    """The logits of a forward's rows, computed on first read.

    Args:
        hidden: (rows, hidden) the forward's final hidden states (after the final norm), the
            LM head's input.
        head: the LM head, (n, hidden) -> (n, vocab).

    Attributes:
        head_calls, rows_computed: how many head calls ran, over how many rows in all.
    """

    def __init__(self, hidden: torch.Tensor, head):
        if hidden.dim() != 2:
            raise ValueError(f"hidden: expected (rows, hidden), got {tuple(hidden.shape)}")
        self._hidden = hidden
        self._head = head
        self._rows: Dict[int, torch.Tensor] = {}
        self._chunk = FIRST_CHUNK
        self._full: Optional[torch.Tensor] = None   # every row as one tensor, when known
        self.head_calls = 0
        self.rows_computed = 0

    @classmethod
    def computed(cls, logits: torch.Tensor) -> "RowLogits":
        """Logits already computed, (rows, vocab) float32 (a forward through the modules)."""
        out = cls(logits, None)
        out._rows = dict(enumerate(logits))      # views, no copy
        out._full = logits
        return out

    def __len__(self) -> int:
        return self._hidden.shape[0]

    def _index(self, j: int) -> int:
        n = len(self)
        if not -n <= j < n:
            raise IndexError(f"row {j} outside the forward's {n} rows")
        return j % n

    def _compute(self, rows: Iterable[int]) -> None:
        missing = sorted({r for r in rows if r not in self._rows})
        if not missing:
            return
        out = self._head(self._hidden[missing]).float()
        for r, logits in zip(missing, out):
            self._rows[r] = logits
        self.head_calls += 1
        self.rows_computed += len(missing)

    def row(self, j: int, with_rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """(vocab,) float32 logits of row j (negative j counts from the end).

        When row j is not computed yet, one head call computes it together with `with_rows`
        (e.g. a tree node's children, the only rows read next), or, when None, with the next
        rows of the forward up to the current chunk size, which then doubles.

        Raises:
            IndexError: j or a row of `with_rows` outside the forward's rows.
        """
        j = self._index(j)
        if j not in self._rows:
            if with_rows is None:
                rows = range(j, min(j + self._chunk, len(self)))
                self._chunk *= 2
            else:
                rows = [j] + [self._index(r) for r in with_rows]
            self._compute(rows)
        return self._rows[j]

    def __getitem__(self, j: int) -> torch.Tensor:
        return self.row(j)

    def all(self) -> torch.Tensor:
        """(rows, vocab) float32: every row (computed in one call where none is yet)."""
        if self._full is None:
            self._compute(range(len(self)))
            self._full = torch.stack([self._rows[r] for r in range(len(self))])
        return self._full
