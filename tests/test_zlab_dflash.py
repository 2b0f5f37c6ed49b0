"""The public z-lab DFlash adapter (drafters/zlab_dflash.py): a tiny random checkpoint written
here straight in the public layout, its draft logits against a float64 forward written from the
published architecture, lossless decoding on Llama and Qwen3 targets, SharpDraft, the other
weight layouts, and malformed checkpoints."""
import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import save_file
from sharpdraft.attention import SharpConfig
from sharpdraft.drafters.config_checks import ConfigKindError
from sharpdraft.drafters.dflash import DFlashDrafter
from sharpdraft.drafters.formats.zlab_dflash import ZLabDFlashConfig, build_target_layer_ids
from sharpdraft.drafters.zlab_dflash import ZLabDFlashDrafter
from sharpdraft.inference.engine import speculative_generate
from sharpdraft_helpers import tiny_drafter, tiny_target, write_public_folder
from transformers import Qwen3Config, Qwen3ForCausalLM

HIDDEN, VOCAB, MASK, BLOCK = 64, 256, 5, 4


# ----- a public checkpoint, written without the adapter ------------------------------------
def public_config(**over) -> dict:
    """A config.json as z-lab publishes them (Qwen3-8B-DFlash-b16's fields), tiny: 2 draft
    layers, 4 query / 2 KV heads of dim 8 (heads * head_dim != hidden_size, as in Qwen3-4B)."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
        "block_size": BLOCK, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
        "head_dim": 8, "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02,
        "intermediate_size": 96, "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 512, "max_window_layers": 2, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "num_target_layers": 4,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 10000.0,
        "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
        "use_sliding_window": False, "vocab_size": VOCAB,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [0, 2]},
    }
    cfg.update(over)
    return cfg


def public_state(cfg: dict, seed: int = 7) -> dict:
    """Random tensors under the public names and shapes (norm weights near 1)."""
    g = torch.Generator().manual_seed(seed)
    H, d, nh, nkv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    n_feat = len(cfg["dflash_config"]["target_layer_ids"])

    def w(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    sd = {"fc.weight": w(H, n_feat * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": w(nh * d, H),
                   p + "self_attn.k_proj.weight": w(nkv * d, H),
                   p + "self_attn.v_proj.weight": w(nkv * d, H),
                   p + "self_attn.o_proj.weight": w(H, nh * d),
                   p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
                   p + "mlp.gate_proj.weight": w(cfg["intermediate_size"], H),
                   p + "mlp.up_proj.weight": w(cfg["intermediate_size"], H),
                   p + "mlp.down_proj.weight": w(H, cfg["intermediate_size"]),
                   p + "input_layernorm.weight": norm(H),
                   p + "post_attention_layernorm.weight": norm(H)})
    return sd


def write_checkpoint(folder, cfg=None, state=None, seed: int = 7):
    cfg = cfg or public_config()
    state = public_state(cfg, seed) if state is None else state
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(folder / "model.safetensors"))
    return folder, cfg, state


def tiny_qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512)).eval()


# ----- the float64 reference, from the published architecture --------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """x (L, heads, d) rotated at positions pos (L,) (rotate-half / NeoX layout)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def reference_logits(cfg, sd, target, feats, last, sharp=None):
    """float64 logits (b - 1, V) of one draft step after context features feats (T, n * H)."""
    sd = {k: v.double() for k, v in sd.items()}
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    B, mask = cfg["block_size"], cfg["dflash_config"]["mask_token_id"]
    E = target.get_input_embeddings().weight.double()
    W = target.get_output_embeddings().weight.double()
    T = feats.shape[0]
    x = E[torch.tensor([last] + [mask] * (B - 1))]
    ctx = _rms(feats.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    qpos = torch.arange(T, T + B)
    kpos = torch.arange(T + B)
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = _rms((h @ sd[p + "self_attn.q_proj.weight"].T).view(B, nh, d),
                 sd[p + "self_attn.q_norm.weight"], eps)
        q = _rope(q, qpos, theta)
        rows = torch.cat([ctx, h])
        k = _rms((rows @ sd[p + "self_attn.k_proj.weight"].T).view(T + B, nkv, d),
                 sd[p + "self_attn.k_norm.weight"], eps)
        k = _rope(k, kpos, theta).repeat_interleave(nh // nkv, dim=1)
        v = (rows @ sd[p + "self_attn.v_proj.weight"].T).view(T + B, nkv, d)
        v = v.repeat_interleave(nh // nkv, dim=1)
        if kind == "sliding_attention":      # causal, window W: keys in (p - W, p]
            win = cfg["sliding_window"]
            visible = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - win)
        else:                                # non-causal over context + block
            visible = torch.ones(B, T + B, dtype=torch.bool)
        n = visible.sum(-1).double()
        beta = torch.ones(B, dtype=torch.float64)
        if sharp is not None and sharp.mode == "fixed_slope":
            beta = (1 + sharp.slope * torch.log(n / sharp.n_ref)).clamp(min=sharp.beta_min)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d) * beta[None, :, None]
        attn = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", attn, v).reshape(B, nh * d)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate = h @ sd[p + "mlp.gate_proj.weight"].T
        x = x + ((gate * torch.sigmoid(gate)) * (h @ sd[p + "mlp.up_proj.weight"].T)) @ \
            sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["norm.weight"], eps)[1:] @ W.T


