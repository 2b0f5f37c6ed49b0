"""Every bad input to `sharpdraft` ends in one stderr line `sharpdraft <command>: error: ...`
naming the flag, file or field, with no traceback (unless --debug): exit code 2 for what the
parser's one validation pass rejects before any model is loaded, 1 for what only a run finds.
"""
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sharpdraft.cli import commands as cli
from sharpdraft.drafters import registry
from sharpdraft.drafters.formats.files import tensor_shapes
from sharpdraft.inference.engine import check_context
from sharpdraft_helpers import tiny_drafter, tiny_target

WORDS = ("the lord god said unto him and her earth heaven light day night water was it "
         "good made called evening morning first second").split()


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """A tiny target checkpoint (word-level tokenizer), a DFlash checkpoint for it, and files
    that are not what their flag wants."""
    root = tmp_path_factory.mktemp("cli-errors")
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    target = tiny_target(vocab=len(vocab), eos_token_id=1)
    target.save_pretrained(root / "target")
    fast.save_pretrained(root / "target")
    tiny_drafter(target).save(root / "dflash")
    (root / "file.txt").write_text("hello")
    (root / "binary.bin").write_bytes(bytes(range(256)))
    (root / "nul.txt").write_bytes(b"the lord\x00god")
    (root / "empty").mkdir()
    (root / "empty" / "readme.txt").write_text("not a model")
    (root / "bad-config").mkdir()
    (root / "bad-config" / "config.json").write_text("{oops")
    (root / "corrupt.gguf").write_bytes(b"GGUF" + bytes(64))
    for name, text in (("sweep-bad", "{nope"), ("sweep-empty", "{}")):
        (root / name).mkdir()
        (root / name / "sweep.json").write_text(text)
    return root


def error_line(capsys, command: str) -> str:
    """The one stderr line of a failed `sharpdraft <command>`: the last line, the only one
    holding "error:", and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]), err
    assert lines[0].startswith(f"sharpdraft {command}: error: "), lines[0]
    return lines[0]


def checkpoint(fx, tmp_path, edit_config=None, edit_weights=None) -> Path:
    """A copy of the fixture's DFlash checkpoint, its config and / or weights edited."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    cfg = json.loads((fx / "dflash" / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    data = (fx / "dflash" / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data)
    if edit_weights:
        edit_weights(folder / "model.safetensors")
    return folder


def _drop(name):
    def edit(path):
        sd = load_file(str(path))
        sd.pop(name)
        save_file(sd, str(path))
    return edit


def _add(name, tensor):
    def edit(path):
        sd = load_file(str(path))
        sd[name] = tensor
        save_file(sd, str(path))
    return edit


def _truncate(n):
    def edit(path):
        path.write_bytes(path.read_bytes()[:-n])
    return edit


def _write(data: bytes):
    def edit(path):
        path.write_bytes(data)
    return edit


def _set(**kw):
    return lambda cfg: cfg.update(kw)


GENERATE = ["generate", "--prompt", "the lord", "--no-chat-template", "--max-new-tokens", "4",
            "--dtype", "float32", "--threads", "1"]

# (id, config edit, weights edit, words the error line must hold); the checkpoint goes to
# `generate --drafter-path`: each fails before any weight is read
CHECKPOINTS = [
    ("fc_shape", _set(target_layer_ids=[0, 1, 2]), None,
     ["model.safetensors", "fc.weight", "(64, 128)", "(64, 192)"]),
    ("truncated", None, _truncate(1000), ["model.safetensors is truncated", "header says"]),
    ("heads", _set(hidden_size=768, num_attention_heads=9), None,
     ["config.json", "hidden_size 768", "num_attention_heads 9", "head_dim"]),
    ("gqa", _set(num_key_value_heads=3), None,
     ["config.json", "num_attention_heads 4", "num_key_value_heads 3"]),
    ("head_dim_null", _set(head_dim=None), None, ["config.json", "head_dim", "null"]),
    ("wrong_type", _set(hidden_size="64"), None, ["config.json", "hidden_size", '"64"']),
    ("bad_value", _set(block_size=1), None, ["config.json", "block_size"]),
    ("missing_tensor", None, _drop("fc.weight"), ["missing tensor", "fc.weight"]),
    ("unexpected_tensor", None, _add("bogus", torch.zeros(3)),
     ["unexpected tensor", "bogus"]),
    ("garbage", None, _write(b"\x00garbage" * 100), ["model.safetensors", "not a safetensors"]),
    ("empty_weights", None, _write(b""), ["model.safetensors", "0 bytes"]),
    ("padded", None, lambda p: p.write_bytes(p.read_bytes() + bytes(10)),
     ["model.safetensors", "10 bytes past"]),
    ("header_not_json", None, _write(struct.pack("<Q", 4) + b"{no}"),
     ["model.safetensors", "header is not JSON"]),
]


