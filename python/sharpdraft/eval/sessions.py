"""The sessions suite: acceptance and decode speed of drafters in multi-turn sessions that grow to
the target's context (`data.sessions`: held-out documents, maths and reading), by context bucket,
frozen against SharpDraft scalings, with paired bootstrap intervals. The paper's evidence is long
generation in multi-turn sessions (its Table 3, acceptance by output length); this is that table
on held-out text.

Two kinds of run, both greedy and lossless, so every variant decodes the same answers:

- real: `engine.speculative_chat` (and `autoregressive_chat`, the baseline): timed, the decode
  speedup comes from these. A real run also records the target's hidden states of every
  committed position (what its drafter's session was handed).
- replayed: the drafter's session driven through the same session with the recorded hidden
  states and the known answers standing in for the target (a draft is accepted iff it equals the
  answer's next token, as the target's argmax would), for drafters that read the same target
  layers and not the target's KV cache. No target forward runs, so one real run per set of
  target layers prices a dozen variants. The recorded variant is replayed too: its acceptance
  lengths must equal the real run's (`replay_exact`), which checks the replay step by step.

Statistics: tau (the mean tokens committed per verification, bonus included) per context bucket;
units for the bootstrap are (session, turn, bucket) chunks, resampled whole (steps within a turn
are not independent); a variant's difference from its drafter's frozen variant is paired on the
same chunks. Decode speedup per bucket: the baseline's decode seconds over the variant's, summed
over the turns whose answer starts in the bucket (same answers, so the ratio of times is the
ratio of rates).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from tqdm import tqdm

from ..data.sessions import Conversation, Session
from ..inference.engine import (autoregressive_chat, runtime_session, speculative_chat,
                                target_model)
from ..target.quantized import is_quantised
from ..target.runtime import prepare_drafter
from .report import write_report
from .sweep import bucket_table, plot as sweep_plot

EDGES = (0, 2048, 4096, 6144, 8192)


@dataclass
class Variant:
    """One row of the suite: `label`, the `drafter` (its `sharp`, context window and sinks set),
    its `family` (the variants of one drafter checkpoint: each pairs against the family's first
    variant, its frozen one), and whether it runs `real` (else replayed from the recording of
    the first real variant whose drafter reads the same target layers). `draft_threshold` > 0
    (real variants only): drafts cut as the fixed policy cuts them, so tau is that of the cut
    drafts and the speedup that of the setting users decode with."""

    label: str
    drafter: object
    family: str
    real: bool = False
    n_ref: int = 0
    draft_threshold: float = 0.0
    notes: Dict[str, object] = field(default_factory=dict)


class _Recording:
    """The hidden states of every committed position of one real session, in position order."""

    def __init__(self, layers):
        self.layers, self.parts = list(layers), []

    def add(self, hidden, rows: int):
        self.parts.append({i: hidden[i][:, :rows].detach().clone() for i in self.layers})

    def tensor(self) -> Dict[int, torch.Tensor]:
        return {i: torch.cat([p[i] for p in self.parts], dim=1) for i in self.layers}


class _RecordingSession:
    """A session that records what it is handed and otherwise is the drafter's own (same
    propose signature, so the engine treats it as it treats the drafter's)."""

    def __init__(self, inner, rec: _Recording):
        self.inner, self.rec = inner, rec
        if hasattr(inner, "propose_tree"):
            self.propose_tree = inner.propose_tree

    def propose(self, last, position, draw, stop_below: float = 0.0, max_drafts=None):
        kw = {} if max_drafts is None else {"max_drafts": max_drafts}
        if stop_below > 0:
            kw["stop_below"] = stop_below
        return self.inner.propose(last, position, draw, **kw)

    def commit(self, accepted, hidden_states):
        self.rec.add(hidden_states, len(accepted))
        return self.inner.commit(accepted, hidden_states)

    def state_bytes(self):
        return self.inner.state_bytes()


