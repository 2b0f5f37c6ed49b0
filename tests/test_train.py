"""Training recipe: real-text loaders, feature cache, distillation loss, checkpoint (tiny models)."""
import json

import pytest
import torch

from sharpdraft import data
from sharpdraft import train_dflash as td
from sharpdraft.drafters.dflash import DFlashDrafter
from sharpdraft.engine import autoregressive_generate, speculative_generate
from sharpdraft_helpers import tiny_drafter, tiny_target


def byte_encoder(doc):
    """Real text as bytes: a vocabulary of 256 fits the tiny target."""
    return list(data.document_text(doc).encode("utf-8")[:2000])


def test_kjv_is_shipped_and_complete():
    verses = data.kjv_verses()
    assert len(verses) == 31102
    assert verses[0] == ("Ge", "Ge1:1", "In the beginning God created the heaven and the earth.")
    assert verses[-1][1] == "Rev22:21"
    assert data.kjv_text("Ge").startswith("In the beginning God created")
    assert {d["name"] for d in data.documents("kjv", "heldout")} == {"Ge"}
    assert "Ge" not in {d["name"] for d in data.documents("kjv", "train")}


@pytest.mark.parametrize("source", data.SOURCES)
def test_sources_give_real_text_and_disjoint_splits(source):
    if source not in data.available_sources():
        pytest.skip(f"the package behind {source} is not installed")
    train, held = data.documents(source, "train"), data.documents(source, "heldout")
    assert train and held
    assert not {d["name"] for d in train} & {d["name"] for d in held}
    text = data.document_text(train[0])
    assert len(text) > 50 and " " in text
    if source in ("humaneval", "stdlib"):
        assert any("def " in data.document_text(d) for d in train[:20])


def test_pack_sequences_is_deterministic():
    a, counts = data.pack_sequences(byte_encoder, 0, "train", 6 * 64, 64, seed=3)
    b, _ = data.pack_sequences(byte_encoder, 0, "train", 6 * 64, 64, seed=3)
    assert a == b and all(len(s) == 64 for s in a)
    assert sum(counts.values()) == 64 * len(a)
    c, _ = data.pack_sequences(byte_encoder, 0, "heldout", 6 * 64, 64, seed=3)
    assert a != c


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tiny_target()
    train_seqs, _ = data.pack_sequences(byte_encoder, 0, "train", 4 * 96, 96, seed=0)
    held_seqs, _ = data.pack_sequences(byte_encoder, 0, "heldout", 2 * 96, 96, seed=0)
    layer_ids = tiny_drafter(target).config.target_layer_ids
    root = tmp_path_factory.mktemp("cache")
    caches = []
    for name, seqs in (("train", train_seqs[:3]), ("held", held_seqs[:2])):
        c = td.FeatureCache(root / name)
        c.build(target, seqs, layer_ids, 8, {"split": name})
        caches.append(c)
    return target, train_seqs[:3], layer_ids, caches, root


def test_cache_roundtrip(setup):
    target, seqs, layer_ids, (train_c, _), _ = setup
    assert train_c.complete()
    loaded = train_c.load()
    assert loaded["ids"].tolist() == seqs
    f, p, i = td.compute_features(target, torch.tensor(seqs[1:2]), layer_ids, 8)
    assert torch.equal(loaded["feats"][1:2], f) and torch.equal(loaded["top_i"][1:2], i)
    assert torch.equal(loaded["top_p"][1:2], p)
    # the cached features are the drafter's context features (float16)
    with torch.no_grad():
        hs = target(torch.tensor(seqs[1:2]), output_hidden_states=True).hidden_states
    ref = tiny_drafter(target).context_features(hs)
    torch.testing.assert_close(loaded["feats"][1].float(), ref[0], atol=2e-3, rtol=2e-3)
    assert json.loads((train_c.folder / "meta.json").read_text())["sequences"] == 3
    # the top-k targets are those of the full logits, however the LM head is chunked
    with torch.no_grad():
        full = torch.softmax(target(torch.tensor(seqs[1:2])).logits.float(), -1).topk(8, -1)
    for rows in (7, 1000):
        _, p_c, i_c = td.compute_features(target, torch.tensor(seqs[1:2]), layer_ids, 8,
                                          rows_per_chunk=rows)
        assert torch.equal(i_c, full.indices.int())
        torch.testing.assert_close(p_c.float(), full.values, atol=1e-3, rtol=1e-3)


