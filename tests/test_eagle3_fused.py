"""EAGLE-3's fused CPU step (`drafters.eagle3_fused`, the `eagle3_layer` op): it gives the bits
of the drafter's own modules run on the same Q8_0 blocks (context rows, chain drafts, tree rows
under a mask; every attention scaling), stays close to the float32 modules, is used only where
it applies (the modules run under autograd, an `observe` callback or a DynamicCache; a context
window with sinks is kept as the modules keep it), is rebuilt when the weights change, and
decoding through it stays lossless."""
import pytest
import torch

from sharpdraft import attention
from sharpdraft.attention import SharpConfig
from sharpdraft.drafters import eagle3_fused
from sharpdraft.drafters.eagle3_fused import FusedEagle3Step
from sharpdraft.target.kv_cache import PreallocatedCache
from sharpdraft_ext import cpu_runtime
from sharpdraft_helpers import assert_greedy_lossless, q8_modules, tiny_eagle3, tiny_target

SCALINGS = {
    "none": SharpConfig(mode="none"),
    "fixed_slope": SharpConfig(mode="fixed_slope", slope=0.3, n_ref=6),
    "per_head_slopes": SharpConfig(mode="fixed_slope", n_ref=6,
                                   layer_slopes=[[0.1, 0.4, -0.2, 0.3]]),
    "exact_topk": SharpConfig(mode="exact_topk", n_ref=12, topk=4, contrast=3.0),
}


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def drafter_for(target, feed_normed: bool = False, seed: int = 2):
    d = tiny_eagle3(target, draft_vocab_size=64, feed_normed_output=feed_normed, seed=seed)
    g = torch.Generator().manual_seed(seed)
    d.set_draft_vocab(torch.randperm(256, generator=g)[:64])
    with torch.no_grad():      # norms away from 1, so that a swapped norm would show
        for norm in (d.input_layernorm, d.hidden_norm, d.post_attention_layernorm, d.norm):
            norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
    return d


def rows(n, seed, h=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, h, generator=g), torch.randn(1, n, h, generator=g)


