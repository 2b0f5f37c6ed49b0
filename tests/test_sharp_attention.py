"""The kernel (ext.sharp_attention / ext.sharp_attention_varlen) against the float64 reference
with the spec §6 rule, plus ext.visible_counts / ext.query_scale against the reference.

Deterministic grids cover every required case (mask kinds, empty rows, Lq != Lk, GQA, dtypes,
modes, per-head slope, n_visible, extreme logits, layouts, varlen); a hypothesis test draws
fresh random combinations on top.
"""

from __future__ import annotations


import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (DTYPES, assert_close_spec, load_ext, make_gen, make_qkv, make_varlen_qkv,
                      random_bool_mask, ref, stable_seed, tree_mask)

ext, _ = load_ext()
pytestmark = pytest.mark.usefixtures("require_ext")

DT_ID = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
MASK_KW = ("causal", "window", "attn_mask", "kv_lens")


# ---------------------------------------------------------------------------------------------
# Runners
# ---------------------------------------------------------------------------------------------
def _describe(q, k, kw):
    parts = [f"q{tuple(q.shape)}{DT_ID.get(q.dtype, q.dtype)} k{tuple(k.shape)}"]
    for key, val in kw.items():
        if isinstance(val, torch.Tensor):
            val = f"tensor{tuple(val.shape)}" if val.numel() > 8 else val.tolist()
        parts.append(f"{key}={val}")
    return " [" + ", ".join(parts) + "]"


def check_dense(q, k, v, return_lse=True, **kw):
    """Run the kernel and both references on the same inputs and apply the spec §6 rule."""
    ctx = _describe(q, k, kw)
    res = ext.sharp_attention(q, k, v, return_lse=return_lse, **kw)
    out, lse = res if return_lse else (res, None)
    o64, l64 = ref.sharp_attention_ref(q, k, v, return_lse=True, upcast=True, **kw)
    oT, lT = ref.sharp_attention_ref(q, k, v, return_lse=True, upcast=False, **kw)
    assert out.dtype == q.dtype, f"out dtype {out.dtype} != {q.dtype}{ctx}"
    assert out.shape == q.shape, f"out shape {tuple(out.shape)} != {tuple(q.shape)}{ctx}"
    empty = torch.isneginf(l64).unsqueeze(-1)  # rows with no visible key: exact zeros
    assert_close_spec(out, o64, oT, name="out", exact=empty, context=ctx)
    if return_lse:
        assert lse.dtype == torch.float32, f"lse dtype {lse.dtype}{ctx}"
        assert lse.shape == q.shape[:3], f"lse shape {tuple(lse.shape)}{ctx}"
        assert_close_spec(lse, l64, lT, name="lse", context=ctx)
    return out, o64


def check_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw):
    ctx = _describe(q, k, dict(kw, cu_seqlens_q=cu_q.tolist(), cu_seqlens_k=cu_k.tolist()))
    res = ext.sharp_attention_varlen(q, k, v, cu_q, cu_k, return_lse=return_lse, **kw)
    out, lse = res if return_lse else (res, None)
    o64, l64 = ref.sharp_attention_varlen_ref(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    oT, lT = ref.sharp_attention_varlen_ref(q, k, v, cu_q, cu_k, return_lse=True, upcast=False,
                                            **kw)
    assert out.dtype == q.dtype and out.shape == q.shape, f"out {out.dtype} {out.shape}{ctx}"
    empty = torch.isneginf(l64).transpose(0, 1).unsqueeze(-1)  # (total_q, Hq, 1)
    assert_close_spec(out, o64, oT, name="out", exact=empty, context=ctx)
    if return_lse:
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]), \
            f"lse {lse.dtype} {tuple(lse.shape)}{ctx}"
        assert_close_spec(lse, l64, lT, name="lse", context=ctx)


