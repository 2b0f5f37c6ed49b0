"""The CPU linear layer for few rows (sharpdraft_ext.cpu_runtime.pack_linear_weight /
packed_linear) against a float64 F.linear (spec §6 rule, with float32 F.linear as the torch
baseline), its argument errors, its fake kernels, each instruction set (in a subprocess: the
choice is made once per process), and the target runtime's use of it (PackedLinear,
plan_linears). Outputs are held to the forward error bound of a float32 dot product, whatever
the order of summation (so the tolerance follows the maths, not one machine's BLAS)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sharpdraft.target import linears
from sharpdraft.target.linears import (LINEAR_PATHS, PANEL_MAX_ROWS, ROW_REGIMES, PackedLinear,
                                       linear_paths, plan_linears)
from sharpdraft_ext import cpu_runtime as rt


def _case(rows, n, k, bias, seed, lead=()):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(*lead, rows, k, generator=g)
    return x, w, b


def assert_within_dot_bound(out, x, w, b=None):
    """|out - (x w^T + b)| <= gamma_n * (|x| |w|^T + |b|) elementwise, the float64 reference on
    the right: the forward error bound of a float32 sum of n = in_features + 1 products
    accumulated in any order, gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and
    Stability of Numerical Algorithms, section 3.1)."""
    x64, w64 = x.detach().double(), w.detach().double()
    b64 = None if b is None else b.detach().double()
    ref = F.linear(x64, w64, b64)
    mag = F.linear(x64.abs(), w64.abs(), None if b64 is None else b64.abs())
    n = w.shape[1] + 1
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    err = (out.double() - ref).abs()
    worst = (err / (gamma * mag + 1e-300)).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the dot-product bound"


def _check(x, w, b):
    assert_within_dot_bound(rt.packed_linear(x, rt.pack_linear_weight(w), w.shape[0], b),
                            x, w, b)


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("n", [1, 47, 48, 49, 200])
def test_packed_linear_matches_float64(rows, n):
    _check(*_case(rows, n, 64, bias=rows % 2 == 0, seed=rows * 100 + n))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 20), n=st.integers(1, 130), k=st.integers(1, 100),
       bias=st.booleans(), lead=st.lists(st.integers(1, 3), max_size=2),
       seed=st.integers(0, 2 ** 16))
def test_packed_linear_random_shapes(rows, n, k, bias, lead, seed):
    _check(*_case(rows, n, k, bias, seed, tuple(lead)))


def test_packed_linear_reads_strided_x_and_an_empty_batch():
    x, w, b = _case(6, 30, 40, True, 1)
    wide = torch.randn(6, 80)
    wide[:, ::2] = x                                   # x as a non-contiguous view
    _check(wide[:, ::2], w, b)
    packed = rt.pack_linear_weight(w)
    assert rt.packed_linear(torch.randn(0, 40), packed, 30).shape == (0, 30)


def test_pack_linear_weight_layout():
    """Panel p, row kk, column j holds w[p * width + j, kk], zero past out_features."""
    w = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3) + 1
    width = rt.panel_width()
    packed = rt.pack_linear_weight(w)
    assert packed.shape == (1, 3, width)
    assert torch.equal(packed[0, :, :5], w.t())
    assert not packed[0, :, 5:].any()


@pytest.mark.parametrize("call, arg", [
    (lambda p: rt.packed_linear(torch.randn(2, 5), p, 4), "x"),
    (lambda p: rt.packed_linear(torch.randn(2, 6).double(), p, 4), "x"),
    (lambda p: rt.packed_linear(torch.randn(2, 6), p.double(), 4), "packed"),
    (lambda p: rt.packed_linear(torch.randn(2, 6), p[..., :-1], 4), "pack the weight again"),
    (lambda p: rt.packed_linear(torch.randn(2, 6), p, 100), "out_features"),
    (lambda p: rt.packed_linear(torch.randn(2, 6), p, 4, torch.randn(3)), "bias"),
    (lambda p: rt.packed_linear(torch.randn(2, 6), p[:0], -3), "packed"),
    (lambda p: rt.pack_linear_weight(torch.randn(4)), "weight"),
    (lambda p: rt.pack_linear_weight(torch.randn(4, 6).bfloat16()), "weight"),
])
def test_bad_arguments_name_the_argument(call, arg):
    packed = rt.pack_linear_weight(torch.randn(4, 6))
    with pytest.raises(ValueError, match=arg):
        call(packed)


def test_fake_kernels_give_shapes_and_run_the_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    width = rt.panel_width()
    ops = torch.ops.sharpdraft_cpu_runtime
    with FakeTensorMode():
        w = torch.empty(50, 7)
        packed = ops.pack_linear_weight(w)
        assert packed.shape == ((50 + width - 1) // width, 7, width)
        out = ops.packed_linear(torch.empty(2, 3, 7), packed, 50, None)
        assert out.shape == (2, 3, 50)
        with pytest.raises(ValueError, match="out_features"):
            ops.packed_linear(torch.empty(3, 7), packed, 500, None)


@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_each_instruction_set(isa):
    """The panel kernels of the lower instruction sets (a capped process), where the CPU has
    them, against float64."""
    code = ("import torch, torch.nn.functional as F, sharpdraft_ext as ext\n"
            "from sharpdraft_ext import cpu_runtime as rt\n"
            "g = torch.Generator().manual_seed(0)\n"
            "w, b, x = torch.randn(50, 33, generator=g), torch.randn(50, generator=g), "
            "torch.randn(9, 33, generator=g)\n"
            "out = rt.packed_linear(x, rt.pack_linear_weight(w), 50, b).double()\n"
            "ref = F.linear(x.double(), w.double(), b.double())\n"
            "mag = F.linear(x.double().abs(), w.double().abs(), b.double().abs())\n"
            "gamma = 34 * 2.0 ** -24 / (1 - 34 * 2.0 ** -24)\n"   # 33 products + the bias
            "print(ext.cpu_isa(), rt.panel_width(), float(((out - ref).abs() / (gamma * mag))"
            ".max()))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, SHARPDRAFT_CPU_ISA=isa), check=True)
    got, width, err = res.stdout.split()     # err: the worst error / its bound
    if got != isa:
        pytest.skip(f"this CPU has no {isa} path below its own ({got})")
    assert int(width) == {"base": 8, "avx2": 16}[isa]
    assert float(err) <= 1.0          # within the float32 dot-product error bound


@pytest.mark.parametrize("path", LINEAR_PATHS)
@pytest.mark.parametrize("rows", [1, 8])
def test_packed_linear_module_on_each_path(path, rows):
    """PackedLinear with either row count on any path equals the layer it wraps, and follows an
    in-place weight update."""
    g = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(40, 52)
    mod = PackedLinear(lin, use_packed=(path,) * len(ROW_REGIMES))
    x = torch.randn(2, rows, 40, generator=g)
    with torch.no_grad():
        assert_within_dot_bound(mod(x), x, lin.weight, lin.bias)
        lin.weight.mul_(-2.0)
        assert_within_dot_bound(mod(x), x, lin.weight, lin.bias)


def test_a_prefill_skips_the_panel_kernel():
    """Past PANEL_MAX_ROWS rows the panel path runs F.linear itself: bitwise its output."""
    lin = torch.nn.Linear(64, 50)
    mod = PackedLinear(lin, use_packed=("panel",) * len(ROW_REGIMES))
    with torch.no_grad():
        x = torch.randn(PANEL_MAX_ROWS + 5, 64)
        assert torch.equal(mod(x), lin(x))
        assert mod.packed["panel"] is not None


def test_packed_linear_takes_the_path_of_each_row_regime(monkeypatch):
    """One path per ROW_REGIMES entry: 1 row, 2 .. 32 rows, 33 .. 96 rows; past that the panel
    kernel gives way to F.linear (a prefill), while oneDNN keeps its path."""
    taken = []
    real = linears.run_path
    monkeypatch.setattr(linears, "run_path", lambda p, *a: taken.append(p) or real(p, *a))
    lin = torch.nn.Linear(24, 40)
    bounds = [top for top, _ in ROW_REGIMES]
    assert bounds == [1, 32, 96] and PANEL_MAX_ROWS == 96
    cases = {("onednn", "panel", "onednn"): [(1, "onednn"), (2, "panel"), (32, "panel"),
                                             (33, "onednn"), (96, "onednn"), (200, "onednn")],
             ("panel", "onednn", "panel"): [(1, "panel"), (8, "onednn"), (64, "panel"),
                                            (97, None)],
             ("dense", "panel", "panel"): [(1, None), (8, "panel"), (64, "panel"),
                                           (97, None)]}
    with torch.no_grad():
        for plan, expected in cases.items():
            mod = PackedLinear(lin, use_packed=plan)
            for rows, path in expected:
                taken.clear()
                x = torch.randn(rows, 24)
                assert_within_dot_bound(mod(x), x, lin.weight, lin.bias)
                assert taken == ([path] if path else []), (plan, rows)


def test_plan_without_dense_or_a_usable_path():
    """Paths that leave a weight nothing to take (bfloat16 and the float32-only panel kernel)
    keep F.linear for it; a single usable path is taken without timing."""
    bf16 = torch.nn.Sequential(torch.nn.Linear(32, 48)).bfloat16()
    assert plan_linears(bf16, repeats=1, paths=("panel",)) == {}
    f32 = torch.nn.Sequential(torch.nn.Linear(32, 48))
    assert plan_linears(f32, repeats=1, paths=("panel",)) == {
        (48, 32, torch.float32): ("panel",) * len(ROW_REGIMES)}


def test_packed_linear_rejects_unknown_paths():
    with pytest.raises(ValueError, match="use_packed"):
        PackedLinear(torch.nn.Linear(4, 4), use_packed=("fast", "dense", "dense"))
    with pytest.raises(ValueError, match="use_packed"):
        PackedLinear(torch.nn.Linear(4, 4), use_packed=("dense", "panel"))   # one per regime


def test_plan_picks_one_measured_path_per_row_count():
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64),
                                torch.nn.Linear(64, 96))
    plan = plan_linears(model, repeats=3)
    assert set(plan) == {(96, 64, torch.float32), (64, 96, torch.float32)}
    for choice in plan.values():
        assert len(choice) == len(ROW_REGIMES) and set(choice) <= set(LINEAR_PATHS)
    only = plan_linears(model, repeats=3, paths=("dense", "panel"))
    assert all(set(c) <= {"dense", "panel"} for c in only.values())


def test_linear_paths_from_the_environment(monkeypatch):
    monkeypatch.delenv("SHARPDRAFT_LINEAR_PATHS", raising=False)
    assert linear_paths() == LINEAR_PATHS
    monkeypatch.setenv("SHARPDRAFT_LINEAR_PATHS", "dense, onednn")
    assert linear_paths() == ("dense", "onednn")
    for bad in ("dense,turbo", " , "):
        monkeypatch.setenv("SHARPDRAFT_LINEAR_PATHS", bad)
        with pytest.raises(ValueError, match="SHARPDRAFT_LINEAR_PATHS"):
            linear_paths()


def _q8_reference(x, w):
    """x w^T in float64 on what the Q8_0 path computes with: gguf-py's Q8_0 round trip of w
    (llama.cpp's rule) and x rounded per 32-block to int8 steps of max|x| / 127 (half to even)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType.Q8_0
    wq = torch.from_numpy(dequantize(quantize(w.numpy(), kind), kind).reshape(w.shape).copy())
    xb = x.reshape(-1, x.shape[-1] // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    xq = (torch.round(xb * inv).clamp(-127, 127) * d).reshape(x.shape)
    return F.linear(xq.double(), wq.double()), F.linear(xq.double().abs(), wq.double().abs())


@pytest.mark.parametrize("rows", [1, 8, 40])
def test_quant_path_runs_the_weight_re_quantised_to_q8_0(rows):
    """QUANT_PATH (a drafter's, when the target runs on quantised blocks): the integer maths of
    Q8_0 weights and int8 activations, held to a float32 bound against its float64 value, and
    within the quantisation's error of the float layer; autograd still takes F.linear."""
    g = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(96, 48, bias=False)
    mod = PackedLinear(lin, use_packed=(linears.QUANT_PATH,) * len(ROW_REGIMES))
    x = torch.randn(rows, 96, generator=g)
    with torch.no_grad():
        out = mod(x)
        ref, mag = _q8_reference(x, lin.weight.detach())
        assert float(((out.double() - ref).abs() - 1e-5 * mag).max()) <= 0
        exact = F.linear(x, lin.weight)
        assert float((out - exact).norm() / exact.norm()) < 0.02
        assert not torch.equal(out, exact)
    y = mod(x.requires_grad_())
    assert torch.equal(y, F.linear(x, lin.weight)) and y.requires_grad


def test_prepare_drafter_weighs_the_quant_path_only_when_asked():
    """prepare_drafter(quantised=True) lets the plan weigh QUANT_PATH; without it (or for the
    target's own plans) no layer takes it; a drafter that opts out (True) is left alone."""
    from sharpdraft.target.runtime import prepare_drafter

    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64))
    prepare_drafter(model, quantised=True)
    assert linears.QUANT_PATH in model._sharpdraft_packed
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(set(m.use_packed) <= set(LINEAR_PATHS) | {linears.QUANT_PATH} for m in packed)
    prepare_drafter(model, quantised=False)
    assert linears.QUANT_PATH not in model._sharpdraft_packed
    assert all(linears.QUANT_PATH not in m.use_packed
               for m in model.modules() if isinstance(m, PackedLinear))
    assert linears.QUANT_PATH not in {p for c in plan_linears(model, repeats=1).values()
                                      for p in c}
    opted = torch.nn.Sequential(torch.nn.Linear(64, 96))
    opted._sharpdraft_packed = True
    prepare_drafter(opted, quantised=True)
    assert type(opted[0]) is torch.nn.Linear
