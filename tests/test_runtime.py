"""Target runtime (sharpdraft.target): the same numbers as the Hugging Face model's own forward
(spec §6 rule, with the model itself in float64 as the reference), a preallocated cache
that crops and keeps tree paths exactly as a fresh forward over the kept tokens, hidden states of
the asked layers only, prepacked linears equal to nn.Linear, the context-length check, a
caller's model left exactly as it was by preparation and generation, and one session per
runtime (two threads on one bare model each get their own runtime; on one runtime, the second
gets a clear error)."""
import copy
import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from conftest import assert_close_spec
from sharpdraft.attention import sharp_mask
from sharpdraft.target.kv_cache import CACHE_KWARG
from sharpdraft.inference import engine
from sharpdraft.inference.engine import autoregressive_generate, speculative_generate
from sharpdraft.target.linears import PackedLinear
from sharpdraft.target.runtime import BUSY, TargetRuntime
from sharpdraft_helpers import TARGET_FAMILIES, tiny_drafter, tiny_target
from test_engine import pristine


@pytest.fixture(scope="module")
def models():
    """(runtime on a prepared tiny target, its float32 pristine twin, a float64 twin)."""
    target = tiny_target(seed=5)
    ref32 = pristine(target)
    ref64 = copy.deepcopy(ref32).double()
    runtime = TargetRuntime.prepare(target, hidden_layers=[0, 2, 4])
    return runtime, ref32, ref64


def _tree_mask(P: int):
    """Root (the last committed token, at P) + 4 nodes: 0 and 1 children of the root, 2 of 0, 3
    of 2. Returns the (5, P + 5) bool mask (prefix, root, ancestors, self) and node depths."""
    parents, depths = [-1, -1, 0, 2], [1, 1, 2, 3]
    mask = torch.zeros(5, P + 5, dtype=torch.bool)
    mask[:, :P + 1] = True
    for i, p in enumerate(parents):
        mask[1 + i, P + 1 + i] = True
        while p >= 0:
            mask[1 + i, P + 1 + p] = True
            p = parents[p]
    return mask, depths


def _hf(model, ids, cache, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **{CACHE_KWARG: cache}, use_cache=True,
                     output_hidden_states=True, **kw)


def test_target_attention_is_never_scaled(models):
    runtime, _, _ = models
    assert runtime.model.config._attn_implementation == "sharp"
    assert runtime.model.config.sharp_config["mode"] == "none"


def test_prefill_chain_and_tree_steps_match_the_hf_forward(models):
    runtime, ref32, ref64 = models
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (1, 37), generator=g)
    c32, c64 = DynamicCache(), DynamicCache()
    runtime.start(128)
    out = runtime.forward(prompt, last_only=True)
    r32, r64 = _hf(ref32, prompt, c32), _hf(ref64, prompt, c64)
    assert out.logits.shape == (1, 256)
    assert_close_spec(out.logits[-1], r64.logits[0, -1], r32.logits[0, -1], "prefill logits")
    assert sorted(out.hidden) == [0, 2, 4]
    for i, h in out.hidden.items():
        assert_close_spec(h, r64.hidden_states[i], r32.hidden_states[i], f"hidden {i}")
    # a chain verification of 6 rows
    block = torch.randint(0, 256, (1, 6), generator=g)
    out = runtime.forward(block)
    r32, r64 = _hf(ref32, block, c32), _hf(ref64, block, c64)
    assert_close_spec(out.logits, r64.logits[0], r32.logits[0], "chain logits")
    # a tree over [last ; 4 nodes]: node 0 and 1 children of the root, 2 of 0, 3 of 2
    P = runtime.length
    mask, depths = _tree_mask(P)
    pos = torch.tensor([[P] + [P + d for d in depths]])
    tree = torch.randint(0, 256, (1, 5), generator=g)
    out = runtime.forward(tree, attention_mask=mask[None, None], position_ids=pos)
    r32 = _hf(ref32, tree, c32, attention_mask=mask[None, None], position_ids=pos)
    r64 = _hf(ref64, tree, c64, attention_mask=mask[None, None], position_ids=pos)
    assert_close_spec(out.logits, r64.logits[0], r32.logits[0], "tree logits")


