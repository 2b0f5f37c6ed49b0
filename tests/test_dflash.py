"""DFlash drafter: layer choice, cache vs training path, masking, checkpoints, sharp scaling."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from sharpdraft.attention import SharpConfig
from sharpdraft.drafters.common import evenly_spaced_layers
from sharpdraft.drafters.dflash import DFlashDrafter
from sharpdraft_helpers import tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def models():
    target = tiny_target()
    with torch.no_grad():
        ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(0))
        feats = tiny_drafter(target).context_features(
            target(ids, output_hidden_states=True).hidden_states)
    return target, ids, feats


def test_evenly_spaced_layers():
    assert evenly_spaced_layers(30, 4) == [1, 10, 19, 28]
    assert evenly_spaced_layers(4, 2) == [1, 2]
    with pytest.raises(ValueError, match="num_features"):
        evenly_spaced_layers(30, 1)


def test_context_features_are_the_chosen_layers(models):
    target, ids, feats = models
    hs = target(ids, output_hidden_states=True).hidden_states
    assert feats.shape == (1, 30, 2 * 64)
    assert torch.equal(feats[..., :64], hs[2]) and torch.equal(feats[..., 64:], hs[3])


def test_cached_drafting_equals_training_forward(models):
    """Incremental drafting over a growing drafter cache == the uncached block forward."""
    target, ids, feats = models
    drafter = tiny_drafter(target, block_size=4)
    drafter.sharp = SharpConfig(mode="fixed_slope", slope=0.25, n_ref=8)  # beta > 1 here
    cache, pos, logits = DynamicCache(), 0, []
    for step in (10, 3, 1, 6):  # commit `step` new context positions, then draft after them
        new = feats[:, pos: pos + step]
        pos += step
        logits.append((pos, drafter.draft_logits(target, int(ids[0, pos]), pos, new, cache)))
    anchors = torch.tensor([p for p, _ in logits])
    block = torch.zeros(len(anchors), 4, dtype=torch.long)
    block[:, 0] = ids[0, anchors]
    with torch.no_grad():
        full = drafter.block_logits(target, feats[0], block, anchors)
    for k, (_, lg) in enumerate(logits):
        torch.testing.assert_close(lg, full[k, 1:], rtol=1e-4, atol=1e-4)


def test_context_written_at_start_drafts_as_the_first_step_over_it(models):
    """start() writes the prompt's context keys (absorb_prompt, write_context); the first draft
    step then drafts what a step that takes the whole context in gives, and the cache holds
    the same keys and values."""
    from sharpdraft.drafters.dflash import DFlashSession

    target, ids, feats = models
    drafter = tiny_drafter(target, block_size=4)
    drafter.sharp = SharpConfig(mode="fixed_slope", slope=0.25, n_ref=8)
    eager = DFlashSession(drafter, target, feats[:, :20], DynamicCache())
    eager.absorb_prompt()
    assert eager.cache.get_seq_length() == 20 and eager.new_context.shape[1] == 0
    lazy = DFlashSession(drafter, target, feats[:, :20], DynamicCache())
    a, la = eager.propose(int(ids[0, 20]), 20, lambda row: int(row.argmax()))
    b, lb = lazy.propose(int(ids[0, 20]), 20, lambda row: int(row.argmax()))
    assert a == b
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    for x, y in zip(eager.cache.layers, lazy.cache.layers):
        torch.testing.assert_close(x.keys, y.keys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.values, y.values, rtol=1e-6, atol=1e-6)


def test_block_sees_only_earlier_context(models):
    target, ids, feats = models
    drafter = tiny_drafter(target)
    anchors = torch.tensor([5, 17])
    block = torch.zeros(2, 4, dtype=torch.long)
    block[:, 0] = ids[0, anchors]
    with torch.no_grad():
        a = drafter.block_logits(target, feats[0], block, anchors)
        changed = feats[0].clone()
        changed[17:] += 3.0                       # only block 1 may not see these
        b = drafter.block_logits(target, changed, block, anchors)
        changed[10:] -= 1.0                       # block 1 sees positions 10..16
        c = drafter.block_logits(target, changed, block, anchors)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[0], c[0])
    assert (a[1] - c[1]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="anchors"):
        drafter.block_logits(target, feats[0], block, torch.tensor([0, 3]))


def test_training_forward_has_gradients_and_matches_kernel(models):
    target, ids, feats = models
    drafter = tiny_drafter(target)
    anchors = torch.tensor([4, 12, 25])
    block = torch.zeros(3, 4, dtype=torch.long)
    block[:, 0] = ids[0, anchors]
    logits = drafter.block_logits(target, feats[0], block, anchors)   # grad: reference path
    loss = torch.nn.functional.cross_entropy(logits[:, 1:].reshape(-1, 256),
                                             ids[0, anchors[:, None] + torch.arange(1, 4)].reshape(-1))
    loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in drafter.layers.parameters())
    with torch.no_grad():                                             # fused kernel path
        torch.testing.assert_close(drafter.block_logits(target, feats[0], block, anchors),
                                   logits.detach(), rtol=1e-4, atol=1e-4)


def test_sharp_scaling_changes_only_long_rows(models):
    target, ids, feats = models
    drafter = tiny_drafter(target)
    anchors = torch.tensor([4, 26])          # n_i = 8 and 30
    block = torch.zeros(2, 4, dtype=torch.long)
    with torch.no_grad():
        frozen = drafter.block_logits(target, feats[0], block, anchors)
        drafter.sharp = SharpConfig(mode="fixed_slope", slope=0.3, n_ref=8)
        sharp = drafter.block_logits(target, feats[0], block, anchors)
    torch.testing.assert_close(frozen[0], sharp[0])  # n = n_ref: beta = 1
    assert (frozen[1] - sharp[1]).abs().max() > 1e-3


def test_save_load_roundtrip(models, tmp_path):
    target, ids, feats = models
    drafter = tiny_drafter(target, block_size=8, train_context=512)
    drafter.save(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["train_context"] == 512 and cfg["block_size"] == 8 and cfg["target_layer_ids"] == [1, 2]
    keys = load_file(str(tmp_path / "ckpt" / "model.safetensors")).keys()
    assert not any("embed" in k or "lm_head" in k for k in keys)  # target weights are borrowed
    loaded = DFlashDrafter.load(tmp_path / "ckpt")
    assert loaded.sharp.mode == "none" and loaded.sharp.n_ref == 512
    block = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        torch.testing.assert_close(loaded.block_logits(target, feats[0], block, torch.tensor([9])),
                                   drafter.block_logits(target, feats[0], block, torch.tensor([9])))
    with pytest.raises(FileNotFoundError, match="config.json"):
        DFlashDrafter.load(tmp_path / "nothing")


def test_draft_vocabulary_borrows_head_rows_and_masks_the_rest(models, tmp_path):
    """With a draft vocabulary, block logits are the full-vocabulary logits at the d2t columns,
    and inference logits put -inf (probability 0) on every token outside it."""
    target, ids, feats = models
    full = tiny_drafter(target)
    small = tiny_drafter(target, draft_vocab_size=40)
    small.load_state_dict(full.state_dict(), strict=False)     # same layers, plus d2t
    d2t = torch.randperm(256, generator=torch.Generator().manual_seed(4))[:40]
    small.set_draft_vocab(d2t)
    anchors = torch.tensor([6, 20])
    block = torch.zeros(2, 4, dtype=torch.long)
    block[:, 0] = ids[0, anchors]
    with torch.no_grad():
        ref = full.block_logits(target, feats[0], block, anchors)
        got = small.block_logits(target, feats[0], block, anchors)
        assert got.shape == (2, 4, 40)
        torch.testing.assert_close(got, ref[..., d2t])
        inf = small.draft_logits(target, int(ids[0, 6]), 6, feats[:, :6], DynamicCache())
    outside = torch.ones(256, dtype=torch.bool)
    outside[d2t] = False
    assert torch.isneginf(inf[:, outside]).all()
    torch.testing.assert_close(inf[:, d2t], ref[0, 1:, d2t], rtol=1e-4, atol=1e-4)
    small.save(tmp_path / "ckpt")                               # d2t travels with the weights
    assert torch.equal(DFlashDrafter.load(tmp_path / "ckpt").d2t, d2t)
    with pytest.raises(ValueError, match="distinct"):
        small.set_draft_vocab(torch.zeros(40, dtype=torch.long))
    with pytest.raises(ValueError, match="full target vocabulary"):
        full.set_draft_vocab(d2t)


def test_context_window_equals_a_truncated_context():
    """With context_window W the block sees the last W context positions only: the same logits
    as a drafter given just those W features at their own positions (RoPE is relative)."""
    from transformers import DynamicCache

    target = tiny_target(seed=4)
    drafter = tiny_drafter(target, block_size=4)
    ids = torch.randint(2, 256, (1, 30))
    with torch.no_grad():
        feats = drafter.context_features(target(ids, output_hidden_states=True).hidden_states)
        full = drafter.draft_logits(target, 7, 30, feats, DynamicCache())
        drafter.context_window = 10
        windowed = drafter.draft_logits(target, 7, 30, feats, DynamicCache())
        drafter.context_window = None
        truncated = drafter.draft_logits(target, 7, 30, feats[:, -10:], DynamicCache())
        drafter.context_window = 40                     # wider than the context: no change
        wide = drafter.draft_logits(target, 7, 30, feats, DynamicCache())
    torch.testing.assert_close(windowed, truncated, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wide, full, rtol=1e-5, atol=1e-5)
    assert (windowed - full).abs().max() > 1e-3         # the window did cut something
    # the training forward honours the window too (what the teacher-forced sweep measures)
    block = torch.tensor([[7, 0, 0, 0]])
    with torch.no_grad():
        drafter.context_window = 10
        tf = drafter.block_logits(target, feats[0], block, torch.tensor([30]))[0, 1:]
        drafter.context_window = None
    torch.testing.assert_close(tf, windowed, rtol=1e-4, atol=1e-4)


def test_attention_sinks_keep_the_first_positions_in_the_window():
    """With context_window W and S sinks the block sees context positions 0 .. S - 1 and the
    last W: the inference path (cache views) and the training forward's mask agree, and the
    sinks change the logits."""
    from transformers import DynamicCache

    target = tiny_target(seed=4)
    drafter = tiny_drafter(target, block_size=4)
    ids = torch.randint(2, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    block = torch.tensor([[7, 0, 0, 0]])
    with torch.no_grad():
        feats = drafter.context_features(target(ids, output_hidden_states=True).hidden_states)
        drafter.context_window = 10
        windowed = drafter.draft_logits(target, 7, 30, feats, DynamicCache())
        drafter.attention_sinks = 3
        sunk = drafter.draft_logits(target, 7, 30, feats, DynamicCache())
        trained = drafter.block_logits(target, feats[0], block, torch.tensor([30]))
    torch.testing.assert_close(trained[0, 1:], sunk, rtol=1e-4, atol=1e-4)
    assert (sunk - windowed).abs().max() > 1e-3