def test_distill_loss_and_weights():
    w = td.position_weights(5, 2.0)
    torch.testing.assert_close(w, torch.exp(-torch.arange(4.0) / 2.0))
    logits = torch.randn(3, 4, 10)
    top_p, top_i = torch.softmax(logits, -1).topk(10, dim=-1)
    loss, per_row = td.distill_loss(logits, top_p, top_i, w)
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean(0)
    torch.testing.assert_close(per_row, entropy)   # full distribution: CE = entropy (KL = 0)
    anchors = td.sample_anchors(40, 5, 8, torch.Generator().manual_seed(0))
    assert len(set(anchors.tolist())) == 8 and anchors.min() >= 1 and anchors.max() <= 35


def test_draft_vocabulary_and_loss_outside_it():
    ids = torch.tensor([[5, 5, 5, 7, 7, 2]])
    top_i = torch.tensor([[[5, 9], [7, 9], [7, 1], [5, 1], [9, 3], [1, 2]]]).int()
    top_p = torch.tensor([[[0.6, 0.1]] * 6]).half()
    # counts: 5 -> 3 (ids) + 2 (top-1) + 1.2, 7 -> 2 + 2 + 1.2, 9 -> 1 + 0.2, 1 -> 1 + 0.2, ...
    d2t = td.draft_vocabulary({"ids": ids, "top_i": top_i, "top_p": top_p}, 3, 12)
    assert d2t.tolist() == [1, 5, 7]
    t2d = td.target_to_draft(d2t, 12)
    assert t2d[5] == 1 and t2d[9] == -1 and t2d[1] == 0
    with pytest.raises(ValueError, match="draft vocabulary size"):
        td.draft_vocabulary({"ids": ids, "top_i": top_i, "top_p": top_p}, 13, 12)
    # entries outside the draft vocabulary (-1) drop out and the rest renormalise
    logits = torch.randn(2, 3, 4)
    p = torch.tensor([0.5, 0.3, 0.2]).expand(2, 3, 3)
    i = torch.tensor([2, -1, 0]).expand(2, 3, 3)
    loss, per_row = td.distill_loss(logits, p, i, torch.ones(3))
    logq = torch.log_softmax(logits.double(), -1)
    expect = -(0.5 * logq[..., 2] + 0.2 * logq[..., 0]) / 0.7
    torch.testing.assert_close(per_row.double(), expect.mean(0), rtol=1e-5, atol=1e-6)


