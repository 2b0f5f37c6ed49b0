"""Model cards: the README.md of a trained drafter folder, written from its own records.

`render(folder)` reads the folder's config.json and training.json (what `sharpdraft train`
writes) and, optionally, a task-suite bench.json (`benchmarks/task_suite.py`), and returns a
card in the layout Hugging Face model cards use: what the drafter is, its target, how to use
it, how it was trained (wall time, steps, tokens, command), on what data, and its held-out
results. Every figure comes from those files, none is typed in; `write(folder)` stores it
(temporary name, then renamed). `sharpdraft train` writes one at the end of every run.

    python -m sharpdraft.training.card <folder> [--suite bench.json] [--note TEXT]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Optional

# config fields worth a line on the card, in this order (those a kind has)
CONFIG_FIELDS = ("num_layers", "num_hidden_layers", "hidden_size", "intermediate_size",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "target_layer_ids",
                 "block_size", "num_draft_tokens", "chain_length", "draft_threshold",
                 "context_window", "tree_topk", "tree_depth", "tree_tokens", "draft_vocab_size", "train_context")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing (a card needs the folder's config.json and "
                                f"training.json, as `sharpdraft train` writes them)") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def _minutes(seconds: Optional[float]) -> str:
    return "?" if seconds is None else f"{seconds / 60:.1f} min"


def _kind_title(name: Optional[str]) -> str:
    from ..drafters import registry

    try:
        return registry.get(name).title
    except (KeyError, ValueError, TypeError):
        return name or "drafter"


def _suite_rows(suite: dict, kind: str) -> list:
    """(variant, category, draft threshold, tau, decode speedup, identical runs, runs) of `kind`'s
    variants in a task-suite bench.json: tau and speedup from its `by_kind` summary (what
    `sharpdraft bench` wrote: mean tau, geometric-mean decode speedup), the identical count from
    its runs, the threshold from its settings' `draft_thresholds` (None where it has none)."""
    thresholds = suite.get("settings", {}).get("draft_thresholds") or {}
    out = []
    for name, per in suite.get("by_kind", {}).items():
        if not name.startswith(kind + "-"):
            continue
        for cat, v in per.items():
            if not isinstance(v, dict):      # the variant's overall geometric mean
                continue
            runs = [r[name] for r in suite.get("runs", []) if r.get("kind") == cat and name in r]
            variant = name.rsplit("-", 1)[0]          # "eagle3-chain" of "eagle3-chain-sharp"
            out.append((name, cat, thresholds.get(variant), v["tau"], v.get("decode_speedup"),
                        sum(bool(r.get("identical_to_ar")) for r in runs), len(runs)))
    return out


