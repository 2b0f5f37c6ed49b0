"""The public EAGLE-3 adapter (drafters/specforge_eagle3.py): tiny random checkpoints written here
straight in the SafeAILab / SpecForge layout, their draft logits against a float64 forward written
from the published architecture, lossless greedy and sampled decoding (chain and tree) on Llama,
Qwen3 and Qwen2 targets, the conversion of the project's own EAGLE-3 drafters, the weight
layouts, the aux-layer conventions and malformed checkpoints."""
import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from sharpdraft.attention import SharpConfig
from sharpdraft.drafters import registry
from sharpdraft.drafters.config_checks import ConfigKindError
from sharpdraft.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from sharpdraft.drafters.formats.specforge_eagle3 import SpecForgeEagle3Config, default_aux_layers
from sharpdraft.drafters.loading import detect_kind, load_drafter
from sharpdraft.drafters.specforge_eagle3 import SpecForgeEagle3Drafter, from_drafter
from sharpdraft.drafters.zlab_dflash import ZLabDFlashDrafter
from sharpdraft.inference.engine import speculative_generate, tree_speculative_generate
from sharpdraft_helpers import TARGET_FAMILIES, tiny_target, write_public_folder
from test_engine import assert_second_token_follows_target, hf_greedy
from transformers import LlamaConfig, LlamaForCausalLM

HIDDEN, VOCAB, DRAFT_VOCAB = 64, 256, 40


# ----- a public checkpoint, written without the adapter --------------------------------------
def public_config(**over) -> dict:
    """A config.json as SpecForge ships them (configs/qwen3-4b-eagle3.json's fields), tiny: 4
    query / 2 KV heads of dim 8 (heads * head_dim != hidden_size, as Qwen3-4B's drafter), the
    aux layers named SpecForge's way (eagle_config, output numbering: layers 0, 1, 2 of a
    4-layer target = aux ids 1, 2, 3)."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 8,
        "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02,
        "intermediate_size": 96, "max_position_embeddings": 2048, "model_type": "llama",
        "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
        "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    }
    cfg.update(over)
    return cfg


def public_state(cfg: dict, seed: int = 7, embed: bool = False, fc_norm: bool = False,
                 n_features: int = 3) -> dict:
    """Random tensors under the public names and shapes (norm weights near 1); d2t as offsets
    of a random (unsorted) subset of the target vocabulary, t2d its indicator."""
    g = torch.Generator().manual_seed(seed)
    H, d = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg["intermediate_size"]
    ht = cfg.get("target_hidden_size", H)
    V = cfg["vocab_size"]
    vd = cfg.get("draft_vocab_size", V)

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    m = "midlayer."
    sd = {"fc.weight": w(H, n_features * ht), "norm.weight": norm(H),
          "lm_head.weight": 3 * w(vd, H),
          m + "input_layernorm.weight": norm(H), m + "hidden_norm.weight": norm(H),
          m + "post_attention_layernorm.weight": norm(H),
          m + "self_attn.q_proj.weight": w(nh * d, 2 * H),
          m + "self_attn.k_proj.weight": w(nkv * d, 2 * H),
          m + "self_attn.v_proj.weight": w(nkv * d, 2 * H),
          m + "self_attn.o_proj.weight": w(H, nh * d),
          m + "mlp.gate_proj.weight": w(inter, H), m + "mlp.up_proj.weight": w(inter, H),
          m + "mlp.down_proj.weight": w(H, inter)}
    if vd < V:
        targets = torch.randperm(V, generator=g)[:vd]
        sd["d2t"] = targets - torch.arange(vd)                       # offsets, int64
        sd["t2d"] = torch.zeros(V, dtype=torch.bool)
        sd["t2d"][targets] = True
    if embed:
        sd["embed_tokens.weight"] = torch.randn(V, H, generator=g)
    if fc_norm:
        for i in range(n_features):
            sd[f"fc_norm.{i}.weight"] = norm(ht)
    return sd


def write_checkpoint(folder, cfg=None, state=None, seed: int = 7, **kw):
    cfg = cfg or public_config()
    state = public_state(cfg, seed, **kw) if state is None else state
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(folder / "model.safetensors"))
    return folder, cfg, state


def target_of(vocab=VOCAB, layers=4, seed=0):
    """A random Llama like tiny_target, with `layers` decoder layers."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)).eval()


# ----- the float64 reference, from the published architecture --------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _inv_freq(cfg, d):
    """Inverse RoPE frequencies (float64): plain, or Llama 3.1's banded rescaling."""
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    sc = cfg.get("rope_scaling")
    if not sc:
        return inv
    assert sc["rope_type"] == "llama3"
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old / lo, inv / factor, inv)          # long waves: slowed
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = (wavelen <= old / lo) & (wavelen >= old / hi)               # the band in between
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, out)