def _record(drafter, rec: _Recording):
    """Make drafter.start hand out recording sessions (undone by `del drafter.start`)."""
    start = type(drafter).start

    def recording_start(target, prompt_ids, hidden_states, target_cache=None):
        rec.add(hidden_states, prompt_ids.shape[1])
        return _RecordingSession(start(drafter, target, prompt_ids, hidden_states,
                                       target_cache), rec)
    drafter.start = recording_start


def _steps(results) -> List[dict]:
    """Per turn: the steps' accept lengths and contexts, the timings of a chat's results and a
    digest of the answer (lossless runs share it)."""
    return [{"context": r.prompt_tokens, "new_tokens": r.new_tokens,
             "accept_lengths": list(r.accept_lengths), "contexts": list(r.context_lengths),
             "decode_s": r.decode_s, "prefill_s": r.prefill_s,
             "answer_sha1": hashlib.sha1(str(r.tokens).encode()).hexdigest()[:16]}
            for r in results]


def real_run(target, tokenizer, session: Session, drafter, *, max_new_tokens: int,
             max_context: int, record: bool = False, draft_threshold: float = 0.0):
    """One timed session: (per-turn steps, answers, the `Conversation`, its `_Recording` or
    None). drafter None: the target-only baseline. record: hand the drafter's session the
    recording wrapper (its hidden states of every committed position)."""
    conv = Conversation(tokenizer, session, max_new_tokens, max_context)
    eos = tokenizer.eos_token_id
    rec = None
    if drafter is None:
        results = autoregressive_chat(target, conv.first, max_new_tokens, conv.follow_up,
                                      eos_token_id=eos, max_context=max_context)
    else:
        if record:
            rec = _Recording(drafter.hidden_layers)
            _record(drafter, rec)
        try:
            results = speculative_chat(target, drafter, conv.first, max_new_tokens,
                                       conv.follow_up, eos_token_id=eos,
                                       max_context=max_context,
                                       draft_threshold=draft_threshold)
        finally:
            if record:
                del drafter.start
    return _steps(results), conv.answers, conv, rec


@torch.no_grad()
def replay(target, drafter, conv: Conversation, hidden: Dict[int, torch.Tensor],
           max_context: int) -> List[dict]:
    """Greedy speculative decoding of `conv`'s session replayed with `drafter` (see the module
    docstring); per turn: accept lengths and contexts."""
    missing = [i for i in drafter.hidden_layers if i not in hidden]
    if missing:
        raise ValueError(f"replay: the recording lacks target layers {missing} the drafter reads")
    ids = conv.transcript()
    draw = lambda row: int(row.argmax())     # noqa: E731 (greedy, as the engine's)
    turns = []
    with runtime_session(target, max_context + drafter.max_drafts + 1,
                         drafter.hidden_layers) as runtime:
        model = runtime.model
        prepare_drafter(drafter, quantised=is_quantised(model), target=model)
        p0 = conv.contexts[0]
        session = drafter.start(model, torch.tensor([ids[:p0]]),
                                {i: h[:, :p0] for i, h in hidden.items()}, runtime.cache)
        for t, (start, answer) in enumerate(zip(conv.contexts, conv.answers)):
            end = start + len(answer)               # the answer is ids[start:end]
            pos, lengths, contexts = start, [], []
            while pos < end - 1:
                drafts, _ = session.propose(ids[pos], pos, draw)
                truth = ids[pos + 1:end]
                k = 0
                while k < len(drafts) and k < len(truth) and drafts[k] == truth[k]:
                    k += 1
                accepted = truth[:k + 1]
                lengths.append(len(accepted))
                contexts.append(pos)
                session.commit(accepted, {i: h[:, pos:pos + len(accepted)]
                                          for i, h in hidden.items()})
                pos += len(accepted)
            turns.append({"context": start, "accept_lengths": lengths, "contexts": contexts})
            if t + 1 < len(conv.contexts):         # the next turn, as engine._append_turn
                nxt = conv.contexts[t + 1]
                session.propose(ids[pos], pos, draw, max_drafts=0)
                session.commit(ids[pos + 1:nxt + 1], {i: h[:, pos:nxt]
                                                      for i, h in hidden.items()})
    return turns


