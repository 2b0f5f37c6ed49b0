"""Peak memory (RSS) of a long-prompt prefill on the default target: Hugging Face's forward with
every position's logits and all hidden states (what the engine did before the target runtime),
`logits_to_keep=1`, and `sharpdraft.target.TargetRuntime` (last-row logits, the shipped DFlash
drafter's hidden layers only, preallocated cache). Each mode runs in a fresh process, so its
peak RSS (ru_maxrss) is its own.

    python benchmarks/prefill_memory_cpu.py --context 7000 --out benchmarks/results/prefill-memory-cpu
"""
import argparse
import json
import resource
import subprocess
import sys

MODES = {
    "hf_all_logits_all_hidden": "HF forward, logits of every position, all hidden states",
    "hf_last_logits_all_hidden": "HF forward, logits_to_keep=1, all hidden states",
    "runtime": "TargetRuntime: last-row logits, the drafter's hidden layers, preallocated cache",
}


def run_mode(mode: str, context: int, new_tokens: int) -> dict:
    import torch
    from transformers import DynamicCache

    from sharpdraft.eval.bench import kjv_passage
    from sharpdraft.drafters.loading import SHIPPED as CHECKPOINTS
    from sharpdraft.drafters.dflash import DFlashDrafter
    from sharpdraft.target.loading import load_target
    from sharpdraft.target.runtime import TargetRuntime

    target, tokenizer, _ = load_target()
    ids = tokenizer(kjv_passage(tokenizer, context), return_tensors="pt").input_ids[:, :context]
    drafter = DFlashDrafter.load(CHECKPOINTS / "dflash-smollm2")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        if mode == "runtime":
            runtime = TargetRuntime.prepare(target, hidden_layers=drafter.hidden_layers)
            runtime.start(ids.shape[1] + new_tokens)
            out = runtime.forward(ids, last_only=True)
            kept = sum(h.numel() * h.element_size() for h in out.hidden.values())
        else:
            out = target(ids, cache=DynamicCache(), use_cache=True, output_hidden_states=True,
                         logits_to_keep=0 if mode == "hf_all_logits_all_hidden" else 1)
            kept = sum(h.numel() * h.element_size() for h in out.hidden_states)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "prompt_tokens": ids.shape[1], "peak_rss_gib": peak / 2 ** 20,
            "rss_before_prefill_gib": base / 2 ** 20, "hidden_states_mib": kept / 2 ** 20}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=7000)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--out", default="benchmarks/results/prefill-memory-cpu")
    p.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:                      # the child process
        print(json.dumps(run_mode(args.mode, args.context, args.new_tokens)))
        return
    rows = []
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--context",
                              str(args.context), "--new-tokens", str(args.new_tokens)],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], file=sys.stderr)
    lines = [f"Peak RSS of one prefill over {rows[0]['prompt_tokens']} Genesis tokens, float32 "
             f"SmolLM2-135M (fresh process per mode).", "",
             "| mode | peak RSS GiB | RSS before prefill GiB | hidden states kept MiB |",
             "|---|---:|---:|---:|"]
    lines += [f"| {MODES[r['mode']]} | {r['peak_rss_gib']:.2f} | "
              f"{r['rss_before_prefill_gib']:.2f} | {r['hidden_states_mib']:.0f} |" for r in rows]
    from sharpdraft.eval.report import write_report
    write_report(args.out, "prefill_memory", rows, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
