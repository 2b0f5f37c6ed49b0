"""Online adaptation of the drafter, the alternative SharpDraft is compared with (the paper's
Table 1, at small scale).

`OnlineAdapter` wraps a drafter that can adapt online (its class's `adapts_online`: DFlash's
teacher-forced blocks) and fine-tunes it while it decodes: after every verification
it keeps the target's distributions at the verified positions (the rows up to and including
the first rejection, which saw the true prefix), and every `every` steps it takes one AdamW step
on the soft cross-entropy (KL up to the target's entropy) of the drafter's blocks of those steps
against them, teacher forced over the whole context. The adapted parameters are either all the
drafter's ("full") or LoRA adapters of rank r on its attention projections (q/k/v/o, through
`peft`). Decoding stays lossless: verification is unchanged, only the drafts move.

`run` decodes the same prompts with the frozen drafter, SharpDraft, and each adaptation, and
reports trainable parameters, peak memory (resident set size above the run's start, sampled),
ms per update, tau and the speedup over target-only decoding in the same process.
"""
from __future__ import annotations

import copy
import threading
import time
from typing import Dict, List

import torch
from tqdm import tqdm

from ..attention import SharpConfig
from ..drafters import registry
from ..inference.engine import autoregressive_generate, speculative_generate
from ..training.losses import distill_loss, position_weights, target_to_draft
from .report import figure, save_figure, write_report

MODES = ("full", "lora")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


class OnlineAdapter:
    """A drafter fine-tuned during decoding (module docstring); pass it to the engine in place of
    the drafter.

    Args:
        drafter: a drafter whose class sets `adapts_online` (DFlash; modified in place: pass a
            copy to keep the original).
        target: the target it drafts for (its final norm and LM head give the distributions).
        mode: "full" (every drafter parameter) or "lora" (rank `rank` adapters on q/k/v/o).
        every: verification steps between updates. lr: AdamW learning rate.
        gamma: loss weight decay along the block (as in `training.dflash`). topk: target
            probabilities kept per verified position.

    Raises:
        TypeError: the drafter cannot adapt online. ValueError: unknown mode, rank < 1 or
            every < 1. ModuleNotFoundError: mode "lora" without peft installed.
    """

    drafts_trees = False
    _sharpdraft_packed = True        # the engine must not prepack weights that train

    def __init__(self, drafter, target, mode: str = "lora", *, rank: int = 16, every: int = 4,
                 lr: float = 1e-4, gamma: float = 2.0, topk: int = 32):
        if not self.supports(drafter):
            able = [k.cls.__name__ for k in registry.KINDS.values() if self.supports(k.cls)]
            raise TypeError(f"OnlineAdapter: the drafter must adapt online (teacher-forced "
                            f"blocks, its class's adapts_online: {', '.join(able)}), got "
                            f"{type(drafter).__name__}")
        if mode not in MODES:
            raise ValueError(f"OnlineAdapter: mode must be one of {MODES}, got {mode!r}")
        if rank < 1 or every < 1:
            raise ValueError(f"OnlineAdapter: rank and every must be >= 1, got {rank}, {every}")
        self.drafter, self.target, self.mode, self.every = drafter, target, mode, every
        self.gamma, self.topk = gamma, topk
        if mode == "lora":
            try:
                from peft import LoraConfig, inject_adapter_in_model
            except ModuleNotFoundError:
                raise ModuleNotFoundError("OnlineAdapter mode 'lora' needs peft: "
                                          "pip install peft") from None
            inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0,
                                               target_modules=LORA_TARGETS), drafter)
            for name, p in drafter.named_parameters():
                p.requires_grad_("lora_" in name)
        else:
            for p in drafter.parameters():
                p.requires_grad_(True)
        if drafter.d2t is not None:
            drafter.d2t.requires_grad_(False)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.update_ms: List[float] = []
        self.t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])

    @staticmethod
    def supports(drafter) -> bool:
        """Whether `drafter` (an instance or a Drafter class) can be adapted: its class sets the
        capability `adapts_online` (teacher-forced blocks, `block_logits(target, feats, block,
        anchors)`; DFlash)."""
        cls = drafter if isinstance(drafter, type) else type(drafter)
        return bool(cls.adapts_online)

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def sharp(self):
        return self.drafter.sharp

    @sharp.setter
    def sharp(self, value):
        self.drafter.sharp = value

    @property
    def max_drafts(self) -> int:
        return self.drafter.max_drafts

    @property
    def hidden_layers(self) -> list:
        """The drafter's layers and the target's final hidden state (after its norm), from
        which the target's distributions at the verified rows are recomputed."""
        return sorted(set(self.drafter.hidden_layers)
                      | {len(self.target.get_decoder().layers)})

    def start(self, target, prompt_ids, hidden_states, target_cache=None) -> "AdaptSession":
        return AdaptSession(self, prompt_ids, hidden_states, target_cache)

    def update(self, feats: torch.Tensor, ids: List[int], anchors: List[int],
               dists: Dict[int, tuple]) -> None:
        """One AdamW step on the blocks at `anchors` (teacher forced over the context features
        `feats` (T, F) of positions < T), rows whose position has a verified target
        distribution in `dists` {position: (top_p, top_i)}."""
        d = self.drafter
        b = d.config.block_size
        t0 = time.perf_counter()
        a = torch.tensor(anchors)
        block = torch.full((len(anchors), b), d.config.mask_token_id, dtype=torch.long)
        block[:, 0] = torch.tensor([ids[x] for x in anchors])
        k = self.topk
        top_p = torch.zeros(len(anchors), b - 1, k)
        top_i = torch.full((len(anchors), b - 1, k), -1, dtype=torch.long)
        valid = torch.zeros(len(anchors), b - 1, dtype=torch.bool)
        for r, x in enumerate(anchors):
            for j in range(1, b):
                if x + j in dists:
                    top_p[r, j - 1], top_i[r, j - 1] = dists[x + j]
                    valid[r, j - 1] = True
        if valid.any():
            d.train()
            with torch.enable_grad():
                logits = d.block_logits(self.target, feats.float(), block, a)[:, 1:]
                ids_d = top_i if self.t2d is None else torch.where(
                    top_i >= 0, self.t2d[top_i.clamp_min(0)], top_i)
                loss, _ = distill_loss(logits, top_p, ids_d, position_weights(b, self.gamma),
                                       valid)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                self.opt.step()
            d.eval()
        self.update_ms.append(1000 * (time.perf_counter() - t0))


