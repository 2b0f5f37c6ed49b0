"""PARD drafter: the multi-copy training mask against a brute-force construction, conditional
token drop, training forward = inference forward, lossless decoding."""
import itertools

import pytest
import torch

from sharpdraft.attention import SharpConfig
from sharpdraft.drafters.layers import window_mask
from sharpdraft.drafters.pard import PARDDrafter, conditional_keep, parallel_draft_mask
from sharpdraft.inference.engine import autoregressive_generate, speculative_generate
from sharpdraft_helpers import tiny_pard, tiny_target
from test_engine import assert_second_token_follows_target, hf_greedy


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def brute_force_mask(keep):
    """Row (j, p) is mask j of an inference step whose last real token sits at s = p - j: it sees
    real tokens 0 .. s and the masks 1 .. j at positions s + 1 .. s + j, which training holds as
    copy i at position s + i."""
    C, T = keep.shape
    rows = [(j, p) for j in range(C) for p in range(T) if keep[j, p]]
    m = torch.zeros(len(rows), len(rows), dtype=torch.bool)
    for a, (j, p) in enumerate(rows):
        s = p - j
        sees = {(0, q) for q in range(s + 1)} | {(i, s + i) for i in range(1, j + 1)}
        for b, key in enumerate(rows):
            m[a, b] = key in sees
    return m


@pytest.mark.parametrize("C, T", [(1, 5), (2, 4), (3, 6), (4, 7)])
def test_training_mask_matches_brute_force(C, T):
    g = torch.Generator().manual_seed(C * 10 + T)
    for rate in (1.0, 0.6):
        keep = conditional_keep(C, T + 1, rate, g)[:, :T] if rate < 1 else torch.ones(C, T,
                                                                                      dtype=bool)
        if rate == 1.0:
            for j in range(C):
                keep[j, :j] = False          # copy j starts at position j (needs p - j >= 0)
        m = parallel_draft_mask(keep)
        assert torch.equal(m, brute_force_mask(keep))
        # cardinality of each row: p + 1 (its real prefix, then j masks)
        pos = torch.arange(T)[None].expand(C, T)[keep]
        assert torch.equal(m.sum(-1), pos + 1)


def test_conditional_keep_keeps_ancestors():
    g = torch.Generator().manual_seed(0)
    keep = conditional_keep(6, 400, 0.7, g)
    assert keep[0, :-1].all() and not keep[:, -1].any()
    for j, p in itertools.product(range(1, 6), range(400)):
        if keep[j, p]:
            assert keep[j - 1, p - 1]
    frac = keep[:, :-1].float().mean(1)
    for j in range(1, 4):                   # about rate ** j (binomial, 400 draws)
        assert abs(float(frac[j]) - 0.7 ** j) < 0.1, frac


