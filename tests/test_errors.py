"""spec §5: every bad input raises (ValueError or RuntimeError) with the argument named.

Each case starts from a valid call (checked to succeed) and breaks exactly one argument.
"""

from __future__ import annotations


import pytest
import torch

from conftest import load_ext, make_gen, make_qkv, make_varlen_qkv, ref

ext, _ = load_ext()
pytestmark = pytest.mark.usefixtures("require_ext")

ERR = (RuntimeError, ValueError)
B, HQ, HK, LQ, LK, D = 2, 4, 2, 5, 9, 32


def name_re(*names):
    """A regex matching any of the argument names as a whole word."""
    return r"(?<![A-Za-z0-9_])(" + "|".join(names) + r")(?![A-Za-z0-9_])"


@pytest.fixture(scope="module")
def dense():
    q, k, v = make_qkv(B, HQ, HK, LQ, LK, D, torch.float32, make_gen(1))
    return q, k, v


@pytest.fixture(scope="module")
def packed():
    return make_varlen_qkv([3, 0, 5], [4, 2, 7], HQ, HK, D, torch.float32, make_gen(2))


def test_valid_calls_succeed(dense, packed):
    q, k, v = dense
    kl = torch.tensor([9, 4], dtype=torch.int32)
    out = ext.sharp_attention(q, k, v, causal=True, window=3, kv_lens=kl,
                              attn_mask=torch.ones(LQ, LK, dtype=torch.bool), mode="exact_topk",
                              n_ref=8, topk=7, slope=torch.full((HQ,), 0.3), beta_min=1.0,
                              beta_max=1.0, n_visible=torch.tensor(5), scale=0.1)
    assert out.shape == q.shape and torch.isfinite(out).all()
    qp, kp, vp, cu_q, cu_k = packed
    out = ext.sharp_attention_varlen(qp, kp, vp, cu_q, cu_k, causal=True)
    assert out.shape == qp.shape