def _rope(x, pos, inv):
    """x (L, heads, d) rotated at positions pos (L,) (rotate-half layout)."""
    d = x.shape[-1]
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def reference_chain(cfg, sd, target, ids, steps, aux, sharp=None):
    """float64 draft logits over the TARGET vocabulary (-inf outside the draft vocabulary), one
    row per chain step, after the committed prefix ids[0, :P] and last = ids[0, P]
    (P = ids.shape[1] - 1): row 0 is context row P - 1 (features at P - 1, token x_P); step
    j >= 1 adds a row at position P - 1 + j with the previous step's greedy draft and the
    previous row's un-normalised output as its hidden input. `aux`: aux ids (inputs of target
    layers = hidden_states[a]), read in ascending order."""
    sd = {k: (v.double() if v.is_floating_point() else v) for k, v in sd.items()}
    eps = cfg["rms_norm_eps"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    m = "midlayer."
    P = ids.shape[1] - 1
    with torch.no_grad():
        hs = target(ids[:, :P], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[a][0].double() for a in sorted(aux)], -1)
    if "fc_norm.0.weight" in sd:
        ht = feats.shape[1] // len(aux)
        feats = torch.cat([_rms(p, sd[f"fc_norm.{i}.weight"], eps)
                           for i, p in enumerate(feats.split(ht, -1))], -1)
    E = sd.get("embed_tokens.weight", target.get_input_embeddings().weight.double())
    V = cfg["vocab_size"]
    d2t = sd["d2t"] + torch.arange(sd["d2t"].numel()) if "d2t" in sd else torch.arange(V)
    inv = _inv_freq(cfg, d)
    tokens = ids[0, 1:].tolist()                                      # row t reads x_{t+1}
    hidden = list(feats @ sd["fc.weight"].T)                          # row t's hidden input
    keys, values, out = [], [], []
    for step in range(steps):
        rows = range(P) if step == 0 else [P - 1 + step]
        for t in rows:
            x = torch.cat([_rms(E[tokens[t]], sd[m + "input_layernorm.weight"], eps),
                           _rms(hidden[t], sd[m + "hidden_norm.weight"], eps)])
            pos = torch.tensor([t])
            keys.append(_rope((x @ sd[m + "self_attn.k_proj.weight"].T).view(1, nkv, d),
                              pos, inv)[0])
            values.append((x @ sd[m + "self_attn.v_proj.weight"].T).view(nkv, d))
            q = _rope((x @ sd[m + "self_attn.q_proj.weight"].T).view(1, nh, d), pos, inv)[0]
            k = torch.stack(keys).repeat_interleave(nh // nkv, 1)     # (t + 1, nh, d)
            v = torch.stack(values).repeat_interleave(nh // nkv, 1)
            beta = 1.0
            if sharp is not None and sharp.mode == "fixed_slope":
                beta = max(sharp.beta_min, 1 + sharp.slope * math.log(len(keys) / sharp.n_ref))
            att = (torch.einsum("hd,khd->hk", q, k) * beta / math.sqrt(d)).softmax(-1)
            o = torch.einsum("hk,khd->hd", att, v).reshape(nh * d)
            h = hidden[t] + o @ sd[m + "self_attn.o_proj.weight"].T
            u = _rms(h, sd[m + "post_attention_layernorm.weight"], eps)
            gate = u @ sd[m + "mlp.gate_proj.weight"].T
            h = h + (gate * torch.sigmoid(gate) * (u @ sd[m + "mlp.up_proj.weight"].T)) @ \
                sd[m + "mlp.down_proj.weight"].T
        draft_logits = _rms(h, sd["norm.weight"], eps) @ sd["lm_head.weight"].T
        full = torch.full((V,), float("-inf"), dtype=torch.float64)
        full[d2t] = draft_logits
        out.append(full)
        tokens.append(int(d2t[draft_logits.argmax()]))                # the greedy draft
        hidden.append(h)                                              # fed forward un-normed
    return torch.stack(out)


def adapter_chain(drafter, target, ids):
    """The adapter's chain logits (chain_length, V) after ids[:, :P], last = ids[0, P]."""
    P = ids.shape[1] - 1
    with torch.no_grad():
        hs = target(ids[:, :P], output_hidden_states=True).hidden_states
    session = drafter.start(target, ids[:, :P], hs)
    drafts, logits = session.propose(int(ids[0, P]), P, lambda row: int(row.argmax()))
    return drafts, logits


def assert_logits_equal(got, ref):
    """Same -inf pattern (the draft vocabulary), finite entries equal to float rounding."""
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin)
    assert ref[fin].abs().max() > 1e-2
    torch.testing.assert_close(got.double()[fin], ref[fin], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, VOCAB, (1, 26), generator=torch.Generator().manual_seed(3))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


# ----- the forward ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "embed+llama3", "sharp", "narrow", "fc_norm",
                                     "full-vocab"])
