"""Export of the project's drafters to the public layouts: the converted drafter drafts exactly
as the original, what has no public equivalent is refused naming the config field, and the
written folder loads back through the public adapter with the same drafts."""
import pytest
import torch

from sharpdraft.drafters.dflash import DFlashConfig, DFlashDrafter
from sharpdraft.drafters.zlab_dflash import ZLabDFlashDrafter
from sharpdraft.inference.engine import speculative_generate

from sharpdraft_helpers import TARGET_FAMILIES

pytestmark = pytest.mark.usefixtures("require_ext")


def _prompt(n=24, seed=5):
    return torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _draft_rows(drafter, target, ids):
    """float32 draft logits of one propose after the prompt `ids` (1, T)."""
    with torch.no_grad():
        out = target(ids[:, :-1], output_hidden_states=True)
    session = drafter.start(target, ids[:, :-1], out.hidden_states)
    return session.propose(int(ids[0, -1]), ids.shape[1] - 1, lambda r: int(r.argmax()))[1]


def _dflash(target, seed=11, **over):
    torch.manual_seed(seed)
    cfg = DFlashConfig.from_target(target.config, mask_token_id=3, num_layers=2, block_size=4,
                                   num_features=2, **{"qk_norm": True, **over})
    drafter = DFlashDrafter(cfg).eval()
    with torch.no_grad():          # norms away from 1, so that a dropped norm would show
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return drafter


@pytest.mark.parametrize("family", sorted(TARGET_FAMILIES))
def test_dflash_exports_exactly_and_loads_back(tmp_path, family):
    target = TARGET_FAMILIES[family]()
    ours = _dflash(target)
    public = ZLabDFlashDrafter.from_drafter(ours, target)
    ids = _prompt()
    want = _draft_rows(ours, target, ids)
    torch.testing.assert_close(_draft_rows(public, target, ids), want, rtol=1e-5, atol=1e-5)
    public.save(tmp_path / "out")
    loaded = ZLabDFlashDrafter.load(tmp_path / "out", target=target)
    torch.testing.assert_close(_draft_rows(loaded, target, ids), want, rtol=1e-5, atol=1e-5)
    assert loaded.config.train_context == ours.config.train_context
    a = speculative_generate(target, ours, ids, 12)
    b = speculative_generate(target, loaded, ids, 12)
    assert (a.tokens, a.target_forwards) == (b.tokens, b.target_forwards)


def test_dflash_without_the_public_architecture_is_refused():
    target = TARGET_FAMILIES["llama"]()
    with pytest.raises(ValueError, match="^qk_norm: "):
        ZLabDFlashDrafter.from_drafter(_dflash(target, qk_norm=False), target)
    with pytest.raises(ValueError, match="^draft_vocab_size: "):
        ZLabDFlashDrafter.from_drafter(_dflash(target, draft_vocab_size=64), target)
