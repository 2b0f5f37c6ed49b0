"""The pure-PyTorch reference (sharpdraft_ext/reference.py) against independent computations:
hand-derived values (math.exp / math.log on Python floats), a scalar-loop implementation of
spec §2-§3 written separately here, and the two-level logit model of spec §1.

These tests need no compiled extension.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_gen, randn, ref, tree_mask

INF = float("inf")


# ---------------------------------------------------------------------------------------------
# An independent scalar implementation (Python floats, explicit loops)
# ---------------------------------------------------------------------------------------------
def beta_py(n, mode="fixed_slope", slope=0.2, n_ref=2048, topk=32, contrast=5.0,
            beta_min=1.0, beta_max=INF):
    if mode == "none":
        return 1.0
    if mode == "fixed_slope":
        if slope == 0:
            b = 1.0
        elif n <= 0:
            b = -INF
        else:
            b = 1.0 + slope * math.log(n / n_ref)
    else:
        b = 1.0 + math.log((n - topk) / (n_ref - topk)) / contrast if n > topk else 1.0
    return min(max(b, beta_min), beta_max)


def visible_py(b, h, i, j, Lq, Lk, causal, window, mask, kv_lens):
    kv_len = Lk if kv_lens is None else int(kv_lens[b])
    if j >= kv_len:
        return False
    p = i + kv_len - Lq
    if causal and j > p:
        return False
    if window is not None and j <= p - window:
        return False
    if mask is not None and not bool(mask[b, h, i, j]):
        return False
    return True


def naive_attention(q, k, v, *, causal=False, window=None, attn_mask=None, kv_lens=None,
                    scale=None, n_visible=None, **beta_kw):
    """Explicit-loop sharp attention on Python floats; returns (out, lse, n) as nested lists."""
    B, Hq, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    g = Hq // Hk
    sc = 1.0 / math.sqrt(D) if scale is None else scale
    mask = None
    if attn_mask is not None:
        mask = torch.broadcast_to(attn_mask, (B, Hq, Lq, Lk))
    slope = beta_kw.pop("slope", 0.2)
    Q, K, V = q.double().tolist(), k.double().tolist(), v.double().tolist()
    out = torch.zeros(B, Hq, Lq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Lq), -INF, dtype=torch.float64)
    ns = torch.zeros(B, Hq, Lq, dtype=torch.int64)
    for b in range(B):
        for h in range(Hq):
            hk = h // g
            lam = float(slope[h]) if isinstance(slope, torch.Tensor) else slope
            for i in range(Lq):
                vis = [j for j in range(Lk)
                       if visible_py(b, h, i, j, Lq, Lk, causal, window, mask, kv_lens)]
                n = len(vis)
                ns[b, h, i] = n
                if n == 0:
                    continue
                nb = n if n_visible is None else int(torch.broadcast_to(
                    torch.as_tensor(n_visible), (B, Hq, Lq))[b, h, i])
                beta = beta_py(nb, slope=lam, **beta_kw)
                s = [beta * sc * sum(Q[b][h][i][d] * K[b][hk][j][d] for d in range(D))
                     for j in vis]
                m = max(s)
                e = [math.exp(x - m) for x in s]
                z = sum(e)
                lse[b, h, i] = m + math.log(z)
                for d in range(D):
                    out[b, h, i, d] = sum(e[t] * V[b][hk][j][d] for t, j in enumerate(vis)) / z
    return out, lse, ns


# ---------------------------------------------------------------------------------------------
# beta(n)
# ---------------------------------------------------------------------------------------------
def test_query_scale_fixed_slope_hand_values():
    n = torch.tensor([1, 100, 2048, 4096, 8192, 65536])
    got = ref.query_scale_ref(n, mode="fixed_slope", slope=0.2, n_ref=2048)
    assert got.dtype == torch.float64
    # below n_ref the clamp beta_min = 1 holds; above: 1 + 0.2 ln(n / 2048)
    want = [1.0, 1.0, 1.0, 1.0 + 0.2 * math.log(2.0), 1.0 + 0.2 * math.log(4.0),
            1.0 + 0.2 * math.log(32.0)]
    assert got.tolist() == pytest.approx(want, rel=1e-14, abs=1e-14)
    # without the lower clamp short contexts are softened
    got = ref.query_scale_ref(n, mode="fixed_slope", slope=0.2, n_ref=2048, beta_min=0.0)
    assert got[1].item() == pytest.approx(1.0 + 0.2 * math.log(100 / 2048), rel=1e-14)
    # n_ref = 4096 (GLM) and an upper clamp
    got = ref.query_scale_ref(n, slope=0.25, n_ref=4096, beta_max=1.5)
    assert got[-1].item() == 1.5
    assert got[-2].item() == pytest.approx(1.0 + 0.25 * math.log(2.0), rel=1e-14)


def test_query_scale_exact_topk_hand_values():
    n = torch.tensor([5, 32, 33, 2048, 4096, 10_000])
    got = ref.query_scale_ref(n, mode="exact_topk", n_ref=2048, topk=32, contrast=5.0,
                              beta_min=-1e300)  # no lower clamp (beta_min must be finite)
    want = [1.0, 1.0, 1.0 + math.log(1 / 2016) / 5.0, 1.0, 1.0 + math.log(4064 / 2016) / 5.0,
            1.0 + math.log(9968 / 2016) / 5.0]
    assert got.tolist() == pytest.approx(want, rel=1e-14, abs=1e-14)
    got = ref.query_scale_ref(n, mode="exact_topk", n_ref=2048, topk=32, contrast=5.0)
    assert got[2].item() == 1.0  # clamped from below by beta_min = 1


def test_query_scale_none_is_exactly_one_without_clamp():
    n = torch.tensor([0, 1, 5000, 10**6])
    got = ref.query_scale_ref(n, mode="none", beta_min=2.0, beta_max=3.0)
    assert torch.equal(got, torch.ones(4, dtype=torch.float64))


def test_query_scale_per_head_slope_broadcast():
    slope = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float32)
    n = torch.tensor([[[1000, 4096], [8192, 16384], [2048, 3000]]])  # (B=1, Hq=3, Lq=2)
    got = ref.query_scale_ref(n, slope=slope, n_ref=2048)
    assert got.shape == (1, 3, 2)
    for h in range(3):
        for i in range(2):
            lam = float(slope[h])  # float32 value, as stored
            want = max(1.0, 1.0 + lam * math.log(int(n[0, h, i]) / 2048))
            assert got[0, h, i].item() == pytest.approx(want, rel=1e-14)


def test_query_scale_zero_count_is_clamped_not_nan():
    got = ref.query_scale_ref(torch.tensor([0]), mode="fixed_slope", beta_min=0.5)
    assert got.item() == 0.5
    got = ref.query_scale_ref(torch.tensor([0]), mode="fixed_slope", slope=0.0, beta_min=0.5)
    assert got.item() == 1.0


# ---------------------------------------------------------------------------------------------
# Visible keys and n_i
# ---------------------------------------------------------------------------------------------
def _counts(Lq, Lk, **kw):
    q = torch.ones(1, 1, Lq, 4)
    k = torch.ones(1, 1, Lk, 4)
    return ref.visible_counts_ref(q, k, **kw)[0, 0].tolist()


def test_counts_by_hand():
    assert _counts(3, 5) == [5, 5, 5]
    assert _counts(3, 5, causal=True) == [3, 4, 5]  # bottom-right: last row sees all keys
    assert _counts(3, 5, causal=True, window=2) == [2, 2, 2]
    assert _counts(5, 5, causal=True, window=3) == [1, 2, 3, 3, 3]
    assert _counts(3, 5, causal=True, kv_lens=torch.tensor([4])) == [2, 3, 4]
    assert _counts(3, 5, kv_lens=torch.tensor([4])) == [4, 4, 4]
    # Lq > kv_len: the first rows sit before key 0 and see nothing
    assert _counts(4, 6, causal=True, kv_lens=torch.tensor([2])) == [0, 0, 1, 2]
    assert _counts(2, 6, kv_lens=torch.tensor([0])) == [0, 0]
    # Lq > Lk, causal
    assert _counts(4, 2, causal=True) == [0, 0, 1, 2]


def test_counts_from_applied_mask():
    m = torch.tensor([[True, False, True, True, False],
                      [False, False, False, False, False],
                      [True, True, True, True, True]])
    assert _counts(3, 5, attn_mask=m) == [3, 0, 5]
    # mask combined with causal: row 0 sees keys 0..2 of which the mask keeps 0 and 2
    assert _counts(3, 5, attn_mask=m, causal=True) == [2, 0, 5]
    # the n_visible override is returned as is (broadcast)
    q, k = torch.ones(2, 3, 4, 8), torch.ones(2, 1, 6, 8)
    nv = ref.visible_counts_ref(q, k, causal=True, n_visible=torch.tensor([7, 8, 9, 10]))
    assert nv.shape == (2, 3, 4) and nv.dtype == torch.int64
    assert nv[1, 2].tolist() == [7, 8, 9, 10]


def test_tree_mask_counts_are_prefix_plus_depth():
    g = make_gen(3)
    Lq, prefix = 9, 20
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 5]
    depth = []
    for t in range(Lq):
        d, a = 0, t
        while a >= 0:
            d, a = d + 1, parents[a]
        depth.append(d)
    m = tree_mask(Lq, prefix + Lq, g, parents=parents)
    assert _counts(Lq, prefix + Lq, attn_mask=m) == [prefix + d for d in depth]


def test_visible_mask_per_head_mask_and_gqa_shapes():
    g = make_gen(1)
    m = torch.rand(2, 4, 3, 7, generator=g) < 0.5
    q, k = randn((2, 4, 3, 8), gen=g), randn((2, 2, 7, 8), gen=g)
    vis = ref.visible_mask_ref(q, k, attn_mask=m)
    assert vis.dtype == torch.bool and vis.shape == (2, 4, 3, 7)
    assert torch.equal(vis, m)


# ---------------------------------------------------------------------------------------------
# Attention: hand-computed cases
# ---------------------------------------------------------------------------------------------
def test_one_row_by_hand():
    f64 = torch.float64  # the literals below are not float32-exact
    q = torch.tensor([[[[0.3, -1.2]]]], dtype=f64)
    k = torch.tensor([[[[1.0, 0.5], [-0.7, 2.0], [0.4, -0.1]]]], dtype=f64)
    v = torch.tensor([[[[1.5, -2.0], [0.25, 3.0], [-1.0, 0.75]]]], dtype=f64)
    for n_ref, want_beta in ((2048, 1.0), (2, 1.0 + 0.2 * math.log(3 / 2))):
        beta = want_beta
        s = [beta * (0.3 * kk[0] - 1.2 * kk[1]) / math.sqrt(2.0)
             for kk in ([1.0, 0.5], [-0.7, 2.0], [0.4, -0.1])]
        e = [math.exp(x) for x in s]
        z = sum(e)
        want = [sum(e[j] * vv[d] for j, vv in enumerate(([1.5, -2.0], [0.25, 3.0], [-1.0, 0.75])))
                / z for d in range(2)]
        out, lse = ref.sharp_attention_ref(q, k, v, n_ref=n_ref, return_lse=True)
        assert out.dtype == torch.float64 and lse.dtype == torch.float64
        assert out[0, 0, 0].tolist() == pytest.approx(want, rel=1e-12)
        assert lse.item() == pytest.approx(math.log(z), rel=1e-12)


def test_one_row_explicit_scale_and_mask():
    q = torch.tensor([[[[2.0]]]])
    k = torch.tensor([[[[1.0], [3.0], [-1.0]]]])
    v = torch.tensor([[[[10.0], [20.0], [30.0]]]])
    m = torch.tensor([True, False, True])
    out, lse = ref.sharp_attention_ref(q, k, v, attn_mask=m, scale=0.5, mode="none",
                                       return_lse=True)
    e0, e2 = math.exp(1.0), math.exp(-1.0)
    assert out.item() == pytest.approx((10 * e0 + 30 * e2) / (e0 + e2), rel=1e-13)
    assert lse.item() == pytest.approx(math.log(e0 + e2), rel=1e-13)


def test_empty_rows_are_zero_with_minus_inf_lse():
    g = make_gen(5)
    q, k, v = randn((1, 2, 5, 16), gen=g), randn((1, 2, 3, 16), gen=g), randn((1, 2, 3, 16), gen=g)
    for upcast, dt in ((True, torch.float64), (False, torch.float32)):
        out, lse = ref.sharp_attention_ref(q, k, v, causal=True, return_lse=True, upcast=upcast)
        assert out.dtype == (torch.float64 if upcast else torch.float32)
        assert lse.dtype == dt
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        # Lq = 5 > Lk = 3: rows 0 and 1 see nothing
        assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
        assert torch.isneginf(lse[:, :, :2]).all()
        assert torch.isfinite(lse[:, :, 2:]).all()
        assert (out[:, :, 2:].abs() > 0).any()
    out, lse = ref.sharp_attention_ref(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert out.shape == (1, 2, 5, 16) and torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, window=2),
    dict(causal=True, kv_lens=[5, 2]),
    dict(kv_lens=[0, 4]),
    dict(attn_mask="head"),
    dict(attn_mask="bcast", causal=True),
    dict(mode="exact_topk", n_ref=6, topk=2, contrast=2.0),
    dict(n_ref=2, slope=0.5),
    dict(n_ref=2, slope="tensor"),
    dict(n_ref=3, n_visible=[[[9], [2], [40], [1]]], beta_min=0.5),
    dict(mode="none", scale=0.3),
    dict(n_ref=2, beta_max=1.1, beta_min=0.9),
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("Lq,Lk", [(4, 7), (6, 6), (7, 3)])
def test_against_scalar_loops(case, Lq, Lk):
    g = make_gen(100 * Lq + Lk)
    B, Hq, Hk, D = 2, 4, 2, 3
    q = randn((B, Hq, Lq, D), gen=g)
    k, v = randn((B, Hk, Lk, D), gen=g), randn((B, Hk, Lk, D), gen=g)
    kw = dict(case)
    if "kv_lens" in kw:
        kw["kv_lens"] = torch.tensor([min(x, Lk) for x in kw["kv_lens"]], dtype=torch.int32)
    if kw.get("attn_mask") == "head":
        kw["attn_mask"] = torch.rand(B, Hq, Lq, Lk, generator=g) < 0.6
    elif kw.get("attn_mask") == "bcast":
        kw["attn_mask"] = torch.rand(Lq, Lk, generator=g) < 0.6
    if kw.get("slope") == "tensor":
        kw["slope"] = torch.tensor([0.1, 0.7, 0.3, 0.0])
    if "n_visible" in kw:
        kw["n_visible"] = torch.tensor(kw["n_visible"], dtype=torch.int64)
    want_out, want_lse, want_n = naive_attention(q, k, v, **dict(kw))
    out, lse = ref.sharp_attention_ref(q, k, v, return_lse=True, **kw)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-13)
    counts = ref.visible_counts_ref(q, k, causal=kw.get("causal", False),
                                    window=kw.get("window"), attn_mask=kw.get("attn_mask"),
                                    kv_lens=kw.get("kv_lens"))
    assert torch.equal(counts, want_n)
    # the float32 run stays close to the float64 one and keeps its dtype
    out32, lse32 = ref.sharp_attention_ref(q, k, v, return_lse=True, upcast=False, **kw)
    assert out32.dtype == torch.float32 and lse32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), want_out, rtol=1e-4, atol=1e-5)


def test_gqa_head_mapping():
    """Query head h reads kv head h // (Hq / Hk): with distinct kv heads the outputs differ."""
    g = make_gen(9)
    q = randn((1, 6, 3, 8), gen=g)
    k, v = randn((1, 2, 5, 8), gen=g), randn((1, 2, 5, 8), gen=g)
    out = ref.sharp_attention_ref(q, k, v)
    for h in range(6):
        hk = h // 3
        single = ref.sharp_attention_ref(q[:, h:h + 1], k[:, hk:hk + 1], v[:, hk:hk + 1])
        torch.testing.assert_close(out[:, h:h + 1], single, rtol=0, atol=0)
        other = ref.sharp_attention_ref(q[:, h:h + 1], k[:, 1 - hk:2 - hk], v[:, 1 - hk:2 - hk])
        assert (out[:, h:h + 1] - other).abs().max() > 1e-3


