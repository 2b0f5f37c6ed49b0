"""The training package: real-text loaders, the feature cache, distillation losses, the three
recipes on the shared loop, checkpoints (tiny models)."""
import json

import pytest
import torch

import numpy as np

from sharpdraft.data import sources as data
from sharpdraft.drafters.dflash import DFlashDrafter
from sharpdraft.training import cache as tc, common as tcm, dflash as td, eagle3 as te, loop
from sharpdraft.training import losses, pard as tp
from sharpdraft.inference.engine import autoregressive_generate, speculative_generate
from sharpdraft_helpers import tiny_drafter, tiny_target


def byte_encoder(doc):
    """Real text as bytes: a vocabulary of 256 fits the tiny target."""
    return list(data.document_text(doc).encode("utf-8")[:2000])


class ByteTokenizer:
    """What `data.tokenizer_encoder` needs of a tokenizer: text to byte ids (vocabulary 256)."""
    chat_template = None
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": list(text.encode("utf-8")[:2000])})()


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
    # compose's documents are writing subjects ("a train journey across the mountains")
    assert len(text) > (15 if source == "compose" else 50) and " " in text
    if source in ("humaneval", "stdlib"):
        assert any("def " in data.document_text(d) for d in train[:20])


def test_pack_sequences_is_deterministic():
    a, counts = data.pack_sequences(byte_encoder, 0, "train", 6 * 64, 64, seed=3)
    b, _ = data.pack_sequences(byte_encoder, 0, "train", 6 * 64, 64, seed=3)
    assert a == b and all(len(s) == 64 for s in a)
    assert sum(counts.values()) == 64 * len(a)
    c, _ = data.pack_sequences(byte_encoder, 0, "heldout", 6 * 64, 64, seed=3)
    assert a != c


def conversation(seq, prompt_len):
    """A corpus-style sequence: the first prompt_len tokens are prompt, the rest response."""
    return list(seq), tc.trained_rows([False] * prompt_len + [True] * (len(seq) - prompt_len))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tiny_target()
    train_seqs, _ = data.pack_sequences(byte_encoder, 0, "train", 4 * 96, 96, seed=0)
    held_seqs, _ = data.pack_sequences(byte_encoder, 0, "heldout", 2 * 96, 96, seed=0)
    layer_ids = tiny_drafter(target).config.target_layer_ids
    root = tmp_path_factory.mktemp("cache")
    # train: two packed texts (every row trained) and two conversations of other lengths
    # (prompt rows context only); held-out: one of each
    train = [(s, [True] * 95 + [False]) for s in train_seqs[:2]]
    train += [conversation(train_seqs[2][:80], 30), conversation(train_seqs[3][:64], 20)]
    held = [(held_seqs[0], [True] * 95 + [False]), conversation(held_seqs[1][:72], 24)]
    caches = []
    for name, items in (("train", train), ("held", held)):
        c = tc.FeatureCache(root / name)
        c.build(target, [s for s, _ in items], [m for _, m in items], layer_ids, 8,
                {"split": name}, progress=False)
        caches.append(c)
    return target, [s for s, _ in train], layer_ids, caches, root


def test_trained_rows_by_hand():
    assert tc.trained_rows([0, 0, 1, 1]).tolist() == [False, True, True, False]
    assert tc.trained_rows([1, 1, 1]).tolist() == [True, True, False]


def test_cache_roundtrip_varlen_memory_mapped(setup):
    target, seqs, layer_ids, (train_c, _), _ = setup
    assert train_c.complete()
    fs = train_c.load()
    assert len(fs) == 4 and fs.lengths.tolist() == [96, 96, 80, 64]
    assert [fs[s]["ids"].tolist() for s in range(4)] == seqs
    assert fs[2]["trained"].tolist() == tc.trained_rows([0] * 30 + [1] * 50).tolist()
    assert isinstance(fs._shards[0]["feats"], np.memmap)          # read from disk, not loaded
    for s in (1, 3):
        f, p, i = tc.compute_features(target, torch.tensor([seqs[s]]), layer_ids, 8)
        assert torch.equal(fs[s]["feats"], f[0]) and torch.equal(fs[s]["top_i"], i[0])
        assert torch.equal(fs[s]["top_p"], p[0])
    # the cached features are the drafter's context features (float16)
    with torch.no_grad():
        hs = target(torch.tensor(seqs[3:4]), output_hidden_states=True).hidden_states
    ref = tiny_drafter(target).context_features(hs)
    torch.testing.assert_close(fs[3]["feats"].float(), ref[0], atol=2e-3, rtol=2e-3)
    meta = json.loads((train_c.folder / "meta.json").read_text())
    assert meta["sequences"] == 4 and meta["rows"] == 336
    # the top-k targets are those of the full logits, however the LM head is chunked
    with torch.no_grad():
        full = torch.softmax(target(torch.tensor(seqs[1:2])).logits.float(), -1).topk(8, -1)
    for rows in (7, 1000):
        _, p_c, i_c = tc.compute_features(target, torch.tensor(seqs[1:2]), layer_ids, 8,
                                          rows_per_chunk=rows)
        assert torch.equal(i_c, full.indices.int())
        torch.testing.assert_close(p_c.float(), full.values, atol=1e-3, rtol=1e-3)


