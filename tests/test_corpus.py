"""sharpdraft.data.corpus and what it is made with (prompts, code_edits, shards,
inference.batched): the prompt set, batched generation, shards, resume and `data generate`
(a tiny random Llama and a word-level tokenizer with a chat template; seconds on CPU)."""
import dataclasses
import hashlib
import json
import math
import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sharpdraft.cli import commands as cli
from sharpdraft.data import corpus, prompts as prompt_set, sources as data
from sharpdraft.inference.sampling import sample_next
from sharpdraft.target import PreallocatedCache
from sharpdraft.target.runtime import TargetRuntime
from sharpdraft_helpers import tiny_target

WORDS = ("the lord god said unto him and her earth heaven light day night water was it "
         "good made called evening morning first second def return if else x y").split()
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
FUNCTION = '''def f{n}(x, y):
    """Return the lord and the earth for x and y, said unto him and her, first and second."""
    if x < y and y == {n}:
        return x + y
    if x >= y or y != 2:
        return x - y
    return x == True
'''


def tiny_tokenizer(chat_template=True):
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "user", "assistant", ":"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    if chat_template:
        fast.chat_template = TEMPLATE
    return fast


def _verses(rng, n):
    return "\n".join(" ".join(rng.choice(WORDS[:22]) for _ in range(8)) for _ in range(n))


def fake_documents(source, split):
    """Small documents of every source, disjoint between the splits (names carry the split)."""
    rng = random.Random(f"{source}-{split}")
    tag = "H" if split == "heldout" else "T"
    if source == "kjv":
        return [{"source": "kjv", "name": f"{tag}b{i}", "text": _verses(rng, 30)} for i in range(2)]
    if source == "champ":
        return [{"source": "champ", "name": f"{tag}p{i}",
                 "chat": (f"{_verses(rng, 2)}\nSolve it step by step.", "it was good")}
                for i in range(3)]
    if source == "humaneval":
        return [{"source": "humaneval", "name": f"{tag}/h{i}",
                 "chat": (f"Complete this Python function.\n\ndef h{i}(x):\n    \"\"\"the lord\"\"\"\n",
                          "")} for i in range(3)]
    if source in ("pydoc", "debdoc", "man"):          # one short document, one long one
        return [{"source": source, "name": f"{tag}{source}{i}",
                 "text": "\n\n".join(_verses(rng, 3) for _ in range(n))}
                for i, n in enumerate((12, 40))]
    if source == "compose":
        return [{"source": "compose", "name": f"{tag}s{i}", "text": f"the earth {tag}{i}"}
                for i in range(2)]
    return [{"source": "stdlib", "name": f"{tag}m{i}.py",
             "text": "\n\n".join(FUNCTION.format(n=n) for n in range(4))} for i in range(2)]


@pytest.fixture(autouse=True)
def short_passages(monkeypatch):
    monkeypatch.setattr(prompt_set, "PASSAGE_CHARS", (100, 300))
    monkeypatch.setattr(prompt_set, "FUNCTION_CHARS", (50, 2000))
    monkeypatch.setattr(prompt_set, "SECTION_CHARS", (100, 300))
    monkeypatch.setattr(prompt_set, "LONG_CHARS", (2500, 3000))
    monkeypatch.setattr(prompt_set, "LONG_SHARE", 1.0)


def every_kind(sources=None):
    """{(source, kind)} the prompt set can hold: KINDS, plus the long kinds of the
    documentation sources."""
    sources = sources or corpus.KINDS
    return ({(s, k) for s in sources for k in corpus.KINDS[s]}
            | {(s, k) for s in ("pydoc", "debdoc", "man") if s in sources
               for k in prompt_set.LONG_KINDS})


@pytest.fixture(scope="module")
def target():
    """(the runtime of a tiny target, its tokenizer); generate_batch and generate_corpus take
    the runtime, direct forwards its prepared copy (`runtime.model`)."""
    tok = tiny_tokenizer()
    return TargetRuntime.prepare(tiny_target(vocab=len(tok), eos_token_id=1)), tok


SETTINGS = corpus.Settings(batch=4, max_new_tokens=8, batches_per_shard=2, heldout_every=2,
                           max_seq_len=256)


def run(model, tok, out, tokens=10 ** 9, **kw):
    kw.setdefault("max_shards", 3)
    return corpus.generate_corpus(model, tok, out, tokens, SETTINGS, documents=fake_documents,
                                  provenance={"source": "tiny", "sha256": "ab" * 32},
                                  progress=False, **kw)