def adapter_step(drafter, target, ids, position=None):
    """The adapter's logits for one step: a session over ids[:, :position], proposing after
    ids[0, position]."""
    position = ids.shape[1] - 1 if position is None else position
    with torch.no_grad():
        hs = target(ids[:, :position], output_hidden_states=True).hidden_states
    session = drafter.start(target, ids[:, :position], hs)
    _, logits = session.propose(int(ids[0, position]), position, lambda row: int(row.argmax()))
    return logits, hs


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(6, VOCAB, (1, 31), generator=torch.Generator().manual_seed(3))


def _features(cfg, hs):
    return torch.cat([hs[i + 1][0] for i in cfg["dflash_config"]["target_layer_ids"]], -1)


# ----- the forward ---------------------------------------------------------------------------
@pytest.mark.parametrize("layer_types,window", [(["full_attention", "full_attention"], None),
                                                (["full_attention", "sliding_attention"], 6)])
def test_draft_logits_equal_float64_reference(tmp_path, target, prompt, layer_types, window):
    folder, cfg, sd = write_checkpoint(tmp_path / "ck", public_config(
        layer_types=layer_types, sliding_window=window))
    drafter = ZLabDFlashDrafter.load(folder, target=target)
    assert drafter.hidden_layers == [1, 3] and drafter.max_drafts == BLOCK - 1
    logits, hs = adapter_step(drafter, target, prompt)
    ref = reference_logits(cfg, sd, target, _features(cfg, hs), int(prompt[0, -1]))
    assert logits.dtype == torch.float32 and logits.shape == (BLOCK - 1, VOCAB)
    assert ref.abs().max() > 1e-2
    torch.testing.assert_close(logits.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layer_types,window", [(["full_attention", "full_attention"], None),
                                                (["sliding_attention", "full_attention"], 5)])
def test_sharpdraft_changes_logits_only_past_n_ref(tmp_path, target, prompt, layer_types,
                                                   window):
    """30 context positions + a block of 4: n_i = 34 in a full layer (fewer in a windowed one,
    counted from the mask applied). n_ref = 8 sharpens (and matches the reference's beta);
    n_ref = 64 leaves beta = 1 (clamped), i.e. the published drafter's logits."""
    folder, cfg, sd = write_checkpoint(tmp_path / "ck", public_config(
        layer_types=layer_types, sliding_window=window))
    drafter = ZLabDFlashDrafter.load(folder, target=target)
    assert drafter.sharp.mode == "none" and drafter.sharp.n_ref == 2048
    off, hs = adapter_step(drafter, target, prompt)
    drafter.sharp = SharpConfig(mode="fixed_slope", slope=0.5, n_ref=64)
    below, _ = adapter_step(drafter, target, prompt)
    torch.testing.assert_close(below, off, rtol=0, atol=0)
    drafter.sharp = on_sharp = SharpConfig(mode="fixed_slope", slope=0.5, n_ref=8)
    above, _ = adapter_step(drafter, target, prompt)
    assert (above - off).abs().max() > 1e-3
    ref = reference_logits(cfg, sd, target, _features(cfg, hs), int(prompt[0, -1]), on_sharp)
    torch.testing.assert_close(above.double(), ref, rtol=1e-4, atol=1e-5)


