"""EAGLE-3 drafter: chain and tree decoding stay lossless, tree rows get the cardinality the spec
gives, the training-time-test forward matches inference, and nothing depends on the training
length."""
import json

import pytest
import torch
from transformers import DynamicCache

import sharpdraft_ext as ext
from sharpdraft import attention
from sharpdraft.attention import SharpConfig
from sharpdraft.drafters.eagle3 import Eagle3Drafter
from sharpdraft.drafters.eagle3_session import Eagle3Session
from sharpdraft.drafters.trees import DraftTree, expand_frontier
from sharpdraft.inference.engine import (autoregressive_generate, speculative_generate,
                                         tree_speculative_generate, verify_tree)
from sharpdraft_helpers import tiny_eagle3, tiny_target
from test_engine import assert_second_token_follows_target, chi_square, hf_greedy


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def prompt_of(n, seed):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("sharp", ["none", "fixed_slope"])
def test_decoding_is_token_identical_to_target_greedy(target, tree, sharp):
    drafter = tiny_eagle3(target, tree_topk=3, tree_depth=3, tree_tokens=8, chain_length=4)
    drafter.sharp = SharpConfig(mode=sharp, slope=0.3, n_ref=8)
    run = tree_speculative_generate if tree else speculative_generate
    for seed in range(2):
        prompt = prompt_of(6 + 9 * seed, seed)
        ref = hf_greedy(target, prompt, 20)
        res = run(target, drafter, prompt, 20)
        assert res.tokens == ref, (seed, res.tokens, ref)
        assert res.target_forwards == 1 + len(res.accept_lengths)
        if tree:
            assert all(n == 8 for n in res.draft_lengths)


@pytest.mark.parametrize("window", [None, 5])
def test_prompt_keys_written_at_start_draft_as_the_full_first_pass(target, window):
    """start() stores the prompt's keys and values without attending (absorb_prompt); the
    first draft step then drafts what one pass of the layer over every prompt row gives."""
    from transformers import DynamicCache
    from sharpdraft.target.runtime import TargetRuntime

    drafter = tiny_eagle3(target, chain_length=4)
    drafter.context_window = window
    prompt = prompt_of(19, 4)
    runtime = TargetRuntime.prepare(target, hidden_layers=drafter.hidden_layers)
    runtime.start(40)
    out = runtime.forward(prompt, last_only=True)
    eager = drafter.start(target, prompt, out.hidden, runtime.cache)
    assert eager.cache.get_seq_length() == 18 and eager.pending.shape[1] == 1
    lazy = Eagle3Session(drafter, target, prompt[0].tolist(),
                            drafter.context_features(out.hidden), DynamicCache())
    last = int(out.logits[-1].argmax())
    a, la = eager.propose(last, 19, lambda row: int(row.argmax()))
    b, lb = lazy.propose(last, 19, lambda row: int(row.argmax()))
    assert a == b
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)


def test_chain_drafting_stops_where_the_threshold_cuts(target, monkeypatch):
    """With draft_threshold, an EAGLE-3 session stops drafting after the first draft below it
    (drafts_one_by_one): the same drafts reach verification as when every draft is computed and
    the engine cuts, the output stays target greedy, and drafter forwards are spared."""
    drafter = tiny_eagle3(target, chain_length=5)
    prompt = prompt_of(12, 3)
    ref = hf_greedy(target, prompt, 24)
    steps = {"n": 0}
    step = Eagle3Drafter.step

    def counted(self, *a, **k):
        steps["n"] += 1
        return step(self, *a, **k)

    monkeypatch.setattr(Eagle3Drafter, "step", counted)
    spared, varied = False, False
    for threshold in (0.002, 0.004, 0.006, 0.01):
        runs = {}
        for early in (True, False):
            monkeypatch.setattr(drafter, "drafts_one_by_one", early)
            steps["n"] = 0
            res = speculative_generate(target, drafter, prompt, 24, draft_threshold=threshold)
            assert res.tokens == ref
            runs[early] = (res.draft_lengths, res.accept_lengths, steps["n"])
        assert runs[True][:2] == runs[False][:2], threshold
        assert runs[True][2] <= runs[False][2]
        spared |= runs[True][2] < runs[False][2]
        varied |= 1 < max(runs[True][0]) and min(runs[True][0]) < 5
    assert spared and varied


