"""`sharpdraft generate` end to end on a tiny local Hugging Face checkpoint (model + tokenizer)."""
import dataclasses
import json
import re

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sharpdraft.cli import commands as cli
from sharpdraft.drafters import registry
from sharpdraft_helpers import tiny_target

WORDS = ("the lord god said unto him and her earth heaven light day night water was it "
         "good made called evening morning first second").split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama and a word-level tokenizer saved as a local checkpoint folder."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    folder = tmp_path_factory.mktemp("tiny-target")
    tiny_target(vocab=len(vocab), eos_token_id=1).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("sharp", ["--sharp", "--no-sharp"])
def test_generate_json_compares_with_target_only(checkpoint, capsys, sharp):
    rc = cli.main(["generate", "--target", str(checkpoint), "--prompt",
                   "in the beginning god made the heaven and the earth", "--no-chat-template",
                   "--max-new-tokens", "12", "--compare-ar", "--json", sharp, "--threads", "1"])
    assert rc == 0
    def no_constants(name):
        raise AssertionError(f"--json printed {name}, which strict JSON parsers reject")
    report = json.loads(capsys.readouterr().out, parse_constant=no_constants)
    for key in ("text", "new_tokens", "target_forwards", "tau", "tokens_per_s",
                "ar_tokens_per_s", "speedup", "seq_rep_4"):
        assert key in report
    assert report["identical_to_ar"] is True          # greedy: lossless
    assert report["new_tokens"] == report["ar_new_tokens"] == 12
    assert 0.0 <= report["seq_rep_4"] <= 1 - 1 / 9      # 12 tokens: 9 4-grams, one at least unique
    # tau = committed tokens per verification forward (the prefill makes the first token)
    assert report["tau"] == pytest.approx((12 - 1) / (report["target_forwards"] - 1))
    assert report["sharp"]["mode"] == ("fixed_slope" if sharp == "--sharp" else "none")
    # decode rates exclude the prefill: 11 tokens after the first over (wall - prefill)
    assert 0 < report["prefill_s"] < report["wall_s"]
    assert report["decode_tokens_per_s"] == pytest.approx(
        11 / (report["wall_s"] - report["prefill_s"]))
    assert report["decode_speedup"] == pytest.approx(
        report["decode_tokens_per_s"] / report["ar_decode_tokens_per_s"])
    steps = report["target_forwards"] - 1
    assert 0 < (report["draft_ms_per_step"] + report["verify_ms_per_step"]) * steps / 1e3 \
        <= report["wall_s"] - report["prefill_s"]
    assert report["target"]["dtype"] in ("float32", "bfloat16")      # --dtype auto's choice


@pytest.mark.parametrize("drafter", [["--drafter", "eagle3"], ["--drafter", "eagle3", "--tree"],
                                     ["--drafter", "eagle3", "--draft-threshold", "0.3"],
                                     ["--drafter", "pard", "--drafter-layers", "1"]])
def test_generate_with_each_drafter_family(checkpoint, capsys, drafter):
    rc = cli.main(["generate", "--target", str(checkpoint), "--prompt",
                   "the lord god said unto him and her", "--no-chat-template",
                   "--max-new-tokens", "10", "--compare-ar", "--json", "--threads", "1"] + drafter)
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical_to_ar"] is True and report["new_tokens"] == 10
    assert report["drafter"] == drafter[1] + ("-tree" if "--tree" in drafter else "")
    flag = drafter[drafter.index("--draft-threshold") + 1] if "--draft-threshold" in drafter \
        else "0"                                     # an untrained drafter measured none
    assert report["draft_threshold"] == float(flag)


