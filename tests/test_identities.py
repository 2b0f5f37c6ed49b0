"""Identities the kernel must satisfy, checked against independent computations:

* mode="none" is plain attention: equal to torch SDPA (bottom-right causal via
  causal_lower_right when Lq != Lk);
* fixed_slope equals SDPA applied to q pre-multiplied row-wise by beta_i;
* beta_i = 1 whenever n_i <= n_ref (beta_min = 1): fixed_slope then equals mode none;
* NaN in q/k propagates as in SDPA and leaves the other rows intact;
* torch.compile(fullgraph=True) traces the op and matches eager.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from conftest import load_ext, make_gen, make_qkv, random_bool_mask, ref, tree_mask

ext, _ = load_ext()
pytestmark = pytest.mark.usefixtures("require_ext")

TIGHT = dict(rtol=1e-5, atol=1e-5)


def sdpa(q, k, v, *, causal=False, attn_mask=None, scale=None):
    """torch SDPA with the conventions of docs/spec.md: bottom-right causal, GQA, bool mask."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if causal:
        assert attn_mask is None
        if Lq == Lk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)
        attn_mask = causal_lower_right(Lq, Lk)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale,
                                          enable_gqa=gqa)


SHAPES = [  # B, Hq, Hk, Lq, Lk, D, causal, mask
    (2, 4, 4, 64, 64, 64, False, None),
    (1, 6, 2, 77, 77, 80, True, None),
    (2, 8, 2, 16, 300, 128, True, None),      # Lq < Lk, bottom-right
    (1, 9, 3, 1, 257, 64, True, None),        # decode
    (2, 4, 1, 33, 150, 32, False, "bool"),
    (1, 4, 4, 16, 96, 64, False, "tree"),
]


def _shape_id(s):
    return "x".join(map(str, s[:6])) + f"-{s[6]}-{s[7]}"


def _mask(kind, B, Hq, Lq, Lk, g):
    if kind == "bool":
        m = random_bool_mask((B, 1, Lq, Lk), 0.6, g)
        m[..., 0] = True  # no empty rows (SDPA's convention for them differs)
        return m
    if kind == "tree":
        return tree_mask(Lq, Lk, g)
    return None


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_mode_none_equals_sdpa(shape):
    B, Hq, Hk, Lq, Lk, D, causal, mk = shape
    g = make_gen(Lq * 3 + Lk)
    q, k, v = make_qkv(B, Hq, Hk, Lq, Lk, D, torch.float32, g)
    m = _mask(mk, B, Hq, Lq, Lk, g)
    out = ext.sharp_attention(q, k, v, causal=causal, attn_mask=m, mode="none")
    want = sdpa(q, k, v, causal=causal, attn_mask=m)
    torch.testing.assert_close(out, want, **TIGHT)
    # an explicit scale as well
    out = ext.sharp_attention(q, k, v, causal=causal, attn_mask=m, mode="none", scale=0.3)
    torch.testing.assert_close(out, sdpa(q, k, v, causal=causal, attn_mask=m, scale=0.3), **TIGHT)


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("mode_kw", [dict(mode="fixed_slope", n_ref=8, slope=0.3),
                                     dict(mode="fixed_slope", n_ref=8, slope="per_head"),
                                     dict(mode="exact_topk", n_ref=20, topk=4, contrast=2.5)],
                         ids=["fixed", "fixed_per_head", "exact"])
