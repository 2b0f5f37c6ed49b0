"""Forward-pass benchmark of the CUDA sharp-attention kernel against its baselines.

Shapes (bfloat16): the flash-attn convention (batch * seqlen = 16k tokens, hidden 2048, head dim
64 and 128, causal and not, seqlen 512 to 16k), decode (Lq 1 x Lk 8192) and DFlash blocks
(Lq 16 x Lk 8192, non-causal). Per shape, in the same run:

  sharp      ext.sharp_attention, mode="fixed_slope" (n_ref 1024: beta > 1 on long rows)
  sharp_none ext.sharp_attention, mode="none" (the same kernel without the scaling)
  sdpa       torch SDPA, flash backend, no scaling
  sdpa_pre   torch SDPA, flash backend, on q pre-multiplied by beta_i (the multiply is timed)
  fa2        flash_attn.flash_attn_func, when importable
  sharp_alt, sharp_wide  (--alt) sharp with SHARPDRAFT_CUDA_TILE=alt / wide: the kernel's
             switchable prefill tiles (wide: 32 query rows per warp at D 128)

Causal shapes with Lq != Lk use bottom-right alignment in the kernel; SDPA's is_causal is
top-left, so only Lq == Lk (or Lq == 1, non-causal) shapes are benchmarked causal.
TFLOP/s counts 4 * D flops per visible (query, key) pair. Writes a markdown table (and a JSON
file next to it).

    python benchmarks/bench_cuda.py --out benchmarks/results/kernel-gpu/results_cuda_h200.md [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import sharpdraft_ext as ext  # noqa: E402

try:
    from flash_attn import flash_attn_func  # type: ignore
except Exception:  # noqa: BLE001 - optional baseline
    flash_attn_func = None

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.functional import scaled_dot_product_attention as sdpa  # noqa: E402

N_REF = 1024


def time_ms(fn, min_total_ms=60.0, max_reps=50):
    """Median-free mean of CUDA-event timings after warm-up; enough reps for ~min_total_ms."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    reps = int(min(max_reps, max(3, math.ceil(min_total_ms / one))))
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


# Lq <= SMALL_M runs the one-warp tile (csrc/attention/cuda/sharp_fwd_traits.h kSmallM)
SMALL_M = 16


# The switchable prefill tiles (SHARPDRAFT_CUDA_TILE, csrc/attention/cuda/sharp_fwd_launch.cu)
# and the head dims where each differs from the default.
TILES = {"alt": (64, 128), "wide": (128,)}


def with_tile(tile, fn):
    """Runs fn with SHARPDRAFT_CUDA_TILE=tile (one of the kernel's switchable prefill tiles)."""
    os.environ["SHARPDRAFT_CUDA_TILE"] = tile
    try:
        return fn()
    finally:
        del os.environ["SHARPDRAFT_CUDA_TILE"]


def visible_pairs(B, H, Lq, Lk, causal):
    if not causal:
        return B * H * Lq * Lk
    off = Lk - Lq  # bottom-right: row i sees min(Lk, i + off + 1) keys
    per_head = sum(max(0, min(Lk, i + off + 1)) for i in range(Lq))
    return B * H * per_head


