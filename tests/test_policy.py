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
from sharpdraft.inference.policy import AutoPolicy, FixedPolicy, LineFit, make_policy, resolve
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
    draft, a target-only step, one more draft: a clear loss ends the warm-up) every plan is a
    target-only step except probes after runs of 2, 4, 8, 16 target-only steps."""
    p = AutoPolicy(max_drafts=4)
    asked = run_steps(p, verify_s=lambda r: 0.010 * r, draft_s=lambda k: 0.002 * k,
                      accept=lambda n: 0, steps=60)
    drafted = [i for i, k in enumerate(asked) if k]
    assert drafted[:2] == [0, 2] and asked[1] == 0
    gaps = [b - a for a, b in zip(drafted[1:], drafted[2:])]
    assert gaps[:4] == [2 + 1, 4 + 1, 8 + 1, 16 + 1], (asked, gaps)
    assert len(drafted) == 2 + 4


def test_auto_warms_up_in_full_where_drafting_loses_narrowly():
    """Drafting loses, but by less than CLEAR_LOSS (cheap rows, nothing accepted: about 0.9x):
    WARMUP drafted steps before the first target-only choice."""
    p = AutoPolicy(max_drafts=4)
    asked = run_steps(p, verify_s=lambda r: 0.010 + 0.001 * (r - 1),
                      draft_s=lambda k: 0.001, accept=lambda n: 0, steps=12)
    drafted = [i for i, k in enumerate(asked) if k]
    w = AutoPolicy.WARMUP
    assert drafted[:w] == [0] + list(range(2, w + 1)) and asked[w + 1] == 0


def test_a_draft_after_target_only_steps_charges_its_catch_up_to_them():
    """A steady draft costs 1 ms; one after 3 target-only steps (0.2 ms each) costs 4 ms: the
    draft fit keeps 1 ms and a target-only step is charged (3 * 0.2 + 3) / 3 = 1.2 ms."""
    p = AutoPolicy(max_drafts=2)
    p.observe(2, 0.001, [0.9, 0.9], 2, 2, 0.012)
    for _ in range(3):
        p.observe(0, 0.0002, [], 0, 0, 0.010)
    p.observe(2, 0.004, [0.9, 0.9], 2, 2, 0.012)
    assert p.draft.predict(2) == pytest.approx(0.001)
    assert p.idle.predict(0) == pytest.approx((3 * 0.0002 + 0.003) / 3)
    assert p.target_rate() == pytest.approx(1 / (0.010 + 0.0012))


def test_stop_below_follows_acceptance_and_costs():
    """A one-by-one drafter: its measured threshold where it has one (and the fixed policy's
    cut); else the lower edge of the run of probability bins, from the top, whose a(p) times
    the mean acceptance pays for one more draft and row at the best expected rate (a
    hand-computed case: 0.7)."""
    measured = AutoPolicy(max_drafts=4, one_by_one=True, prior_threshold=0.6)
    assert measured.stop_below() == 0.6
    measured.verify.add(1, 0.010)
    measured.drafted = AutoPolicy.WARMUP
    assert measured.stop_below() == 0.6
    for conf in ([0.95, 0.7, 0.5, 0.9], [0.3, 0.9], [0.9, 0.8]):
        assert measured.cut(conf, 0.001) == FixedPolicy(4, 0.6).cut(conf, 0.001)
    assert AutoPolicy(max_drafts=4).stop_below() == 0.0          # a parallel drafter: never
    single = AutoPolicy(max_drafts=1, one_by_one=True)
    single.verify.add(1, 0.010)
    single.draft.add(1, 0.001)
    single.drafted = AutoPolicy.WARMUP
    assert single.stop_below() == 0.0                            # one draft: nothing to stop
    p = AutoPolicy(max_drafts=4, one_by_one=True)
    p.verify.add(1, 0.010)
    p.verify.add(2, 0.012)                      # verify(r) = 10 ms + 2 ms a row
    p.draft.add(1, 0.001)                       # draft(k) = 1 ms a draft (proportional)
    p.drafted = AutoPolicy.WARMUP
    p.reached[1:] = [100] * 4
    p.taken[1:] = [98] * 4                      # alpha_j = 99 / 102 at every position
    a = 99 / 102
    rates = [(1 + sum(a ** j for j in range(1, k + 1))) / (0.001 * k + 0.010 + 0.002 * k)
             for k in range(1, 5)]
    need = max(rates) * (0.001 + 0.002) / a     # = 0.662: bins 0.7-0.8 (a = 0.75) pay, 0.6-0.7 not
    assert 0.65 < need < 0.75
    assert p.stop_below() == pytest.approx(0.7)
    cheap = AutoPolicy(max_drafts=4, one_by_one=True)
    cheap.verify.add(1, 0.010)
    cheap.verify.add(2, 0.0100001)
    cheap.draft.add(1, 0.00001)
    cheap.drafted = AutoPolicy.WARMUP
    assert cheap.stop_below() == 0.0            # rows and drafts nearly free: never stop
    dear = AutoPolicy(max_drafts=4, one_by_one=True)
    dear.verify.add(1, 0.010)
    dear.verify.add(2, 0.020)                   # a row costs a step: stop after the first draft
    dear.draft.add(1, 0.001)
    dear.drafted = AutoPolicy.WARMUP
    assert dear.stop_below() == 1.0


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


class StubDrafter:
    max_drafts, max_tree_nodes, drafts_one_by_one, default_draft_threshold = 4, 0, False, 0.0


def test_auto_resumes_what_an_earlier_request_learnt():
    """A second request of the same drafter and target starts from the first's estimates
    (acceptance counts halved, back-off capped, no warm-up): drafting lost, so it plans a
    target-only step at once; another target starts afresh with a full draft."""
    drafter, target = StubDrafter(), object()
    first = make_policy("auto", drafter, target=target)
    run_steps(first, verify_s=lambda r: 0.010 * r, draft_s=lambda k: 0.002 * k,
              accept=lambda n: 0, steps=60)
    second = make_policy("auto", drafter, target=target)
    assert second.reached[1] == first.reached[1] / 2 > 0
    assert second.alpha(1) == pytest.approx(1 / (first.reached[1] / 2 + 2))
    assert first.backoff > AutoPolicy.RESUME_BACKOFF
    assert second.backoff == AutoPolicy.RESUME_BACKOFF and second.plan() == 0
    assert make_policy("auto", drafter, target=object()).plan() == 4
    assert make_policy("fixed", drafter, target=target).plan() == 4


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
