"""`sharpdraft bench`: target-only AR vs frozen drafters vs the drafters + SharpDraft.

Prompts: KJV passages (Genesis, public domain; the copy shipped in sharpdraft/data/assets, from Debian's
`bible-kjv-text`, read through `sharpdraft.data`, so no root or `bible` tool is needed) cut to a
given number of tokens and followed by a task, and competition maths problems from the PyPI
package `champ-dataset`. Each prompt runs AR and every drafter variant, frozen and with
SharpDraft, in the same process; the results go to bench.json, bench.md (a Markdown table) and
tau_vs_context.png.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from tqdm import tqdm

from .._hashing import sha256_chunks
from ..data import sources as data
from ..data.sources import KJV_BOOK, KJV_TASK, kjv_passage  # noqa: F401 (the bench's task)
from ..inference.engine import (GenerationResult, autoregressive_generate, seq_rep,
                                speculative_generate, tree_speculative_generate)
from ..inference.policy import POLICIES
from .report import figure, save_figure, write_report



def maths_problems(n: int) -> List[str]:
    """The first n problems of champ-dataset (PyPI `champ-dataset`), via `data.champ_problems`.

    Raises:
        ModuleNotFoundError: n > 0 and champ-dataset is not installed (the message says how).
    """
    if n == 0:
        return []
    try:
        return [p["problem"] for p in data.champ_problems()[:n]]
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError("--maths needs the champ-dataset package: pip install "
                                  "champ-dataset==1.0.0 (or the [bench] extra), or pass --maths 0"
                                  ) from None


def corpus_prompts(folder, n: int) -> List[dict]:
    """n first-turn prompts of a corpus's held-out split (`sharpdraft data generate`; its
    documents are never trained on), taken in turn from each prompt source/kind, as
    [{name, kind, ids}] with kind "corpus".

    Raises:
        FileNotFoundError: no corpus in `folder`. ValueError: its held-out split is empty.
    """
    from ..data import shards

    held = shards.load(folder, "heldout")
    groups: Dict[str, List[int]] = {}
    for i, rec in enumerate(held.records):
        if rec["turns"] == 1:
            groups.setdefault(f"{rec['source']}/{rec['kind']}", []).append(i)
    if n > 0 and not groups:
        raise ValueError(f"--corpus {folder}: the held-out split holds no first-turn prompts")
    picked, k = [], 0
    while len(picked) < n and k < max(map(len, groups.values()), default=0):
        for g in sorted(groups):
            if k < len(groups[g]) and len(picked) < n:
                picked.append((g, groups[g][k]))
        k += 1
    prompts = []
    for g, i in picked:
        first = int(held.masks[i].argmax())            # the response starts here
        prompts.append({"name": f"{g}-{held.records[i]['prompt']}", "kind": "corpus",
                        "ids": torch.tensor([held.sequences[i][:first].tolist()])})
    return prompts


def build_prompts(tokenizer, lengths: List[int], n_maths: int) -> List[dict]:
    """[{name, kind, ids}], KJV passages of `lengths` tokens + task, then maths problems."""
    prompts = []
    for n in lengths:
        passage = kjv_passage(tokenizer, n)
        prompts.append({"name": f"kjv-{n}", "kind": "kjv", "text": f"{passage}\n\n{KJV_TASK}"})
    for i, problem in enumerate(maths_problems(n_maths)):
        prompts.append({"name": f"maths-{i}", "kind": "maths",
                        "text": f"{problem}\nSolve it step by step."})
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p.pop("text")}],
                                            add_generation_prompt=True, return_dict=False)
        p["ids"] = torch.tensor([list(ids)])
    return prompts


def suite_prompts(tokenizer, categories) -> List[dict]:
    """[{name, kind (the category), ids}]: the held-out task suite (`data.tasks.suite`) in the
    target's chat template."""
    from ..data.prompts import render
    from ..data.tasks import suite

    return [{"name": p["name"], "kind": p["kind"],
             "ids": torch.tensor([render(tokenizer, [{"role": "user", "content": p["text"]}])])}
            for p in suite(tokenizer, categories)]