def test_generate_task_runs_the_suites_own_prompt(checkpoint, capsys):
    from transformers import AutoTokenizer
    from sharpdraft.eval.bench import suite_prompts

    rc = cli.main(["generate", "--target", str(checkpoint), "--task", "code-1",
                   "--max-new-tokens", "4", "--json", "--threads", "1"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    want = next(p for p in suite_prompts(AutoTokenizer.from_pretrained(checkpoint), ["code"])
                if p["name"] == "code-1")
    assert report["task"] == "code-1" and report["prompt_tokens"] == want["ids"].shape[1]
    assert report["new_tokens"] == 4


def test_tree_shape_options_replace_the_checkpoint_config(checkpoint, capsys):
    """--tree-topk/--tree-depth/--tree-tokens reach the drafter: the report echoes the shape, no
    step commits more than depth + 1 tokens, and the output stays lossless."""
    rc = cli.main(["generate", "--target", str(checkpoint), "--prompt",
                   "the lord god said unto him and her", "--no-chat-template", "--drafter",
                   "eagle3", "--tree", "--tree-topk", "2", "--tree-depth", "2", "--tree-tokens",
                   "3", "--max-new-tokens", "12", "--compare-ar", "--json", "--threads", "1"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tree_shape"] == {"tree_topk": 2, "tree_depth": 2, "tree_tokens": 3}
    assert report["max_drafts"] == 3
    assert report["fused_draft_step"] is None        # a float target: the modules draft
    assert 1 <= report["tau"] <= 3 and report["identical_to_ar"] is True


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--drafter", "dflash", "--tree"], "--tree"),
    (["generate", "--drafter", "eagle3", "--tree", "--draft-threshold", "0.5"], "--tree"),
    (["generate", "--block-size", "1"], "--block-size"),
    (["generate", "--drafter", "eagle3", "--tree", "--tree-tokens", "0"], "--tree-tokens"),
    (["bench", "--drafter", "eagle3", "--tree-depth", "0"], "--tree-depth"),
    (["generate", "--drafter", "dflash", "--tree-topk", "4"], "--tree-topk"),  # no trees
    (["generate", "--drafter", "eagle3", "--tree-depth", "3"], "--tree"),  # chain drafting
    (["analyze", "mass", "--drafter", "eagle3", "--tree-tokens", "8", "--out", "x"],
     "--tree-tokens"),
    (["generate", "--kjv-context", "0"], "--kjv-context"),
    (["generate", "--task", "story-9"], "--task"),
    (["generate", "--task", "doc-4k"], "--task"),                 # a category, not a task
    (["generate", "--task", "story-0", "--prompt", "hi"], "--task"),
    (["generate", "--task", "doc-4k-GPL-2", "--context-file", "x"], "--context-file"),
    (["generate", "--task", "code-0", "--kjv-context", "64"], "--kjv-context"),
    (["generate", "--task", "code-0", "--no-chat-template"], "--no-chat-template"),
    (["generate", "--n-ref", "0"], "--n-ref"),
    (["generate", "--threads", "0"], "--threads"),
    (["generate", "--draft-threshold", "1.5"], "--draft-threshold"),
    (["generate", "--temperature", "-1"], "--temperature"),
    (["generate", "--temperature", "nan"], "--temperature"),
    (["generate", "--temperature", "inf"], "--temperature"),
    (["generate", "--slope", "nan"], "--slope"),
    (["generate", "--slope", "inf"], "--slope"),
    (["bench", "--slope=-inf"], "--slope"),
    (["bench", "--lengths", "1024", "0"], "--lengths"),
    (["bench", "--maths", "-1"], "--maths"),
    (["generate", "--context-window=-2"], "--context-window"),
    (["generate", "--context-window", "0", "--attention-sinks", "4"], "--attention-sinks"),
    (["generate", "--drafter", "longspark", "--context-window", "64"], "--context-window"),
])
def test_bad_options_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:        # before any model is loaded
        cli.main(argv + ["--target", "/nonexistent"])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def error_line(capsys, command: str = "generate") -> str:
    """The one error line a failed `sharpdraft <command>` left on stderr (no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.startswith(f"sharpdraft {command}: error: ")]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]), err
    return lines[0]


def test_kjv_context_beyond_genesis_names_the_flag(checkpoint, capsys):
    assert cli.main(["generate", "--target", str(checkpoint), "--kjv-context", "10000000"]) == 1
    assert "--kjv-context" in error_line(capsys)


def test_bench_table_summarises_each_kind():
    from sharpdraft.eval.bench import markdown_table

    def row(name, kind, tf, sf, ts, ss):     # decode speedups: 2x the end-to-end ones
        return {"name": name, "kind": kind, "prompt_tokens": 100,
                "ar": {"tokens_per_s": 3.0, "decode_tokens_per_s": 4.0,
                       "seq_rep_4": 0.1 if kind == "kjv" else 0.6},
                "dflash-frozen": {"tau": tf, "speedup": sf, "decode_speedup": 2 * sf,
                                  "identical_to_ar": True},
                "dflash-sharp": {"tau": ts, "speedup": ss, "decode_speedup": 2 * ss,
                                 "identical_to_ar": True}}
    md = markdown_table([row("kjv-1", "kjv", 1.2, 0.5, 1.4, 0.25), row("kjv-2", "kjv", 1.6, 2.0, 1.8, 4.0),
                         row("maths-0", "maths", 2.0, 1.0, 2.5, 1.5)],
                        {"max_new_tokens": 8, "slope": 0.2, "n_ref": 64, "block_size": 4})
    assert md.count("\n| kjv-") == 2
    assert "| kjv-1 | 100 | 4.0 | dflash | 1.200 | 0.500x | 1.000x | 1.400 | 0.250x | 0.500x |" in md
    # by category, by hand: kjv tau (1.2 + 1.6) / 2 and decode speedup sqrt(1 * 4); sharp
    # kjv sqrt(0.5 * 8), maths 3; the last column sqrt(2 * 2) and sqrt(2 * 3)
    assert "| drafter | kjv | maths | geomean |" in md
    assert "| dflash-frozen | 2.00x (1.40) | 2.00x (2.00) | 2.00x |" in md
    assert "| dflash-sharp | 2.00x (1.60) | 3.00x (2.50) | 2.45x |" in md
    assert "| target output seq-rep-4 (mean) | 0.10 | 0.60 | |" in md
    assert md.count("| True | 0.10 |") == 2 and md.count("| True | 0.60 |") == 1


def test_seq_rep_by_hand():
    """seq-rep-4 on hand-counted sequences: distinct tokens 0; one 4-gram repeated among 5
    (1 2 3 4 1 2 3 4: 1234 2341 3412 4123 1234) 1 - 4/5; a two-token loop of 20 tokens has 17
    4-grams of 2 kinds; fewer than 4 tokens 0."""
    from sharpdraft.eval.bench import seq_rep
    assert seq_rep(list(range(10))) == 0.0
    assert seq_rep([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(0.2)
    assert seq_rep([7, 8] * 10) == pytest.approx(1 - 2 / 17)
    assert seq_rep([1, 2, 3]) == 0.0


def test_run_bench_writes_rows_for_every_variant(tmp_path):
    """bench over drafter variants (EAGLE-3 chain and tree here): one table row per prompt and
    variant, frozen and SharpDraft both lossless, JSON and plot written."""
    import torch

    from sharpdraft.eval.bench import run_bench
    from sharpdraft_helpers import tiny_eagle3

    target = tiny_target()
    drafter = tiny_eagle3(target, tree_topk=2, tree_depth=2, tree_tokens=4, chain_length=3)
    drafter.config.draft_threshold = 0.9      # a checkpoint's measured default: chain only

    class Tok:
        eos_token_id = None
    prompts = [{"name": f"p{i}", "kind": "kjv", "ids": torch.randint(3, 256, (1, 20 + 30 * i))}
               for i in range(2)]
    rows = run_bench(target, Tok(), {"eagle3-chain": (drafter, False),
                                     "eagle3-tree": (drafter, True)}, prompts, 6, 0.2, tmp_path)
    assert len(rows) == 2
    for r in rows:
        for key in ("eagle3-chain-frozen", "eagle3-chain-sharp", "eagle3-tree-frozen",
                    "eagle3-tree-sharp"):
            assert r[key]["identical_to_ar"] is True and r[key]["new_tokens"] == 6
        assert 0.0 <= r["ar"]["seq_rep_4"] < 1.0
    md = (tmp_path / "bench.md").read_text()
    assert md.count("| eagle3-tree |") == 2 and md.count("| eagle3-chain |") == 2
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["settings"]["max_drafts"] == {"eagle3-chain": 3, "eagle3-tree": 4}
    assert saved["settings"]["draft_threshold"] is None
    assert saved["settings"]["draft_thresholds"] == {"eagle3-chain": 0.9, "eagle3-tree": 0.0}
    # an untrained drafter over 256 tokens is never 90% sure: every chain step keeps one draft
    for r in rows:
        assert r["eagle3-chain-frozen"]["mean_draft_length"] == 1.0
    assert saved["settings"]["target_dtype"] == "float32"
    assert (tmp_path / "tau_vs_context.png").stat().st_size > 1000
    assert (tmp_path / "speedup_by_kind.png").stat().st_size > 1000
    assert set(saved["by_kind"]) == {f"eagle3-{v}-{m}" for v in ("chain", "tree")
                                     for m in ("frozen", "sharp")}
    # the weights benched are named by content: the same module twice gives one digest, and
    # a change of one weight (by hand, independent of the digest code) gives another
    from sharpdraft.eval.bench import weights_sha256
    digest = saved["settings"]["drafter_sha256"]
    assert digest["eagle3-chain"] == digest["eagle3-tree"] == weights_sha256(drafter)
    assert len(digest["eagle3-chain"]) == 64
    with torch.no_grad():
        next(drafter.parameters()).view(-1)[0] += 1.0
    assert weights_sha256(drafter) != digest["eagle3-chain"]


def test_run_bench_runs_each_variant_under_both_policies(tmp_path):
    """policies=("fixed", "auto"): every variant again as "<label>-auto", lossless, its draft
    threshold 0 and its policy recorded; an unknown policy is refused before any work."""
    import torch

    from sharpdraft.eval.bench import run_bench
    from sharpdraft_helpers import tiny_eagle3

    target = tiny_target()
    drafter = tiny_eagle3(target, chain_length=3)
    drafter.config.draft_threshold = 0.9

    class Tok:
        eos_token_id = None
    prompts = [{"name": "p0", "kind": "kjv", "ids": torch.randint(3, 256, (1, 24))}]
    with pytest.raises(ValueError, match="policies"):
        run_bench(target, Tok(), {"eagle3-chain": (drafter, False)}, prompts, 6, 0.2,
                  tmp_path / "bad", policies=("greedy",))
    assert not (tmp_path / "bad").exists()
    rows = run_bench(target, Tok(), {"eagle3-chain": (drafter, False)}, prompts, 6, 0.2,
                     tmp_path, policies=("fixed", "auto"))
    for key in ("eagle3-chain-frozen", "eagle3-chain-auto-frozen", "eagle3-chain-auto-sharp"):
        assert rows[0][key]["identical_to_ar"] is True
    assert rows[0]["eagle3-chain-auto-frozen"]["draft_policy"] == "auto"
    assert rows[0]["eagle3-chain-frozen"]["draft_policy"] == "fixed"
    saved = json.loads((tmp_path / "bench.json").read_text())["settings"]
    assert saved["policies"] == {"eagle3-chain": "fixed", "eagle3-chain-auto": "auto"}
    assert saved["draft_thresholds"] == {"eagle3-chain": 0.9, "eagle3-chain-auto": 0.0}
    assert "-auto ran the auto draft policy" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("flag", ["--prompt-file", "--context-file"])
def test_non_utf8_text_file_is_an_error_naming_the_file(tmp_path, capsys, flag):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))     # 0xe9: not UTF-8
    with pytest.raises(SystemExit) as exc:                   # before any model is loaded
        cli.main(["generate", flag, str(bad), "--target", "/nonexistent"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and flag in err and str(bad) in err and "UTF-8" in err


def test_prompt_past_the_context_is_refused_before_the_drafter(checkpoint, monkeypatch, capsys):
    """tiny target: max_position_embeddings 512; the prompt + 600 new tokens do not fit."""
    from transformers import AutoTokenizer
    prompt = "in the beginning god made the heaven and the earth"
    n = len(AutoTokenizer.from_pretrained(checkpoint)(prompt).input_ids)
    def no_drafter(*a, **k):
        raise AssertionError("the drafter was loaded before the context check")
    monkeypatch.setattr(cli, "build_drafter", no_drafter)
    argv = ["generate", "--target", str(checkpoint), "--prompt", prompt, "--no-chat-template"]
    assert cli.main(argv + ["--max-new-tokens", "600"]) == 1
    line = error_line(capsys)
    assert re.search(r"--max-new-tokens 600.*512", line)
    assert f"{n + 600} positions" in line
    assert f"--max-new-tokens {512 - n} or less" in line            # what would fit
    monkeypatch.undo()
    # exactly at the limit it runs
    assert cli.main(argv + ["--max-new-tokens", str(512 - n), "--json", "--threads", "1"]) == 0


def _saved_drafter(tmp_path, name, make, target, edit=None):
    folder = tmp_path / name
    make(target).save(folder)
    if edit:
        cfg = json.loads((folder / "config.json").read_text())
        edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _other_target(vocab=300, hidden=32, layers=8):
    """A random Llama unlike tiny_target (4 layers, width 64, vocabulary 256)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(5)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512)).eval()


