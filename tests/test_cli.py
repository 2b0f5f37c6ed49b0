"""`sharpdraft generate` end to end on a tiny local Hugging Face checkpoint (model + tokenizer)."""
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sharpdraft import cli
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
                "ar_tokens_per_s", "speedup"):
        assert key in report
    assert report["identical_to_ar"] is True          # greedy: lossless
    assert report["new_tokens"] == report["ar_new_tokens"] == 12
    # tau = committed tokens per verification forward (the prefill makes the first token)
    assert report["tau"] == pytest.approx((12 - 1) / (report["target_forwards"] - 1))
    assert report["sharp"]["mode"] == ("fixed_slope" if sharp == "--sharp" else "none")


@pytest.mark.parametrize("drafter", [["--drafter", "eagle3"], ["--drafter", "eagle3", "--tree"],
                                     ["--drafter", "pard", "--drafter-layers", "1"]])
def test_generate_with_each_drafter_family(checkpoint, capsys, drafter):
    rc = cli.main(["generate", "--target", str(checkpoint), "--prompt",
                   "the lord god said unto him and her", "--no-chat-template",
                   "--max-new-tokens", "10", "--compare-ar", "--json", "--threads", "1"] + drafter)
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical_to_ar"] is True and report["new_tokens"] == 10
    assert report["drafter"] == drafter[1] + ("-tree" if "--tree" in drafter else "")


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--tree"], "--tree"),
    (["generate", "--drafter", "eagle3", "--tree", "--draft-threshold", "0.5"], "--tree"),
    (["generate", "--block-size", "1"], "--block-size"),
    (["generate", "--kjv-context", "0"], "--kjv-context"),
    (["generate", "--n-ref", "0"], "--n-ref"),
    (["generate", "--threads", "0"], "--threads"),
    (["generate", "--draft-threshold", "1.5"], "--draft-threshold"),
    (["generate", "--temperature", "-1"], "--temperature"),
    (["bench", "--lengths", "1024", "0"], "--lengths"),
    (["bench", "--maths", "-1"], "--maths"),
])
def test_bad_options_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:        # before any model is loaded
        cli.main(argv + ["--target", "/nonexistent"])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_kjv_context_beyond_genesis_names_the_flag(checkpoint):
    with pytest.raises(ValueError, match="--kjv-context"):
        cli.main(["generate", "--target", str(checkpoint), "--kjv-context", "10000000"])


def test_bench_table_summarises_each_kind():
    from sharpdraft.bench import markdown_table

    def row(name, kind, tf, sf, ts, ss):
        return {"name": name, "kind": kind, "prompt_tokens": 100, "ar": {"tokens_per_s": 3.0},
                "dflash-frozen": {"tau": tf, "speedup": sf, "identical_to_ar": True},
                "dflash-sharp": {"tau": ts, "speedup": ss, "identical_to_ar": True}}
    md = markdown_table([row("kjv-1", "kjv", 1.2, 0.5, 1.4, 0.25), row("kjv-2", "kjv", 1.6, 2.0, 1.8, 4.0),
                         row("maths-0", "maths", 2.0, 1.0, 2.0, 1.0)],
                        {"max_new_tokens": 8, "slope": 0.2, "n_ref": 64, "block_size": 4})
    assert md.count("\n| kjv-") == 2
    # means by hand: tau (1.2 + 1.6) / 2, speedup sqrt(0.5 * 2) and sqrt(0.25 * 4)
    assert ("kjv (2 prompts): dflash-frozen: mean tau 1.400, geomean speedup 1.000x; "
            "dflash-sharp: mean tau 1.600, geomean speedup 1.000x.") in md
    assert "maths (1 prompts): dflash-frozen: mean tau 2.000" in md


def test_run_bench_writes_rows_for_every_variant(tmp_path):
    """bench over drafter variants (EAGLE-3 chain and tree here): one table row per prompt and
    variant, frozen and SharpDraft both lossless, JSON and plot written."""
    import torch

    from sharpdraft.bench import run_bench
    from sharpdraft_helpers import tiny_eagle3

    target = tiny_target()
    drafter = tiny_eagle3(target, tree_topk=2, tree_depth=2, tree_tokens=4, chain_length=3)

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
    md = (tmp_path / "bench.md").read_text()
    assert md.count("| eagle3-tree |") == 2 and md.count("| eagle3-chain |") == 2
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["settings"]["max_drafts"] == {"eagle3-chain": 3, "eagle3-tree": 4}
    assert (tmp_path / "tau_vs_context.png").stat().st_size > 1000