class ScriptedTreeDrafter(Eagle3Drafter):
    """Proposes trees holding the known greedy continuation on one branch among wrong siblings
    (exercises acceptance deep in a tree and the target cache keeping only the accepted path)."""

    def __init__(self, base, prompt_len, continuation, wrong_from):
        super().__init__(base.config)
        self.prompt_len, self.cont, self.wrong_from = prompt_len, continuation, wrong_from

    def start(self, target, prompt_ids, hidden_states, target_cache=None):
        outer = self

        class Session:
            def propose_tree(self, last, position):
                i = position + 1 - outer.prompt_len          # index of the next token in cont
                tokens, parents, depths = [], [], []
                parent = -1
                for d in range(1, outer.config.tree_depth + 1):
                    true = outer.cont[i + d - 1] if i + d - 1 < len(outer.cont) else 0
                    if d >= outer.wrong_from:
                        true = (true + 1) % 256
                    for tok in ((true + 7) % 256, true):      # a wrong sibling first
                        tokens.append(tok)
                        parents.append(parent)
                        depths.append(d)
                    parent = len(tokens) - 1
                return DraftTree(tokens, parents, depths)

            def commit(self, accepted, hidden_states):
                # only the path's rows, of the layers the drafter reads
                assert sorted(hidden_states) == outer.hidden_layers
                assert all(h.shape[1] == len(accepted) for h in hidden_states.values())

        return Session()


@pytest.mark.parametrize("wrong_from", [2, 4, 99])
def test_tree_verification_commits_the_accepted_path(target, wrong_from):
    prompt = prompt_of(9, 4)
    ref = hf_greedy(target, prompt, 30)
    base = tiny_eagle3(target, tree_depth=4)
    drafter = ScriptedTreeDrafter(base, 9, ref, wrong_from).eval()
    res = tree_speculative_generate(target, drafter, prompt, 30)
    assert res.tokens == ref
    depth_ok = min(wrong_from - 1, 4)                 # drafts accepted per full step
    assert all(a == depth_ok + 1 for a in res.accept_lengths[:-1]), res.accept_lengths


def test_tree_rows_see_the_prefix_and_their_ancestors(target, monkeypatch):
    """n_i of every drafter row (counted by ext.visible_counts from the mask the drafter builds)
    is position + 1: the committed rows before it plus its ancestors and itself."""
    drafter = tiny_eagle3(target, tree_topk=3, tree_depth=4, tree_tokens=12)
    seen = []
    real_step, real_attn = drafter.step, ext.sharp_attention

    def step(embeds, hidden, positions, cache, attn_mask=None):
        seen.append({"positions": positions.clone()})
        try:
            return real_step(embeds, hidden, positions, cache, attn_mask)
        finally:
            seen[-1]["done"] = True

    def attn(q, k, v, **kw):
        if seen and "done" not in seen[-1]:          # the drafter's calls, not the target's
            seen[-1]["n"] = ext.visible_counts(q, k, causal=kw.get("causal", False),
                                               attn_mask=kw.get("attn_mask"))
        return real_attn(q, k, v, **kw)

    monkeypatch.setattr(drafter, "step", step)
    monkeypatch.setattr(attention.ext, "sharp_attention", attn)
    prompt = prompt_of(11, 5)
    tree_speculative_generate(target, drafter, prompt, 12)
    assert len(seen) > 3
    for s in seen:
        n = s["n"][0, 0]                              # (Lq,), every head alike
        assert torch.equal(n, s["positions"][0] + 1), (n, s["positions"])