def _chunks(turns_by_session: Dict[str, List[dict]], edges: Sequence[int]) -> Dict[tuple, list]:
    """{(session, turn, bucket index): accept lengths of the steps whose context is in it}."""
    out: Dict[tuple, list] = {}
    for name, turns in turns_by_session.items():
        for t, turn in enumerate(turns):
            for a, c in zip(turn["accept_lengths"], turn["contexts"]):
                b = next(i for i in range(len(edges) - 1) if c < edges[i + 1])
                out.setdefault((name, t, b), []).append(a)
    return out


def _bootstrap(units: List[tuple], reps: int, seed: int) -> tuple:
    """(estimate, low, high) of sum(x) / sum(n) over units [(sum x, n)], 95% percentile
    bootstrap resampling whole units."""
    x = torch.tensor([u[0] for u in units], dtype=torch.float64)
    n = torch.tensor([u[1] for u in units], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(units), (reps, len(units)), generator=g)
    est = (x[idx].sum(1) / n[idx].sum(1)).sort().values
    return (float(x.sum() / n.sum()), float(est[int(0.025 * reps)]),
            float(est[int(0.975 * reps) - 1]))


def _paired(a: Dict[tuple, list], base: Dict[tuple, list], keys: List[tuple], reps: int,
            seed: int) -> tuple:
    """tau(a) - tau(base) over the same chunks, with its 95% bootstrap interval (chunks resampled
    together for both sides)."""
    sa = torch.tensor([sum(a[k]) for k in keys], dtype=torch.float64)
    na = torch.tensor([len(a[k]) for k in keys], dtype=torch.float64)
    sb = torch.tensor([sum(base[k]) for k in keys], dtype=torch.float64)
    nb = torch.tensor([len(base[k]) for k in keys], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(keys), (reps, len(keys)), generator=g)
    d = (sa[idx].sum(1) / na[idx].sum(1) - sb[idx].sum(1) / nb[idx].sum(1)).sort().values
    return (float(sa.sum() / na.sum() - sb.sum() / nb.sum()), float(d[int(0.025 * reps)]),
            float(d[int(0.975 * reps) - 1]))


def table(parts: Dict[str, dict], baseline: Dict[str, List[dict]], variants: List[dict], *,
          edges: Sequence[int] = EDGES, reps: int = 2000, seed: int = 0) -> List[dict]:
    """Rows {variant, family, bucket, steps, chunks, tau, ci95, delta_vs_frozen, delta_ci95,
    relative_delta, decode_speedup (real variants)} from the per-variant turns `parts`
    ({label: {session: turns}}) and the baseline's turns."""
    chunks = {v["label"]: _chunks(parts[v["label"]], edges) for v in variants}
    frozen = {}
    for v in variants:
        frozen.setdefault(v["family"], v["label"])
    rows = []
    for v in variants:
        mine, base = chunks[v["label"]], chunks[frozen[v["family"]]]
        for b in range(len(edges) - 1):
            keys = sorted(k for k in mine if k[2] == b and k in base)
            if not keys:
                continue
            tau, lo, hi = _bootstrap([(sum(mine[k]), len(mine[k])) for k in keys], reps, seed)
            d, dlo, dhi = _paired(mine, base, keys, reps, seed)     # d = tau - tau(frozen)
            row = {"variant": v["label"], "family": v["family"],
                   "bucket": [edges[b], edges[b + 1]],
                   "steps": sum(len(mine[k]) for k in keys), "chunks": len(keys),
                   "tau": round(tau, 4), "ci95": [round(lo, 4), round(hi, 4)],
                   "delta_vs_frozen": round(d, 4), "delta_ci95": [round(dlo, 4), round(dhi, 4)],
                   "relative_delta": round(d / (tau - d), 4), "decode_speedup": None}
            if v["real"]:
                row["decode_speedup"] = _speedup(parts[v["label"]], baseline, edges, b)
            rows.append(row)
    return rows