@pytest.mark.parametrize("feed_normed", [False, True])
@pytest.mark.parametrize("scaling", list(SCALINGS))
@torch.no_grad()
def test_fused_step_is_the_modules_on_the_same_blocks(target, scaling, feed_normed):
    drafter = drafter_for(target, feed_normed)
    drafter.sharp = SCALINGS[scaling]
    ref, ref_head = q8_modules(drafter, target)
    fused = FusedEagle3Step(drafter, target)
    a, b = PreallocatedCache(1, 40), PreallocatedCache(1, 40)
    emb, hid = rows(9, 0)
    pos = torch.arange(9)[None]
    ref.write_keys(emb, hid, pos, a)
    ref.write_keys(emb, hid, pos, b)
    tree = torch.rand(1, 1, 4, 9 + 3 + 1 + 4, generator=torch.Generator().manual_seed(5)) < 0.6
    tree[..., :9] = True
    calls = [(3, torch.arange(9, 12)[None], None),            # pending context rows: causal
             (1, torch.tensor([[12]]), None),                   # a chain draft
             (4, torch.full((1, 4), 13), tree)]                 # tree rows under a mask
    for seed, (n, p, mask) in enumerate(calls, 1):
        emb, hid = rows(n, seed)
        normed, want_hidden = ref.step(emb, hid, p, a, mask)
        want = ref_head(normed[0])
        logits, got_hidden = fused(drafter, emb, hid, p, b, mask)
        assert torch.equal(logits[0], want), (scaling, n, (logits[0] - want).abs().max())
        assert torch.equal(got_hidden, want_hidden)
        assert b.get_seq_length() == a.get_seq_length()
        length = a.get_seq_length()
        assert torch.equal(b.layers[0].keys, a.layers[0].keys[:, :, :length])
        assert torch.equal(b.layers[0].values, a.layers[0].values[:, :, :length])
    # and the blocks hold the drafter's weights: close to its float32 modules
    fresh = PreallocatedCache(1, 8)
    emb, hid = rows(5, 9)
    normed, _ = drafter.step(emb, hid, torch.arange(5)[None], PreallocatedCache(1, 8))
    want = drafter.head(target, normed[0])
    logits, _ = fused(drafter, emb, hid, torch.arange(5)[None], fresh)
    err = (logits[0] - want).abs().max() / want.abs().max()
    assert 0 < err < 0.03, err


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("scaling", ["none", "fixed_slope"])
@torch.no_grad()
def test_fused_step_keeps_the_window_and_sinks_of_the_modules(target, scaling, sinks):
    """A sliding window of 5 keys (and 2 sink keys): context rows under `window_mask`, a chain
    draft and tree rows under a mask see the keys the modules' `last_keys` keeps, so the bits
    agree (SharpDraft's cardinality counts the kept keys only); a window wider than the context
    changes nothing."""
    from sharpdraft.drafters.layers import window_mask
    drafter = drafter_for(target)
    drafter.sharp = SCALINGS[scaling]
    fused = FusedEagle3Step(drafter, target)
    plain, _ = q8_modules(drafter, target)                    # no window
    for window in (5, 64):
        drafter.context_window, drafter.attention_sinks = window, sinks
        ref, ref_head = q8_modules(drafter, target)
        a, b, c = (PreallocatedCache(1, 40) for _ in range(3))
        emb, hid = rows(9, 0)
        for cache in (a, b, c):
            ref.write_keys(emb, hid, torch.arange(9)[None], cache)
        tree = torch.rand(1, 1, 4, 17, generator=torch.Generator().manual_seed(5)) < 0.6
        tree[..., :12] = True
        calls = [(3, torch.arange(9, 12)[None], window_mask(torch.arange(9, 12), 12, window,
                                                              sinks)),
                 (1, torch.tensor([[12]]), None),
                 (4, torch.full((1, 4), 13), tree)]
        cut = []
        for seed, (n, p, mask) in enumerate(calls, 1):
            emb, hid = rows(n, seed)
            normed, want_hidden = ref.step(emb, hid, p, a, mask)
            logits, got_hidden = fused(drafter, emb, hid, p, b, mask)
            want = ref_head(normed[0])
            assert torch.equal(logits[0], want), (window, n, (logits[0] - want).abs().max())
            assert torch.equal(got_hidden, want_hidden)
            whole = mask if mask is None or mask.shape[-1] == 17 else torch.tril(
                torch.ones(n, 12, dtype=torch.bool), 9)[None, None]
            cut.append(not torch.equal(plain.step(emb, hid, p, c, whole)[0], normed))
        assert cut == ([True] * 3 if window == 5 else [False] * 3)


