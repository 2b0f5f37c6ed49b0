"""The "sharp" attention implementation inside a transformers model."""
import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from sharpdraft.attention import SharpConfig, register, set_sharp_config
from sharpdraft.target.kv_cache import CACHE_KWARG
from sharpdraft_helpers import tiny_target


@pytest.fixture(scope="module")
def pair():
    register()
    sdpa = tiny_target(attn_implementation="sdpa")
    sharp = LlamaForCausalLM(sdpa.config.__class__(**{**sdpa.config.to_dict(),
                                                     "attn_implementation": "sharp"})).eval()
    sharp.load_state_dict(sdpa.state_dict())
    assert sharp.config._attn_implementation == "sharp"
    return sdpa, sharp


def run(model, ids, mask=None):
    cache = DynamicCache()
    with torch.no_grad():
        a = model(ids[:, :-3], attention_mask=None if mask is None else mask[:, :-3],
                  **{CACHE_KWARG: cache})
        b = model(ids[:, -3:], attention_mask=mask, **{CACHE_KWARG: cache})  # cached, Lq < Lk
    return torch.cat([a.logits, b.logits], 1)


def test_mode_none_equals_sdpa_prefill_and_cached(pair):
    sdpa, sharp = pair
    set_sharp_config(sharp, SharpConfig(mode="none"))
    ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(run(sharp, ids), run(sdpa, ids), rtol=1e-4, atol=1e-4)
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[1, :6] = 0                                                # left padding
    got, want = run(sharp, ids, mask), run(sdpa, ids, mask)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1, 6:], want[1, 6:], rtol=1e-4, atol=1e-4)


def test_fixed_slope_is_identity_below_n_ref_and_sharpens_above(pair):
    sdpa, sharp = pair
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    set_sharp_config(sharp, SharpConfig(mode="fixed_slope", slope=0.5, n_ref=64))
    torch.testing.assert_close(run(sharp, ids), run(sdpa, ids), rtol=1e-4, atol=1e-4)
    set_sharp_config(sharp, SharpConfig(mode="fixed_slope", slope=0.5, n_ref=8))
    diff = (run(sharp, ids) - run(sdpa, ids)).abs().amax(-1)[0]
    assert diff[:7].max() < 1e-4        # rows with n_i <= 8 keep beta = 1
    assert diff[8:].min() > 1e-4        # longer rows are scaled


def test_bad_config_and_mask_are_rejected(pair):
    with pytest.raises(ValueError, match="mode"):
        SharpConfig(mode="sharpest")
    with pytest.raises(ValueError, match="n_ref"):
        SharpConfig(n_ref=0)
    from sharpdraft.attention import sharp_attention_forward
    sdpa, _ = pair
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(ValueError, match="attention_mask adds biases"):   # ALiBi-like
        sharp_attention_forward(sdpa.model.layers[0].self_attn, q, q[:, :2], q[:, :2],
                                torch.full((1, 1, 3, 2), -1.5))
