"""LongSpark drafter: the incremental summary, the window view, cached drafting vs the training
forward, losslessness (greedy and sampling) and a state that does not grow with the context."""
import pytest
import torch

import sharpdraft_ext as ext
from sharpdraft.attention import SharpConfig
from sharpdraft.drafters.layers import merge_lse
from sharpdraft.drafters.longspark import LongSparkConfig, LongSparkDrafter
from sharpdraft.inference.engine import autoregressive_generate, speculative_generate
from sharpdraft.target.kv_cache import PreallocatedCache
from sharpdraft.target.runtime import TargetRuntime
from conftest import assert_close_spec
from sharpdraft_helpers import tiny_target
from test_engine import chi_square, exact_first_two


def tiny_longspark(target, *, window=6, summary=4, drafts=3, seed=4, **kw):
    """A LongSpark drafter with random weights (not the target's: nothing cancels by accident)
    whose correction is non-zero."""
    torch.manual_seed(seed)
    cfg = LongSparkConfig.from_target(target.config, mask_token_id=0, num_layers=2,
                                      num_drafts=drafts, window=window, summary_size=summary,
                                      **kw)
    d = LongSparkDrafter(cfg)
    with torch.no_grad():
        d.correction_out.weight.normal_(0, 0.5)
        d.slot_embedding.normal_(0, 0.5)
        d.mask_embedding.normal_()
    return d.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target(max_position_embeddings=8192)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "fixed_slope"])
def test_incremental_summary_equals_one_attention_over_all_keys(target, dtype, mode):
    """Chunks of sizes 5, 0, 1, 17, 3, 40 folded by the LSE merge == one attention of the
    summary queries over all 66 keys (spec §6 rule against float64); with SharpDraft
    every chunk is scored at the same n_visible, the beta of the whole."""
    d = tiny_longspark(target)
    d.sharp = SharpConfig(mode=mode, slope=0.3, n_ref=8)
    g = torch.Generator().manual_seed(11)
    k = torch.randn(1, 2, 66, 16, generator=g).to(dtype)
    v = torch.randn(1, 2, 66, 16, generator=g).to(dtype)
    nv = 66 if mode != "none" else None
    with torch.no_grad():
        state, start = None, 0
        for n in (5, 0, 1, 17, 3, 40):
            if n == 0:
                continue                   # an empty update leaves the summary as it is
            part = d.summary_chunk(1, k[:, :, start:start + n], v[:, :, start:start + n],
                                   n_visible=nv)
            state = part if state is None else merge_lse(*state, *part)
            start += n
        out, lse = state
        g_q = d.summary_queries[1][None]
        kw = dict(mode=mode, slope=0.3, n_ref=8, return_lse=True)
        ref64, lse64 = ext.reference.sharp_attention_ref(g_q.double(), k.double(), v.double(),
                                                         **kw)
        ref_t, lse_t = ext.reference.sharp_attention_ref(g_q.to(dtype), k, v, upcast=False,
                                                         **kw)
    assert out.dtype == torch.float32 and out.shape == (1, 2, 4, 16)   # the running state
    assert_close_spec(out, ref64, ref_t)
    assert_close_spec(lse, lse64, lse_t.float(), name="lse")
    if mode != "none":               # beta at 66 keys > 1 changes the result
        plain = ext.reference.sharp_attention_ref(g_q.double(), k.double(), v.double(),
                                                  mode="none")
        assert (plain - ref64).abs().max() > 1e-3


def test_merge_with_an_empty_side_is_the_other_side():
    g = torch.Generator().manual_seed(2)
    o = torch.randn(1, 2, 3, 4, generator=g)
    lse = torch.randn(1, 2, 3, generator=g)
    empty = (torch.zeros_like(o), torch.full_like(lse, float("-inf")))
    for merged in (merge_lse(o, lse, *empty), merge_lse(*empty, o, lse)):
        torch.testing.assert_close(merged[0], o)
        torch.testing.assert_close(merged[1], lse)


