"""The draft session protocol (drafters/protocol.py): every registered drafter kind, and every
public format read back from its folder, starts sessions that follow it (methods, parameter names,
the capabilities the drafter's flags claim, the shapes a propose returns); sessions that break it
are named."""
import pytest
import torch
from transformers import DynamicCache

from sharpdraft.drafters import registry
from sharpdraft.drafters.protocol import (DraftSession, OneByOneSession, SessionDrafter,
                                          TreeDraftSession, session_problems)
from sharpdraft.drafters.sessions import crop_to
from sharpdraft.target.kv_cache import CACHE_KWARG
from sharpdraft_helpers import tiny_target

VOCAB = 256
PROMPT = torch.tensor([[5, 9, 14, 3, 7, 22, 8, 40]])


class Tok:
    pad_token_id, eos_token_id, unk_token_id = None, 1, None
    vocab_size = VOCAB

    def __len__(self):
        return VOCAB


@pytest.fixture(scope="module")
def target():
    return tiny_target().eval()


def start(drafter, target):
    """A session after a prefill over the prompt but its last token; returns (session, the
    target's KV cache)."""
    with torch.no_grad():
        cache = DynamicCache()
        out = target(PROMPT[:, :-1], output_hidden_states=True, use_cache=True,
                     **{CACHE_KWARG: cache})
        return drafter.start(target, PROMPT[:, :-1], out.hidden_states, cache), cache


def check_follows(drafter, target):
    """The protocol checks, then one propose / commit with the shapes the protocol states."""
    assert isinstance(drafter, SessionDrafter)
    session, cache = start(drafter, target)
    assert isinstance(session, DraftSession)
    assert isinstance(session, TreeDraftSession) == bool(drafter.drafts_trees)
    if drafter.drafts_one_by_one:
        assert isinstance(session, OneByOneSession)
    assert session_problems(drafter, session) == []
    position = PROMPT.shape[1] - 1
    before = session.state_bytes()
    assert isinstance(before, int) and before > 0
    with torch.no_grad():
        drafts, logits = session.propose(int(PROMPT[0, -1]), position, lambda r: int(r.argmax()))
    assert 1 <= len(drafts) <= drafter.max_drafts
    assert logits.dtype == torch.float32 and tuple(logits.shape) == (len(drafts), VOCAB)
    assert drafts == [int(r.argmax()) for r in logits]         # draft j drawn from row j - 1
    accepted = drafts[:1] + [3]
    with torch.no_grad():
        out = target(torch.tensor([[int(PROMPT[0, -1])] + drafts]), use_cache=True,
                     output_hidden_states=True, **{CACHE_KWARG: cache})
        crop_to(cache, position + len(accepted))        # as the engine rolls back
        session.commit(accepted, out.hidden_states if drafter.needs_hidden_states else None)
    assert session.state_bytes() >= before


@pytest.mark.parametrize("name", registry.names())
def test_every_registered_kind_starts_sessions_that_follow_the_protocol(name, target):
    drafter = registry.build_untrained(name, target, Tok(), layers=2, block_size=4, seed=3)
    check_follows(drafter, target)


PUBLIC = [n for n in registry.names() if not registry.get(n).trainable]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_format_read_back_starts_sessions_that_follow_the_protocol(name, target,
                                                                                tmp_path):
    drafter = registry.build_untrained(name, target, Tok(), layers=2, block_size=4, seed=3)
    drafter.save(tmp_path / name)
    loaded = registry.get(name).cls.load(tmp_path / name, target=target)
    check_follows(loaded, target)


def test_the_kinds_cover_chain_tree_and_one_by_one_sessions():
    """The flags the protocol keys on are each claimed by some kind (else the checks above would
    not exercise propose_tree and stop_below)."""
    classes = [registry.get(n).cls for n in registry.names()]
    assert any(c.drafts_trees for c in classes) and any(c.drafts_one_by_one for c in classes)
    assert any(not c.drafts_trees and not c.drafts_one_by_one for c in classes)


class Complete:
    def propose(self, last, position, draw, stop_below=0.0):
        return [], torch.zeros(0, VOCAB)

    def commit(self, accepted, hidden_states):
        pass

    def state_bytes(self):
        return 0

    def propose_tree(self, last, position):
        return None


class NoStateBytes:
    def propose(self, last, position, draw):
        return [], torch.zeros(0, VOCAB)

    def commit(self, accepted, hidden_states):
        pass


class NoStopBelow(Complete):
    def propose(self, last, position, draw):
        return [], torch.zeros(0, VOCAB)


class Misnamed(Complete):
    def commit(self, tokens, hidden):
        pass


class Demanding(Complete):
    def propose(self, last, position, draw, stop_below=0.0, temperature=None, *, top_k):
        return [], torch.zeros(0, VOCAB)


class FakeDrafter:
    needs_hidden_states, hidden_layers, max_drafts = False, [], 4
    max_tree_nodes = max_tree_depth = 0

    def __init__(self, trees=False, one_by_one=False):
        self.drafts_trees, self.drafts_one_by_one = trees, one_by_one

    def start(self, target, prompt_ids, hidden_states, target_cache=None):
        return Complete()


def test_a_complete_session_passes_and_each_broken_one_is_named():
    full = FakeDrafter(trees=True, one_by_one=True)
    assert session_problems(full, Complete()) == []
    assert not isinstance(NoStateBytes(), DraftSession)
    assert session_problems(FakeDrafter(), NoStateBytes()) == [
        "NoStateBytes lacks state_bytes (DraftSession)"]
    assert session_problems(full, NoStopBelow()) == ["NoStopBelow.propose has no stop_below "
                                                     "keyword"]
    assert session_problems(FakeDrafter(), NoStopBelow()) == []     # not claimed: not needed
    assert session_problems(full, Misnamed()) == [
        "Misnamed.commit takes (tokens, hidden), expected (accepted, hidden_states)"]
    assert session_problems(full, Demanding()) == [
        "Demanding.propose requires top_k, which the engine never passes"]


def test_a_tree_drafter_needs_propose_tree_and_a_drafter_its_attributes():
    assert session_problems(FakeDrafter(trees=True), NoStopBelow()) == []
    chain_only = NoStateBytes()
    chain_only.state_bytes = lambda: 0
    assert session_problems(FakeDrafter(trees=True), chain_only) == [
        "NoStateBytes lacks propose_tree (TreeDraftSession)"]
    bare = FakeDrafter()
    del bare.drafts_trees
    assert not isinstance(bare, SessionDrafter)
    assert session_problems(bare, Complete()) == ["FakeDrafter lacks drafts_trees"]
