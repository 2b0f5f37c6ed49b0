"""DFlash's fused CPU step (`drafters.dflash_fused`, the `dflash_layers` op): it gives the bits of
the drafter's own modules run on the same Q8_0 blocks (a block over cached context alone, a
block after new context rows; with and without q/k norms; every attention scaling, a slope per
layer), stays close to the float32 modules, is used only where it applies, is rebuilt when the
weights change, and decoding through it stays lossless."""
import pytest
import torch
from transformers import DynamicCache

from sharpdraft import attention
from sharpdraft.attention import SharpConfig
from sharpdraft.drafters import dflash_fused
from sharpdraft.drafters.dflash_fused import FusedDFlashStep
from sharpdraft.inference.engine import autoregressive_generate, speculative_generate
from sharpdraft.target.kv_cache import PreallocatedCache
from sharpdraft_ext import cpu_runtime
from sharpdraft_helpers import q8_modules, tiny_drafter, tiny_target

SCALINGS = {
    "none": SharpConfig(mode="none"),
    "fixed_slope": SharpConfig(mode="fixed_slope", slope=0.3, n_ref=6),
    "layer_slopes": SharpConfig(mode="fixed_slope", n_ref=6,
                                layer_slopes=[[0.1, 0.4, -0.2, 0.3], 0.25]),
    "exact_topk": SharpConfig(mode="exact_topk", n_ref=8, topk=4, contrast=3.0),
}


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def drafter_for(target, qk_norm: bool = False, seed: int = 1, **kw):
    d = tiny_drafter(target, seed=seed, qk_norm=qk_norm, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():      # norms away from 1, so that a swapped norm would show
        for name, p in d.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return d


def rows(n, seed, width):
    return torch.randn(1, n, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
@torch.no_grad()
def test_fused_step_is_the_modules_on_the_same_blocks(target, scaling, qk_norm):
    drafter = drafter_for(target, qk_norm)
    drafter.sharp = SCALINGS[scaling]
    ref, ref_head = q8_modules(drafter, target)
    fused = FusedDFlashStep(drafter, target)
    F = drafter.fc.in_features
    a, b = PreallocatedCache(2, 32), PreallocatedCache(2, 32)
    for cache in (a, b):                           # the prompt's context, by the modules
        ref.write_context(rows(5, 0, F), torch.arange(5)[None], cache)
    steps = [(5, 0), (8, 3)]                       # (block position, new context rows)
    for seed, (p, tn) in enumerate(steps, 1):
        block = rows(4, seed, 64)
        ctx, ctx_pos = rows(tn, 10 + seed, F), torch.arange(p - tn, p)[None]
        pos = torch.arange(p, p + 4)[None]
        want = ref_head(ref(block, pos, ctx, ctx_pos, cache=a)[0, 1:])
        got = fused(drafter, block, pos, ctx, ctx_pos, b)
        assert got.shape == (3, 256)
        assert torch.equal(got, want), (scaling, p, (got - want).abs().max())
        assert b.get_seq_length() == a.get_seq_length() == p
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(lb.keys, la.keys) and torch.equal(lb.values, la.values)
    # and the blocks hold the drafter's weights: close to its float32 modules
    cache = PreallocatedCache(2, 16)
    block, ctx, pos = rows(4, 7, 64), rows(3, 8, F), torch.arange(3, 7)[None]
    want = drafter.head(target, drafter(block, pos, ctx, torch.arange(3)[None], cache=cache)[0, 1:])
    got = fused(drafter, block, pos, ctx, torch.arange(3)[None], PreallocatedCache(2, 16))
    err = (got - want).abs().max() / want.abs().max()
    assert 0 < err < 0.03, err


@torch.no_grad()
def test_draft_logits_run_the_modules_where_the_fused_step_does_not_apply(target, monkeypatch):
    drafter = drafter_for(target, qk_norm=True)
    assert drafter.fused_step is None
    drafter.prepare_for_target(target, quantised=True)
    assert drafter.fused_step == "dflash_layers"
    count, seen = [], []
    real = FusedDFlashStep.__call__
    monkeypatch.setattr(FusedDFlashStep, "__call__",
                        lambda self, *a, **k: count.append(1) or real(self, *a, **k))
    ctx = rows(3, 2, drafter.fc.in_features)
    fused = drafter.draft_logits(target, 7, 3, ctx, PreallocatedCache(2, 16))
    assert count == [1]
    with attention.observe(lambda *a: seen.append(1)):       # an analysis watching attention
        drafter.draft_logits(target, 7, 3, ctx, PreallocatedCache(2, 16))
    assert seen == [1, 1]
    modules = drafter.draft_logits(target, 7, 3, ctx, DynamicCache())
    assert (modules - fused).abs().max() < 0.03 * modules.abs().max()
    drafter.context_window = 2
    drafter.draft_logits(target, 7, 3, ctx, PreallocatedCache(2, 16))
    drafter.context_window = None
    assert count == [1]
    drafter.prepare_for_target(target, quantised=False)       # a float target: modules
    assert drafter.fused_step is None


@torch.no_grad()
def test_changed_weights_rebuild_the_blocks(target, monkeypatch):
    drafter = drafter_for(target)
    drafter.prepare_for_target(target, quantised=True)
    old = drafter.__dict__["_fused_step"]
    drafter.fc.weight.mul_(2.0)
    assert not old.fresh(drafter, target)
    hidden = target(torch.tensor([[5, 6, 7]]), output_hidden_states=True).hidden_states
    drafter.start(target, torch.tensor([[5, 6, 7]]), hidden, PreallocatedCache(4, 16))
    new = drafter.__dict__["_fused_step"]                    # start rebuilt it
    assert new is not old and new.fresh(drafter, target)
    assert not torch.equal(new.fc, old.fc)
    monkeypatch.setenv("SHARPDRAFT_FUSED_DRAFTERS", "0")
    assert dflash_fused.problems(drafter, target) == ["SHARPDRAFT_FUSED_DRAFTERS=0"]
    drafter.prepare_for_target(target, quantised=True)
    assert drafter.fused_step is None


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_decoding_through_the_fused_step_is_lossless(target, qk_norm, monkeypatch):
    """Greedy decoding with the fused step (the engine prepares it for a quantised target;
    here forced on the tiny float target) equals target-only decoding."""
    drafter = drafter_for(target, qk_norm)
    drafter.sharp = SCALINGS["layer_slopes"]
    monkeypatch.setattr("sharpdraft.inference.engine.is_quantised", lambda model: True)
    count = []
    real = FusedDFlashStep.__call__
    monkeypatch.setattr(FusedDFlashStep, "__call__",
                        lambda self, *a, **k: count.append(1) or real(self, *a, **k))
    for seed in range(2):
        prompt = torch.randint(3, 256, (1, 7 + 6 * seed),
                               generator=torch.Generator().manual_seed(seed))
        want = autoregressive_generate(target, prompt, 24).tokens
        assert speculative_generate(target, drafter, prompt, 24).tokens == want
    assert count and drafter.fused_step == "dflash_layers"


def test_bad_arguments_are_named(target):
    drafter = drafter_for(target, qk_norm=True)
    f = FusedDFlashStep(drafter, target)
    cache = PreallocatedCache(2, 12)
    F = drafter.fc.in_features
    f(drafter, rows(4, 0, 64), torch.arange(2, 6)[None], rows(2, 1, F), torch.arange(2)[None],
      cache)
    keys = [layer.key_buffer for layer in cache.layers]
    values = [layer.value_buffer for layer in cache.layers]
    cos = sin = torch.zeros(4, 16)
    args = [rows(4, 0, 64)[0], cos, sin, rows(1, 1, F)[0], cos[:1], sin[:1], f.fc, 2,
            f.hidden_norm, keys, values, 2, *f.stack.values(), f.qtypes, *f.qk_norms,
            *f.geometry, f.final_norm, f.head.packed, f.head.qtype, f.head.size, 1, "none",
            [0.0, 0.0], [None, None]]
    cpu_runtime.dflash_layers(*args)
    with pytest.raises(ValueError, match="head_from"):
        cpu_runtime.dflash_layers(*args[:31], 5, *args[32:])
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        cpu_runtime.dflash_layers(*args[:20], [], *args[21:])
    with pytest.raises(ValueError, match="kv"):
        cpu_runtime.dflash_layers(*args[:15], f.stack["qkv"], *args[16:])
    with pytest.raises(ValueError, match="fc"):
        cpu_runtime.dflash_layers(*args[:6], f.stack["qkv"][0], *args[7:])
    with pytest.raises(ValueError, match="key_cache / value_cache"):
        cpu_runtime.dflash_layers(*args[:11], 8, *args[12:])    # rows past the capacity
