"""PARD's fused CPU step (`drafters.pard_fused`, the `pard_layers` op): it gives the bits of the
drafter's own modules run on the same Q8_0 blocks (context rows, a draft of real and mask rows,
rows under a mask; every attention scaling, a slope per layer), stays close to the float32
modules, borrows a quantised target's LM head as it is, is used only where it applies, is
rebuilt when the weights change, covers the public AMD layout where its layers are Llama's, and
decoding through it stays lossless."""
import pytest
import torch
from transformers import DynamicCache

from sharpdraft import attention
from sharpdraft.attention import SharpConfig
from sharpdraft.drafters import pard_fused
from sharpdraft.drafters.amd_pard import AMDPARDDrafter
from sharpdraft.drafters.formats.amd_pard import AMDPARDConfig
from sharpdraft.drafters.pard_fused import FusedPARDStep
from sharpdraft.inference.engine import autoregressive_generate, speculative_generate
from sharpdraft.target.kv_cache import PreallocatedCache
from sharpdraft.target.linears import QUANT_PATH, pack_weight
from sharpdraft.target.quantized import QuantLinear
from sharpdraft_ext import cpu_runtime
from sharpdraft_helpers import q8_modules, tiny_pard, tiny_qwen2, tiny_qwen3, tiny_target

SCALINGS = {
    "none": SharpConfig(mode="none"),
    "fixed_slope": SharpConfig(mode="fixed_slope", slope=0.3, n_ref=6),
    "layer_slopes": SharpConfig(mode="fixed_slope", n_ref=6,
                                layer_slopes=[0.25, [0.1, 0.4, -0.2, 0.3]]),
    "exact_topk": SharpConfig(mode="exact_topk", n_ref=12, topk=4, contrast=3.0),
}


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def drafter_for(target, seed: int = 3, **kw):
    d = tiny_pard(target, seed=seed, num_draft_tokens=4, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():      # norms away from 1, so that a swapped norm would show
        for layer in d.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
        d.norm.weight.copy_(0.5 + torch.rand(d.norm.weight.shape, generator=g))
    return d


def embeds(n, seed, h=64):
    return torch.randn(1, n, h, generator=torch.Generator().manual_seed(seed))


def calls():
    """(rows, positions, attn_mask, head_from) of a session's calls: the prompt's context rows
    (no logits), a draft of 2 real and 3 mask rows, rows under a mask."""
    mask = torch.rand(1, 1, 4, 9 + 4, generator=torch.Generator().manual_seed(5)) < 0.6
    mask[..., :6] = True
    return [(6, torch.arange(6)[None], None, 6),
            (5, torch.arange(6, 11)[None], None, 1),
            (4, torch.arange(9, 13)[None], mask, 0)]


def run_calls(fn, caches):
    out = []
    for seed, (n, pos, mask, head_from) in enumerate(calls(), 1):
        out.append(fn(embeds(n, seed), pos, caches, mask, head_from))
        if seed == 2:
            for c in caches:
                c.crop(-2)             # the mask rows' keys dropped, as a session does
    return out


@pytest.mark.parametrize("scaling", list(SCALINGS))
@torch.no_grad()
def test_fused_step_is_the_modules_on_the_same_blocks(target, scaling):
    drafter = drafter_for(target)
    drafter.sharp = SCALINGS[scaling]
    ref, ref_head = q8_modules(drafter, target)
    fused = FusedPARDStep(drafter, target)
    a, b = PreallocatedCache(2, 40), PreallocatedCache(2, 40)

    def modules(emb, pos, caches, mask, head_from):
        h = ref(emb, pos, attn_mask=mask, cache=caches[0])
        return ref_head(h[0, head_from:])

    want = run_calls(modules, [a])
    got = run_calls(lambda emb, pos, caches, mask, hf: fused(drafter, emb, pos, caches[0], mask, hf),
                    [b])
    for (n, _, _, head_from), w, g in zip(calls(), want, got):
        assert g.shape == (n - head_from, 256)
        assert torch.equal(g, w), (scaling, n, (g - w).abs().max())
    assert b.get_seq_length() == a.get_seq_length() == 13
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(lb.keys, la.keys) and torch.equal(lb.values, la.values)
    # and the blocks hold the drafter's weights: close to its float32 modules
    h = drafter(embeds(5, 9), torch.arange(5)[None], cache=PreallocatedCache(2, 8))
    want = drafter.head(target, h[0])
    got = fused(drafter, embeds(5, 9), torch.arange(5)[None], PreallocatedCache(2, 8))
    err = (got - want).abs().max() / want.abs().max()
    assert 0 < err < 0.03, err


@torch.no_grad()
def test_a_quantised_target_head_is_borrowed_as_it_is(target):
    """The target's own QuantLinear LM head drafts as it is (its packed blocks, no copy), so the
    fused step equals the modules with that same head."""
    import copy

    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    quantised = copy.deepcopy(target)
    w = quantised.lm_head.weight.detach()
    blocks = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q4_0).copy())
    quantised.lm_head = QuantLinear(quantised.lm_head, blocks, "q4_0")
    drafter = drafter_for(target)
    fused = FusedPARDStep(drafter, quantised)
    assert fused.head.packed is quantised.lm_head.packed and fused.head.qtype == 0
    ref, _ = q8_modules(drafter, target)
    a, b = PreallocatedCache(2, 16), PreallocatedCache(2, 16)
    h = ref(embeds(5, 1), torch.arange(5)[None], cache=a)
    want = ref.head(quantised, h[0, 1:])
    got = fused(drafter, embeds(5, 1), torch.arange(5)[None], b, None, 1)
    assert torch.equal(got, want)
    # a draft vocabulary: its rows re-quantised to Q8_0
    small = drafter_for(target, draft_vocab_size=64)
    small.set_draft_vocab(torch.randperm(256, generator=torch.Generator().manual_seed(1))[:64])
    f = FusedPARDStep(small, quantised)
    assert f.head.qtype == 2 and f.head.size == 64
    assert torch.equal(f.head.packed, pack_weight(quantised.lm_head.weight[small.d2t], QUANT_PATH))