@pytest.mark.parametrize("kind,edit,fields", [
    ("dflash", lambda c: c.update(target_layer_ids=[1, 45]), ["target_layer_ids", "45"]),
    ("dflash", lambda c: c.update(mask_token_id=10_000), ["mask_token_id"]),
    ("eagle3", lambda c: c.update(target_layer_ids=[0, 2, 4]), ["target_layer_ids", "[4]"]),
], ids=["dflash_layer", "dflash_mask_token", "eagle3_layer"])
def test_drafter_checkpoint_with_fields_outside_the_target(tmp_path, kind, edit, fields):
    """tiny target: 4 layers (0 .. 3), vocabulary 256."""
    from sharpdraft_helpers import tiny_drafter, tiny_eagle3
    target = tiny_target()
    make = {"dflash": tiny_drafter, "eagle3": tiny_eagle3}[kind]
    folder = _saved_drafter(tmp_path, kind, make, target, edit)
    drafter_cls = registry.get(kind).cls
    assert drafter_cls.load(folder) is not None            # loads without a target
    with pytest.raises(ValueError, match=str(folder)) as exc:
        drafter_cls.load(folder, target=target)
    for f in fields:
        assert f in str(exc.value)


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "pard"])
def test_drafter_checkpoint_for_another_target(tmp_path, kind):
    """A drafter of a width-32, 8-layer, 300-token target against tiny_target (width 64, 4
    layers, 256 tokens): every mismatching field is named; on its own target it loads."""
    from sharpdraft_helpers import tiny_drafter, tiny_pard
    other = _other_target()
    from sharpdraft.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    make = {"dflash": tiny_drafter,
            "eagle3": lambda t: Eagle3Drafter(Eagle3Config.from_target(t.config, [1, 5, 7])),
            "pard": lambda t: tiny_pard(t, draft_vocab_size=280)}[kind]
    drafter = make(other)
    if kind == "pard":
        drafter.set_draft_vocab(torch.arange(20, 300))
    folder = tmp_path / kind
    drafter.save(folder)
    with pytest.raises(ValueError, match=str(folder)) as exc:
        registry.get(kind).cls.load(folder, target=tiny_target())
    msg = str(exc.value)
    want = {"dflash": ["hidden_size is 32", "target_hidden_size is 32", "target_layer_ids"],
            "eagle3": ["hidden_size is 32", "target_hidden_size is 32", "[5, 7]"],
            "pard": ["hidden_size is 32", "draft_vocab_size is 280"]}[kind]
    for w in want:
        assert w in msg, (w, msg)
    registry.get(kind).cls.load(folder, target=other).check_target(other)