def test_cache_grown_by_commits_equals_fresh_session(tmp_path, target, prompt):
    """Context K/V extended at each commit == computed at once from the whole context."""
    folder, _, _ = write_checkpoint(tmp_path / "ck", public_config(
        layer_types=["full_attention", "sliding_attention"], sliding_window=7))
    drafter = ZLabDFlashDrafter.load(folder, target=target)
    with torch.no_grad():
        hs = target(prompt, output_hidden_states=True).hidden_states
    wanted = drafter.hidden_layers
    rows = lambda a, b: {i: hs[i][:, a:b] for i in wanted}
    session = drafter.start(target, prompt[:, :10], rows(0, 10))
    pos = 10
    for step in (3, 1, 4, 2, 4, 4, 2):       # verification rows [last] + drafts; some accepted
        session.commit(list(range(step)), rows(pos, pos + BLOCK))
        pos += step
    assert pos == 30 and session.length == 30
    draw = lambda row: int(row.argmax())
    grown = session.propose(int(prompt[0, 30]), 30, draw)[1]
    fresh = drafter.start(target, prompt[:, :30], rows(0, 30)).propose(int(prompt[0, 30]), 30,
                                                                      draw)[1]
    torch.testing.assert_close(grown, fresh, rtol=1e-5, atol=1e-6)
    assert session.state_bytes() == 2 * 2 * (2 * 30 * 8) * 4   # layers x k,v x Hk T d x fp32
    with pytest.raises(ValueError, match="position"):
        session.propose(1, 29, draw)


# ----- lossless decoding -------------------------------------------------------------------
def _greedy(target, ids, n):
    seq = ids[0].tolist()
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[ids.shape[1]:]


@pytest.mark.parametrize("make_target", [tiny_target, tiny_qwen3], ids=["llama", "qwen3"])
def test_lossless_greedy(tmp_path, make_target, prompt):
    tgt = make_target()
    folder, _, _ = write_checkpoint(tmp_path / "ck", public_config(
        layer_types=["full_attention", "sliding_attention"], sliding_window=6))
    for sharp in (None, SharpConfig(mode="fixed_slope", slope=0.5, n_ref=8)):
        drafter = ZLabDFlashDrafter.load(folder, target=tgt, sharp=sharp)
        res = speculative_generate(tgt, drafter, prompt[:, :12], 16)
        assert res.tokens == _greedy(tgt, prompt[:, :12], 16)


def test_lossless_when_every_draft_is_accepted(tmp_path, prompt):
    """A target whose LM head is zero always picks token 0, so does the drafter (same head):
    every block is accepted whole and the context K/V grow by b per step."""
    tgt = tiny_target()
    with torch.no_grad():
        tgt.get_output_embeddings().weight.zero_()
    folder, _, _ = write_checkpoint(tmp_path / "ck")
    drafter = ZLabDFlashDrafter.load(folder, target=tgt)
    res = speculative_generate(tgt, drafter, prompt[:, :9], 17)
    assert res.tokens == [0] * 17
    assert max(res.accept_lengths) == BLOCK