@pytest.mark.parametrize("window,sinks", [(None, 0), (5, 0), (5, 2)])
def test_training_forward_equals_inference(target, window, sinks):
    """Copy j's row at p (training) gives the logits of draft j + 1 of the inference step whose
    last real token is at p - j, with or without a context window (and attention sinks; both
    layers)."""
    drafter = tiny_pard(target, num_draft_tokens=4)
    drafter.context_window, drafter.attention_sinks = window, sinks
    ids = torch.randint(3, 256, (16,), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(4, 16, dtype=torch.bool)
    for j in range(4):
        keep[j, :j] = False
    with torch.no_grad():
        train = drafter.train_logits(target, ids, keep)
    index = {rc: i for i, rc in enumerate((j, p) for j in range(4) for p in range(16)
                                          if keep[j, p])}
    for s in (0, 6, 11):
        session = drafter.start(target, ids[None, :s])
        _, logits = session.propose(int(ids[s]), s, lambda row: int(row.argmax()))
        for j in range(4):
            torch.testing.assert_close(logits[j], train[index[(j, s + j)]], rtol=1e-4,
                                       atol=1e-4)


def test_trained_keep_by_hand():
    """C = 3 copies, targets 3 and 4 trained: copy 1 keeps rows 2 .. 4 (a trained target at p or
    p + 1), copy 2 only row 3 and 4 (its own target), copy 0 keeps everything."""
    from sharpdraft.training.pard import trained_keep
    keep = torch.ones(3, 7, dtype=torch.bool)
    trained = torch.tensor([0, 0, 0, 1, 1, 0, 0], dtype=torch.bool)
    got = trained_keep(keep, trained)
    assert got[0].all()
    assert got[1].nonzero().flatten().tolist() == [2, 3, 4]
    assert got[2].nonzero().flatten().tolist() == [3, 4]


def test_trained_rows_loss_equals_the_full_loss(target):
    """The recipe's trimmed forward (mask-copy rows without a trained target dropped, the LM
    head on trained rows only) gives the full forward's logits on every trained row, so the
    same per-copy losses and gradient."""
    from sharpdraft.training.pard import copy_rows, trained_keep
    drafter = tiny_pard(target, num_draft_tokens=4).train()
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(8))
    trained = torch.zeros(30, dtype=torch.bool)
    trained[12:20] = trained[24:29] = True
    keep = conditional_keep(4, 30, 0.8, torch.Generator().manual_seed(1))
    full = drafter.train_logits(target, ids, keep)
    pos, copy = copy_rows(keep)
    want_full = full[trained[pos]]
    trimmed = trained_keep(keep, trained)
    assert int(trimmed.sum()) < int(keep.sum())
    wanted = trimmed & trained[None, :]
    part = drafter.train_logits(target, ids, trimmed, wanted)
    torch.testing.assert_close(part, want_full, rtol=1e-5, atol=1e-5)
    g = []
    for lg in (want_full, part):
        drafter.zero_grad()
        lg.logsumexp(-1).sum().backward(retain_graph=True)
        g.append(drafter.layers[0].mlp.down_proj.weight.grad.clone())
    torch.testing.assert_close(g[1], g[0], rtol=1e-4, atol=1e-6)
    assert float(g[0].abs().sum()) > 0
    with pytest.raises(ValueError, match="wanted"):
        drafter.train_logits(target, ids, trimmed, keep)


@pytest.mark.parametrize("sharp", ["none", "fixed_slope"])
def test_greedy_is_token_identical_to_target_greedy(target, sharp):
    drafter = tiny_pard(target, num_draft_tokens=5)
    drafter.sharp = SharpConfig(mode=sharp, slope=0.3, n_ref=8)
    for seed in range(2):
        prompt = torch.randint(3, 256, (1, 5 + 30 * seed),
                               generator=torch.Generator().manual_seed(seed))
        ref = hf_greedy(target, prompt, 24)
        res = speculative_generate(target, drafter, prompt, 24)
        assert res.tokens == ref
        assert all(n == 5 for n in res.draft_lengths)
    assert autoregressive_generate(target, prompt, 24).tokens == ref


def test_sampling_matches_target_distribution():
    small = tiny_target(seed=5, vocab=8)
    drafter = tiny_pard(small, num_draft_tokens=2)
    prompt = torch.tensor([[1, 5, 2, 7]])
    assert_second_token_follows_target(
        lambda generator: speculative_generate(small, drafter, prompt, 2, temperature=1.0,
                                               generator=generator), small, prompt, seed=3)


def test_save_load_round_trip(target, tmp_path):
    drafter = tiny_pard(target, draft_vocab_size=64)
    drafter.set_draft_vocab(torch.arange(0, 256, 4))
    drafter.save(tmp_path)
    back = PARDDrafter.load(tmp_path)
    assert back.config == drafter.config
    for (k, a), (_, b) in zip(drafter.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    prompt = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    assert speculative_generate(target, back, prompt, 12).tokens == hf_greedy(target, prompt, 12)


def test_rows_see_the_committed_prefix_and_earlier_rows(target, monkeypatch):
    """Each forward's row i (committed tokens not yet cached, `last`, then the masks) sees
    n_i = position + 1 keys: the mask rows of earlier steps were dropped from the cache."""
    import sharpdraft.attention as attention
    import sharpdraft_ext as ext
    k = 4
    drafter = tiny_pard(target, num_draft_tokens=k)
    calls, real = [], ext.sharp_attention

    def attn(q, kk, v, **kw):
        calls.append(ext.visible_counts(q, kk, causal=kw.get("causal", False),
                                        attn_mask=kw.get("attn_mask"))[0, 0])
        return real(q, kk, v, **kw)

    monkeypatch.setattr(attention.ext, "sharp_attention", attn)
    prompt = torch.randint(3, 256, (1, 13), generator=torch.Generator().manual_seed(4))
    session = drafter.start(target, prompt)
    position = 13
    for step in range(3):
        calls.clear()
        drafts, _ = session.propose(7 + step, position, lambda row: int(row.argmax()))
        assert len(calls) == 2                                  # one per layer
        for n in calls:                                         # rows end at position + k - 1
            assert torch.equal(n, torch.arange(position + k - len(n), position + k) + 1)
        accepted = drafts[:step] + [5]                          # step drafts, then a target token
        session.commit(accepted)
        position += len(accepted)


@pytest.mark.parametrize("window", [None, 4])
def test_prompt_run_at_start_drafts_as_a_first_step_over_it(target, window):
    """start() runs the drafter over the prompt (absorb_prompt); the first draft step then
    drafts what a step over prompt, last token and masks in one forward gives."""
    from transformers import DynamicCache
    from sharpdraft.drafters.pard import PARDSession

    drafter = tiny_pard(target, num_draft_tokens=4)
    drafter.context_window = window
    prompt = torch.randint(3, 256, (1, 13), generator=torch.Generator().manual_seed(6))
    eager = drafter.start(target, prompt)
    assert eager.cache.get_seq_length() == 13
    lazy = PARDSession(drafter, target, prompt[0].tolist(), DynamicCache())
    a, la = eager.propose(9, 13, lambda row: int(row.argmax()))
    b, lb = lazy.propose(9, 13, lambda row: int(row.argmax()))
    assert a == b
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)