@pytest.mark.parametrize("saved,loaded", [("eagle3", "dflash"), ("dflash", "pard"),
                                          ("pard", "eagle3")])
def test_checkpoint_of_another_drafter_kind(tmp_path, saved, loaded):
    from sharpdraft_helpers import tiny_drafter, tiny_eagle3, tiny_pard
    target = tiny_target()
    make = {"dflash": tiny_drafter, "eagle3": tiny_eagle3, "pard": tiny_pard}[saved]
    folder = _saved_drafter(tmp_path, saved, make, target)
    with pytest.raises(ValueError, match=str(folder)) as exc:
        registry.get(loaded).cls.load(folder, target=target)
    assert registry.get(loaded).cls.config_class.__name__ in str(exc.value)
    if (saved, loaded) == ("eagle3", "dflash"):  # the TypeError about norm_features
        assert "norm_features" in str(exc.value) and "mask_token_id" in str(exc.value)


def test_cli_checks_the_drafter_checkpoint_against_the_target(checkpoint, tmp_path, capsys):
    from sharpdraft_helpers import tiny_eagle3
    folder = _saved_drafter(tmp_path, "eagle3", tiny_eagle3, tiny_target(),
                            lambda c: c.update(target_layer_ids=[0, 2, 45]))
    assert cli.main(["generate", "--target", str(checkpoint), "--prompt", "the lord",
                     "--no-chat-template", "--drafter", "eagle3", "--drafter-path", str(folder),
                     "--max-new-tokens", "4"]) == 1
    assert "target_layer_ids" in error_line(capsys)
    with pytest.raises(SystemExit) as exc:      # an eagle3 folder named as dflash: refused
        cli.main(["generate", "--target", str(checkpoint), "--prompt", "the lord",
                  "--no-chat-template", "--drafter", "dflash", "--drafter-path", str(folder),
                  "--max-new-tokens", "4"])
    assert exc.value.code == 2
    assert "--drafter dflash contradicts" in error_line(capsys)