def test_training_lowers_loss_and_checkpoint_drafts(setup):
    target, seqs, _, (train_c, held_c), root = setup
    drafter = tiny_drafter(target, block_size=4, train_context=96)
    out = root / "ckpt"
    res = td.train(drafter, target, train_c.load(), held_c.load(), steps=40, blocks=8, lr=3e-3,
                   warmup=4, eval_every=20, eval_blocks=8, out=out, progress=False,
                   save_dtype=torch.float32, anchor_warmup=0.5, min_context=16)
    losses = [h["loss"] for h in res["history"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05
    best = res["best"]
    assert len(best["top1_per_position"]) == 3 and 1.0 <= best["tau_proxy"] <= 4.0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["train_context"] == 96 and cfg["block_size"] == 4
    loaded = DFlashDrafter.load(out)
    assert loaded.sharp.n_ref == 96
    # the checkpoint reads raw features: the training-time feature scale is folded into fc
    feats = train_c.load()["feats"][0].float()
    anchors = torch.tensor([5, 40, 90])
    block = torch.zeros(3, 4, dtype=torch.long)
    with torch.no_grad():
        final = td.folded_drafter(drafter, None)   # the trained weights, scale not folded
        torch.testing.assert_close(
            td.folded_drafter(drafter, res["feature_scale"]).block_logits(target, feats, block,
                                                                          anchors),
            final.block_logits(target, feats * res["feature_scale"], block, anchors),
            rtol=1e-4, atol=1e-4)
    prompt = torch.tensor([seqs[0][:20]])
    ar = autoregressive_generate(target, prompt, 12)
    spec = speculative_generate(target, loaded, prompt, 12)
    assert spec.tokens == ar.tokens                           # lossless with the trained drafter


def test_pard_recipe_lowers_loss_and_checkpoint_drafts(setup):
    from sharpdraft import train_common, train_pard
    from sharpdraft.drafters.pard import PARDConfig, PARDDrafter
    target, seqs, _, (train_c, held_c), root = setup
    cfg = PARDConfig.from_target(target.config, num_layers=2, num_draft_tokens=3,
                                 train_context=48, draft_vocab_size=64)
    drafter = PARDDrafter(cfg)
    tr = train_c.load()
    drafter.set_draft_vocab(td.draft_vocabulary(tr, 64, 256))
    drafter.init_from_target(target)
    out = root / "pard"
    out.mkdir()
    res = train_common.fit(drafter, target, train_pard.make_loss(drafter, target, tr, 48, 0.7),
                           lambda: train_pard.evaluate(drafter, target, held_c.load(), window=48),
                           steps=40, lr=3e-3, warmup=4, eval_every=20, out=out,
                           save_dtype=torch.float32, max_seconds=None)
    losses = [h["loss"] for h in res["history"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05
    assert len(res["best"]["top1_per_position"]) == 3
    assert 1.0 <= res["best"]["tau_proxy"] <= 4.0
    loaded = PARDDrafter.load(out)
    assert loaded.config.train_context == 48 and loaded.sharp.n_ref == 48
    prompt = torch.tensor([seqs[0][:20]])
    assert (speculative_generate(target, loaded, prompt, 12).tokens
            == autoregressive_generate(target, prompt, 12).tokens)


def test_copy_losses_by_hand():
    from sharpdraft.train_pard import copy_losses
    ce = torch.tensor([1.0, 3.0, 2.0, 4.0, 6.0])
    got = copy_losses(ce, torch.tensor([0, 0, 1, 2, 2]), 4)
    assert got[:3].tolist() == [2.0, 2.0, 5.0] and torch.isnan(got[3])


def test_eagle3_recipe_lowers_loss_and_checkpoint_drafts(setup):
    from sharpdraft import train_common, train_eagle3
    from sharpdraft.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    target, seqs, layer_ids, (train_c, held_c), root = setup
    cfg = Eagle3Config.from_target(target.config, target_layer_ids=[layer_ids[1]],
                                   train_context=64, chain_length=3, draft_vocab_size=64)
    drafter = Eagle3Drafter(cfg)
    tr = train_c.load()
    drafter.set_draft_vocab(td.draft_vocabulary(tr, 64, 256))
    cols = train_eagle3.fused_columns(layer_ids, [layer_ids[1]], 64)
    torch.testing.assert_close(tr["feats"][..., cols], tr["feats"][..., 64:128])
    with torch.no_grad():
        drafter.feature_scale.copy_(td.feature_scale(tr["feats"][..., cols]))
    out = root / "eagle3"
    out.mkdir()
    res = train_common.fit(
        drafter, target, train_eagle3.make_loss(drafter, target, tr, cols, 64, 2, 0.8),
        lambda: train_eagle3.evaluate(drafter, target, held_c.load(), cols, window=64),
        steps=40, lr=3e-3, warmup=4, eval_every=20, out=out, save_dtype=torch.float32,
        max_seconds=None)
    losses = [h["loss"] for h in res["history"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05
    assert len(res["best"]["top1_per_position"]) == 3
    loaded = Eagle3Drafter.load(out)
    torch.testing.assert_close(loaded.feature_scale, drafter.feature_scale)
    prompt = torch.tensor([seqs[0][:20]])
    ref = autoregressive_generate(target, prompt, 12).tokens
    assert speculative_generate(target, loaded, prompt, 12).tokens == ref