def test_tree_decoding_needs_a_tree_drafter(target):
    from sharpdraft_helpers import tiny_drafter
    with pytest.raises(ValueError, match="drafter"):
        tree_speculative_generate(target, tiny_drafter(target), prompt_of(5, 0), 4)


def test_draft_tree_is_ancestor_closed_and_sized(target):
    drafter = tiny_eagle3(target, tree_topk=3, tree_depth=4, tree_tokens=10)
    prompt = prompt_of(12, 6)
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
    session = drafter.start(target, prompt, out.hidden_states)
    tree = session.propose_tree(int(out.logits[0, -1].argmax()), prompt.shape[1])
    assert len(tree) == 10
    for i, p in enumerate(tree.parents):
        assert p < i and (p == -1 or tree.depths[i] == tree.depths[p] + 1)
        assert tree.depths[i] == 1 or p >= 0
    mask = tree.mask()
    assert torch.equal(mask.sum(-1), torch.tensor(tree.depths))


@pytest.mark.parametrize("skip", [False, True], ids=["positions", "skipped-positions"])
def test_ttt_forward_matches_chain_inference(target, skip):
    """Depth d of the training-time-test forward at row t equals the d-th chain draft after the
    committed prefix t + 1 when the drafts are the true tokens, with the rows at positions
    0 .. T - 1 or at position ids that skip forward (position-robust training)."""
    drafter = tiny_eagle3(target)
    ids = prompt_of(14, 7)[0]
    positions = torch.arange(14) + 300 * (torch.arange(14) >= 4) if skip else torch.arange(14)
    with torch.no_grad():
        feats = drafter.context_features(target(ids[None], output_hidden_states=True)
                                         .hidden_states)[0]
        ttt = drafter.ttt_logits(target, feats, ids, 3, positions if skip else None)
    emb = target.get_input_embeddings()
    for t in (0, 5, 9):
        with torch.no_grad():
            cache = DynamicCache()
            pos = positions[None, :t + 1]
            normed, hidden = drafter.step(emb(ids[None, 1:t + 2]), drafter.fuse(feats[None, :t + 1]),
                                          pos, cache)
            normed, hidden = normed[:, -1:], hidden[:, -1:]
            for d in range(3):
                got = drafter.head(target, normed[0, 0])
                torch.testing.assert_close(got, ttt[d][t], rtol=1e-4, atol=1e-4)
                normed, hidden = drafter.step(emb(ids[None, t + 2 + d:t + 3 + d]), hidden,
                                              positions[t:t + 1][None] + 1 + d, cache)
    if skip:                  # the skip changed the distances the rows past it see
        plain = drafter.ttt_logits(target, feats, ids, 3)
        assert not torch.allclose(plain[0][9], ttt[0][9], atol=1e-3)
        torch.testing.assert_close(plain[0][:4], ttt[0][:4], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "context-window"])
def test_ttt_forward_on_listed_rows_equals_the_full_forward(target, window):
    """`ttt_logits(rows=...)` drafts only the listed rows: depth d returns the listed rows below
    T - 1 - d, and each equals the full forward's row (every row still a depth-0 key), with
    skipped positions and with a context window."""
    drafter = tiny_eagle3(target)
    drafter.context_window = window
    ids = prompt_of(15, 4)[0]
    positions = torch.arange(15) + 200 * (torch.arange(15) >= 6)
    rows = torch.tensor([1, 4, 5, 9, 12, 13])
    with torch.no_grad():
        feats = drafter.context_features(target(ids[None], output_hidden_states=True)
                                         .hidden_states)[0]
        full = drafter.ttt_logits(target, feats, ids, 3, positions)
        part = drafter.ttt_logits(target, feats, ids, 3, positions, rows)
    for d in range(3):
        kept = rows[rows < 14 - d]
        assert part[d].shape == (kept.numel(), full[d].shape[1])
        torch.testing.assert_close(part[d], full[d][kept], rtol=1e-5, atol=1e-5)
    assert [p.shape[0] for p in part] == [6, 5, 4]          # row 13 stops at depth 0, 12 at 1
    for bad in (torch.tensor([3, 2]), torch.tensor([0, 14]), torch.tensor([-1, 2])):
        with pytest.raises(ValueError, match="rows"):
            drafter.ttt_logits(target, feats, ids, 3, rows=bad)