def test_window_mask_by_hand():
    # rows 3..6 (context rows 3, 4; first draft position 5), window 2
    m = window_mask(torch.arange(3, 7), 5, 2)[0, 0]
    want = torch.tensor([[0, 1, 1, 1, 0, 0, 0],       # p=3: keys 1..3
                         [0, 0, 1, 1, 1, 0, 0],       # p=4: keys 2..4
                         [0, 0, 0, 1, 1, 1, 0],       # p=5 (draft): keys 3..5
                         [0, 0, 0, 1, 1, 1, 1]],      # p=6 (draft): keys 3..6
                        dtype=torch.bool)
    assert torch.equal(m, want)
    assert window_mask(torch.arange(0, 4), 2, 2) is None          # nothing cut: plain causal
    assert window_mask(torch.arange(3, 7), 5, None) is None
    # one sink: key 0 stays visible to every row
    sunk = window_mask(torch.arange(3, 7), 5, 2, sinks=1)[0, 0]
    want[:, 0] = True
    assert torch.equal(sunk, want)
    assert window_mask(torch.arange(0, 4), 3, 2, sinks=1) is None  # row 3 sees 0 and 1 .. 3


def test_last_keys_keep_the_sinks_and_the_window_by_hand():
    from sharpdraft.drafters.layers import last_keys
    k = torch.arange(10.0).view(1, 1, 10, 1)
    mask = torch.arange(10)[None, None, None] % 2 == 0
    kk, vv, mm = last_keys(k, -k, 3, own=1, attn_mask=mask, sinks=2)
    assert kk.flatten().tolist() == [0, 1, 6, 7, 8, 9] and torch.equal(vv, -kk)
    assert mm.flatten().tolist() == [True, False, True, False, True, False]
    assert last_keys(k, k, 3, own=1, sinks=6)[0] is k           # nothing between: all of it


def test_context_window_equals_a_truncated_context(target):
    """One layer (its keys depend on the tokens only): with context_window W the drafts at
    position P read the same as a plain session started on the last W committed tokens (RoPE
    sees only distances), and a window wider than the context changes nothing."""
    drafter = tiny_pard(target, num_draft_tokens=3)
    drafter.layers = drafter.layers[:1]
    ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(6))
    last, P, W = 77, 30, 9

    def logits(d, prompt, position):
        return d.start(target, prompt).propose(last, position, lambda r: int(r.argmax()))[1]

    plain = logits(drafter, ids[:, -W:], W)
    drafter.context_window = W
    torch.testing.assert_close(logits(drafter, ids, P), plain, rtol=1e-4, atol=1e-4)
    drafter.context_window = 40
    wide = logits(drafter, ids, P)
    drafter.context_window = None
    torch.testing.assert_close(wide, logits(drafter, ids, P), rtol=0, atol=0)
    assert not torch.allclose(plain, wide, atol=1e-3)        # the window did cut the context