def test_low_precision_reference_runs_in_T():
    g = make_gen(11)
    q = randn((1, 2, 9, 32), gen=g)
    k, v = randn((1, 2, 40, 32), gen=g), randn((1, 2, 40, 32), gen=g)
    o64 = ref.sharp_attention_ref(q, k, v, causal=True, n_ref=8)
    for dt, tol in ((torch.float16, 5e-3), (torch.bfloat16, 4e-2)):
        oT, lT = ref.sharp_attention_ref(q.to(dt), k.to(dt), v.to(dt), causal=True, n_ref=8,
                                         upcast=False, return_lse=True)
        assert oT.dtype == dt and lT.dtype == torch.float32
        err = (oT.double() - o64).abs().max().item()
        assert 0 < err < tol  # genuinely lower precision, still close


def test_noncontiguous_inputs_match_contiguous():
    g = make_gen(13)
    qb = randn((2, 7, 3, 16), gen=g)  # (B, L, H, D)
    kb, vb = randn((2, 9, 3, 16), gen=g), randn((2, 9, 3, 16), gen=g)
    a = ref.sharp_attention_ref(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                causal=True, n_ref=3)
    b = ref.sharp_attention_ref(qb.transpose(1, 2).contiguous(), kb.transpose(1, 2).contiguous(),
                                vb.transpose(1, 2).contiguous(), causal=True, n_ref=3)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------------------------