def test_trained_only_losses_equal_the_full_losses(target):
    """The recipe's trained-rows-only forward gives the full forward's losses on every valid row
    (prompt rows in between, a gap in the response) and the same gradient of the step loss."""
    from sharpdraft.training import eagle3 as te
    drafter = tiny_eagle3(target).train()
    ids = prompt_of(24, 5)[0]
    with torch.no_grad():
        feats = drafter.context_features(target(ids[None], output_hidden_states=True)
                                         .hidden_states)[0]
        logits = target(ids[None]).logits[0].softmax(-1)
    top_p, top_i = logits.topk(8, dim=-1)
    trained = torch.zeros(24, dtype=torch.bool)
    trained[9:15] = trained[18:] = True
    seq = {"ids": ids.int(), "feats": feats, "top_p": top_p / top_p.sum(-1, keepdim=True),
           "top_i": top_i.int(), "trained": trained}
    cols = torch.arange(feats.shape[1])
    grads = []
    for only in (False, True):
        drafter.zero_grad()
        per = te.depth_losses(drafter, target, seq, 0, 24, 3, cols, None, trained_only=only)
        loss = sum(te.masked_mean(ce, v) for ce, v, _, _ in per)
        loss.backward()
        grads.append(drafter.fc.weight.grad.clone())
        if not only:
            full = [ce[v] for ce, v, _, _ in per]
            assert sum(int((~v).sum()) for _, v, _, _ in per) > 0       # prompt rows were drafted
        else:      # rows t with a trained target among t + 1 .. t + 3: 6 .. 13 and 15 .. 22
            assert [ce.shape[0] for ce, _, _, _ in per] == [16, 15, 14]
            for d, (ce, v, _, _) in enumerate(per):
                torch.testing.assert_close(ce[v].detach(), full[d].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    assert float(grads[0].abs().sum()) > 0


@pytest.mark.parametrize("sinks", [0, 2])
def test_ttt_forward_with_a_context_window_matches_the_windowed_session(target, sinks):
    """With context_window W (and S attention sinks) the training-time test's depth d at row t
    equals the session's d-th chain draft after the committed prefix t + 1 (the drafts being
    the true tokens), and the window changes those logits once the context is longer than
    W (+ S)."""
    drafter = tiny_eagle3(target, chain_length=3)
    ids = prompt_of(16, 9)[0]
    with torch.no_grad():
        hs = target(ids[None], output_hidden_states=True).hidden_states
        feats = drafter.context_features(hs)[0]
        plain = drafter.ttt_logits(target, feats, ids, 3)
        drafter.context_window, drafter.attention_sinks = 4, sinks
        ttt = drafter.ttt_logits(target, feats, ids, 3)
    for t in (2, 8, 11):
        with torch.no_grad():
            prefix = target(ids[None, :t + 1], output_hidden_states=True).hidden_states
            session = drafter.start(target, ids[None, :t + 1], prefix)
            truth = iter(ids[t + 2:t + 5].tolist())
            _, logits = session.propose(int(ids[t + 1]), t + 1, lambda row: next(truth))
        for d in range(3):
            torch.testing.assert_close(logits[d], drafter.to_target_vocab(target, ttt[d][t:t + 1])[0],
                                       rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ttt[0][:5], plain[0][:5], rtol=1e-5, atol=1e-5)   # t <= W
    assert not torch.allclose(ttt[0][11], plain[0][11], atol=1e-3)


def test_runs_past_its_training_length(target):
    """No position table: a drafter trained at 16 tokens drafts at 300+ tokens (longer than its
    training context and than its config's max_position_embeddings), still lossless, and its
    attention depends on relative positions only."""
    drafter = tiny_eagle3(target, train_context=16, max_position_embeddings=32)
    drafter.sharp = SharpConfig(mode="fixed_slope", slope=0.3, n_ref=16)
    prompt = prompt_of(300, 8)
    ref = autoregressive_generate(target, prompt, 10).tokens
    assert speculative_generate(target, drafter, prompt, 10).tokens == ref
    assert tree_speculative_generate(target, drafter, prompt, 10).tokens == ref
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(0))
    h = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        near = drafter.step(x, h, torch.arange(6)[None], None)[0]
        far = drafter.step(x, h, torch.arange(5000, 5006)[None], None)[0]
    assert torch.isfinite(far).all()
    torch.testing.assert_close(far, near, rtol=1e-3, atol=1e-3)


