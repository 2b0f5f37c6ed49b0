"""The held-out task suite (`sharpdraft.data.tasks.suite`, `sharpdraft bench --suite tasks`):
categories, documents cut to a token count at a line end, held-out sources only."""
import importlib.metadata
from pathlib import Path

import pytest

from sharpdraft.data import tasks

pytestmark = pytest.mark.skipif(not tasks.LICENCES.is_dir(),
                                reason="/usr/share/common-licenses is absent on this machine")


class CharTokenizer:
    """One token per character: cuts are checkable by hand."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_documents_are_cut_at_a_line_end_within_the_token_count():
    tok = CharTokenizer()
    for size, docs in tasks.DOCUMENTS.items():
        for name, _ in docs:
            full = (tasks.LICENCES / name).read_text()
            cut = tasks.cut_document(tok, name, size)
            assert full.startswith(cut)
            assert len(cut) <= size and full[len(cut)] == "\n"
            # the cut drops at most the last (partial) line of the first `size` characters
            assert "\n" not in full[len(cut) + 1:size]


def test_a_short_text_is_kept_whole():
    text = (tasks.LICENCES / "BSD").read_text()
    assert tasks.cut_document(CharTokenizer(), "BSD", len(text) + 10) == text


def test_suite_covers_every_category_in_order():
    cats = [c for c in tasks.SUITE if c != "maths" or _champ_installed()]
    prompts = tasks.suite(CharTokenizer(), cats)
    kinds = [p["kind"] for p in prompts]
    assert kinds == sorted(kinds, key=tasks.SUITE.index) and set(kinds) == set(cats)
    names = [p["name"] for p in prompts]
    assert len(set(names)) == len(names)
    doc = next(p for p in prompts if p["name"] == "doc-4k-GPL-2")
    question = dict(tasks.DOCUMENTS[4096])["GPL-2"]
    assert doc["text"].endswith("\n\n" + question)
    assert len(doc["text"]) - len(question) - 2 <= 4096
    assert [p["text"] for p in prompts if p["kind"] == "story"] == list(tasks.CHAT)


def test_suite_names_are_the_suites_own_without_a_tokenizer():
    cats = [c for c in tasks.SUITE if c != "maths" or _champ_installed()]
    assert tasks.suite_names(cats) == [p["name"] for p in tasks.suite(CharTokenizer(), cats)]
    assert tasks.suite_names(["code", "doc-6k"]) == ["code-0", "code-1", "code-2",
                                                    "doc-6k-LGPL-2.1", "doc-6k-GPL-3"]
    assert tasks.suite_names(["maths"], maths=3) == ["maths-0", "maths-1", "maths-2"]
    with pytest.raises(ValueError, match="'poetry'"):
        tasks.suite_names(["poetry"])


def _champ_installed() -> bool:
    try:
        importlib.metadata.distribution("champ-dataset")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _champ_installed(), reason="champ-dataset is not installed")
def test_maths_prompts_are_held_out_problems():
    from sharpdraft.data import sources
    prompts = tasks.suite(CharTokenizer(), ["maths"], maths=3)
    held = [d["chat"][0] for d in sources.documents("champ", "heldout")]
    assert len(prompts) == 3 and all(p["text"] in held for p in prompts)


def test_unknown_category_is_named():
    with pytest.raises(ValueError, match="'poetry'"):
        tasks.suite(CharTokenizer(), ["story", "poetry"])


def test_no_suite_document_is_in_any_training_source():
    """The suite's texts come from /usr/share/common-licenses, which lies under no source's
    folder, and every licence text is a document that the sources' licence filter drops."""
    from sharpdraft.data import sources
    for root in (sources.DOC_ROOT, sources.MAN_ROOT):
        assert not tasks.LICENCES.resolve().is_relative_to(root)
    src = (Path(tasks.__file__).parent / "sources.py").read_text()
    assert "from .tasks" not in src and "LICENCES" not in src
    for names in tasks.DOCUMENTS.values():
        for name, _ in names:
            assert sources.quotes_a_licence((tasks.LICENCES / name).read_text())