def test_draft_logits_equal_float64_reference(tmp_path, target, prompt, variant):
    """Chain drafts (first row after the prompt, then rows fed the un-normed output) against the
    float64 forward of the published architecture: own embedding and Llama 3.1 RoPE, SharpDraft
    (n_ref 8 < the 25 keys: beta > 1 from the 8th row on), a drafter narrower than the target
    (hidden 32, target_hidden_size 64, own embedding), SpecForge's fc_norm, and a full-vocabulary
    drafter without d2t."""
    cfg = public_config()
    kw, sharp = {}, None
    if variant == "embed+llama3":
        cfg["rope_scaling"], kw["embed"] = LLAMA3, True
    if variant == "sharp":
        sharp = SharpConfig(mode="fixed_slope", slope=0.5, n_ref=8)
    if variant == "narrow":
        cfg.update(hidden_size=32, intermediate_size=48, target_hidden_size=HIDDEN)
        kw["embed"] = True
    if variant == "fc_norm":
        cfg["fc_norm"], kw["fc_norm"] = True, True
    if variant == "full-vocab":
        del cfg["draft_vocab_size"]
    folder, cfg, sd = write_checkpoint(tmp_path / "ck", cfg, **kw)
    drafter = SpecForgeEagle3Drafter.load(folder, target=target, sharp=sharp)
    assert drafter.hidden_layers == [1, 2, 3] and drafter.config.target_layer_ids == [0, 1, 2]
    assert (drafter.embed_tokens is not None) == ("embed" in kw)
    assert (drafter.d2t is None) == (variant == "full-vocab")
    drafts, logits = adapter_chain(drafter, target, prompt)
    ref = reference_chain(cfg, sd, target, prompt, 5, aux=[1, 2, 3], sharp=sharp)
    assert logits.dtype == torch.float32 and logits.shape == (5, VOCAB)
    assert_logits_equal(logits, ref)
    assert drafts == [int(r.argmax()) for r in ref]
    if sharp is not None:          # SharpDraft changed the published drafter's logits
        drafter.sharp = SharpConfig(mode="none")
        off = adapter_chain(drafter, target, prompt)[1]
        fin = torch.isfinite(off)
        assert (off[fin] - logits[fin]).abs().max() > 1e-3


def test_tree_rows_equal_the_reference_chain(tmp_path, target, prompt):
    """A tree's first-depth nodes are the root row's top-k (mapped through d2t) and the tree
    holds the greedy chain of the reference as its best path."""
    folder, cfg, sd = write_checkpoint(tmp_path / "ck")
    drafter = SpecForgeEagle3Drafter.load(folder, target=target,
                                          overrides={"tree_topk": 3, "tree_depth": 3,
                                                     "tree_tokens": 21})
    P = prompt.shape[1] - 1
    with torch.no_grad():
        hs = target(prompt[:, :P], output_hidden_states=True).hidden_states
    tree = drafter.start(target, prompt[:, :P], hs).propose_tree(int(prompt[0, P]), P)
    ref = reference_chain(cfg, sd, target, prompt, 3, aux=[1, 2, 3])
    roots = [tree.tokens[i] for i in tree.children(-1)]
    assert roots == ref[0].topk(3).indices.tolist()
    node, path = -1, []
    for _ in range(3):                     # follow the first (likeliest) child at each depth
        kids = tree.children(node)
        if not kids:
            break
        node = kids[0]
        path.append(tree.tokens[node])
    assert path[:1] == [int(ref[0].argmax())]
    assert path[1:2] == [int(ref[1].argmax())]


# ----- lossless decoding -------------------------------------------------------------------
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("family", sorted(TARGET_FAMILIES))
def test_lossless_greedy(tmp_path, family, tree, prompt):
    tgt = TARGET_FAMILIES[family]()
    folder, _, _ = write_checkpoint(tmp_path / "ck", public_config(head_dim=16), embed=True)
    run = tree_speculative_generate if tree else speculative_generate
    ref = hf_greedy(tgt, prompt[:, :12], 16)
    for sharp in (None, SharpConfig(mode="fixed_slope", slope=0.5, n_ref=8)):
        drafter = SpecForgeEagle3Drafter.load(folder, target=tgt, sharp=sharp,
                                              overrides={"tree_topk": 3, "tree_depth": 3,
                                                         "tree_tokens": 8})
        res = run(tgt, drafter, prompt[:, :12], 16)
        assert res.tokens == ref, (family, tree, sharp)