def same_corpus(a, b):
    for split in data.SPLITS:
        ca, cb = corpus.load(a, split), corpus.load(b, split)
        assert len(ca) == len(cb) > 0
        for x, y in zip(ca.sequences, cb.sequences):
            np.testing.assert_array_equal(x, y)
        for x, y in zip(ca.masks, cb.masks):
            np.testing.assert_array_equal(x, y)
        assert ca.records == cb.records


# ----- the prompt set --------------------------------------------------------------------------------
def test_prompt_set_is_deterministic_and_covers_every_source_and_kind():
    a, _ = corpus.build_prompts("train", 0, documents=fake_documents)
    b, _ = corpus.build_prompts("train", 0, documents=fake_documents)
    c, _ = corpus.build_prompts("train", 1, documents=fake_documents)
    assert corpus.prompts_digest(a) == corpus.prompts_digest(b)
    assert corpus.prompts_digest(a) != corpus.prompts_digest(c)
    for prompts in (a, c):
        have = {(p.source, p.kind) for p in prompts}
        assert have == every_kind()


def test_prompt_set_of_the_real_heldout_sources_covers_every_kind():
    prompts, unavailable = corpus.build_prompts("heldout", 0)
    # documentation and manual pages depend on the machine; the packaged sources do not
    assert set(unavailable) <= {"debdoc", "man"}
    have = {(p.source, p.kind) for p in prompts}
    base = every_kind([s for s in corpus.KINDS if s not in unavailable])
    # every short kind of every source; long stretches only where a document is long enough
    assert {(s, k) for s, k in base if not k.startswith("long_")} <= have <= base
    assert {p.doc for p in prompts if p.source == "kjv"} == set(data.KJV_HELD_OUT_BOOKS)
    bug = next(p for p in prompts if p.kind == "find_bug")
    assert "```python" in bug.user and bug.followup


def test_heldout_and_train_prompts_never_share_a_document():
    for source in ("kjv", "champ", "humaneval"):          # the real documents (stdlib: below)
        docs = {s: {p.doc for p in corpus.build_prompts(s, 0, [source])[0]} for s in data.SPLITS}
        assert docs["train"] and docs["heldout"] and not docs["train"] & docs["heldout"]
    for split in data.SPLITS:                             # prompts only from their split
        names = {d["name"] for s in data.SOURCES for d in fake_documents(s, split)}
        assert {p.doc for p in corpus.build_prompts(split, 0, documents=fake_documents)[0]} <= names


def test_stdlib_prompts_document_strips_the_docstring_and_find_bug_changes_one_token():
    prompts, _ = corpus.build_prompts("train", 0, ["stdlib"], documents=fake_documents)
    doc = next(p for p in prompts if p.kind == "document")
    assert '"""' not in doc.user and "return x + y" in doc.user
    bug = next(p for p in prompts if p.kind == "find_bug")
    code = bug.user.split("```python\n")[1].split("\n```")[0]
    n = int(code.split("(")[0][5:])
    original = FUNCTION.format(n=n).rstrip("\n")
    assert code != original and len(code.split()) == len(original.split())
    assert sum(a != b for a, b in zip(code.split(), original.split())) == 1


