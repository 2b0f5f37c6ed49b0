"""The target on its GGUF file's quantised blocks (sharpdraft.target.quantized): the blocks decode
to exactly the weights transformers dequantises from the same file (names, llama's q / k row
order), the loaded model runs every linear through them, speculative decoding on it is
token-identical to target-only decoding on it (the lossless engine), it stays close to the
float32 model on held-out text, a truncated or corrupt GGUF is refused with nothing written, and
`QuantLinear` takes the quantised kernel for every step-sized call and F.linear past it."""
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sharpdraft.data.tasks import user_tasks
from sharpdraft.drafters.loading import load_drafter
from sharpdraft.inference.engine import autoregressive_generate, speculative_generate
from sharpdraft.target import quantized
from sharpdraft.target.kv_cache import CACHE_KWARG
from sharpdraft.target.loading import default_gguf, load_target, resolve_target
from sharpdraft.data.prompts import render
from sharpdraft_ext import cpu_runtime


@pytest.fixture(scope="module")
def gguf_path(require_smollm2):
    return default_gguf()[0]


@pytest.fixture(scope="module")
def models(gguf_path):
    """(float32 target, the same target on its GGUF blocks, tokenizer, provenance)."""
    dense, tokenizer, _ = load_target()
    quant, _, info = load_target(weights="gguf")
    return dense, quant, tokenizer, info


def test_blocks_hold_exactly_what_transformers_dequantises(gguf_path, models):
    dense = models[0]
    blocks = quantized.gguf_blocks(gguf_path)
    params = dict(dense.named_parameters())
    assert len(blocks) == 30 * 7 + 1          # every decoder linear and the tied LM head
    for name, (b, qtype) in blocks.items():
        w = params[f"{name}.weight"] if name != "lm_head" else dense.lm_head.weight
        packed = cpu_runtime.quant_pack(b, qtype, *w.shape)
        assert torch.equal(cpu_runtime.quant_unpack(packed, qtype, w.shape[0]), w.detach()), name


def test_loaded_model_runs_on_the_blocks(models):
    _, quant, _, info = models
    assert info["weights"] == "gguf" and info["dtype"] == "float32"
    assert info["quantised_linears"] == {"q4_1": 210, "q8_0": 1}
    mods = [m for m in quant.modules() if isinstance(m, quantized.QuantLinear)]
    assert len(mods) == 211 and quant.get_output_embeddings().qtype == "q8_0"
    folder, _ = resolve_target()
    assert (folder / quantized.BLOCKS_FILE.format("gguf")).exists()
    assert not [p for p in (folder / "sharpdraft_quant").iterdir() if p.name.startswith(".tmp")]
    assert not list(folder.glob("quant*.safetensors"))   # only the checkpoint's own shards there


def _prompt(tokenizer, task: int = 1):
    return torch.tensor([render(tokenizer, [{"role": "user", "content": user_tasks()[task].user}])])


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_speculative_decoding_on_the_blocks_is_lossless(models, kind, kv, monkeypatch):
    """Over a float32 and a float16 KV cache (`RuntimePlan.kv_dtype`)."""
    from sharpdraft.target.runtime import TargetRuntime

    _, quant, tokenizer, _ = models
    monkeypatch.setenv("SHARPDRAFT_KV_DTYPE", kv)
    runtime = TargetRuntime.prepare(quant)
    assert runtime.info["kv_dtype"] == kv
    ids = _prompt(tokenizer)
    base = autoregressive_generate(runtime, ids, 40)
    drafter = load_drafter(kind, quant)
    spec = speculative_generate(runtime, drafter, ids, 40)
    assert spec.tokens == base.tokens
    assert spec.tau > 1.0                    # it drafted and was accepted at least once