def render(folder, *, suite: Optional[str] = None, note: str = "") -> str:
    """The model card of drafter folder `folder` (config.json + training.json), with the
    task-suite results of bench.json `suite` when given and `note` (free text) under the title.

    Raises:
        FileNotFoundError / ValueError naming the file: a record is missing or not JSON.
    """
    folder = Path(folder)
    cfg = _read_json(folder / "config.json")
    tr = _read_json(folder / "training.json")
    args = tr.get("args", {})
    kind = tr.get("drafter") or args.get("drafter")
    target = tr.get("target", {})
    tname = Path(target.get("source") or "target").name
    data, held = tr.get("train_data", {}), tr.get("heldout_data", {})
    best = tr.get("best_eval") or {}
    lines = [f"# {folder.name}: {_kind_title(kind)} drafter for {tname}", ""]
    if note:
        lines += [note, ""]
    lines += ["## What", "",
              f"{_kind_title(kind)} drafter, {tr.get('drafter_params', 0):,} parameters (stored "
              f"as {args.get('save_dtype', 'float32')}).", "",
              "| config | value |", "|---|---|"]
    lines += [f"| {k} | {cfg[k]} |" for k in CONFIG_FIELDS if k in cfg]
    lines += ["", "## Target", "",
              f"`{tname}` from the `{target.get('package')}=={target.get('version')}` package "
              f"(sha256 `{target.get('sha256')}`); training read its {target.get('dtype')} "
              f"forward. The drafter checks the target's geometry when it is loaded.", "",
              "## Use", "",
              f"    sharpdraft generate --drafter {kind} --drafter-path {folder} "
              f"--prompt \"...\" --compare-ar", "",
              f"or `sharpdraft.load_drafter(\"{folder}\", target)` in Python.",
              "", "## Training", ""]
    wall = (tr.get("cache_seconds") or 0) + (tr.get("train_seconds") or 0)
    cached = (tr.get("cache_seconds") or 0) < 60          # the cache came from an earlier run
    features = ("target features read from the cache an earlier run built"
                if cached else f"{_minutes(tr.get('cache_seconds'))} of target features")
    if data.get("autocast"):
        features += f", computed under {data['autocast']} autocast"
    lines += [f"- Wall time: {_minutes(wall)} ({_minutes(tr.get('train_seconds'))} of training; "
              f"{features}) on {args.get('threads')} CPU threads ({args.get('device', 'cpu')}).",
              f"- Steps: {tr.get('steps_done', 0):,}; trained rows seen: "
              f"{tr.get('trained_rows_seen', 0):,}; peak learning rate {args.get('lr')}, "
              f"warm-up {args.get('warmup')} steps, seed {args.get('seed')}, autocast "
              f"{args.get('autocast')}.",
              f"- Kept checkpoint: step {best.get('step')} (best held-out acceptance proxy)."]
    init = tr.get("init_from")
    if init:
        lines.append(f"- Continued from `{init.get('folder')}`"
                     + (f" (made by `{init['made_by']}`)" if init.get("made_by") else "") + ".")
    if tr.get("stage"):
        lines.append(f"- Stage {tr['stage']} of this drafter (earlier stages: RECIPE.md).")
    lines += ["", "Command:", "", f"    {tr.get('command')}", "", "## Data", ""]
    lines += [f"- Train: `{data.get('corpus') or data.get('source')}`, split "
              f"`{data.get('split')}`: {data.get('response_tokens', 0):,} response tokens "
              f"(the training targets; prompts are context only), sequences cut to their last "
              f"{data.get('max_len')} tokens.",
              f"- Held out (never trained on): `{held.get('corpus') or held.get('source')}`, "
              f"split `{held.get('split')}`, {held.get('response_tokens', 0):,} response "
              f"tokens, for the training-time evaluation."]
    by_kind = data.get("response_tokens_per_kind") or {}
    if by_kind:
        by_source: dict = {}
        for k, n in by_kind.items():
            by_source[k.split("/")[0]] = by_source.get(k.split("/")[0], 0) + n
        lines += ["", "| source | response tokens |", "|---|---:|"]
        lines += [f"| {s} | {n:,} |" for s, n in sorted(by_source.items(), key=lambda x: -x[1])]
    lines += ["", "## Held-out results", "",
              "Training-time, teacher forced on the held-out split (the kept checkpoint):", "",
              f"- loss {best.get('loss', float('nan')):.3f}; top-1 agreement by draft position "
              f"{best.get('top1_per_position')}; acceptance proxy (tau) "
              f"{best.get('tau_proxy', float('nan')):.3f}"
              + (f"; tau_walk {best['tau_walk']:.3f}" if "tau_walk" in best else "") + "."]
    if suite:
        bench = _read_json(Path(suite))
        rows = _suite_rows(bench, kind)
        if rows:
            lines += ["", f"Decoding the held-out task suite (`{suite}`; greedy, "
                      f"{bench.get('settings', {}).get('max_new_tokens')} new tokens, "
                      "speedup against target-only decoding on the same runtime; identical: "
                      "runs whose output equals target-only output token for token):", "",
                      "| variant | category | draft threshold | tau | decode speedup | identical |",
                      "|---|---|---:|---:|---:|---:|"]
            lines += [f"| {v} | {c} | {'-' if p is None else f'{p:g}'} | {t:.2f} | "
                      f"{'-' if s is None else f'{s:.2f}x'} | {i}/{n} |"
                      for v, c, p, t, s, i, n in sorted(rows, key=lambda r: r[:2])]
    lines += ["", "## Files", "",
              "`config.json` (configuration), `model.safetensors` (weights), `training.json` "
              "(command, arguments, target provenance, data sizes, every held-out evaluation), "
              "this card" + (" and `RECIPE.md` (every stage's command and results)"
                             if (folder / "RECIPE.md").is_file() else "") + ".", ""]
    return "\n".join(lines)


def write(folder, **kw) -> Path:
    """`render(folder, **kw)` into folder/README.md (temporary name, then renamed)."""
    path = Path(folder) / "README.md"
    text = render(folder, **kw)
    tmp = path.with_suffix(".md.partial")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Write a drafter folder's model card (README.md).")
    p.add_argument("folder")
    p.add_argument("--suite", help="a task-suite bench.json whose results go on the card")
    p.add_argument("--note", default="", help="text under the title")
    a = p.parse_args(argv)
    try:
        print(write(a.folder, suite=a.suite, note=a.note))
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"sharpdraft card: error: {err}")


if __name__ == "__main__":
    main()
