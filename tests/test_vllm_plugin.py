"""The vLLM plugin's parts that need no vLLM (sharpdraft.integrations.vllm): settings, the
cardinality counted from vLLM-style attention metadata, beta, the per-layer scales read from a
drafter's config, and the hook around a backend's forward, checked against the kernel. The
plugin inside a real vLLM engine: tests/vllm_engine/ (scripts/vllm_test.sh)."""
import math
import sys
from types import SimpleNamespace

import pytest
import torch

import sharpdraft_ext as ext
from conftest import assert_close_spec
from sharpdraft.integrations import vllm as plugin

pytestmark = pytest.mark.usefixtures("require_ext")


# ---------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------
def test_settings_off_when_unset_or_off():
    assert plugin.settings_from_env({}) is None
    assert plugin.settings_from_env({plugin.ENV_MODE: "off"}) is None
    assert plugin.settings_from_env({plugin.ENV_MODE: " "}) is None


def test_settings_parse():
    s = plugin.settings_from_env({plugin.ENV_MODE: "Fixed_Slope", plugin.ENV_SLOPE: "0.3",
                                  plugin.ENV_N_REF: "256"})
    assert s == plugin.PluginSettings(mode="fixed_slope", slope=0.3, n_ref=256)
    assert plugin.settings_from_env({plugin.ENV_MODE: "none"}) == plugin.PluginSettings("none")


@pytest.mark.parametrize("env, names", [
    ({plugin.ENV_MODE: "sharp"}, [plugin.ENV_MODE, "fixed_slope"]),
    ({plugin.ENV_MODE: "fixed_slope", plugin.ENV_SLOPE: "nan"}, [plugin.ENV_SLOPE, "finite"]),
    ({plugin.ENV_MODE: "fixed_slope", plugin.ENV_SLOPE: "inf"}, [plugin.ENV_SLOPE, "finite"]),
    ({plugin.ENV_MODE: "fixed_slope", plugin.ENV_SLOPE: "steep"}, [plugin.ENV_SLOPE]),
    ({plugin.ENV_MODE: "fixed_slope", plugin.ENV_N_REF: "0"}, [plugin.ENV_N_REF, ">= 1"]),
    ({plugin.ENV_MODE: "fixed_slope", plugin.ENV_N_REF: "2.5"}, [plugin.ENV_N_REF]),
    ({plugin.ENV_SLOPE: "0.2"}, [plugin.ENV_SLOPE, plugin.ENV_MODE]),
])
def test_bad_settings_name_the_variable(env, names):
    with pytest.raises(ValueError) as err:
        plugin.settings_from_env(env)
    message = str(err.value)
    assert "\n" not in message and all(name in message for name in names)


def test_register_switched_off_imports_nothing(monkeypatch):
    monkeypatch.delenv(plugin.ENV_MODE, raising=False)
    monkeypatch.delenv(plugin.ENV_SLOPE, raising=False)
    monkeypatch.delenv(plugin.ENV_N_REF, raising=False)
    before = "vllm" in sys.modules
    plugin.register()
    assert ("vllm" in sys.modules) == before


def test_register_refuses_bad_settings_before_loading(monkeypatch):
    monkeypatch.setenv(plugin.ENV_MODE, "fixed_slope")
    monkeypatch.setenv(plugin.ENV_N_REF, "0")
    with pytest.raises(ValueError, match=plugin.ENV_N_REF):
        plugin.register()


# ---------------------------------------------------------------------------------------------
# cardinality
# ---------------------------------------------------------------------------------------------
def meta(qsl, seq, causal=True, **extra):
    return SimpleNamespace(query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                           seq_lens=torch.tensor(seq, dtype=torch.int32), causal=causal, **extra)


