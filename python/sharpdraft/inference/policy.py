"""Draft policies: how many drafts a speculative step asks for and verifies, and whether it drafts
at all.

"fixed" is what the engine always did: every step asks the session for `max_drafts` drafts and
verifies them up to the first whose drafter probability is below `draft_threshold` (the measured
default of `Drafter.default_draft_threshold`); a tree step verifies the whole tree.

"auto" (issue 53) chooses from what this request measured, for any drafter (no switch on kinds):

- costs: verify(r), the target forward over r rows, as a recency-weighted line a + b (r - 1)
  through the steps' own timings (a is a target-only step; the line follows the context as it
  grows); draft(k), the session's propose + commit asking for k drafts, likewise a line (a
  parallel drafter's cost barely moves with k; a one-by-one drafter's is about k forwards when
  only one k was seen); a target-only step's session cost, with the catch-up a draft after
  target-only steps pays on their context (its excess over a steady draft) spread over them;
- acceptance: alpha_j, the share of steps that reached draft j (every earlier draft accepted)
  and accepted it, and a(p), the same share among drafts whose drafter probability p fell in
  one of ten bins (Beta priors: alpha_j 1/2, a(p) the bin's centre);
- the expected committed tokens per second of a step of k drafts, (1 + sum_j prod_{i <= j}
  alpha_i) / (draft(k) + verify(k + 1)), against a target-only step's 1 / (verify(1) + the
  session's commit);
- a drafting step asks for `max_drafts` (a tree: the whole tree); how many are verified is
  chosen once the drafts and their probabilities are known:
  where the drafter carries a measured draft threshold (`Drafter.default_draft_threshold`,
  tuned on the task suite), drafts are cut, and a one-by-one drafter stops, where the fixed
  policy would; otherwise a one-by-one drafter (`drafts_one_by_one`) stops after the first
  draft whose a(p) is too low for the next draft to pay (with d and v the draft and verify
  cost of one more row and r the best expected rate, below the p where a(p) * alpha < r (d +
  v), alpha the mean acceptance of a reached draft: `stop_below`), and the verified prefix is
  the one that maximises that rate with the drafts' own a(p_j) and the drafting already paid
  (`cut`);
- a step drafts while the drafted steps' achieved rate (tokens committed per second of their
  drafting and verifying, recency-weighted over about 10 drafted steps: it includes what the
  cut and the early stop buy, which the expected rate above does not model) stays above
  `KEEP` (0.9) times a target-only step's; after target-only steps, a probe resumes drafting
  only where it brings that rate above target-only's (a hysteresis against the estimates'
  noise; the rate's history keeps `OFF_WEIGHT` of its weight when drafting stops, so probes
  count);
- when a target-only step wins it decodes target-only for a back-off of 2 steps (doubling to 64
  while probes keep losing), then probes again with its best k. The first steps measure, as
  the fixed policy would run: one full draft, one target-only step, then drafts until
  `WARMUP` steps have drafted (or 2, where the best expected rate is below `CLEAR_LOSS` times
  target-only's).

What auto learnt carries over, in one process, to the next request of the same drafter and
target (`make_policy`): costs, acceptance at half weight, the back-off (at most
`RESUME_BACKOFF`: a new prompt may draft better); the warm-up is paid once.

Every choice depends only on the drafts, the drafter's own probabilities and past timings, never
on the target's output of the step being chosen, so decoding stays lossless (greedy output
equals target-only decoding; sampling follows the target's distribution, as with any draft
length).
"""
from __future__ import annotations

import copy
import math
import weakref
from typing import Dict, List, Optional, Sequence

POLICIES = ("auto", "fixed")