@pytest.mark.parametrize("edit_config, edit_weights, words",
                         [c[1:] for c in CHECKPOINTS], ids=[c[0] for c in CHECKPOINTS])
def test_bad_drafter_checkpoint_is_one_line(fx, tmp_path, capsys, edit_config, edit_weights,
                                            words):
    folder = checkpoint(fx, tmp_path, edit_config, edit_weights)
    rc = cli.main(GENERATE + ["--target", str(fx / "target"), "--drafter", "dflash",
                              "--drafter-path", str(folder)])
    line = error_line(capsys, "generate")
    assert rc == 1 and str(folder) in line
    for w in words:
        assert w in line, (w, line)


def test_config_json_not_json_names_the_file_and_position(fx, tmp_path, capsys):
    folder = checkpoint(fx, tmp_path)
    (folder / "config.json").write_text('{"hidden_size": 64,\n "x": }')
    assert cli.main(GENERATE + ["--target", str(fx / "target"), "--drafter-path",
                                str(folder)]) == 1
    line = error_line(capsys, "generate")
    assert f"{folder}: config.json is not JSON" in line and "line 2 column 7" in line


def test_shape_mismatch_is_found_before_any_weight_is_read(fx, tmp_path, monkeypatch):
    from sharpdraft.drafters import base
    folder = checkpoint(fx, tmp_path, _set(target_layer_ids=[0, 1, 2]))
    monkeypatch.setattr(base, "load_file", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match=r"fc\.weight has shape \(64, 128\) in the file, the "
                                         r"config implies \(64, 192\)"):
        registry.get("dflash").cls.load(folder)


def _untrained_config_fields(kind):
    cfg = registry.get(kind).cls.config_class
    base = registry.build_untrained(kind, tiny_target(), type("T", (), {
        "pad_token_id": 0, "unk_token_id": None, "eos_token_id": 1,
        "__len__": lambda self: 256})()).config
    return cfg, {f: getattr(base, f) for f in cfg.__dataclass_fields__}


# the project's own formats derive head_dim from hidden_size / heads; the public z-lab DFlash
# layout (Qwen3) sets head_dim on its own, so only the grouped-query ratio binds it
OWN_FORMATS = [n for n in registry.names() if registry.get(n).trainable]


@pytest.mark.parametrize("kind", OWN_FORMATS)
def test_config_geometry_is_checked_before_any_module_is_built(kind):
    """hidden_size 768 with 9 heads: the config itself refuses, naming the fields."""
    cfg, fields = _untrained_config_fields(kind)
    with pytest.raises(ValueError) as exc:
        cfg(**dict(fields, hidden_size=768, num_attention_heads=9))
    for w in ("hidden_size 768", "num_attention_heads 9", "head_dim", cfg.__name__):
        assert w in str(exc.value)


def test_public_dflash_geometry_binds_only_the_gqa_ratio():
    cfg, fields = _untrained_config_fields("zlab-dflash")
    ok = cfg(**dict(fields, hidden_size=768, num_attention_heads=9, num_key_value_heads=3))
    assert (ok.hidden_size, ok.num_attention_heads) == (768, 9)
    with pytest.raises(ValueError) as exc:
        cfg(**dict(fields, num_attention_heads=9, num_key_value_heads=2))
    for w in ("num_attention_heads 9", "num_key_value_heads 2", cfg.__name__):
        assert w in str(exc.value)