@torch.no_grad()
def test_draft_logits_run_the_modules_where_the_fused_step_does_not_apply(target, monkeypatch):
    drafter = drafter_for(target)
    assert drafter.fused_step is None
    drafter.prepare_for_target(target, quantised=True)
    assert drafter.fused_step == "pard_layers"
    count = []
    real = FusedPARDStep.__call__
    monkeypatch.setattr(FusedPARDStep, "__call__",
                        lambda self, *a, **k: count.append(1) or real(self, *a, **k))
    seen = []
    emb, pos = embeds(3, 3), torch.arange(3)[None]
    fused = drafter.draft_logits(target, emb, pos, PreallocatedCache(2, 8), head_from=1)
    assert count == [1]
    with attention.observe(lambda *a: seen.append(1)):       # an analysis watching attention
        drafter.draft_logits(target, emb, pos, PreallocatedCache(2, 8))
    assert seen == [1, 1]                                     # both layers seen
    modules = drafter.draft_logits(target, emb, pos, DynamicCache(), head_from=1)
    assert (modules - fused).abs().max() < 0.03 * modules.abs().max()
    drafter.context_window = 2
    drafter.draft_logits(target, emb, pos, PreallocatedCache(2, 8))
    drafter.context_window = None
    with torch.enable_grad():
        drafter.draft_logits(target, emb, pos, PreallocatedCache(2, 8))
    assert count == [1]
    assert drafter.draft_logits(target, emb, pos, DynamicCache(), head_from=3).numel() == 0
    drafter.prepare_for_target(target, quantised=False)       # a float target: modules
    assert drafter.fused_step is None


@torch.no_grad()
def test_changed_weights_rebuild_the_blocks(target, monkeypatch):
    drafter = drafter_for(target)
    drafter.prepare_for_target(target, quantised=True)
    old = drafter.__dict__["_fused_step"]
    drafter.layers[1].mlp.down_proj.weight.mul_(2.0)
    assert not old.fresh(drafter, target)
    drafter.start(target, torch.tensor([[5, 6, 7]]), target_cache=PreallocatedCache(4, 16))
    new = drafter.__dict__["_fused_step"]                    # start rebuilt it
    assert new is not old and new.fresh(drafter, target)
    assert not torch.equal(new.stack["down"][1], old.stack["down"][1])
    assert torch.equal(new.stack["down"][0], old.stack["down"][0])
    drafter.prepare_for_target(target, quantised=True)       # unchanged: kept
    assert drafter.__dict__["_fused_step"] is new
    monkeypatch.setenv("SHARPDRAFT_FUSED_DRAFTERS", "0")
    assert pard_fused.problems(drafter, target) == ["SHARPDRAFT_FUSED_DRAFTERS=0"]
    drafter.prepare_for_target(target, quantised=True)
    assert drafter.fused_step is None


