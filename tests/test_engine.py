"""Speculative decoding engine: greedy token identity, lossless sampling, statistics."""
import copy
import gc
import math

import pytest
import torch

from sharpdraft.attention import SharpConfig
from sharpdraft.drafters.dflash import DFlashDrafter
from sharpdraft.inference.engine import _verify, autoregressive_generate, speculative_generate
from sharpdraft_helpers import tiny_drafter, tiny_target


def pristine(target):
    """An independent copy of `target`: same weights, transformers' own SDPA attention and
    nn.Linear layers, whatever `target` was loaded with (the oracle never shares a module with
    the runtime under test)."""
    config = copy.deepcopy(target.config)
    config._attn_implementation = "sdpa"
    config.sharp_config = None
    twin = type(target)(config).eval()
    twin.load_state_dict(target.state_dict())
    return twin


def hf_greedy(target, prompt, n):
    """The independent oracle: transformers' own greedy generate on a pristine copy."""
    out = pristine(target).generate(prompt, max_new_tokens=n, do_sample=False,
                                    min_new_tokens=n)
    return out[0, prompt.shape[1]:].tolist()


class ScriptedDrafter(DFlashDrafter):
    """Proposes a known continuation with chosen positions corrupted (exercises acceptance,
    rejection in the middle of a block and the cache rollback)."""

    def __init__(self, base, prompt_len, continuation, corrupt_every, weak_every=None):
        super().__init__(base.config)
        self.prompt_len, self.cont, self.every = prompt_len, continuation, corrupt_every
        self.weak = weak_every          # positions drafted with low confidence (logit 1, not 10)

    def draft_logits(self, target, last_token, position, new_context, cache):
        b, vocab = self.config.block_size, target.config.vocab_size
        logits = torch.zeros(b - 1, vocab)
        for j in range(1, b):
            i = position + j - self.prompt_len          # index into the continuation
            tok = self.cont[i] if i < len(self.cont) else 0
            if (position + j) % self.every == 0:
                tok = (tok + 1) % vocab
            weak = self.weak is not None and (position + j) % self.weak == 0
            logits[j - 1, tok] = 1.0 if weak else 10.0
        return logits


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_greedy_is_token_identical_to_target_greedy(target, block_size):
    drafter = tiny_drafter(target, block_size=block_size)
    for seed in range(2):
        prompt = torch.randint(3, 256, (1, 5 + 7 * seed), generator=torch.Generator().manual_seed(seed))
        ref = hf_greedy(target, prompt, 24)
        spec = speculative_generate(target, drafter, prompt, 24)
        ar = autoregressive_generate(target, prompt, 24)
        assert spec.tokens == ref, f"seed {seed}: speculative {spec.tokens} != greedy {ref}"
        assert ar.tokens == ref
        assert spec.new_tokens == 24 and spec.target_forwards == 1 + len(spec.accept_lengths)


@pytest.mark.parametrize("corrupt_every", [3, 5, 1000])
def test_greedy_with_accepting_drafter_rolls_back_correctly(target, corrupt_every):
    prompt = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(7))
    ref = hf_greedy(target, prompt, 40)
    drafter = ScriptedDrafter(tiny_drafter(target, block_size=6), 9, ref, corrupt_every).eval()
    res = speculative_generate(target, drafter, prompt, 40)
    assert res.tokens == ref
    assert res.tau > 1.5, res.accept_lengths            # drafts were really accepted
    if corrupt_every == 1000:                           # nothing corrupted: full blocks
        assert all(a == 6 for a in res.accept_lengths[:-1])
    # accounting: tau - 1 is the sum of per-position acceptance, the first token is the prefill's
    assert math.isclose(res.tau - 1, sum(res.acceptance_by_position()), rel_tol=1e-12)
    assert sum(res.accept_lengths) >= res.new_tokens - 1