def test_lossless_when_the_drafter_agrees_with_the_target(tmp_path, prompt):
    """A target whose LM head is zero always picks token 0 (ties go to the first id); a drafter
    whose lm_head is zero drafts draft id 0, which d2t maps to target 0 (draft i -> target 5 i,
    offsets 4 i): every chain is accepted whole."""
    tgt = tiny_target()
    with torch.no_grad():
        tgt.get_output_embeddings().weight.zero_()
    cfg = public_config()
    sd = public_state(cfg)
    sd["d2t"] = 4 * torch.arange(DRAFT_VOCAB)
    sd["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    sd["t2d"][5 * torch.arange(DRAFT_VOCAB)] = True
    sd["lm_head.weight"] = torch.zeros(DRAFT_VOCAB, HIDDEN)
    folder, _, _ = write_checkpoint(tmp_path / "ck", cfg, sd)
    drafter = SpecForgeEagle3Drafter.load(folder, target=tgt)
    assert drafter.d2t.tolist() == list(range(0, 5 * DRAFT_VOCAB, 5))
    res = speculative_generate(tgt, drafter, prompt[:, :9], 13)
    assert res.tokens == [0] * 13
    assert max(res.accept_lengths) == drafter.max_drafts + 1


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampling_follows_the_target(tmp_path, tree):
    """Temperature 1 with a draft vocabulary of 5 of the 8 tokens (d2t offsets): the 2nd new
    token's frequencies over 500 runs match the target's exact marginal (chi-square, df 7)."""
    small = tiny_target(seed=5, vocab=8)
    cfg = public_config(vocab_size=8, draft_vocab_size=5)
    folder, _, _ = write_checkpoint(tmp_path / "ck", cfg)
    drafter = SpecForgeEagle3Drafter.load(folder, target=small,
                                          overrides={"chain_length": 3, "tree_topk": 2,
                                                     "tree_depth": 2, "tree_tokens": 4})
    assert drafter.d2t.numel() == 5
    prompt = torch.tensor([[1, 5, 2, 7]])
    run = tree_speculative_generate if tree else speculative_generate
    assert_second_token_follows_target(
        lambda generator: run(small, drafter, prompt, 2, temperature=1.0, generator=generator),
        small, prompt, seed=4)


def test_short_public_max_position_embeddings_still_decodes_long_contexts(tmp_path):
    """SafeAILab ships max_position_embeddings 2048 for 128K targets: a drafter claiming 64
    positions (Llama 3.1 RoPE) decodes a 100-token context losslessly and its rows at
    positions >= 64 still equal the reference."""
    tgt = tiny_target()
    cfg = public_config(max_position_embeddings=64, rope_scaling=LLAMA3)
    folder, cfg, sd = write_checkpoint(tmp_path / "ck", cfg)
    drafter = SpecForgeEagle3Drafter.load(folder, target=tgt)
    long = torch.randint(3, VOCAB, (1, 101), generator=torch.Generator().manual_seed(9))
    _, logits = adapter_chain(drafter, tgt, long)
    assert_logits_equal(logits, reference_chain(cfg, sd, tgt, long, 5, aux=[1, 2, 3]))
    for run in (speculative_generate, tree_speculative_generate):
        assert run(tgt, drafter, long[:, :100], 12).tokens == hf_greedy(tgt, long[:, :100], 12)
    # a cast of the whole drafter (load_drafter casts to the target's dtype) keeps float32 RoPE
    half = SpecForgeEagle3Drafter.load(folder).to(torch.bfloat16)
    assert half.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(half.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq)


# ----- the project's own drafters, exported ---------------------------------------------------
def own_public_drafter(target, **kw):
    """One of the project's EAGLE-3 drafters with the public options, unsorted target layers, a
    non-unit feature_scale and a reduced draft vocabulary."""
    torch.manual_seed(11)
    cfg = Eagle3Config.from_target(target.config, target_layer_ids=[2, 0, 1], norm_features=False,
                                   feed_normed_output=False, chain_length=4, tree_topk=3,
                                   tree_depth=3, tree_tokens=8, **kw)
    d = Eagle3Drafter(cfg).eval()
    with torch.no_grad():
        d.feature_scale.uniform_(0.5, 2.0)
    if d.d2t is not None:
        d.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[
            :d.d2t.numel()])
    return d