def _fresh_cache_rows(ref64, ids):
    cache = DynamicCache()
    _hf(ref64, ids, cache)
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_crop_and_keep_leave_the_cache_of_a_fresh_forward(models):
    runtime, _, ref64 = models
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (1, 20), generator=g)
    runtime.start(64)
    runtime.forward(prompt, last_only=True)
    block = torch.randint(0, 256, (1, 7), generator=g)
    runtime.forward(block)
    runtime.crop(23)                               # keep the first 3 rows of the block
    assert runtime.length == 23
    kept = torch.cat([prompt, block[:, :3]], 1)
    # a tree step: root + nodes (chain 0 -> 2 -> 3 with a sibling 1), keep the path 0, 2, 3
    P = runtime.length
    mask, depths = _tree_mask(P)
    tree = torch.randint(0, 256, (1, 5), generator=g)
    pos = torch.tensor([[P] + [P + d for d in depths]])
    runtime.forward(tree, attention_mask=mask[None, None], position_ids=pos)
    runtime.keep(P + 1, [0, 2, 3])
    assert runtime.length == P + 4
    kept = torch.cat([kept, tree[:, [0, 1, 3, 4]]], 1)
    fresh = _fresh_cache_rows(ref64, kept)
    for layer, (k64, v64) in zip(runtime.cache.layers, fresh):
        assert layer.keys.shape == k64.shape
        torch.testing.assert_close(layer.keys.double(), k64, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer.values.double(), v64, rtol=1e-4, atol=1e-5)


def test_cache_capacity_is_enforced(models):
    runtime, _, _ = models
    runtime.start(8)
    runtime.forward(torch.arange(1, 7)[None], last_only=True)
    with pytest.raises(RuntimeError, match="capacity"):
        runtime.forward(torch.arange(1, 4)[None])


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(48, 40, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 48, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(40, generator=g))
    packed = PackedLinear(lin, use_packed=(True, True, True))
    assert packed.weight is lin.weight               # parameters shared (tying survives)
    x = torch.randn(1, rows, 48, generator=g)
    ref64 = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else
                     lin.bias.double())
    with torch.no_grad():
        assert_close_spec(packed(x), ref64, lin(x), "packed linear")
    # autograd takes F.linear: gradients flow
    x.requires_grad_(True)
    packed(x).sum().backward()
    torch.testing.assert_close(x.grad[0], lin.weight.sum(0).expand(rows, 48))


def test_sharp_mask_skips_only_the_plain_causal_mask():
    assert sharp_mask(1, 4, 10, q_offset=6) is None                 # queries on the last keys
    padded = torch.ones(1, 10, dtype=torch.bool)
    padded[0, 2] = False
    m = sharp_mask(1, 4, 10, q_offset=6, attention_mask=padded)
    want = torch.ones(4, 10, dtype=torch.bool).tril(6)
    want[:, 2] = False
    assert torch.equal(m[0, 0], want)
    assert sharp_mask(1, 4, 10, q_offset=6, attention_mask=torch.ones(1, 10,
                                                                       dtype=torch.bool)) is None