def _filled_cache(n_layers, rows, gen):
    cache = PreallocatedCache(n_layers, 64)
    for layer in range(n_layers):
        cache.update(torch.randn(1, 2, rows, 16, generator=gen),
                     torch.randn(1, 2, rows, 16, generator=gen), layer)
    return cache


def test_window_is_a_view_of_the_last_rows_after_crops_and_keep_paths(target):
    d = tiny_longspark(target, window=6)
    g = torch.Generator().manual_seed(3)
    cache = _filled_cache(4, 20, g)
    s = d.start(target, None, {2: torch.randn(1, 20, 64), 3: torch.randn(1, 20, 64)}, cache)
    layer = cache.layers[d.config.cache_layers[1]]
    for op in (lambda: cache.crop_to(15), lambda: cache.keep(9, [0, 2, 5]),
               lambda: cache.crop_to(4)):
        op()
        k, v = s.window(1)
        n = min(6, layer.length)
        assert torch.equal(k, layer.key_buffer[:, :, layer.length - n:layer.length])
        assert torch.equal(v, layer.value_buffer[:, :, layer.length - n:layer.length])
        assert k.untyped_storage().data_ptr() == layer.key_buffer.untyped_storage().data_ptr()


def _teacher_forced_rounds(target, drafter, prompt, steps, gen):
    """Drive a session by hand over the target runtime, committing a random number of the
    drafts each round; returns (session, ids of positions 0 .. T (the last one the next `last`),
    [(position, last, drafts, logits)])."""
    rt = TargetRuntime.prepare(target, hidden_layers=drafter.hidden_layers, pack=False)
    rt.start(256)
    out = rt.forward(prompt, last_only=True)
    s = drafter.start(target, prompt, out.hidden, rt.cache)
    ids, last, rounds = prompt[0].tolist(), int(out.logits[-1].argmax()), []
    for _ in range(steps):
        pos = rt.length
        assert pos == len(ids)
        drafts, logits = s.propose(last, pos, lambda row: int(row.argmax()))
        rounds.append((pos, last, drafts, logits))
        out = rt.forward(torch.tensor([[last] + drafts]))
        n = 1 + int(torch.randint(len(drafts) + 1, (), generator=gen))   # 1 .. B + 1 rows
        accepted = drafts[:n - 1] + [int(out.logits[n - 1].argmax())]
        rt.crop(pos + n)
        s.commit(accepted, out.hidden)
        ids += [last] + accepted[:-1]
        last = accepted[-1]
    return s, torch.tensor(ids + [last]), rounds


@pytest.mark.parametrize("scope", ["summary", "slots"])
def test_cached_drafting_equals_the_training_forward(target, scope):
    """Session rounds (window read from the target cache, summary folded round by round, rebuilt
    whenever beta moves: tolerance 0) == `block_logits` teacher-forced over the same tokens,
    with SharpDraft on (beta > 1 at these lengths)."""
    d = tiny_longspark(target, beta_tolerance=0.0, sharp_scope=scope)
    d.sharp = SharpConfig(mode="fixed_slope", slope=0.3, n_ref=8)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 256, (1, 9), generator=gen)
    s, ids, rounds = _teacher_forced_rounds(target, d, prompt, 6, gen)
    assert s.rebuilds > 1 if scope == "summary" else s.rebuilds == 1
    with torch.no_grad():
        feats = d.boundary_features(target(ids[None], output_hidden_states=True).hidden_states)
    for pos, last, drafts, logits in rounds:
        assert int(ids[pos]) == last
        pred = torch.tensor([[last] + drafts[:-1]])
        with torch.no_grad():
            z = d.block_logits(target, feats[0], ids, torch.tensor([pos]), pred)[0]
        torch.testing.assert_close(logits, z, rtol=1e-4, atol=1e-4)


def test_greedy_is_token_identical_to_target_greedy(target):
    d = tiny_longspark(target)
    d.sharp = SharpConfig(mode="fixed_slope", slope=0.3, n_ref=8)
    prompt = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    assert (speculative_generate(target, d, prompt, 30).tokens
            == autoregressive_generate(target, prompt, 30).tokens)


