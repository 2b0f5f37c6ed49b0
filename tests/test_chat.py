"""Multi-turn sessions (`autoregressive_chat`, `speculative_chat`): the caches are kept from turn
to turn, every drafter's session absorbs the user turns, and greedy answers equal an independent
oracle that re-runs the whole history through transformers' own generate each turn."""
import pytest
import torch

from sharpdraft.inference.engine import autoregressive_chat, speculative_chat
from test_engine import ScriptedDrafter, hf_greedy
from sharpdraft_helpers import tiny_drafter, tiny_eagle3, tiny_pard, tiny_target

ANSWER = 9        # tokens per answer (no EOS: every answer is exactly this long)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def turns(seed: int, sizes=(7, 3, 12)) -> list:
    """A first prompt and the follow-up turns' ids (random tokens, lengths `sizes`)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (1, n), generator=g) for n in sizes]


def oracle(target, parts: list) -> list:
    """Each answer by transformers' greedy generate over the whole history so far."""
    history, answers = parts[0], []
    for nxt in parts[1:] + [None]:
        ans = hf_greedy(target, history, ANSWER)
        answers.append(ans)
        if nxt is not None:
            history = torch.cat([history, torch.tensor([ans]), nxt], dim=1)
    return answers


def follow(parts: list):
    seen = []

    def follow_up(i, answer):
        seen.append((i, list(answer)))
        return parts[i + 1] if i + 1 < len(parts) else None
    follow_up.seen = seen
    return follow_up


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "pard"])
def test_every_drafter_answers_each_turn_as_the_oracle(target, kind):
    parts = turns(1)
    want = oracle(target, parts)
    drafter = {"dflash": tiny_drafter, "eagle3": tiny_eagle3, "pard": tiny_pard}[kind](target)
    fu = follow(parts)
    res = speculative_chat(target, drafter, parts[0], ANSWER, fu)
    assert [r.tokens for r in res] == want
    assert [i for i, _ in fu.seen] == [0, 1, 2]            # asked after every answer
    assert [a for _, a in fu.seen] == want
    # the context before each answer: the prompt, then every answer and turn before it
    lengths = [parts[0].shape[1]]
    for p in parts[1:]:
        lengths.append(lengths[-1] + ANSWER + p.shape[1])
    assert [r.prompt_tokens for r in res] == lengths
    for r in res:                  # each turn's steps start where its context starts
        assert r.context_lengths[0] == r.prompt_tokens


def test_autoregressive_chat_matches_the_oracle(target):
    parts = turns(2, sizes=(5, 8, 2, 4))
    res = autoregressive_chat(target, parts[0], ANSWER, follow(parts))
    assert [r.tokens for r in res] == oracle(target, parts)
    assert all(r.target_forwards == ANSWER for r in res)   # the turn's forward, then 1 a token


def test_drafts_stay_aligned_across_turns(target):
    """A drafter that drafts the oracle's transcript by absolute position (every 5th position
    corrupted) keeps its acceptance in later turns: positions and caches follow the turns."""
    parts = turns(3)
    answers = oracle(target, parts)
    transcript = parts[0][0].tolist()
    for ans, nxt in zip(answers, parts[1:] + [None]):
        transcript += ans + ([] if nxt is None else nxt[0].tolist())
    base = tiny_drafter(target, block_size=5)
    drafter = ScriptedDrafter(base, 0, transcript, corrupt_every=5).eval()
    res = speculative_chat(target, drafter, parts[0], ANSWER, follow(parts))
    assert [r.tokens for r in res] == answers
    for r in res[1:]:
        assert r.tau > 1.5, r.accept_lengths


def test_bad_follow_ups_are_refused_before_the_turn_runs(target):
    parts = turns(4)
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match=r"follow_up: after turn 0: expected \(1, L\)"):
        speculative_chat(target, drafter, parts[0], ANSWER, lambda i, a: torch.zeros(3))
    calls = []

    def too_long(i, answer):
        calls.append(i)
        return torch.ones(1, 40, dtype=torch.long)
    with pytest.raises(ValueError, match="follow_up: after turn 0: .* > max_context 50"):
        autoregressive_chat(target, parts[0], ANSWER, too_long, max_context=50)
    assert calls == [0]
    limit = target.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_context: {limit + 1} > the target's"):
        autoregressive_chat(target, parts[0], ANSWER, too_long, max_context=limit + 1)