def resolve(policy: Optional[str], draft_threshold: Optional[float]) -> str:
    """The policy a call runs: `policy`, or "fixed" when None. (auto is not the default yet: on
    the task suite, 2-core AVX2 EPYC, it measured 1.20x target-only against fixed's 1.23x for
    the default EAGLE-3 chain, though 0.94x / 0.97x / 0.90x against 0.65x / 0.76x / 0.47x for
    PARD / DFlash / EAGLE-3 trees; docs/drafters.md.)

    Raises:
        ValueError naming the argument: an unknown policy, or a draft_threshold with "auto".
    """
    if policy is None:
        return "fixed"
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "auto" and draft_threshold:
        raise ValueError("draft_threshold: applies to the fixed policy (policy='fixed'); "
                         "'auto' chooses draft lengths itself")
    return policy


def threshold_cut(confidences: Sequence[float], threshold: float) -> int:
    """How many drafts a draft threshold keeps: those before the first whose drafter
    probability is below `threshold` (at least one; 0 keeps all)."""
    low = [j for j, c in enumerate(confidences) if c < threshold]
    return max(1, low[0]) if low and threshold > 0 else len(confidences)


class LineFit:
    """y ~ a + b x by least squares over the last `keep` observations of each x, the newest
    weighted 1, each older one `decay` times its successor (so a run of one x, such as
    target-only steps, does not push the others out). With one distinct x seen, `proportional`
    predicts y x / x0 (x0 > 0), else the weighted mean."""

    def __init__(self, keep: int = 8, decay: float = 0.9, proportional: bool = False):
        self.points: List[tuple] = []
        self.keep, self.decay, self.proportional = keep, decay, proportional
        self._fit: Optional[tuple] = None           # (mx, my, slope or None), until an add

    def add(self, x: float, y: float) -> None:
        self.points.append((float(x), float(y)))
        same = [i for i, p in enumerate(self.points) if p[0] == float(x)]
        if len(same) > self.keep:
            del self.points[same[0]]
        self._fit = None

    def __bool__(self) -> bool:
        return bool(self.points)

    def predict(self, x: float) -> float:
        """The fitted y at x (NaN before any observation)."""
        if not self.points:
            return math.nan
        if self._fit is None:
            n = len(self.points)
            w = [self.decay ** (n - 1 - i) for i in range(n)]
            sw = sum(w)
            mx = sum(wi * p[0] for wi, p in zip(w, self.points)) / sw
            my = sum(wi * p[1] for wi, p in zip(w, self.points)) / sw
            sxx = sum(wi * (p[0] - mx) ** 2 for wi, p in zip(w, self.points))
            b = None if sxx < 1e-9 else sum(                 # None: one distinct x
                wi * (p[0] - mx) * (p[1] - my) for wi, p in zip(w, self.points)) / sxx
            self._fit = (mx, my, b)
        mx, my, b = self._fit
        if b is None:
            return my * x / mx if self.proportional and mx > 0 else my
        return max(0.0, my + max(0.0, b) * (x - mx))


class FixedPolicy:
    """Every step asks for `max_drafts` and verifies up to the first draft whose drafter
    probability is below `draft_threshold` (at least one)."""

    name = "fixed"

    def __init__(self, max_drafts: int, draft_threshold: float = 0.0):
        self.max_drafts, self.draft_threshold = max_drafts, draft_threshold
        self.steps = self.drafted = 0

    def plan(self) -> int:
        return self.max_drafts

    def stop_below(self) -> float:
        """The drafter probability below which a one-by-one drafter stops drafting."""
        return self.draft_threshold

    def cut(self, confidences: Sequence[float], draft_s: float) -> int:
        return threshold_cut(confidences, self.draft_threshold)

    def observe(self, asked: int, draft_s: float, confidences: Sequence[float], verified: int,
                accepted: int, verify_s: float) -> None:
        self.steps += 1
        self.drafted += verified > 0

    def report(self) -> dict:
        return {"policy": self.name, "drafted_share": self.drafted / self.steps
                if self.steps else None, "draft_threshold": self.draft_threshold}


