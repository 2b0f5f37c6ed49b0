"""The public PARD adapter (drafters/amd_pard.py): tiny random checkpoints written here straight in
the published layout of each family (Llama, Qwen2, Qwen3; tied and untied; safetensors, shards
with an index, pytorch_model.bin), their draft logits against a float64 forward written from the
published architectures, lossless greedy decoding and sampling, the conversion of the project's
own PARD drafter, the save / load round trip, kind detection and malformed checkpoints."""
import json
import math

import pytest
import torch
from sharpdraft.attention import SharpConfig
from sharpdraft.drafters import registry
from sharpdraft.drafters.amd_pard import AMDPARDDrafter
from sharpdraft.drafters.config_checks import ConfigKindError
from sharpdraft.drafters.formats.amd_pard import AMDPARDConfig
from sharpdraft.drafters.loading import detect_kind, load_drafter
from sharpdraft.drafters.pard import PARDDrafter
from sharpdraft.inference.engine import speculative_generate
from sharpdraft_helpers import TARGET_FAMILIES, tiny_pard, tiny_target, write_public_folder
from test_engine import assert_second_token_follows_target, hf_greedy

VOCAB, PARD, K = 256, 250, 4
FAMILIES = ("llama", "qwen2", "qwen3")


# ----- a public checkpoint, written without the adapter ------------------------------------
def public_config(family: str, tied: bool = True, **over) -> dict:
    """A config.json as transformers saves the published PARD drafters (PARD-Llama-3.2-1B's,
    PARD-Qwen2.5-0.5B's, PARD-Qwen3-0.6B's fields), tiny: 2 layers, hidden 48, 4 query / 2 KV
    heads; Llama with Llama 3's rope scaling, Qwen3 with head_dim 16 (heads * head_dim !=
    hidden_size, as in Qwen3-0.6B)."""
    cfg = {"hidden_size": 48, "intermediate_size": 80, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": VOCAB,
           "max_position_embeddings": 512, "hidden_act": "silu", "initializer_range": 0.02,
           "use_cache": True, "attention_dropout": 0.0, "tie_word_embeddings": tied,
           "torch_dtype": "float32", "transformers_version": "4.51.3", "bos_token_id": 1,
           "eos_token_id": 2, "pard_token": PARD, "spd_type": "pard"}
    if family == "llama":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
                   mlp_bias=False, head_dim=12, pretraining_tp=1, rms_norm_eps=1e-5,
                   rope_theta=500000.0,
                   rope_scaling={"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64, "rope_type": "llama3"})
    elif family == "qwen2":
        cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rms_norm_eps=1e-6,
                   rope_theta=1000000.0, rope_scaling=None, sliding_window=32768,
                   use_sliding_window=False, max_window_layers=21)
    else:
        cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
                   head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
                   sliding_window=None, use_sliding_window=False, max_window_layers=28)
    cfg.update(over)
    return cfg


def _geometry(cfg):
    H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return H, nh, nkv, cfg.get("head_dim") or H // nh


def public_state(cfg: dict, seed: int = 7) -> dict:
    """Random tensors under the published names and shapes (norm weights near 1, Qwen2's q/k/v
    biases and Qwen3's q/k norms where the family has them; no lm_head.weight when tied)."""
    g = torch.Generator().manual_seed(seed)
    H, nh, nkv, d = _geometry(cfg)
    V, inter = cfg["vocab_size"], cfg["intermediate_size"]

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    sd = {"model.embed_tokens.weight": torch.randn(V, H, generator=g),
          "model.norm.weight": norm(H)}
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = w(V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": w(nh * d, H),
                   p + "self_attn.k_proj.weight": w(nkv * d, H),
                   p + "self_attn.v_proj.weight": w(nkv * d, H),
                   p + "self_attn.o_proj.weight": w(H, nh * d),
                   p + "mlp.gate_proj.weight": w(inter, H), p + "mlp.up_proj.weight": w(inter, H),
                   p + "mlp.down_proj.weight": w(H, inter),
                   p + "input_layernorm.weight": norm(H),
                   p + "post_attention_layernorm.weight": norm(H)})
        if cfg["model_type"] == "qwen2":
            sd.update({p + "self_attn.q_proj.bias": 0.5 * torch.randn(nh * d, generator=g),
                       p + "self_attn.k_proj.bias": 0.5 * torch.randn(nkv * d, generator=g),
                       p + "self_attn.v_proj.bias": 0.5 * torch.randn(nkv * d, generator=g)})
        if cfg["model_type"] == "qwen3":
            sd.update({p + "self_attn.q_norm.weight": norm(d),
                       p + "self_attn.k_norm.weight": norm(d)})
    return sd