def bench_shape(name, B, H, Lq, Lk, D, causal, dtype=torch.bfloat16, alt=False):
    g = torch.Generator(device="cuda")
    g.manual_seed(B * 131 + Lq * 7 + Lk + D + int(causal))
    q = torch.randn(B, H, Lq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, H, Lk, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, H, Lk, D, device="cuda", dtype=dtype, generator=g)
    flops = 4.0 * D * visible_pairs(B, H, Lq, Lk, causal)

    # beta_i for the pre-scaled SDPA baseline (computed once, outside the timing).
    rows = torch.arange(Lq, device="cuda")
    n = torch.minimum(rows + (Lk - Lq) + 1, torch.tensor(Lk, device="cuda")) if causal else \
        torch.full((Lq,), Lk, device="cuda")
    beta = (1.0 + 0.2 * torch.log(n.double() / N_REF)).clamp_min(1.0).to(dtype)
    beta = beta.view(1, 1, Lq, 1)
    sdpa_causal = causal and Lq == Lk

    fns = {
        "sharp": lambda: ext.sharp_attention(q, k, v, causal=causal, mode="fixed_slope",
                                             n_ref=N_REF),
        "sharp_none": lambda: ext.sharp_attention(q, k, v, causal=causal, mode="none"),
    }
    if alt and Lq > SMALL_M:
        for tile, dims in TILES.items():
            if D in dims:
                fns[f"sharp_{tile}"] = lambda tile=tile: with_tile(tile, fns["sharp"])

    def run_sdpa(qq):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(qq, k, v, is_causal=sdpa_causal)

    fns["sdpa"] = lambda: run_sdpa(q)
    fns["sdpa_pre"] = lambda: run_sdpa(q * beta)
    if flash_attn_func is not None:
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        fns["fa2"] = lambda: flash_attn_func(qt, kt, vt, causal=causal)

    res = {"name": name, "B": B, "H": H, "Lq": Lq, "Lk": Lk, "D": D, "causal": causal,
           "flops": flops}
    for tile in TILES:  # a switchable tile must agree with the default one
        if f"sharp_{tile}" not in fns:
            continue
        try:
            diff = (fns[f"sharp_{tile}"]().float() - fns["sharp"]().float()).abs().max().item()
            res[f"{tile}_maxdiff"] = diff
        except Exception as err:  # noqa: BLE001
            res[f"sharp_{tile}_error"] = f"{type(err).__name__}: {err}"[:200]
            del fns[f"sharp_{tile}"]
    for key, fn in fns.items():
        try:
            ms = time_ms(fn)
            res[key + "_ms"] = ms
            res[key + "_tflops"] = flops / ms / 1e9
        except Exception as err:  # noqa: BLE001 - a missing baseline must not stop the run
            res[key + "_ms"] = None
            res[key + "_error"] = f"{type(err).__name__}: {err}"[:200]
    return res