def test_cache_build_resumes_at_the_missing_shard(tmp_path, monkeypatch):
    target = tiny_target()
    seqs = [[(7 * i + j) % 250 + 1 for j in range(20 + i)] for i in range(tc.SHARD_SEQUENCES + 3)]
    flags = [[True] * (len(s) - 1) + [False] for s in seqs]
    c = tc.FeatureCache(tmp_path / "c")
    c.build(target, seqs, flags, [0, 2], 4, {}, progress=False)
    first = c.load()[0]["feats"].clone()
    (tmp_path / "c" / "meta.json").unlink()
    (tmp_path / "c" / "shard_00001.offsets.npy").unlink()      # shard 1 never finished
    calls = []
    real = tc.compute_features
    monkeypatch.setattr(tc, "compute_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    c.build(target, seqs, flags, [0, 2], 4, {}, progress=False)
    assert len(calls) == 3 and c.complete()                     # only shard 1's 3 sequences
    fs = c.load()
    assert len(fs) == len(seqs) and torch.equal(fs[0]["feats"], first)
    assert fs[len(seqs) - 1]["ids"].tolist() == seqs[-1]
    assert not list((tmp_path / "c").glob("*.partial*"))
    with pytest.raises(ValueError, match="trained"):
        c.build(target, seqs[:1], [[True]], [0, 2], 4, {}, progress=False)


def test_cache_folder_grows_with_its_list_and_serves_shorter_ones(tmp_path, monkeypatch):
    """A longer list that begins with the cached one computes only the sequences it adds (plus
    the partial last shard's); a shorter one computes nothing and loads exactly its prefix."""
    target = tiny_target()
    n = tc.SHARD_SEQUENCES
    seqs = [[(5 * i + 3 * j) % 250 + 1 for j in range(12 + i % 7)] for i in range(2 * n + 7)]
    flags = [[j % 3 != 0 for j in range(len(s) - 1)] + [False] for s in seqs]
    calls = []
    real = tc.compute_features
    monkeypatch.setattr(tc, "compute_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    c = tc.FeatureCache(tmp_path / "c")
    c.build(target, seqs[:n + 3], flags[:n + 3], [0, 2], 4, {}, progress=False)
    assert len(calls) == n + 3
    kept = c.load()[2]["feats"].clone()
    calls.clear()
    c.build(target, seqs, flags, [0, 2], 4, {}, progress=False)
    assert len(calls) == len(seqs) - n            # shard 0 kept; shard 1 (3 -> 16) and shard 2
    calls.clear()
    short = n + 5
    c.build(target, seqs[:short], flags[:short], [0, 2], 4, {}, progress=False)
    assert calls == []                            # shard 1 begins with the wanted 5 sequences
    fs = c.load(short)
    assert len(fs) == short and torch.equal(fs[2]["feats"], kept)
    assert [fs[s]["ids"].tolist() for s in range(short)] == seqs[:short]
    assert sum(int(sh["ids"].shape[0]) for sh in fs.shards()) == sum(map(len, seqs[:short]))
    assert len(c.load()) == len(seqs)
    # a list that differs inside shard 1 rewrites that shard only
    other = [list(s) for s in seqs[:n + 2]]
    other[n + 1][0] = 251
    calls.clear()
    c.build(target, other, flags[:n + 2], [0, 2], 4, {}, progress=False)
    assert len(calls) == 2 and c.load(n + 2)[n + 1]["ids"].tolist() == other[n + 1]
    with pytest.raises(ValueError, match="wanted"):
        c.load(len(seqs) + 1)


def test_cached_features_keys_the_folder_by_content_not_by_the_list(tmp_path):
    target = tiny_target()
    tok = ByteTokenizer()
    kw = dict(split="train", seq_len=48, topk=4, home=tmp_path)
    small = tc.cached_features(target, tok, {"source": "tiny"}, [0, 2], tokens=2 * 48, **kw)
    big = tc.cached_features(target, tok, {"source": "tiny"}, [0, 2], tokens=16 * 48, **kw)
    assert small["folder"] == big["folder"]
    assert small["meta"]["fingerprint"] != big["meta"]["fingerprint"]
    assert len(big["features"]) > len(small["features"])
    # packed text is not prefix-stable (sources interleave by budget): the small list again
    # gets its own sequences and features back from the shared folder
    again = tc.cached_features(target, tok, {"source": "tiny"}, [0, 2], tokens=2 * 48, **kw)
    assert len(again["features"]) == len(small["features"])
    for s in range(len(small["features"])):
        assert torch.equal(again["features"][s]["ids"], small["features"][s]["ids"])
        assert torch.equal(again["features"][s]["feats"], small["features"][s]["feats"])
    other = tc.cached_features(target, tok, {"source": "tiny"}, [0, 2], tokens=2 * 48,
                               **{**kw, "topk": 3})
    assert other["folder"] != small["folder"]


def test_cache_autocast_is_keyed_apart_and_stays_close_to_float32(tmp_path):
    """--cache-dtype bfloat16: the train features come from a bfloat16-autocast forward, a
    different cache folder from float32's, differing from float32 by bfloat16 rounding only."""
    target = tiny_target()
    tok = ByteTokenizer()
    kw = dict(split="train", seq_len=48, topk=4, home=tmp_path, tokens=4 * 48)
    f32 = tc.cached_features(target, tok, {"source": "tiny"}, [0, 2], **kw)
    b16 = tc.cached_features(target, tok, {"source": "tiny"}, [0, 2], **kw,
                             autocast=torch.bfloat16)
    assert b16["folder"] != f32["folder"] and b16["meta"]["autocast"] == "bfloat16"
    assert "autocast" not in f32["meta"]
    a = torch.cat([f32["features"][s]["feats"].float() for s in range(len(f32["features"]))])
    b = torch.cat([b16["features"][s]["feats"].float() for s in range(len(b16["features"]))])
    assert a.abs().mean() > 1e-3                        # real features, not zeros
    rel = float((a - b).norm() / a.norm())
    assert 0 < rel < 0.05                               # autocast ran, and only rounding differs
    n = len(f32["features"])
    p32 = torch.cat([f32["features"][s]["top_p"][:, 0].float() for s in range(n)])
    p16 = torch.cat([b16["features"][s]["top_p"][:, 0].float() for s in range(n)])
    assert float((p32 - p16).abs().max()) < 0.05


def test_fit_autocast_runs_the_loss_in_bfloat16_and_keeps_float32_weights(setup):
    target, _, _, (train_c, held_c), root = setup
    drafter = tiny_drafter(target, block_size=4, train_context=96)
    tr = train_c.load()
    scale = losses.feature_scale(tr.feature_rows())
    inner = td.make_loss(drafter, target, tr, blocks=8, gamma=7.0, scale=scale)
    seen = []

    def loss_fn(gen, frac):
        seen.append(torch.is_autocast_enabled("cpu") and
                    torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return inner(gen, frac)

    res = loop.fit(drafter, target, loss_fn,
                   lambda: td.evaluate(drafter, target, held_c.load(), 8, 7.0, scale=scale),
                   snapshot=lambda: td.folded_drafter(drafter, scale), autocast=torch.bfloat16,
                   **fit_kw(root / "dflash-autocast"))
    assert seen and all(seen)
    assert all(p.dtype == torch.float32 for p in drafter.parameters())
    hist = [h["loss"] for h in res["history"]]
    assert sum(hist[-5:]) / 5 < sum(hist[:5]) / 5 - 0.05


def test_choose_autocast_picks_the_precision_it_measured_faster(monkeypatch):
    """--autocast auto / --cache-dtype auto: both precisions are timed, and bfloat16 autocast
    is chosen exactly when its median is the lower one (real timings, then set ones both
    ways)."""
    from sharpdraft.target import precision

    dtype, ms = precision.choose_autocast(tiny_target(), rows=64, repeats=3)
    assert set(ms) == {"float32", "bfloat16"} and all(v > 0 for v in ms.values())
    assert (dtype is torch.bfloat16) == (ms["bfloat16"] < ms["float32"])

    def fake(fns, repeats, flush=None):
        assert set(fns) == {"float32", "bfloat16"}
        for fn in fns.values():
            fn()                                   # both candidates run
        return dict(times)

    monkeypatch.setattr(precision, "interleaved_medians", fake)
    for times, want in (({"float32": 2e-3, "bfloat16": 1e-3}, torch.bfloat16),
                        ({"float32": 1e-3, "bfloat16": 2e-3}, None)):
        assert precision.choose_autocast(tiny_target(), rows=8) == (
            want, {k: round(1e3 * v, 4) for k, v in times.items()})


def test_resolve_precision_replaces_auto_only_and_records_the_timings():
    import argparse

    args = argparse.Namespace(autocast="auto", cache_dtype="float32")
    loop.resolve_precision(args, tiny_target())
    bf16 = args.precision_rule_ms["bfloat16"] < args.precision_rule_ms["float32"]
    assert args.autocast == ("bfloat16" if bf16 else "off")
    assert args.cache_dtype == "float32"                      # not "auto": left alone
    fixed = argparse.Namespace(autocast="off", cache_dtype="bfloat16")
    loop.resolve_precision(fixed, tiny_target())
    assert vars(fixed) == {"autocast": "off", "cache_dtype": "bfloat16"}   # nothing measured
    with pytest.raises(ValueError, match="resolve_precision"):
        loop.autocast_dtype("auto")
    assert loop.autocast_dtype("off") is None and loop.autocast_dtype("bfloat16") is torch.bfloat16


def test_cache_dtype_auto_reuses_a_complete_cache(tmp_path, monkeypatch):
    """--cache-dtype auto takes the precision of a complete train cache of the same selection
    (no timing, nothing rebuilt); a selection without one is left to the measurement."""
    import argparse

    target, tok, prov = tiny_target(), ByteTokenizer(), {"source": "tiny"}
    kw = dict(split="train", seq_len=48, topk=4, home=tmp_path, tokens=4 * 48)
    assert tc.complete_cache_dtype(tok, prov, [0, 2], **kw) is None
    tc.cached_features(target, tok, prov, [0, 2], **kw, autocast=torch.bfloat16)
    assert tc.complete_cache_dtype(tok, prov, [0, 2], **kw) == "bfloat16"
    longer = {**kw, "tokens": 16 * 48}                  # same folder, another list: incomplete
    assert tc.complete_cache_dtype(tok, prov, [0, 2], **longer) is None
    tc.cached_features(target, tok, prov, [0, 2], **longer)
    assert tc.complete_cache_dtype(tok, prov, [0, 2], **longer) == "float32"
    monkeypatch.setenv("SHARPDRAFT_HOME", str(tmp_path))
    monkeypatch.setattr(loop, "choose_autocast", lambda *a, **k: pytest.fail("timed"))
    args = argparse.Namespace(cache_dtype="auto", autocast="bfloat16", tokens=4 * 48,
                              seq_len=48, topk=4, seed=0, corpus=None)
    loop.reuse_cache_dtype(args, tok, prov, [0, 2])
    loop.resolve_precision(args, target)
    assert args.cache_dtype == "bfloat16"
    other = argparse.Namespace(**{**vars(args), "cache_dtype": "auto", "topk": 3})
    loop.reuse_cache_dtype(other, tok, prov, [0, 2])
    assert other.cache_dtype == "auto"                  # nothing cached: measure as before


def test_cache_key_ignores_the_dtype_timing_but_not_the_dtype():
    """--dtype auto records its float32 / bfloat16 timings in the target provenance; they vary
    run to run and must not make a new cache folder, while the chosen dtype must."""
    meta = {"format": "f", "layer_ids": [0, 2], "topk": 4, "split": "heldout",
            "target": {"sha256": "ab", "dtype": "bfloat16", "dtype_rule_ms": {"float32": [1.0]}}}
    again = {**meta, "target": {**meta["target"], "dtype_rule_ms": {"float32": [2.0]}}}
    fp32 = {**meta, "target": {**meta["target"], "dtype": "float32"}}
    assert tc.cache_key(meta) == tc.cache_key(again) != tc.cache_key(fp32)


def test_distill_loss_and_weights():
    w = losses.position_weights(5, 2.0)
    torch.testing.assert_close(w, torch.exp(-torch.arange(4.0) / 2.0))
    logits = torch.randn(3, 4, 10)
    top_p, top_i = torch.softmax(logits, -1).topk(10, dim=-1)
    loss, per_row = losses.distill_loss(logits, top_p, top_i, w)
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean(0)
    torch.testing.assert_close(per_row, entropy)   # full distribution: CE = entropy (KL = 0)
    torch.testing.assert_close(loss, (entropy * w).sum() / w.sum())


def test_distill_loss_ignores_rows_that_are_not_training_targets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 12, generator=g, dtype=torch.float64)
    top_p, top_i = torch.softmax(torch.randn(4, 3, 12, generator=g), -1).topk(5, dim=-1)
    valid = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    w = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    loss, per_row = losses.distill_loss(logits, top_p, top_i, w, valid)
    ce = losses.soft_cross_entropy(logits, top_p, top_i)
    expect = sum(float(ce[k, j] * w[j]) for k in range(4) for j in range(3) if valid[k, j])
    expect /= sum(float(w[j]) for k in range(4) for j in range(3) if valid[k, j])
    assert abs(float(loss) - expect) < 1e-12
    assert abs(float(per_row[1]) - float(ce[0, 1] + ce[3, 1]) / 2) < 1e-12
    garbage = logits.clone()
    garbage[~valid] = 1e3 * torch.randn(int((~valid).sum()), 12, dtype=torch.float64)
    assert float(losses.distill_loss(garbage, top_p, top_i, w, valid)[0]) == float(loss)


def test_draft_vocabulary_and_loss_outside_it():
    ids = torch.tensor([5, 5, 5, 7, 7, 2])
    top_i = torch.tensor([[5, 9], [7, 9], [7, 1], [5, 1], [9, 3], [1, 2]]).int()
    top_p = torch.tensor([[0.6, 0.1]] * 6).half()
    # counts: 5 -> 3 (ids) + 2 (top-1) + 1.2, 7 -> 2 + 2 + 1.2, 9 -> 1 + 0.2, 1 -> 1 + 0.2, ...
    shards = [{"ids": ids[:4], "top_i": top_i[:4], "top_p": top_p[:4]},
              {"ids": ids[4:], "top_i": top_i[4:], "top_p": top_p[4:]}]
    d2t = losses.draft_vocabulary(shards, 3, 12)
    assert d2t.tolist() == [1, 5, 7]
    t2d = losses.target_to_draft(d2t, 12)
    assert t2d[5] == 1 and t2d[9] == -1 and t2d[1] == 0
    with pytest.raises(ValueError, match="draft vocabulary size"):
        losses.draft_vocabulary(shards, 13, 12)
    # entries outside the draft vocabulary (-1) drop out and the rest renormalise
    logits = torch.randn(2, 3, 4)
    p = torch.tensor([0.5, 0.3, 0.2]).expand(2, 3, 3)
    i = torch.tensor([2, -1, 0]).expand(2, 3, 3)
    loss, per_row = losses.distill_loss(logits, p, i, torch.ones(3))
    logq = torch.log_softmax(logits.double(), -1)
    expect = -(0.5 * logq[..., 2] + 0.2 * logq[..., 0]) / 0.7
    torch.testing.assert_close(per_row.double(), expect.mean(0), rtol=1e-5, atol=1e-6)


def test_anchors_and_windows_fall_on_trained_rows():
    trained = torch.tensor(tc.trained_rows([0] * 40 + [1] * 24))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = tcm.sample_anchors(trained, 8, g)
        assert len(set(a.tolist())) == 8 and bool(trained[a].all()) and a.min() >= 39
        off = tcm.window_start(trained, 32, g)
        assert 0 <= off <= 32 and bool(trained[off:off + 32].any())
    assert tcm.window_start(trained, 32) == 32                  # evaluation: the last window
    curriculum = tcm.sample_anchors(trained, 4, g, max_anchor=10)  # none that early: earliest
    assert curriculum.tolist() == [39, 40, 41, 42]
    with pytest.raises(ValueError, match="no trained row"):
        tcm.sample_anchors(torch.zeros(10, dtype=torch.bool), 2, g)


def test_lr_schedule_by_hand():
    assert loop.lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert loop.lr_at(10, 110, 1.0, 10) == pytest.approx(1.0)
    assert loop.lr_at(60, 110, 1.0, 10) == pytest.approx(0.5)
    assert loop.lr_at(20, 110, 1.0, 10, time_frac=1.0) == pytest.approx(0.0)


def fit_kw(out):
    return dict(steps=40, lr=3e-3, warmup=4, eval_every=20, out=out, save_dtype=torch.float32,
                max_seconds=None, progress=False)


def test_dflash_recipe_lowers_loss_and_checkpoint_drafts(setup):
    target, seqs, _, (train_c, held_c), root = setup
    drafter = tiny_drafter(target, block_size=4, train_context=96)
    tr = train_c.load()
    scale = losses.feature_scale(tr.feature_rows())
    out = root / "dflash"
    res = loop.fit(drafter, target,
                   td.make_loss(drafter, target, tr, blocks=8, gamma=7.0, scale=scale,
                                anchor_warmup=0.5, min_context=16),
                   lambda: td.evaluate(drafter, target, held_c.load(), 8, 7.0, scale=scale),
                   snapshot=lambda: td.folded_drafter(drafter, scale), **fit_kw(out))
    hist = [h["loss"] for h in res["history"]]
    assert sum(hist[-5:]) / 5 < sum(hist[:5]) / 5 - 0.05
    best = res["best"]
    assert len(best["top1_per_position"]) == 3 and 1.0 <= best["tau_proxy"] <= 4.0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["train_context"] == 96 and cfg["block_size"] == 4
    assert json.loads((out / "training.json").read_text())["best_eval"] == best
    assert not list(root.glob("dflash.partial"))
    loaded = DFlashDrafter.load(out)
    assert loaded.sharp.n_ref == 96
    # the checkpoint reads raw features: the training-time feature scale is folded into fc
    feats = tr[0]["feats"].float()
    anchors = torch.tensor([5, 40, 90])
    block = torch.zeros(3, 4, dtype=torch.long)
    with torch.no_grad():
        final = td.folded_drafter(drafter, None)   # the trained weights, scale not folded
        torch.testing.assert_close(
            td.folded_drafter(drafter, scale).block_logits(target, feats, block, anchors),
            final.block_logits(target, feats * scale, block, anchors), rtol=1e-4, atol=1e-4)
    prompt = torch.tensor([seqs[0][:20]])
    ar = autoregressive_generate(target, prompt, 12)
    spec = speculative_generate(target, loaded, prompt, 12)
    assert spec.tokens == ar.tokens                           # lossless with the trained drafter


def test_recipe_losses_read_only_trained_rows(setup):
    """Each recipe's loss is unchanged when the target distributions of untrained (prompt)
    rows are replaced by other ones: the prompt is context, never a target."""
    from sharpdraft.drafters.pard import PARDConfig, PARDDrafter
    from sharpdraft.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    target, _, layer_ids, (train_c, _), _ = setup
    fs = train_c.load()

    class Only(tc.SequenceFeatures):   # sequence 2 alone (a conversation: rows < 29 untrained)
        def __init__(self, top_p=None):
            self.lengths, self.seq = fs.lengths[2:3], dict(fs[2])
            if top_p is not None:
                self.seq["top_p"] = top_p
        def __len__(self):
            return 1
        def __getitem__(self, s):
            return self.seq
    other = fs[2]["top_p"].clone()
    other[~fs[2]["trained"]] = other[~fs[2]["trained"]].flip(-1)
    dfl = tiny_drafter(target, block_size=4)
    pard = PARDDrafter(PARDConfig.from_target(target.config, num_layers=2, num_draft_tokens=3))
    eag = Eagle3Drafter(Eagle3Config.from_target(target.config, target_layer_ids=[layer_ids[1]]))
    cols = tcm.fused_columns(layer_ids, [layer_ids[1]], 64)
    makers = [lambda f: td.make_loss(dfl, target, f, blocks=6, gamma=7.0, scale=None),
              lambda f: tp.make_loss(pard, target, f, 48, 0.7),
              lambda f: te.make_loss(eag, target, f, cols, 48, 2, 0.8)]
    for make in makers:
        a, b, c = (make(f)(torch.Generator().manual_seed(5), 1.0)[0].detach()
                   for f in (Only(), Only(other), Only(fs[2]["top_p"].flip(-1))))
        assert float(a) == float(b) and float(a) != float(c)


def test_pard_recipe_lowers_loss_and_checkpoint_drafts(setup):
    from sharpdraft.drafters.pard import PARDConfig, PARDDrafter
    target, seqs, _, (train_c, held_c), root = setup
    cfg = PARDConfig.from_target(target.config, num_layers=2, num_draft_tokens=3,
                                 train_context=48, draft_vocab_size=64)
    drafter = PARDDrafter(cfg)
    tr = train_c.load()
    drafter.set_draft_vocab(losses.draft_vocabulary(tr, 64, 256))
    drafter.init_from_target(target)
    out = root / "pard"
    res = loop.fit(drafter, target, tp.make_loss(drafter, target, tr, 48, 0.7),
                   lambda: tp.evaluate(drafter, target, held_c.load(), window=48), **fit_kw(out))
    hist = [h["loss"] for h in res["history"]]
    assert sum(hist[-5:]) / 5 < sum(hist[:5]) / 5 - 0.05
    assert len(res["best"]["top1_per_position"]) == 3
    assert 1.0 <= res["best"]["tau_proxy"] <= 4.0
    loaded = PARDDrafter.load(out)
    assert loaded.config.train_context == 48 and loaded.sharp.n_ref == 48
    prompt = torch.tensor([seqs[0][:20]])
    assert (speculative_generate(target, loaded, prompt, 12).tokens
            == autoregressive_generate(target, prompt, 12).tokens)


def test_decoding_walk_by_hand():
    """A step at row t commits runs[t] + 1 tokens and the next starts there; rows that may not
    start a step (prompt) are skipped."""
    runs = torch.tensor([2, 0, 1, 0, 3, 0, 0, 0])
    yes = torch.ones(8, dtype=torch.bool)
    assert losses.decoding_walk(runs, yes).tolist() == [3.0, 1.0, 4.0]
    assert losses.decoding_walk(runs, torch.tensor([0, 1, 1, 1, 1, 1, 1, 1]).bool()
                                ).tolist() == [1.0, 2.0, 4.0]
    assert losses.decoding_walk(runs, torch.tensor([1, 1, 1, 0, 1, 1, 1, 1]).bool()
                                ).tolist() == [3.0, 4.0]
    assert losses.decoding_walk(runs, ~yes).numel() == 0
    # every row is committed by exactly one step when steps may start anywhere
    assert float(losses.decoding_walk(runs, yes).sum()) == runs.numel()


def test_trained_ahead_by_hand():
    t = torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.bool)
    assert losses.trained_ahead(t, 1).tolist() == t.tolist()
    assert losses.trained_ahead(t, 2).int().tolist() == [1, 1, 0, 1, 1, 0]
    assert losses.trained_ahead(t, 10).int().tolist() == [1, 1, 1, 1, 1, 0]


def test_copy_losses_by_hand():
    ce = torch.tensor([1.0, 3.0, 2.0, 4.0, 6.0])
    got = losses.copy_losses(ce, torch.tensor([0, 0, 1, 2, 2]), 4)
    assert got[:3].tolist() == [2.0, 2.0, 5.0] and torch.isnan(got[3])


def test_eagle3_recipe_lowers_loss_and_checkpoint_drafts(setup):
    from sharpdraft.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    target, seqs, layer_ids, (train_c, held_c), root = setup
    cfg = Eagle3Config.from_target(target.config, target_layer_ids=[layer_ids[1]],
                                   train_context=64, chain_length=3, draft_vocab_size=64)
    drafter = Eagle3Drafter(cfg)
    tr = train_c.load()
    drafter.set_draft_vocab(losses.draft_vocabulary(tr, 64, 256))
    cols = tcm.fused_columns(layer_ids, [layer_ids[1]], 64)
    torch.testing.assert_close(tr[0]["feats"][:, cols], tr[0]["feats"][:, 64:128])
    with torch.no_grad():
        drafter.feature_scale.copy_(losses.feature_scale(tr.feature_rows()[:, cols]))
    out = root / "eagle3"
    res = loop.fit(drafter, target, te.make_loss(drafter, target, tr, cols, 64, 2, 0.8),
                   lambda: te.evaluate(drafter, target, held_c.load(), cols, window=64),
                   **fit_kw(out))
    hist = [h["loss"] for h in res["history"]]
    assert sum(hist[-5:]) / 5 < sum(hist[:5]) / 5 - 0.05
    assert len(res["best"]["top1_per_position"]) == 3
    loaded = Eagle3Drafter.load(out)
    torch.testing.assert_close(loaded.feature_scale, drafter.feature_scale)
    prompt = torch.tensor([seqs[0][:20]])
    ref = autoregressive_generate(target, prompt, 12).tokens
    assert speculative_generate(target, loaded, prompt, 12).tokens == ref


def test_skipped_positions_keep_the_keys_and_stretch_the_distances():
    g = torch.Generator().manual_seed(0)
    spans = []
    for _ in range(50):
        p = loop.skipped_positions(64, 1000, g)
        d = p[1:] - p[:-1]
        assert p[0] == 0 and bool((d >= 1).all()) and int((d > 1).sum()) <= 1
        assert int(p[-1]) <= 999
        spans.append(int(p[-1]))
    assert max(spans) > 500                          # distances far beyond 64 are trained
    with pytest.raises(ValueError, match="max_position"):
        loop.skipped_positions(64, 63, g)


def test_block_logits_positions_obey_rope_relative_invariance(setup):
    target, _, _, (train_c, _), _ = setup
    drafter = tiny_drafter(target, block_size=4)
    feats = train_c.load()[0]["feats"].float()
    anchors, block = torch.tensor([10, 50, 90]), torch.zeros(3, 4, dtype=torch.long)
    T = feats.shape[0]
    with torch.no_grad():
        plain = drafter.block_logits(target, feats, block, anchors)
        same = drafter.block_logits(target, feats, block, anchors, torch.arange(T))
        shifted = drafter.block_logits(target, feats, block, anchors, torch.arange(T) + 300)
        gap = drafter.block_logits(target, feats, block, anchors,
                                   torch.arange(T) + 300 * (torch.arange(T) >= 30))
    torch.testing.assert_close(same, plain)
    torch.testing.assert_close(shifted, plain, atol=2e-4, rtol=2e-4)   # RoPE: only differences
    assert (gap[1:] - plain[1:]).abs().max() > 1e-3    # blocks past the gap see other distances
    torch.testing.assert_close(gap[0], plain[0], atol=2e-4, rtol=2e-4)  # block 0 is before it
    with pytest.raises(ValueError, match="positions must have shape"):
        drafter.block_logits(target, feats, block, anchors, torch.arange(T - 1))


def test_dflash_position_skip_steps_train(setup):
    target, _, _, (train_c, _), _ = setup
    drafter = tiny_drafter(target, block_size=4)
    fn = td.make_loss(drafter, target, train_c.load(), blocks=4, gamma=7.0, scale=None,
                      position_skip=1.0, max_position=400)
    loss, extra = fn(torch.Generator().manual_seed(0), 0.5)
    assert extra["skipped"] and torch.isfinite(loss)
    loss.backward()
    assert drafter.fc.weight.grad is not None
    with pytest.raises(ValueError, match="max_position"):
        td.make_loss(drafter, target, train_c.load(), blocks=4, gamma=7.0, scale=None,
                     position_skip=0.5)


def test_eagle3_position_skip_steps_train(setup):
    from sharpdraft.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    target, _, layer_ids, (train_c, _), _ = setup
    drafter = Eagle3Drafter(Eagle3Config.from_target(target.config,
                                                     target_layer_ids=[layer_ids[1]]))
    cols = tcm.fused_columns(layer_ids, [layer_ids[1]], target.config.hidden_size)
    fn = te.make_loss(drafter, target, train_c.load(), cols, 48, 2, 0.8, position_skip=1.0,
                      max_position=400)
    loss, extra = fn(torch.Generator().manual_seed(0), 0.5)
    assert extra["skipped"] and torch.isfinite(loss)
    loss.backward()
    assert drafter.fc.weight.grad is not None
    with pytest.raises(ValueError, match="max_position"):
        te.make_loss(drafter, target, train_c.load(), cols, 48, 2, 0.8, position_skip=0.5)


def test_init_from_checkpoint_continues_the_saved_drafter(tmp_path):
    target = tiny_target()
    saved = tiny_drafter(target, block_size=4, train_context=96)
    saved.to(torch.bfloat16).save(tmp_path / "d")
    (tmp_path / "d" / "training.json").write_text(json.dumps(
        {"steps_done": 7, "best_eval": {"tau_proxy": 1.5}, "command": "sharpdraft train x"}))
    d, info = loop.init_from_checkpoint(DFlashDrafter, tmp_path / "d", target)
    assert d.training and d.fc.weight.dtype == torch.float32
    assert info["steps_done"] == 7 and info["best_eval"] == 1.5
    for (n, a), b in zip(d.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(a.to(b.dtype), b), n
    from transformers import LlamaConfig, LlamaForCausalLM
    other = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2)).eval()     # another width
    with pytest.raises(ValueError, match="drafter checkpoint"):
        loop.init_from_checkpoint(DFlashDrafter, tmp_path / "d", other)