class AdaptSession:
    """The wrapped drafter's session, plus what the updates read: every context feature, the
    committed ids, the verified target distributions and the anchors since the last update."""

    def __init__(self, adapter: OnlineAdapter, prompt_ids, hidden_states, target_cache):
        self.a = adapter
        d = adapter.drafter
        self.inner = d.start(adapter.target, prompt_ids, hidden_states, target_cache)
        self.feats = [d.context_features(hidden_states)[0]]
        self.ids = prompt_ids[0].tolist()
        self.dists: Dict[int, tuple] = {}
        self.pending: List[int] = []
        self.position = None

    def propose(self, last: int, position: int, draw, max_drafts=None) -> tuple:
        self.position = position
        if len(self.ids) == position:
            self.ids.append(last)
        sized = {} if max_drafts is None else {"max_drafts": max_drafts}
        return self.inner.propose(last, position, draw, **sized)

    @torch.no_grad()
    def _verified(self, n: int, hidden_states) -> None:
        """Target distributions of the n verified rows: row i predicts position + 1 + i."""
        h = hidden_states[len(self.a.target.get_decoder().layers)][0, :n]
        probs = torch.softmax(self.a.target.get_output_embeddings()(h).float(), dim=-1)
        p, i = probs.topk(self.a.topk, dim=-1)
        for r in range(n):
            self.dists[self.position + 1 + r] = (p[r], i[r])

    def commit(self, accepted: List[int], hidden_states) -> None:
        n = len(accepted)
        self._verified(n, hidden_states)
        self.feats.append(self.a.drafter.context_features(hidden_states)[0, :n])
        self.ids.extend(accepted[:-1])              # `last` is already in; the bonus is next
        self.pending.append(self.position)
        self.inner.commit(accepted, hidden_states)
        if len(self.pending) >= self.a.every:
            feats = torch.cat(self.feats)
            self.feats = [feats]
            self.a.update(feats, self.ids, self.pending, self.dists)
            self.pending = []

    def state_bytes(self) -> int:
        return self.inner.state_bytes() + sum(f.nbytes for f in self.feats)