@pytest.mark.parametrize("public", [False, True], ids=["pard", "amd-pard"])
def test_decoding_through_the_fused_step_is_lossless(target, public, monkeypatch):
    """Greedy decoding with the fused step (the engine prepares it for a quantised target;
    here forced on the tiny float target) equals target-only decoding, for the project's PARD
    drafter and for the public layout converted from it."""
    drafter = drafter_for(target)
    drafter.sharp = SCALINGS["layer_slopes"]
    if public:
        drafter = AMDPARDDrafter.from_drafter(drafter, target, 2)
    monkeypatch.setattr("sharpdraft.inference.engine.is_quantised", lambda model: True)
    count = []
    real = FusedPARDStep.__call__
    monkeypatch.setattr(FusedPARDStep, "__call__",
                        lambda self, *a, **k: count.append(1) or real(self, *a, **k))
    for seed in range(2):
        prompt = torch.randint(3, 256, (1, 7 + 6 * seed),
                               generator=torch.Generator().manual_seed(seed))
        want = autoregressive_generate(target, prompt, 24).tokens
        assert speculative_generate(target, drafter, prompt, 24).tokens == want
    assert count and drafter.fused_step == "pard_layers"


@torch.no_grad()
def test_the_public_layout_drafts_the_same_bits_fused():
    """AMD's layout with Llama layers (converted from ours) drafts through the op with the bits
    of its own modules on the same blocks; Qwen3 (q/k norms) and Qwen2 (biases) layers are
    named and keep their modules."""
    target = tiny_target()
    drafter = AMDPARDDrafter.from_drafter(drafter_for(target), target, 2)
    assert pard_fused.problems(drafter, target) == []
    ref, ref_head = q8_modules(drafter, target)
    fused = FusedPARDStep(drafter, target)
    a, b = PreallocatedCache(2, 16), PreallocatedCache(2, 16)
    emb = drafter.embed(target, torch.tensor([[5, 9, 11, 2, 2]]), torch.zeros(1, 5, dtype=torch.bool))
    want = ref_head(ref(emb, torch.arange(5)[None], cache=a)[0, 2:])
    assert torch.equal(fused(drafter, emb, torch.arange(5)[None], b, None, 2), want)
    for family, reason in ((tiny_qwen3, "q/k norms"), (tiny_qwen2, "a bias")):
        other = family()
        cfg = AMDPARDConfig(public=other.config.to_dict(), pard_token=2)
        d = AMDPARDDrafter(cfg)
        found = pard_fused.problems(d, other)
        assert any(reason in line for line in found), found
        d.prepare_for_target(other, quantised=True)
        assert d.fused_step is None


def test_bad_arguments_are_named(target):
    drafter = drafter_for(target)
    f = FusedPARDStep(drafter, target)
    cache = PreallocatedCache(2, 8)
    f(drafter, embeds(1, 0), torch.tensor([[0]]), cache)
    keys = [layer.key_buffer for layer in cache.layers]
    values = [layer.value_buffer for layer in cache.layers]
    cos = sin = torch.zeros(2, 16)
    args = [embeds(2, 0)[0], cos, sin, keys, values, 1, None, *f.stack.values(), f.qtypes,
            *f.geometry, f.final_norm, f.head.packed, f.head.qtype, f.head.size, 0, "none",
            [0.0, 0.0], [None, None]]
    cpu_runtime.pard_layers(*args)
    with pytest.raises(ValueError, match="head_from"):
        cpu_runtime.pard_layers(*args[:23], 3, *args[24:])
    with pytest.raises(ValueError, match="slope"):
        cpu_runtime.pard_layers(*args[:-2], [0.0], [None])
    with pytest.raises(ValueError, match="qkv"):
        cpu_runtime.pard_layers(*args[:9], f.stack["o_proj"], *args[10:])
    with pytest.raises(ValueError, match="key_cache / value_cache"):
        cpu_runtime.pard_layers(*args[:5], 7, *args[6:])       # rows past the capacity
    with pytest.raises(ValueError, match="head"):
        cpu_runtime.pard_layers(*args[:20], f.stack["o_proj"][0], *args[21:])