def test_sampling_matches_target_distribution():
    """Marginal of the 2nd new token vs the exact target law (vocab 8: df 7, P(chi2 > 26) ~
    5e-4); the drafts come from the corrected, non-trivial drafter distributions."""
    small = tiny_target(seed=5, vocab=8)
    d = tiny_longspark(small, drafts=2)
    prompt = torch.tensor([[1, 5, 2, 7]])
    p1, _, p2_given_1 = exact_first_two(small, prompt)
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(8)
    for _ in range(500):
        counts[speculative_generate(small, d, prompt, 3, temperature=1.0,
                                    generator=g).tokens[1]] += 1
    assert chi_square(counts, p1 @ p2_given_1) < 26.0


def test_state_does_not_grow_with_the_context(target):
    """Drafter state bytes after a 1k-token and a 7k-token prefill: equal for LongSpark (the
    window is the target's cache, the summary has a fixed size); DFlash's context cache grows
    with the context (7x the keys, more than 6x the bytes)."""
    from sharpdraft_helpers import tiny_drafter
    sizes = {"longspark": [], "dflash": []}
    for n in (1024, 7168):
        prompt = torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(n))
        for name, d in (("longspark", tiny_longspark(target, window=64)),
                        ("dflash", tiny_drafter(target))):
            rt = TargetRuntime.prepare(target, hidden_layers=d.hidden_layers, pack=False)
            rt.start(n + 8)
            out = rt.forward(prompt, last_only=True)
            s = d.start(target, prompt, out.hidden, rt.cache)
            s.propose(int(out.logits[-1].argmax()), n, lambda row: int(row.argmax()))
            sizes[name].append(s.state_bytes())
    assert sizes["longspark"][0] == sizes["longspark"][1] > 0
    assert sizes["dflash"][1] > 6 * sizes["dflash"][0] > 0


def test_sharp_variants_differ_only_in_scope(target):
    d = tiny_longspark(target)
    v = d.sharp_variants()
    assert set(v) == {"summary", "slots"} and v["summary"] is d
    assert v["slots"].config.sharp_scope == "slots" and d.config.sharp_scope == "summary"
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(),
                                                 v["slots"].state_dict().values()))


def test_bad_config_and_target_are_named(target):
    with pytest.raises(ValueError, match="sharp_scope"):
        tiny_longspark(target, sharp_scope="everywhere")
    with pytest.raises(ValueError, match="window"):
        tiny_longspark(target, window=0)
    d = tiny_longspark(target)
    other = tiny_target(num_key_value_heads=4)
    assert any("num_key_value_heads" in p for p in d.target_problems(other))
    d.config.target_layer_ids = [1, 3]                 # layer 4 does not exist
    assert any("KV cache of layers" in p for p in d.target_problems(target))
    with pytest.raises(ValueError, match="target_cache"):
        tiny_longspark(target).start(target, None, {2: torch.zeros(1, 3, 64)})


def test_sweep_runs_every_scaling_in_both_scopes(target, tmp_path):
    from sharpdraft.eval import sweep
    from sharpdraft.training import cache as tc

    d = tiny_longspark(target)
    ids = torch.randint(3, 250, (1, 120), generator=torch.Generator().manual_seed(5))
    f, p, i = tc.compute_features(target, ids, d.config.target_layer_ids, 4)
    seq = {"ids": ids[0].int(), "feats": f[0], "top_p": p[0], "top_i": i[0],
           "trained": torch.ones(120, dtype=torch.bool)}

    class Features:
        lengths = torch.tensor([120])

        def __len__(self):
            return 1

        def __getitem__(self, s):
            return seq
    rep = sweep.run(target, d, Features(), d.config.target_layer_ids, drafter_name="longspark",
                    edges=[16, 64, 110], per_bucket=6, out=tmp_path, only=["slope 0.2"])
    names = {r["scaling"] for r in rep["rows"]}
    assert names == {"frozen", "summary: slope 0.2", "slots: slope 0.2"}
    assert d.sharp.mode == "none"            # left frozen
