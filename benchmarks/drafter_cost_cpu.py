"""Drafting cost against context length: drafter milliseconds per decoding step and drafter
state bytes, for the shipped drafters on the default target (CPU), frozen.

For each --contexts length, the first n tokens of Genesis (held out from training) followed by
the bench's summary task are decoded greedily for --new-tokens tokens with each drafter
(`speculative_generate`); the drafter time of a step (propose + commit, the target's
verification excluded) is the run's draft seconds over its verification forwards; runs are
interleaved across drafters, --repeats times, and the median is reported. The state bytes are
the session's own (`state_bytes()`: LongSpark's summaries and boundary state; DFlash's and
EAGLE-3's drafter KV caches) at the end of a run. LongSpark's window is read from the target's
KV cache, which every method has, so it is not drafter state.

Writes drafter_cost.json, drafter_cost.md and drafter_cost.png to --out.

    python benchmarks/drafter_cost_cpu.py --threads 2 --out benchmarks/results/drafter-cost-cpu
"""
import argparse
import statistics

import torch
from tqdm import tqdm

from sharpdraft.eval.bench import KJV_TASK, kjv_passage
from sharpdraft.eval.report import figure, write_report
from sharpdraft.drafters.loading import SHIPPED as CHECKPOINTS
from sharpdraft.drafters import registry
from sharpdraft.inference.engine import speculative_generate
from sharpdraft.target.loading import load_target


def recording(drafter, sessions: list):
    """Make `drafter.start` keep every session it returns in `sessions`."""
    start = type(drafter).start

    def wrapped(*args, **kwargs):
        sessions.append(start(drafter, *args, **kwargs))
        return sessions[-1]
    drafter.start = wrapped
    return drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafters", nargs="+", default=["longspark", "dflash", "eagle3"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 7168])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/drafter-cost-cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok, provenance = load_target(None, dtype=torch.float32)
    drafters = {}
    for name in args.drafters:
        d = registry.get(name).cls.load(CHECKPOINTS / registry.get(name).checkpoint,
                                        target=target).float()
        sessions = []
        drafters[name] = (recording(d, sessions), sessions)
    prompts = {n: torch.tensor([tok(kjv_passage(tok, n) + "\n\n" + KJV_TASK).input_ids])
               for n in args.contexts}
    warm = prompts[args.contexts[0]][:, :64]
    for d, _ in drafters.values():
        speculative_generate(target, d, warm, 4)
    runs = {(name, n): [] for name in drafters for n in args.contexts}
    jobs = [(n, name) for _ in range(args.repeats) for n in args.contexts for name in drafters]
    for n, name in tqdm(jobs, desc="drafter cost", unit="run"):
        d, sessions = drafters[name]
        res = speculative_generate(target, d, prompts[n], args.new_tokens)
        runs[(name, n)].append({"draft_ms_per_step": 1000 * res.draft_s / res.target_forwards,
                                "tau": res.tau, "state_bytes": sessions[-1].state_bytes(),
                                "context": prompts[n].shape[1]})
        sessions.clear()
    rows = []
    for (name, n), rs in runs.items():
        rows.append({"drafter": name, "context": rs[0]["context"],
                     "draft_ms_per_step": statistics.median(r["draft_ms_per_step"] for r in rs),
                     "all_ms": [round(r["draft_ms_per_step"], 2) for r in rs],
                     "state_bytes": rs[-1]["state_bytes"], "tau": rs[-1]["tau"]})
    meta = {"target": provenance, "threads": args.threads, "new_tokens": args.new_tokens,
            "repeats": args.repeats, "dtype": "float32", "mode": "frozen"}
    lines = [f"Drafter cost per decoding step (propose + commit, median of {args.repeats} "
             f"interleaved runs of {args.new_tokens} greedy tokens) and drafter state bytes at "
             f"the end of a run, Genesis prefix + summary task, {args.threads} CPU threads, "
             "float32.", "",
             "| drafter | context | draft ms / step | state | tau |", "|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["drafter"], r["context"])):
        lines.append(f"| {r['drafter']} | {r['context']} | {r['draft_ms_per_step']:.2f} | "
                     f"{r['state_bytes'] / 2**20:.2f} MiB | {r['tau']:.2f} |")
    lines.append("")
    for name in drafters:
        sel = sorted((r for r in rows if r["drafter"] == name), key=lambda r: r["context"])
        small = [r for r in sel if r["context"] >= 1000][:1] or sel[:1]
        grow = sel[-1]["draft_ms_per_step"] / small[0]["draft_ms_per_step"]
        lines.append(f"{name}: draft ms / step x{grow:.2f} and state x"
                     f"{sel[-1]['state_bytes'] / max(1, small[0]['state_bytes']):.2f} from "
                     f"{small[0]['context']} to {sel[-1]['context']} tokens.")
    fig, axes = figure(1, 2, figsize=(10, 4))
    for name in drafters:
        sel = sorted((r for r in rows if r["drafter"] == name), key=lambda r: r["context"])
        xs = [r["context"] for r in sel]
        axes[0].plot(xs, [r["draft_ms_per_step"] for r in sel], marker="o", label=name)
        axes[1].plot(xs, [r["state_bytes"] / 2**20 for r in sel], marker="o", label=name)
    axes[0].set_ylabel("drafter ms per step")
    axes[1].set_ylabel("drafter state (MiB)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("context (tokens)")
        ax.legend()
    fig.suptitle("drafting cost against context (CPU, frozen drafters)")
    write_report(args.out, "drafter_cost", {"settings": meta, "rows": rows}, lines, figure=fig)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
