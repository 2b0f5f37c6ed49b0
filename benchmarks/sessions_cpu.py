"""The sessions suite on the CPU (`sharpdraft.eval.sessions`, docs/premise.md): held-out
multi-turn sessions (documents, maths, reading) growing to the target's 8,192-token context, on
the default runtime, 2 threads, greedy, full drafts.

Variants: the shipped EAGLE-3 (n_ref 512) and DFlash (n_ref 1,024), frozen and at slope 0.2,
EAGLE-3 with a 512-key window and 4 attention sinks; with --short-window PATH, an EAGLE-3
continued on 256-key windows (n_ref 256; `scripts/sessions_cpu.sh` trains it): frozen, slopes
0.1-0.4, calibrated (when its config has per-layer slopes), a 256-key window with and without
4 sinks, and a 1,024-key window with sinks and slope 0.2. Real (timed) runs: target-only, each
drafter's frozen variant and --real-extra labels; every other variant is replayed from a real
run's recording (exact: the suite checks it).

    python benchmarks/sessions_cpu.py --out benchmarks/results/sessions-cpu \
        [--short-window runs/sessions/eagle3-w256] [--sessions documents maths reading]

A cut run resumes from the parts already written to --out/parts.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sharpdraft.data.sessions import SESSIONS, sessions
from sharpdraft.drafters.loading import load_drafter
from sharpdraft.eval.sessions import Variant, run
from sharpdraft.target import load_target

SINKS = 4


def variants(model, short_window, real_extra):
    out = []

    def add(label, source, family, real=False, **kw):
        d = load_drafter(source, model, **kw)
        out.append(Variant(label, d, family, real=real or label in real_extra,
                           n_ref=d.sharp.n_ref,
                           notes={"context_window": d.context_window,
                                  "attention_sinks": d.attention_sinks,
                                  "sharp": d.sharp.mode, "slope": d.sharp.slope}))

    add("eagle3 frozen", "eagle3", "eagle3", real=True, sharp=False)
    add("eagle3 slope 0.2", "eagle3", "eagle3", slope=0.2)
    add(f"eagle3 window 512+{SINKS}", "eagle3", "eagle3", sharp=False, context_window=512,
        attention_sinks=SINKS)
    if short_window:
        p = Path(short_window)
        f = "eagle3-w256"
        add(f"{f} frozen", p, f, real=True, sharp=False)
        for s in (0.1, 0.2, 0.3, 0.4):
            add(f"{f} slope {s:g}", p, f, slope=s)
        if json.loads((p / "config.json").read_text()).get("sharp_slopes"):
            add(f"{f} calibrated", p, f)
        add(f"{f} window 256", p, f, sharp=False, context_window=256)
        add(f"{f} window 256+{SINKS}", p, f, sharp=False, context_window=256,
            attention_sinks=SINKS)
        add(f"{f} window 1024+{SINKS} slope 0.2", p, f, slope=0.2, context_window=1024,
            attention_sinks=SINKS)
    add("dflash frozen", "dflash", "dflash", real=True, sharp=False)
    add("dflash slope 0.2", "dflash", "dflash", slope=0.2)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--short-window", default=None, metavar="PATH",
                    help="an EAGLE-3 checkpoint continued on 256-key windows")
    ap.add_argument("--sessions", nargs="+", default=list(SESSIONS), choices=SESSIONS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--real-extra", nargs="*", default=[],
                    help="labels of further variants to run for real (timed)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.short_window and not (Path(args.short_window) / "config.json").is_file():
        ap.error(f"--short-window {args.short_window}: no config.json there")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_target(weights="auto", dtype="auto")[:2]
    vs = variants(model, args.short_window, set(args.real_extra))
    unknown = set(args.real_extra) - {v.label for v in vs}
    if unknown:
        ap.error(f"--real-extra: unknown labels {sorted(unknown)}")
    data = run(model, tokenizer, sessions(tokenizer, args.sessions), vs, out=args.out,
               max_new_tokens=args.max_new_tokens, target_name="SmolLM2-135M-Instruct (Q4_1)")
    print((Path(args.out) / "sessions.md").read_text())
    return data


if __name__ == "__main__":
    main()
