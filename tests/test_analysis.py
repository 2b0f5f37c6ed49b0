"""sharpdraft.eval.mass: row statistics by hand, the probe's logits against the kernel, the
scalings' properties, and the command on tiny models."""
import json
import math

import pytest
import torch

import sharpdraft_ext as ext
from sharpdraft.eval import mass
from sharpdraft.attention import observe
from sharpdraft.inference.engine import speculative_generate
from sharpdraft.target.runtime import TargetRuntime
from sharpdraft_helpers import tiny_drafter, tiny_target


class ByteTok:
    """A tokenizer for the tiny models (vocabulary 256): the text's bytes; the "chat template"
    keeps the last `keep` of them (the prompt builders need one)."""
    chat_template = None
    eos_token_id = None

    def __init__(self, keep: int):
        self.keep = keep

    def __call__(self, text, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": [min(b, 255) for b in text.encode()]})()

    def decode(self, ids):
        return bytes(ids).decode("latin1")

    def apply_chat_template(self, msgs, add_generation_prompt=True, return_dict=False):
        return [min(b, 255) for b in msgs[0]["content"].encode()][-self.keep:]


def test_two_level_rows_have_the_spec_topk_mass():
    """spec §1: k keys at logit a, n - k at b: M = 1 / (1 + (n - k) / k * exp(-beta Delta))."""
    n, k, a, b = 300, 8, 2.5, -1.0
    logits = torch.full((2, n), b, dtype=torch.float64)
    logits[:, 50:50 + k] = a
    vis = torch.ones(2, n, dtype=torch.bool)
    beta = torch.tensor([1.0, 1.7], dtype=torch.float64)
    st = mass.row_statistics(logits, vis, beta, topk=k, n_ref=100)
    want = [1 / (1 + (n - k) / k * math.exp(-bt * (a - b))) for bt in beta.tolist()]
    assert st["topk_mass"].tolist() == pytest.approx(want, rel=1e-12)


def test_locality_by_hand():
    # 6 keys, the row sees keys 0..4 (key 5 masked); newest visible = 4
    logits = torch.tensor([[4.0, 0.0, 0.0, 0.0, 1.0, 9.0]], dtype=torch.float64)
    vis = torch.tensor([[True] * 5 + [False]])
    st = mass.row_statistics(logits, vis, torch.ones(1, dtype=torch.float64), topk=1, n_ref=3)
    p = torch.softmax(logits[0, :5], 0)
    assert float(st["topk_mass"]) == pytest.approx(float(p[0]))
    assert float(st["far_share"]) == pytest.approx(float(p[:2].sum()))   # distance >= 3: 0, 1
    assert float(st["recent_share"]) == pytest.approx(1.0)               # all within 32
    assert float(st["argmax_distance"]) == 4.0                           # key 0 is 4 back


@pytest.mark.parametrize("case", ["causal", "mask", "full"])
def test_probe_logits_reproduce_the_kernel(case):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 16, generator=g)
    k, v = torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g)
    kw = {"causal": case == "causal"}
    if case == "mask":
        kw["attn_mask"] = torch.rand(1, 1, 6, 20, generator=g) > 0.4
    rows = torch.tensor([0, 3, 5])
    rows, logits, vis = mass.row_logits(q, k, kw, rows)
    p = torch.softmax(logits.masked_fill(~vis, float("-inf")), -1)
    got = p @ v.repeat_interleave(2, dim=1)
    ref = ext.sharp_attention(q, k, v, mode="none", **kw)[:, :, rows]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def probed():
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=4, train_context=16)
    suite = mass.scaling_suite(16, topk=4)
    runtime = TargetRuntime.prepare(target)          # its copy's modules are the ones called
    probe = mass.AttentionProbe(mass.attention_modules(drafter, runtime), suite, topk=4, rows=8)
    for L in (12, 60):
        probe.context = L
        ids = torch.randint(3, 250, (1, L), generator=torch.Generator().manual_seed(L))
        with observe(probe):
            speculative_generate(runtime, drafter, ids, 6)
    return probe, mass.summarise(probe)