def test_l1_distance_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0 + 1e-30]]))
    # target top-2 {0: 0.6, 3: 0.2} renormalised to {0: 0.75, 3: 0.25}; id 3 is in the vocab
    got = losses.l1_distance(logits, torch.tensor([[0.6, 0.2]]), torch.tensor([[0, 3]]))
    want = abs(0.5 - 0.75) + abs(0.0 - 0.25) + (1 - 0.5)          # + the mass outside {0, 3}
    assert abs(float(got[0]) - want) < 1e-6
    # an id outside the draft vocabulary (-1) is dropped before renormalising
    got = losses.l1_distance(logits, torch.tensor([[0.6, 0.2]]), torch.tensor([[0, -1]]))
    assert abs(float(got[0]) - (abs(0.5 - 1.0) + 0.5)) < 1e-6


def test_longspark_recipe_lowers_loss_and_checkpoint_drafts(setup):
    from sharpdraft.drafters.longspark import LongSparkConfig, LongSparkDrafter
    from sharpdraft.training import longspark as tl
    target, seqs, layer_ids, (train_c, held_c), root = setup
    cfg = LongSparkConfig.from_target(target.config, mask_token_id=0, num_layers=2, num_drafts=3,
                                      window=16, summary_size=4, train_context=96,
                                      draft_vocab_size=64)
    assert cfg.target_layer_ids == layer_ids
    drafter = LongSparkDrafter(cfg)
    tr = train_c.load()
    drafter.set_draft_vocab(losses.draft_vocabulary(tr, 64, 256))
    drafter.init_from_target(target)
    with torch.no_grad():
        drafter.boundary_scale.copy_(losses.feature_scale(tr.feature_rows()))
    out = root / "longspark"
    res = loop.fit(drafter, target, tl.make_loss(drafter, target, tr, blocks=8, gamma=4.0,
                                                 ce_weight=0.1),
                   lambda: tl.evaluate(drafter, target, held_c.load(), 8, 4.0, 0.1),
                   **fit_kw(out))
    hist = [h["loss"] for h in res["history"]]
    assert sum(hist[-5:]) / 5 < sum(hist[:5]) / 5 - 0.02
    assert len(res["best"]["top1_per_position"]) == 3
    assert 1.0 <= res["best"]["tau_proxy"] <= 4.0
    loaded = LongSparkDrafter.load(out)
    torch.testing.assert_close(loaded.boundary_scale, drafter.boundary_scale)
    assert loaded.sharp.n_ref == 96
    prompt = torch.tensor([seqs[0][:20]])
    assert (speculative_generate(target, loaded, prompt, 12).tokens
            == autoregressive_generate(target, prompt, 12).tokens)