def test_verify_tree_sampling_follows_the_target():
    """Recursive rejection over siblings: the first committed token follows p(root) whatever the
    children are, and the token after an accepted child x follows p(. | x)."""
    V, N = 5, 4000
    g = torch.Generator().manual_seed(0)
    P = torch.softmax(2 * torch.randn(V + 1, V, generator=g), -1)   # row 0: root, row 1 + x
    a, b, c = P[0].argsort(descending=True)[:3].tolist()     # root's children, likeliest first
    tree = DraftTree([a, b, c, 0], [-1, -1, -1, 0], [1, 1, 1, 2])     # node 3: child of node 0
    logits = torch.log(P[[0, 1 + a, 1 + b, 1 + c, 1]])              # rows: root, nodes 0..3
    first, after_1 = torch.zeros(V), torch.zeros(V)
    for _ in range(N):
        path, out = verify_tree(logits, tree, 1.0, g)
        first[out[0]] += 1
        if path and path[0] == 0:
            after_1[out[1]] += 1
        assert out[:len(path)] == [tree.tokens[i] for i in path]
    assert chi_square(first, P[0]) < 20.5                 # df 4: P(chi2 > 20.5) ~ 4e-4
    assert after_1.sum() > 300
    assert chi_square(after_1, P[1 + a]) < 20.5


def test_tree_sampling_end_to_end_matches_target():
    small = tiny_target(seed=5, vocab=8)
    drafter = tiny_eagle3(small, tree_topk=2, tree_depth=2, tree_tokens=4)
    prompt = torch.tensor([[1, 5, 2, 7]])
    assert_second_token_follows_target(
        lambda generator: tree_speculative_generate(small, drafter, prompt, 2, temperature=1.0,
                                                    generator=generator), small, prompt, seed=2)


def test_save_load_round_trip(target, tmp_path):
    drafter = tiny_eagle3(target, draft_vocab_size=32)
    drafter.set_draft_vocab(torch.arange(0, 256, 8))
    with torch.no_grad():
        drafter.feature_scale.uniform_(0.5, 2.0)
    drafter.save(tmp_path)
    back = Eagle3Drafter.load(tmp_path)
    assert back.config == drafter.config
    for (k, a), (_, b) in zip(drafter.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k


def test_the_checkpoints_measured_context_window_is_the_default(target, tmp_path):
    """load_drafter sets the config's context_window when the caller gives none (None), every
    key with 0, the caller's W otherwise; the field round-trips through config.json and bad
    values are refused before any weight is read."""
    from sharpdraft.drafters.loading import load_drafter
    tiny_eagle3(target, context_window=7).save(tmp_path / "w7")
    tiny_eagle3(target).save(tmp_path / "all")
    assert json.loads((tmp_path / "w7" / "config.json").read_text())["context_window"] == 7
    assert load_drafter(tmp_path / "w7", target).context_window == 7
    assert load_drafter(tmp_path / "w7", target, context_window=0).context_window is None
    assert load_drafter(tmp_path / "w7", target, context_window=3).context_window == 3
    assert load_drafter(tmp_path / "all", target).context_window is None
    d = load_drafter(tmp_path / "w7", target, attention_sinks=2)       # sinks in the default
    assert (d.context_window, d.attention_sinks) == (7, 2)
    with pytest.raises(ValueError, match="attention_sinks"):
        load_drafter(tmp_path / "w7", target, context_window=0, attention_sinks=2)
    with pytest.raises(ValueError, match="attention_sinks"):
        load_drafter(tmp_path / "all", target, attention_sinks=2)
    with pytest.raises(ValueError, match="context_window"):
        load_drafter(tmp_path / "all", target, context_window=-1)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="Eagle3Config.context_window"):
            tiny_eagle3(target, context_window=bad)