class AutoPolicy:
    """The cost-aware policy of the module docstring, for chains (`plan` / `cut` / `observe`) and,
    with `tree_nodes`, for trees (plan returns `tree_nodes` or 0: a whole tree or a target-only
    step)."""

    name = "auto"
    BINS = 10
    BACKOFF = (2, 64)
    WARMUP = 4                      # drafted steps before the first choice ...
    CLEAR_LOSS = 0.6                # ... unless after 2 the best rate is below this x target-only
    DECAY = 0.9                     # of the drafted steps' achieved rate
    KEEP = 0.9                      # drafting stops below this x target-only's rate
    OFF_WEIGHT = 0.3                # the achieved rate's weight kept when drafting stops
    RESUME_BACKOFF = 16             # the most back-off a new request resumes with

    def __init__(self, max_drafts: int, one_by_one: bool = False, tree_nodes: int = 0,
                 sized: bool = True, prior_threshold: float = 0.0):
        self.max_drafts, self.tree_nodes, self.sized = max_drafts, tree_nodes, sized
        self.one_by_one, self.prior_threshold = one_by_one, prior_threshold
        self.verify = LineFit()
        self.draft = LineFit(proportional=one_by_one)
        self.idle = LineFit()                       # a target-only step's session cost
        self.reached = [0] * (max_drafts + 1)      # by draft position (1-based)
        self.taken = [0] * (max_drafts + 1)
        self.bin_seen = [0] * self.BINS
        self.bin_taken = [0] * self.BINS
        self.tree_tokens = LineFit(decay=0.9)      # accepted drafts per tree step
        self.steps = self.drafted = 0
        self.backoff, self.skip_left = self.BACKOFF[0], 0
        self.idle_run, self.idle_run_s = 0, 0.0     # target-only steps since the last draft
        self.done_tokens = self.done_s = 0.0        # drafted steps: decayed tokens and seconds
        self.warm = False                           # warm-up done (by an earlier request)

    # ----- estimates ---------------------------------------------------------------------------
    def alpha(self, j: int) -> float:
        """P(draft j accepted | drafts < j accepted), Beta(1, 1) prior."""
        return (self.taken[j] + 1) / (self.reached[j] + 2)

    def accept(self, p: float) -> float:
        """P(a reached draft of drafter probability p is accepted), prior the bin's centre."""
        b = min(self.BINS - 1, max(0, int(p * self.BINS)))
        centre = (b + 0.5) / self.BINS
        return (self.bin_taken[b] + 2 * centre) / (self.bin_seen[b] + 2)

    def target_rate(self) -> float:
        """Tokens per second of a target-only step."""
        idle = self.idle.predict(0) if self.idle else 0.0
        return 1.0 / (self.verify.predict(1) + idle)

    def rate(self, k: int) -> float:
        """Expected committed tokens per second of a step asking for k drafts (k >= 1)."""
        if self.tree_nodes:
            gain = self.tree_tokens.predict(0) if self.tree_tokens else 1.0
            return (1.0 + gain) / (self.draft.predict(k) + self.verify.predict(k + 1))
        gain, reach = 0.0, 1.0
        for j in range(1, k + 1):
            reach *= self.alpha(j)
            gain += reach
        return (1.0 + gain) / (self.draft.predict(k) + self.verify.predict(k + 1))

    def drafted_rate(self) -> float:
        """Tokens per second the drafted steps achieved (recency-weighted: the cut and a
        one-by-one drafter's early stop included, which `rate` does not model); before 2
        drafted steps, `rate` of the best k."""
        if (self.drafted < 2 and not self.warm) or self.done_s <= 0:
            return max(map(self.rate, self._choices()))
        return self.done_tokens / self.done_s

    def _choices(self) -> range:
        return range(self.tree_nodes, self.tree_nodes + 1) if self.tree_nodes else \
            range(1, self.max_drafts + 1)

    # ----- the step's choices ------------------------------------------------------------------
    def plan(self) -> int:
        """How many drafts to ask for (a tree: `tree_nodes` or 0); 0 = a target-only step. A
        session whose propose takes no max_drafts (`sized` False) always gets the full
        draft (the verified prefix is still chosen, `cut`)."""
        full = self.tree_nodes or self.max_drafts
        if not self.draft or not self.sized:         # first: measure a full draft
            return full
        if not any(x == 1 for x, _ in self.verify.points):
            return 0                                 # then: measure a target-only step
        if self.drafted < self.WARMUP and not self.warm and not (  # then: enough drafts
                self.drafted >= 2
                and self.drafted_rate() < self.CLEAR_LOSS * self.target_rate()):
            return full
        if self.skip_left > 0:
            self.skip_left -= 1
            return full if self.skip_left == 0 else 0   # at 0: probe again
        # hysteresis: a drafting request stops only on a clear loss (KEEP), a probe resumes
        # drafting only on a gain
        if self.drafted_rate() > (self.KEEP if self.backoff == self.BACKOFF[0] else 1.0) \
                * self.target_rate():
            self.backoff = self.BACKOFF[0]
            return full
        if self.backoff == self.BACKOFF[0]:         # drafting stops: probes weigh more
            self.done_tokens *= self.OFF_WEIGHT
            self.done_s *= self.OFF_WEIGHT
        self.skip_left = self.backoff
        self.backoff = min(2 * self.backoff, self.BACKOFF[1])
        return 0

    def stop_below(self) -> float:
        """For a one-by-one drafter: the drafter probability below which drafting stops (its
        measured threshold where it has one, else the module docstring's rule; 0 never)."""
        if not self.one_by_one or self.tree_nodes or self.max_drafts < 2:
            return 0.0                               # (one draft: no next one to stop before)
        if self.prior_threshold > 0 or not self.verify:
            return self.prior_threshold
        more = (self.draft.predict(self.max_drafts) - self.draft.predict(1)) / (
            self.max_drafts - 1) + self.verify.predict(2) - self.verify.predict(1)
        best = max(self.rate(k) for k in self._choices())
        mean = sum(self.alpha(j) for j in range(2, self.max_drafts + 1)) / (self.max_drafts - 1)
        need = best * more / mean
        edge = 1.0
        for b in reversed(range(self.BINS)):        # the run of bins from the top that pay
            if self.accept((b + 0.5) / self.BINS) < need:
                break
            edge = b / self.BINS
        return edge

    def cut(self, confidences: Sequence[float], draft_s: float) -> int:
        """How many of the drafts to verify (at least 1; trees: all): as the drafter's measured
        threshold cuts, where it has one; else the prefix with the best expected rate given
        their drafter probabilities and the drafting already paid."""
        if self.tree_nodes or not confidences:
            return len(confidences)
        if self.prior_threshold > 0:
            return threshold_cut(confidences, self.prior_threshold)
        if not self.verify:
            return len(confidences)                  # (before any verify timing: measure all)
        best, best_rate, gain, reach = 1, -1.0, 0.0, 1.0
        for j, p in enumerate(confidences, 1):
            reach *= self.accept(p)
            gain += reach
            rate = (1.0 + gain) / (draft_s + self.verify.predict(j + 1))
            if rate > best_rate:
                best, best_rate = j, rate
        return best

    def observe(self, asked: int, draft_s: float, confidences: Sequence[float], verified: int,
                accepted: int, verify_s: float) -> None:
        """A step's outcome: `asked` drafts asked for, `draft_s` seconds of propose + commit,
        the drafter probabilities of the drafts, `verified` of them verified, `accepted` of
        those accepted, `verify_s` seconds of the target forward over verified + 1 rows."""
        self.steps += 1
        self.verify.add(verified + 1, verify_s)
        if asked == 0:
            self.idle_run += 1
            self.idle_run_s += draft_s
            return
        self.drafted += 1
        x = len(confidences) if self.one_by_one and confidences else asked
        excess = 0.0
        if self.idle_run and self.draft:
            # a draft after target-only steps catches up on their context: the excess over a
            # steady draft is their cost, spread over them
            excess = max(0.0, draft_s - self.draft.predict(x))
            self.idle.add(0, (self.idle_run_s + excess) / self.idle_run)
        else:
            if self.idle_run:
                self.idle.add(0, self.idle_run_s / self.idle_run)
            self.draft.add(x, draft_s)
        self.idle_run, self.idle_run_s = 0, 0.0
        self.done_tokens = self.DECAY * self.done_tokens + accepted + 1
        self.done_s = self.DECAY * self.done_s + draft_s - excess + verify_s
        if self.tree_nodes:
            self.tree_tokens.add(0, accepted)
            return
        for j in range(1, min(verified, accepted + 1) + 1):   # reached drafts
            self.reached[j] += 1
            self.taken[j] += j <= accepted
            b = min(self.BINS - 1, max(0, int(confidences[j - 1] * self.BINS)))
            self.bin_seen[b] += 1
            self.bin_taken[b] += j <= accepted

    def resume(self, prev: "AutoPolicy") -> "AutoPolicy":
        """Start from the estimates an earlier request of the same drafter and target ended
        with: its cost fits (newer points soon outweigh them as this context differs), its
        acceptance counts and achieved rate at half weight, its back-off; the warm-up is
        skipped where it had finished. Returns self."""
        for name in ("verify", "draft", "idle", "tree_tokens"):
            setattr(self, name, copy.deepcopy(getattr(prev, name)))
        for name in ("reached", "taken", "bin_seen", "bin_taken"):
            setattr(self, name, [v / 2 for v in getattr(prev, name)])
        self.done_tokens, self.done_s = prev.done_tokens / 2, prev.done_s / 2
        self.backoff = min(prev.backoff, self.RESUME_BACKOFF)
        self.warm = prev.drafted >= self.WARMUP or prev.warm
        return self

    def report(self) -> Dict[str, object]:
        """The policy's estimates, JSON-ready (ms; None where not measured)."""
        def ms(v):
            return None if not math.isfinite(v) else round(1e3 * v, 3)

        out = {"policy": self.name,
               "drafted_share": self.drafted / self.steps if self.steps else None,
               "target_step_ms": ms(self.verify.predict(1)) if self.verify else None,
               "verify_ms_per_row": ms(self.verify.predict(2) - self.verify.predict(1))
               if self.verify else None,
               "draft_ms": {k: ms(self.draft.predict(k)) for k in self._choices()}
               if self.draft else None}
        if self.tree_nodes:
            out["tree_accepted"] = self.tree_tokens.predict(0) if self.tree_tokens else None
        else:
            out["acceptance_by_position"] = [round(self.alpha(j), 3)
                                             for j in range(1, self.max_drafts + 1)]
        return out


# {drafter: {(id(target), tree): the latest AutoPolicy}}: what auto learnt, per process
_LEARNT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def make_policy(name: str, drafter, draft_threshold: float = 0.0, tree: bool = False,
                sized: bool = True, target=None):
    """The policy object `name` ("auto" / "fixed") for one generation with `drafter`; `sized`:
    whether its session's propose takes max_drafts (`drafters.protocol`). An auto policy
    resumes from the latest one of the same drafter, `target` (the runtime's model) and tree
    flag in this process (`AutoPolicy.resume`), so a warm-up is paid once, not per request."""
    if name == "fixed":
        return FixedPolicy(drafter.max_tree_nodes if tree else drafter.max_drafts,
                           0.0 if tree else draft_threshold)
    pol = AutoPolicy(drafter.max_drafts, bool(getattr(drafter, "drafts_one_by_one", False)),
                     drafter.max_tree_nodes if tree else 0, sized,
                     0.0 if tree else drafter.default_draft_threshold)
    try:
        learnt = _LEARNT.setdefault(drafter, {})
    except TypeError:                               # not weakly referenceable: no memory
        return pol
    key = (id(target), tree)
    if key in learnt:
        pol.resume(learnt[key])
    learnt[key] = pol
    return pol