def bench_variants(kind: str, drafter, trees: bool) -> Dict[str, tuple]:
    """{label: (drafter, tree)} for `run_bench`: every place SharpDraft may act on the drafter
    (`drafter.sharp_variants()`, labelled "<kind>-<suffix>"), each with chain drafting and, for
    a kind that drafts trees (`trees`), tree drafting ("-chain" / "-tree")."""
    variants = {}
    for suffix, d in drafter.sharp_variants().items():
        label = kind + (f"-{suffix}" if suffix else "")
        if trees:
            variants.update({f"{label}-chain": (d, False), f"{label}-tree": (d, True)})
        else:
            variants[label] = (d, False)
    return variants


def weights_sha256(module: torch.nn.Module) -> str:
    """Hex sha256 of a module's state (each entry's name, dtype, shape and bytes, in order): which
    weights a benchmark ran, whatever folder they were loaded from."""
    def chunks():
        for name, t in module.state_dict().items():
            t = t.detach().cpu().contiguous()
            yield f"{name}:{t.dtype}:{tuple(t.shape)}".encode()
            yield t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return sha256_chunks(chunks())


def decode(target, drafter, ids: torch.Tensor, max_new_tokens: int, *, tree: bool = False,
           draft_threshold: float = 0.0, policy: str = "fixed", **kwargs) -> GenerationResult:
    """Speculative decoding with `drafter`: tree drafting (EAGLE-3) or chain drafting, under
    the draft policy `policy` (`inference.policy`; auto ignores draft_threshold)."""
    if tree:
        return tree_speculative_generate(target, drafter, ids, max_new_tokens, policy=policy,
                                         **kwargs)
    return speculative_generate(target, drafter, ids, max_new_tokens, policy=policy,
                                draft_threshold=0.0 if policy == "auto" else draft_threshold,
                                **kwargs)


def warm_up(target, drafter, ids: torch.Tensor, draft_threshold: float = 0.0,
            tree: bool = False) -> None:
    """A few tokens of target-only and speculative decoding on a short prefix of `ids`, so that
    one-time costs (allocator, op dispatch) stay out of the timed runs."""
    autoregressive_generate(target, ids[:, :64], 2)
    decode(target, drafter, ids[:, :64], 2, tree=tree, draft_threshold=draft_threshold)