def test_probe_records_every_drafter_and_target_layer(probed):
    probe, rows = probed
    layers = {(r["model"], r["layer"]) for r in rows}
    assert layers == {("drafter", 0), ("drafter", 1)} | {("target", i) for i in range(4)}
    assert {r["scaling"] for r in rows if r["model"] == "target"} == {"frozen"}
    assert {r["context"] for r in rows} == {12, 60}
    for r in rows:
        assert 0 < r["topk_mass"] <= 1 + 1e-6 and r["rows"] > 0
        assert len(r["topk_mass_per_head"]) == 4


def test_scalings_raise_mass_only_past_n_ref(probed):
    """beta >= 1 never lowers top-k mass (d/dbeta of the top set's log-mass is E_top z - E z
    >= 0); fixed_slope is beta = 1, i.e. frozen, where n <= n_ref."""
    probe, rows = probed
    for rec in probe.records.values():
        if "slope 0.2" not in rec.stats:
            continue
        n = torch.cat(rec.n)
        frozen = torch.cat(rec.stats["frozen"]["topk_mass"])
        for name in ("slope 0.1", "slope 0.4", "const e^0.2", "exact_topk"):
            other = torch.cat(rec.stats[name]["topk_mass"])
            assert bool((other >= frozen - 1e-6).all()), name
        short = n <= 16
        assert short.any() and (~short).any()
        slope = torch.cat(rec.stats["slope 0.4"]["topk_mass"])
        torch.testing.assert_close(slope[short], frozen[short])
        assert bool((slope[~short] > frozen[~short]).any())
        const = torch.cat(rec.stats["const e^0.2"]["topk_mass"])
        assert bool((const[short] > frozen[short]).any())          # constant: everywhere


def test_analyze_mass_writes_its_report(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=4, train_context=16)

    rows = mass.run(target, ByteTok(120), drafter, drafter_name="dflash", lengths=[30, 80], steps=3,
                    out=tmp_path, topk=4, rows=4)
    assert rows and (tmp_path / "mass.json").exists() and (tmp_path / "mass.png").exists()
    md = (tmp_path / "mass.md").read_text()
    assert "| frozen |" in md and "| slope 0.2 |" in md and "| drafter | 1 |" in md


# ----- calibration -----------------------------------------------------------------------------
def test_contrast_inverts_the_two_level_mass():
    from sharpdraft.eval import calibrate
    for n_ref, k, delta in ((1024, 32, 5.0), (512, 8, 2.3), (2048, 32, 7.5)):
        m = 1 / (1 + (n_ref - k) / k * math.exp(-delta))        # spec §1 at beta = 1
        assert calibrate.contrast_from_mass(m, n_ref, k) == pytest.approx(delta, rel=1e-10)
        assert calibrate.slope_from_mass(m, n_ref, k) == pytest.approx(1 / delta, rel=1e-10)
    assert calibrate.slope_from_mass(32 / 1024, 1024, 32) == calibrate.MAX_SLOPE  # uniform
    assert calibrate.slope_from_mass(1.0, 1024, 32) == 0.0                        # one-hot
    with pytest.raises(ValueError, match="n_ref must exceed k"):
        calibrate.contrast_from_mass(0.5, 32, 32)