def test_longspark_loss_reads_only_trained_rows(setup):
    """Replacing the target distributions of untrained (prompt) rows changes nothing; replacing
    those of every row does."""
    from sharpdraft.drafters.longspark import LongSparkConfig, LongSparkDrafter
    from sharpdraft.training import longspark as tl
    target, _, _, (train_c, _), _ = setup
    fs = train_c.load()
    seq = dict(fs[2])                       # a conversation: rows < 29 are prompt
    shifted = (seq["top_i"] + 1) % 256      # other ids (the L1 term moves with the ids' q)
    other = dict(seq, top_i=torch.where(seq["trained"][:, None], seq["top_i"], shifted))
    moved = dict(seq, top_i=shifted)
    d = LongSparkDrafter(LongSparkConfig.from_target(target.config, mask_token_id=0,
                                                     num_layers=2, num_drafts=3, window=16,
                                                     summary_size=4))
    with torch.no_grad():
        d.correction_out.weight.normal_(0, 0.3)
    w = losses.position_weights(4, 4.0)
    anchors = torch.tensor([3, 10, 28, 40, 60])
    a, b, c = (float(tl.round_step(d, target, s, anchors, w, None, 0.1)[0].detach())
               for s in (seq, other, moved))
    assert not bool(seq["trained"][3]) and a == b and a != c