@pytest.mark.parametrize("dtype,identical,noted", [("bfloat16", False, True),
                                                   ("bfloat16", True, False),
                                                   ("float32", False, False)])
def test_report_explains_a_bfloat16_divergence(capsys, dtype, identical, noted):
    # the note appears only where a bfloat16 run left target-only output
    report = {"text": "x", "new_tokens": 4, "prompt_tokens": 3, "target_forwards": 2, "tau": 2.0,
              "tokens_per_s": 10.0, "ar_tokens_per_s": 5.0, "speedup": 2.0,
              "identical_to_ar": identical, "target": {"dtype": dtype}}
    cli.print_report(report)
    out = capsys.readouterr().out
    assert ("--dtype float32 gives token-identical output" in out) is noted
    assert "seq-rep-4" not in out                     # reports without it print no such line
    cli.print_report({**report, "seq_rep_4": 0.25})
    assert "seq-rep-4 0.25: the share" in capsys.readouterr().out
    assert "identical to AR: " + str(identical) in out


def test_drafter_kind_comes_from_the_checkpoint_and_a_contradiction_is_refused(tmp_path, capsys):
    """--drafter omitted: the kind is read from --drafter-path's config.json (DEFAULT_DRAFTER,
    eagle3, without a folder); an explicit --drafter of another kind is a one-line error naming
    both."""
    from sharpdraft_helpers import tiny_drafter, tiny_eagle3

    tiny_eagle3(tiny_target()).save(tmp_path / "e")
    tiny_drafter(tiny_target()).save(tmp_path / "d")
    assert cli.parse(["generate", "--drafter-path", str(tmp_path / "e")]).drafter == "eagle3"
    assert cli.parse(["generate", "--drafter-path", str(tmp_path / "d")]).drafter == "dflash"
    assert cli.parse(["generate"]).drafter == "eagle3"
    assert cli.parse(["bench", "--drafter", "eagle3", "--drafter-path",
                      str(tmp_path / "e")]).drafter == "eagle3"
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--drafter", "pard", "--drafter-path", str(tmp_path / "e")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--drafter pard contradicts --drafter-path" in err[0]
    assert "a eagle3 checkpoint" in err[0] and "Traceback" not in err[0]