def test_calibrate_writes_slopes_that_generate_then_uses(tmp_path):
    from sharpdraft.cli import commands as cli
    from sharpdraft.eval import calibrate
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=4, train_context=40)
    folder = tmp_path / "ckpt"
    drafter.save(folder)

    rep = calibrate.run(target, ByteTok(60), drafter, checkpoint=folder, out=tmp_path / "rep", steps=4,
                        topk=4, rows=8)
    values = rep["sharp_slopes"]
    assert len(values) == 2 and all(0.0 <= v <= calibrate.MAX_SLOPE for v in values)
    for layer, m in rep["measured"].items():      # each slope is its layer's inverted mass
        assert values[layer] == pytest.approx(calibrate.slope_from_mass(m["mass"], 40, 4),
                                              abs=1e-4)
    assert (tmp_path / "rep" / "calibrate.png").exists()
    loaded = type(drafter).load(folder, target=target)
    assert loaded.config.sharp_slopes == values
    args = cli.parser().parse_args(["generate", "--drafter-path", str(folder), "--target", "x"])
    built = cli.build_drafter(target, ByteTok(60), args)
    assert built.sharp.layer_slopes == values and built.sharp.mode == "fixed_slope"
    args = cli.parser().parse_args(["generate", "--drafter-path", str(folder), "--slope", "0.3"])
    assert cli.build_drafter(target, ByteTok(60), args).sharp.layer_slopes is None  # --slope wins
    # the kernel sees each layer's own slope
    seen, mine = {}, {id(m) for m in built.modules()}
    with observe(lambda mod, layer, q, k, kw, skw: id(mod) in mine
                 and seen.setdefault(layer, skw["slope"])):
        speculative_generate(target, built, torch.tensor([[5, 6, 7, 8, 9]]), 3)
    assert [seen[i] for i in range(2)] == pytest.approx(values)


# ----- the teacher-forced sweep ----------------------------------------------------------------
def _text_seq(target, layer_ids, T=90, seed=0):
    from sharpdraft.training import cache as tc
    ids = torch.randint(3, 250, (1, T), generator=torch.Generator().manual_seed(seed))
    f, p, i = tc.compute_features(target, ids, layer_ids, 4)
    return {"ids": ids[0].int(), "feats": f[0], "top_p": p[0], "top_i": i[0],
            "trained": torch.ones(T, dtype=torch.bool), "layer_ids": layer_ids}


def _session_drafts(target, drafter, ids, a):
    """Greedy drafts at anchor a through the inference path: a session after the prefix
    ids[:a], the last committed token ids[a] at position a."""
    from sharpdraft.target.runtime import TargetRuntime
    rt = TargetRuntime.prepare(target, hidden_layers=drafter.hidden_layers, pack=False)
    rt.start(a + 1)
    with torch.no_grad():
        out = rt.forward(ids[None, :a])
        s = drafter.start(target, ids[None, :a], out.hidden, rt.cache)
        drafts, _ = s.propose(int(ids[a]), a, lambda row: int(row.argmax()))
    return drafts


def _tiny(kind, target):
    from sharpdraft_helpers import tiny_eagle3, tiny_pard
    from test_longspark import tiny_longspark
    return {"dflash": lambda t: tiny_drafter(t, block_size=4),
            "pard": lambda t: tiny_pard(t, num_draft_tokens=3),
            "eagle3": lambda t: tiny_eagle3(t, chain_length=3),
            "longspark": lambda t: tiny_longspark(t, window=8)}[kind](target)


def _seq_with_known_leads(target, drafter):
    """(seq, anchors, leads): a text rewritten so that after anchor a it follows the session's
    own drafts for m_a tokens and the target's top-1 agrees with exactly m_a of them (m_a = 0,
    1, ... across anchors), so the expected lead of every anchor is known by construction."""
    from sharpdraft.training import cache as tc
    layer_ids = [0, 1, 2, 3]
    ids = _text_seq(target, layer_ids)["ids"].long()
    anchors, wants, drafted = [6, 20, 34, 48, 62], [0, 1, 2, 3, 1], {}
    for a, m in zip(anchors, wants):        # in order: each session sees the rewritten prefix
        drafts = _session_drafts(target, drafter, ids, a)
        assert len(drafts) == 3
        ids[a + 1:a + 1 + m] = torch.tensor(drafts[:m])
        drafted[a] = drafts
    f, p, i = tc.compute_features(target, ids[None], layer_ids, 4)
    top = i[0].clone()
    for a, m in zip(anchors, wants):
        for j in range(3):
            top[a + j, 0] = drafted[a][j] if j < m else (drafted[a][j] + 1) % 256
    seq = {"ids": ids.int(), "feats": f[0], "top_p": p[0], "top_i": top, "layer_ids": layer_ids,
           "trained": torch.ones(len(ids), dtype=torch.bool)}
    return seq, torch.tensor(anchors), wants