@pytest.mark.parametrize("draft_vocab_size", [32, None])
def test_from_drafter_gives_identical_drafts(tmp_path, target, prompt, draft_vocab_size):
    own = own_public_drafter(target, draft_vocab_size=draft_vocab_size)
    pub = from_drafter(own, target)
    same = SpecForgeEagle3Drafter.from_drafter(own, target, tokenizer=None)
    assert all(torch.equal(a, b) for a, b in zip(pub.state_dict().values(),
                                                 same.state_dict().values()))
    assert pub.config.target_layer_ids == [0, 1, 2] and pub.embed_tokens is None
    assert pub.lm_head.weight.shape == (draft_vocab_size or VOCAB, HIDDEN)
    d_own, l_own = adapter_chain(own, target, prompt)
    d_pub, l_pub = adapter_chain(pub, target, prompt)
    assert d_own == d_pub
    assert torch.equal(torch.isfinite(l_own), torch.isfinite(l_pub))
    fin = torch.isfinite(l_own)
    torch.testing.assert_close(l_pub[fin], l_own[fin], rtol=1e-5, atol=1e-5)
    P = prompt.shape[1] - 1
    with torch.no_grad():
        hs = target(prompt[:, :P], output_hidden_states=True).hidden_states
    trees = [d.start(target, prompt[:, :P], hs).propose_tree(int(prompt[0, P]), P)
             for d in (own, pub)]
    assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents
    # written and read back: the public files hold what the published loaders expect
    pub.save(tmp_path / "pub")
    files = load_file(str(tmp_path / "pub" / "model.safetensors"))
    torch.testing.assert_close(files["fc.weight"][:, :HIDDEN],
                               own.fc.weight[:, 1 * HIDDEN:2 * HIDDEN]
                               * own.feature_scale[HIDDEN:2 * HIDDEN])   # layer 0: old block 1
    if draft_vocab_size:
        assert torch.equal(files["d2t"] + torch.arange(32), own.d2t)
        assert torch.equal(files["t2d"].nonzero()[:, 0], own.d2t.sort().values)
        assert torch.equal(files["lm_head.weight"], target.lm_head.weight[own.d2t])
    else:
        assert "d2t" not in files and "t2d" not in files
    back = SpecForgeEagle3Drafter.load(tmp_path / "pub", target=target)
    assert adapter_chain(back, target, prompt)[0] == d_own
    ref = hf_greedy(target, prompt[:, :10], 12)
    assert speculative_generate(target, back, prompt[:, :10], 12).tokens == ref


def test_the_measured_context_window_travels_in_the_public_config(tmp_path, target):
    """An exported EAGLE-3 keeps its measured context window as sharpdraft.context_window (left
    out when it has none), and loads back with it as the default."""
    from_drafter(own_public_drafter(target, context_window=12), target).save(tmp_path / "w")
    from_drafter(own_public_drafter(target), target).save(tmp_path / "all")
    raw = json.loads((tmp_path / "w" / "config.json").read_text())
    assert raw["sharpdraft"]["context_window"] == 12
    assert "context_window" not in json.loads(
        (tmp_path / "all" / "config.json").read_text())["sharpdraft"]
    assert load_drafter(tmp_path / "w", target).context_window == 12
    assert load_drafter(tmp_path / "all", target).context_window is None
    raw["sharpdraft"]["context_window"] = 0
    (tmp_path / "w" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="sharpdraft.context_window"):
        load_drafter(tmp_path / "w", target)


@pytest.mark.parametrize("option", ["norm_features", "feed_normed_output"])
def test_from_drafter_refuses_what_the_public_architecture_lacks(target, option):
    torch.manual_seed(0)
    cfg = Eagle3Config.from_target(target.config, target_layer_ids=[0, 1, 2],
                                   norm_features=option == "norm_features",
                                   feed_normed_output=option == "feed_normed_output")
    with pytest.raises(ValueError, match=f"from_drafter: {option} is true: a "
                                         f"(per-feature RMSNorm|normalised output).*no place in "
                                         f"the public EAGLE-3 architecture"):
        from_drafter(Eagle3Drafter(cfg), target)
    cfg = Eagle3Config.from_target(target.config, target_layer_ids=[0, 1, 3],
                                   norm_features=False, feed_normed_output=False)
    with pytest.raises(ValueError, match=r"from_drafter: target_layer_ids \[0, 1, 3\] .*outside "
                                         r"the aux ids 1 \.\. 3"):
        from_drafter(Eagle3Drafter(cfg), target)      # layer 3's output: after the final norm


