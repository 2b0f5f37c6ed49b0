"""The draft policies (inference/policy.py): the cost and acceptance estimates on hand-derived
cases, the auto policy's choices (full drafts where rows are cheap and drafts accepted, target-only
steps with a doubling back-off where they are not, the verified prefix), and decoding under auto
staying lossless for every registered drafter kind, chains and trees, with the report fields."""
import json

import pytest
import torch

from sharpdraft import generate
from sharpdraft.drafters import registry
from sharpdraft.inference.engine import (autoregressive_generate, speculative_generate,
                                         tree_speculative_generate)
from sharpdraft.inference.policy import AutoPolicy, FixedPolicy, LineFit, resolve
from sharpdraft_helpers import tiny_target
from test_protocol import Tok


def test_line_fit_is_weighted_least_squares():
    fit = LineFit(decay=1.0)
    assert fit.predict(3) != fit.predict(3)                 # NaN before any point
    for x, y in ((1, 10.0), (3, 14.0), (5, 18.0)):           # y = 8 + 2 x exactly
        fit.add(x, y)
    assert fit.predict(9) == pytest.approx(26.0)
    one = LineFit(proportional=True)
    one.add(4, 8.0)
    assert one.predict(2) == pytest.approx(4.0)             # one x seen: y proportional to x
    flat = LineFit()
    flat.add(4, 8.0)
    assert flat.predict(2) == pytest.approx(8.0)            # or constant
    recent = LineFit(decay=0.5)
    recent.add(1, 10.0)
    recent.add(1, 20.0)                                     # weights 0.5, 1
    assert recent.predict(1) == pytest.approx((0.5 * 10 + 20) / 1.5)


def test_resolve_names_the_argument():
    assert resolve(None, None) == "fixed" and resolve(None, 0.3) == "fixed"
    assert resolve("auto", 0.0) == "auto"
    with pytest.raises(ValueError, match="policy"):
        resolve("greedy", None)
    with pytest.raises(ValueError, match="draft_threshold"):
        resolve("auto", 0.3)


def run_steps(policy, verify_s, draft_s, accept, steps):
    """Drive `policy` through `steps` steps: verify_s(rows) and draft_s(k) seconds, accept(n)
    drafts accepted of n verified, drafter probability 0.9 for each draft."""
    asked = []
    for _ in range(steps):
        k = policy.plan()
        asked.append(k)
        n = policy.cut([0.9] * k, draft_s(k)) if k else 0
        policy.observe(k, draft_s(k) if k else 0.0, [0.9] * k, n, min(n, accept(n)),
                       verify_s(n + 1))
    return asked


def test_auto_drafts_in_full_where_rows_are_cheap_and_drafts_accepted():
    p = AutoPolicy(max_drafts=6)
    asked = run_steps(p, verify_s=lambda r: 0.010 + 0.0002 * (r - 1),
                      draft_s=lambda k: 0.001, accept=lambda n: n, steps=12)
    assert asked[:2] == [6, 0]                 # measure a full draft, then a target-only step
    assert asked[2:] == [6] * 10
    rep = p.report()
    assert rep["target_step_ms"] == pytest.approx(10.0, rel=0.01)
    assert rep["verify_ms_per_row"] == pytest.approx(0.2, rel=0.05)
    assert rep["acceptance_by_position"][0] > 0.9 and rep["drafted_share"] == 11 / 12


def test_auto_decodes_target_only_where_drafting_cannot_pay_and_backs_off():
    """Rows cost as much as a step and nothing is accepted: after the measuring steps (a full
    draft, a target-only step, full drafts until 6 drafted) every plan is a target-only step
    except probes after runs of 2, 4, 8, 16 target-only steps."""
    p = AutoPolicy(max_drafts=4)
    asked = run_steps(p, verify_s=lambda r: 0.010 * r, draft_s=lambda k: 0.002 * k,
                      accept=lambda n: 0, steps=60)
    drafted = [i for i, k in enumerate(asked) if k]
    assert drafted[:6] == [0, 2, 3, 4, 5, 6] and asked[1] == 0
    gaps = [b - a for a, b in zip(drafted[5:], drafted[6:])]
    assert gaps[:4] == [2 + 1, 4 + 1, 8 + 1, 16 + 1], (asked, gaps)
    assert len(drafted) == 10


def test_cut_keeps_the_prefix_with_the_best_expected_rate():
    p = AutoPolicy(max_drafts=4)
    for _ in range(3):                          # verify(r) = 10 ms + 5 ms a row
        p.verify.add(1, 0.010)
        p.verify.add(3, 0.020)
    # a(0.95) = bin 9's prior 0.95, a(0.05) = 0.05: two sure drafts, then two hopeless ones
    n = p.cut([0.95, 0.95, 0.05, 0.05], draft_s=0.004)
    rates = {}
    gain, reach = 0.0, 1.0
    for j, a in enumerate([0.95, 0.95, 0.05, 0.05], 1):
        reach *= a
        gain += reach
        rates[j] = (1 + gain) / (0.004 + 0.010 + 0.005 * j)
    assert n == max(rates, key=rates.get) == 2
    assert FixedPolicy(4, 0.5).cut([0.95, 0.95, 0.05, 0.05], 0.0) == 2
    assert FixedPolicy(4, 0.0).cut([0.95, 0.05], 0.0) == 2


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("name", registry.names())
def test_auto_is_lossless_for_every_kind(name, target):
    """Greedy decoding under auto equals target-only decoding; full drafts were asked for, some
    steps were target-only and the report carries the policy's fields."""
    drafter = registry.build_untrained(name, target, Tok(), layers=2, block_size=4, seed=3)
    prompt = torch.randint(3, 256, (1, 11), generator=torch.Generator().manual_seed(2))
    want = autoregressive_generate(target, prompt, 40).tokens
    res = speculative_generate(target, drafter, prompt, 40, policy="auto")
    assert res.tokens == want
    assert 0 in res.draft_lengths and max(res.draft_lengths) >= 1
    summary = res.summary()
    assert summary["draft_policy"] == "auto" and 0 < summary["drafted_share"] < 1
    assert summary["policy_estimates"]["target_step_ms"] > 0
    json.dumps(summary)
    if drafter.drafts_trees:
        tree = tree_speculative_generate(target, drafter, prompt, 40, policy="auto")
        assert tree.tokens == want and 0 in tree.draft_lengths
        assert tree.policy["policy"] == "auto" and "tree_accepted" in tree.policy


def test_generate_takes_the_policy_and_defaults_to_fixed(target):
    drafter = registry.build_untrained("eagle3", target, Tok(), layers=2, seed=3)
    prompt = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    assert generate(target, drafter, prompt, max_new_tokens=8).policy["policy"] == "fixed"
    auto = generate(target, drafter, prompt, max_new_tokens=8, policy="auto")
    assert auto.policy["policy"] == "auto"
    fixed = generate(target, drafter, prompt, max_new_tokens=8, draft_threshold=0.0)
    assert fixed.policy["policy"] == "fixed" and 0 not in fixed.draft_lengths
    with pytest.raises(ValueError, match="draft_threshold"):
        generate(target, drafter, prompt, max_new_tokens=8, policy="auto", draft_threshold=0.3)