# (description, keyword changes applied to the valid dense call, argument names to match)
def _dense_cases():
    g = make_gen(3)
    q, k, v = make_qkv(B, HQ, HK, LQ, LK, D, torch.float32, g)
    t = lambda *s, dt=torch.float32: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    return [
        ("q rank 3", dict(q=q[0]), ("q",)),
        ("k rank 5", dict(k=k[None]), ("k",)),
        ("v rank 3", dict(v=v[0]), ("v",)),
        ("k batch", dict(k=t(B + 1, HK, LK, D), v=t(B + 1, HK, LK, D)), ("k", "v")),
        ("v batch", dict(v=t(B + 1, HK, LK, D)), ("v",)),
        ("v length", dict(v=t(B, HK, LK + 1, D)), ("v",)),
        ("v heads", dict(v=t(B, HK + 1, LK, D)), ("v",)),
        ("k head dim", dict(k=t(B, HK, LK, D + 1)), ("k", "v", "q")),
        ("v head dim", dict(v=t(B, HK, LK, D // 2)), ("v", "k")),
        ("Hq % Hk", dict(k=t(B, 3, LK, D), v=t(B, 3, LK, D)), ("q", "k")),
        ("Hk > Hq", dict(k=t(B, 8, LK, D), v=t(B, 8, LK, D)), ("q", "k")),
        ("k dtype", dict(k=k.half()), ("k",)),
        ("v dtype", dict(v=v.bfloat16()), ("v",)),
        ("float64", dict(q=q.double(), k=k.double(), v=v.double()), ("q",)),
        ("int32", dict(q=q.int(), k=k.int(), v=v.int()), ("q",)),
        ("head dim 272", dict(q=t(B, HQ, LQ, 272), k=t(B, HK, LK, 272), v=t(B, HK, LK, 272)),
         ("q",)),
        ("q last stride", dict(q=t(B, HQ, D, LQ).transpose(-1, -2)), ("q",)),
        ("k last stride", dict(k=t(B, HK, D, LK).transpose(-1, -2)), ("k",)),
        ("window without causal", dict(window=4), ("window",)),
        ("window 0", dict(causal=True, window=0), ("window",)),
        ("window -3", dict(causal=True, window=-3), ("window",)),
        ("kv_lens > Lk", dict(kv_lens=torch.tensor([LK + 1, 2], dtype=torch.int32)), ("kv_lens",)),
        ("kv_lens < 0", dict(kv_lens=torch.tensor([3, -1], dtype=torch.int32)), ("kv_lens",)),
        ("kv_lens shape", dict(kv_lens=torch.tensor([3, 3, 3], dtype=torch.int32)), ("kv_lens",)),
        ("kv_lens float", dict(kv_lens=torch.tensor([3.0, 3.0])), ("kv_lens",)),
        ("attn_mask float", dict(attn_mask=torch.ones(LQ, LK)), ("attn_mask",)),
        ("attn_mask int", dict(attn_mask=torch.ones(LQ, LK, dtype=torch.int32)), ("attn_mask",)),
        ("attn_mask shape", dict(attn_mask=torch.ones(LQ + 1, LK, dtype=torch.bool)),
         ("attn_mask",)),
        ("attn_mask heads", dict(attn_mask=torch.ones(B, 3, LQ, LK, dtype=torch.bool)),
         ("attn_mask",)),
        ("attn_mask rank 5", dict(attn_mask=torch.ones(1, B, HQ, LQ, LK, dtype=torch.bool)),
         ("attn_mask",)),
        ("n_ref 0", dict(n_ref=0), ("n_ref",)),
        ("n_ref -5", dict(n_ref=-5, mode="exact_topk", topk=1), ("n_ref", "topk")),
        ("topk == n_ref", dict(mode="exact_topk", n_ref=32, topk=32), ("topk", "n_ref")),
        ("topk > n_ref", dict(mode="exact_topk", n_ref=16, topk=40), ("topk", "n_ref")),
        ("slope nan", dict(slope=float("nan")), ("slope",)),
        ("slope inf", dict(slope=float("inf")), ("slope",)),
        ("slope tensor inf", dict(slope=torch.tensor([0.1, float("inf"), 0.1, 0.1])), ("slope",)),
        ("slope tensor shape", dict(slope=torch.full((HQ + 1,), 0.2)), ("slope",)),
        ("slope tensor 2-D", dict(slope=torch.full((1, HQ), 0.2)), ("slope",)),
        ("contrast 0", dict(mode="exact_topk", contrast=0.0), ("contrast",)),
        ("contrast < 0", dict(mode="exact_topk", contrast=-2.0), ("contrast",)),
        ("contrast inf", dict(mode="exact_topk", contrast=float("inf")), ("contrast",)),
        ("contrast nan", dict(mode="exact_topk", contrast=float("nan")), ("contrast",)),
        ("scale nan", dict(scale=float("nan")), ("scale",)),
        ("scale inf", dict(scale=float("inf")), ("scale",)),
        ("beta_min > beta_max", dict(beta_min=2.0, beta_max=1.5), ("beta_min", "beta_max")),
        ("beta_min nan", dict(beta_min=float("nan")), ("beta_min", "beta_max")),
        # non-finite beta bounds that give a non-finite beta (once all-NaN outputs)
        ("beta_min = beta_max = inf", dict(beta_min=float("inf"), beta_max=float("inf")),
         ("beta_min",)),
        ("beta_min -inf", dict(beta_min=float("-inf")), ("beta_min",)),
        ("beta_min -inf, n_visible 0", dict(beta_min=float("-inf"), n_visible=0),
         ("beta_min",)),
        ("beta_max -inf", dict(beta_min=-1.0, beta_max=float("-inf")), ("beta_max",)),
        ("beta_max nan", dict(beta_max=float("nan")), ("beta_max",)),
        ("unknown mode", dict(mode="sharpest"), ("mode",)),
        ("mode case", dict(mode="Fixed_Slope"), ("mode",)),
        ("n_visible shape", dict(n_visible=torch.ones(B, HQ, LQ + 2, dtype=torch.int64)),
         ("n_visible",)),
        ("n_visible float", dict(n_visible=torch.full((B, HQ, LQ), 3.0)), ("n_visible",)),
    ]


DENSE_CASES = _dense_cases()


@pytest.mark.parametrize("desc,change,names", DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
def test_dense_errors(dense, desc, change, names):
    q, k, v = dense
    args = dict(q=q, k=k, v=v)
    kw = {}
    for key, val in change.items():
        (args if key in ("q", "k", "v") else kw)[key] = val
    with pytest.raises(ERR, match=name_re(*names)):
        ext.sharp_attention(args["q"], args["k"], args["v"], **kw)


@pytest.mark.parametrize("desc,change,names",
                         [c for c in DENSE_CASES if not set(c[1]) & {"q", "k", "v", "kv_lens",
                                                                     "attn_mask", "n_visible"}],
                         ids=lambda x: x if isinstance(x, str) else None)
def test_dense_errors_with_return_lse(dense, desc, change, names):
    q, k, v = dense
    with pytest.raises(ERR, match=name_re(*names)):
        ext.sharp_attention(q, k, v, return_lse=True, **change)


def _varlen_cases():
    g = make_gen(4)
    q, k, v, cu_q, cu_k = make_varlen_qkv([3, 0, 5], [4, 2, 7], HQ, HK, D, torch.float32, g)
    return [
        ("q rank 4", dict(q=q[None]), ("q",)),
        ("k rank 2", dict(k=k[:, 0]), ("k",)),
        ("v total", dict(v=v[:-1]), ("v",)),
        ("Hq % Hk", dict(k=torch.randn(13, 3, D), v=torch.randn(13, 3, D)), ("q", "k")),
        ("k dtype", dict(k=k.half()), ("k",)),
        ("q float64", dict(q=q.double(), k=k.double(), v=v.double()), ("q",)),
        ("head dim 320", dict(q=torch.randn(8, HQ, 320), k=torch.randn(13, HK, 320),
                              v=torch.randn(13, HK, 320)), ("q",)),
        ("q last stride", dict(q=torch.randn(8, D, HQ).transpose(1, 2)), ("q",)),
        ("cu_seqlens_q int64", dict(cu_seqlens_q=cu_q.long()), ("cu_seqlens_q",)),
        ("cu_seqlens_k float", dict(cu_seqlens_k=cu_k.float()), ("cu_seqlens_k",)),
        ("cu_seqlens_q decreasing",
         dict(cu_seqlens_q=torch.tensor([0, 3, 2, 8], dtype=torch.int32)), ("cu_seqlens_q",)),
        ("cu_seqlens_k decreasing",
         dict(cu_seqlens_k=torch.tensor([0, 6, 4, 13], dtype=torch.int32)), ("cu_seqlens_k",)),
        ("cu_seqlens_k past total",
         dict(cu_seqlens_k=torch.tensor([0, 4, 6, 14], dtype=torch.int32)), ("cu_seqlens_k",)),
        ("cu_seqlens length mismatch",
         dict(cu_seqlens_k=torch.tensor([0, 13], dtype=torch.int32)),
         ("cu_seqlens_q", "cu_seqlens_k")),
        ("window without causal", dict(window=2), ("window",)),
        ("window 0", dict(causal=True, window=0), ("window",)),
        ("n_ref 0", dict(n_ref=0), ("n_ref",)),
        ("topk >= n_ref", dict(mode="exact_topk", n_ref=10, topk=10), ("topk", "n_ref")),
        ("slope nan", dict(slope=float("nan")), ("slope",)),
        ("slope tensor shape", dict(slope=torch.full((HK,), 0.2)), ("slope",)),
        ("contrast 0", dict(mode="exact_topk", contrast=0.0), ("contrast",)),
        ("scale inf", dict(scale=float("inf")), ("scale",)),
        ("beta_min > beta_max", dict(beta_min=3.0, beta_max=2.0), ("beta_min", "beta_max")),
        ("beta_min inf", dict(beta_min=float("inf"), beta_max=float("inf")), ("beta_min",)),
        ("beta_min -inf", dict(beta_min=float("-inf"), n_visible=0), ("beta_min",)),
        ("unknown mode", dict(mode="nope"), ("mode",)),
        ("max_seqlen_q < 0", dict(max_seqlen_q=-1), ("max_seqlen_q",)),
        ("n_visible shape", dict(n_visible=torch.ones(9, HQ, dtype=torch.int64)), ("n_visible",)),
    ]


VARLEN_CASES = _varlen_cases()


@pytest.mark.parametrize("desc,change,names", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_errors(packed, desc, change, names):
    q, k, v, cu_q, cu_k = packed
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    kw = {}
    for key, val in change.items():
        (args if key in args else kw)[key] = val
    with pytest.raises(ERR, match=name_re(*names)):
        ext.sharp_attention_varlen(args["q"], args["k"], args["v"], args["cu_seqlens_q"],
                                   args["cu_seqlens_k"], **kw)


@pytest.mark.parametrize("change,names", [
    (dict(window=3), ("window",)),
    (dict(causal=True, window=0), ("window",)),
    (dict(kv_lens=torch.tensor([LK + 2, 0], dtype=torch.int32)), ("kv_lens",)),
    (dict(attn_mask=torch.ones(LQ, LK)), ("attn_mask",)),
    (dict(attn_mask=torch.ones(2, LQ, LK + 1, dtype=torch.bool)), ("attn_mask",)),
    (dict(n_visible=torch.ones(3, 3, dtype=torch.int64)), ("n_visible",)),
], ids=["window", "window0", "kv_lens", "mask_dtype", "mask_shape", "n_visible"])
def test_visible_counts_errors(dense, change, names):
    q, k, _ = dense
    with pytest.raises(ERR, match=name_re(*names)):
        ext.visible_counts(q, k, **change)


@pytest.mark.parametrize("change,names", [
    (dict(mode="unknown"), ("mode",)),
    (dict(n_ref=0), ("n_ref",)),
    (dict(mode="exact_topk", topk=2048), ("topk", "n_ref")),
    (dict(slope=float("nan")), ("slope",)),
    (dict(slope=torch.full((5,), 0.2)), ("slope",)),
    (dict(mode="exact_topk", contrast=-1.0), ("contrast",)),
    (dict(beta_min=1.2, beta_max=1.1), ("beta_min", "beta_max")),
    (dict(beta_min=float("inf"), beta_max=float("inf")), ("beta_min",)),
    (dict(beta_min=float("-inf")), ("beta_min",)),
    (dict(beta_min=-1.0, beta_max=float("-inf")), ("beta_max",)),
], ids=["mode", "n_ref", "topk", "slope", "slope_shape", "contrast", "beta", "beta_min_inf",
        "beta_min_-inf", "beta_max_-inf"])
def test_query_scale_errors(change, names):
    n = torch.randint(1, 5000, (2, HQ, 7))
    with pytest.raises(ERR, match=name_re(*names)):
        ext.query_scale(n, **change)


def test_errors_leave_inputs_untouched(dense):
    """Nothing half-done: a rejected call does not write to its inputs."""
    q, k, v = dense
    before = [t.clone() for t in (q, k, v)]
    with pytest.raises(ERR):
        ext.sharp_attention(q, k, v, mode="exact_topk", n_ref=4, topk=4)
    for a, b in zip((q, k, v), before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw,names", [
    (dict(beta_min=float("inf"), beta_max=float("inf")), ("beta_min",)),
    (dict(beta_min=float("-inf"), n_visible=0), ("beta_min",)),
    (dict(beta_min=-1.0, beta_max=float("-inf")), ("beta_max",)),
    (dict(beta_max=float("nan")), ("beta_max",)),
], ids=["inf", "-inf_n0", "max_-inf", "max_nan"])
def test_reference_rejects_non_finite_beta_bounds(dense, kw, names):
    """The reference gave all-NaN outputs for these too (a fixed bug)."""
    q, k, v = dense
    with pytest.raises(ValueError, match=name_re(*names)):
        ref.sharp_attention_ref(q, k, v, **kw)
    with pytest.raises(ValueError, match=name_re(*names)):
        ref.query_scale_ref(torch.tensor([0, 5, 4096]),
                            **{key: val for key, val in kw.items() if key != "n_visible"})


def test_infinite_beta_max_and_finite_negative_beta_min_stay_valid(dense):
    """beta_max = +inf (the default) and a finite beta_min below 1 give finite outputs."""
    q, k, v = dense
    out = ext.sharp_attention(q, k, v, beta_min=-3.0, beta_max=float("inf"), n_visible=0)
    want = ref.sharp_attention_ref(q, k, v, beta_min=-3.0, beta_max=float("inf"), n_visible=0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The fake (meta) kernels check like the real ones (they once returned shapes unchecked)
# ---------------------------------------------------------------------------------------------
# checks that read tensor values: the real kernel makes them, a meta or fake tensor has none
VALUE_CASES = {"kv_lens > Lk", "kv_lens < 0", "slope tensor inf", "cu_seqlens_q decreasing",
               "cu_seqlens_k decreasing", "cu_seqlens_k past total"}


def _to(device_or_mode, x):
    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(device_or_mode, str):
        return x.to(device_or_mode)
    return device_or_mode.from_tensor(x)


def _fake_modes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    return ["meta", FakeTensorMode()]


def _in_mode(mode):
    import contextlib
    return contextlib.nullcontext() if isinstance(mode, str) else mode


@pytest.mark.parametrize("where", ["meta", "fake"])
@pytest.mark.parametrize("desc,change,names", [c for c in DENSE_CASES if c[0] not in VALUE_CASES],
                         ids=[c[0] for c in DENSE_CASES if c[0] not in VALUE_CASES])
def test_dense_errors_on_meta_and_fake_tensors(dense, desc, change, names, where):
    mode = _fake_modes()[0 if where == "meta" else 1]
    q, k, v = dense
    args = dict(q=q, k=k, v=v)
    kw = {}
    for key, val in change.items():
        (args if key in ("q", "k", "v") else kw)[key] = val
    args = {key: _to(mode, val) for key, val in args.items()}
    kw = {key: _to(mode, val) for key, val in kw.items()}
    with _in_mode(mode), pytest.raises(ERR, match=name_re(*names)):
        ext.sharp_attention(args["q"], args["k"], args["v"], **kw)


@pytest.mark.parametrize("where", ["meta", "fake"])
@pytest.mark.parametrize("desc,change,names",
                         [c for c in VARLEN_CASES if c[0] not in VALUE_CASES],
                         ids=[c[0] for c in VARLEN_CASES if c[0] not in VALUE_CASES])
def test_varlen_errors_on_meta_and_fake_tensors(packed, desc, change, names, where):
    mode = _fake_modes()[0 if where == "meta" else 1]
    q, k, v, cu_q, cu_k = packed
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    kw = {}
    for key, val in change.items():
        (args if key in args else kw)[key] = val
    args = {key: _to(mode, val) for key, val in args.items()}
    kw = {key: _to(mode, val) for key, val in kw.items()}
    with _in_mode(mode), pytest.raises(ERR, match=name_re(*names)):
        ext.sharp_attention_varlen(args["q"], args["k"], args["v"], args["cu_seqlens_q"],
                                   args["cu_seqlens_k"], **kw)


def test_meta_calls_of_the_issue(dense):
    q, k, v = (t.to("meta") for t in dense)
    with pytest.raises(ValueError, match=name_re("k", "v")):  # head dim 33 vs 32
        ext.sharp_attention(q, torch.randn(B, HK, LK, D + 1, device="meta"),
                            torch.randn(B, HK, LK, D + 1, device="meta"))
    with pytest.raises(ValueError, match=name_re("k")):  # q on meta, k and v on the CPU
        ext.sharp_attention(q, dense[1], dense[2])
    with pytest.raises(ValueError, match=name_re("q")):  # 3-D q
        ext.sharp_attention(q[0], k, v)
    out, lse = ext.sharp_attention(q, k, v, causal=True, return_lse=True)  # valid: shapes
    assert out.shape == q.shape and out.device.type == "meta" and lse.shape == q.shape[:3]
    with pytest.raises(ValueError, match=name_re("window")):
        ext.visible_counts(q, k, window=2)
    assert ext.visible_counts(q, k, causal=True).shape == q.shape[:3]
    n = torch.randint(1, 9, (B, HQ, LQ)).to("meta")
    with pytest.raises(ValueError, match=name_re("slope")):
        ext.ops.query_scale(n, "fixed_slope", 0.2, torch.ones(HQ + 1, device="meta"), 2048, 32,
                            5.0, 1.0, float("inf"))
    with pytest.raises(ValueError, match=name_re("beta_min")):
        ext.ops.query_scale(n, "fixed_slope", 0.2, None, 2048, 32, 5.0, float("inf"),
                            float("inf"))