# ----- config.json, layer ids, weight layouts --------------------------------------------------
def test_save_round_trip_and_other_layouts(tmp_path, target, prompt):
    folder, cfg, sd = write_checkpoint(tmp_path / "ck", public_config(train_context=512),
                                       embed=True)
    drafter = SpecForgeEagle3Drafter.load(folder, target=target)
    assert drafter.config.train_context == 512 and drafter.config.records_train_context
    want = adapter_chain(drafter, target, prompt)[1]
    drafter.save(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"]
    assert saved["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]                # vLLM: aux
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang
    assert saved["draft_vocab_size"] == DRAFT_VOCAB and saved["target_hidden_size"] == HIDDEN
    assert saved["bos_token_id"] == 1 and saved["train_context"] == 512
    assert saved["sharpdraft"] == {"chain_length": 5, "tree_topk": 4, "tree_depth": 5,
                                   "tree_tokens": 16}
    files = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(files) == set(sd)
    for k in sd:
        assert torch.equal(files[k], sd[k]), k
    again = SpecForgeEagle3Drafter.load(tmp_path / "saved", target=target)
    assert again.config == drafter.config
    # pytorch_model.bin (weights_only) and shards with an index
    binf = write_public_folder(tmp_path / "bin", cfg, sd, "bin")
    shard = write_public_folder(tmp_path / "sharded", cfg, sd, "sharded")
    for other in (tmp_path / "saved", binf, shard):
        got = adapter_chain(SpecForgeEagle3Drafter.load(other, target=target), target, prompt)[1]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # bfloat16 weights load in bfloat16; the d2t / t2d keep their dtypes
    write_checkpoint(tmp_path / "bf16", cfg, {k: v.bfloat16() if v.is_floating_point() else v
                                              for k, v in sd.items()})
    bf = SpecForgeEagle3Drafter.load(tmp_path / "bf16")
    assert bf.fc.weight.dtype == torch.bfloat16 and bf.d2t.dtype == torch.int64
    assert bf.t2d.dtype == torch.bool


def test_load_drafter_detects_the_kind_and_applies_sharpdraft(tmp_path, target, prompt):
    folder, _, _ = write_checkpoint(tmp_path / "ck")
    assert detect_kind(folder) == "specforge-eagle3"
    d = load_drafter(folder, target, sharp=True, n_ref=8)
    assert isinstance(d, SpecForgeEagle3Drafter) and registry.kind_of(d).name == "specforge-eagle3"
    assert d.sharp.mode == "fixed_slope" and d.sharp.n_ref == 8
    assert load_drafter(folder, target, sharp=True).sharp.n_ref == 2048      # none recorded
    assert speculative_generate(target, d, prompt[:, :8], 10).tokens == \
        hf_greedy(target, prompt[:, :8], 10)


def test_aux_layer_conventions(tmp_path, prompt):
    """Top level = vLLM's aux ids (inputs), eagle_config = SGLang / SpecForge's (outputs): the
    same layers either way, listed in any order; none named = (2, L // 2, L - 3) of the target
    given to load."""
    tgt = target_of(layers=8)
    assert default_aux_layers(8) == [2, 4, 5] and default_aux_layers(32) == [2, 16, 29]
    base = public_config()
    del base["eagle_config"]
    variants = {"top": dict(base, eagle_aux_hidden_state_layer_ids=[5, 2, 4]),
                "nested": dict(base, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}),
                "both": dict(base, eagle_aux_hidden_state_layer_ids=[2, 4, 5],
                             eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}),
                "default": base,
                "safeailab": dict(base, architectures=["LlamaForCausalLM"])}
    state = public_state(base)
    outs = {}
    for name, cfg in variants.items():
        folder, _, _ = write_checkpoint(tmp_path / name, cfg, state)
        assert detect_kind(folder) == "specforge-eagle3"
        d = SpecForgeEagle3Drafter.load(folder, target=tgt)
        assert d.config.target_layer_ids == [1, 3, 4] and d.hidden_layers == [2, 4, 5], name
        outs[name] = adapter_chain(d, tgt, prompt)[1]
    ref = reference_chain(base, state, tgt, prompt, 5, aux=[2, 4, 5])
    for got in outs.values():
        assert_logits_equal(got, ref)
    # no ids and no target: read_config still succeeds, load says what to do
    config = SpecForgeEagle3Drafter.read_config(tmp_path / "default")
    assert config.target_layer_ids is None and not config.resolved
    with pytest.raises(ValueError, match=r"config\.json names no aux layers .*pass target="):
        SpecForgeEagle3Drafter.load(tmp_path / "default")
    d = SpecForgeEagle3Drafter.load(tmp_path / "default",
                                    overrides={"target_layer_ids": [1, 3, 4]})
    assert d.hidden_layers == [2, 4, 5]
    # a 4-layer target's default (2, 2, 1) repeats a layer: refused, naming the fix
    with pytest.raises(ValueError, match=r"config\.json names no eagle_aux_hidden_state_layer_ids"
                                         r".*4-layer target repeat a layer"):
        SpecForgeEagle3Drafter.load(tmp_path / "default", target=tiny_target())


def test_kinds_tell_each_other_apart(tmp_path, target):
    folder, _, _ = write_checkpoint(tmp_path / "ck")
    with pytest.raises(ConfigKindError):
        Eagle3Drafter.read_config(folder)
    with pytest.raises(ConfigKindError):
        ZLabDFlashDrafter.read_config(folder)
    torch.manual_seed(0)
    Eagle3Drafter(Eagle3Config.from_target(target.config)).save(tmp_path / "own")
    with pytest.raises(ConfigKindError, match="architectures"):
        SpecForgeEagle3Drafter.read_config(tmp_path / "own")
    assert detect_kind(tmp_path / "own") == "eagle3"
    plain = public_config(architectures=["LlamaForCausalLM"])
    del plain["draft_vocab_size"]               # a plain Llama config: not an EAGLE-3 one
    write_checkpoint(tmp_path / "plain", plain)
    with pytest.raises(ConfigKindError, match=r"not a public EAGLE-3 config"):
        SpecForgeEagle3Drafter.read_config(tmp_path / "plain")