class PeakRSS:
    """Context manager sampling this process's resident set size every `interval` s; `peak`
    is the largest sample above the one at entry, in bytes."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak = interval, 0
        import psutil                  # optional: needed only to sample memory

        self._proc = psutil.Process()

    def __enter__(self):
        self._base = self._proc.memory_info().rss
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, self._proc.memory_info().rss - self._base)
                self._stop.wait(self.interval)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss - self._base)


def methods(lora_ranks=(16, 32)) -> List[tuple]:
    """(label, sharp?, mode, rank) of every method compared."""
    out = [("frozen", False, None, 0), ("sharpdraft", True, None, 0), ("full", False, "full", 0)]
    return out + [(f"lora-r{r}", False, "lora", r) for r in lora_ranks]


def run(target, tokenizer, drafter, prompts: List[dict], *, max_new_tokens: int, out,
        every: int = 4, lr: float = 1e-4, lora_ranks=(16, 32), slope: float = 0.2) -> dict:
    """Decode every prompt (greedy) target-only, then with each method of `methods`, each from
    a fresh copy of `drafter` (after one warm-up run of every method on a short prefix); write
    adapt.json and adapt.md to `out`.

    Returns {"settings", "rows", "summary"}; summary per method: trainable parameters, mean
    tau, geometric-mean end-to-end speedup, ms per update (median), peak RSS (max, MiB).
    """
    eos = tokenizer.eos_token_id
    n_ref = drafter.sharp.n_ref
    rows = []
    # one-time costs (allocator pools, op dispatch, peft's first forward) stay out of the
    # timed runs and of the memory peaks: every method once on a short prefix first
    warm = prompts[0]["ids"][:, :64]
    autoregressive_generate(target, warm, 4)
    for _, _, mode, rank in methods(lora_ranks):
        d = copy.deepcopy(drafter)
        runner = d if mode is None else OnlineAdapter(d, target, mode, rank=rank or 16, every=1,
                                                      lr=lr)
        speculative_generate(target, runner, warm, 8)
    for p in tqdm(prompts, desc="analyze adapt", unit="prompt"):
        ar = autoregressive_generate(target, p["ids"], max_new_tokens, eos_token_id=eos)
        row = {"name": p["name"], "prompt_tokens": p["ids"].shape[1], "ar": ar.summary()}
        for label, sharp, mode, rank in methods(lora_ranks):
            d = copy.deepcopy(drafter)
            d.sharp = SharpConfig(mode="fixed_slope" if sharp else "none", slope=slope,
                                  n_ref=n_ref)
            runner = d if mode is None else OnlineAdapter(d, target, mode, rank=rank or 16,
                                                          every=every, lr=lr)
            with PeakRSS() as mem:
                res = speculative_generate(target, runner, p["ids"], max_new_tokens,
                                           eos_token_id=eos)
            upd = getattr(runner, "update_ms", [])
            row[label] = {"tau": res.tau, "speedup": res.tokens_per_s / ar.tokens_per_s,
                          "identical_to_ar": res.tokens == ar.tokens,
                          "trainable_parameters": getattr(runner, "trainable_parameters", 0),
                          "updates": len(upd),
                          "ms_per_update": sorted(upd)[len(upd) // 2] if upd else None,
                          "peak_rss_mib": mem.peak / 2**20}
        rows.append(row)
    summary = {}
    for label, *_ in methods(lora_ranks):
        rs = [r[label] for r in rows]
        ms = [r["ms_per_update"] for r in rs if r["ms_per_update"] is not None]
        summary[label] = {
            "trainable_parameters": rs[0]["trainable_parameters"],
            "tau": sum(r["tau"] for r in rs) / len(rs),
            "speedup": float(torch.tensor([r["speedup"] for r in rs]).log().mean().exp()),
            "ms_per_update": sorted(ms)[len(ms) // 2] if ms else None,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            "lossless": all(r["identical_to_ar"] for r in rs)}
    meta = {"max_new_tokens": max_new_tokens, "every": every, "lr": lr, "n_ref": n_ref,
            "slope": slope, "prompts": [r["name"] for r in rows]}
    write_report(out, "adapt", {"settings": meta, "rows": rows, "summary": summary},
                 markdown(summary, meta), figure=plot(summary))
    return {"settings": meta, "rows": rows, "summary": summary}


def plot(summary: Dict[str, dict], path=None):
    """Bars of mean tau and speedup over target-only decoding per method: saved to `path`, or
    returned as a figure when `path` is None (`report.write_report` saves it)."""
    labels = list(summary)
    fig, axes = figure(1, 2, figsize=(9, 3.5))
    for ax, key, title in ((axes[0], "tau", "mean tau"),
                           (axes[1], "speedup", "speedup vs target-only")):
        ax.bar(labels, [summary[k][key] for k in labels],
               color=["C0" if summary[k]["trainable_parameters"] == 0 else "C1" for k in labels])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    fig.suptitle("online adaptation (orange) vs frozen and SharpDraft (blue)")
    return fig if path is None else save_figure(fig, path)


def markdown(summary: Dict[str, dict], meta: dict) -> str:
    lines = [f"Online adaptation vs SharpDraft (greedy, {meta['max_new_tokens']} new tokens, "
             f"an update every {meta['every']} verification steps, AdamW lr {meta['lr']}; "
             f"SharpDraft slope {meta['slope']}, n_ref {meta['n_ref']}; prompts "
             f"{', '.join(meta['prompts'])}). Peak memory: resident set size above the run's "
             f"start (CPU), the largest over the prompts.", "",
             "| method | trainable params | peak memory (MiB) | ms / update | mean tau | "
             "speedup vs AR | lossless |", "|---|---:|---:|---:|---:|---:|---|"]
    for label, s in summary.items():
        ms = "n/a" if s["ms_per_update"] is None else f"{s['ms_per_update']:.0f}"
        lines.append(f"| {label} | {s['trainable_parameters']:,} | {s['peak_rss_mib']:.0f} | "
                     f"{ms} | {s['tau']:.3f} | {s['speedup']:.3f}x | {s['lossless']} |")
    return "\n".join(lines) + "\n"