def snapshot(model) -> dict:
    """What preparing or generating must leave as it was: every module's type and attribute
    names, the config (attention implementation included), each parameter's and buffer's
    identity and storage, a QuantLinear's packed blocks, and the state_dict's values."""
    from sharpdraft.target.quantized import QuantLinear

    return {"modules": [(name, type(m), sorted(vars(m))) for name, m in model.named_modules()],
            "config": model.config.to_dict(), "attn": model.config._attn_implementation,
            "sharp_config": hasattr(model.config, "sharp_config"),
            "tensors": [(name, id(t), t.data_ptr()) for name, t in
                        [*model.named_parameters(), *model.named_buffers()]],
            "packed": [(name, id(m.packed), m.packed.data_ptr(), m.packed._base is None)
                       for name, m in model.named_modules() if isinstance(m, QuantLinear)],
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def assert_unchanged(before: dict, after: dict) -> None:
    state_a, state_b = before.pop("state"), after.pop("state")
    assert before == after
    assert list(state_a) == list(state_b)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


@pytest.mark.parametrize("family", sorted(TARGET_FAMILIES))
def test_prepare_and_generate_leave_the_model_as_it_was(family):
    target = TARGET_FAMILIES[family](seed=6)
    before = snapshot(target)
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(6))
    runtime = TargetRuntime.prepare(target)
    want = autoregressive_generate(runtime, prompt, 6).tokens
    assert autoregressive_generate(target, prompt, 6).tokens == want      # a bare model too
    assert speculative_generate(target, tiny_drafter(target), prompt, 6).tokens == want
    assert not hasattr(target, "_sharpdraft_runtime")
    assert_unchanged(before, snapshot(target))
    # the runtime's copy: its own modules and config, the model's very tensors
    twin = runtime.model
    assert twin.config is not target.config and twin.config._attn_implementation == "sharp"
    assert any(isinstance(m, PackedLinear) for m in twin.modules())
    assert [id(p) for p in twin.parameters()] == [id(p) for p in target.parameters()]
    assert [id(b) for b in twin.buffers()] == [id(b) for b in target.buffers()]
    assert (twin.lm_head.weight is twin.model.embed_tokens.weight) == \
        (target.lm_head.weight is target.model.embed_tokens.weight)
    assert list(runtime.info) == ["linear_plan", "packed_linears", "fused_layers", "kv_dtype"]


def test_engine_keeps_a_runtime_per_model_and_lets_it_go_with_the_model():
    target = tiny_target(seed=9)
    prompt = torch.arange(1, 9)[None]
    first = autoregressive_generate(target, prompt, 4).tokens
    (runtime,) = engine._RUNTIMES[target][1]
    assert autoregressive_generate(target, prompt, 4).tokens == first
    assert engine._RUNTIMES[target][1] == [runtime] and not runtime.busy     # reused, freed
    # a parameter replaced: the kept runtime no longer fits, a fresh one is prepared
    norm = target.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 3)
    want = autoregressive_generate(TargetRuntime.prepare(target), prompt, 4).tokens
    assert autoregressive_generate(target, prompt, 4).tokens == want
    assert engine._RUNTIMES[target][1] != [runtime]
    ref = weakref.ref(target)
    del target, runtime
    gc.collect()
    assert ref() is None                          # the kept runtimes hold no reference to it


def _generate_in_threads(fns):
    """Run each fn in its own thread; returns their results (re-raising the first error)."""
    results, errors = [None] * len(fns), []

    def run(i):
        try:
            results[i] = fns[i]()
        except BaseException as err:          # noqa: B902 (re-raised in the main thread)
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return results


def test_two_threads_on_one_bare_model_each_get_their_own_runtime():
    """Both threads are inside a generation at once (a barrier after each one's first token):
    the second finds the kept runtime busy and gets a fresh one; both outputs are the
    single-threaded output."""
    target = tiny_target(seed=10)
    prompt = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(10))
    want = autoregressive_generate(target, prompt, 12).tokens
    barrier = threading.Barrier(2, timeout=60)

    def generate():
        seen = []

        def progress(n):
            if not seen:
                seen.append(n)
                barrier.wait()                # both hold a runtime here
        return autoregressive_generate(target, prompt, 12, progress=progress).tokens

    assert _generate_in_threads([generate, generate]) == [want, want]
    runtimes = engine._RUNTIMES[target][1]
    assert len(runtimes) == 2 and not any(rt.busy for rt in runtimes)


def test_two_threads_on_one_runtime_the_second_gets_a_clear_error():
    target = tiny_target(seed=11)
    prompt = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(11))
    runtime = TargetRuntime.prepare(target)
    want = autoregressive_generate(runtime, prompt, 8).tokens
    inside, release = threading.Event(), threading.Event()

    def progress(n):
        inside.set()
        assert release.wait(60)

    def first():
        return autoregressive_generate(runtime, prompt, 8, progress=progress).tokens

    def second():
        assert inside.wait(60)
        try:
            with pytest.raises(RuntimeError, match="in use by another generation") as err:
                autoregressive_generate(runtime, prompt, 8)
            assert str(err.value) == BUSY
            with pytest.raises(RuntimeError, match="in use by another generation"):
                runtime.start(16)
            with pytest.raises(RuntimeError, match="in use by another generation"):
                runtime.forward(prompt)
            with pytest.raises(RuntimeError, match="another thread"):
                runtime.finish()
        finally:
            release.set()
        return "refused"

    assert _generate_in_threads([first, second]) == [want, "refused"]
    assert not runtime.busy
    assert autoregressive_generate(runtime, prompt, 8).tokens == want     # free again