def test_a_failed_save_leaves_the_previous_checkpoint_whole(target, tmp_path, monkeypatch):
    """Drafter.save writes each file to a temporary name, then renames it: a save that fails
    while writing the weights leaves the folder's previous checkpoint as it was."""
    from sharpdraft.drafters import base

    first = tiny_eagle3(target, seed=2)
    first.save(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def fail(tensors, path):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(base, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        tiny_eagle3(target, seed=5).save(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    back = Eagle3Drafter.load(tmp_path)
    assert torch.equal(back.fc.weight, first.fc.weight)


@pytest.mark.parametrize("tree", [False, True])
def test_context_window_bounds_n_i_and_stays_lossless(target, monkeypatch, tree):
    """With context_window W every drafter row sees at most W cached keys plus the step's own
    rows (counted by ext.visible_counts), and decoding stays token-identical to greedy."""
    drafter = tiny_eagle3(target, tree_topk=2, tree_depth=3, tree_tokens=6, chain_length=3)
    drafter.context_window = 8
    counts, real_step, real_attn = [], drafter.step, ext.sharp_attention
    rows = []

    def step(embeds, hidden, positions, cache, attn_mask=None):
        rows.append(positions.shape[1])
        try:
            return real_step(embeds, hidden, positions, cache, attn_mask)
        finally:
            rows.append(None)

    def attn(q, k, v, **kw):
        if rows and rows[-1] is not None:             # inside a drafter step
            n = ext.visible_counts(q, k, causal=kw.get("causal", False),
                                   attn_mask=kw.get("attn_mask"))
            counts.append((int(n.max()), rows[-1]))
        return real_attn(q, k, v, **kw)

    monkeypatch.setattr(drafter, "step", step)
    monkeypatch.setattr(attention.ext, "sharp_attention", attn)
    prompt = prompt_of(13, 40)
    ref = hf_greedy(target, prompt, 16)
    run = tree_speculative_generate if tree else speculative_generate
    assert run(target, drafter, prompt, 16).tokens == ref
    assert counts and all(n <= 8 + r for n, r in counts)
    assert any(n > r for n, r in counts)                # the window still holds context


def test_expand_frontier_keeps_every_child_and_expands_the_best():
    """EAGLE-2's pool: every expanded node's k best children, scored parent + log-prob; the next
    frontier is the k best of them, checked against a brute-force enumeration in float64."""
    gen = torch.Generator().manual_seed(3)
    scores = -torch.rand(3, generator=gen, dtype=torch.float64)
    logp = torch.log_softmax(torch.randn(3, 11, generator=gen, dtype=torch.float64), -1)
    tok, score, row, nxt = expand_frontier(scores, logp, 4)
    want = sorted(((float(scores[f] + logp[f, v]), f, v) for f in range(3) for v in range(11)),
                  reverse=True)
    for f in range(3):                        # node f's 4 best children, in its rows
        best = sorted(range(11), key=lambda v: -float(logp[f, v]))[:4]
        assert tok[row == f].tolist() == best
    assert torch.allclose(score, scores[row] + logp[row, tok])
    top4 = [(f, v) for _, f, v in want[:4]]
    assert [(int(row[j]), int(tok[j])) for j in nxt] == top4