def test_context_window_bounds_n_i_and_stays_lossless(target, monkeypatch):
    import sharpdraft.attention as attention
    import sharpdraft_ext as ext
    drafter = tiny_pard(target, num_draft_tokens=4)
    drafter.context_window = 6
    counts, real, inside = [], ext.sharp_attention, []
    real_forward = drafter.forward

    def forward(*a, **kw):                  # count the drafter's attention calls only
        inside.append(True)
        try:
            return real_forward(*a, **kw)
        finally:
            inside.pop()

    def attn(q, kk, v, **kw):
        if inside:
            counts.append(ext.visible_counts(q, kk, causal=kw.get("causal", False),
                                             attn_mask=kw.get("attn_mask"))[0, 0])
        return real(q, kk, v, **kw)

    monkeypatch.setattr(drafter, "forward", forward)
    monkeypatch.setattr(attention.ext, "sharp_attention", attn)
    prompt = torch.randint(3, 256, (1, 25), generator=torch.Generator().manual_seed(8))
    ref = hf_greedy(target, prompt, 20)
    assert speculative_generate(target, drafter, prompt, 20).tokens == ref
    # W context keys plus at most the step's 4 own rows (3 drafts after `last`), itself included
    assert counts and all(int(n.max()) <= 6 + 4 for n in counts)
    assert all(int(n.min()) >= 1 for n in counts)
    assert any(int(n.max()) == 6 + 4 for n in counts)


def test_evaluate_on_trimmed_rows_equals_the_full_forward(target):
    """The held-out evaluation runs the trimmed forward (rows leading to no trained target
    dropped, the LM head on trained rows); its agreement counts, tau proxy and loss equal those
    of the full forward over every copy row, computed here directly. The target's top-1 is
    set to the drafter's own guess at most rows so that agreements and runs are not all zero."""
    from sharpdraft.training import losses
    from sharpdraft.training.pard import copy_rows, evaluate
    k, T = 4, 40
    drafter = tiny_pard(target, num_draft_tokens=k)
    ids = torch.randint(3, 256, (T,), generator=torch.Generator().manual_seed(5))
    trained = torch.zeros(T, dtype=torch.bool)
    trained[10:22] = trained[28:38] = True                   # two responses, prompt rows between
    keep = torch.ones(k, T, dtype=torch.bool)
    for j in range(k):
        keep[j, :j] = False
    keep[:, T - 1] = False
    with torch.no_grad():
        full = drafter.train_logits(target, ids, keep)
    pos, copy = copy_rows(keep)
    guess = full.argmax(-1)
    # no near-tie on a trained row: the trimmed forward's logits differ from these by float
    # rounding only (1e-5 at most, test above), so its argmax is the same on any CPU
    top2 = full[trained[pos]].topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4
    top_i = torch.randint(3, 256, (T, 6), generator=torch.Generator().manual_seed(6))
    for r in range(pos.numel()):   # row p's target: copy p % k's guess, so that runs start
        p, c = int(pos[r]), int(copy[r])               # at anchors p = 0 mod k (some broken)
        if c == p % k and p % 7:
            top_i[p, 0] = guess[r]
    top_p = torch.softmax(torch.randn(T, 6, generator=torch.Generator().manual_seed(7)), -1)
    seq = {"ids": ids, "top_p": top_p, "top_i": top_i, "trained": trained}
    got = evaluate(drafter, target, [seq], window=T)

    v = trained[pos]
    ok = torch.zeros(k, T, dtype=torch.bool)
    ok[keep] = (guess == top_i[pos, 0]) & v
    hits = ok.sum(1).float()
    counts = torch.zeros(k, T, dtype=torch.bool)
    counts[keep] = v
    per = hits / counts.sum(1).float()
    anchors = torch.arange(T - k)
    runs = torch.stack([ok[m, anchors + m] for m in range(k)], 1).int().cumprod(1).sum(1)
    ce = losses.soft_cross_entropy(full[v], top_p[pos][v], top_i[pos][v])
    loss = torch.stack([ce[copy[v] == j].mean() for j in range(k)]).mean()
    assert float(hits.sum()) >= 8 and int(runs.max()) >= 2            # not a run of zeros
    assert got["top1_per_position"] == [round(float(x), 4) for x in per]
    assert got["tau_proxy"] == pytest.approx(1.0 + float(runs[trained[anchors]].float().mean()))
    walk = losses.decoding_walk(runs, trained[anchors])
    assert got["tau_walk"] == pytest.approx(float(walk.mean()))
    assert got["loss"] == pytest.approx(float(loss), rel=1e-5)
