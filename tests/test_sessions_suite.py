"""The sessions suite (`sharpdraft.data.sessions`, `sharpdraft.eval.sessions`): conversations
rendered through the chat template, the context limit, the bootstrap by hand, and a replayed
variant equal, step for step, to a real run of it on the default target."""
import pytest

from sharpdraft.attention import SharpConfig
from sharpdraft.data import tasks
from sharpdraft.data.sessions import SESSIONS, Conversation, Session, sessions
from sharpdraft.eval import sessions as suite

pytestmark = pytest.mark.usefixtures("require_ext")


@pytest.fixture(scope="module")
def smollm2(require_smollm2):
    from sharpdraft.target import load_target
    target, tokenizer, _ = load_target(weights="auto", dtype="auto")
    return target, tokenizer


SHORT = Session("short", ("Write two sentences about the sea.", "Now two about hills.",
                          "And one about rivers."))


def test_a_conversation_is_the_chat_template_of_the_whole_history(smollm2):
    _, tok = smollm2
    conv = Conversation(tok, SHORT, 40, 8192)
    texts = ["The sea is wide.", "Hills roll.", "Rivers run."]
    answers = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    for i, a in enumerate(answers):
        nxt = conv.follow_up(i, a)
        assert (nxt is None) == (i == 2)
    history = []
    for user, text in zip(SHORT.turns, texts):
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
    want = tok.apply_chat_template(history[:-1], add_generation_prompt=True, return_dict=False)
    assert conv.transcript()[:-len(answers[-1])] == list(want)
    assert conv.contexts == [len(tok.apply_chat_template(history[:2 * i + 1],
                                                         add_generation_prompt=True,
                                                         return_dict=False))
                             for i in range(3)]


def test_the_session_ends_before_a_turn_would_pass_the_context(smollm2):
    _, tok = smollm2
    probe = Conversation(tok, SHORT, 40, 8192)
    tail = len(probe._tail("A", SHORT.turns[1]))     # an answer cut short: the tail closes it
    limit = probe.contexts[0] + 40 + tail + 40 + 32  # exactly the second turn and its answer
    conv = Conversation(tok, SHORT, 40, limit)
    answer = [5] * 40
    nxt = conv.follow_up(0, answer)
    assert nxt is not None and nxt.shape == (1, tail)
    assert conv.contexts[1] == probe.contexts[0] + 40 + tail
    assert conv.follow_up(1, answer) is None            # the third turn would not fit
    with pytest.raises(ValueError, match="session short: its first turn"):
        Conversation(tok, SHORT, 100, 60)


@pytest.mark.skipif(not tasks.LICENCES.is_dir(), reason="/usr/share/common-licenses is absent")
def test_every_session_is_built_from_held_out_text(smollm2):
    _, tok = smollm2
    built = sessions(tok)
    assert [s.name for s in built] == list(SESSIONS)
    docs, maths, reading = built
    assert (tasks.LICENCES / "Apache-2.0").read_text()[:200] in docs.turns[0]
    assert "Problem:" in maths.turns[0] and len(maths.turns) > 5
    assert reading.turns[0].count("In the beginning God created") == 1   # Genesis 1:1
    with pytest.raises(ValueError, match="--sessions: unknown"):
        sessions(tok, ["novels"])


def test_bootstrap_and_pairing_by_hand():
    tau, lo, hi = suite._bootstrap([(6, 3), (2, 2)], reps=400, seed=0)
    assert tau == pytest.approx(8 / 5) and 1.0 <= lo <= tau <= hi <= 2.0
    a = {("s", 0, 0): [3, 1], ("s", 1, 0): [2]}
    d, dlo, dhi = suite._paired(a, a, sorted(a), reps=100, seed=0)
    assert d == dlo == dhi == 0.0
    b = {("s", 0, 0): [1, 1], ("s", 1, 0): [1]}
    d, dlo, dhi = suite._paired(a, b, sorted(a), reps=400, seed=0)
    assert d == pytest.approx(6 / 3 - 1) and dlo <= d <= dhi


def test_a_replayed_variant_equals_its_real_run(smollm2, tmp_path):
    """The replay (recorded hidden states, the known answers as the target) gives the same
    acceptance, step for step, as a real timed run of the same variant; the suite's table is
    the plain ratio of those steps."""
    from sharpdraft.drafters.loading import load_drafter
    target, tok = smollm2
    frozen = load_drafter("eagle3", target, sharp=False)
    sharp = load_drafter("eagle3", target, sharp=False)
    sharp.sharp = SharpConfig(mode="fixed_slope", slope=0.4, n_ref=16)
    vs = [suite.Variant("frozen", frozen, "eagle3", real=True),
          suite.Variant("slope", sharp, "eagle3")]
    data = suite.run(target, tok, [SHORT], vs, out=tmp_path, max_new_tokens=24,
                     max_context=512)
    assert data["settings"]["replay_exact"] is True
    assert data["settings"]["same_answers_as_target_only"] is True
    real = suite.real_run(target, tok, SHORT, sharp, max_new_tokens=24, max_context=512)[0]
    import json
    part = json.loads((tmp_path / "parts" / "slope.json").read_text())["short"]
    assert [t["accept_lengths"] for t in part] == [t["accept_lengths"] for t in real]
    steps = [a for t in part for a in t["accept_lengths"]]
    row = next(r for r in data["rows"] if r["variant"] == "slope")
    assert row["tau"] == pytest.approx(sum(steps) / len(steps), abs=1e-4)
    assert row["steps"] == len(steps) and row["decode_speedup"] is None
    assert (tmp_path / "sessions.md").is_file() and (tmp_path / "sessions.png").is_file()
    with pytest.raises(ValueError, match="slope is replayed but no real variant"):
        suite.run(target, tok, [SHORT], vs[1:], out=tmp_path / "x")
    cut = suite.Variant("cut", sharp, "eagle3", draft_threshold=0.5)
    with pytest.raises(ValueError, match="cut has a draft threshold, so it must run real"):
        suite.run(target, tok, [SHORT], vs + [cut], out=tmp_path / "y")


def test_bench_suite_sessions_from_the_command_line(smollm2, tmp_path, monkeypatch, capsys):
    """`sharpdraft bench --suite sessions` (one short session here): the frozen drafter real,
    SharpDraft and a windowed row with sinks replayed, the report written."""
    import json

    from sharpdraft.cli import commands as cli
    from sharpdraft.data import sessions as data_sessions
    monkeypatch.setattr(data_sessions, "sessions", lambda tok, names: [SHORT])
    rc = cli.main(["bench", "--suite", "sessions", "--drafter", "eagle3", "--slope", "0.3",
                   "--context-window", "8", "--attention-sinks", "2", "--max-new-tokens", "16",
                   "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "sessions.json").read_text())
    labels = [v["label"] for v in data["settings"]["variants"]]
    assert labels == ["eagle3 frozen", "eagle3 slope 0.3", "eagle3 window 8+2"]
    assert data["settings"]["real"] == ["eagle3 frozen"] and data["settings"]["replay_exact"]
    assert "| eagle3 window 8+2 |" in capsys.readouterr().out