def test_a_session_ends_on_errors_and_with_its_thread():
    target = tiny_target(seed=12)
    runtime = TargetRuntime.prepare(target)
    prompt = torch.arange(1, 9)[None]

    def fail(n):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        autoregressive_generate(runtime, prompt, 8, progress=fail)
    assert not runtime.busy and runtime.cache is None
    # a thread that starts a session and ends without finishing does not hold it
    _generate_in_threads([lambda: runtime.start(8)])
    runtime.start(8)
    runtime.finish()
    # a generation nested in another on the same thread: the bare model gets a second runtime
    want = autoregressive_generate(target, prompt, 6).tokens
    inner = []
    outer = autoregressive_generate(
        target, prompt, 6,
        progress=lambda n: inner or inner.append(autoregressive_generate(target, prompt, 6)))
    assert outer.tokens == inner[0].tokens == want
    with runtime.session(8):
        with pytest.raises(RuntimeError, match="in use by another generation"):
            autoregressive_generate(runtime, prompt, 6)     # a session is already open


def test_engine_refuses_generations_past_the_context():
    target = tiny_target(seed=7)                     # max_position_embeddings 512
    prompt = torch.randint(0, 256, (1, 500))
    with pytest.raises(ValueError, match="max_new_tokens.*512"):
        autoregressive_generate(target, prompt, 13)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        speculative_generate(target, tiny_drafter(target), prompt, 20)
    assert len(autoregressive_generate(target, prompt, 12).tokens) == 12


def test_packed_linear_follows_in_place_weight_updates():
    """An optimizer step changes the weight in place: the packed copy must not go stale."""
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(32, 24, bias=False)
    packed = PackedLinear(lin, use_packed=(True, True, True))
    x = torch.randn(5, 32, generator=g)
    with torch.no_grad():
        before = packed(x)
        lin.weight.add_(torch.randn(24, 32, generator=g))
        after = packed(x)
    ref = x.double() @ lin.weight.double().t()
    assert (before.double() - ref).abs().max() > 0.1          # the update mattered
    torch.testing.assert_close(after.double(), ref, rtol=1e-5, atol=1e-5)


def test_draft_head_tracks_the_target_head():
    from sharpdraft_helpers import tiny_eagle3
    target = tiny_target(seed=8)
    drafter = tiny_eagle3(target, draft_vocab_size=40)
    drafter.set_draft_vocab(torch.arange(40).flip(0) * 3)
    h = torch.randn(3, 64)
    head = target.get_output_embeddings()
    with torch.no_grad():
        want = h @ head.weight[drafter.d2t].t()
        torch.testing.assert_close(drafter.head(target, h), want, rtol=1e-5, atol=1e-5)
        head.weight.mul_(2.0)                       # the cached rows must follow
        torch.testing.assert_close(drafter.head(target, h), 2 * want, rtol=1e-5, atol=1e-5)


def test_packed_linear_follows_a_dtype_cast():
    """Cast after packing (model.to(bfloat16)): the output is the bfloat16 layer's, packed where
    oneDNN can and F.linear elsewhere."""
    g = torch.Generator().manual_seed(4)
    lin = torch.nn.Linear(32, 24, bias=False)
    packed = PackedLinear(lin, use_packed=(True, True, True)).to(torch.bfloat16)
    x = torch.randn(5, 32, generator=g).bfloat16()
    with torch.no_grad():
        out = packed(x)
        want = F.linear(x, lin.weight)
    assert out.dtype == torch.bfloat16
    ref64 = x.double() @ lin.weight.double().t()
    assert_close_spec(out, ref64, want, "cast packed linear", atol=1e-2)
