"""Tiny random models for the engine / drafter / attention tests (seconds on CPU)."""
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from sharpdraft.drafters.dflash import DFlashConfig, DFlashDrafter


def tiny_target(seed: int = 0, vocab: int = 256, **kw) -> LlamaForCausalLM:
    """A random 4-layer Llama: hidden 64, 4 query / 2 KV heads (GQA), head dim 16."""
    torch.manual_seed(seed)
    kw = {"num_key_value_heads": 2, "max_position_embeddings": 512, **kw}
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, **kw)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen3(seed: int = 0, vocab: int = 256, **kw) -> Qwen3ForCausalLM:
    """A random 4-layer Qwen3 (q/k RMSNorm per head): hidden 64, 4 query / 2 KV heads, head dim
    16."""
    torch.manual_seed(seed)
    kw = {"num_key_value_heads": 2, "max_position_embeddings": 512, "head_dim": 16, **kw}
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, **kw)
    return Qwen3ForCausalLM(cfg).eval()


def tiny_qwen2(seed: int = 0, vocab: int = 256, **kw) -> Qwen2ForCausalLM:
    """A random 4-layer Qwen2 (q/k/v biases): hidden 64, 4 query / 2 KV heads, head dim 16."""
    torch.manual_seed(seed)
    kw = {"num_key_value_heads": 2, "max_position_embeddings": 512, **kw}
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, **kw)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():       # transformers starts biases at 0: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


TARGET_FAMILIES = {"llama": tiny_target, "qwen3": tiny_qwen3, "qwen2": tiny_qwen2}


def tiny_drafter(target, seed: int = 1, block_size: int = 4, **kw) -> DFlashDrafter:
    """A random 2-layer DFlash drafter reading 2 evenly spaced layers of `target`."""
    torch.manual_seed(seed)
    cfg = DFlashConfig.from_target(target.config, mask_token_id=0, num_layers=2,
                                   block_size=block_size, num_features=2, **kw)
    return DFlashDrafter(cfg).eval()


def tiny_eagle3(target, seed: int = 2, **kw):
    """A random EAGLE-3 drafter fusing layers 0, 2 and 3 of `target`."""
    from sharpdraft.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    torch.manual_seed(seed)
    cfg = Eagle3Config.from_target(target.config, target_layer_ids=[0, 2, 3], **kw)
    return Eagle3Drafter(cfg).eval()


def tiny_pard(target, seed: int = 3, **kw):
    """A PARD drafter started from the first 2 layers of `target` (random mask embedding)."""
    from sharpdraft.drafters.pard import PARDConfig, PARDDrafter
    torch.manual_seed(seed)
    d = PARDDrafter(PARDConfig.from_target(target.config, num_layers=2, **kw))
    d.init_from_target(target)
    with torch.no_grad():
        d.mask_embedding.normal_()
    return d.eval()


def write_public_folder(folder, config: dict, state: dict, layout: str = "safetensors"):
    """A checkpoint folder in one of the public weight layouts: config.json plus
    model.safetensors ("safetensors"), two shards with model.safetensors.index.json
    ("sharded"), or a pytorch_model.bin ("bin"). Returns the folder."""
    import json
    from pathlib import Path
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if layout == "safetensors":
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    elif layout == "sharded":
        names = sorted(state)
        parts = {"model-00001-of-00002.safetensors": names[::2],
                 "model-00002-of-00002.safetensors": names[1::2]}
        for fname, keys in parts.items():
            save_file({k: state[k] for k in keys}, str(folder / fname))
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": 0},
             "weight_map": {k: f for f, ks in parts.items() for k in ks}}))
    elif layout == "bin":
        torch.save(state, folder / "pytorch_model.bin")
    else:
        raise ValueError(f"layout must be safetensors, sharded or bin, got {layout!r}")
    return folder


def q8_modules(drafter, target):
    """A copy of the drafter with every linear on Q8_0 blocks (QUANT_PATH at every row count)
    and its head as one Q8_0 quant_linear of its `draft_head_weight`: the reference a fused
    CPU draft step (`drafters.fused`) must equal bit for bit."""
    import copy

    from torch import nn

    from sharpdraft.target.linears import QUANT_PATH, pack_linears, pack_weight
    from sharpdraft_ext import cpu_runtime
    ref = copy.deepcopy(drafter)
    pack_linears(ref, {(m.out_features, m.in_features, m.weight.dtype): (QUANT_PATH,) * 3
                       for m in ref.modules() if isinstance(m, nn.Linear)})
    w = drafter.draft_head_weight(target).float()
    packed = pack_weight(w, QUANT_PATH)
    return ref, lambda h: cpu_runtime.quant_linear(h.contiguous(), packed, "q8_0", w.shape[0])


def assert_greedy_lossless(target, drafter, tree: bool, lengths=(7, 13), new_tokens: int = 24):
    """Greedy chain (or tree) speculative decoding of random prompts of `lengths` tokens (a
    seed each) gives target-only decoding's tokens on `target` (a model or a runtime)."""
    from sharpdraft.inference.engine import (autoregressive_generate, speculative_generate,
                                             tree_speculative_generate)
    run = tree_speculative_generate if tree else speculative_generate
    for seed, n in enumerate(lengths):
        prompt = torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))
        want = autoregressive_generate(target, prompt, new_tokens).tokens
        assert run(target, drafter, prompt, new_tokens).tokens == want, (seed, n)