def test_agreement_metrics_by_hand():
    ok1 = torch.tensor([[True, True, False], [False, True, False]])    # already & valid
    v1 = torch.tensor([[True, True, True], [True, True, False]])
    ok2 = torch.tensor([[True, False, True]])
    v2 = torch.tensor([[True, True, True]])
    m = losses.agreement_metrics([1.0, 3.0], [ok1, ok2], [v1, v2])
    assert m["loss"] == 2.0
    assert m["top1_per_position"] == [round(2 / 3, 4), round(2 / 3, 4), 0.5]
    assert abs(m["tau_proxy"] - (1 + (2 + 0 + 1) / 3)) < 1e-9     # leading runs 2, 0, 1


class _Tok:
    pad_token_id, unk_token_id, eos_token_id = None, None, 1

    def __len__(self):
        return 256


@pytest.mark.parametrize("kind, extra", [
    ("dflash", ["--features", "2", "--block-size", "4", "--blocks", "4", "--layers", "1"]),
    ("eagle3", ["--window", "48", "--chain-length", "3", "--ttt-steps", "2"]),
    ("pard", ["--window", "48", "--layers", "2", "--draft-tokens", "3"]),
    ("longspark", ["--layers", "2", "--drafts", "3", "--blocks", "4", "--window", "16",
                   "--summary", "4", "--rank", "4"]),
])
def test_every_recipe_main_writes_its_checkpoint(setup, monkeypatch, tmp_path, kind, extra):
    """One `run_recipe` runs every recipe (`<recipe>.main(args)`): config.json,
    model.safetensors, training.json and train_log.jsonl in --out, the recipe's defaults and
    --lr-scale recorded."""
    import argparse
    from sharpdraft import training
    from sharpdraft.drafters import registry
    target, _, layer_ids, (train_c, held_c), _ = setup
    caches = [{"features": c.load(), "meta": {"layer_ids": list(layer_ids), "split": s},
               "folder": str(c.folder)} for c, s in ((train_c, "train"), (held_c, "heldout"))]
    monkeypatch.setattr(loop, "prepare_run", lambda args, layers: (
        target, _Tok(), {"name": "tiny"}, caches[0], caches[1], 0.0))
    recipe = training.recipe(kind)
    p = argparse.ArgumentParser()
    recipe.add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / kind), "--steps", "3", "--eval-every", "2",
                         "--draft-vocab", "0", "--lr-scale", "0.5", *extra])
    default_lr = p.get_default("lr")
    summary = recipe.main(args)
    files = {f.name for f in (tmp_path / kind).iterdir()}
    assert {"config.json", "model.safetensors", "training.json", "train_log.jsonl",
            "README.md"} <= files
    saved = json.loads((tmp_path / kind / "training.json").read_text())
    assert saved["steps_done"] == summary["steps_done"] == 3
    card_text = (tmp_path / kind / "README.md").read_text()
    assert f"{registry.get(kind).title} drafter" in card_text and "- Steps: 3;" in card_text
    assert saved["args"]["lr"] == pytest.approx(default_lr * 0.5)
    assert saved["args"]["lr_scale"] == 0.5 and "cache_seconds" in saved
    assert {"best_eval", "evals", "init_from", "drafter_params", "train_data"} <= set(saved)
    drafter = registry.get(kind).cls.load(tmp_path / kind, target=target)
    assert training.recipe_of(drafter) is recipe.RECIPE
    # continued with another key window: the checkpoint records the new window as its
    # train_context (the n_ref default), training.json the one it started from
    option = "--" + recipe.RECIPE.context_option.replace("_", "-")
    before = drafter.config.train_context
    args = p.parse_args(["--out", str(tmp_path / "more"), "--steps", "1", "--eval-every", "1",
                         "--draft-vocab", "0", "--init-from", str(tmp_path / kind), *extra,
                         option, "40"])
    recipe.main(args)
    again = registry.get(kind).cls.load(tmp_path / "more", target=target)
    assert again.config.train_context == 40 != before
    assert again.sharp.n_ref == 40
    saved = json.loads((tmp_path / "more" / "training.json").read_text())
    assert saved["init_from"]["train_context"] == before