def test_varlen_against_scalar_loops():
    g = make_gen(17)
    Hq, Hk, D = 4, 2, 5
    lq, lk = [3, 0, 4, 2], [5, 3, 0, 2]
    cu_q = torch.tensor([0] + lq).cumsum(0).int()      # [0, 3, 3, 7, 9]
    cu_k = torch.tensor([0] + lk).cumsum(0).int()      # [0, 5, 8, 8, 10]
    q, k, v = randn((9, Hq, D), gen=g), randn((10, Hk, D), gen=g), randn((10, Hk, D), gen=g)
    nv = torch.arange(9 * Hq).reshape(9, Hq) + 1
    for kw in (dict(causal=True, n_ref=2), dict(n_ref=2, slope=0.4, n_visible=nv),
               dict(causal=True, window=2, mode="exact_topk", n_ref=4, topk=1)):
        out, lse = ref.sharp_attention_varlen_ref(q, k, v, cu_q, cu_k, max_seqlen_q=4,
                                                  max_seqlen_k=5, return_lse=True, **kw)
        assert out.shape == (9, Hq, D) and lse.shape == (Hq, 9)
        for b in range(4):
            q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
            if q1 == q0:
                continue
            kwb = dict(kw)
            if "n_visible" in kwb:
                kwb["n_visible"] = kwb["n_visible"][q0:q1].T.unsqueeze(0)
            wo, wl, _ = naive_attention(q[q0:q1].transpose(0, 1)[None],
                                        k[k0:k1].transpose(0, 1)[None],
                                        v[k0:k1].transpose(0, 1)[None], **kwb)
            torch.testing.assert_close(out[q0:q1], wo[0].transpose(0, 1), rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(lse[:, q0:q1], wl[0], rtol=1e-12, atol=1e-13)
        # sequence 2 has no keys: its q rows 3..6 are empty
        assert torch.equal(out[3:7], torch.zeros_like(out[3:7]))
        assert torch.isneginf(lse[:, 3:7]).all()


# ---------------------------------------------------------------------------------------------
# The two-level logit model (spec §1)
# ---------------------------------------------------------------------------------------------
def _topk_mass(n, k, delta, **kw):
    """Top-k mass of one row with n keys: k keys at logit 1 + delta, n - k at logit 1."""
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    keys = torch.ones(1, 1, n, 1, dtype=torch.float64)
    keys[..., :k, :] = 1.0 + delta
    vals = torch.ones(1, 1, n, 1, dtype=torch.float64)
    vals[..., :k, :] = 2.0  # out = 1 + top-k mass
    out = ref.sharp_attention_ref(q, keys, vals, scale=1.0, **kw)
    return out.item() - 1.0


def _mass_formula(beta, n, k, delta):
    return 1.0 / (1.0 + (n - k) / k * math.exp(-beta * delta))


def _mass_tol(n, mass, beta=2.0, delta=5.0):
    """Absolute error bound of `_topk_mass` against the closed form, from the computation's
    conditioning rather than from one machine's rounding. The reference sums n float64 terms
    (softmax numerator and denominator; any summation order obeys |err| <= gamma_n * sum|x|,
    gamma_n = n u / (1 - n u), u = 2^-53, Higham Thm 4.4), divides, and then subtracts 1 from
    out = 1 + mass, so the absolute error of the mass is about (1 + mass) * 2 gamma_n. The
    exponent beta * delta carries a relative rounding of a few u, which moves exp() by about
    beta * delta * u relative. Factor 2 for the closed form's own rounding."""
    u = 2.0 ** -53
    gamma = n * u / (1.0 - n * u)
    return 2.0 * ((1.0 + mass) * (2.0 * gamma + 4.0 * u) + mass * beta * delta * 4.0 * u)


@pytest.mark.parametrize("n", [4096, 8192, 32768])
def test_two_level_model_restores_topk_mass(n):
    delta, k, n_ref = 5.0, 32, 2048
    m_ref = _topk_mass(n_ref, k, delta, mode="none")
    assert m_ref == pytest.approx(_mass_formula(1.0, n_ref, k, delta), rel=0,
                                  abs=_mass_tol(n_ref, m_ref))
    m_none = _topk_mass(n, k, delta, mode="none")
    m_exact = _topk_mass(n, k, delta, mode="exact_topk", n_ref=n_ref, topk=k, contrast=delta)
    m_fixed = _topk_mass(n, k, delta, mode="fixed_slope", n_ref=n_ref, slope=1.0 / delta)
    # dilution is real: without scaling the mass drops by much more than the tolerances below
    assert m_ref - m_none > 0.1
    # exact_topk restores the mass exactly
    assert m_exact == pytest.approx(m_ref, rel=0,
                                    abs=_mass_tol(n, m_exact) + _mass_tol(n_ref, m_ref))
    # fixed_slope is its n >> k approximation: beta_fixed < beta_exact by
    # ln(n/n_ref) - ln((n-k)/(n_ref-k)) ~ k (1/n_ref - 1/n) / delta, so a slight under-restoration
    b_fixed = 1.0 + math.log(n / n_ref) / delta
    b_exact = 1.0 + math.log((n - k) / (n_ref - k)) / delta
    assert b_fixed < b_exact
    assert m_fixed == pytest.approx(_mass_formula(b_fixed, n, k, delta), rel=0,
                                    abs=_mass_tol(n, m_fixed, beta=b_fixed, delta=delta))
    assert m_fixed < m_ref
    assert m_ref - m_fixed < 0.01 * m_ref


def test_calibration_inverts_the_model():
    """Delta = ln((n_ref - k) / k) - ln(1 / M_ref - 1) recovers the contrast (spec §1)."""
    k, n_ref = 32, 2048
    for delta in (3.0, 5.0, 7.5):
        m = _topk_mass(n_ref, k, delta, mode="none")
        assert math.log((n_ref - k) / k) - math.log(1.0 / m - 1.0) == pytest.approx(delta, rel=1e-9)


def test_nan_value_of_masked_key_does_not_poison_rows():
    g = make_gen(23)
    q, k, v = randn((1, 1, 6, 4), gen=g), randn((1, 1, 6, 4), gen=g), randn((1, 1, 6, 4), gen=g)
    v[0, 0, 3, 1] = float("nan")
    out = ref.sharp_attention_ref(q, k, v, causal=True, n_ref=2)
    want, _, _ = naive_attention(q, k, v, causal=True, n_ref=2)  # NaN where key 3 is seen
    assert torch.isfinite(out[0, 0, :3]).all()
    assert torch.isnan(out[0, 0, 3:, 1]).all() and torch.isfinite(out[0, 0, 3:, [0, 2, 3]]).all()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-13, equal_nan=True)