def run_bench(target, tokenizer, variants: Dict[str, tuple], prompts, max_new_tokens: int,
              slope: Optional[float], out_dir: Path, draft_threshold: Optional[float] = None,
              target_info: Optional[dict] = None,
              policies: Sequence[str] = ("fixed",)) -> List[dict]:
    """Run AR, then every variant frozen and with SharpDraft (greedy), on every prompt; write
    bench.json, bench.md and tau_vs_context.png to `out_dir`.

    variants: {label: (drafter, tree)}, e.g. {"eagle3-chain": (d, False), "eagle3-tree": (d,
    True)}; each drafter runs with its current `sharp` config in mode "none" and in mode
    "fixed_slope" (its n_ref and calibrated layer slopes kept; `slope`, when given, replaces
    its slope), keys "<label>-frozen" and "<label>-sharp" of each row.
    draft_threshold: passed to chain decoding (0: whole blocks are verified); None: each
        drafter's measured default (`Drafter.default_draft_threshold`). Tree drafting has none.
        bench.json's settings record the argument ("draft_threshold") and what each variant
        ran ("draft_thresholds").
    target_info: the target's provenance (package, sha256, dtype: bfloat16 rounding makes
        speculative output leave target-only output at near-ties), recorded in bench.json.
    policies: the draft policies each variant runs under ("fixed", "auto": `inference.policy`);
        a variant under "auto" is labelled "<label>-auto" (its draft threshold 0), under
        "fixed" "<label>"; bench.json's settings record each label's ("policies").

    Raises:
        ValueError naming `policies`: empty or an unknown policy.
    """
    if not policies or any(p not in POLICIES for p in policies):
        raise ValueError(f"policies: a non-empty list of {', '.join(POLICIES)}, got "
                         f"{list(policies)}")
    variants = {(label if policy == "fixed" else f"{label}-auto"): (drafter, tree, policy)
                for policy in dict.fromkeys(policies)
                for label, (drafter, tree) in variants.items()}
    methods, thresholds = {}, {}
    for label, (drafter, tree, policy) in variants.items():
        thresholds[label] = 0.0 if tree or policy == "auto" else (
            drafter.default_draft_threshold if draft_threshold is None else draft_threshold)
        base = drafter.sharp if slope is None else dataclasses.replace(drafter.sharp, slope=slope)
        for suffix, mode in (("frozen", "none"), ("sharp", "fixed_slope")):
            methods[f"{label}-{suffix}"] = (drafter, tree, dataclasses.replace(base, mode=mode),
                                            thresholds[label], policy)
    rows = []
    eos = tokenizer.eos_token_id
    for drafter, tree, sharp, threshold, _ in methods.values():
        drafter.sharp = sharp
        warm_up(target, drafter, prompts[0]["ids"], threshold, tree)
    for p in tqdm(prompts, desc="bench prompts", unit="prompt"):
        ar = autoregressive_generate(target, p["ids"], max_new_tokens, eos_token_id=eos)
        row = {"name": p["name"], "kind": p["kind"], "prompt_tokens": p["ids"].shape[1],
               "ar": {**ar.summary(), "seq_rep_4": seq_rep(ar.tokens)}}
        for name, (drafter, tree, sharp, threshold, policy) in methods.items():
            drafter.sharp = sharp
            res = decode(target, drafter, p["ids"], max_new_tokens, tree=tree,
                         eos_token_id=eos, draft_threshold=threshold, policy=policy)
            row[name] = {**res.summary(), "speedup": res.tokens_per_s / ar.tokens_per_s,
                         "decode_speedup": _ratio(res.decode_tokens_per_s,
                                                  ar.decode_tokens_per_s),
                         "identical_to_ar": res.tokens == ar.tokens}
        rows.append(row)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"max_new_tokens": max_new_tokens, "target": target_info,
            "target_dtype": str(next(target.parameters()).dtype)[6:],
            "slope": {label: methods[f"{label}-sharp"][2].slope for label in variants},
            "layer_slopes": {label: methods[f"{label}-sharp"][2].layer_slopes
                             for label in variants},
            "n_ref": {label: methods[f"{label}-sharp"][2].n_ref for label in variants},
            "variants": list(variants), "draft_threshold": draft_threshold,
            "draft_thresholds": thresholds,
            "policies": {label: policy for label, (_, _, policy) in variants.items()},
            "context_window": {label: d.context_window for label, (d, _, _) in variants.items()},
            "max_drafts": {label: (d.max_tree_nodes if tree else d.max_drafts)
                           for label, (d, tree, _) in variants.items()},
            "drafter_sha256": {label: weights_sha256(d) for label, (d, _, _) in variants.items()}}
    write_report(out_dir, "bench", {"settings": meta, "runs": rows,
                                    "by_kind": by_kind(rows, meta["variants"])},
                 markdown_table(rows, meta))
    plot_tau(rows, meta["variants"], out_dir / "tau_vs_context.png")
    plot_kinds(rows, meta["variants"], out_dir / "speedup_by_kind.png")
    return rows


def _ratio(a: float, b: float):
    """a / b, None when either is undefined (one-token runs have no decode phase)."""
    return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else None


def _geomean(values) -> float:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.3f}x"