def test_model_card_reports_the_records_and_the_suite(tmp_path):
    """The card's figures come from training.json and a suite bench.json: wall time is cache
    plus training seconds, tokens by source sum the kinds, a category's tau and speedup are
    the suite's own by_kind summary (1.00x, not a run's 1.5x), its identical count is counted
    from the runs (1 of 2), and another drafter's variants stay off the card."""
    from sharpdraft.training import card
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32, "train_context": 64}))
    (tmp_path / "training.json").write_text(json.dumps({
        "command": "sharpdraft train eagle3 --out x", "args": {"drafter": "eagle3", "threads": 2,
                                                              "lr": 1e-3, "save_dtype": "bfloat16"},
        "target": {"source": "/m/tiny.gguf", "package": "p", "version": "1", "sha256": "ab",
                   "dtype": "float32"},
        "drafter_params": 1234, "cache_seconds": 90.0, "train_seconds": 210.0, "steps_done": 77,
        "trained_rows_seen": 5000, "best_eval": {"step": 70, "loss": 1.5, "tau_proxy": 2.25,
                                                  "top1_per_position": [0.5]},
        "train_data": {"corpus": "c", "split": "train", "response_tokens": 30, "max_len": 512,
                       "response_tokens_per_kind": {"man/list": 10, "man/explain": 5,
                                                    "kjv/list": 15}},
        "heldout_data": {"corpus": "c", "split": "heldout", "response_tokens": 8}}))
    run = lambda same: {"tau": 2.0, "decode_speedup": 1.5, "identical_to_ar": same}
    (tmp_path / "bench.json").write_text(json.dumps({
        "settings": {"max_new_tokens": 16, "draft_thresholds": {"eagle3-chain": 0.6}},
        "runs": [{"kind": "story", "eagle3-chain-sharp": run(True), "dflash-sharp": run(True)},
                 {"kind": "story", "eagle3-chain-sharp": run(False)}],
        "by_kind": {"eagle3-chain-sharp": {"story": {"tau": 2.0, "decode_speedup": 1.0},
                                           "geomean_decode_speedup": 1.0},
                    "dflash-sharp": {"story": {"tau": 9.0, "decode_speedup": 9.0},
                                     "geomean_decode_speedup": 9.0}}}))
    text = card.render(tmp_path, suite=str(tmp_path / "bench.json"))
    assert "Wall time: 5.0 min (3.5 min of training; 1.5 min of target features)" in text
    assert "| man | 15 |" in text and "| kjv | 15 |" in text
    assert "| eagle3-chain-sharp | story | 0.6 | 2.00 | 1.00x | 1/2 |" in text
    assert "dflash" not in text.split("## Held-out results")[1]
    assert "1,234 parameters" in text and "step 70" in text
    assert "RECIPE.md" not in text
    # a run that read a cache built before it: no feature minutes to add, and the card says so
    record = json.loads((tmp_path / "training.json").read_text())
    record["cache_seconds"], record["train_data"]["autocast"] = 0.9, "bfloat16"
    (tmp_path / "training.json").write_text(json.dumps(record))
    (tmp_path / "RECIPE.md").write_text("stages")
    text = card.render(tmp_path)
    assert ("Wall time: 3.5 min (3.5 min of training; target features read from the cache an "
            "earlier run built, computed under bfloat16 autocast)") in text
    assert "and `RECIPE.md`" in text
    (tmp_path / "training.json").write_text("{")
    with pytest.raises(ValueError, match="training.json"):
        card.render(tmp_path)