def test_quantised_model_stays_close_to_float32_on_held_out_text(models):
    """Teacher-forced on a held-out licence text: next-token agreement with the float32 model
    and perplexity within a few percent of it (int8 activations cost little at Q4_1)."""
    dense, quant, tokenizer, _ = models
    text = Path("/usr/share/common-licenses/Apache-2.0").read_text()[:3000]
    ids = torch.tensor([tokenizer(text)["input_ids"][:400]])
    with torch.no_grad():
        # rows <= QUANT_MAX_ROWS take the quantised kernel: feed the text in step-sized chunks
        from transformers import DynamicCache

        cache = DynamicCache()
        chunks = [quant(input_ids=ids[:, i:i + 64], **{CACHE_KWARG: cache}, use_cache=True).logits
                  for i in range(0, ids.shape[1], 64)]
        lq = torch.cat(chunks, 1)[0, :-1]
        ld = dense(input_ids=ids).logits[0, :-1]
    target = ids[0, 1:]
    agree = float((lq.argmax(-1) == ld.argmax(-1)).float().mean())
    ppl_q = float(F.cross_entropy(lq, target).exp())
    ppl_d = float(F.cross_entropy(ld, target).exp())
    assert agree >= 0.9, agree
    assert abs(ppl_q / ppl_d - 1) < 0.05, (ppl_q, ppl_d)


def test_quant_linear_paths_by_rows(models):
    quant = models[1]
    mod = quant.model.layers[0].mlp.down_proj
    g = torch.Generator().manual_seed(0)
    step = torch.randn(1, 8, mod.in_features, generator=g)
    with torch.no_grad():
        assert torch.equal(mod(step), cpu_runtime.quant_linear(step, mod.packed, "q4_1",
                                                              mod.out_features))
        long = torch.randn(quantized.QUANT_MAX_ROWS + 1, mod.in_features, generator=g)
        assert torch.equal(mod(long), F.linear(long, mod.weight))