@pytest.mark.parametrize("kind", ["dflash", "pard", "eagle3", "longspark"])
def test_sweep_leads_match_the_inference_sessions(kind):
    """The parallel teacher-forced leads equal what a session drafts at each anchor (the
    text of `_seq_with_known_leads`)."""
    from sharpdraft.eval import sweep
    target = tiny_target()
    drafter = _tiny(kind, target)
    seq, anchors, wants = _seq_with_known_leads(target, drafter)
    with torch.no_grad():
        leads = sweep.anchor_leads(drafter, target, seq, anchors)
    assert leads.tolist() == wants


@pytest.mark.parametrize("kind", ["dflash", "pard", "eagle3", "longspark"])
def test_sweep_leads_of_a_bfloat16_drafter(kind):
    """A bfloat16 target and drafter (what `--dtype auto` picks where bfloat16 is faster) run the
    teacher-forced sweep on the float16 cached features of a float32 text with known leads:
    leads in [0, drafts], equal to the known ones at most anchors (bfloat16 rounding may flip a
    near tie)."""
    from sharpdraft.eval import sweep
    target = tiny_target()
    drafter = _tiny(kind, target)
    seq, anchors, wants = _seq_with_known_leads(target, drafter)
    with torch.no_grad():
        got = sweep.anchor_leads(drafter.to(torch.bfloat16), target.to(torch.bfloat16), seq,
                                 anchors)
    assert got.dtype == torch.int64 and got.shape == anchors.shape
    assert int(got.min()) >= 0 and int(got.max()) <= 3
    assert sum(int(g == w) for g, w in zip(got.tolist(), wants)) >= 3, (got.tolist(), wants)


def test_bootstrap_interval_covers_the_mean_and_shrinks():
    from sharpdraft.eval import sweep
    x = torch.arange(100.0) % 7
    m, lo, hi = sweep.bootstrap_ci(x)
    assert lo < m < hi and m == pytest.approx(float(x.mean()))
    m4, lo4, hi4 = sweep.bootstrap_ci(x.repeat(16))
    assert (hi4 - lo4) < 0.5 * (hi - lo)


def test_sweep_run_writes_paired_tables(tmp_path):
    from sharpdraft.eval import sweep
    from sharpdraft.training import cache as tc
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=4, train_context=40)
    layer_ids = list(drafter.config.target_layer_ids)
    seqs = [torch.randint(3, 250, (120,), generator=torch.Generator().manual_seed(s)).tolist()
            for s in range(2)]
    c = tc.FeatureCache(tmp_path / "c")
    c.build(target, seqs, [[True] * 119 + [False]] * 2, layer_ids, 4, {}, progress=False)
    rep = sweep.run(target, drafter, c.load(), layer_ids, drafter_name="dflash",
                    edges=[8, 40, 110], per_bucket=6, out=tmp_path / "o")
    rows = {(r["scaling"], r["bucket"][0]): r for r in rep["rows"]}
    assert rows[("frozen", 8)]["delta_vs_frozen"] == 0 and rows[("frozen", 8)]["anchors"] == 12
    # below n_ref = 40 every fixed slope is beta = 1: identical leads, a zero paired difference
    assert rows[("slope 0.4", 8)]["delta_vs_frozen"] == 0
    assert rows[("slope 0.4", 8)]["delta_ci95"] == [0, 0]
    for f in ("sweep.json", "sweep.md", "sweep.png"):
        assert (tmp_path / "o" / f).exists()
    assert "| const e^0.2 |" in (tmp_path / "o" / "sweep.md").read_text()
    # every row keeps its anchors and leads: their mean is the row's tau; the anchors lie in
    # the bucket, in both sequences, and are the same under every scaling
    for r in rep["rows"]:
        assert len(r["leads"]) == len(r["anchors_at"]) == r["anchors"]
        assert sum(r["leads"]) / len(r["leads"]) + 1 == pytest.approx(r["tau_proxy"], abs=1e-4)
        assert all(r["bucket"][0] <= p < r["bucket"][1] for _, p in r["anchors_at"])
        assert {s for s, _ in r["anchors_at"]} == {0, 1}
        assert r["anchors_at"] == rows[("frozen", r["bucket"][0])]["anchors_at"]