def write_checkpoint(folder, cfg, state=None, layout: str = "safetensors", seed: int = 7):
    """Write config.json and the weights as model.safetensors, two shards with an index, or
    pytorch_model.bin."""
    state = public_state(cfg, seed) if state is None else state
    write_public_folder(folder, cfg, state, layout)
    return folder, cfg, state


# ----- the float64 reference, from the published architectures --------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _inv_freq(cfg, d):
    """RoPE inverse frequencies; Llama 3's rope scaling (rope_type "llama3": wavelengths above
    original / low_freq_factor divided by factor, below original / high_freq_factor kept, a
    linear blend between)."""
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    sc = cfg.get("rope_scaling")
    if sc and sc.get("rope_type") == "llama3":
        lo, hi, old = sc["low_freq_factor"], sc["high_freq_factor"], \
            sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        blend = (old / wavelen - lo) / (hi - lo)
        mixed = (1 - blend) * inv / sc["factor"] + blend * inv
        inv = torch.where(wavelen > old / lo, inv / sc["factor"],
                          torch.where(wavelen < old / hi, inv, mixed))
    return inv


def _rope(x, pos, inv):
    """x (L, heads, d) rotated at positions pos (L,) (rotate-half layout)."""
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    d = x.shape[-1]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def reference_logits(cfg, sd, ids, k=K, sharp=None):
    """float64 logits (k, V) of one PARD step over the committed tokens `ids` (the last one
    included): rows ids + [pard_token] * (k - 1) at positions 0 .. L - 1, plain causal
    attention (SharpDraft's beta = 1 + slope ln(n / n_ref), clamped at beta_min, when `sharp`
    is fixed_slope), the last k rows."""
    sd = {n: t.double() for n, t in sd.items()}
    _, nh, nkv, d = _geometry(cfg)
    eps = cfg["rms_norm_eps"]
    rows = torch.tensor(list(ids) + [cfg["pard_token"]] * (k - 1))
    L = rows.numel()
    pos = torch.arange(L)
    inv = _inv_freq(cfg, d)
    x = sd["model.embed_tokens.weight"][rows]

    def lin(h, name):
        out = h @ sd[name + ".weight"].T
        return out + sd[name + ".bias"] if name + ".bias" in sd else out

    visible = pos[None, :] <= pos[:, None]
    n = visible.sum(-1).double()
    beta = torch.ones(L, dtype=torch.float64)
    if sharp is not None and sharp.mode == "fixed_slope":
        beta = (1 + sharp.slope * torch.log(n / sharp.n_ref)).clamp(min=sharp.beta_min)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = lin(h, p + "self_attn.q_proj").view(L, nh, d)
        kk = lin(h, p + "self_attn.k_proj").view(L, nkv, d)
        v = lin(h, p + "self_attn.v_proj").view(L, nkv, d)
        if cfg["model_type"] == "qwen3":
            q = _rms(q, sd[p + "self_attn.q_norm.weight"], eps)
            kk = _rms(kk, sd[p + "self_attn.k_norm.weight"], eps)
        q, kk = _rope(q, pos, inv), _rope(kk, pos, inv)
        kk, v = kk.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d) * beta[None, :, None]
        attn = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
        x = x + lin(torch.einsum("hqk,khd->qhd", attn, v).reshape(L, nh * d),
                    p + "self_attn.o_proj")
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate = lin(h, p + "mlp.gate_proj")
        x = x + lin(gate * torch.sigmoid(gate) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return (_rms(x, sd["model.norm.weight"], eps) @ head.T)[-k:]


def argmax(row):
    return int(row.argmax())


@pytest.fixture(scope="module")
def targets():
    return {name: make() for name, make in TARGET_FAMILIES.items()}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, PARD, (40,), generator=torch.Generator().manual_seed(3)).tolist()