def test_untrained_hook(target):
    d = registry.build_untrained("specforge-eagle3", target, None, seed=1)
    assert isinstance(d, SpecForgeEagle3Drafter) and d.target_problems(target) == []
    assert d.config.target_layer_ids == [0, 1]              # (2, 2, 1) of 4 layers, distinct
    assert torch.equal(d.lm_head.weight, target.lm_head.weight)
    deep = target_of(layers=8)
    assert registry.build_untrained("specforge-eagle3", deep, None).hidden_layers == [2, 4, 5]
    assert registry.get("specforge-eagle3").trees
    d = registry.build_untrained("specforge-eagle3", target, None, overrides={"tree_topk": 2})
    assert d.config.tree_topk == 2


# ----- malformed checkpoints ---------------------------------------------------------------
def test_missing_and_misshapen_tensors(tmp_path, target):
    cfg = public_config()
    sd = public_state(cfg)
    del sd["midlayer.self_attn.k_proj.weight"]
    folder, _, _ = write_checkpoint(tmp_path / "missing", cfg, sd)
    with pytest.raises(ValueError, match=r"model\.safetensors does not match its config\.json: "
                                         r"missing tensor\(s\) midlayer\.self_attn\.k_proj"
                                         r"\.weight"):
        SpecForgeEagle3Drafter.load(folder, target=target)
    sd = public_state(cfg)
    sd["midlayer.mlp.up_proj.weight"] = torch.zeros(95, HIDDEN)
    folder, _, _ = write_checkpoint(tmp_path / "shape", cfg, sd)
    with pytest.raises(ValueError, match=r"model\.safetensors does not match its config\.json: "
                                         r"midlayer\.mlp\.up_proj\.weight has shape \(95, 64\) in "
                                         r"the file, the config implies \(96, 64\)"):
        SpecForgeEagle3Drafter.load(folder, target=target)
    sd = public_state(cfg)
    sd["fc.weight"] = sd["fc.weight"][:, :2 * HIDDEN].contiguous()   # 2 features, 3 aux ids
    folder, _, _ = write_checkpoint(tmp_path / "fc", cfg, sd)
    with pytest.raises(ValueError, match=r"fc\.weight has shape \(64, 128\) in the file, the "
                                         r"config implies \(64, 192\)"):
        SpecForgeEagle3Drafter.load(folder, target=target)
    sd = public_state(cfg)
    del sd["d2t"]
    folder, _, _ = write_checkpoint(tmp_path / "no_d2t", cfg, sd)
    with pytest.raises(ValueError, match=r"missing tensor\(s\) d2t"):
        SpecForgeEagle3Drafter.load(folder, target=target)
    sd = public_state(cfg)
    del sd["lm_head.weight"]
    folder, _, _ = write_checkpoint(tmp_path / "no_head", cfg, sd)
    with pytest.raises(ValueError, match=r"missing tensor\(s\) lm_head\.weight"):
        SpecForgeEagle3Drafter.load(folder, target=target)
    binf = tmp_path / "bin"
    binf.mkdir()
    (binf / "config.json").write_text(json.dumps(cfg))
    torch.save(dict(public_state(cfg), extra=torch.zeros(3)), binf / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin does not match its config\.json: "
                                         r"unexpected tensor\(s\) extra"):
        SpecForgeEagle3Drafter.load(binf, target=target)


def test_draft_vocabulary_tensors(tmp_path, target):
    cfg = public_config()
    sd = public_state(cfg)
    sd["d2t"][7] = VOCAB + 50 - 7
    folder, _, _ = write_checkpoint(tmp_path / "range", cfg, sd)
    with pytest.raises(ValueError, match=r"model\.safetensors: d2t maps draft id 7 to target id "
                                         r"306 \(7 \+ offset 299\), outside vocab_size 256"):
        SpecForgeEagle3Drafter.load(folder)
    sd = public_state(cfg)
    sd["d2t"][3] = sd["d2t"][2] + 2 - 3                              # draft 3 -> draft 2's id
    folder, _, _ = write_checkpoint(tmp_path / "twice", cfg, sd)
    with pytest.raises(ValueError, match=r"model\.safetensors: d2t maps 1 draft id\(s\) to a "
                                         r"target id another draft id already has"):
        SpecForgeEagle3Drafter.load(folder)
    sd = public_state(cfg)
    sd["t2d"] = sd["t2d"].float()
    folder, _, _ = write_checkpoint(tmp_path / "t2d", cfg, sd)
    with pytest.raises(ValueError, match=r"model\.safetensors: t2d has dtype torch\.float32, not "
                                         r"bool"):
        SpecForgeEagle3Drafter.load(folder)
    sd = public_state(cfg)
    sd["d2t"] = sd["d2t"].float()
    folder, _, _ = write_checkpoint(tmp_path / "d2t_float", cfg, sd)
    with pytest.raises(ValueError, match=r"model\.safetensors: d2t has dtype torch\.float32"):
        SpecForgeEagle3Drafter.load(folder)