def markdown_table(rows: List[dict], meta: dict) -> str:
    """Per-prompt rows (one per variant) and per-kind means (tau, the target output's
    seq-rep-4) and geometric means (speedup)."""

    def rep(r):
        return f"{r['ar']['seq_rep_4']:.2f}" if "seq_rep_4" in r["ar"] else "n/a"

    variants = meta.get("variants", ["dflash"])
    windows = {k: v for k, v in meta.get("context_window", {}).items() if v is not None}
    calibrated = {k: v for k, v in meta.get("layer_slopes", {}).items() if v}
    cut = {k: v for k, v in meta.get("draft_thresholds", {}).items() if v}
    lines = [f"Greedy decoding, {meta['max_new_tokens']} new tokens at most, SharpDraft slope "
             f"{meta['slope']}, n_ref {meta['n_ref']}"
             + (f", calibrated layer slopes {calibrated}" if calibrated else "")
             + (f", drafter context window {windows}" if windows else "")
             + (f", draft thresholds {cut}" if cut else "") + "."
             + (" Labels ending -auto ran the auto draft policy, the others the fixed one."
                if "auto" in meta.get("policies", {}).values() else ""), "",
             "Speedup: end to end (prefill included); decode: tokens/s after the first token "
             "(prefill excluded), both against target-only decoding in the same run. seq-rep-4: "
             "the share of the target's output 4-grams that repeat an earlier one (towards 1 "
             "in a loop, the easiest text to draft).", "",
             "| prompt | prompt tokens | AR decode tok/s | drafter | frozen tau | frozen speedup "
             "| frozen decode speedup | sharp tau | sharp speedup | sharp decode speedup "
             "| lossless | seq-rep-4 |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        for v in variants:
            f, s = r[f"{v}-frozen"], r[f"{v}-sharp"]
            ar_decode = r["ar"].get("decode_tokens_per_s")
            lines.append(f"| {r['name']} | {r['prompt_tokens']} | "
                         f"{'n/a' if ar_decode is None else f'{ar_decode:.1f}'} "
                         f"| {v} | {f['tau']:.3f} | {_x(f['speedup'])} | "
                         f"{_x(f.get('decode_speedup'))} | {s['tau']:.3f} | {_x(s['speedup'])} | "
                         f"{_x(s.get('decode_speedup'))} | "
                         f"{f['identical_to_ar'] and s['identical_to_ar']} | {rep(r)} |")
    summary = by_kind(rows, variants)
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    reps = {k: [r["ar"]["seq_rep_4"] for r in rows if r["kind"] == k and "seq_rep_4" in r["ar"]]
            for k in kinds}
    lines += ["", "By category: mean tau and geometric-mean decode speedup over its prompts; the "
              "last column is the geometric mean of the category speedups.", "",
              "| drafter | " + " | ".join(kinds) + " | geomean |",
              "|---|" + "---:|" * (len(kinds) + 1)]
    for name in summary:
        cells = [f"{summary[name][k]['decode_speedup']:.2f}x ({summary[name][k]['tau']:.2f})"
                 for k in kinds]
        lines.append(f"| {name} | " + " | ".join(cells)
                     + f" | {summary[name]['geomean_decode_speedup']:.2f}x |")
    if any(reps.values()):
        lines.append("| target output seq-rep-4 (mean) | "
                     + " | ".join(f"{sum(v) / len(v):.2f}" if v else "n/a" for v in reps.values())
                     + " | |")
    return "\n".join(lines) + "\n"


def by_kind(rows: List[dict], variants: List[str]) -> Dict[str, dict]:
    """{"<variant>-frozen|sharp": {kind: {"prompts", "tau" (mean), "speedup",
    "decode_speedup" (geometric means)}, "geomean_decode_speedup": over the kinds}}, kinds in
    the order the rows first show them."""
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    out = {}
    for name in (f"{v}-{m}" for v in variants for m in ("frozen", "sharp")):
        per = {}
        for kind in kinds:
            sel = [r for r in rows if r["kind"] == kind]
            per[kind] = {"prompts": len(sel),
                         "tau": sum(r[name]["tau"] for r in sel) / len(sel),
                         "speedup": _geomean(r[name]["speedup"] for r in sel),
                         "decode_speedup": _geomean(r[name].get("decode_speedup")
                                                    for r in sel)}
        per["geomean_decode_speedup"] = _geomean(per[k]["decode_speedup"] for k in kinds)
        out[name] = per
    return out


def plot_kinds(rows: List[dict], variants: List[str], path: Path) -> None:
    """Grouped bars: geometric-mean decode speedup per prompt kind (category), one bar per
    drafter variant and mode, a line at 1x (target-only decoding)."""
    summary = by_kind(rows, variants)
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, ax = figure(figsize=(max(6, 1.3 * len(kinds) * max(1, len(summary)) / 3), 4))
    width = 0.8 / len(summary)
    for j, (name, per) in enumerate(summary.items()):
        ax.bar([i + j * width for i in range(len(kinds))],
               [per[k]["decode_speedup"] for k in kinds], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(kinds))], kinds)
    ax.set_ylabel("decode speedup over target-only")
    ax.set_title("speedup by category")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_tau(rows: List[dict], variants: List[str], path: Path) -> None:
    fig, ax = figure(figsize=(6, 4))
    xs = [r["prompt_tokens"] for r in rows]
    for name in (f"{v}-{m}" for v in variants for m in ("frozen", "sharp")):
        marker = "o" if name.endswith("frozen") else "s"
        ax.scatter(xs, [r[name]["tau"] for r in rows], marker=marker, label=name)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("acceptance length tau")
    ax.set_title("tau against context length")
    ax.legend()
    save_figure(fig, path)
