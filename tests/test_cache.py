"""The converted-target cache (sharpdraft.target.resolve_target): concurrent conversions, a
conversion killed midway, and messages on stderr. The slow transformers conversion is replaced
by a fake whose save_pretrained writes a few small files."""
import hashlib
import multiprocessing
import os
import signal

import pytest
import transformers

from sharpdraft.target import loading as models

EXPECTED = {"config.json", "model.safetensors", "tokenizer.json", models.PROVENANCE_FILE}


class FakeModel:
    """Stands in for the dequantised model: save_pretrained writes small files, first waiting at
    `barrier` (so that concurrent conversions really overlap) and optionally dying midway."""

    def __init__(self, tag, barrier=None, die=False):
        self.config, self.hf_quantizer, self.tag = object(), None, tag
        self.barrier, self.die = barrier, die

    def save_pretrained(self, folder):
        os.makedirs(folder, exist_ok=True)
        if self.barrier is not None:
            self.barrier.wait(timeout=60)
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write('{"model_type": "llama"}')
        if self.die:  # killed while safetensors writes its temporary file
            with open(os.path.join(folder, ".tmpA1b2C3"), "wb") as f:
                f.write(b"\0" * (1 << 20))
            os.kill(os.getpid(), signal.SIGKILL)
        with open(os.path.join(folder, "model.safetensors"), "w") as f:
            f.write(self.tag)


class FakeTokenizer:
    def save_pretrained(self, folder):
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write("{}")


def fake_converter(monkeypatch, tag, barrier=None, die=False):
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: FakeModel(tag, barrier, die))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: FakeTokenizer())


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A .gguf source file and an empty SHARPDRAFT_HOME; returns (file, expected cache folder)."""
    monkeypatch.setenv("SHARPDRAFT_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny.gguf"
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")           # a complete, tiny GGUF: one tensor
    writer.add_tensor("tiny", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return path, tmp_path / "home" / "targets" / digest[:16]


def _resolve_in_child(source, queue):
    try:
        folder, _ = models.resolve_target(source)
        queue.put(("ok", str(folder), (folder / "model.safetensors").read_text()))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        queue.put(("error", f"{type(err).__name__}: {err}", None))


def test_two_concurrent_conversions_share_one_result(gguf, monkeypatch):
    source, out_dir = gguf
    ctx = multiprocessing.get_context("fork")     # children inherit the fake converter
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = []
    for tag in ("first", "second"):
        fake_converter(monkeypatch, tag, barrier)
        procs.append(ctx.Process(target=_resolve_in_child, args=(str(source), queue)))
        procs[-1].start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [r[0] for r in results] == ["ok", "ok"], results
    assert {r[1] for r in results} == {str(out_dir)}
    # both converted (the barrier), one renamed its folder, the other reused it
    assert results[0][2] == results[1][2] in ("first", "second")
    assert {f.name for f in out_dir.iterdir()} == EXPECTED
    assert sorted(f.name for f in out_dir.parent.iterdir()) == [out_dir.name]  # no temporaries


def test_killed_conversion_is_not_reused(gguf, monkeypatch):
    source, out_dir = gguf
    ctx = multiprocessing.get_context("fork")
    fake_converter(monkeypatch, "killed", die=True)
    child = ctx.Process(target=_resolve_in_child, args=(str(source), ctx.Queue()))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL
    assert not out_dir.exists()
    leftovers = list(out_dir.parent.iterdir())  # the dead conversion's temporary folder
    assert len(leftovers) == 1 and (leftovers[0] / ".tmpA1b2C3").exists()

    fake_converter(monkeypatch, "rerun")
    folder, provenance = models.resolve_target(str(source))
    assert folder == out_dir and provenance["source"] == str(source)
    assert {f.name for f in folder.iterdir()} == EXPECTED   # no stale temporary file
    assert (folder / "model.safetensors").read_text() == "rerun"
    assert sorted(f.name for f in out_dir.parent.iterdir()) == [out_dir.name]


def test_a_live_conversion_is_left_alone(gguf, monkeypatch):
    """Another process's temporary folder (its pid is alive) is not deleted under it."""
    source, out_dir = gguf
    out_dir.parent.mkdir(parents=True)
    live = out_dir.parent / f"{out_dir.name}.partial-{os.getppid()}-x1y2"
    live.mkdir()
    fake_converter(monkeypatch, "mine")
    models.resolve_target(str(source))
    assert live.exists() and (out_dir / "model.safetensors").read_text() == "mine"


def test_conversion_message_goes_to_stderr(gguf, monkeypatch, capsys):
    """generate --json prints JSON on stdout: the one-time "converting" line must not."""
    source, out_dir = gguf
    fake_converter(monkeypatch, "quiet")
    models.resolve_target(str(source))
    out, err = capsys.readouterr()
    assert out == "" and "converting tiny.gguf" in err
    models.resolve_target(str(source))                 # cached: no message at all
    assert capsys.readouterr() == ("", "")