@torch.no_grad()
def test_draft_step_runs_the_modules_where_the_fused_step_does_not_apply(target):
    drafter = drafter_for(target)
    assert drafter.fused_step is None
    drafter.prepare_for_target(target, quantised=True)
    assert isinstance(drafter.__dict__["_fused_step"], FusedEagle3Step)
    assert drafter.fused_step == "eagle3_layer"
    seen = []
    emb, hid = rows(1, 3)
    pos = torch.tensor([[0]])

    calls = []
    real = FusedEagle3Step.__call__

    def counting(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    FusedEagle3Step.__call__ = counting
    try:
        drafter.draft_step(target, emb, hid, pos, PreallocatedCache(1, 4))
        assert calls == [1]                                   # fused
        with attention.observe(lambda *a: seen.append(1)):   # an analysis watching attention
            drafter.draft_step(target, emb, hid, pos, PreallocatedCache(1, 4))
        assert calls == [1] and seen == [1]
        from transformers import DynamicCache
        drafter.draft_step(target, emb, hid, pos, DynamicCache())
        with torch.enable_grad():
            drafter.draft_step(target, emb, hid, pos, PreallocatedCache(1, 4))
        assert calls == [1]
        drafter.context_window, drafter.attention_sinks = 4, 1     # the op keeps a window
        drafter.draft_step(target, emb, hid, pos, PreallocatedCache(1, 4))
        assert calls == [1, 1]
        drafter.context_window, drafter.attention_sinks = None, 0
        drafter.prepare_for_target(target, quantised=False)    # a float target: modules
        drafter.draft_step(target, emb, hid, pos, PreallocatedCache(1, 4))
        assert calls == [1, 1] and drafter.__dict__["_fused_step"] is None
    finally:
        FusedEagle3Step.__call__ = real


@torch.no_grad()
def test_changed_weights_rebuild_the_blocks(target, monkeypatch):
    drafter = drafter_for(target)
    drafter.prepare_for_target(target, quantised=True)
    old = drafter.__dict__["_fused_step"]
    assert old.fresh(drafter, target)
    drafter.mlp.down_proj.weight.mul_(2.0)
    assert not old.fresh(drafter, target)
    drafter.prepare_for_target(target, quantised=True)
    new = drafter.__dict__["_fused_step"]
    assert new is not old and new.fresh(drafter, target)
    assert not torch.equal(new.down, old.down)
    drafter.prepare_for_target(target, quantised=True)       # unchanged: kept
    assert drafter.__dict__["_fused_step"] is new
    monkeypatch.setenv("SHARPDRAFT_FUSED_DRAFTERS", "0")     # off, weights unchanged
    assert eagle3_fused.problems(drafter, target) == ["SHARPDRAFT_FUSED_DRAFTERS=0"]
    drafter.prepare_for_target(target, quantised=True)
    assert drafter.__dict__["_fused_step"] is None


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("tree", [False, True])
def test_decoding_through_the_fused_step_is_lossless(target, tree, window, monkeypatch):
    """Greedy chain and tree decoding with the fused step (the engine prepares it for a
    quantised target; here forced on the tiny float target), with or without a context
    window and sinks, equal target-only decoding."""
    drafter = drafter_for(target)
    drafter.sharp = SCALINGS["fixed_slope"]
    drafter.context_window, drafter.attention_sinks = window, 0 if window is None else 2
    monkeypatch.setattr("sharpdraft.inference.engine.is_quantised", lambda model: True)
    calls = []
    real = FusedEagle3Step.__call__
    monkeypatch.setattr(FusedEagle3Step, "__call__",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    assert_greedy_lossless(target, drafter, tree)
    assert calls                                          # drafting went through the op


def test_bad_arguments_are_named(target):
    drafter = drafter_for(target)
    f = FusedEagle3Step(drafter, target)
    cache = PreallocatedCache(1, 4)
    emb, hid = rows(1, 0)
    f(drafter, emb, hid, torch.tensor([[0]]), cache)
    layer = cache.layers[0]
    cos = sin = torch.zeros(1, 16)
    args = [emb[0], hid[0], cos, sin, layer.key_buffer, layer.value_buffer, 1, None, *f.norms,
            f.qkv, f.o_proj, f.gate_up, f.down, f.head.packed, [2] * 5, f.head.size, *f.geometry]
    bad = dict(enumerate(args))
    bad[12] = f.o_proj                                    # qkv slot given o_proj's blocks
    with pytest.raises(ValueError, match="qkv"):
        cpu_runtime.eagle3_layer(*bad.values())
    with pytest.raises(ValueError, match="key_cache / value_cache"):
        cpu_runtime.eagle3_layer(*args[:6], 4, *args[7:])  # rows past the capacity
    with pytest.raises(ValueError, match="hidden"):
        cpu_runtime.eagle3_layer(args[0], hid[0, :, :32], *args[2:])
    with pytest.raises(ValueError, match="window"):
        cpu_runtime.eagle3_layer(*args, window=0)
    with pytest.raises(ValueError, match="sinks"):
        cpu_runtime.eagle3_layer(*args, window=4, sinks=-1)