def test_cardinality_hand_derived():
    # three requests: 3 new rows of 10 keys, 1 of 5 (decode), 5 of 9 (prefill of 9 with 4
    # cached); then 2 padding rows
    m = meta([0, 3, 4, 9], [10, 5, 9])
    assert plugin.cardinality(m, 11).tolist() == [8, 9, 10, 5, 5, 6, 7, 8, 9, 1, 1]
    m.causal = False                                     # DFlash's block: every key
    assert plugin.cardinality(m, 11).tolist() == [10, 10, 10, 5, 9, 9, 9, 9, 9, 1, 1]
    m.causal = torch.tensor([1, 0, 0], dtype=torch.int32)   # per-request flags
    assert plugin.cardinality(m, 9).tolist() == [8, 9, 10, 5, 9, 9, 9, 9, 9]
    m = meta([0, 3, 4, 9], [10, 5, 9], causal=False,
             dynamic_causal=torch.tensor([0, 1, 1], dtype=torch.int32))   # vLLM CPU's field
    assert plugin.cardinality(m, 9).tolist() == [10, 10, 10, 5, 5, 6, 7, 8, 9]
    assert plugin.cardinality(meta([0, 3], [10]), 3, window=9).tolist() == [8, 9, 9]


@pytest.mark.parametrize("causal", [True, False])
def test_cardinality_matches_the_kernels_count(causal):
    # one request of L new rows over S keys: the kernel's own count (bottom-right causal)
    L, S = 5, 12
    q, k = torch.zeros(1, 2, L, 8), torch.zeros(1, 2, S, 8)
    kernel = ext.visible_counts(q, k, causal=causal)[0, 0]
    assert plugin.cardinality(meta([0, L], [S], causal), L).tolist() == kernel.tolist()


# ---------------------------------------------------------------------------------------------
# beta and the per-layer scales
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fixed_slope", "exact_topk", "none"])
def test_layer_beta_is_the_reference_beta(mode):
    n = torch.tensor([1, 7, 64, 300, 4096, 20000])
    scale = plugin.LayerScale("l", 0, mode, 0.3, 256, None)
    want = ext.reference.query_scale_ref(n, mode=mode, slope=0.3, n_ref=256)
    got = scale.beta(n, num_heads=4)
    assert got.shape == (6, 1) and got.dtype == torch.float32
    torch.testing.assert_close(got[:, 0].double(), want, rtol=1e-6, atol=0)
    if mode == "fixed_slope":                            # hand-derived: 1 + 0.3 ln(4096 / 256)
        assert got[4, 0].item() == pytest.approx(1 + 0.3 * math.log(16), rel=1e-6)
        assert got[0, 0].item() == 1.0                    # clamped at beta_min


def test_layer_beta_per_head():
    n = torch.tensor([10, 1000, 5000])
    slopes = torch.tensor([0.1, 0.4])
    got = plugin.LayerScale("l", 0, "fixed_slope", slopes, 512, None).beta(n, num_heads=2)
    assert got.shape == (3, 2)
    for h in range(2):
        want = ext.reference.query_scale_ref(n, slope=float(slopes[h]), n_ref=512)
        torch.testing.assert_close(got[:, h].double(), want, rtol=1e-6, atol=0)


NAMES = ["model.layers.31.self_attn.attn", "model.layers.30.self_attn.attn"]
HEADS = {name: 2 for name in NAMES}


def test_layer_scales_from_the_drafters_config():
    config = SimpleNamespace(train_context=512, sharp_slopes=[0.05, [0.1, 0.2]])
    scales = plugin.layer_scales(NAMES, config, plugin.PluginSettings("fixed_slope"), HEADS)
    assert [s.name for s in scales] == sorted(NAMES)      # ordered by layer; index from 0
    assert [s.index for s in scales] == [0, 1]
    assert [s.n_ref for s in scales] == [512, 512]
    assert scales[0].slope == 0.05
    assert scales[1].slope.tolist() == pytest.approx([0.1, 0.2])
    # the environment overrides the config; a config without the fields gets the defaults
    scales = plugin.layer_scales(NAMES, config, plugin.PluginSettings("exact_topk", 0.3, 64),
                                 HEADS)
    assert [(s.mode, s.slope, s.n_ref) for s in scales] == [("exact_topk", 0.3, 64)] * 2
    scales = plugin.layer_scales(NAMES, SimpleNamespace(), plugin.PluginSettings("none"), HEADS)
    assert [(s.slope, s.n_ref) for s in scales] == [(0.2, 2048)] * 2