def _report(leads_by_scaling, anchors=((0, 10), (0, 20), (1, 15), (1, 30))):
    """A hand-made sweep.json: one bucket [8, 40), the given leads per scaling."""
    return {"settings": {"drafter": "eagle3", "text": "t"},
            "rows": [{"scaling": n, "bucket": [8, 40], "anchors": len(x),
                      "anchors_at": [list(a) for a in anchors], "leads": list(x)}
                     for n, x in leads_by_scaling.items()]}


def test_compare_pairs_checkpoints_anchor_by_anchor():
    """eval.sweep.compare: the paired difference is the mean of the per-anchor differences
    (by hand), the base comes first, and mismatched anchors or missing leads are refused."""
    from sharpdraft.eval import sweep
    base = _report({"frozen": [0, 1, 2, 1], "slope 0.2": [0, 1, 2, 3]})
    other = _report({"frozen": [1, 1, 2, 4], "slope 0.2": [1, 1, 1, 4]})
    rows = sweep.compare(base, {"pskip": other})
    got = {r["scaling"]: r for r in rows}
    assert [r["scaling"] for r in rows] == ["base: frozen", "base: slope 0.2", "pskip: frozen",
                                            "pskip: slope 0.2"]
    assert got["base: slope 0.2"]["delta_vs_base"] == pytest.approx(0.5)    # (0+0+0+2) / 4
    assert got["base: frozen"]["tau_proxy"] == pytest.approx(2.0)      # 1 + mean(0, 1, 2, 1)
    assert got["base: frozen"]["delta_vs_base"] == 0
    assert got["pskip: frozen"]["delta_vs_base"] == pytest.approx(1.0)      # (1+0+0+3) / 4
    assert got["pskip: slope 0.2"]["delta_vs_base"] == pytest.approx(0.75)  # (1+0-1+3) / 4
    lo, hi = got["pskip: frozen"]["delta_ci95"]
    assert 0.0 <= lo <= 1.0 <= hi <= 3.0
    rows = sweep.compare(base, {"pskip": other}, base_scaling="slope 0.2")
    assert {r["scaling"]: r["delta_vs_base"] for r in rows}["pskip: frozen"] == pytest.approx(0.5)
    md = sweep.compare_markdown(rows, {"drafter": "eagle3", "text": "t", "base": "b",
                                       "base_scaling": "slope 0.2"})
    assert "| pskip: frozen | +0.500 [" in md and "| minus base | 8-40 |" in md
    with pytest.raises(ValueError, match="anchors of bucket 8-40 differ"):
        sweep.compare(base, {"x": _report({"frozen": [1, 1, 1, 1]},
                                          anchors=((0, 10), (0, 21), (1, 15), (1, 30)))})
    with pytest.raises(ValueError, match="no scaling 'slope 9'"):
        sweep.compare(base, {"pskip": other}, base_scaling="slope 9")
    old = {"settings": {}, "rows": [{"scaling": "frozen", "bucket": [8, 40], "anchors": 4}]}
    with pytest.raises(ValueError, match="no per-anchor leads"):
        sweep.compare(base, {"old": old})