def test_generate_says_where_n_ref_comes_from(checkpoint, tmp_path, capsys):
    """--n-ref when given; else the training length the checkpoint records; else 2048 (a public
    DFlash config without one). The report and the printed summary both say which."""
    from transformers import AutoModelForCausalLM
    from sharpdraft.drafters.zlab_dflash import untrained
    from sharpdraft_helpers import tiny_eagle3
    target = AutoModelForCausalLM.from_pretrained(checkpoint)
    untrained(target, layers=2, block_size=4).save(tmp_path / "public")
    tiny_eagle3(target, train_context=96).save(tmp_path / "own")
    base = ["generate", "--target", str(checkpoint), "--prompt", "the lord", "--no-chat-template",
            "--max-new-tokens", "3", "--threads", "1"]
    for folder, extra, want_source, want_n_ref in [
            ("public", [], "default", 2048), ("public", ["--n-ref", "64"], "given", 64),
            ("own", [], "checkpoint", 96)]:
        assert cli.main(base + ["--drafter-path", str(tmp_path / folder), "--json"] + extra) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["n_ref_source"], report["sharp"]["n_ref"]) == (want_source, want_n_ref)
    assert cli.main(base + ["--drafter-path", str(tmp_path / "public")]) == 0
    assert "n_ref 2048: the default 2048: the checkpoint records no training length" \
        in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "pard"])
