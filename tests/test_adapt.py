"""Online adaptation (eval.adapt): lossless, updates only what it should, learns from the
target's verified distributions, and the Table-1 runner reports every method."""
import json

import pytest
import torch

from sharpdraft.eval import adapt
from sharpdraft.inference.engine import autoregressive_generate, speculative_generate
from sharpdraft.target.runtime import TargetRuntime
from sharpdraft_helpers import tiny_drafter, tiny_eagle3, tiny_target

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def prompt(seed=0, n=30):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_adapted_decoding_is_lossless_and_updates_the_right_weights(target, mode):
    d = tiny_drafter(target)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    a = adapt.OnlineAdapter(d, target, mode, rank=4, every=2, lr=1e-2)
    res = speculative_generate(target, a, prompt(), 40)
    assert res.tokens == autoregressive_generate(target, prompt(), 40).tokens
    assert len(a.update_ms) >= 5
    after = {k.replace(".base_layer", ""): v for k, v in d.state_dict().items()}  # peft's names
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    if mode == "full":
        assert a.trainable_parameters == sum(p.numel() for p in before.values()
                                             if p.is_floating_point())
        assert "fc.weight" in changed and "layers.1.mlp.down_proj.weight" in changed
    else:
        lora = {k for k in after if "lora_" in k}
        assert a.trainable_parameters == sum(after[k].numel() for k in lora) > 0
        assert not changed                    # the base weights are untouched
        assert any(not torch.equal(after[k], torch.zeros_like(after[k])) for k in lora
                   if "lora_B" in k)          # B starts at 0 and has moved


def test_verified_distributions_are_the_targets(target):
    """The distributions an update trains on equal the target's own next-token distributions
    over the committed prefix (recomputed here with one plain forward)."""
    d = tiny_drafter(target)
    a = adapt.OnlineAdapter(d, target, "full", every=1000)
    ids = prompt(1)
    rt = TargetRuntime.prepare(target, hidden_layers=a.hidden_layers, pack=False)
    rt.start(64)
    out = rt.forward(ids, last_only=True)
    s = a.start(target, ids, out.hidden, rt.cache)
    last = int(out.logits[-1].argmax())
    for _ in range(4):
        pos = rt.length
        drafts, _ = s.propose(last, pos, lambda row: int(row.argmax()))
        out = rt.forward(torch.tensor([[last] + drafts]))
        accepted = drafts[:1] + [int(out.logits[1].argmax())]      # one draft accepted
        rt.crop(pos + 2)
        s.commit(accepted, out.hidden)
        last = accepted[-1]
    committed = torch.tensor([s.ids + [last]])
    with torch.no_grad():
        probs = torch.softmax(target(committed).logits[0].float(), -1)
    assert len(s.dists) == 8
    for q, (p, i) in s.dists.items():
        want = probs[q - 1].topk(a.topk)
        torch.testing.assert_close(i, want.indices)
        torch.testing.assert_close(p, want.values, rtol=1e-4, atol=1e-5)


def test_updates_lower_the_loss_on_what_they_saw(target):
    """Repeated updates on one decoding's verified blocks lower the drafter's cross-entropy
    against those distributions (the update optimises the loss it claims to)."""
    d = tiny_drafter(target)
    a = adapt.OnlineAdapter(d, target, "full", every=10 ** 6, lr=3e-3)
    captured = {}
    start = a.start

    def keep(*args, **kw):
        captured["s"] = start(*args, **kw)
        return captured["s"]
    a.start = keep
    speculative_generate(target, a, prompt(2), 24)
    s = captured["s"]
    feats = torch.cat(s.feats)
    losses = []
    for _ in range(6):
        a.update(feats, s.ids, s.pending, s.dists)
        with torch.no_grad():
            losses.append(_loss(a, feats, s))
    assert losses[-1] < losses[0] - 0.05


def _loss(a, feats, s):
    from sharpdraft.training.losses import distill_loss, position_weights
    d = a.drafter
    b = d.config.block_size
    anchors = torch.tensor(s.pending)
    block = torch.zeros(len(anchors), b, dtype=torch.long)
    block[:, 0] = torch.tensor([s.ids[x] for x in s.pending])
    logits = d.block_logits(a.target, feats, block, anchors)[:, 1:]
    top_p = torch.zeros(len(anchors), b - 1, a.topk)
    top_i = torch.full((len(anchors), b - 1, a.topk), -1, dtype=torch.long)
    valid = torch.zeros(len(anchors), b - 1, dtype=torch.bool)
    for r, x in enumerate(s.pending):
        for j in range(1, b):
            if x + j in s.dists:
                top_p[r, j - 1], top_i[r, j - 1] = s.dists[x + j]
                valid[r, j - 1] = True
    return float(distill_loss(logits, top_p, top_i, position_weights(b, a.gamma), valid)[0])


def test_bad_arguments_are_named(target):
    with pytest.raises(TypeError, match="DFlashDrafter"):
        adapt.OnlineAdapter(tiny_eagle3(target), target)
    with pytest.raises(ValueError, match="mode"):
        adapt.OnlineAdapter(tiny_drafter(target), target, "qlora")
    with pytest.raises(ValueError, match="every"):
        adapt.OnlineAdapter(tiny_drafter(target), target, every=0)


def test_peak_rss_sees_an_allocation():
    """64 MiB of fresh anonymous pages (an mmap, so no freed heap memory that is already resident
    can serve them), every page touched and held for several sampling intervals."""
    import mmap
    import time

    size = 64 * 2**20
    with adapt.PeakRSS() as mem:
        buf = mmap.mmap(-1, size)
        for off in range(0, size, mmap.PAGESIZE):
            buf[off] = 1
        time.sleep(0.05)
        buf.close()
    assert mem.peak >= 60 * 2**20


def test_run_reports_every_method(target, tmp_path):
    class Tok:
        eos_token_id = None
    rep = adapt.run(target, Tok(), tiny_drafter(target), [{"name": "p", "ids": prompt(3)}],
                    max_new_tokens=16, out=tmp_path, every=2, lora_ranks=(4,))
    assert list(rep["summary"]) == ["frozen", "sharpdraft", "full", "lora-r4"]
    assert all(s["lossless"] for s in rep["summary"].values())
    assert rep["summary"]["frozen"]["trainable_parameters"] == 0
    assert 0 < rep["summary"]["lora-r4"]["trainable_parameters"] < \
        rep["summary"]["full"]["trainable_parameters"]
    assert rep["summary"]["full"]["ms_per_update"] > 0
    saved = json.loads((tmp_path / "adapt.json").read_text())
    assert saved["summary"] == rep["summary"]
    assert "| lora-r4 |" in (tmp_path / "adapt.md").read_text()
    assert (tmp_path / "adapt.png").stat().st_size > 0
