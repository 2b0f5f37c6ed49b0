"""sharpdraft.patch_attention: a user's Hugging Face-style module attends through sharp attention,
masks kept (n_i counted from them), and the patch undone."""
import math

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import sharpdraft
from sharpdraft.attention import SharpConfig, visible_mask

from sharpdraft_helpers import tiny_target

pytestmark = pytest.mark.usefixtures("require_ext")


class BlockConfig(PretrainedConfig):
    model_type = "dflash_style_block"

    def __init__(self, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, **kw):
        super().__init__(**kw)
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads


class DFlashStyleAttention(nn.Module):
    """What a user's drafter file does (the shape of z-lab's DFlash attention): block queries
    over [context ; block] keys, non-causal, the function looked up by _attn_implementation."""

    def __init__(self, config):
        super().__init__()
        self.config, self.is_causal, self.layer_idx = config, False, 0
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)

    def heads(self, x, n):
        return x.view(*x.shape[:2], n, self.config.head_dim).transpose(1, 2)

    def forward(self, block, context):
        c = self.config
        q = self.heads(self.q_proj(block), c.num_attention_heads)
        both = torch.cat([context, block], dim=1)
        k = self.heads(self.k_proj(both), c.num_key_value_heads)
        v = self.heads(self.v_proj(both), c.num_key_value_heads)
        fn = ALL_ATTENTION_FUNCTIONS[c._attn_implementation]
        out, _ = fn(self, q, k, v, None, dropout=0.0, scaling=c.head_dim ** -0.5,
                    is_causal=False)
        return out


def reference(module, block, context, slope, n_ref):
    """float64: every block row sees all context + block keys, q scaled by beta(n)."""
    c = module.config
    m = {k: v.double() for k, v in module.state_dict().items()}
    both = torch.cat([context, block], dim=1).double()
    q = module.heads(block.double() @ m["q_proj.weight"].T, c.num_attention_heads)
    k = module.heads(both @ m["k_proj.weight"].T, c.num_key_value_heads)
    v = module.heads(both @ m["v_proj.weight"].T, c.num_key_value_heads)
    rep = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    n = both.shape[1]
    beta = max(1.0, 1 + slope * math.log(n / n_ref))
    p = torch.softmax(beta * q @ k.transpose(-1, -2) / math.sqrt(c.head_dim), dim=-1)
    return (p @ v).transpose(1, 2)


def test_dflash_style_block_attends_through_sharp_attention_and_undo_restores():
    torch.manual_seed(0)
    config = BlockConfig()
    config._attn_implementation = "sdpa"
    module = DFlashStyleAttention(config).eval()
    block, context = torch.randn(1, 6, 32), torch.randn(1, 20, 32)
    with torch.no_grad():
        before = module(block, context)
        patch = sharpdraft.patch_attention(module, SharpConfig(slope=0.5, n_ref=4))
        assert config._attn_implementation == "sharp" and patch.configs == 1
        sharp = module(block, context)
        patch.undo()
        after = module(block, context)
    want = reference(module, block, context, 0.5, 4)          # n = 26 > n_ref: beta > 1
    torch.testing.assert_close(sharp.double(), want, rtol=2e-5, atol=2e-6)
    assert (sharp - before).abs().max() > 1e-3                 # the scaling acted
    torch.testing.assert_close(after, before)
    assert config._attn_implementation == "sdpa" and not hasattr(config, "sharp_config")
    patch.undo()                                               # idempotent


def _prompt(n, seed=3):
    return torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_causal_model_rows_below_n_ref_unchanged_above_scaled():
    """Rows with n_i <= n_ref have beta = 1: their logits equal the unpatched model's; later
    rows differ (n_i counted per row from the causal mask, not the whole sequence)."""
    model = tiny_target()
    ids = _prompt(24)
    with torch.no_grad():
        plain = model(ids).logits
        with sharpdraft.patch_attention(model, SharpConfig(slope=1.0, n_ref=10)):
            sharp = model(ids).logits
        again = model(ids).logits
    torch.testing.assert_close(sharp[:, :10], plain[:, :10], rtol=1e-4, atol=1e-4)
    assert (sharp[:, 12:] - plain[:, 12:]).abs().amax(-1).min() > 1e-3
    torch.testing.assert_close(again, plain)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_padding_keys_do_not_count(impl):
    """A left-padded row gives the logits of the same text unpadded: n_i counts the visible keys
    of the mask (an eager model's additive float mask too), not the padding."""
    model = tiny_target(attn_implementation=impl)
    ids = _prompt(16)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 16, dtype=torch.long)],
                     dim=1)
    pos = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.arange(16)[None]], dim=1)
    with torch.no_grad(), sharpdraft.patch_attention(model, SharpConfig(slope=1.0, n_ref=4)):
        alone = model(ids).logits
        both = model(padded, attention_mask=mask, position_ids=pos).logits[:, 5:]
    torch.testing.assert_close(both, alone, rtol=1e-4, atol=1e-4)


def test_visible_mask_reads_additive_masks_and_refuses_biases():
    low = torch.finfo(torch.float32).min
    m = torch.tensor([[0.0, low, float("-inf"), 0.0]])
    assert visible_mask(m).tolist() == [[True, False, False, True]]
    with pytest.raises(ValueError, match="biases"):
        visible_mask(torch.tensor([[0.0, -1.5]]))


def test_a_module_without_a_config_is_refused():
    with pytest.raises(ValueError, match="model: no submodule"):
        sharpdraft.patch_attention(nn.Linear(2, 2))