@pytest.mark.parametrize("damage", ["truncated", "bad magic"])
def test_a_damaged_gguf_is_refused_with_nothing_written(gguf_path, tmp_path, monkeypatch, damage):
    home = tmp_path / "home"
    monkeypatch.setenv("SHARPDRAFT_HOME", str(home))
    bad = tmp_path / "model.gguf"
    if damage == "truncated":
        with open(gguf_path, "rb") as src, open(bad, "wb") as dst:
            dst.write(src.read(os.path.getsize(gguf_path) // 2))
    else:
        shutil.copyfile(gguf_path, bad)
        with open(bad, "r+b") as f:
            f.write(b"XXXX")
    with pytest.raises(ValueError, match="model.gguf: not a complete GGUF file"):
        load_target(str(bad))
    assert not (home / "targets").exists() or not any((home / "targets").iterdir())


def test_bad_weights_argument_is_named():
    with pytest.raises(ValueError, match="weights: 'q5_k'"):
        load_target(weights="q5_k")


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_fused_layers_equal_the_modules_and_compute_each_row_alone(models, monkeypatch, kv):
    """The one-call decoder (`fused`, taken by every step-sized forward of this model) against
    the same model through its Hugging Face modules (SHARPDRAFT_FUSED_LAYERS=0): the same
    logits and hidden states up to float32 rounding; and a verification's first row is the
    same bits as a decode step of that token alone (what losslessness needs); over a float32
    and a float16 KV cache."""
    from sharpdraft.target.runtime import TargetRuntime

    monkeypatch.setenv("SHARPDRAFT_KV_DTYPE", kv)
    quant, tokenizer = models[1], models[2]
    ids = _prompt(tokenizer, 2)[:, :400]
    fused = TargetRuntime.prepare(quant, hidden_layers=[0, 7, 30])
    assert fused.fused is not None and fused.info["fused_layers"]
    assert fused.info["kv_dtype"] == kv
    monkeypatch.setenv("SHARPDRAFT_FUSED_LAYERS", "0")
    plain = TargetRuntime.prepare(quant, hidden_layers=[0, 7, 30])
    assert plain.fused is None and not plain.info["fused_layers"]
    outs = []
    for rt in (fused, plain):
        rt.start(512)
        rt.forward(ids[:, :300], last_only=True)           # the prefill (> QUANT_MAX_ROWS rows)
        outs.append(rt.forward(ids[:, 300:340]))           # a step-sized forward
    a, b = outs
    # The two round differently at the 1e-6 level, and an int8 activation that sits on a
    # rounding boundary then moves by a whole step (dx = max|x| / 127) in one path only: rows
    # agree closely, not bitwise, and the next-token choice almost everywhere.
    assert torch.equal(a.hidden[0], b.hidden[0])
    for i in (7, 30):
        rel = (a.hidden[i] - b.hidden[i]).norm(dim=-1) / b.hidden[i].norm(dim=-1)
        assert float(rel.median()) < 1e-3 and float(rel.max()) < 0.1, (i, rel)
    agree = float((a.logits.argmax(-1) == b.logits.argmax(-1)).float().mean())
    assert agree >= 0.9, agree
    # row independence: 8 rows verified at once vs the first of them decoded alone
    fused.crop(340)
    many = fused.forward(ids[:, 340:348]).logits[0]
    fused.crop(340)
    one = fused.forward(ids[:, 340:341]).logits[0]
    assert torch.equal(many, one)


def test_batched_generation_on_the_blocks_is_target_only_decoding(models):
    """`generate_batch` on a target with fused layers (the unpadded path: each prompt prefilled
    alone, one `llama_layers` row per sequence at its own position) gives every prompt the
    runtime's own target-only greedy response, token for token: prompts of different lengths,
    one prefilled through the modules (> QUANT_MAX_ROWS tokens), and an EOS that ends one row
    early so the batch is compacted mid-way."""
    from sharpdraft.inference.batched import generate_batch

    quant, tokenizer = models[1], models[2]
    prompts = [_prompt(tokenizer, t)[0].tolist() for t in range(3)]
    prompts.append(prompts[0][:12])
    assert max(map(len, prompts)) > quantized.QUANT_MAX_ROWS > min(map(len, prompts))
    alone = [autoregressive_generate(quant, torch.tensor([p]), 20).tokens for p in prompts]
    eos = alone[1][4]                 # row 1 ends after 5 tokens: 3 of 4 rows live, compacted
    alone = [autoregressive_generate(quant, torch.tensor([p]), 20, eos_token_id=eos).tokens
             for p in prompts]
    assert len(alone[1]) == 5 and max(map(len, alone)) == 20
    batched = generate_batch(quant, prompts, 20, pad_token_id=0, eos_token_id=eos)
    assert batched == alone


def test_the_runtime_leaves_the_gguf_target_as_it_was(models):
    """Preparing the fused runtime and decoding through it (and through the bare model) leave
    the loaded target as it was: its QuantLinears keep their own packed blocks (not views of
    the runtime's fused q/k/v and gate/up packs), its modules, config and tensors too."""
    from sharpdraft.target.runtime import TargetRuntime
    from test_runtime import assert_unchanged, snapshot

    quant, tokenizer = models[1], models[2]
    before = snapshot(quant)
    runtime = TargetRuntime.prepare(quant)
    assert runtime.fused is not None
    ids = _prompt(tokenizer, 1)[:, :40]
    want = autoregressive_generate(runtime, ids, 4).tokens
    assert autoregressive_generate(quant, ids, 4).tokens == want
    assert not hasattr(quant, "_sharpdraft_runtime")
    assert_unchanged(before, snapshot(quant))
    q = quant.model.layers[0].self_attn.q_proj
    fused_q = runtime.model.model.layers[0].self_attn.q_proj
    assert fused_q is not q and fused_q.packed._base is runtime.fused.qkv[0]
    assert q.packed.data_ptr() != runtime.fused.qkv[0].data_ptr()


def test_batched_llama_layers_refuses_bad_seq_starts(models):
    from sharpdraft.target.runtime import TargetRuntime

    f = TargetRuntime.prepare(models[1]).fused
    x = torch.randn(2, 576)
    cos, sin = torch.ones(2, f.head_dim), torch.zeros(2, f.head_dim)
    cache = [torch.zeros(2, f.num_kv_heads, 8, f.head_dim) for _ in f.qkv]
    args = (x, cos, sin, cache, cache, 0)
    rest = (f.input_norm, f.post_norm, f.qkv, f.o_proj, f.gate_up, f.down, f.qtypes,
            f.num_heads, f.num_kv_heads, f.head_dim, f.intermediate_size, f.eps, [])
    op = cpu_runtime.llama_layers
    with pytest.raises(ValueError, match="seq_starts must be >= 0"):
        op(*args, None, *rest, torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="seq_starts must be an int64"):
        op(*args, None, *rest, torch.tensor([3]))
    with pytest.raises(ValueError, match="exclude each other"):
        op(*args, torch.ones(1, 1, 2, 8, dtype=torch.bool), *rest, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="capacity >= 9"):
        op(*args, None, *rest, torch.tensor([3, 8]))
    out = op(*args, None, *rest, torch.tensor([3, 5]))[0]
    assert out.shape == (2, 576) and bool(torch.isfinite(out).all())
