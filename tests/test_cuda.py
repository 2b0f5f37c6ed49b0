"""The CUDA kernel (sharpdraft_ext._cuda).

Without a GPU: the extension imports and registers CUDA kernels; calling them with CPU tensors
raises a clear error (these run whenever _cuda is importable).
With a GPU: the kernel against the float64 reference under the spec §6 rule (references run on
CPU on the same inputs), and against the CPU kernel (same empty rows, lse within the rule).
The grid covers head dims 64/128/256, float16/bfloat16, every mask kind, Lq != Lk, empty rows,
GQA, the three modes, per-head slopes, n_visible, extreme logits, non-tile-multiple lengths,
split-KV shapes (decode, DFlash blocks), varlen with zero-length sequences and misaligned
layouts. Inputs are fresh standard-normal draws.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from conftest import (assert_close_spec, make_gen, make_qkv, make_varlen_qkv, random_bool_mask,
                      ref, stable_seed, tree_mask)


def _import_cuda_ext():
    try:
        import sharpdraft_ext

        importlib.import_module("sharpdraft_ext._cuda")
        return sharpdraft_ext
    except ImportError:
        return None


ext = _import_cuda_ext()
HAS_GPU = ext is not None and torch.cuda.is_available()
needs_ext = pytest.mark.skipif(ext is None, reason="sharpdraft_ext._cuda is not built")
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and sharpdraft_ext._cuda")

DT16 = (torch.float16, torch.bfloat16)
DT_ID = {torch.float16: "f16", torch.bfloat16: "bf16"}


# ---------------------------------------------------------------------------------------------
# No GPU needed
# ---------------------------------------------------------------------------------------------
@needs_ext
def test_cuda_extension_imports_and_registers():
    assert ext.HAS_CUDA_KERNELS
    for op in ("sharp_attention", "sharp_attention_varlen"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sharpdraft::{op}", "CUDA"), op


@needs_ext
def test_cuda_kernel_rejects_cpu_tensors():
    g = make_gen(1)
    q, k, v = make_qkv(1, 2, 2, 5, 7, 64, torch.float16, g)
    cuda_keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        torch.ops.sharpdraft.sharp_attention.default.redispatch(
            cuda_keys, q, k, v, False, None, None, None, None, "fixed_slope", 0.2, None, 2048,
            32, 5.0, 1.0, float("inf"), None)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        torch.ops.sharpdraft.sharp_attention_varlen.default.redispatch(
            cuda_keys, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu,
            torch.tensor([0, 7], dtype=torch.int32), None, None, False, None, None,
            "fixed_slope", 0.2, None, 2048, 32, 5.0, 1.0, float("inf"), None)


# ---------------------------------------------------------------------------------------------
# GPU runners
# ---------------------------------------------------------------------------------------------
def _to_cuda(kw):
    return {key: (val.cuda() if isinstance(val, torch.Tensor) else val) for key, val in kw.items()}


def _ctx(q, k, kw):
    parts = [f"q{tuple(q.shape)} {q.dtype} k{tuple(k.shape)}"]
    for key, val in kw.items():
        if isinstance(val, torch.Tensor):
            val = f"tensor{tuple(val.shape)}" if val.numel() > 8 else val.tolist()
        parts.append(f"{key}={val}")
    return " [" + ", ".join(parts) + "]"


def check_dense_cuda(q, k, v, **kw):
    """CUDA kernel vs float64 reference (spec §6) and vs the CPU kernel; inputs on CPU."""
    ctx = _ctx(q, k, kw)
    out, lse = ext.sharp_attention(q.cuda(), k.cuda(), v.cuda(), return_lse=True, **_to_cuda(kw))
    torch.cuda.synchronize()
    out, lse = out.cpu(), lse.cpu()
    o64, l64 = ref.sharp_attention_ref(q, k, v, return_lse=True, upcast=True, **kw)
    oT, lT = ref.sharp_attention_ref(q, k, v, return_lse=True, upcast=False, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape, f"out {out.dtype} {out.shape}{ctx}"
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3], f"lse {lse.shape}{ctx}"
    empty = torch.isneginf(l64).unsqueeze(-1)
    assert_close_spec(out, o64, oT, name="out", exact=empty, context=ctx)
    assert_close_spec(lse, l64, lT, name="lse", context=ctx)
    # The CPU kernel on the same inputs: the same empty rows, and its lse under the same rule.
    out_cpu, lse_cpu = ext.sharp_attention(q, k, v, return_lse=True, **kw)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_cpu)), f"empty rows differ{ctx}"
    assert_close_spec(lse, lse_cpu.double(), lT, name="lse vs CPU kernel", context=ctx)
    return out, o64


def check_varlen_cuda(q, k, v, cu_q, cu_k, **kw):
    ctx = _ctx(q, k, dict(kw, cu_seqlens_q=cu_q.tolist(), cu_seqlens_k=cu_k.tolist()))
    out, lse = ext.sharp_attention_varlen(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(),
                                          return_lse=True, **_to_cuda(kw))
    out, lse = out.cpu(), lse.cpu()
    o64, l64 = ref.sharp_attention_varlen_ref(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    oT, lT = ref.sharp_attention_varlen_ref(q, k, v, cu_q, cu_k, return_lse=True, upcast=False,
                                            **kw)
    assert out.dtype == q.dtype and out.shape == q.shape, f"out {out.dtype} {out.shape}{ctx}"
    assert lse.shape == (q.shape[1], q.shape[0]), f"lse {tuple(lse.shape)}{ctx}"
    empty = torch.isneginf(l64).transpose(0, 1).unsqueeze(-1)
    assert_close_spec(out, o64, oT, name="out", exact=empty, context=ctx)
    assert_close_spec(lse, l64, lT, name="lse", context=ctx)
    out_cpu, lse_cpu = ext.sharp_attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_cpu)), f"empty rows differ{ctx}"


def mask_kwargs(kind, B, Hq, Lq, Lk, gen):
    """Masking keywords of one named kind (spec §2), on CPU."""
    lens = lambda lo: torch.randint(lo, Lk + 1, (B,), generator=gen).to(torch.int32)  # noqa: E731
    table = {
        "none": lambda: {},
        "causal": lambda: dict(causal=True),
        "causal_window": lambda: dict(causal=True, window=max(1, Lk // 5)),
        "window1": lambda: dict(causal=True, window=1),
        "kv_lens": lambda: dict(kv_lens=lens(0)),
        "kv_lens_causal": lambda: dict(causal=True, kv_lens=lens(0)),
        "kv_lens_causal_window": lambda: dict(causal=True, window=7, kv_lens=lens(1)),
        "mask_bcast": lambda: dict(attn_mask=random_bool_mask((Lq, Lk), 0.6, gen)),
        "mask_batch": lambda: dict(attn_mask=random_bool_mask((B, 1, Lq, Lk), 0.6, gen)),
        "mask_head": lambda: dict(attn_mask=random_bool_mask((B, Hq, Lq, Lk), 0.5, gen)),
        "mask_rowkey": lambda: dict(attn_mask=random_bool_mask((1, Hq, 1, Lk), 0.5, gen)),
        "mask_causal": lambda: dict(causal=True,
                                    attn_mask=random_bool_mask((B, 1, Lq, Lk), 0.7, gen)),
        "tree": lambda: dict(attn_mask=tree_mask(Lq, Lk, gen)),
        "mask_window": lambda: dict(causal=True, window=33,
                                    attn_mask=random_bool_mask((B, Hq, Lq, Lk), 0.8, gen)),
    }
    return table[kind]()


MASK_KINDS = ["none", "causal", "causal_window", "window1", "kv_lens", "kv_lens_causal",
              "kv_lens_causal_window", "mask_bcast", "mask_batch", "mask_head", "mask_rowkey",
              "mask_causal", "tree", "mask_window"]


# ---------------------------------------------------------------------------------------------
# GPU grids
# ---------------------------------------------------------------------------------------------
@needs_gpu
@pytest.mark.parametrize("dtype", DT16, ids=DT_ID.get)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_mask_kinds(kind, D, dtype):
    g = make_gen(stable_seed("mask", kind, D, dtype))
    B, Hq, Hk, Lq, Lk = 2, 4, 2, 77, 203  # not tile multiples, Lq != Lk
    q, k, v = make_qkv(B, Hq, Hk, Lq, Lk, D, dtype, g)
    check_dense_cuda(q, k, v, n_ref=64, **mask_kwargs(kind, B, Hq, Lq, Lk, g))


@needs_gpu
@pytest.mark.parametrize("dtype", DT16, ids=DT_ID.get)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_mask_kinds_small_m(kind, D, dtype):
    """Lq <= 16 runs the one-warp tile (sharp_fwd_traits.h SmallMTraits), with split-KV."""
    g = make_gen(stable_seed("mask_small", kind, D, dtype))
    B, Hq, Hk, Lq, Lk = 2, 4, 2, 13, 1203
    q, k, v = make_qkv(B, Hq, Hk, Lq, Lk, D, dtype, g)
    check_dense_cuda(q, k, v, n_ref=64, **mask_kwargs(kind, B, Hq, Lq, Lk, g))


@needs_gpu
@pytest.mark.parametrize("dtype", DT16, ids=DT_ID.get)
@pytest.mark.parametrize("tile,D", [("alt", 64), ("alt", 128), ("wide", 128)])
@pytest.mark.parametrize("kind", ["none", "causal", "causal_window", "kv_lens_causal",
                                  "mask_head", "mask_causal"])
def test_switchable_tiles(kind, tile, D, dtype, monkeypatch):
    """SHARPDRAFT_CUDA_TILE=alt / wide (the switchable prefill tiles the benchmark times)."""
    monkeypatch.setenv("SHARPDRAFT_CUDA_TILE", tile)
    g = make_gen(stable_seed(tile, kind, D, dtype))
    B, Hq, Hk, Lq, Lk = 2, 4, 2, 150, 333
    q, k, v = make_qkv(B, Hq, Hk, Lq, Lk, D, dtype, g)
    check_dense_cuda(q, k, v, n_ref=64, **mask_kwargs(kind, B, Hq, Lq, Lk, g))


@needs_gpu
@pytest.mark.parametrize("dtype", DT16, ids=DT_ID.get)
@pytest.mark.parametrize("Lq,Lk,causal", [(1, 300, False), (300, 17, True), (300, 17, False),
                                          (16, 257, True), (129, 129, True), (2, 1, True),
                                          (64, 64, True), (200, 1000, True), (1000, 200, False),
                                          (5, 0, False)])
@pytest.mark.parametrize("D", [64, 128])
def test_lengths(Lq, Lk, causal, D, dtype):
    g = make_gen(stable_seed("len", Lq, Lk, causal, D, dtype))
    q, k, v = make_qkv(2, 2, 1, Lq, Lk, D, dtype, g)
    check_dense_cuda(q, k, v, causal=causal, n_ref=32)


@needs_gpu
@pytest.mark.parametrize("dtype", DT16, ids=DT_ID.get)
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_gqa(ratio, dtype):
    g = make_gen(stable_seed("gqa", ratio, dtype))
    q, k, v = make_qkv(2, 2 * ratio, 2, 70, 150, 128, dtype, g)
    check_dense_cuda(q, k, v, causal=True, n_ref=32)


MODE_CASES = [
    dict(mode="none"),
    dict(mode="fixed_slope"),
    dict(mode="fixed_slope", n_ref=16),
    dict(mode="fixed_slope", n_ref=16, slope=0.5, beta_max=1.4),
    dict(mode="fixed_slope", n_ref=300, slope=0.3, beta_min=0.7),
    dict(mode="fixed_slope", n_ref=4096, slope=2.0, beta_min=-3.0),   # negative beta rows
    dict(mode="fixed_slope", n_ref=16, slope="per_head"),
    dict(mode="exact_topk", n_ref=40, topk=8, contrast=2.0),
    dict(mode="exact_topk", n_ref=2048, topk=32, contrast=5.0, beta_min=0.5),
    dict(mode="fixed_slope", n_ref=64, n_visible="per_row"),
    dict(mode="exact_topk", n_ref=64, topk=4, contrast=3.0, n_visible=torch.tensor(5000)),
    dict(mode="fixed_slope", n_ref=16, scale=0.07),
    dict(mode="fixed_slope", n_ref=16, scale=0.0),
]


@needs_gpu
@pytest.mark.parametrize("dtype", DT16, ids=DT_ID.get)
@pytest.mark.parametrize("case", range(len(MODE_CASES)))
def test_modes(case, dtype):
    g = make_gen(stable_seed("mode", case, dtype))
    B, Hq, Hk, Lq, Lk = 2, 4, 2, 50, 170
    q, k, v = make_qkv(B, Hq, Hk, Lq, Lk, 64, dtype, g)
    kw = dict(MODE_CASES[case])
    if isinstance(kw.get("slope"), str):
        kw["slope"] = torch.tensor([0.0, 0.15, 0.4, 1.0], dtype=torch.float32)
    if isinstance(kw.get("n_visible"), str):
        kw["n_visible"] = torch.randint(1, 20000, (B, 1, Lq), generator=g)
    check_dense_cuda(q, k, v, causal=True, **kw)


@needs_gpu
@pytest.mark.parametrize("dtype", DT16, ids=DT_ID.get)
@pytest.mark.parametrize("mode", ["none", "fixed_slope", "exact_topk"])
@pytest.mark.parametrize("kind", ["causal", "mask_head", "none"])
def test_extreme_logits(kind, mode, dtype):
    g = make_gen(stable_seed("extreme", kind, mode, dtype))
    B, Hq, Lq, Lk = 2, 2, 40, 300
    q, k, v = make_qkv(B, Hq, Hq, Lq, Lk, 128, dtype, g, extreme=True)
    check_dense_cuda(q, k, v, mode=mode, n_ref=64, topk=4, **mask_kwargs(kind, B, Hq, Lq, Lk, g))


@needs_gpu
@pytest.mark.parametrize("dtype", DT16, ids=DT_ID.get)
@pytest.mark.parametrize("Lq,Lk,B,H,causal", [(1, 8192, 1, 4, True), (1, 5000, 3, 2, False),
                                              (16, 8192, 1, 4, False), (16, 3001, 2, 2, True),
                                              (1, 700, 1, 1, True)])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_split_kv_shapes(Lq, Lk, B, H, causal, D, dtype):
    """Decode and DFlash-block shapes: few query tiles, so the kernel splits the keys."""
    g = make_gen(stable_seed("split", Lq, Lk, B, H, causal, D, dtype))
    q, k, v = make_qkv(B, H, max(1, H // 2), Lq, Lk, D, dtype, g)
    check_dense_cuda(q, k, v, causal=causal)


@needs_gpu
@pytest.mark.parametrize("dtype", DT16, ids=DT_ID.get)
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_layouts(layout, dtype):
    g = make_gen(stable_seed("layout", layout, dtype))
    q, k, v = make_qkv(2, 4, 2, 45, 130, 64, dtype, g, layout=layout)
    check_dense_cuda(q, k, v, causal=True, n_ref=16)


VARLEN_CASES = [
    dict(lq=[5, 0, 17, 3], lk=[40, 9, 17, 0], causal=True),
    dict(lq=[1, 1, 1], lk=[300, 1, 77]),
    dict(lq=[1, 1], lk=[9000, 4100], causal=True),                 # split-KV, varlen
    dict(lq=[16, 16], lk=[100, 16], causal=True, window=9),
    dict(lq=[0, 0, 4], lk=[0, 5, 4], mode="exact_topk", n_ref=3, topk=1),
    dict(lq=[30, 2], lk=[10, 120], causal=True, n_visible="per_row"),
    dict(lq=[7, 129], lk=[129, 7], slope="per_head", sliced=True),
    dict(lq=[12, 40], lk=[60, 45], causal=True, extreme=True, mode="none"),
    dict(lq=[300, 1, 130], lk=[300, 500, 129], causal=True, D=256),
]


@needs_gpu
@pytest.mark.parametrize("dtype", DT16, ids=DT_ID.get)
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_varlen(case, dtype):
    g = make_gen(stable_seed("varlen", case, dtype))
    kw = dict(VARLEN_CASES[case])
    lq, lk = kw.pop("lq"), kw.pop("lk")
    D = kw.pop("D", 128)
    extreme, sliced = kw.pop("extreme", False), kw.pop("sliced", False)
    Hq, Hk = 4, 2
    q, k, v, cu_q, cu_k = make_varlen_qkv(lq, lk, Hq, Hk, D, dtype, g, extreme=extreme,
                                          sliced=sliced)
    if kw.get("slope") == "per_head":
        kw["slope"] = torch.tensor([0.1, 0.2, 0.0, 0.7], dtype=torch.float32)
    if kw.get("n_visible") == "per_row":
        kw["n_visible"] = torch.randint(0, 5000, (q.shape[0], 1), generator=g)
    kw.setdefault("n_ref", 16)
    check_varlen_cuda(q, k, v, cu_q, cu_k, **kw)


@needs_gpu
def test_nan_rows_do_not_leak():
    g = make_gen(7)
    q, k, v = make_qkv(1, 2, 2, 130, 140, 64, torch.bfloat16, g)
    q[0, 0, 3] = float("nan")
    out = ext.sharp_attention(q.cuda(), k.cuda(), v.cuda(), causal=True).cpu()
    assert torch.isnan(out[0, 0, 3]).all()
    rest = torch.ones(out.shape[:3], dtype=torch.bool)
    rest[0, 0, 3] = False
    assert torch.isfinite(out[rest]).all()


@needs_gpu
def test_unsupported_inputs_raise():
    g = make_gen(3)
    q, k, v = make_qkv(1, 2, 2, 8, 8, 64, torch.float32, g)
    with pytest.raises(ValueError, match="bfloat16 and float16"):
        ext.sharp_attention(q.cuda(), k.cuda(), v.cuda())
    q, k, v = make_qkv(1, 2, 2, 8, 8, 96, torch.float16, g)
    with pytest.raises(ValueError, match="64, 128 and 256"):
        ext.sharp_attention(q.cuda(), k.cuda(), v.cuda())


@needs_gpu
def test_current_stream_and_graph_capture():
    """The kernel runs on the current stream (also under CUDA-graph capture)."""
    g = make_gen(11)
    q, k, v = (t.cuda() for t in make_qkv(1, 4, 4, 1, 4000, 128, torch.float16, g))
    expect = ext.sharp_attention(q, k, v, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = ext.sharp_attention(q, k, v, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)
