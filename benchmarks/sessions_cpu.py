"""The sessions suite on the CPU (`sharpdraft.eval.sessions`, docs/premise.md): held-out
multi-turn sessions (documents, maths, reading) growing to the target's 8,192-token context, on
the default runtime, 2 threads, greedy, full drafts.

Variants: the shipped EAGLE-3 (trained on windows of up to 512 keys, n_ref 512): frozen, slopes
0.1-0.4 (and 0.2 at n_ref 256), its calibrated slope (--calibrated), a 512-key window with and
without 4 attention sinks, a 1,024-key window with sinks and slope 0.2; the same rows for an
EAGLE-3 continued on 256-key windows (--short-window, n_ref 256); the shipped DFlash (n_ref
1,024) frozen and at slope 0.2; EAGLE-3 frozen and in a 512-key window at its measured draft
threshold (what users decode with; real only). Real (timed) runs: target-only, each drafter's frozen variant and
the --real-extra labels; every other variant is replayed from a real run's recording (exact:
the suite checks it).

    python benchmarks/sessions_cpu.py --out benchmarks/results/sessions-cpu \
        [--calibrated runs/sessions/eagle3-calibrated] [--short-window PATH] \
        [--real-extra "eagle3 slope 0.2"] [--sessions documents maths reading]

A cut run resumes from the parts already written to --out/parts.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from sharpdraft.data.sessions import SESSIONS, sessions
from sharpdraft.drafters.loading import load_drafter
from sharpdraft.eval.sessions import Variant, run
from sharpdraft.target import load_target

SINKS = 4


def variants(model, calibrated, short_window, real_extra):
    out = []

    def add(label, source, family, real=False, draft_threshold=0.0, **kw):
        kw.setdefault("context_window", 0)      # every key, unless the row names a window
        d = load_drafter(source, model, **kw)
        out.append(Variant(label, d, family, real=real or label in real_extra,
                           n_ref=d.sharp.n_ref, draft_threshold=draft_threshold,
                           notes={"context_window": d.context_window,
                                  "attention_sinks": d.attention_sinks,
                                  "sharp": d.sharp.mode, "slope": d.sharp.slope,
                                  "layer_slopes": d.sharp.layer_slopes}))

    def eagle3_rows(source, f, n_ref):
        add(f"{f} frozen", source, f, real=True, sharp=False)
        for s in (0.1, 0.2, 0.3, 0.4):
            add(f"{f} slope {s:g}", source, f, slope=s)
        add(f"{f} slope 0.2 n_ref {n_ref // 2}", source, f, slope=0.2, n_ref=n_ref // 2)
        add(f"{f} window {n_ref}", source, f, sharp=False, context_window=n_ref)
        add(f"{f} window {n_ref}+{SINKS}", source, f, sharp=False, context_window=n_ref,
            attention_sinks=SINKS)
        add(f"{f} window {2 * n_ref}+{SINKS} slope 0.2", source, f, slope=0.2,
            context_window=2 * n_ref, attention_sinks=SINKS)

    eagle3_rows("eagle3", "eagle3", 512)
    if calibrated:
        add("eagle3 calibrated", Path(calibrated), "eagle3")
    if short_window:
        eagle3_rows(Path(short_window), "eagle3-w256", 256)
    # as users decode: at the checkpoint's measured draft threshold (timed, real runs only)
    th = out[0].drafter.default_draft_threshold           # the shipped EAGLE-3's measured one
    for label, kw in ((f"eagle3 frozen @{th:g}", {"sharp": False}),
                      (f"eagle3 window 512 @{th:g}", {"sharp": False, "context_window": 512})):
        add(label, "eagle3", f"eagle3 @{th:g}", real=True, draft_threshold=th, **kw)
    add("dflash frozen", "dflash", "dflash", real=True, sharp=False)
    add("dflash slope 0.2", "dflash", "dflash", slope=0.2)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calibrated", default=None, metavar="PATH",
                    help="a copy of the shipped EAGLE-3 with calibrated per-layer slopes in its "
                         "config (`sharpdraft analyze calibrate`)")
    ap.add_argument("--short-window", default=None, metavar="PATH",
                    help="an EAGLE-3 checkpoint continued on 256-key windows")
    ap.add_argument("--sessions", nargs="+", default=list(SESSIONS), choices=SESSIONS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--real-extra", nargs="*", default=[],
                    help="labels of further variants to run for real (timed)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for flag in ("calibrated", "short_window"):
        path = getattr(args, flag)
        if path and not (Path(path) / "config.json").is_file():
            ap.error(f"--{flag.replace('_', '-')} {path}: no config.json there")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_target(weights="auto", dtype="auto")[:2]
    vs = variants(model, args.calibrated, args.short_window, set(args.real_extra))
    unknown = set(args.real_extra) - {v.label for v in vs}
    if unknown:
        ap.error(f"--real-extra: unknown labels {sorted(unknown)}")
    data = run(model, tokenizer, sessions(tokenizer, args.sessions), vs, out=args.out,
               max_new_tokens=args.max_new_tokens, target_name="SmolLM2-135M-Instruct (Q4_1)")
    print((Path(args.out) / "sessions.md").read_text())
    return data


if __name__ == "__main__":
    main()