def mask_kwargs(kind, B, Hq, Lq, Lk, gen):
    """Masking keywords of one named kind (spec §2)."""
    if kind == "none":
        return {}
    if kind == "causal":
        return dict(causal=True)
    if kind == "causal_window":
        return dict(causal=True, window=max(1, Lk // 5))
    if kind == "window1":
        return dict(causal=True, window=1)
    if kind == "kv_lens":
        lens = torch.randint(0, Lk + 1, (B,), generator=gen).to(torch.int32)
        lens[0] = Lk
        return dict(kv_lens=lens)
    if kind == "kv_lens_causal":
        lens = torch.randint(0, Lk + 1, (B,), generator=gen).to(torch.int32)
        return dict(causal=True, kv_lens=lens)
    if kind == "kv_lens_causal_window":
        lens = torch.randint(1, Lk + 1, (B,), generator=gen).to(torch.int32)
        return dict(causal=True, window=7, kv_lens=lens)
    if kind == "mask_bcast":  # (Lq, Lk), shared by batch and heads
        return dict(attn_mask=random_bool_mask((Lq, Lk), 0.6, gen))
    if kind == "mask_batch":  # (B, 1, Lq, Lk): broadcast over heads
        return dict(attn_mask=random_bool_mask((B, 1, Lq, Lk), 0.6, gen))
    if kind == "mask_head":  # (B, Hq, Lq, Lk): per head
        return dict(attn_mask=random_bool_mask((B, Hq, Lq, Lk), 0.5, gen))
    if kind == "mask_rowkey":  # (1, Hq, 1, Lk): per head, broadcast over batch and rows
        return dict(attn_mask=random_bool_mask((1, Hq, 1, Lk), 0.5, gen))
    if kind == "mask_causal":
        return dict(causal=True, attn_mask=random_bool_mask((B, 1, Lq, Lk), 0.7, gen))
    if kind == "tree":  # EAGLE: prefix all visible + random tree among the Lq rows
        return dict(attn_mask=tree_mask(Lq, Lk, gen))
    raise ValueError(kind)


MASK_KINDS = ["none", "causal", "causal_window", "window1", "kv_lens", "kv_lens_causal",
              "kv_lens_causal_window", "mask_bcast", "mask_batch", "mask_head", "mask_rowkey",
              "mask_causal", "tree"]


# ---------------------------------------------------------------------------------------------
# Deterministic grids
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_mask_kinds(kind, dtype):
    g = make_gen(stable_seed(kind, str(dtype)))
    B, Hq, Hk, Lq, Lk, D = 2, 6, 2, 37, 101, 80
    q, k, v = make_qkv(B, Hq, Hk, Lq, Lk, D, dtype, g)
    kw = mask_kwargs(kind, B, Hq, Lq, Lk, g)
    check_dense(q, k, v, n_ref=16, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("Lq,Lk,kv_lens", [
    (40, 17, None),          # Lq > Lk, causal: the first 23 rows are empty
    (33, 64, [20, 0]),       # Lq > kv_len and a batch with no keys at all
    (5, 64, [0, 3]),
])
def test_empty_rows(Lq, Lk, kv_lens, dtype):
    g = make_gen(Lq * 1000 + Lk)
    B = 1 if kv_lens is None else len(kv_lens)
    q, k, v = make_qkv(B, 4, 2, Lq, Lk, 64, dtype, g)
    kl = None if kv_lens is None else torch.tensor(kv_lens, dtype=torch.int32)
    out, _ = check_dense(q, k, v, causal=True, kv_lens=kl, n_ref=8)
    assert not torch.isnan(out).any()
    # non-causal with kv_lens = 0 for a batch also gives empty rows
    if kl is not None:
        check_dense(q, k, v, kv_lens=kl, n_ref=8, mode="exact_topk", topk=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("Lq,Lk", [(1, 300), (300, 17), (16, 257), (129, 129), (2, 1),
                                   (1, 1), (63, 65)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lq_ne_lk(Lq, Lk, causal, dtype):
    g = make_gen(Lq * 7919 + Lk * 31 + causal)
    q, k, v = make_qkv(1, 4, 4, Lq, Lk, 64, dtype, g)
    check_dense(q, k, v, causal=causal, n_ref=32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("ratio", [1, 3, 4])
def test_gqa(ratio, dtype):
    g = make_gen(ratio)
    Hk = 2
    q, k, v = make_qkv(2, Hk * ratio, Hk, 45, 90, 64, dtype, g)
    check_dense(q, k, v, causal=True, n_ref=20)
    slope = torch.linspace(0.05, 0.6, Hk * ratio, dtype=torch.float32)
    check_dense(q, k, v, n_ref=20, slope=slope)


@pytest.mark.parametrize("D", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
def test_head_dims(D, dtype):
    g = make_gen(D)
    q, k, v = make_qkv(1, 3, 1, 23, 150, D, dtype, g)
    check_dense(q, k, v, causal=True, n_ref=50)


MODE_CASES = [
    dict(mode="none"),
    dict(mode="fixed_slope"),                              # defaults: n_ref 2048 -> beta = 1
    dict(mode="fixed_slope", n_ref=16),
    dict(mode="fixed_slope", n_ref=16, slope=0.5, beta_max=1.4),
    dict(mode="fixed_slope", n_ref=300, slope=0.3, beta_min=0.7),  # softening allowed
    dict(mode="fixed_slope", n_ref=16, slope="per_head"),
    dict(mode="exact_topk", n_ref=40, topk=8, contrast=2.0),
    dict(mode="exact_topk", n_ref=2048, topk=32, contrast=5.0, beta_min=0.5),
    dict(mode="fixed_slope", n_ref=64, n_visible="per_row"),
    dict(mode="exact_topk", n_ref=64, topk=4, contrast=3.0, n_visible=torch.tensor(5000)),
    dict(mode="none", n_visible=torch.tensor(10**6)),  # override ignored by mode none
    dict(mode="fixed_slope", n_ref=16, scale=0.07),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("case", range(len(MODE_CASES)))
def test_modes(case, dtype):
    g = make_gen(case + 17)
    B, Hq, Hk, Lq, Lk = 2, 4, 2, 50, 170
    q, k, v = make_qkv(B, Hq, Hk, Lq, Lk, 64, dtype, g)
    kw = dict(MODE_CASES[case])
    if isinstance(kw.get("slope"), str):
        kw["slope"] = torch.tensor([0.0, 0.15, 0.4, 1.0], dtype=torch.float32)
    if isinstance(kw.get("n_visible"), str):
        kw["n_visible"] = torch.randint(1, 20000, (B, 1, Lq), generator=g)
    check_dense(q, k, v, causal=True, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("mode", ["none", "fixed_slope", "exact_topk"])
@pytest.mark.parametrize("kind", ["causal", "mask_head", "none"])
def test_extreme_logits(kind, mode, dtype):
    g = make_gen(stable_seed(kind, mode, str(dtype)))
    B, Hq, Hk, Lq, Lk = 1, 4, 1, 40, 211
    q, k, v = make_qkv(B, Hq, Hk, Lq, Lk, 64, dtype, g, extreme=True)
    kw = mask_kwargs(kind, B, Hq, Lq, Lk, g)
    check_dense(q, k, v, mode=mode, n_ref=16, topk=4, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_noncontiguous(layout, dtype):
    g = make_gen(len(layout))
    q, k, v = make_qkv(2, 6, 3, 29, 77, 64, dtype, g, layout=layout)
    assert not q.is_contiguous() and q.stride(-1) == 1
    check_dense(q, k, v, causal=True, n_ref=10)
    # mixed layouts: q transposed, k sliced, v contiguous
    q2, _, _ = make_qkv(2, 6, 3, 29, 77, 64, dtype, g, layout="transposed")
    _, k2, _ = make_qkv(2, 6, 3, 29, 77, 64, dtype, g, layout="sliced")
    check_dense(q2, k2, v.contiguous(), n_ref=10, attn_mask=random_bool_mask((29, 77), 0.5, g))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
def test_decode_long_context(dtype):
    """Lq = 1 against many keys (the split-KV regime of a decode kernel)."""
    g = make_gen(4242)
    q, k, v = make_qkv(2, 8, 2, 1, 3000, 128, dtype, g)
    check_dense(q, k, v, causal=True, n_ref=512, kv_lens=torch.tensor([3000, 1234],
                                                                        dtype=torch.int32))
    check_dense(q, k, v, n_ref=512, mode="exact_topk")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
def test_return_lse_false_matches_true(dtype):
    g = make_gen(99)
    q, k, v = make_qkv(1, 2, 1, 20, 33, 32, dtype, g)
    out_only = ext.sharp_attention(q, k, v, causal=True, n_ref=8)
    assert isinstance(out_only, torch.Tensor)
    check_dense(q, k, v, causal=True, n_ref=8, return_lse=False)
    out, _ = ext.sharp_attention(q, k, v, causal=True, n_ref=8, return_lse=True)
    assert torch.equal(out_only, out)


# ---------------------------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------------------------
VARLEN_CASES = [
    dict(lq=[5, 0, 17, 3], lk=[40, 9, 17, 0], causal=True),     # empty q seq, empty k seq
    dict(lq=[1, 1, 1], lk=[300, 1, 77]),                          # decode batch
    dict(lq=[16, 16], lk=[100, 16], causal=True, window=9),
    dict(lq=[0, 0, 4], lk=[0, 5, 4], mode="exact_topk", n_ref=3, topk=1),
    dict(lq=[30, 2], lk=[10, 120], causal=True, n_visible="per_row"),  # Lq > Lk in seq 0
    dict(lq=[7, 129], lk=[129, 7], slope="per_head", sliced=True),
    dict(lq=[12, 40], lk=[60, 45], causal=True, extreme=True, mode="none"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_varlen(case, dtype):
    g = make_gen(case * 13 + 5)
    c = dict(VARLEN_CASES[case])
    lq, lk = c.pop("lq"), c.pop("lk")
    Hq, Hk, D = 6, 2, 64
    q, k, v, cu_q, cu_k = make_varlen_qkv(lq, lk, Hq, Hk, D, dtype, g,
                                          extreme=c.pop("extreme", False),
                                          sliced=c.pop("sliced", False))
    c.setdefault("n_ref", 8)
    if isinstance(c.get("slope"), str):
        c["slope"] = torch.linspace(0.1, 0.9, Hq, dtype=torch.float32)
    if isinstance(c.get("n_visible"), str):
        c["n_visible"] = torch.randint(1, 5000, (q.shape[0], 1), generator=g)
    check_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk), **c)


def test_varlen_matches_dense_per_sequence():
    """Each packed sequence equals the dense kernel on that sequence alone (float32)."""
    g = make_gen(31)
    lq, lk = [9, 1, 20], [50, 70, 20]
    q, k, v, cu_q, cu_k = make_varlen_qkv(lq, lk, 4, 4, 32, torch.float32, g)
    out = ext.sharp_attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=20, max_seqlen_k=70,
                                     causal=True, n_ref=8)
    for b in range(3):
        q0, q1, k0, k1 = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        dense = ext.sharp_attention(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                                    v[k0:k1].transpose(0, 1)[None], causal=True, n_ref=8)
        torch.testing.assert_close(out[q0:q1], dense[0].transpose(0, 1), rtol=1e-5, atol=1e-6)


def test_n_visible_python_int():
    """spec §2: n_visible is an int broadcastable to (B, Hq, Lq): a plain Python int works."""
    g = make_gen(71)
    q, k, v = make_qkv(1, 2, 1, 12, 40, 32, torch.float32, g)
    check_dense(q, k, v, causal=True, n_ref=8, n_visible=5000)
    got = ext.visible_counts(q, k, causal=True, n_visible=5000)
    assert torch.equal(got.to(torch.int64), torch.full((1, 2, 12), 5000))


# ---------------------------------------------------------------------------------------------
# visible_counts / query_scale
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("Lq,Lk", [(37, 101), (50, 20)])
def test_visible_counts(kind, Lq, Lk):
    g = make_gen(stable_seed(kind, Lq))
    B, Hq, Hk = 2, 6, 2
    q, k, _ = make_qkv(B, Hq, Hk, Lq, Lk, 32, torch.float32, g)
    kw = mask_kwargs(kind, B, Hq, Lq, Lk, g)
    got = ext.visible_counts(q, k, **kw)
    want = ref.visible_counts_ref(q, k, **kw)
    assert not got.is_floating_point()
    assert got.shape == (B, Hq, Lq)
    assert torch.equal(got.to(torch.int64), want), \
        f"first mismatch at {(got.to(torch.int64) != want).nonzero()[0].tolist()}"
    assert (want > 0).any()


def test_visible_counts_n_visible_override():
    g = make_gen(5)
    q, k, _ = make_qkv(2, 4, 2, 10, 30, 32, torch.float32, g)
    for nv in (torch.tensor(777), torch.arange(1, 11, dtype=torch.int64),
               torch.randint(1, 10**6, (2, 4, 10), generator=g)):
        got = ext.visible_counts(q, k, causal=True, n_visible=nv)
        want = ref.visible_counts_ref(q, k, causal=True, n_visible=nv)
        assert torch.equal(got.to(torch.int64), want)


QS_CASES = [
    dict(mode="fixed_slope"),
    dict(mode="fixed_slope", slope=0.35, n_ref=4096, beta_min=0.5, beta_max=1.6),
    dict(mode="fixed_slope", slope="per_head", n_ref=100),
    dict(mode="exact_topk"),
    dict(mode="exact_topk", topk=5, n_ref=50, contrast=1.5, beta_min=-10.0),
    dict(mode="none", beta_min=2.0),
]


@pytest.mark.parametrize("case", range(len(QS_CASES)))
def test_query_scale(case):
    g = make_gen(case)
    kw = dict(QS_CASES[case])
    if isinstance(kw.get("slope"), str):
        kw["slope"] = torch.tensor([0.05, 0.2, 0.9], dtype=torch.float32)
    # counts spanning 1 .. 10^6, with the boundaries n = topk, n_ref
    n = torch.randint(1, 10**6, (2, 3, 40), generator=g)
    n[0, :, :6] = torch.tensor([1, 31, 32, 33, 2048, 4096])
    got = ext.query_scale(n, **kw)
    want = ref.query_scale_ref(n, **kw)
    assert got.shape == want.shape
    torch.testing.assert_close(got.to(torch.float64), want, rtol=1e-6, atol=1e-7)
    if kw["mode"] != "none":
        assert (want > 1.0).any()  # the case exercises a non-trivial beta


# ---------------------------------------------------------------------------------------------
# Random grid (hypothesis)
# ---------------------------------------------------------------------------------------------
@st.composite
def dense_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    D = draw(st.sampled_from([32, 64, 80, 128, 256]))
    Hk = draw(st.integers(1, 2))
    ratio = draw(st.sampled_from([1, 3, 4]))
    B = draw(st.integers(1, 2))
    small = st.integers(1, 40)
    big = st.integers(41, 300)
    Lq = draw(st.one_of(small, big))
    Lk = draw(st.one_of(small, big))
    # keep the work (B * Hq * Lq * Lk * D) bounded so the suite stays fast
    while B * Hk * ratio * Lq * Lk * D > 6_000_000:
        Lq = max(1, Lq // 2)
    kind = draw(st.sampled_from(MASK_KINDS))
    mode = draw(st.sampled_from(["none", "fixed_slope", "exact_topk"]))
    kw = dict(mode=mode)
    kw["n_ref"] = draw(st.sampled_from([8, 64, 2048]))
    if mode == "exact_topk":
        kw["topk"] = draw(st.integers(1, kw["n_ref"] - 1))
        kw["contrast"] = draw(st.floats(0.5, 8.0))
    if mode == "fixed_slope" and draw(st.booleans()):
        kw["slope"] = "per_head"
    if draw(st.integers(0, 4)) == 0:
        kw["n_visible"] = torch.tensor(draw(st.integers(1, 50_000)))
    if draw(st.integers(0, 4)) == 0:
        kw["scale"] = draw(st.floats(0.01, 0.5))
    return dict(dtype=dtype, D=D, Hk=Hk, Hq=Hk * ratio, B=B, Lq=Lq, Lk=Lk, kind=kind, kw=kw,
                extreme=draw(st.integers(0, 3)) == 0,
                layout=draw(st.sampled_from(["contiguous", "transposed", "sliced"])),
                return_lse=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dense_cases())
def test_random_grid(c):
    g = make_gen(c["seed"])
    q, k, v = make_qkv(c["B"], c["Hq"], c["Hk"], c["Lq"], c["Lk"], c["D"], c["dtype"], g,
                       extreme=c["extreme"], layout=c["layout"])
    kw = dict(c["kw"])
    if isinstance(kw.get("slope"), str):
        kw["slope"] = torch.rand(c["Hq"], generator=g) * 0.8
    kw.update(mask_kwargs(c["kind"], c["B"], c["Hq"], c["Lq"], c["Lk"], g))
    check_dense(q, k, v, return_lse=c["return_lse"], **kw)


@st.composite
def varlen_cases(draw):
    nb = draw(st.integers(1, 4))
    lq = draw(st.lists(st.integers(0, 60), min_size=nb, max_size=nb))
    lk = draw(st.lists(st.integers(0, 200), min_size=nb, max_size=nb))
    kw = dict(mode=draw(st.sampled_from(["none", "fixed_slope", "exact_topk"])),
              n_ref=draw(st.sampled_from([4, 32])), topk=2)
    if draw(st.booleans()):
        kw["causal"] = True
        if draw(st.booleans()):
            kw["window"] = draw(st.integers(1, 50))
    return dict(lq=lq, lk=lk, kw=kw, dtype=draw(st.sampled_from(DTYPES)),
                D=draw(st.sampled_from([32, 64, 128])), ratio=draw(st.sampled_from([1, 3, 4])),
                sliced=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(varlen_cases())
def test_random_varlen(c):
    g = make_gen(c["seed"])
    q, k, v, cu_q, cu_k = make_varlen_qkv(c["lq"], c["lk"], 2 * c["ratio"], 2, c["D"],
                                          c["dtype"], g, sliced=c["sliced"])
    check_varlen(q, k, v, cu_q, cu_k, **c["kw"])


# ---------------------------------------------------------------------------------------------
# Fuzz of the index tensors: any cu_seqlens / kv_lens / n_visible, valid or not, contiguous or a
# strided view, gives either a ValueError or the reference's result (never a crash). Validity
# is decided here from the values the tensor holds, independently of the kernel's checks.
# ---------------------------------------------------------------------------------------------
def _as_view(values, dtype, layout, filler):
    """A 1-D tensor holding `values`, laid out as `layout`: contiguous, every other element of
    a buffer whose other elements are `filler`, or a column of a 2-D buffer."""
    n = len(values)
    if layout == "contiguous":
        return torch.tensor(values, dtype=dtype)
    if layout == "stride2":
        buf = torch.full((2 * n,), filler, dtype=dtype)
        buf[::2] = torch.tensor(values, dtype=dtype)
        return buf[::2]
    buf = torch.full((n, 3), filler, dtype=dtype)  # "column": stride 3, offset 1
    buf[:, 1] = torch.tensor(values, dtype=dtype)
    return buf[:, 1]


LAYOUTS = ("contiguous", "stride2", "column")
FILLERS = (99, 4000, -7, 0, 5)


@st.composite
def varlen_index_cases(draw):
    nb = draw(st.integers(1, 3))
    lq = draw(st.lists(st.integers(0, 6), min_size=nb, max_size=nb))
    lk = draw(st.lists(st.integers(0, 8), min_size=nb, max_size=nb))
    cus = []
    for lens in (lq, lk):
        vals = [0]
        for n in lens:
            vals.append(vals[-1] + n)
        how = draw(st.sampled_from(["valid", "valid", "perturb", "random", "length"]))
        if how == "perturb":
            i = draw(st.integers(0, len(vals) - 1))
            vals[i] += draw(st.sampled_from([-4000, -2, -1, 1, 2, 99, 4000]))
        elif how == "random":
            vals = draw(st.lists(st.integers(-5, 30), min_size=nb + 1, max_size=nb + 1))
        elif how == "length":
            vals = vals + [vals[-1]] if draw(st.booleans()) else vals[:-1] or [0]
        cus.append(vals)
    heads = draw(st.sampled_from([(1, 1), (2, 1), (4, 2)]))
    nv = None
    if draw(st.booleans()):
        nv = draw(st.sampled_from(["int", "tensor", "negative"]))
    return dict(lq=lq, lk=lk, cus=cus, heads=heads, nv=nv,
                dtype=draw(st.sampled_from([torch.int32] * 5 + [torch.int64])),
                layouts=[draw(st.sampled_from(LAYOUTS)) for _ in range(2)],
                filler=draw(st.sampled_from(FILLERS)), causal=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)))


def _valid_cu(vals, total, length):
    return (len(vals) == length and len(vals) >= 2 and vals[0] == 0 and vals[-1] == total
            and all(b >= a for a, b in zip(vals, vals[1:])))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(varlen_index_cases())
def test_fuzz_varlen_index_tensors(c):
    g = make_gen(c["seed"])
    hq, hk = c["heads"]
    tq, tk = sum(c["lq"]), sum(c["lk"])
    q = torch.randn(tq, hq, 16, generator=g)
    k, v = torch.randn(tk, hk, 16, generator=g), torch.randn(tk, hk, 16, generator=g)
    cu_q, cu_k = (_as_view(vals, c["dtype"], lay, c["filler"])
                  for vals, lay in zip(c["cus"], c["layouts"]))
    kw = dict(causal=c["causal"], n_ref=4)
    nv_ok = True
    if c["nv"] == "int":
        kw["n_visible"] = 3
    elif c["nv"] is not None:  # a (Hq, total_q) buffer viewed transposed: not contiguous
        lo = -2 if c["nv"] == "negative" else 0
        nv = torch.randint(lo, 50, (hq, tq), generator=g).t()
        nv_ok = tq == 0 or int(nv.min()) >= 0
        kw["n_visible"] = nv
    valid = (c["dtype"] == torch.int32 and nv_ok
             and len(c["cus"][0]) == len(c["cus"][1])
             and _valid_cu(c["cus"][0], tq, len(c["cus"][0]))
             and _valid_cu(c["cus"][1], tk, len(c["cus"][1])))
    if not valid:
        with pytest.raises(ValueError):
            ext.sharp_attention_varlen(q, k, v, cu_q, cu_k, **kw)
        return
    check_varlen(q, k, v, cu_q, cu_k, **kw)


@st.composite
def kv_lens_cases(draw):
    b = draw(st.integers(1, 3))
    lk = draw(st.integers(0, 9))
    lens = draw(st.lists(st.integers(-3, lk + 3), min_size=b, max_size=b))
    if draw(st.booleans()):
        lens = [min(max(x, 0), lk) for x in lens]  # valid
    big = draw(st.sampled_from([None, 2**32, 2**31]))  # int64 values int32 would wrap
    return dict(b=b, lk=lk, lens=lens, big=big, lq=draw(st.integers(1, 6)),
                dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                layout=draw(st.sampled_from(LAYOUTS)), filler=draw(st.sampled_from(FILLERS)),
                causal=draw(st.booleans()), mask=draw(st.booleans()),
                nv=draw(st.sampled_from([None, "tensor", "negative"])),
                seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_lens_cases())
def test_fuzz_kv_lens_and_side_tensors(c):
    g = make_gen(c["seed"])
    b, lq, lk = c["b"], c["lq"], c["lk"]
    q, k, v = make_qkv(b, 4, 2, lq, lk, 16, torch.float32, g)
    lens = list(c["lens"])
    if c["big"] is not None and c["dtype"] == torch.int64:
        lens[0] += c["big"]  # wraps to a valid-looking int32 value if narrowed unchecked
    kw = dict(causal=c["causal"], n_ref=4,
              kv_lens=_as_view(lens, c["dtype"], c["layout"], c["filler"]))
    valid = all(0 <= x <= lk for x in lens)
    if c["mask"]:  # (Lk, Lq) storage viewed as (Lq, Lk): not contiguous along keys
        kw["attn_mask"] = (torch.rand(lk, lq, generator=g) < 0.7).t()
    if c["nv"] is not None:  # (Lq, Hq, B) storage viewed as (B, Hq, Lq)
        lo = -2 if c["nv"] == "negative" else 0
        nv = torch.randint(lo, 40, (lq, 4, b), generator=g).permute(2, 1, 0)
        valid = valid and int(nv.min()) >= 0
        kw["n_visible"] = nv
    if not valid:
        with pytest.raises(ValueError):
            ext.sharp_attention(q, k, v, **kw)
        return
    check_dense(q, k, v, **kw)
    assert torch.equal(ext.visible_counts(q, k, **{key: kw[key] for key in kw if key in (
        "causal", "attn_mask", "kv_lens", "n_visible")}),
        ref.visible_counts_ref(q, k, **{key: kw[key] for key in kw if key in (
            "causal", "attn_mask", "kv_lens", "n_visible")}))


def test_strided_cu_seqlens_views_are_read_through_their_strides():
    """A fixed bug: views with stride 2 were read as if contiguous (a floating point exception, a
    segmentation fault, and a valid view rejected)."""
    g = make_gen(11)
    q, k = torch.randn(30, 4, 32, generator=g), torch.randn(50, 2, 32, generator=g)
    ck = torch.tensor([0, 20, 50], dtype=torch.int32)
    for raw in ([0, 10, 30, 99, 5], [0, 10, 30, 99, 4000]):
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            ext.sharp_attention_varlen(q, k, k, torch.tensor(raw, dtype=torch.int32)[::2], ck,
                                       causal=True)
    view = torch.tensor([0, 99, 10, 99, 30], dtype=torch.int32)[::2]  # [0, 10, 30]
    check_varlen(q, k, k, view, ck, causal=True)


# ---------------------------------------------------------------------------------------------
# Backward (a fixed bug: the output required grad, but backward left q.grad None)
# ---------------------------------------------------------------------------------------------
def _grads(fn, inputs, cotangents):
    """d<outputs, cotangents>/d inputs by torch.autograd (inputs: leaves requiring grad)."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * c).sum() for o, c in zip(outs, cotangents))
    return torch.autograd.grad(loss, inputs)


def test_backward_of_plain_attention_matches_sdpa():
    """mode "none" is plain attention: its gradient is SDPA's (an independent implementation),
    here in float64 with GQA and a bottom-right causal mask."""
    g = make_gen(401)
    q, k, v = make_qkv(2, 4, 2, 7, 12, 16, torch.float32, g)
    go = torch.randn(2, 4, 7, 16, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = _grads(lambda q, k, v: ext.sharp_attention(q, k, v, causal=True, mode="none"),
                 leaves, [go])
    mask = torch.ones(7, 12, dtype=torch.bool).tril(12 - 7)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    want = _grads(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask),
        leaves64, [go])
    for name, a, b in zip("qkv", got, want):
        assert a is not None and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", [
    dict(causal=True, slope=0.3, n_ref=4),
    dict(attn_mask="tree", mode="exact_topk", topk=2, n_ref=6, contrast=2.0),
    dict(kv_lens=[9, 0], causal=True, n_ref=3, beta_max=1.4),   # empty rows, upper clamp
    dict(n_visible=[[[40], [1], [7], [3]]], slope="per_head", n_ref=5),
], ids=["causal", "tree_exact_topk", "empty_rows", "n_visible_per_head"])
def test_backward_matches_the_reference_gradient(case):
    """The gradient of out and lse (q, k, v and a per-head slope tensor) is the float64
    reference's, whose own autograd gradient is checked against finite differences."""
    g = make_gen(stable_seed("bwd", case))
    B, Hq, Hk, Lq, Lk, D = 2, 4, 2, 5, 9, 8
    q, k, v = make_qkv(B, Hq, Hk, Lq, Lk, D, torch.float32, g)
    kw = dict(case)
    if kw.get("attn_mask") == "tree":
        kw["attn_mask"] = tree_mask(Lq, Lk, g)
    if "kv_lens" in kw:
        kw["kv_lens"] = torch.tensor(kw["kv_lens"], dtype=torch.int32)
    if "n_visible" in kw:
        kw["n_visible"] = torch.tensor(kw["n_visible"])
    slope = kw.pop("slope", 0.2)
    inputs = [q, k, v]
    if slope == "per_head":
        inputs.append(torch.tensor([0.1, 0.25, 0.4, -0.2]))
    go = torch.randn(B, Hq, Lq, D, generator=g, dtype=torch.float64)
    gl = torch.randn(B, Hq, Lq, generator=g, dtype=torch.float64)

    def call(fn, upcast=None):
        extra = {} if upcast is None else dict(upcast=upcast)
        def f(q, k, v, s=slope):
            out, lse = fn(q, k, v, slope=s, return_lse=True, **kw, **extra)
            # lse is -inf on empty rows: no gradient flows there, compare it as 0
            return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        return f

    got = _grads(call(ext.sharp_attention), [t.clone().requires_grad_() for t in inputs],
                 [go, gl])
    leaves64 = [t.double().requires_grad_() for t in inputs]
    want = _grads(call(ref.sharp_attention_ref, upcast=True), leaves64, [go, gl])
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == inputs[i].dtype and torch.isfinite(a).all(), f"input {i}"
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6, msg=f"input {i}")
    # the reference's autograd gradient is the derivative (finite differences, float64)
    assert torch.autograd.gradcheck(
        lambda *t: call(ref.sharp_attention_ref, upcast=True)(*t),
        [t.double().requires_grad_() for t in inputs], eps=1e-6, atol=1e-5, fast_mode=True)


def test_backward_varlen_matches_dense_per_sequence():
    g = make_gen(402)
    q, k, v, cu_q, cu_k = make_varlen_qkv([3, 0, 5], [4, 2, 7], 4, 2, 8, torch.float32, g)
    go = torch.randn(q.shape, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = _grads(lambda q, k, v: ext.sharp_attention_varlen(q, k, v, cu_q, cu_k, causal=True,
                                                            n_ref=3), leaves, [go])
    # per sequence: the dense reference on that sequence alone, in float64
    want = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
    for b in range(3):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        seq = [q[q0:q1], k[k0:k1], v[k0:k1]]
        leaves64 = [t.double().transpose(0, 1)[None].requires_grad_() for t in seq]
        grads = _grads(lambda q, k, v: ref.sharp_attention_ref(q, k, v, causal=True, n_ref=3),
                       leaves64, [go[q0:q1].transpose(0, 1)[None]])
        for w, gr, (lo, hi) in zip(want, grads, ((q0, q1), (k0, k1), (k0, k1))):
            w[lo:hi] = gr[0].transpose(0, 1)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6, msg=name)


def test_query_scale_backward_to_per_head_slopes():
    """d beta / d lambda_h = ln(n / n_ref) where beta is not clamped, 0 where it is."""
    n = torch.tensor([[[1, 4096, 100], [8192, 2048, 0]]])  # (1, Hq=2, Lq=3)
    slope = torch.tensor([0.2, 0.3], requires_grad=True)
    beta = ext.query_scale(n, slope=slope, n_ref=2048)
    beta.sum().backward()
    want = [math.log(4096 / 2048), math.log(8192 / 2048)]  # clamped entries contribute 0
    assert slope.grad.tolist() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("hq,hk", [(9, 3), (8, 2), (16, 4), (16, 8), (4, 4)])
@pytest.mark.parametrize("p", [100, 511, 512, 600, 1400, 3000])
def test_a_row_decoded_alone_equals_the_same_row_verified(hq, hk, p):
    """The lossless engine's premise at the kernel: row p's output (causal, position p) is the
    same bits whether the call holds just it (a decode step, p + 1 keys) or it leads a block of
    k rows (a verification, p + k keys), whatever k. Step-sized calls split keys at fixed
    positions, so crossing a split boundary does not change a row's arithmetic; with at most
    2 query heads a KV head (16/8, 4/4) the decode step scores by the dot-product path and the
    verification in the same order."""
    g = torch.Generator().manual_seed(p + hq)
    d = 64
    q_all = torch.randn(1, hq, 40, d, generator=g)
    k_all = torch.randn(1, hk, p + 40, d, generator=g)
    v_all = torch.randn(1, hk, p + 40, d, generator=g)
    alone = ext.sharp_attention(q_all[:, :, :1], k_all[:, :, :p + 1], v_all[:, :, :p + 1],
                                causal=True, mode="none")
    for k in (2, 8, 16, 40):
        block = ext.sharp_attention(q_all[:, :, :k], k_all[:, :, :p + k], v_all[:, :, :p + k],
                                    causal=True, mode="none")
        assert torch.equal(block[:, :, :1], alone), k


@pytest.mark.parametrize("hq,hk", [(9, 3), (16, 4), (16, 8)])
@pytest.mark.parametrize("prefix", [40, 500, 1015, 1530, 3000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_row_equals_the_same_row_decoded_alone(hq, hk, prefix, dtype):
    """The lossless engine's premise for tree verification: a tree node's row (prefix visible,
    then its ancestors and itself, among masked siblings) is the same bits as that row decoded
    alone at the end of the contiguous sequence prefix + ancestors + itself, wherever block
    (64 keys) and split (512 keys) boundaries fall among the nodes. Prefixes sit just before
    a split boundary so that the nodes straddle it."""
    g = torch.Generator().manual_seed(prefix + hq)
    n, d = 24, 64
    parents = [-1] + [int(torch.randint(0, t, (1,), generator=g)) for t in range(1, n)]
    mask = tree_mask(n, prefix + n, prefix=prefix, parents=parents)
    q = torch.randn(1, hq, n, d, generator=g).to(dtype)
    k = torch.randn(1, hk, prefix + n, d, generator=g).to(dtype)
    v = torch.randn(1, hk, prefix + n, d, generator=g).to(dtype)
    tree = ext.sharp_attention(q, k, v, attn_mask=mask, mode="none")
    for t in range(n):
        keys = mask[t].nonzero().flatten()       # prefix, ancestors, itself, in key order
        alone = ext.sharp_attention(q[:, :, t:t + 1], k[:, :, keys], v[:, :, keys],
                                    causal=True, mode="none")
        assert torch.equal(tree[:, :, t:t + 1], alone), (t, len(keys))


@pytest.mark.parametrize("lk,p_true", [(700, 0.5), (2000, 0.3), (1500, 0.05), (3000, 0.9)])
@pytest.mark.parametrize("lq", [1, 5, 40])
def test_sparse_masks_over_several_key_chunks_match_the_reference(lk, p_true, lq):
    """Step-sized calls chunk each row's visible keys (not positions): rows whose visible keys
    spread over several 512-key chunks, rows whose first chunks see nothing and rows that see
    nothing at all still give the float64 reference (zeros for the last)."""
    g = torch.Generator().manual_seed(lk + lq)
    q = torch.randn(1, 9, lq, 64, generator=g)
    k = torch.randn(1, 3, lk, 64, generator=g)
    v = torch.randn(1, 3, lk, 64, generator=g)
    mask = torch.rand(lq, lk, generator=g) < p_true
    mask[0] = False
    if lq > 1:
        mask[1, :min(lk, 1200)] = False
    got = ext.sharp_attention(q, k, v, attn_mask=mask, mode="none")
    want = ref.sharp_attention_ref(q.double(), k.double(), v.double(), attn_mask=mask,
                                   mode="none")
    want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)
    assert torch.equal(got[:, :, 0], torch.zeros_like(got[:, :, 0]))