# ----- config.json and weight layouts ------------------------------------------------------
def test_config_fields_and_defaults(tmp_path, target, prompt):
    cfg = public_config(num_hidden_layers=2, num_target_layers=30)
    del cfg["dflash_config"]["target_layer_ids"]
    c = ZLabDFlashConfig.from_public(cfg)
    assert c.target_layer_ids == build_target_layer_ids(30, 2) == [1, 27]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]   # Qwen3-8B-DFlash-b16's
    assert build_target_layer_ids(36, 1) == [18]
    assert c.train_context == 2048 and c.rope_parameters["rope_theta"] == 10000.0
    c = ZLabDFlashConfig.from_public(public_config(train_context=4096))
    assert c.train_context == 4096
    # newer checkpoints: block_size inside dflash_config; rope_scaling mapped like Qwen3Config
    cfg = public_config(rope_scaling={"type": "linear", "factor": 2.0})
    del cfg["block_size"]
    cfg["dflash_config"]["block_size"] = 8
    c = ZLabDFlashConfig.from_public(cfg)
    assert c.block_size == 8 and c.rope_parameters["rope_type"] == "linear"
    assert ZLabDFlashConfig.from_public(c.to_public()) == c
    # layer_types from use_sliding_window / max_window_layers when absent
    cfg = public_config(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    del cfg["layer_types"]
    c = ZLabDFlashConfig.from_public(cfg)
    assert c.layer_types == ["full_attention", "sliding_attention"]
    assert c.layer_attention(0) == (False, None) and c.layer_attention(1) == (True, 16)


def test_save_round_trip_and_other_layouts(tmp_path, target, prompt):
    folder, cfg, sd = write_checkpoint(tmp_path / "ck")
    drafter = ZLabDFlashDrafter.load(folder, target=target)
    want, _ = adapter_step(drafter, target, prompt)
    drafter.save(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["auto_map"] == cfg["auto_map"]
    assert saved["dflash_config"] == cfg["dflash_config"]
    again = ZLabDFlashDrafter.load(tmp_path / "saved", target=target)
    assert again.config == drafter.config
    assert set(again.state_dict()) == set(sd)
    shard = write_public_folder(tmp_path / "sharded", cfg, sd, "sharded")   # with its index
    binf = write_public_folder(tmp_path / "bin", cfg, sd, "bin")   # read with weights_only
    for other in (tmp_path / "saved", shard, binf):
        got, _ = adapter_step(ZLabDFlashDrafter.load(other, target=target), target, prompt)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # bfloat16 weights load in bfloat16
    write_checkpoint(tmp_path / "bf16", cfg, {k: v.bfloat16() for k, v in sd.items()})
    assert ZLabDFlashDrafter.load(tmp_path / "bf16").fc.weight.dtype == torch.bfloat16
    # a drafter cast as a whole (load_drafter casts to the target's dtype) keeps float32 RoPE
    half = ZLabDFlashDrafter.load(folder).to(torch.bfloat16)
    got, _ = adapter_step(half, tiny_target().to(torch.bfloat16), prompt)  # = target, in bf16
    assert half.rotary_emb.inv_freq.dtype == torch.float32
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    # overrides (e.g. a shorter block at inference)
    short = ZLabDFlashDrafter.load(folder, overrides={"block_size": 3})
    assert short.max_drafts == 2


def test_kinds_tell_each_other_apart(tmp_path, target):
    folder, _, _ = write_checkpoint(tmp_path / "ck")
    with pytest.raises(ConfigKindError):
        DFlashDrafter.read_config(folder)
    tiny_drafter(target).save(tmp_path / "own")
    with pytest.raises(ConfigKindError, match="architectures"):
        ZLabDFlashDrafter.read_config(tmp_path / "own")


# ----- malformed checkpoints ---------------------------------------------------------------
def test_misshapen_tensor(tmp_path, target):
    cfg = public_config()
    sd = public_state(cfg)
    sd["layers.1.mlp.up_proj.weight"] = torch.zeros(95, HIDDEN)
    folder, _, _ = write_checkpoint(tmp_path / "ck", cfg, sd)
    with pytest.raises(ValueError, match=r"model\.safetensors does not match its config\.json: "
                                         r"layers\.1\.mlp\.up_proj\.weight has shape \(95, 64\) "
                                         r"in the file, the config implies \(96, 64\)"):
        ZLabDFlashDrafter.load(folder, target=target)


def test_missing_and_unexpected_tensors(tmp_path, target):
    cfg = public_config()
    sd = public_state(cfg)
    del sd["layers.0.self_attn.k_norm.weight"]
    folder, _, _ = write_checkpoint(tmp_path / "missing", cfg, sd)
    with pytest.raises(ValueError, match=r"model\.safetensors does not match its config\.json: "
                                         r"missing tensor\(s\) layers\.0\.self_attn\.k_norm"
                                         r"\.weight"):
        ZLabDFlashDrafter.load(folder, target=target)
    sd = dict(public_state(cfg), **{"lm_head.weight": torch.zeros(VOCAB, HIDDEN)})
    folder, _, _ = write_checkpoint(tmp_path / "extra", cfg, sd)
    with pytest.raises(ValueError, match=r"model\.safetensors does not match its config\.json: "
                                         r"unexpected tensor\(s\) lm_head\.weight .*; an own "
                                         r"embedding"):
        ZLabDFlashDrafter.load(folder, target=target)


def test_target_mismatches_name_the_field(tmp_path, target):
    cfg = public_config(hidden_size=32, intermediate_size=48)
    folder, _, _ = write_checkpoint(tmp_path / "h32", cfg)
    ZLabDFlashDrafter.load(folder)                      # a valid checkpoint on its own
    with pytest.raises(ValueError, match=r"config\.json does not fit the target.*hidden_size "
                                         r"is 32, the target's hidden_size is 64"):
        ZLabDFlashDrafter.load(folder, target=target)
    cfg = public_config(num_target_layers=6)
    cfg["dflash_config"]["target_layer_ids"] = [0, 5]
    folder, _, _ = write_checkpoint(tmp_path / "layers", cfg)
    with pytest.raises(ValueError, match=r"config\.json.*target_layer_ids \[0, 5\] name layer"
                                         r".*num_target_layers is 6"):
        ZLabDFlashDrafter.load(folder, target=target)
    folder, _, _ = write_checkpoint(tmp_path / "vocab", public_config(
        vocab_size=1000, dflash_config={"mask_token_id": 700, "target_layer_ids": [0, 2]}))
    with pytest.raises(ValueError, match=r"config\.json.*mask_token_id \(dflash_config\) is 700"):
        ZLabDFlashDrafter.load(folder, target=target)


@pytest.mark.parametrize("change,field", [
    (lambda c: c["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id"),
    (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
    (lambda c: c.update(hidden_size="64"), "hidden_size must be an integer"),
    (lambda c: c.update(block_size=1), "block_size must be an integer >= 2"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
    (lambda c: c.update(layer_types=["full_attention", "sliding_attention"]), "sliding_window"),
    (lambda c: c["dflash_config"].update(target_layer_ids="0,2"), "target_layer_ids"),
    (lambda c: c.update(draft_threshold=1.5),
     r"draft_threshold must be a number in \[0, 1\], got 1.5"),
])
def test_invalid_config_fields(tmp_path, change, field):
    cfg = public_config()
    change(cfg)
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*" + field.replace(".", r"\.")) as err:
        ZLabDFlashDrafter.load(folder)
    assert "\n" not in str(err.value)


def test_mask_embedding_file_is_refused(tmp_path):
    folder, _, _ = write_checkpoint(tmp_path / "ck")
    torch.save(torch.zeros(HIDDEN), folder / "mask_embedding.pt")
    with pytest.raises(ValueError, match="mask_embedding.pt"):
        ZLabDFlashDrafter.load(folder)


def test_overrides_are_validated(tmp_path):
    folder, _, _ = write_checkpoint(tmp_path / "ck")
    with pytest.raises(ValueError, match="not field"):
        ZLabDFlashDrafter.load(folder, overrides={"blocksize": 3})
    with pytest.raises(ValueError, match="block_size"):
        ZLabDFlashDrafter.load(folder, overrides={"block_size": 1})
    assert dataclasses.replace(ZLabDFlashDrafter.read_config(folder), block_size=6).block_size == 6


def test_untrained_hook_and_sharp_config(tmp_path, target):
    """What registration uses: `untrained(target, tokenizer, layers, block_size, overrides)`
    and `loading.sharp_config` (n_ref = config.train_context, calibrated sharp_slopes)."""
    from sharpdraft.drafters.loading import sharp_config
    from sharpdraft.drafters.zlab_dflash import untrained
    d = untrained(target, None, 2, 4, {"train_context_length": 512})
    assert d.config.target_layer_ids == build_target_layer_ids(4, 2)
    assert d.config.mask_token_id == VOCAB - 1 and d.max_drafts == 3
    assert sharp_config(d).n_ref == 512 and sharp_config(d, False).mode == "none"
    d.save(tmp_path / "u")
    cfg = json.loads((tmp_path / "u" / "config.json").read_text())
    cfg["sharp_slopes"] = [0.1, 0.3]                     # as `analyze calibrate` writes them
    (tmp_path / "u" / "config.json").write_text(json.dumps(cfg))
    back = ZLabDFlashDrafter.load(tmp_path / "u", target=target)
    assert sharp_config(back).layer_slopes == [0.1, 0.3] and back.config.train_context == 512