def test_sharp_equals_sdpa_on_prescaled_q(shape, mode_kw):
    B, Hq, Hk, Lq, Lk, D, causal, mk = shape
    g = make_gen(Lq * 5 + Lk)
    q, k, v = make_qkv(B, Hq, Hk, Lq, Lk, D, torch.float32, g)
    m = _mask(mk, B, Hq, Lq, Lk, g)
    kw = dict(mode_kw)
    if kw.get("slope") == "per_head":
        kw["slope"] = torch.linspace(0.05, 0.5, Hq)
    n = ref.visible_counts_ref(q, k, causal=causal, attn_mask=m)
    beta = ref.query_scale_ref(n, **kw)  # float64 (B, Hq, Lq)
    assert (beta > 1.05).any(), "the case must exercise beta > 1"
    q_scaled = (q.double() * beta.unsqueeze(-1)).float()
    want = sdpa(q_scaled, k, v, causal=causal, attn_mask=m)
    out = ext.sharp_attention(q, k, v, causal=causal, attn_mask=m, **kw)
    torch.testing.assert_close(out, want, **TIGHT)
    # and it differs from plain attention (the test could fail)
    plain = sdpa(q, k, v, causal=causal, attn_mask=m)
    assert (out - plain).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window=30),
                                dict(attn_mask="tree")], ids=["causal", "full", "window", "tree"])
def test_short_context_is_plain_attention(kw, dtype):
    """beta_min = 1 and n_i <= n_ref for every row: beta_i = 1, fixed_slope == mode none."""
    g = make_gen(21)
    B, Hq, Hk, Lq, Lk = 2, 4, 2, 40, 120
    q, k, v = make_qkv(B, Hq, Hk, Lq, Lk, 64, dtype, g)
    kw = dict(kw)
    if kw.get("attn_mask") == "tree":
        kw["attn_mask"] = tree_mask(Lq, Lk, g)
    n = ref.visible_counts_ref(q, k, **kw)
    n_ref = int(n.max())  # every row has n_i <= n_ref, and some row has n_i == n_ref
    assert torch.equal(ref.query_scale_ref(n, n_ref=n_ref, slope=0.7),
                       torch.ones_like(n, dtype=torch.float64))
    got, lse = ext.sharp_attention(q, k, v, n_ref=n_ref, slope=0.7, return_lse=True, **kw)
    base, lse0 = ext.sharp_attention(q, k, v, mode="none", return_lse=True, **kw)
    torch.testing.assert_close(got, base, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse0, rtol=0, atol=0)
    # one key fewer of reference: now the longest rows are sharpened and the output changes
    got2 = ext.sharp_attention(q, k, v, n_ref=n_ref - 1, slope=0.7, **kw)
    assert not torch.equal(got2, base)


def test_beta_one_below_n_ref_per_row():
    """Rows with n_i <= n_ref are bitwise those of mode none even when other rows are scaled."""
    g = make_gen(8)
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, torch.float32, g)
    n_ref = 40  # causal: row i sees i + 1 keys
    got = ext.sharp_attention(q, k, v, causal=True, n_ref=n_ref)
    base = ext.sharp_attention(q, k, v, causal=True, mode="none")
    torch.testing.assert_close(got[:, :, :n_ref], base[:, :, :n_ref], rtol=0, atol=0)
    assert (got[:, :, n_ref + 1:] - base[:, :, n_ref + 1:]).abs().amax(dim=-1).min() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_query_row_is_isolated(dtype):
    g = make_gen(33)
    q, k, v = make_qkv(1, 3, 1, 50, 90, 64, dtype, g)
    clean = ext.sharp_attention(q, k, v, causal=True, n_ref=8)
    qn = q.clone()
    qn[0, 1, 17, 5] = float("nan")
    out, lse = ext.sharp_attention(qn, k, v, causal=True, n_ref=8, return_lse=True)
    assert torch.isnan(out[0, 1, 17]).all(), "NaN must propagate to its own row (as SDPA)"
    keep = torch.ones(out.shape[:3], dtype=torch.bool)
    keep[0, 1, 17] = False
    torch.testing.assert_close(out[keep], clean[keep], rtol=0, atol=0)
    assert torch.isfinite(lse[keep]).all()