def test_cli_analyze_compare(tmp_path, capsys):
    """`sharpdraft analyze compare` writes compare.json/md/png from sweep folders (no model)
    and names a folder without sweep.json."""
    from sharpdraft.cli import commands as cli
    for name, leads in (("a", [0, 1, 2, 1]), ("b", [2, 1, 2, 1])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sweep.json").write_text(json.dumps(_report({"frozen": leads})))
    assert cli.main(["analyze", "compare", str(tmp_path / "a"), str(tmp_path / "b"),
                     "--out", str(tmp_path / "c")]) == 0
    rows = json.loads((tmp_path / "c" / "compare.json").read_text())["rows"]
    assert [r["scaling"] for r in rows] == ["base: frozen", "b: frozen"]
    assert rows[1]["delta_vs_base"] == pytest.approx(0.5)
    assert (tmp_path / "c" / "compare.png").exists()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli.main(["analyze", "compare", str(tmp_path / "a"), str(tmp_path / "nope"),
                  "--out", str(tmp_path / "d")])
    assert exc.value.code == 2 and "no sweep.json" in capsys.readouterr().err


def test_long_decode_buckets_every_step_by_output_length(tmp_path):
    """eval.long_decode: one row per (scaling, bucket) whose steps add up to each run's
    verification steps; the text is the same under every scaling (lossless greedy)."""
    from sharpdraft.eval import long_decode
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=4)

    class Tok:
        eos_token_id = None
    prompts = [{"name": "a", "ids": torch.randint(3, 250, (1, 12),
                                                  generator=torch.Generator().manual_seed(1))}]
    rep = long_decode.run(target, Tok(), drafter, prompts, drafter_name="dflash",
                          max_new_tokens=40, bucket=16, out=tmp_path, only=["slope 0.2"])
    assert rep["settings"]["same_text_under_every_scaling"]
    frozen = [r for r in rep["rows"] if r["scaling"] == "frozen"]
    assert [r["bucket"][0] for r in frozen] == [0, 16, 32][:len(frozen)] and len(frozen) >= 2
    res = speculative_generate(target, drafter, prompts[0]["ids"], 40)
    assert sum(r["steps"] for r in frozen) == len(res.accept_lengths)
    tau = sum(r["tau"] * r["steps"] for r in frozen) / len(res.accept_lengths)
    assert abs(tau - res.tau) < 1e-3
    assert "| slope 0.2 |" in (tmp_path / "decode.md").read_text()
    with pytest.raises(ValueError, match="unknown"):
        long_decode.run(target, Tok(), drafter, prompts, drafter_name="dflash",
                        max_new_tokens=4, bucket=16, out=tmp_path, only=["slope 9"])


def test_bootstrap_diff_brackets_the_difference():
    from sharpdraft.eval.long_decode import bootstrap_diff
    x = torch.tensor([3.0, 4.0, 5.0, 4.0] * 10)
    y = torch.tensor([1.0, 2.0, 1.0, 2.0] * 10)
    d, lo, hi = bootstrap_diff(x, y)
    assert d == pytest.approx(2.5) and lo < 2.5 < hi and hi - lo < 1.0


def test_bucket_table_by_hand():
    """One row per scaling in first-seen order, one column per sorted bucket; a missing
    (scaling, bucket) pair is an empty cell and ``skip`` drops a scaling."""
    from sharpdraft.eval.sweep import bucket_table, delta_table

    rows = [{"scaling": "sharp", "bucket": [2048, 4096], "v": 2.5, "delta_vs_frozen": 0.25,
             "delta_ci95": [-0.5, 1.0]},
            {"scaling": "frozen", "bucket": [1024, 2048], "v": 1.0},
            {"scaling": "frozen", "bucket": [2048, 4096], "v": 2.0}]
    assert bucket_table(rows, "s", lambda c: f"{c['v']:.1f}") == [
        "| s | 1024-2048 | 2048-4096 |", "|---|---:|---:|",
        "| sharp |  | 2.5 |", "| frozen | 1.0 | 2.0 |"]
    assert bucket_table(rows, "s", lambda c: "x", skip=("sharp",))[2:] == ["| frozen | x | x |"]
    assert delta_table(rows) == ["", "| scaling - frozen | 1024-2048 | 2048-4096 |",
                                 "|---|---:|---:|", "| sharp |  | +0.250 [-0.50, +1.00] |"]