def test_export_writes_the_public_layout_and_checks_it(checkpoint, tmp_path, capsys, kind):
    """`sharpdraft export` of a drafter in the public architecture: the public kind's folder,
    read back with drafts equal to the original's (float32: bit for bit); a drafter whose
    architecture has no public equivalent is a one-line error naming the config field."""
    from transformers import AutoModelForCausalLM
    from sharpdraft.drafters.loading import detect_kind
    from sharpdraft_helpers import tiny_eagle3, tiny_pard
    target = AutoModelForCausalLM.from_pretrained(checkpoint)
    if kind == "dflash":
        from sharpdraft.drafters.dflash import DFlashConfig, DFlashDrafter
        cfg = DFlashConfig.from_target(target.config, mask_token_id=0, num_layers=2,
                                       block_size=4, num_features=2)
        public, private = (DFlashDrafter(dataclasses.replace(cfg, qk_norm=q)) for q in (True, False))
        field = "qk_norm"
    elif kind == "eagle3":
        from sharpdraft.drafters.eagle3 import Eagle3Config, Eagle3Drafter
        public = Eagle3Drafter(Eagle3Config.from_target(      # layer inputs only: ids < L - 1
            target.config, target_layer_ids=[0, 1, 2], norm_features=False,
            feed_normed_output=False))
        private, field = tiny_eagle3(target, norm_features=True), "norm_features"
    else:
        public, private = tiny_pard(target), tiny_pard(target, draft_vocab_size=8)
        field = "draft_vocab_size"
    public.save(tmp_path / "ours")
    private.save(tmp_path / "private")
    assert cli.main(["export", "--target", str(checkpoint), "--drafter-path",
                     str(tmp_path / "ours"), "--out", str(tmp_path / "pub"),
                     "--dtype", "float32"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == registry.get(kind).public == detect_kind(tmp_path / "pub")
    assert report["probe_same_drafts"] is True and report["probe_max_abs_diff"] < 1e-4
    assert cli.main(["export", "--target", str(checkpoint), "--drafter-path",
                     str(tmp_path / "private"), "--out", str(tmp_path / "no")]) == 1
    assert field in error_line(capsys, "export")
    assert not (tmp_path / "no" / "config.json").exists()
