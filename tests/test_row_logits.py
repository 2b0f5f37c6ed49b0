"""RowLogits (sharpdraft.target.logits): the LM head of a verification runs only on the rows the
engine reads, and a row's logits are the same bits whichever call computed it (the quantised
head computes every row alone); the chain and tree verifications accept the same tokens from
it as from the full logits, reading fewer rows."""
import numpy as np
import pytest
import torch
from torch import nn

from sharpdraft.drafters.trees import DraftTree
from sharpdraft.inference.engine import _verify, verify_tree
from sharpdraft.target import logits as row_logits
from sharpdraft.target.logits import RowLogits

pytestmark = pytest.mark.usefixtures("require_ext")

HIDDEN, VOCAB = 64, 96


def quant_head(seed=0):
    """A Q8_0 LM head (QuantLinear) from random weights, quantised by gguf-py."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from sharpdraft.target.quantized import QuantLinear

    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(HIDDEN, VOCAB, bias=False)
    w = torch.randn(VOCAB, HIDDEN, generator=g) * 0.1
    blocks = torch.from_numpy(np.ascontiguousarray(
        quantize(w.numpy(), GGMLQuantizationType.Q8_0)).view(np.uint8))
    return QuantLinear(lin, blocks.reshape(VOCAB, -1), "q8_0")


class Counting(nn.Module):
    """Wraps a head and records the rows of every call."""

    def __init__(self, head):
        super().__init__()
        self.head, self.calls = head, []

    def forward(self, x):
        self.calls.append(x.shape[0])
        return self.head(x)


def hidden(rows, seed=1):
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_rows_are_the_bits_of_the_all_rows_call():
    head, h = quant_head(), hidden(9)
    full = head(h)
    lazy = RowLogits(h, head)
    for j in (4, 0, 8, 2, -1):
        assert torch.equal(lazy[j], full[j])
    assert torch.equal(lazy.all(), full)


def test_chunks_double_from_the_first_read():
    head = Counting(quant_head())
    lazy = RowLogits(hidden(12), head)
    for j in range(12):
        lazy[j]
    c = row_logits.FIRST_CHUNK
    expected, start = [], 0
    while start < 12:
        expected.append(min(c, 12 - start))
        start += c
        c *= 2
    assert head.calls == expected and lazy.rows_computed == 12
    assert lazy.head_calls == len(expected)


def test_named_rows_come_in_one_call():
    head = Counting(quant_head())
    lazy = RowLogits(hidden(8), head)
    lazy.row(0, with_rows=[3, 5])
    lazy[3], lazy[5], lazy.row(0)
    assert head.calls == [3]
    with pytest.raises(IndexError, match="row 8"):
        lazy[8]
    with pytest.raises(ValueError, match="hidden"):
        RowLogits(torch.zeros(2, 3, 4), head)


@pytest.mark.parametrize("accept", [0, 1, 3, 8])
def test_chain_verification_accepts_the_same_tokens_reading_fewer_rows(accept):
    """Drafts equal the target's argmax for the first `accept` rows, then differ."""
    head, h = Counting(quant_head()), hidden(9, seed=accept)
    full = head.head(h)
    best = full.argmax(-1).tolist()
    drafts = best[:accept] + [(b + 1) % VOCAB for b in best[accept:8]]
    want = _verify(full, drafts, None, 0.0, None)
    assert want == best[:accept + 1]
    lazy = RowLogits(h, head)
    assert _verify(lazy, drafts, None, 0.0, None) == want
    # rows read: accept + 1; computed: at most the chunks that cover them
    covered, c = 0, row_logits.FIRST_CHUNK
    while covered < accept + 1:
        covered += c
        c *= 2
    assert lazy.rows_computed == min(covered, 9)
    if accept == 0:
        assert lazy.rows_computed < 9


def test_sampled_chain_verification_is_unchanged():
    head, h = quant_head(), hidden(6, seed=3)
    full = head(h)
    q = torch.softmax(torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(4)), -1)
    drafts = q.argmax(-1).tolist()
    for seed in range(20):
        a = _verify(full, drafts, q, 1.0, torch.Generator().manual_seed(seed))
        b = _verify(RowLogits(h, head), drafts, q, 1.0, torch.Generator().manual_seed(seed))
        assert a == b


def test_tree_verification_reads_the_path_and_its_children():
    head, h = Counting(quant_head()), hidden(8, seed=5)
    full = head.head(h)
    best = full.argmax(-1).tolist()
    # root -> node 0 (the target's choice) and node 1; node 0 -> node 2 (its choice), node 3;
    # node 1 -> nodes 4, 5, 6 (never read: node 1 is rejected)
    tokens = [best[0], (best[0] + 1) % VOCAB, best[1], (best[1] + 1) % VOCAB, 1, 2, 3]
    tree = DraftTree(tokens, [-1, -1, 0, 0, 1, 1, 1], [1, 1, 2, 2, 2, 2, 2])
    want = verify_tree(full, tree, 0.0, None)
    assert want == ([0, 2], [best[0], best[1], best[3]])
    assert verify_tree(RowLogits(h, head), tree, 0.0, None) == want
    # row 0 with the root's children (rows 1, 2), then node 2's row (a leaf, for the bonus
    # token): 4 of 8 rows in 2 calls; nodes 3-6 are never computed
    assert head.calls == [3, 1]


def test_computed_logits_are_served_as_they_are():
    """A forward through the modules has every row already: no head call, no copy."""
    full = torch.randn(5, VOCAB)
    lazy = RowLogits.computed(full)
    assert lazy.all() is full and torch.equal(lazy[3], full[3])
    assert lazy[3].data_ptr() == full[3].data_ptr()
    assert lazy.head_calls == 0 and len(lazy) == 5
