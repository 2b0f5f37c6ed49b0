"""Top-k attention mass and locality of drafter (and target) layers (spec §1, §7).

`AttentionProbe` is an `attention.observe` callback: on every attention call of the modules it
is told about, it samples up to `rows` query rows, rebuilds their visible keys (spec §2, the
reference's `visible_mask_ref`) and float32 logits from the q / k the kernel received, and for
each scaling in `scalings` computes, per row and head:

- top-k mass: the sum of the k largest softmax weights (k = 32);
- recent share: the weight on the 32 keys nearest the row (distance < 32);
- far share: the weight on keys farther back than n_ref (distance >= n_ref);
- argmax distance: how far back the most-weighted key sits.

Distance is counted from the row's newest visible key (0 = the newest). The scalings are
applied to the same q / k (beta(n_i) multiplies the row's logits, as in the kernel), so a layer's
numbers under each scaling share its inputs: the frozen drafter's. That isolates what each
scaling does to a layer's own softmax; it does not rerun later layers on changed inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

import sharpdraft_ext as ext
from sharpdraft_ext.reference import visible_mask_ref

from ..attention import SharpConfig, observe
from .bench import build_prompts
from ..inference.engine import speculative_generate
from ..target.runtime import TargetRuntime
from .report import figure, save_figure, write_report

RECENT = 32


def scaling_suite(n_ref: int, topk: int = 32, slopes=(0.1, 0.2, 0.3, 0.4),
                  constants=(0.1, 0.2, 0.3, 0.4),
                  calibrated: Optional[list] = None) -> Dict[str, SharpConfig]:
    """The scalings the analyses compare: frozen, constant beta = e^c, fixed_slope at each slope,
    exact_topk (Delta 5, this k; needs k < n_ref) and, when given, the calibrated per-layer
    slopes."""
    suite = {"frozen": SharpConfig(mode="none", n_ref=n_ref)}
    for c in constants:
        b = math.exp(c)
        suite[f"const e^{c:g}"] = SharpConfig(mode="fixed_slope", slope=0.0, n_ref=n_ref,
                                              beta_min=b, beta_max=b)
    for s in slopes:
        suite[f"slope {s:g}"] = SharpConfig(mode="fixed_slope", slope=s, n_ref=n_ref)
    if topk < n_ref:
        suite["exact_topk"] = SharpConfig(mode="exact_topk", n_ref=n_ref, topk=topk)
    if calibrated:
        suite["calibrated"] = SharpConfig(mode="fixed_slope", n_ref=n_ref,
                                          layer_slopes=list(calibrated))
    return suite


def row_statistics(logits: torch.Tensor, visible: torch.Tensor, beta: torch.Tensor, *,
                   topk: int = 32, n_ref: int = 2048) -> Dict[str, torch.Tensor]:
    """Statistics of softmax(beta * logits) over the visible keys, per row.

    Args:
        logits: (..., Lk) float32 (softmax scale applied). visible: (..., Lk) bool (every row
            sees at least one key). beta: (...) per-row query scale.

    Returns:
        {"topk_mass", "recent_share", "far_share", "argmax_distance"}, each (...) float32.
    """
    z = (logits * beta[..., None]).masked_fill(~visible, float("-inf"))
    p = torch.softmax(z, dim=-1)
    k = min(topk, p.shape[-1])
    Lk = p.shape[-1]
    j = torch.arange(Lk, device=p.device)
    newest = torch.where(visible, j, -1).amax(-1, keepdim=True)           # (..., 1)
    dist = (newest - j).clamp_min(0)
    return {"topk_mass": p.topk(k, dim=-1).values.sum(-1),
            "recent_share": (p * (visible & (dist < RECENT))).sum(-1),
            "far_share": (p * (visible & (dist >= n_ref))).sum(-1),
            "argmax_distance": torch.gather(dist, -1, p.argmax(-1, keepdim=True))[..., 0]
            .float()}


def row_logits(q: torch.Tensor, k: torch.Tensor, kwargs: dict, rows: torch.Tensor):
    """(rows, logits (B, Hq, R, Lk) float32 with the softmax scale, visible (B, Hq, R, Lk)) of
    query rows `rows` of one attention call as the kernel computes it (`kwargs`: the call's
    causal / window / attn_mask / kv_lens / scale; GQA keys repeated per query head); rows that
    see no key are dropped."""
    B, Hq, Lq, D = q.shape
    vis = visible_mask_ref(q, k, causal=bool(kwargs.get("causal", False)),
                           window=kwargs.get("window"), attn_mask=kwargs.get("attn_mask"),
                           kv_lens=kwargs.get("kv_lens"))[:, :, rows]
    keep = vis.any(-1).all(1).all(0)
    rows, vis = rows[keep], vis[:, :, keep]
    scale = kwargs.get("scale") or 1.0 / math.sqrt(D)
    kk = k.float().repeat_interleave(Hq // k.shape[1], dim=1)
    return rows, (q[:, :, rows].float() @ kk.transpose(-1, -2)) * scale, vis


@dataclass
class LayerRecord:
    """What a probe kept of one (model, layer): per sampled row, its cardinality n (head-mean)
    and context label, and per scaling the per-head statistics (rows, Hq)."""

    n: List[torch.Tensor] = field(default_factory=list)
    context: List[int] = field(default_factory=list)
    stats: Dict[str, Dict[str, List[torch.Tensor]]] = field(default_factory=dict)


class AttentionProbe:
    """An `attention.observe` callback recording row statistics (see the module docstring).

    Args:
        modules: {attention module: (model name, layer index)}: the calls to record; others
            are ignored.
        scalings: {name: SharpConfig} applied to every recorded drafter call; calls of models in
            `reference_models` (the target) are recorded under "frozen" only.
        rows: query rows sampled per call. max_query_rows: calls with more query rows (a
            prefill) are skipped.
    """

    def __init__(self, modules: Dict, scalings: Dict[str, SharpConfig], *, topk: int = 32,
                 rows: int = 16, max_query_rows: int = 64, seed: int = 0,
                 reference_models: Tuple[str, ...] = ("target",)):
        self.modules = {id(m): v for m, v in modules.items()}
        self.scalings = scalings
        self.topk, self.rows, self.max_query_rows = topk, rows, max_query_rows
        self.reference_models = reference_models
        self.gen = torch.Generator().manual_seed(seed)
        self.context = 0                       # label of the current prompt (its length)
        self.records: Dict[Tuple[str, int], LayerRecord] = {}

    @torch.no_grad()
    def __call__(self, module, layer, q, k, kwargs, sharp_kwargs) -> None:
        key = self.modules.get(id(module))
        if key is None or q.shape[2] > self.max_query_rows:
            return
        B, Hq, Lq, D = q.shape
        rows = torch.randperm(Lq, generator=self.gen)[:self.rows].sort().values
        rows, logits, vis = row_logits(q, k, kwargs, rows)
        if rows.numel() == 0:
            return
        n = vis.sum(-1)
        if kwargs.get("n_visible") is not None:
            n = torch.broadcast_to(torch.as_tensor(kwargs["n_visible"]), (B, Hq, Lq))[:, :, rows]
        rec = self.records.setdefault(key, LayerRecord())
        rec.n.append(n.float().mean(1).reshape(-1))                               # (B*R,)
        rec.context += [self.context] * (B * rows.numel())
        model, idx = key
        frozen = self.scalings.get("frozen", SharpConfig(mode="none"))   # the same n_ref
        suite = {"frozen": frozen} if model in self.reference_models else self.scalings
        for name, sc in suite.items():
            kw = sc.kernel_kwargs(idx)
            beta = ext.query_scale(n, **kw) if sc.mode != "none" else torch.ones(n.shape)
            st = row_statistics(logits, vis, beta.float(), topk=self.topk, n_ref=sc.n_ref)
            out = rec.stats.setdefault(name, {s: [] for s in st})
            for s, v in st.items():                                               # (B*R, Hq)
                out[s].append(v.permute(0, 2, 1).reshape(-1, Hq))


def attention_modules(drafter, target) -> Dict:
    """{attention module: (model, layer)} of a drafter and its target: every module whose calls
    reach `attention.attend` with `module=` (the drafters' attention modules in order, and the
    target's HF attention modules by their layer_idx).

    target: the `TargetRuntime` the decoding runs (its prepared copy's modules are the ones
    called), or a model that is called itself (a bare model given to the decoding loops runs
    through a runtime's copy: its own modules are never called)."""
    found = {}
    if isinstance(target, TargetRuntime):
        target = target.model
    for name, model in (("drafter", drafter), ("target", target)):
        mods = [m for m in model.modules() if _is_attention(m)]
        for i, m in enumerate(mods):
            found[m] = (name, int(getattr(m, "layer_idx", i) if name == "target" else i))
    return found


def _is_attention(m) -> bool:
    cls = type(m).__name__
    return cls.endswith("Attention") and hasattr(m, "q_proj")


# ----- summaries --------------------------------------------------------------------------------
def summarise(probe: AttentionProbe) -> List[dict]:
    """One row per (model, layer, scaling, context): rows sampled, mean n, top-k mass (mean over
    heads and rows, and per head), recent / far shares, median argmax distance."""
    out = []
    for (model, layer), rec in sorted(probe.records.items()):
        ctx = torch.tensor(rec.context)
        n = torch.cat(rec.n)
        for name, st in rec.stats.items():
            cat = {s: torch.cat(v) for s, v in st.items()}                 # (rows, Hq)
            for c in sorted(set(rec.context)):
                sel = ctx == c
                row = {"model": model, "layer": layer, "scaling": name, "context": c,
                       "rows": int(sel.sum()), "mean_n": round(float(n[sel].mean()), 1)}
                for s in ("topk_mass", "recent_share", "far_share"):
                    row[s] = round(float(cat[s][sel].mean()), 4)
                row["topk_mass_per_head"] = [round(float(x), 4)
                                             for x in cat["topk_mass"][sel].mean(0)]
                row["argmax_distance_median"] = float(cat["argmax_distance"][sel].median())
                out.append(row)
    return out


def layer_means(rows: List[dict]) -> List[dict]:
    """Mean over a model's layers of each statistic, per (model, scaling, context)."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["scaling"], r["context"]), []).append(r)
    out = []
    for (model, name, c), rs in groups.items():
        out.append({"model": model, "scaling": name, "context": c, "layers": len(rs),
                    **{s: round(sum(r[s] for r in rs) / len(rs), 4)
                       for s in ("topk_mass", "recent_share", "far_share")},
                    "argmax_distance_median": sorted(r["argmax_distance_median"]
                                                     for r in rs)[len(rs) // 2]})
    return out


def markdown(rows: List[dict], meta: dict) -> str:
    """Tables: layer-mean top-k mass by context per scaling; per-layer locality of the frozen
    drafter and the target."""
    means = layer_means(rows)
    contexts = sorted({r["context"] for r in rows})
    names = list(dict.fromkeys(r["scaling"] for r in means if r["model"] == "drafter"))
    k = meta["topk"]
    lines = [f"Top-{k} attention mass of the {meta['drafter']} drafter (layer mean over heads and "
             f"sampled rows) while decoding held-out text ({meta['text']}), n_ref {meta['n_ref']}; "
             f"rows: the drafter's query rows of {meta['steps']} decoding steps per context.", "",
             "| scaling | " + " | ".join(f"{c} tokens" for c in contexts) + " |",
             "|---|" + "---:|" * len(contexts)]
    get = {(r["model"], r["scaling"], r["context"]): r for r in means}
    for name in names:
        lines.append(f"| {name} | " + " | ".join(
            f"{get[('drafter', name, c)]['topk_mass']:.3f}" if ('drafter', name, c) in get
            else "" for c in contexts) + " |")
    if any(r["model"] == "target" for r in means):
        lines.append("| target (its own layers, frozen) | " + " | ".join(
            f"{get[('target', 'frozen', c)]['topk_mass']:.3f}" if ('target', 'frozen', c) in get
            else "" for c in contexts) + " |")
    lines += ["", f"Where the mass goes (frozen): share on the last {RECENT} keys / share on keys "
              f"farther back than n_ref / median distance of the most-weighted key.", "",
              "| model | layer | " + " | ".join(f"{c} tokens" for c in contexts) + " |",
              "|---|---:|" + "---:|" * len(contexts)]
    per = {(r["model"], r["layer"], r["context"]): r for r in rows if r["scaling"] == "frozen"}
    for model, layer in sorted({(r["model"], r["layer"]) for r in rows}):
        cells = []
        for c in contexts:
            r = per.get((model, layer, c))
            cells.append("" if r is None else f"{r['recent_share']:.2f} / {r['far_share']:.2f}"
                         f" / {r['argmax_distance_median']:.0f}")
        lines.append(f"| {model} | {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: List[dict], meta: dict, path) -> None:
    """Layer-mean top-k mass against context, one line per scaling (and the target)."""
    means = layer_means(rows)
    fig, ax = figure(figsize=(7, 4.5))
    for model, name in dict.fromkeys((r["model"], r["scaling"]) for r in means):
        pts = sorted((r["context"], r["topk_mass"]) for r in means
                     if r["model"] == model and r["scaling"] == name)
        label = name if model == "drafter" else "target (frozen)"
        style = "k--" if model == "target" else ("o-" if name == "frozen" else ".-")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, lw=1.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"top-{meta['topk']} attention mass (layer mean)")
    ax.set_title(f"{meta['drafter']}: attention-mass dilution and the scalings")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


# ----- the command ------------------------------------------------------------------------------
def run(target, tokenizer, drafter, *, drafter_name: str, lengths: List[int], steps: int,
        out, topk: int = 32, rows: int = 16, seed: int = 0, calibrated=None,
        include_target: bool = True) -> List[dict]:
    """`sharpdraft analyze mass`: decode `steps` tokens (greedy, frozen drafter) after a held-out
    KJV passage (Genesis) of each length + the bench's task, probing every attention call;
    writes mass.json, mass.md and mass.png to `out`. Returns the per-layer rows."""
    n_ref = drafter.sharp.n_ref
    drafter.sharp = SharpConfig(mode="none", n_ref=n_ref)
    runtime = TargetRuntime.prepare(target)        # the probe watches its modules
    modules = attention_modules(drafter, runtime if include_target else torch.nn.Module())
    probe = AttentionProbe(modules, scaling_suite(n_ref, topk, calibrated=calibrated), topk=topk,
                           rows=rows, seed=seed)
    for L in tqdm(lengths, desc="analyze mass: contexts", unit="context"):
        ids = build_prompts(tokenizer, [L], 0)[0]["ids"]
        probe.context = L
        with observe(probe):
            speculative_generate(runtime, drafter, ids, steps)
    result = summarise(probe)
    meta = {"drafter": drafter_name, "n_ref": n_ref, "topk": topk, "steps": steps,
            "rows_per_call": rows, "lengths": lengths, "seed": seed,
            "text": "KJV Genesis, held out from training, + the bench's summary task",
            "scalings": {k: v.kernel_kwargs() | {"layer_slopes": v.layer_slopes}
                         for k, v in probe.scalings.items()}}
    write_report(out, "mass", {"settings": meta, "rows": result,
                               "layer_means": layer_means(result)}, markdown(result, meta),
                 indent=1, default=float)
    plot(result, meta, Path(out) / "mass.png")
    return result