def _speedup(turns: Dict[str, List[dict]], baseline: Dict[str, List[dict]], edges, b):
    num = den = 0.0
    for name, ts in turns.items():
        for t, turn in enumerate(ts):
            if edges[b] <= turn["context"] < edges[b + 1] and turn["new_tokens"] > 1:
                num += baseline[name][t]["decode_s"]
                den += turn["decode_s"]
    return round(num / den, 4) if den > 0 else None


def markdown(rows: List[dict], meta: dict) -> str:
    named = [dict(r, scaling=r["variant"]) for r in rows]       # `sweep.bucket_table`'s key
    grid = lambda cell: bucket_table(named, "variant", cell)    # noqa: E731
    text = [f"Sessions suite: {', '.join(meta['sessions'])} (held-out text, "
            f"`sharpdraft.data.sessions`), target {meta['target']}, up to "
            f"{meta['max_new_tokens']} new tokens a turn, context up to {meta['max_context']}, "
            f"greedy, full drafts (no draft threshold) but where a label names one. Real runs: "
            f"{', '.join(meta['real'])}; the others replayed from a real run's recording "
            f"(replay of the recorded variant exact: {meta['replay_exact']}; real runs' answers "
            f"equal target-only's: {meta['same_answers_as_target_only']}). Turns and "
            f"generated tokens per session: {meta['turns']}.", "",
            "tau [95% bootstrap over (session, turn) chunks] by context bucket (tokens):", ""]
    text += grid(lambda c: f"{c['tau']:.3f} [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]")
    text += ["", "Change from the family's frozen variant, paired on the same chunks "
             "(relative change in brackets after the interval):", ""]
    text += grid(lambda c: f"{c['delta_vs_frozen']:+.3f} [{c['delta_ci95'][0]:+.2f}, "
                 f"{c['delta_ci95'][1]:+.2f}] ({100 * c['relative_delta']:+.1f}%)")
    text += ["", "Decode speedup over target-only decoding of the same turns (real runs):", ""]
    text += grid(lambda c: "" if c["decode_speedup"] is None else f"{c['decode_speedup']:.2f}x")
    return "\n".join(text) + "\n"


def plot(rows: List[dict], meta: dict, path) -> None:
    """tau by context bucket, one line per variant (`sweep.plot`)."""
    sweep_plot([dict(r, scaling=r["variant"], tau_proxy=r["tau"]) for r in rows],
               {"drafter": "sessions suite"}, path,
               xlabel="context at the verification step (tokens)",
               ylabel="tau (tokens per verification)",
               what="tau by context (buckets mix sessions)", log_x=False)