def test_draft_threshold_cuts_before_the_first_unsure_draft(target):
    """With draft_threshold, each step verifies the drafts before the first one whose drafter
    probability is below it (at least one), and the output is still target greedy."""
    prompt = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(7))
    ref = hf_greedy(target, prompt, 40)
    b, weak = 6, 4
    drafter = ScriptedDrafter(tiny_drafter(target, block_size=b), 9, ref, 5, weak).eval()
    # logit 10 against 255 zeros: p = 0.99; logit 1: p = e / (e + 255) = 0.0105
    full = speculative_generate(target, drafter, prompt, 40)
    cut = speculative_generate(target, drafter, prompt, 40, draft_threshold=0.5)
    assert full.tokens == cut.tokens == ref
    assert all(n == b - 1 for n in full.draft_lengths)
    for n, pos in zip(cut.draft_lengths, cut.context_lengths):
        first_weak = next(j for j in range(1, b + weak) if (pos + j) % weak == 0)
        assert n == min(b - 1, max(1, first_weak - 1)), (pos, n)
    assert cut.summary()["mean_draft_length"] < b - 1
    with pytest.raises(ValueError, match="draft_threshold"):
        speculative_generate(target, drafter, prompt, 4, draft_threshold=1.5)


def test_a_checkpoints_draft_threshold_is_the_default(target, tmp_path):
    """`generate` with the fixed policy and no draft_threshold cuts drafts at the drafter
    config's measured draft_threshold (kept through save / read_config); an explicit 0 (which
    implies the fixed policy) still verifies every draft;
    a threshold outside [0, 1] in config.json is refused naming the field."""
    from sharpdraft import generate

    prompt = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(7))
    ref = hf_greedy(target, prompt, 40)
    base = tiny_drafter(target, block_size=6)
    base.config.draft_threshold = 0.5
    base.save(tmp_path / "ckpt")
    config = DFlashDrafter.read_config(tmp_path / "ckpt")
    assert config.draft_threshold == 0.5
    drafter = ScriptedDrafter(DFlashDrafter(config), 9, ref, 5, 4).eval()
    assert drafter.default_draft_threshold == 0.5
    default = generate(target, drafter, prompt, max_new_tokens=40, policy="fixed")
    cut = speculative_generate(target, drafter, prompt, 40, draft_threshold=0.5)
    full = generate(target, drafter, prompt, max_new_tokens=40, draft_threshold=0.0)
    assert default.tokens == cut.tokens == full.tokens == ref
    assert default.draft_lengths == cut.draft_lengths
    assert all(n == 5 for n in full.draft_lengths) and min(default.draft_lengths) < 5
    with pytest.raises(ValueError, match="draft_threshold"):
        DFlashDrafter.read_config(tmp_path / "ckpt", overrides={"draft_threshold": 1.5})


def test_eos_and_max_new_tokens_stop_exactly(target):
    prompt = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    ref = hf_greedy(target, prompt, 30)
    eos = ref[13]
    stop = ref.index(eos) + 1                       # the first time eos appears
    drafter = ScriptedDrafter(tiny_drafter(target, block_size=8), 9, ref, 1000).eval()
    res = speculative_generate(target, drafter, prompt, 30, eos_token_id=eos)
    assert res.tokens == ref[:stop]
    res = speculative_generate(target, drafter, prompt, 11)
    assert res.tokens == ref[:11]


def test_decoding_pauses_the_cyclic_gc_and_restores_its_state(target):
    """The loops run with the cyclic collector off (engine.gc_paused) and leave it as found."""
    prompt = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(5))
    drafter = tiny_drafter(target, block_size=4)
    runs = {"ar": lambda tick: autoregressive_generate(target, prompt, 6, progress=tick),
            "spec": lambda tick: speculative_generate(target, drafter, prompt, 6, progress=tick)}
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            for name, run in runs.items():
                (gc.enable if enabled else gc.disable)()
                during = []
                assert run(lambda n: during.append(gc.isenabled())).new_tokens == 6
                assert during and not any(during), name
                assert gc.isenabled() is enabled, name
    finally:
        (gc.enable if was else gc.disable)()


def test_sharp_drafter_is_still_lossless(target):
    drafter = tiny_drafter(target, block_size=4)
    drafter.sharp = SharpConfig(mode="fixed_slope", slope=0.3, n_ref=4)
    prompt = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(11))
    assert speculative_generate(target, drafter, prompt, 16).tokens == hf_greedy(target, prompt, 16)


def test_bad_arguments_name_the_argument(target):
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="prompt_ids"):
        speculative_generate(target, drafter, torch.randint(0, 9, (2, 4)), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, drafter, torch.randint(0, 9, (1, 4)), 0)
    with pytest.raises(ValueError, match="temperature"):
        autoregressive_generate(target, torch.randint(0, 9, (1, 4)), 3, temperature=-1.0)