# ----- batched generation --------------------------------------------------------------------------
def test_batched_greedy_generation_matches_unbatched(target):
    model, tok = target
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19, 20]]
    batched = corpus.generate_batch(model, prompts, 8, pad_token_id=1, eos_token_id=None)
    for p, b in zip(prompts, batched):
        alone = corpus.generate_batch(model, [p], 8, pad_token_id=1, eos_token_id=None)[0]
        assert len(b) == len(alone) == 8
        assert b[:4] == alone[:4]
    # the logits of a left-padded row equal the unpadded row's (padding is masked out)
    width = max(map(len, prompts))
    ids = torch.tensor([[1] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        prepared = model.model                     # the runtime's copy: sharp attention
        padded = prepared(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        for i, p in enumerate(prompts):
            alone = prepared(input_ids=torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(padded[i], alone, atol=1e-4, rtol=1e-4)


def test_sampled_batches_are_reproducible_and_differ_from_greedy(target):
    model, _ = target
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    kw = dict(pad_token_id=1, eos_token_id=None, temperature=5.0, top_p=1.0)
    a = corpus.generate_batch(model, prompts, 16, seed=3, **kw)
    assert a == corpus.generate_batch(model, prompts, 16, seed=3, **kw)
    assert a != corpus.generate_batch(model, prompts, 16, pad_token_id=1, eos_token_id=None)


def test_sample_next_is_greedy_at_temperature_0_and_draws_inside_the_top_p_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    assert sample_next(logits, 0.0).tolist() == [0, 3]
    assert sample_next(logits[0], 0.0).dim() == 0                 # a (V,) row: one 0-d id
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, 1.0, 0.7, g) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {0, 1} and set(draws[:, 1].tolist()) == {2, 3}
    # a nucleus larger than the candidates searched first: the full sort, every token reachable
    wide = torch.stack([sample_next(logits, 1.0, 0.99, g, candidates=1) for _ in range(200)])
    assert set(wide[:, 0].tolist()) == {0, 1, 2, 3}
    # top_p 1: the engine's draw, from the whole softmax at the temperature
    want = torch.multinomial(torch.softmax(logits / 0.5, -1), 1,
                             generator=torch.Generator().manual_seed(1)).squeeze(-1)
    assert torch.equal(sample_next(logits, 0.5, generator=torch.Generator().manual_seed(1)), want)
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0)


def test_cache_batch_select_indices_keeps_the_chosen_rows_in_order():
    cache = PreallocatedCache(2, 8)
    k = torch.arange(3 * 2 * 5 * 4, dtype=torch.float32).reshape(3, 2, 5, 4)
    for i, layer in enumerate(cache.layers):
        layer.update(k + i, -k)
    cache.batch_select_indices(torch.tensor([2, 0]))
    for i, layer in enumerate(cache.layers):
        assert layer.get_seq_length() == 5 and layer.get_max_length() == 8
        torch.testing.assert_close(layer.keys, (k + i)[[2, 0]])
        torch.testing.assert_close(layer.values, -k[[2, 0]])
        layer.update(k[:2, :, :1], k[:2, :, :1])                  # still writable, in place
        assert layer.get_seq_length() == 6


def test_target_sha256_is_the_provenances_or_that_of_the_folders_weight_files(tmp_path):
    for name, content in (("b.safetensors", b"bb"), ("a.safetensors", b"a"), ("w.bin", b"w")):
        (tmp_path / name).write_bytes(content)
    assert corpus.target_sha256({"source": str(tmp_path)}) == hashlib.sha256(b"abbw").hexdigest()
    assert corpus.target_sha256({"source": str(tmp_path), "sha256": "ab"}) == "ab"
    assert corpus.target_sha256({"source": str(tmp_path / "missing")}) is None


def test_plain_text_fallback_without_chat_template():
    tok = tiny_tokenizer(chat_template=False)
    ids = corpus.render(tok, [{"role": "user", "content": "the lord"}])
    assert tok.decode(ids).split() == ["user", ":", "the", "lord", "assistant", ":"]


# ----- shards, manifest, resume ---------------------------------------------------------------------------
def test_write_and_read_shard_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    for vocab in (300, 100_000):                      # uint16 and int32 storage
        seqs = [rng.integers(0, vocab, n).tolist() for n in (3, 10, 1)]
        masks = [rng.integers(0, 2, len(s)).tolist() for s in seqs]
        path = tmp_path / f"shard_{vocab}.npz"
        corpus.write_shard(path, seqs, masks, [0, 1, 2], vocab)
        got_seqs, got_masks = corpus.read_shard(path)
        assert [s.tolist() for s in got_seqs] == seqs
        assert [m.tolist() for m in got_masks] == [[bool(x) for x in m] for m in masks]
        assert got_seqs[0].dtype == np.int64 and got_masks[0].dtype == bool
    with pytest.raises(ValueError, match="mask of 2"):
        corpus.write_shard(tmp_path / "bad.npz", [[1, 2, 3]], [[0, 1]], [0], 10)
    assert list(tmp_path.glob(".*")) == []            # no temporary left behind


def test_corpus_shards_round_trip_through_load_and_the_manifest_counts_them(target, tmp_path):
    model, tok = target
    manifest = run(model, tok, tmp_path / "c")
    assert [s["split"] for s in manifest["shards"]] == ["train", "heldout", "train"]
    assert (tmp_path / "c" / "train" / "shard_00001.npz").exists()
    assert (tmp_path / "c" / "heldout" / "shard_00000.npz").exists()
    assert json.loads((tmp_path / "c" / "manifest.json").read_text()) == manifest
    for split in data.SPLITS:
        c = corpus.load(tmp_path / "c", split)
        counts = manifest["counts"][split]
        assert counts["sequences"] == len(c) == len(c.masks) == len(c.records)
        assert counts["response_tokens"] == sum(int(m.sum()) for m in c.masks)
        assert counts["prompt_tokens"] == sum(int((~m).sum()) for m in c.masks)
        assert counts["followups"] == sum(r["turns"] == 2 for r in c.records) > 0
        direct = [s for sh in manifest["shards"] if sh["split"] == split
                  for s in corpus.read_shard(tmp_path / "c" / sh["file"])[0]]
        assert all(np.array_equal(a, b) for a, b in zip(direct, c.sequences))
        # every batch: `batch` prompts; greedy and sampled (seeded) batches both present
        temps = {r["temperature"] for r in c.records}
        assert temps == {0.0, SETTINGS.temperature}
        assert all(r["seed"] is not None for r in c.records if r["temperature"] > 0)
    sizes = [b["size"] for s in manifest["shards"] for b in s["batches"]]
    assert set(sizes) == {SETTINGS.batch}
    # the manifest says which documents each split holds: disjoint
    docs = manifest["splits"]
    for source in data.SOURCES:
        assert not set(docs["train"]["documents"].get(source, [])) & set(
            docs["heldout"]["documents"].get(source, []))
    assert {r["doc"] for r in corpus.load(tmp_path / "c", "heldout").records} <= {
        d["name"] for s in data.SOURCES for d in fake_documents(s, "heldout")}
    assert manifest["target"]["sha256"] == "ab" * 32
    assert manifest["throughput"]["response_tokens_per_s"] > 0


def test_response_mask_marks_exactly_the_generated_tokens(target, tmp_path):
    model, tok = target
    run(model, tok, tmp_path / "c", max_shards=1)
    prompts, _ = corpus.build_prompts("train", SETTINGS.seed, documents=fake_documents)
    c = corpus.load(tmp_path / "c", "train")
    first = {r["prompt"]: (s, m) for s, m, r in zip(c.sequences, c.masks, c.records)
             if r["turns"] == 1}
    assert any(r["turns"] == 2 for r in c.records)
    for seq, mask, rec in zip(c.sequences, c.masks, c.records):
        n = int(mask.sum())
        assert n >= 1 and mask[-n:].all() and not mask[:-n].any()     # a suffix
        prompt, response = seq[:-n].tolist(), seq[-n:].tolist()
        p = prompts[rec["prompt"]]
        messages = [{"role": "user", "content": p.user}]
        if rec["turns"] == 2:      # after the target's first answer, a second user turn
            s1, m1 = first[rec["prompt"]]
            messages += [{"role": "assistant",
                          "content": tok.decode(s1[m1].tolist(), skip_special_tokens=True)},
                         {"role": "user", "content": p.followup}]
        assert prompt == corpus.render(tok, messages)
        assert response[-1] == tok.eos_token_id or n == SETTINGS.max_new_tokens
        assert tok.eos_token_id not in response[:-1]
        if rec["temperature"] == 0:                   # greedy: the target's own tokens
            alone = corpus.generate_batch(model, [prompt], SETTINGS.max_new_tokens,
                                          pad_token_id=1, eos_token_id=tok.eos_token_id)[0]
            assert response[:4] == alone[:4]


def test_resumed_run_gives_the_same_corpus_as_an_uninterrupted_one(target, tmp_path):
    model, tok = target
    run(model, tok, tmp_path / "whole", max_shards=3)
    run(model, tok, tmp_path / "resumed", max_shards=1)
    assert len(corpus.read_manifest(tmp_path / "resumed")["shards"]) == 1
    run(model, tok, tmp_path / "resumed", max_shards=2)
    same_corpus(tmp_path / "whole", tmp_path / "resumed")
    # --tokens: a rerun with a reached target adds nothing
    done = corpus.read_manifest(tmp_path / "whole")["counts"]["train"]["response_tokens"]
    m = run(model, tok, tmp_path / "whole", tokens=done, max_shards=None)
    assert len(m["shards"]) == 3


def test_resume_refuses_other_settings_or_target(target, tmp_path):
    model, tok = target
    run(model, tok, tmp_path / "c", max_shards=1)
    other = dataclasses.replace(SETTINGS, max_new_tokens=SETTINGS.max_new_tokens + 1)
    with pytest.raises(ValueError, match=f"--max-new-tokens {SETTINGS.max_new_tokens + 1}"):
        corpus.generate_corpus(model, tok, tmp_path / "c", 10 ** 9, other,
                               documents=fake_documents, progress=False,
                               provenance={"sha256": "ab" * 32})
    with pytest.raises(ValueError, match="--target"):
        corpus.generate_corpus(model, tok, tmp_path / "c", 10 ** 9, SETTINGS,
                               documents=fake_documents, progress=False,
                               provenance={"sha256": "cd" * 32})


def test_resume_may_change_the_batch_schedule_and_each_shard_records_its_own(target, tmp_path):
    model, tok = target
    run(model, tok, tmp_path / "c", max_shards=2)            # a train and a held-out shard
    wider = dataclasses.replace(SETTINGS, batch=SETTINGS.batch + 2, batches_per_shard=1)
    m = corpus.generate_corpus(model, tok, tmp_path / "c", 10 ** 9, wider, max_shards=1,
                               documents=fake_documents, progress=False,
                               provenance={"sha256": "ab" * 32})
    first, _, second = m["shards"]
    assert first["split"] == second["split"] == "train"
    assert (first["batch"], first["batches_per_shard"]) == (SETTINGS.batch,
                                                            SETTINGS.batches_per_shard)
    assert (second["batch"], second["batches_per_shard"]) == (SETTINGS.batch + 2, 1)
    assert [b["size"] for b in second["batches"]][0] == SETTINGS.batch + 2
    # the second shard starts where the first stopped: no prompt is used twice
    assert second["prompt_range"][0] == first["prompt_range"][1]
    assert len(corpus.load(tmp_path / "c")) == len(first["sequences"]) + len(second["sequences"])


def test_a_crash_mid_shard_leaves_the_manifest_intact_and_the_rerun_completes(
        target, tmp_path, monkeypatch):
    model, tok = target
    out = tmp_path / "c"
    run(model, tok, out, max_shards=1)
    before = (out / "manifest.json").read_text()
    real = np.savez_compressed

    def killed(f, **arrays):           # half a file, then the process "dies"
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt
    monkeypatch.setattr(np, "savez_compressed", killed)
    with pytest.raises(KeyboardInterrupt):
        run(model, tok, out, max_shards=1)
    monkeypatch.setattr(np, "savez_compressed", real)
    assert list(out.glob("*/.shard_*.tmp-*"))                 # the temporary is left behind
    assert (out / "manifest.json").read_text() == before      # the manifest is untouched
    assert len(corpus.load(out, "train")) > 0
    # a shard renamed but never listed (killed before the manifest was rewritten) is ignored
    (out / "heldout").mkdir(exist_ok=True)
    (out / "heldout" / "shard_00000.npz").write_bytes(b"garbage")
    run(model, tok, out, max_shards=2)
    assert not list(out.glob("*/.*.tmp-*"))
    run(model, tok, tmp_path / "whole", max_shards=3)
    same_corpus(out, tmp_path / "whole")


# ----- the command line ----------------------------------------------------------------------------------
@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "tiny-target"
    tok = tiny_tokenizer()
    tiny_target(vocab=len(tok), eos_token_id=1).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_data_generate_command_writes_and_resumes_a_corpus(checkpoint, tmp_path, monkeypatch,
                                                           capsys):
    monkeypatch.setattr(data, "documents", fake_documents)
    argv = ["data", "generate", "--out", str(tmp_path / "c"), "--tokens", "1", "--batch", "4",
            "--max-new-tokens", "8", "--max-seq-len", "256", "--batches-per-shard", "1",
            "--threads", "1", "--target", str(checkpoint)]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    done = report["counts"]["train"]["response_tokens"]
    assert done >= 1 and report["shards"] == 1
    manifest = corpus.read_manifest(tmp_path / "c")
    assert manifest["target"]["sha256"]                    # of the folder's weights
    assert cli.main(argv[:5] + [str(done + 1)] + argv[6:]) == 0      # resumes: one more shard
    report = json.loads(capsys.readouterr().out)
    assert report["counts"]["train"]["response_tokens"] > done and report["shards"] == 2
    assert cli.main(argv[:9] + ["9"] + argv[10:]) == 1            # resume with other settings
    assert "--max-new-tokens 9" in capsys.readouterr().err


RECIPE_FLAGS = {"dflash": ["--block-size", "4", "--blocks", "4", "--eval-blocks", "4",
                           "--layers", "1"],
                "eagle3": ["--window", "64", "--ttt-steps", "2"],
                "pard": ["--window", "64", "--layers", "1", "--draft-tokens", "3"],
                "longspark": ["--blocks", "4", "--eval-blocks", "4", "--window", "32",
                              "--summary", "4", "--rank", "4"]}


@pytest.mark.parametrize("drafter", sorted(RECIPE_FLAGS))
def test_train_with_online_features_equals_training_on_the_cache(drafter, checkpoint, tmp_path,
                                                                  monkeypatch, capsys):
    """`--online-features` (the GPU path: target forwards per step, nothing on disk) gives the
    very losses and held-out metrics of the cached run with the same seed."""
    monkeypatch.setattr(data, "documents", fake_documents)
    monkeypatch.setenv("SHARPDRAFT_HOME", str(tmp_path / "home"))
    gen = ["data", "generate", "--out", str(tmp_path / "c"), "--tokens", "97", "--batch", "4",
           "--max-new-tokens", "8", "--max-seq-len", "256", "--batches-per-shard", "2",
           "--heldout-every", "2", "--threads", "1", "--target", str(checkpoint)]
    assert cli.main(gen) == 0
    capsys.readouterr()
    runs = {}
    for name, extra in (("cached", []), ("online", ["--online-features"])):
        out = tmp_path / name
        argv = ["train", drafter, "--out", str(out), "--corpus", str(tmp_path / "c"),
                "--target", str(checkpoint), "--steps", "12", "--eval-every", "3",
                "--draft-vocab", "0", "--seq-len", "128", "--threads", "1", "--device", "cpu",
                *RECIPE_FLAGS[drafter], *extra]
        assert cli.main(argv) == 0
        runs[name] = json.loads((out / "training.json").read_text())
        logs = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
        runs[name]["log"] = [r for r in logs if "loss" in r]
    assert runs["online"]["train_data"].get("online") is True
    assert [r["loss"] for r in runs["online"]["log"]] == [r["loss"] for r in runs["cached"]["log"]]
    def strip(evals):
        return [{k: v for k, v in e.items() if k != "elapsed_s"} for e in evals]
    assert len(runs["cached"]["evals"]) >= 4 and len(runs["cached"]["log"]) == 2
    assert strip(runs["online"]["evals"]) == strip(runs["cached"]["evals"])
    # the cached run's two splits are the only cache folders: the online run stored nothing
    assert len(list((tmp_path / "home" / "train_cache").iterdir())) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("command", [["train", "dflash", "--out", "x"],
                                     ["data", "generate", "--out", "x", "--tokens", "5"]])
def test_device_that_is_not_here_is_refused_naming_the_flag(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(command + ["--device", "cuda"])
    assert exc.value.code == 2 and "--device cuda" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--tokens", "0"), ("--batch", "0"),
                                         ("--max-new-tokens", "0"), ("--threads", "0"),
                                         ("--batches-per-shard", "0"), ("--max-seq-len", "0"),
                                         ("--heldout-every", "1"), ("--top-p", "0"),
                                         ("--temperature", "0"), ("--max-new-tokens", "2000")])
def test_data_generate_rejects_bad_values_naming_the_flag(flag, value, capsys):
    argv = ["data", "generate", "--out", "x", "--tokens", "5"]
    if flag == "--tokens":
        argv = argv[:-2]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv + [flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


# ----- what reads the corpus: held-out bench prompts, the training feature cache -----------------
def test_bench_corpus_prompts_are_heldout_first_turns_without_their_response(target, tmp_path):
    from sharpdraft.eval.bench import corpus_prompts
    model, tok = target
    run(model, tok, tmp_path / "c")
    held = corpus.load(tmp_path / "c", "heldout")
    prompts = corpus_prompts(tmp_path / "c", 3)
    assert len(prompts) == 3 and {p["kind"] for p in prompts} == {"corpus"}
    firsts = {tuple(s[:int(m.argmax())].tolist()) for s, m, r in
              zip(held.sequences, held.masks, held.records) if r["turns"] == 1}
    assert all(tuple(p["ids"][0].tolist()) in firsts for p in prompts)
    kinds = [p["name"].rsplit("-", 1)[0] for p in prompts]
    assert len(set(kinds)) == min(3, len({f"{r['source']}/{r['kind']}" for r in held.records
                                          if r["turns"] == 1}))      # sources taken in turn
    with pytest.raises(FileNotFoundError):
        corpus_prompts(tmp_path / "missing", 1)


def test_training_cache_of_a_corpus_trains_on_responses_only(target, tmp_path):
    from sharpdraft.training import cache as tc
    model, tok = target
    run(model, tok, tmp_path / "c")
    train = corpus.load(tmp_path / "c", "train")
    seqs, trained, meta = tc.corpus_sequences(tmp_path / "c", "train", 10 ** 9, 40)
    assert len(seqs) == len(train)
    assert meta["response_tokens"] == sum(int(m[-40:].sum()) for m in train.masks)
    for s, t, full, m in zip(seqs, trained, train.sequences, train.masks):
        assert s == full[-40:].tolist()             # the last max_len tokens: the response
        # row r is trained exactly when token r + 1 is a response token
        assert t == [bool(x) for x in m[-40:][1:]] + [False]
    few, _, meta_few = tc.corpus_sequences(tmp_path / "c", "train", 1, 40)
    assert len(few) == 1 and meta_few["response_tokens"] >= 1


@pytest.mark.parametrize("spread", [0.5, 6.0], ids=["flat-nucleus-past-64", "peaked"])
def test_nucleus_sampling_draws_from_exactly_the_nucleus(spread):
    """sample_next's draws follow the renormalised nucleus of softmax(logits / T) (the smallest
    top set reaching top_p), whether the nucleus fits its 64 candidates or needs the full sort."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(200, generator=g, dtype=torch.float64) * spread
    T, top_p, n = 0.7, 0.8, 20000
    p = torch.softmax(base / T, -1)
    sp, order = p.sort(descending=True)
    size = int((sp.cumsum(-1) - sp < top_p).sum())            # smallest set reaching top_p
    want = torch.zeros_like(p)
    want[order[:size]] = sp[:size] / sp[:size].sum()
    assert (size > 64) == (spread < 1.0)
    draws = corpus.sample_next(base.float().expand(n, -1), T, top_p,
                               torch.Generator().manual_seed(1))
    freq = torch.bincount(draws, minlength=200).double() / n
    assert float(freq[want == 0].sum()) == 0.0                # nothing outside the nucleus
    assert float((freq - want).abs().max()) < 4 * math.sqrt(float(want.max()) / n) + 1e-3


def test_resume_on_a_machine_with_other_documents_skips_what_the_corpus_holds(target, tmp_path,
                                                                               capsys):
    """A corpus resumed where the documentation differs goes on with that machine's prompt set
    and never repeats a first turn it holds; the change is said and recorded."""
    model, tok = target
    run(model, tok, tmp_path / "c", max_shards=2)

    def other_documents(source, split):        # one more document on the second machine
        docs = fake_documents(source, split)
        if source == "compose":
            docs = docs + [{"source": "compose", "name": f"X{split}", "text": "the night"}]
        return docs
    before = corpus.read_manifest(tmp_path / "c")
    m = corpus.generate_corpus(model, tok, tmp_path / "c", 10 ** 9, SETTINGS,
                               documents=other_documents, max_shards=2, progress=False,
                               provenance={"source": "tiny", "sha256": "ab" * 32})
    assert "prompt set differs" in capsys.readouterr().err
    new = m["shards"][2:]
    assert {sh["prompt_set"] for sh in new} == {
        corpus.prompts_digest(corpus.build_prompts(sh["split"], 0, documents=other_documents)[0])
        for sh in new}
    for split in data.SPLITS:                                # no first turn twice
        firsts = [r["key"] for sh in m["shards"] if sh["split"] == split
                  for r in sh["sequences"] if r["turns"] == 1]
        assert len(firsts) == len(set(firsts))
    held = {(sh["split"], r["key"]) for sh in before["shards"] for r in sh["sequences"]}
    assert not held & {(sh["split"], r["key"]) for sh in new for r in sh["sequences"]}
    assert {h["split"] for h in m["prompt_set_history"]} == {sh["split"] for sh in new}