def test_nan_key_propagates_like_sdpa():
    """A NaN key poisons exactly the rows that see it (float32, against SDPA)."""
    g = make_gen(34)
    q, k, v = make_qkv(1, 2, 2, 30, 30, 32, torch.float32, g)
    k[0, 0, 20, 3] = float("nan")
    out = ext.sharp_attention(q, k, v, causal=True, mode="none")
    want = sdpa(q, k, v, causal=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isfinite(out[0, 0, :20]).all() and torch.isnan(out[0, 0, 20:]).all()
    assert torch.isfinite(out[0, 1]).all()


def test_nan_value_beyond_kv_lens_is_ignored():
    """Keys past kv_len are not part of the sequence: a NaN value there changes nothing."""
    g = make_gen(36)
    q, k, v = make_qkv(2, 2, 1, 4, 100, 32, torch.float32, g)
    kl = torch.tensor([99, 100], dtype=torch.int32)
    clean = ext.sharp_attention(q, k, v, causal=True, kv_lens=kl, n_ref=8)
    v[:, 0, 99, 0] = float("nan")
    out = ext.sharp_attention(q, k, v, causal=True, kv_lens=kl, n_ref=8)
    torch.testing.assert_close(out[0], clean[0], rtol=0, atol=0)
    assert torch.isnan(out[1, :, -1, 0]).all()  # batch 1's last row does see key 99


@pytest.mark.parametrize("kind", ["causal", "attn_mask"])
def test_nan_value_of_unseen_key_does_not_leak(kind):
    g = make_gen(35)
    Lq, Lk = 4, 100
    q, k, v = make_qkv(1, 1, 1, Lq, Lk, 32, torch.float32, g)
    kw = dict(causal=True) if kind == "causal" else dict(attn_mask=torch.arange(Lk) < Lk - 1)
    v[0, 0, Lk - 1, 0] = float("nan")  # causal: only the last row sees key Lk - 1
    out = ext.sharp_attention(q, k, v, mode="none", **kw)
    want = ref.sharp_attention_ref(q, k, v, mode="none", **kw)
    nan_rows = torch.isnan(out[0, 0, :, 0]).nonzero().flatten().tolist()
    want_rows = torch.isnan(want[0, 0, :, 0]).nonzero().flatten().tolist()
    assert nan_rows == want_rows, f"rows with NaN: kernel {nan_rows}, reference {want_rows}"


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    g = make_gen(77)
    q, k, v = make_qkv(1, 6, 2, 24, 70, 64, torch.float32, g)
    slope = torch.linspace(0.1, 0.4, 6)
    m = tree_mask(24, 70, g)

    def f(q, k, v, m, slope):
        out, lse = ext.sharp_attention(q, k, v, attn_mask=m, n_ref=16, slope=slope,
                                       return_lse=True)
        out2 = ext.sharp_attention(q, k, v, causal=True, window=20, mode="exact_topk",
                                   n_ref=16, topk=4)
        return out * 2.0 + out2, lse - 1.0

    eager = f(q, k, v, m, slope)
    compiled = torch.compile(f, fullgraph=True)
    got = compiled(q, k, v, m, slope)
    torch.testing.assert_close(got[0], eager[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], eager[1], rtol=1e-6, atol=1e-6)
    # the compiled call depends on its inputs (no constant folding of a stale result)
    q2 = q.flip(2)
    torch.testing.assert_close(compiled(q2, k, v, m, slope)[0], f(q2, k, v, m, slope)[0],
                               rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_torch_compile_varlen_and_helpers():
    torch._dynamo.reset()
    g = make_gen(78)
    cu_q = torch.tensor([0, 5, 5, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 41, 60], dtype=torch.int32)
    q = torch.randn(17, 4, 32, generator=g)
    k, v = torch.randn(60, 2, 32, generator=g), torch.randn(60, 2, 32, generator=g)

    def f(q, k, v, cu_q, cu_k):
        out, lse = ext.sharp_attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=12,
                                              max_seqlen_k=30, causal=True, n_ref=8,
                                              return_lse=True)
        return out, lse

    eager = f(q, k, v, cu_q, cu_k)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], eager[1], rtol=0, atol=0)
    want = ref.sharp_attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, n_ref=8)
    torch.testing.assert_close(got[0].double(), want, rtol=1e-4, atol=1e-5)