# ----- the forward ---------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_draft_logits_equal_float64_reference(tmp_path, targets, ids, family, tied):
    """Step 1 after a 20-token prompt, then (after a commit of 3 tokens, the mask rows rolled
    back) step 2, each against the reference forward from scratch over the committed tokens."""
    folder, cfg, sd = write_checkpoint(tmp_path / "ck", public_config(family, tied))
    drafter = AMDPARDDrafter.load(folder, target=targets[family],
                                  overrides={"num_draft_tokens": K})
    assert drafter.max_drafts == K and drafter.config.tie_word_embeddings is tied
    assert (drafter.lm_head.weight is drafter.model.embed_tokens.weight) is tied
    target = targets[family]
    session = drafter.start(target, torch.tensor([ids[:20]]))
    drafts, logits = session.propose(ids[20], 20, argmax)
    ref = reference_logits(cfg, sd, ids[:21])
    assert logits.dtype == torch.float32 and logits.shape == (K, VOCAB)
    assert ref.std() > 0.5
    torch.testing.assert_close(logits.double(), ref, rtol=1e-4, atol=1e-4)
    assert drafts == ref.argmax(-1).tolist()
    assert session.cache.get_seq_length() == 21                     # mask rows rolled back
    session.commit(ids[21:24])
    _, logits = session.propose(ids[23], 23, argmax)
    torch.testing.assert_close(logits.double(), reference_logits(cfg, sd, ids[:24]), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_sharpdraft_changes_logits_only_past_n_ref(tmp_path, targets, ids, family):
    """30 committed tokens + 3 masks: rows see n_i = 1 .. 33 keys. n_ref = 64 leaves every beta
    at 1 (clamped): the published drafter; n_ref = 8 sharpens the rows with n_i > 8, as the
    reference's beta does."""
    folder, cfg, sd = write_checkpoint(tmp_path / "ck", public_config(family))
    target = targets[family]
    drafter = AMDPARDDrafter.load(folder, overrides={"num_draft_tokens": K})
    assert drafter.sharp.mode == "none" and drafter.sharp.n_ref == 2048

    def step(d):
        return d.start(target, torch.tensor([ids[:29]])).propose(ids[29], 29, argmax)[1]

    off = step(drafter)
    drafter.sharp = SharpConfig(mode="fixed_slope", slope=0.5, n_ref=64)
    torch.testing.assert_close(step(drafter), off, rtol=0, atol=0)
    drafter.sharp = on = SharpConfig(mode="fixed_slope", slope=0.5, n_ref=8)
    above = step(drafter)
    assert (above - off).abs().max() > 1e-3
    torch.testing.assert_close(above.double(), reference_logits(cfg, sd, ids[:30], sharp=on),
                               rtol=1e-4, atol=1e-4)


def test_weight_layouts_agree(tmp_path, targets, ids):
    """model.safetensors, shards with an index and pytorch_model.bin hold the same drafter."""
    cfg = public_config("qwen2", tied=False)
    state = public_state(cfg)
    got = []
    for layout in ("safetensors", "sharded", "bin"):
        folder, _, _ = write_checkpoint(tmp_path / layout, cfg, state, layout)
        d = AMDPARDDrafter.load(folder, target=targets["qwen2"])
        got.append(d.start(targets["qwen2"], torch.tensor([ids[:12]])).propose(ids[12], 12,
                                                                                argmax)[1])
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(got[1], got[0], rtol=0, atol=0)
    torch.testing.assert_close(got[2], got[0], rtol=0, atol=0)
    torch.testing.assert_close(got[0].double(), reference_logits(cfg, state, ids[:13],
                                                                 k=8), rtol=1e-4, atol=1e-4)


# ----- lossless decoding -------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_greedy(tmp_path, targets, family):
    """A random PARD checkpoint and one started from the target (the registry's untrained hook
    with every target layer: its first draft is the target's own next token, so each step
    accepts at least one draft), SharpDraft off and on: transformers' own greedy tokens."""
    target = targets[family]
    folder, _, _ = write_checkpoint(tmp_path / "ck", public_config(family))
    prompt = torch.randint(3, PARD, (1, 14), generator=torch.Generator().manual_seed(1))
    want = hf_greedy(target, prompt, 20)
    early_exit = registry.build_untrained("amd-pard", target, None, layers=4, block_size=5)
    for sharp in (None, SharpConfig(mode="fixed_slope", slope=0.5, n_ref=8)):
        drafter = AMDPARDDrafter.load(folder, target=target, sharp=sharp)
        res = speculative_generate(target, drafter, prompt, 20)
        assert res.tokens == want
        assert all(n == 8 for n in res.draft_lengths)                 # K = 8 by default
        early_exit.sharp = sharp or SharpConfig(mode="none")
        res = speculative_generate(target, early_exit, prompt, 20)
        assert res.tokens == want
        if sharp is None:                                           # the target's own layers
            assert min(res.accept_lengths[:-1]) >= 2, res.accept_lengths
    drafter.context_window = 6                      # inherited from PARD: still lossless
    assert speculative_generate(target, drafter, prompt, 20).tokens == want


def test_lossless_when_every_draft_is_accepted(tmp_path):
    """Target and drafter LM heads zero: both always pick token 0, every block of K drafts is
    accepted whole and the drafter's cache grows by K + 1 per step."""
    target = tiny_target()
    with torch.no_grad():
        target.get_output_embeddings().weight.zero_()
    cfg = public_config("llama", tied=False)
    state = public_state(cfg)
    state["lm_head.weight"].zero_()
    folder, _, _ = write_checkpoint(tmp_path / "ck", cfg, state)
    drafter = AMDPARDDrafter.load(folder, target=target, overrides={"num_draft_tokens": K})
    res = speculative_generate(target, drafter, torch.tensor([[5, 9, 14, 3]]), 17)
    assert res.tokens == [0] * 17 and max(res.accept_lengths) == K + 1


def test_sampling_matches_target_distribution(tmp_path):
    small = tiny_target(seed=5, vocab=8)
    cfg = public_config("llama", tied=False, vocab_size=8, pard_token=7)
    folder, _, _ = write_checkpoint(tmp_path / "ck", cfg)
    drafter = AMDPARDDrafter.load(folder, target=small, overrides={"num_draft_tokens": 2})
    prompt = torch.tensor([[1, 5, 2, 6]])
    assert_second_token_follows_target(
        lambda generator: speculative_generate(small, drafter, prompt, 2, temperature=1.0,
                                               generator=generator), small, prompt, seed=3)


def test_padded_target_vocabulary(tmp_path, ids):
    """A target whose vocabulary is padded further (264 rows for the drafter's 256) is refused
    by default, accepted with target_vocab_size: the extra ids get probability 0."""
    target = tiny_target(vocab=264)
    folder, _, _ = write_checkpoint(tmp_path / "ck", public_config("llama"))
    with pytest.raises(ValueError, match=r"config\.json does not fit the target.*vocab_size is "
                                         r"256, the target's vocabulary has 264 tokens"):
        AMDPARDDrafter.load(folder, target=target)
    drafter = AMDPARDDrafter.load(folder, target=target, overrides={"target_vocab_size": 264})
    _, logits = drafter.start(target, torch.tensor([ids[:9]])).propose(ids[9], 9, argmax)
    assert logits.shape == (8, 264) and torch.isinf(logits[:, 256:]).all()
    assert torch.isfinite(logits[:, :256]).all()
    prompt = torch.tensor([ids[:9]])
    assert speculative_generate(target, drafter, prompt, 12).tokens == hf_greedy(target, prompt,
                                                                                 12)
    with pytest.raises(ValueError, match=r"sharpdraft\.target_vocab_size is 300"):
        AMDPARDDrafter.load(folder, target=target, overrides={"target_vocab_size": 300})
    drafter.save(tmp_path / "saved")                # written inside "sharpdraft", read back
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["sharpdraft"] == {"num_draft_tokens": 8, "target_vocab_size": 264}
    assert "train_context" not in saved and "sharp_slopes" not in saved
    again = AMDPARDDrafter.load(tmp_path / "saved", target=target)
    assert again.config.target_vocab_size == 264 and again.config.num_draft_tokens == 8


# ----- from the project's own PARD drafter ---------------------------------------------------
def test_from_drafter_drafts_identically(tmp_path):
    target = tiny_target()
    ours = tiny_pard(target, num_draft_tokens=K, train_context=512)
    assert ours.config.draft_vocab_size is None
    ours.sharp = SharpConfig(mode="fixed_slope", slope=0.3, n_ref=8)
    pard_token = 2
    public = AMDPARDDrafter.from_drafter(ours, target, pard_token)
    assert public.config.model_type == "llama" and not public.config.tie_word_embeddings
    assert public.sharp == ours.sharp and public.config.train_context == 512
    emb = public.model.embed_tokens.weight
    assert torch.equal(emb[pard_token], ours.mask_embedding)
    others = torch.arange(VOCAB) != pard_token
    assert torch.equal(emb[others], target.get_input_embeddings().weight[others])
    assert torch.equal(public.lm_head.weight, target.get_output_embeddings().weight)
    public.save(tmp_path / "pub")
    again = AMDPARDDrafter.load(tmp_path / "pub", target=target, sharp=ours.sharp)
    seq = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    sessions = [d.start(target, torch.tensor([seq[:15]])) for d in (ours, public, again)]
    pos = 15
    for accepted in (2, 1, 4, 3):
        got = [s.propose(seq[pos], pos, argmax) for s in sessions]
        for drafts, logits in got[1:]:
            assert drafts == got[0][0]
            torch.testing.assert_close(logits, got[0][1], rtol=1e-5, atol=1e-5)
        for s in sessions:
            s.commit(seq[pos + 1:pos + 1 + accepted])
        pos += accepted
    prompt = torch.tensor([seq[:15]])
    runs = [speculative_generate(target, d, prompt, 16) for d in (ours, public)]
    assert runs[0].tokens == runs[1].tokens == hf_greedy(target, prompt, 16)
    assert runs[0].accept_lengths == runs[1].accept_lengths
    saved = json.loads((tmp_path / "pub" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["pard_token"] == pard_token
    assert saved["spd_type"] == "pard" and saved["train_context"] == 512
    assert saved["sharpdraft"] == {"num_draft_tokens": K} and saved["tie_word_embeddings"] is False


def test_from_drafter_refusals():
    target = tiny_target()
    with pytest.raises(ValueError, match="draft_vocab_size is 64"):
        AMDPARDDrafter.from_drafter(tiny_pard(target, draft_vocab_size=64), target, 2)
    ours = tiny_pard(target)
    with pytest.raises(ValueError, match="pard_token is needed"):
        AMDPARDDrafter.from_drafter(ours, target)

    class Tok:                       # pad token 3: `drafters.export` passes tokenizer=
        pad_token_id, unk_token_id, eos_token_id = 3, None, 1

    assert AMDPARDDrafter.from_drafter(ours, target, tokenizer=Tok()).config.pard_token == 3
    for bad in (VOCAB, -1):
        with pytest.raises(ValueError, match=f"pard_token {bad} is outside the target's "
                                             f"vocabulary of {VOCAB} tokens"):
            AMDPARDDrafter.from_drafter(ours, target, bad)


# ----- config.json and the round trip --------------------------------------------------------
@pytest.mark.parametrize("family,tied", [("qwen3", True), ("llama", False), ("qwen2", True)])
def test_save_load_round_trip(tmp_path, targets, ids, family, tied):
    cfg = public_config(family, tied, sharp_slopes=[0.1, 0.3])
    folder, _, sd = write_checkpoint(tmp_path / "ck", cfg)
    target = targets[family]
    drafter = AMDPARDDrafter.load(folder, target=target, overrides={"train_context_length": 512})
    drafter.save(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    for key, value in cfg.items():                  # every published field written back as read
        if key != "torch_dtype":
            assert saved[key] == value, key
    assert saved["torch_dtype"] == "float32" and saved["train_context"] == 512
    assert saved["sharpdraft"] == {"num_draft_tokens": 8}        # K, the default; no vocab set
    from safetensors import safe_open
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert names == set(sd)                     # the public names; no lm_head when tied
        for name in names:
            assert torch.equal(f.get_tensor(name), sd[name]), name
    again = AMDPARDDrafter.load(tmp_path / "saved", target=target)
    assert again.config == drafter.config and again.config.sharp_slopes == [0.1, 0.3]
    assert again.config.train_context == 512

    def step(d):
        return d.start(target, torch.tensor([ids[:16]])).propose(ids[16], 16, argmax)[1]

    torch.testing.assert_close(step(again), step(drafter), rtol=0, atol=0)
    # bfloat16 weights load in bfloat16; a whole-drafter cast keeps float32 RoPE frequencies
    write_checkpoint(tmp_path / "bf16", cfg, {k: v.bfloat16() for k, v in sd.items()})
    assert AMDPARDDrafter.load(tmp_path / "bf16").lm_head.weight.dtype == torch.bfloat16
    half = AMDPARDDrafter.load(folder).to(torch.bfloat16)
    got = step(half)
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32
    assert (got - step(drafter)).abs().max() < 0.05 * step(drafter).abs().max()


def test_kinds_tell_each_other_apart(tmp_path, targets):
    """detect_kind: a public PARD folder is amd-pard, the project's own PARD checkpoint pard, a
    z-lab DFlash folder zlab-dflash; a plain causal LM is no drafter kind (amd-pard says it is
    not a PARD drafter); vLLM's mask_token_id is read as the pard token."""
    from test_zlab_dflash import write_checkpoint as write_zlab
    folder, cfg, _ = write_checkpoint(tmp_path / "amd", public_config("qwen3"))
    assert detect_kind(folder) == "amd-pard"
    tiny_pard(targets["llama"]).save(tmp_path / "own")
    assert detect_kind(tmp_path / "own") == "pard"
    with pytest.raises(ConfigKindError):
        AMDPARDDrafter.read_config(tmp_path / "own")
    with pytest.raises(ConfigKindError):
        PARDDrafter.read_config(folder)
    write_zlab(tmp_path / "zlab")
    assert detect_kind(tmp_path / "zlab") == "zlab-dflash"
    with pytest.raises(ConfigKindError, match="another drafter kind"):
        AMDPARDDrafter.read_config(tmp_path / "zlab")
    plain = {k: v for k, v in cfg.items() if k not in ("pard_token", "spd_type")}
    write_checkpoint(tmp_path / "plain", plain)
    with pytest.raises(ConfigKindError, match=r"config\.json has no pard_token .*not a PARD "
                                              r"drafter"):
        AMDPARDDrafter.read_config(tmp_path / "plain")
    with pytest.raises(ValueError, match="fits no drafter kind"):
        detect_kind(tmp_path / "plain")
    write_checkpoint(tmp_path / "vllm", dict(plain, mask_token_id=PARD))
    assert AMDPARDDrafter.read_config(tmp_path / "vllm").pard_token == PARD
    assert detect_kind(tmp_path / "vllm") == "amd-pard"
    d = load_drafter(folder, targets["qwen3"], slope=0.3, context_window=16)
    assert isinstance(d, AMDPARDDrafter) and d.sharp.mode == "fixed_slope"
    assert d.sharp.slope == 0.3 and d.sharp.n_ref == 2048 and d.context_window == 16
    assert registry.kind_of(d).name == "amd-pard"


def test_n_ref_source_follows_train_context(tmp_path, targets):
    """load_drafter(sharp=True): n_ref is config.json's train_context when recorded
    (n_ref_source "checkpoint"), else 2048 (n_ref_source "default")."""
    target = targets["qwen3"]
    folder, _, _ = write_checkpoint(tmp_path / "none", public_config("qwen3"))
    assert not AMDPARDDrafter.read_config(folder).records_train_context
    d = load_drafter(folder, target, sharp=True)
    assert d.n_ref_source == "default" and d.sharp.n_ref == 2048
    assert d.sharp.mode == "fixed_slope"
    folder, _, _ = write_checkpoint(tmp_path / "512", public_config("qwen3", train_context=512))
    assert AMDPARDDrafter.read_config(folder).records_train_context
    d = load_drafter(folder, target, sharp=True)
    assert d.n_ref_source == "checkpoint" and d.sharp.n_ref == 512
    assert d.sharp.mode == "fixed_slope"


# ----- malformed checkpoints ---------------------------------------------------------------
def test_missing_misshapen_and_unexpected_tensors(tmp_path):
    cfg = public_config("qwen3")
    sd = public_state(cfg)
    del sd["model.layers.1.self_attn.k_norm.weight"]
    folder, _, _ = write_checkpoint(tmp_path / "missing", cfg, sd)
    with pytest.raises(ValueError, match=r"missing.*model\.safetensors does not match its "
                                         r"config\.json: missing tensor\(s\) "
                                         r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        AMDPARDDrafter.load(folder)
    sd = public_state(cfg)
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(79, 48)
    folder, _, _ = write_checkpoint(tmp_path / "shape", cfg, sd, layout="sharded")
    with pytest.raises(ValueError, match=r"model-0000[12]-of-00002\.safetensors.*does not match "
                                         r"its config\.json: model\.layers\.0\.mlp\.up_proj"
                                         r"\.weight has shape \(79, 48\) in the file, the "
                                         r"config implies \(80, 48\)"):
        AMDPARDDrafter.load(folder)
    sd = dict(public_state(cfg), **{"lm_head.weight": torch.zeros(VOCAB, 48)})
    folder, _, _ = write_checkpoint(tmp_path / "tied", cfg, sd, layout="bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin does not match its config\.json: "
                                         r"unexpected tensor\(s\) lm_head\.weight.*"
                                         r"tie_word_embeddings is true"):
        AMDPARDDrafter.load(folder)


def test_another_vocabulary_than_the_target(tmp_path, targets):
    folder, _, _ = write_checkpoint(tmp_path / "ck", public_config("llama", vocab_size=300))
    AMDPARDDrafter.load(folder)                       # a valid checkpoint on its own
    with pytest.raises(ValueError, match=r"ck/config\.json does not fit the target.*vocab_size "
                                         r"is 300, the target's vocabulary has 256 tokens") as e:
        AMDPARDDrafter.load(folder, target=targets["llama"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(architectures=["MistralForCausalLM"]),
     r"architectures \['MistralForCausalLM'\] is not \['Qwen3ForCausalLM'\]"),
    (lambda c: c.update(model_type="mistral", architectures=["MistralForCausalLM"]),
     r"model_type 'mistral' is not supported"),
    (lambda c: c.pop("model_type"), "missing model_type"),
    (lambda c: c.pop("pard_token"), r"missing pard_token"),
    (lambda c: c.update(pard_token=VOCAB),
     rf"pard_token {VOCAB} is outside the vocabulary \(vocab_size {VOCAB}\)"),
    (lambda c: c.update(pard_token=-3), r"pard_token -3 is outside the vocabulary"),
    (lambda c: c.update(pard_token="250"), r"pard_token must be an integer token id"),
    (lambda c: c.update(mask_token_id=7),
     r"the mask-id fields disagree \(mask_token_id 7, pard_token 250\)"),
    (lambda c: c.update(spd_type="eagle"), r"spd_type is \"eagle\""),
    (lambda c: c.pop("hidden_size"), r"missing hidden_size"),
    (lambda c: c.update(hidden_size="48"), r"hidden_size must be an integer >= 1"),
    (lambda c: c.update(num_key_value_heads=3),
     r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (lambda c: c.update(hidden_act="swish2"), r"hidden_act 'swish2'"),
    (lambda c: c.update(rms_norm_eps="tiny"), r"not a valid qwen3 config .*rms_norm_eps"),
    (lambda c: c.update(use_sliding_window=True, sliding_window=8, max_window_layers=1),
     r"layer_types has non-full-attention layers \[1\]"),
    (lambda c: c.update(sharpdraft={"num_draft_tokens": 0}),
     r"sharpdraft\.num_draft_tokens must be an integer >= 1, got 0"),
    (lambda c: c.update(sharpdraft={"target_vocab_size": "264"}),
     r"sharpdraft\.target_vocab_size must be an integer >= 1, got \"264\""),
    (lambda c: c.update(sharpdraft={"num_draft_tokens": 4, "drafts": 3, "block": 2}),
     r"sharpdraft has unknown key\(s\) sharpdraft\.drafts, sharpdraft\.block"),
    (lambda c: c.update(sharpdraft=[4]), r"sharpdraft must be an object of num_draft_tokens"),
    (lambda c: c.update(train_context=0), r"train_context must be an integer >= 1, got 0"),
    (lambda c: c.update(sharp_slopes=0.2), r"sharp_slopes must be a list, got 0\.2"),
    (lambda c: c.update(draft_threshold=-0.1),
     r"draft_threshold must be a number in \[0, 1\], got -0\.1"),
])
def test_invalid_config_fields(tmp_path, change, message):
    cfg = public_config("qwen3")
    change(cfg)
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"ck: config\.json: " + message) as err:
        AMDPARDDrafter.load(folder)
    assert "\n" not in str(err.value)
    assert not isinstance(err.value, ConfigKindError)     # a PARD config, with a bad field


def test_overrides_are_validated(tmp_path):
    folder, _, _ = write_checkpoint(tmp_path / "ck", public_config("llama"))
    with pytest.raises(ValueError, match="not field"):
        AMDPARDDrafter.load(folder, overrides={"drafts": 3})
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1"):
        AMDPARDDrafter.load(folder, overrides={"num_draft_tokens": 0})
    with pytest.raises(ValueError, match="pard_token 999 is outside"):
        AMDPARDDrafter.load(folder, overrides={"pard_token": 999})
    d = AMDPARDDrafter.load(folder, overrides={"num_draft_tokens": 3, "pard_token": 5})
    assert d.max_drafts == 3 and d.config.to_public()["pard_token"] == 5
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        AMDPARDConfig(public=dict(public_config("llama"), model_type="gpt2"), pard_token=1)