def test_target_mismatches_name_the_field(tmp_path, target):
    cfg = public_config(hidden_size=32, intermediate_size=48)
    folder, _, _ = write_checkpoint(tmp_path / "h32", cfg)
    SpecForgeEagle3Drafter.load(folder)                 # a valid checkpoint on its own
    with pytest.raises(ValueError, match=r"config\.json does not fit the target.*hidden_size is "
                                         r"32, the target's hidden_size is 64 \(the drafter uses "
                                         r"the target's token embeddings.*target_hidden_size is "
                                         r"32"):
        SpecForgeEagle3Drafter.load(folder, target=target)
    folder, _, _ = write_checkpoint(tmp_path / "vocab", public_config(vocab_size=300))
    with pytest.raises(ValueError, match=r"config\.json does not fit the target.*vocab_size is "
                                         r"300, the target's vocabulary has 256 tokens"):
        SpecForgeEagle3Drafter.load(folder, target=target)
    folder, _, _ = write_checkpoint(tmp_path / "aux", public_config(
        eagle_aux_hidden_state_layer_ids=[1, 2, 4], eagle_config={}))
    with pytest.raises(ValueError, match=r"config\.json does not fit the target.*"
                                         r"eagle_aux_hidden_state_layer_ids \[1, 2, 4\] "
                                         r"\(target_layer_ids \[0, 1, 3\]\) name \[4\], outside "
                                         r"the aux ids 1 \.\. 3"):
        SpecForgeEagle3Drafter.load(folder, target=target)


@pytest.mark.parametrize("change,field", [
    (lambda c: c.update(architectures=["MedusaModel"]), r"architectures \[\"MedusaModel\"\]"),
    (lambda c: c.pop("hidden_size"), "missing hidden_size"),
    (lambda c: c.update(vocab_size="256"), "vocab_size must be an integer"),
    (lambda c: c.update(num_hidden_layers=2), "num_hidden_layers is 2"),
    (lambda c: c.update(draft_vocab_size=300), "draft_vocab_size 300 exceeds vocab_size 256"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings"),
    (lambda c: c.update(norm_before_residual=True), "norm_before_residual"),
    (lambda c: c.update(norm_output=False), "norm_output"),
    (lambda c: c.update(rope_scaling={"rope_type": "bogus", "factor": 2.0}),
     "rope_scaling.rope_type"),
    (lambda c: c.update(eagle_config={"use_aux_hidden_state": False}),
     "eagle_config.use_aux_hidden_state"),
    (lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": "0,1,2"}),
     "eagle_config.eagle_aux_hidden_state_layer_ids must be a non-empty list"),
    (lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}),
     r"eagle_config.eagle_aux_hidden_state_layer_ids \[0, 1, 1\] repeat a layer"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2], eagle_config={}),
     r"eagle_aux_hidden_state_layer_ids \[0, 1, 2\] must be >= 1"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3],
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}),
     "name different target layers"),
    (lambda c: c.update(draft_threshold="0.6"),
     r"draft_threshold must be a number in \[0, 1\], got '0.6'"),
])
def test_invalid_config_fields(tmp_path, change, field):
    cfg = public_config()
    change(cfg)
    folder, _, _ = write_checkpoint(tmp_path / "ck", cfg, public_state(public_config()))
    with pytest.raises(ValueError, match=r"ck: config\.json.*" + field) as err:
        SpecForgeEagle3Drafter.load(folder)
    assert "\n" not in str(err.value)


def test_overrides_are_validated(tmp_path):
    folder, _, _ = write_checkpoint(tmp_path / "ck")
    with pytest.raises(ValueError, match="not field"):
        SpecForgeEagle3Drafter.load(folder, overrides={"treetopk": 3})
    with pytest.raises(ValueError, match="tree_topk"):
        SpecForgeEagle3Drafter.load(folder, overrides={"tree_topk": 0})
    with pytest.raises(ValueError, match="target_layer_ids must be strictly increasing"):
        SpecForgeEagle3Drafter.load(folder, overrides={"target_layer_ids": [2, 0, 1]})
    c = SpecForgeEagle3Drafter.read_config(folder)
    assert dataclasses.replace(c, chain_length=2).chain_length == 2
    assert SpecForgeEagle3Config.from_public(c.to_public()) == c