def test_safetensors_header_of_a_whole_and_a_truncated_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4)}, str(path))
    assert tensor_shapes(path) == {"a": (2, 3), "b": (4,)}
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match=rf"w.safetensors is truncated \({size - 5} bytes, "
                                         rf"header says {size}\)"):
        tensor_shapes(path)


# Bad inputs found before any model is loaded: (argv, words of the error line). The target
# named is the fixture's (`{fx}` is replaced), or a path that does not exist.
PARSER_CASES = [
    (["generate", "--target", "{fx}/nope"], ["--target", "no such file or folder"]),
    (["generate", "--target", "{fx}/empty"], ["--target", "config.json"]),
    (["generate", "--target", "{fx}/file.txt"], ["--target", "neither"]),
    (["generate", "--drafter-path", "{fx}/nope"], ["--drafter-path", "no such folder"]),
    (["generate", "--drafter-path", "{fx}/file.txt"], ["--drafter-path", "not a folder"]),
    (["generate", "--drafter-path", "{fx}/empty"], ["--drafter-path", "no config.json"]),
    (["generate", "--prompt-file", "{fx}/nope.txt"], ["--prompt-file", "nope.txt"]),
    (["generate", "--prompt-file", "{fx}/binary.bin"], ["--prompt-file", "not UTF-8"]),
    (["generate", "--prompt-file", "{fx}/nul.txt"], ["--prompt-file", "binary"]),
    (["generate", "--prompt-file", "{fx}"], ["--prompt-file", "cannot read"]),
    (["generate", "--context-file", "{fx}/nope.txt"], ["--context-file", "nope.txt"]),
    (["generate", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["generate", "--max-new-tokens=-3"], ["--max-new-tokens", ">= 1"]),
    (["generate", "--threads=-1"], ["--threads", ">= 1"]),
    (["generate", "--drafter-layers", "0"], ["--drafter-layers", ">= 1"]),
    (["generate", "--block-size", "0"], ["--block-size", ">= 2"]),
    (["generate", "--block-size=-4"], ["--block-size", ">= 2"]),
    (["generate", "--n-ref=-2"], ["--n-ref", ">= 1"]),
    (["generate", "--seed=-1"], ["--seed", ">= 0"]),
    (["generate", "--kjv-context=-5"], ["--kjv-context", ">= 1"]),
    (["generate", "--context-window=-1"], ["--context-window", ">= 0"]),
    (["generate", "--attention-sinks", "4"], ["--attention-sinks", "needs --context-window"]),
    (["bench", "--suite", "sessions", "--sessions", "novels"], ["--sessions", "invalid choice"]),
    (["generate", "--slope", "nan"], ["--slope", "finite"]),
    (["generate", "--draft-threshold", "nan"], ["--draft-threshold", "finite"]),
    (["generate", "--temperature", "-0.5"], ["--temperature", ">= 0"]),
    (["bench", "--lengths=-1"], ["--lengths", ">= 1"]),
    (["bench", "--maths=-1"], ["--maths", ">= 0"]),
    (["bench", "--corpus-prompts=-1"], ["--corpus-prompts", ">= 0"]),
    (["bench", "--corpus", "{fx}/nope", "--corpus-prompts", "2"], ["--corpus", "no such folder"]),
    (["bench", "--out", "{fx}/file.txt/sub"], ["--out", "file.txt is a file"]),
    (["bench", "--out", "{fx}/file.txt"], ["--out", "not a folder"]),
    (["analyze", "mass", "--steps", "0"], ["--steps", ">= 1"]),
    (["analyze", "mass", "--topk=-1"], ["--topk", ">= 1"]),
    (["analyze", "mass", "--rows", "0"], ["--rows", ">= 1"]),
    (["analyze", "mass", "--lengths", "0"], ["--lengths", ">= 1"]),
    (["analyze", "sweep", "--decode=-1"], ["--decode", ">= 0"]),
    (["analyze", "sweep", "--bucket", "0"], ["--bucket", ">= 1"]),
    (["analyze", "sweep", "--per-bucket", "0"], ["--per-bucket", ">= 1"]),
    (["analyze", "sweep", "--length", "0"], ["--length", ">= 1"]),
    (["analyze", "sweep", "--sequences", "0"], ["--sequences", ">= 1"]),
    (["analyze", "sweep", "--edges", "0", "5"], ["--edges"]),
    (["analyze", "adapt", "--every", "0"], ["--every", ">= 1"]),
    (["analyze", "adapt", "--lora-ranks", "0"], ["--lora-ranks", ">= 1"]),
    (["analyze", "adapt", "--lr", "nan"], ["--lr", "finite"]),
    (["analyze", "adapt", "--lr=-1"], ["--lr", "> 0"]),
    (["analyze", "calibrate", "--out", "{fx}/file.txt/x"], ["--out"]),
    (["analyze", "compare", "{fx}/nope1", "{fx}/nope2"], ["nope1", "no sweep.json"]),
    (["analyze", "compare", "{fx}/empty", "{fx}/sweep-bad"], ["empty", "no sweep.json"]),
    (["data", "generate", "--out", "x", "--tokens", "0"], ["--tokens", ">= 1"]),
    (["data", "generate", "--out", "x", "--tokens", "5", "--seed=-1"], ["--seed", ">= 0"]),
    (["data", "generate", "--out", "x", "--tokens", "5", "--top-p", "nan"], ["--top-p"]),
    (["data", "generate", "--out", "{fx}/file.txt/c", "--tokens", "5"], ["--out"]),
    (["data", "generate", "--out", "x", "--tokens", "5", "--device", "tpu"], ["--device"]),
    (["train", "dflash", "--out", "x", "--init-from", "{fx}/nope"],
     ["--init-from", "no such folder"]),
    (["train", "dflash", "--out", "x", "--steps", "0"], ["--steps", ">= 1"]),
    (["train", "dflash", "--out", "x", "--threads", "0"], ["--threads", ">= 1"]),
    (["train", "dflash", "--out", "x", "--tokens=-5"], ["--tokens", ">= 1"]),
    (["train", "dflash", "--out", "x", "--lr", "inf"], ["--lr", "finite"]),
    (["train", "dflash", "--out", "x", "--lr-scale", "0"], ["--lr-scale", "> 0"]),
    (["train", "dflash", "--out", "x", "--max-minutes", "0"], ["--max-minutes", "> 0"]),
    (["train", "dflash", "--out", "x", "--position-skip", "2"], ["--position-skip", "[0, 1]"]),
    (["train", "dflash", "--out", "x", "--warmup=-1"], ["--warmup", ">= 0"]),
    (["train", "eagle3", "--out", "x", "--target", "{fx}/nope"], ["--target"]),
]


def _command(argv):
    return " ".join(argv[:2]) if argv[0] in ("analyze", "data", "train") else argv[0]


@pytest.mark.parametrize("argv, words", PARSER_CASES,
                         ids=[" ".join(a[:4]).replace("{fx}/", "") for a, _ in PARSER_CASES])
def test_bad_option_is_one_line_before_any_model(fx, capsys, monkeypatch, argv, words):
    from sharpdraft.cli import commands
    monkeypatch.setattr(commands, "load_target",
                        lambda *a, **k: pytest.fail("a target was loaded"))
    argv = [a.replace("{fx}", str(fx)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    line = error_line(capsys, _command(argv))
    assert exc.value.code == 2
    for w in words:
        assert w in line, (w, line)


@pytest.mark.parametrize("name, raw", [("SHARPDRAFT_FUSED_DRAFTERS", "maybe"),
                                       ("SHARPDRAFT_VLLM_SLOPE", "steep")])
def test_bad_environment_variable_is_one_line_before_any_model(fx, capsys, monkeypatch, name,
                                                               raw):
    """A SHARPDRAFT_* value the package would only read mid-run fails with the flags."""
    from sharpdraft.cli import commands
    monkeypatch.setattr(commands, "load_target",
                        lambda *a, **k: pytest.fail("a target was loaded"))
    monkeypatch.setenv(name, raw)
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--max-new-tokens", "2"])
    line = error_line(capsys, "generate")
    assert exc.value.code == 2 and f"{name}={raw!r}" in line, line


# Bad inputs only a run finds (a target that cannot be loaded, a context too long...): exit 1
RUN_CASES = [
    (GENERATE + ["--target", "{fx}/bad-config"], ["--target", "config.json"]),
    (GENERATE + ["--target", "{fx}/corrupt.gguf"], ["--target", "corrupt.gguf"]),
    (GENERATE[:4] + ["--max-new-tokens", "5000", "--target", "{fx}/target"],
     ["--max-new-tokens 5000", "max_position_embeddings", "or less"]),
    (GENERATE + ["--target", "{fx}/target", "--kjv-context", "10000000"], ["--kjv-context"]),
    (["analyze", "compare", "{fx}/sweep-bad", "{fx}/sweep-empty"],
     ["sweep-bad/sweep.json", "not JSON", "line 1 column 2"]),
    (["analyze", "compare", "{fx}/sweep-empty", "{fx}/sweep-empty"],
     ["sweep-empty/sweep.json", "not a sweep report"]),
]


@pytest.mark.parametrize("argv, words", RUN_CASES,
                         ids=["bad-config", "corrupt-gguf", "context", "kjv", "sweep-not-json",
                              "sweep-empty"])
def test_run_time_error_is_one_line(fx, capsys, monkeypatch, tmp_path, argv, words):
    monkeypatch.setenv("SHARPDRAFT_HOME", str(tmp_path / "home"))
    argv = [a.replace("{fx}", str(fx)) for a in argv]
    if argv[0] == "analyze":
        argv += ["--out", str(tmp_path / "out")]
    assert cli.main(argv) == 1
    line = error_line(capsys, _command(argv))
    for w in words:
        assert w in line, (w, line)


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(fx, capsys, where):
    argv = GENERATE[:4] + ["--max-new-tokens", "5000", "--target", str(fx / "target")]
    argv = ["--debug"] + argv if where == "before" else argv + ["--debug"]
    with pytest.raises(ValueError, match="--max-new-tokens 5000"):
        cli.main(argv)


def test_unexpected_errors_name_their_type_and_ctrl_c_is_quiet(fx, capsys, monkeypatch):
    from sharpdraft.cli import commands
    argv = GENERATE + ["--target", str(fx / "target")]
    def boom(*a, **k):
        raise RuntimeError("kernel exploded\nsecond line")
    monkeypatch.setattr(commands, "build_drafter", boom)
    assert cli.main(argv) == 1
    line = error_line(capsys, "generate")
    assert "RuntimeError: kernel exploded second line" in line and "--debug" in line
    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(commands, "build_drafter", interrupt)
    assert cli.main(argv) == 130
    assert capsys.readouterr().err.rstrip().endswith("sharpdraft generate: interrupted")


def test_check_context_names_the_flag_and_what_fits():
    target = tiny_target()                          # max_position_embeddings 512
    assert check_context(target, 500, 12, extra=9) == 521
    with pytest.raises(ValueError, match=r"max_new_tokens=20: .* 520 positions.* 512 "
                                         r"\(max_position_embeddings\); use max_new_tokens=12"):
        check_context(target, 500, 20)
    with pytest.raises(ValueError, match=r"--steps 8: the --lengths 600 passage .*shorten"):
        check_context(target, 600, 8, what="--lengths 600 passage", flag="--steps")
    with pytest.raises(ValueError, match=r"--length: 600 tokens exceed"):
        check_context(target, 600, 0, what="--length")


def test_generate_runs_without_matplotlib_or_psutil(fx):
    """The CLI imports sharpdraft.eval (plots: matplotlib; adapt: psutil) only in the commands
    that use it."""
    code = ("import sys, json\n"
            "sys.modules['matplotlib'] = sys.modules['psutil'] = None\n"
            "from sharpdraft.cli import main\n"
            f"rc = main({GENERATE + ['--target', str(fx / 'target'), '--json']!r})\n"
            "assert not any(m.startswith('sharpdraft.eval') for m in sys.modules)\n"
            "sys.exit(rc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["new_tokens"] >= 1
