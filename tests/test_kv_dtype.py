"""A 16-bit KV cache in the target runtime (`RuntimePlan.kv_dtype`, SHARPDRAFT_KV_DTYPE): the
plan's field and its rule, the cache's keys as the float32 keys rounded to the dtype, the fused
decoder (`llama_layers`) and the modules writing and reading the same bits, a verification's rows
keeping the bits of the same rows decoded alone, and speculative decoding (chain and tree) over
such a cache equal to target-only decoding over it."""
import copy
import dataclasses
import json

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

import sharpdraft_ext as ext
from sharpdraft import attention
from sharpdraft.attention import SharpConfig
from sharpdraft.target.plan import RuntimePlan, auto_plan
from sharpdraft.target.quantized import QuantLinear
from sharpdraft.target.runtime import TargetRuntime
from sharpdraft_helpers import assert_greedy_lossless, tiny_eagle3, tiny_target

HALF = ("float16", "bfloat16")


def quantised(target, qtype=GGMLQuantizationType.Q8_0, name="q8_0"):
    """A copy of `target` with every decoder linear on GGUF blocks (a `QuantLinear`), so the
    runtime takes its fused decoder."""
    q = copy.deepcopy(target)
    for layer in q.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for attr, mod in list(parent.named_children()):
                if isinstance(mod, torch.nn.Linear):
                    w = mod.weight.detach().numpy()
                    blocks = torch.from_numpy(quantize(w, qtype).copy())
                    setattr(parent, attr, QuantLinear(mod, blocks, name))
    return q


@pytest.fixture(scope="module")
def targets():
    dense = tiny_target(seed=31)
    return dense, quantised(dense)


def runtime(model, kv, hidden=()):
    plan = dataclasses.replace(auto_plan(model), kv_dtype=kv)
    return TargetRuntime.prepare(model, plan, hidden_layers=hidden)


def test_the_plan_carries_the_kv_dtype_and_its_rule(targets, tmp_path, monkeypatch):
    """Unset, the auto plan keeps the model's dtype (the runtime's cache is float32 for a
    float32 model); SHARPDRAFT_KV_DTYPE chooses another, which the cache then has; a bad value
    names the variable; plan files carry the field, older ones without it load."""
    quant = targets[1]
    monkeypatch.delenv("SHARPDRAFT_KV_DTYPE", raising=False)
    rt = TargetRuntime.prepare(quant)
    assert rt.plan.kv_dtype is None and rt.info["kv_dtype"] is None
    rt.start(8)
    rt.forward(torch.tensor([[5, 6, 7]]))
    assert rt.cache.layers[0].key_buffer.dtype == torch.float32
    monkeypatch.setenv("SHARPDRAFT_KV_DTYPE", "bfloat16")
    rt = TargetRuntime.prepare(quant)
    assert auto_plan(quant).kv_dtype == "bfloat16" == rt.info["kv_dtype"]
    rt.start(8)
    rt.forward(torch.tensor([[5, 6, 7]]))
    assert rt.cache.layers[0].key_buffer.dtype == torch.bfloat16
    monkeypatch.setenv("SHARPDRAFT_KV_DTYPE", "int8")
    with pytest.raises(ValueError, match="SHARPDRAFT_KV_DTYPE"):
        auto_plan(quant)
    monkeypatch.delenv("SHARPDRAFT_KV_DTYPE")
    plan = RuntimePlan({}, True, kv_dtype="float16")
    path = plan.save(tmp_path / "p.json")
    assert json.loads(path.read_text())["kv_dtype"] == "float16"
    assert RuntimePlan.load(path) == plan
    old = {"version": 1, "fused": True, "linears": {}}               # a file from before
    path.write_text(json.dumps(old))
    assert RuntimePlan.load(path).kv_dtype is None
    path.write_text(json.dumps({**old, "kv_dtype": "fp8"}))
    with pytest.raises(ValueError, match="field 'kv_dtype'"):
        RuntimePlan.load(path)
    with pytest.raises(ValueError, match="RuntimePlan.kv_dtype"):
        RuntimePlan({}, kv_dtype="half")


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kv", HALF)
@torch.no_grad()
def test_a_16_bit_cache_holds_the_keys_rounded_and_rows_keep_their_bits(targets, kv, fused):
    """Layer 0's keys depend on the tokens only: over a 16-bit cache they are the float32
    runtime's keys rounded to that dtype, bit for bit, through the modules (a long prefill) and
    through the fused decoder alike; the two paths give the same bits for the same rows; a
    verification's rows are the bits of the same rows decoded alone; the logits stay close to
    float32's (the bits rule on the fused path, whose linears compute each row alone)."""
    model = targets[1] if fused else targets[0]
    dtype = getattr(torch, kv)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    half, full = runtime(model, kv, hidden=[2, 4]), runtime(model, "float32")
    assert (half.fused is not None) == fused
    outs = {}
    for name, rt in (("half", half), ("full", full)):
        rt.start(64)
        outs[name] = rt.forward(ids[:, :30]).logits       # <= 96 rows: fused where it applies
    a, b = half.cache.layers[0], full.cache.layers[0]
    assert a.key_buffer.dtype == dtype and b.key_buffer.dtype == torch.float32
    assert torch.equal(a.keys, b.keys.to(dtype)) and torch.equal(a.values, b.values.to(dtype))
    err = (outs["half"] - outs["full"]).abs().max() / outs["full"].abs().max()
    assert 0 < err < 0.05, err
    if not fused:      # dense linears round by row count: the bits rule is the fused path's
        return
    many = half.forward(ids[:, 30:38]).hidden         # the decoder's rows (this LM head is
    half.crop(30)                                     # dense: it rounds by row count)
    one = half.forward(ids[:, 30:31]).hidden
    for i in (2, 4):
        assert torch.equal(many[i][:, :1], one[i]), i
    # the modules over the same 16-bit cache: the same bits for these rows
    plain = TargetRuntime.prepare(model, dataclasses.replace(half.plan, fused=False))
    plain.start(64)
    assert torch.equal(plain.forward(ids[:, :30]).logits, outs["half"])
    assert torch.equal(plain.cache.layers[3].keys, half.cache.layers[3].keys[:, :, :30])


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("kv", HALF)
def test_speculative_decoding_over_a_16_bit_cache_is_lossless(targets, kv, tree):
    model = targets[1]
    drafter = tiny_eagle3(model, seed=3)
    assert_greedy_lossless(runtime(model, kv), drafter, tree, lengths=(9, 14))


def test_attention_takes_queries_into_the_caches_dtype():
    """`attention.attend` with float32 queries over 16-bit keys and values: the kernel on the
    queries rounded to that dtype, the output back in float32; close to the float32 kernel."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 3, 32, generator=g)
    k, v = torch.randn(1, 2, 20, 32, generator=g), torch.randn(1, 2, 20, 32, generator=g)
    for dtype in (torch.float16, torch.bfloat16):
        got = attention.attend(q, k.to(dtype), v.to(dtype), SharpConfig(mode="none"), causal=True)
        want = ext.sharp_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
        assert got.dtype == torch.float32 and torch.equal(got, want.float())
        full = ext.sharp_attention(q, k, v, causal=True)
        assert 0 < float((got - full).abs().max()) < 0.05