def shapes(quick):
    out = []
    seqlens = [512, 2048, 8192] if quick else [512, 1024, 2048, 4096, 8192, 16384]
    for D in (64, 128):
        H = 2048 // D
        for causal in (False, True):
            for L in seqlens:
                out.append(("fa-conv", 16384 // L, H, L, L, D, causal))
    for D in (64, 128):
        H = 2048 // D
        for B in (1, 8):
            out.append(("decode", B, H, 1, 8192, D, False))
        for B in (1, 8):
            out.append(("dflash", B, H, 16, 8192, D, False))
    return out


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def write_markdown(results, path, device, elapsed, commit=None, command=None):
    have_fa2 = any(r.get("fa2_ms") is not None for r in results)
    tiles = [t for t in TILES if any(r.get(f"sharp_{t}_ms") is not None for r in results)]
    lines = [
        "# CUDA forward benchmark (sharp attention vs SDPA flash)",
        "",
        f"Device: {device}; torch {torch.__version__}; bfloat16; forward only; "
        f"benchmark wall time {elapsed:.0f} s. Written by benchmarks/bench_cuda.py "
        f"(scripts/gpu_check.sh).",
        "",
    ]
    if commit or command:
        lines += [f"Kernel commit: {commit or 'unknown'}. Command: `{command or 'n/a'}`.", ""]
    lines += [
        "TFLOP/s = 4 * D * (visible query-key pairs) / time. `vs sdpa` = sdpa time / sharp time "
        "(>= 1 is faster than SDPA flash). `scaling cost` = sharp (fixed_slope) time / "
        "sharp (mode none) time - 1. `sdpa_pre` = SDPA on q pre-multiplied by beta_i "
        "(multiply included).",
        "",
        "| shape | B | H | Lq | Lk | D | causal | sharp TF/s | none TF/s | sdpa TF/s | "
        "sdpa_pre TF/s |" + (" fa2 TF/s |" if have_fa2 else "") +
        " vs sdpa | vs sdpa_pre | scaling cost |" + "".join(f" {t} tile TF/s |" for t in tiles),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if have_fa2 else "") +
        "---|---|---|" + "---|" * len(tiles),
    ]
    for r in results:
        s, n, d, p = (r.get(k + "_ms") for k in ("sharp", "sharp_none", "sdpa", "sdpa_pre"))
        ratio = d / s if s and d else None
        ratio_pre = p / s if s and p else None
        cost = (s / n - 1.0) * 100 if s and n else None
        row = (f"| {r['name']} | {r['B']} | {r['H']} | {r['Lq']} | {r['Lk']} | {r['D']} | "
               f"{'yes' if r['causal'] else 'no'} | {fmt(r.get('sharp_tflops'), '.1f')} | "
               f"{fmt(r.get('sharp_none_tflops'), '.1f')} | {fmt(r.get('sdpa_tflops'), '.1f')} | "
               f"{fmt(r.get('sdpa_pre_tflops'), '.1f')} |")
        if have_fa2:
            row += f" {fmt(r.get('fa2_tflops'), '.1f')} |"
        row += (f" {fmt(ratio, '.2f')}{'x' if ratio else ''} |"
                f" {fmt(ratio_pre, '.2f')}{'x' if ratio_pre else ''} |"
                f" {fmt(cost, '+.1f')}{'%' if cost is not None else ''} |")
        for t in tiles:
            row += f" {fmt(r.get(f'sharp_{t}_tflops'), '.1f')} |"
        lines.append(row)
    errors = [(r["name"], k, v) for r in results for k, v in r.items() if k.endswith("_error")]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {n} {k}: {v}" for n, k, v in errors]
    ratios = [r["sdpa_ms"] / r["sharp_ms"] for r in results if r.get("sdpa_ms") and r.get("sharp_ms")]
    costs = [r["sharp_ms"] / r["sharp_none_ms"] - 1 for r in results
             if r.get("sharp_ms") and r.get("sharp_none_ms")]
    if ratios:
        lines += ["", f"Summary: sharp / SDPA-flash speed ratio min {min(ratios):.2f}x, "
                      f"geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}x, "
                      f"max {max(ratios):.2f}x over {len(ratios)} shapes; scaling cost "
                      f"median {sorted(costs)[len(costs) // 2] * 100:+.1f}%, "
                      f"max {max(costs) * 100:+.1f}%."]
    if tiles:
        best = [r["sdpa_ms"] / min([r["sharp_ms"]] + [r[f"sharp_{t}_ms"] for t in tiles
                                                      if r.get(f"sharp_{t}_ms")])
                for r in results if r.get("sdpa_ms") and r.get("sharp_ms")]
        if best:
            lines += ["", f"With the fastest of the default and the {', '.join(tiles)} tiles per "
                          f"shape: speed ratio min {min(best):.2f}x, geomean "
                          f"{math.exp(sum(map(math.log, best)) / len(best)):.2f}x."]
        for t in tiles:
            diffs = [r[f"{t}_maxdiff"] for r in results if f"{t}_maxdiff" in r]
            lines += ["", f"`{t} tile`: the same fixed_slope call with SHARPDRAFT_CUDA_TILE={t} "
                          f"({t.capitalize()}Traits in csrc/attention/cuda/sharp_fwd_traits.h); "
                          f"max |{t} - default| over the outputs: "
                          f"{max(diffs) if diffs else float('nan'):.3g}."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "kernel-gpu", "results_cuda.md"))
    ap.add_argument("--quick", action="store_true", help="fewer flash-attn-convention seqlens")
    ap.add_argument("--alt", action="store_true",
                    help="also time the alternative prefill tile (SHARPDRAFT_CUDA_TILE=alt)")
    ap.add_argument("--commit", default=os.environ.get("SHARPDRAFT_COMMIT"),
                    help="the kernel's git commit, written into the results")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "bench_cuda.py needs a CUDA device"
    device = torch.cuda.get_device_name()
    t0 = time.time()
    results = []
    for sh in shapes(args.quick):
        r = bench_shape(*sh, alt=args.alt)
        results.append(r)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}),
              flush=True)
    elapsed = time.time() - t0
    command = "python benchmarks/bench_cuda.py " + " ".join(sys.argv[1:])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_markdown(results, args.out, device, elapsed, args.commit, command)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "commit": args.commit,
                   "command": command, "results": results}, f, indent=1)
    print(open(args.out).read())


if __name__ == "__main__":
    main()