# ----- lossless speculative sampling -----------------------------------------------------------
def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_verify_rule_reproduces_a_markov_chain():
    """_verify alone, against a known chain p(x_{t+1} | x_t) and a proposal q far from it.

    The first committed token must follow P[start]; the token after an accepted first draft
    x1 must follow P[x1] (speculative sampling is exact given any accepted prefix).
    """
    V, b, N, start = 5, 4, 4000, 0
    g = torch.Generator().manual_seed(0)
    P = torch.softmax(2 * torch.randn(V, V, generator=g), -1)
    Q = torch.softmax(2 * torch.randn(b - 1, V, generator=g), -1)
    first, second = torch.zeros(V), torch.zeros(V, V)
    for _ in range(N):
        drafts = torch.multinomial(Q, 1, generator=g)[:, 0].tolist()
        out = _verify(torch.log(P[[start] + drafts]), drafts, Q, 1.0, g)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0], out[1]] += 1
    assert chi_square(first, P[start]) < 20.5              # df 4: P(chi2 > 20.5) ~ 4e-4
    tested = [x for x in range(V) if second[x].sum() >= 200]
    assert tested, second
    for x1 in tested:
        assert chi_square(second[x1], P[x1]) < 20.5, (x1, second[x1], P[x1])


def exact_first_two(small, prompt):
    """The target's own sampling law after `prompt`, by enumeration: p(x1) (V,), the V
    continuations prompt + x1 (V, L + 1) and p(x2 | x1) (V, V)."""
    V = small.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(small(prompt).logits[0, -1], -1)
        seqs = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
        p2_given_1 = torch.softmax(small(seqs).logits[:, -1], -1)
    return p1, seqs, p2_given_1


def assert_second_token_follows_target(run, small, prompt, seed: int, n: int = 500):
    """Sample `run(generator=g)` n times; the 2nd new token must follow the exact marginal
    p(x2) = sum_x1 p(x1) p(x2 | x1) (chi-square, vocab 8: df 7, P(chi2 > 26) ~ 5e-4)."""
    p1, _, p2_given_1 = exact_first_two(small, prompt)
    p2 = p1 @ p2_given_1
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(small.config.vocab_size)
    for _ in range(n):
        counts[run(generator=g).tokens[1]] += 1
    assert chi_square(counts, p2) < 26.0, (counts / n, p2)


@pytest.mark.parametrize("draft_threshold,policy", [(0.0, "fixed"), (0.13, "fixed"),
                                                    (0.0, "auto")])
def test_sampling_matches_target_distribution(target, draft_threshold, policy):
    """End to end: marginals of the 2nd and 3rd new tokens vs the exact target distribution
    (with draft_threshold 0.13 the random drafter's blocks, p ~ 1/8 each, are cut at random;
    under auto the tokens come from drafted and target-only steps)."""
    small = tiny_target(seed=5, vocab=8)
    drafter = tiny_drafter(small, block_size=3)
    prompt = torch.tensor([[1, 5, 2, 7]])
    p1, seqs, p2_given_1 = exact_first_two(small, prompt)
    p2 = p1 @ p2_given_1
    with torch.no_grad():
        seqs3 = torch.cat([seqs.repeat_interleave(8, 0), torch.arange(8).repeat(8)[:, None]], 1)
        p3_given_12 = torch.softmax(small(seqs3).logits[:, -1], -1)           # (64, 8)
        p3 = (p1[:, None] * p2_given_1).reshape(64) @ p3_given_12
    g = torch.Generator().manual_seed(1)
    N = 500
    c2, c3 = torch.zeros(8), torch.zeros(8)
    for _ in range(N):
        toks = speculative_generate(small, drafter, prompt, 3, temperature=1.0, generator=g,
                                    draft_threshold=draft_threshold, policy=policy).tokens
        c2[toks[1]] += 1
        c3[toks[2]] += 1
    # df 7: P(chi2 > 26) ~ 5e-4
    assert chi_square(c2, p2) < 26.0, (c2 / N, p2)
    assert chi_square(c3, p3) < 26.0, (c3 / N, p3)