@pytest.mark.parametrize("config, field", [
    (SimpleNamespace(sharp_slopes=[[0.1, 0.2, 0.3]]), "sharp_slopes[0]"),
    (SimpleNamespace(sharp_slopes=["x"]), "sharp_slopes[0]"),
    (SimpleNamespace(train_context=-4), "train_context"),
    (SimpleNamespace(train_context=16), "topk"),                 # exact_topk: n_ref > 32
])
def test_layer_scales_refuse_bad_config_fields(config, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        plugin.layer_scales(NAMES, config, plugin.PluginSettings("exact_topk"), HEADS)


# ---------------------------------------------------------------------------------------------
# the hook, around a stand-in backend
# ---------------------------------------------------------------------------------------------
class DenseBackend:
    """A stand-in for a vLLM attention impl: float64 softmax attention of each request's new
    rows over its keys (a cache of the keys written so far, one request, bottom-right causal
    unless the metadata says otherwise), written into `output` as vLLM's impls do."""

    def __init__(self, scale):
        self.scale = scale
        self.sliding_window = None
        self.keys = self.values = None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.keys = key if self.keys is None else torch.cat([self.keys, key])
        self.values = value if self.values is None else torch.cat([self.values, value])

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        q = query.double().transpose(0, 1)                           # (Hq, L, D)
        k = self.keys.double().transpose(0, 1).repeat_interleave(q.shape[0] // key.shape[1], 0)
        v = self.values.double().transpose(0, 1).repeat_interleave(q.shape[0] // key.shape[1], 0)
        s = self.scale * q @ k.transpose(1, 2)
        L, S = q.shape[1], k.shape[1]
        if attn_metadata.causal:
            visible = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
            s = s.masked_fill(~visible, -math.inf)
        output.copy_((s.softmax(-1) @ v).transpose(0, 1).to(output.dtype))
        return output


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["fixed_slope", "exact_topk"])
def test_hooked_backend_is_sharp_attention(causal, mode):
    torch.manual_seed(0)
    Hq, Hk, D, cached, L = 4, 2, 16, 40, 6
    impl = DenseBackend(scale=D ** -0.5)
    n_ref = 8 if mode == "fixed_slope" else 36              # exact_topk: n_ref > topk = 32
    scale = plugin.LayerScale("model.layers.0.self_attn.attn", 0, mode, 0.4, n_ref, None)
    plugin.hook_layer(SimpleNamespace(impl=impl), scale)
    plugin.hook_layer(SimpleNamespace(impl=impl), scale)           # hooking twice: once
    try:
        k0, v0 = torch.randn(cached, Hk, D), torch.randn(cached, Hk, D)
        q, k, v = torch.randn(L, Hq, D), torch.randn(L, Hk, D), torch.randn(L, Hk, D)
        events = []
        with plugin.observe(events.append):
            impl.do_kv_cache_update(None, k0, v0, None, None)
            impl.do_kv_cache_update(None, k, v, None, None)
            out = torch.empty(L, Hq, D)
            impl.forward(None, q, k, v, None, meta([0, L], [cached + L], causal), output=out)
        K, V = torch.cat([k0, k])[None].transpose(1, 2), torch.cat([v0, v])[None].transpose(1, 2)
        want = ext.sharp_attention(q[None].transpose(1, 2), K, V, causal=causal, mode=mode,
                                   slope=0.4, n_ref=n_ref, scale=D ** -0.5)[0].transpose(0, 1)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        plain = torch.empty(L, Hq, D)
        impl.forward._sharpdraft_inner(None, q, k, v, None, meta([0, L], [cached + L], causal),
                                       output=plain)
        assert (out - plain).abs().max() > 1e-3            # the scaling changed the output
        writes = [e for e in events if isinstance(e, plugin.CacheWrite)]
        calls = [e for e in events if isinstance(e, plugin.AttentionCall)]
        assert [w.key.shape[0] for w in writes] == [cached, L] and len(calls) == 1
        assert calls[0].cardinality.tolist() == (
            list(range(cached + 1, cached + L + 1)) if causal else [cached + L] * L)
        assert torch.equal(calls[0].query, q) and calls[0].softmax_scale == D ** -0.5
    finally:
        plugin.unhook_all()
    assert not hasattr(impl.forward, "_sharpdraft_inner") and not plugin.hooked_layers()


def test_hooked_backend_in_mode_none_is_the_backend():
    torch.manual_seed(1)
    impl = DenseBackend(scale=0.25)
    q, k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    impl.do_kv_cache_update(None, k, v, None, None)
    plain = impl.forward(None, q, k, v, None, meta([0, 5], [5]), output=torch.empty(5, 2, 16))
    plugin.hook_layer(SimpleNamespace(impl=impl), plugin.LayerScale("x", 0, "none", 0.4, 2, None))
    try:
        got = impl.forward(None, q, k, v, None, meta([0, 5], [5]), output=torch.empty(5, 2, 16))
        assert torch.equal(got, plain)
        plugin.hooked_layers()[0].mode = "fixed_slope"          # switched at run time
        got = impl.forward(None, q, k, v, None, meta([0, 5], [5]), output=torch.empty(5, 2, 16))
        assert not torch.equal(got, plain)
    finally:
        plugin.unhook_all()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and ext.HAS_CUDA_KERNELS else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_query_through_sdpa_is_the_kernel(device, dtype):
    """The plugin's operation in a serving dtype, on each device (CUDA where there is one): its
    beta(n_i) from vLLM-style metadata on the device, the query scaled in `dtype`, then a plain
    attention kernel (torch's SDPA, standing in for vLLM's backend) against the sharp kernel on
    the same q / k / v, both judged against the float64 reference (the tolerance rule: at most
    twice the kernel's error, plus 1e-5)."""
    g = torch.Generator().manual_seed(7)
    Hq, Hk, D, S, L = 8, 2, 64, 700, 16
    q, k, v = (torch.randn(n, h, D, generator=g) for n, h in ((L, Hq), (S, Hk), (S, Hk)))
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    m = SimpleNamespace(query_start_loc=torch.tensor([0, L], dtype=torch.int32, device=device),
                        seq_lens=torch.tensor([S], dtype=torch.int32, device=device), causal=True)
    scale = plugin.LayerScale("l", 0, "fixed_slope", 0.3, 64, None)
    n = plugin.cardinality(m, L)
    beta = scale.beta(n, Hq)
    assert n.device.type == beta.device.type == device and float(beta.min()) > 1.3
    qs = (q.float() * beta[..., None]).to(dtype)
    rows, keys = torch.arange(L, device=device), torch.arange(S, device=device)
    visible = keys[None, :] <= rows[:, None] + S - L
    dense = lambda t: t.transpose(0, 1)[None]                                   # noqa: E731
    out = torch.nn.functional.scaled_dot_product_attention(
        dense(qs), dense(k).repeat_interleave(Hq // Hk, 1), dense(v).repeat_interleave(Hq // Hk, 1),
        attn_mask=visible, scale=D ** -0.5)
    kernel = ext.sharp_attention(dense(q), dense(k), dense(v), causal=True, slope=0.3, n_ref=64)
    exact = ext.reference.sharp_attention_ref(dense(q).double().cpu(), dense(k).double().cpu(),
                                              dense(v).double().cpu(), causal=True, slope=0.3,
                                              n_ref=64)
    assert_close_spec(out.cpu(), exact, kernel.cpu(), f"plugin path {device} {dtype}")