def run(target, tokenizer, sessions: List[Session], variants: List[Variant], *, out,
        max_new_tokens: int = 128, max_context: Optional[int] = None, seed: int = 0,
        target_name: str = "") -> dict:
    """Run the suite and write sessions.json / .md / .png to `out` (per-variant parts under
    `out`/parts, reused when a cut run resumes: a part is the variant's turns per session).

    Raises:
        ValueError: no variant, duplicate labels, a replayed variant with a draft threshold or
            with no real variant (threshold 0) before it reading the same target layers.
    """
    if not variants:
        raise ValueError("variants: none given")
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise ValueError(f"variants: duplicate labels in {labels}")
    recorder: Dict[tuple, Variant] = {}        # target layers -> the variant recording them
    for v in variants:
        layers = tuple(v.drafter.hidden_layers)
        if v.real and not v.draft_threshold:
            recorder.setdefault(layers, v)
        elif not v.real and v.draft_threshold:
            raise ValueError(f"variants: {v.label} has a draft threshold, so it must run real")
        elif not v.real and layers not in recorder:
            raise ValueError(f"variants: {v.label} is replayed but no real variant before it "
                             f"reads target layers {list(layers)}")
    limit = max_context or target_model(target).config.max_position_embeddings
    out = Path(out)
    parts_dir = out / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)

    def load(label):
        f = parts_dir / f"{label.replace(' ', '_').replace('/', '_')}.json"
        return f, (json.loads(f.read_text()) if f.exists() else None)

    def save(f, data):
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(f)

    f, baseline = load("target-only")
    bar = tqdm(total=len(sessions) * (1 + len(variants)), desc="sessions suite", unit="run")
    if baseline is None:
        baseline = {}
        for s in sessions:
            baseline[s.name] = real_run(
                target, tokenizer, s, None, max_new_tokens=max_new_tokens, max_context=limit)[0]
            bar.update(1)
        save(f, baseline)
    else:
        bar.update(len(sessions))
    parts, recordings = {}, {}
    exact_file, exact = load("replay-exact")        # {"label/session": bool}, kept on resume
    exact = exact or {}

    def record(v: Variant, s: Session):
        """Run `v` for real, recording its hidden states; returns its turns."""
        turns, _, conv, rec = real_run(target, tokenizer, s, v.drafter,
                                       max_new_tokens=max_new_tokens, max_context=limit,
                                       record=True)
        hidden = rec.tensor()
        recordings[(tuple(v.drafter.hidden_layers), s.name)] = (conv, hidden)
        again = replay(target, v.drafter, conv, hidden, limit)
        exact[f"{v.label}/{s.name}"] = [a["accept_lengths"] for a in again] == \
            [b["accept_lengths"] for b in turns]
        save(exact_file, exact)
        return turns

    for v in variants:
        f, part = load(v.label)
        if part is not None:
            parts[v.label] = part
            bar.update(len(sessions))
            continue
        part = {}
        for s in sessions:
            layers = tuple(v.drafter.hidden_layers)
            if recorder.get(layers) is v:
                part[s.name] = record(v, s)
            elif v.real:
                part[s.name] = real_run(target, tokenizer, s, v.drafter,
                                        max_new_tokens=max_new_tokens, max_context=limit,
                                        draft_threshold=v.draft_threshold)[0]
            else:
                if (layers, s.name) not in recordings:     # a resumed run: record again
                    record(recorder[layers], s)
                conv, hidden = recordings[(layers, s.name)]
                part[s.name] = replay(target, v.drafter, conv, hidden, limit)
            bar.update(1)
        parts[v.label] = part
        save(f, part)
    bar.close()
    vs = [{"label": v.label, "family": v.family, "real": v.real, "n_ref": v.n_ref,
           "draft_threshold": v.draft_threshold, **v.notes} for v in variants]
    rows = table(parts, baseline, vs, seed=seed)
    meta = {"sessions": [s.name for s in sessions], "target": target_name,
            "max_new_tokens": max_new_tokens, "max_context": limit, "edges": list(EDGES),
            "real": [v.label for v in variants if v.real], "variants": vs,
            "replay_exact": all(exact.values()) if exact else None,
            "replay_exact_by_session": exact,
            "same_answers_as_target_only": all(
                [t["answer_sha1"] for t in parts[v.label][s.name]]
                == [t["answer_sha1"] for t in baseline[s.name]]
                for v in variants if v.real for s in sessions),
            "turns": {s.name: [len(baseline[s.name]),
                               sum(t["new_tokens"] for t in baseline[s.name])]
                      for s in sessions}}
    data = {"settings": meta, "rows": rows}
    write_report(out, "sessions", data, markdown(rows, meta), indent=1)
    plot(rows, meta, out / "sessions.png")
    return data
