"""The target runtime's plan (sharpdraft.target.plan): the "auto" rule is a pure function of the
CPU's features and the weight (nothing timed, in preparation or in generation), "measure" is
`plan_linears`, a plan saved to a file reads back equal and prepares the same runtime, and a
bad plan file is refused with one line naming the file and the field, before any work."""
import json

import pytest
import torch

from sharpdraft.inference.batched import generate_batch
from sharpdraft.inference.engine import autoregressive_generate, speculative_generate
from sharpdraft.target import linears, plan as plans, runtime as rt
from sharpdraft.target.plan import LARGE_WEIGHT, RuntimePlan, auto_path, auto_plan
from sharpdraft.target.runtime import TargetRuntime
from sharpdraft_helpers import tiny_drafter, tiny_target

F32 = torch.float32
DECODER = [(192, 576), (576, 576), (576, 1536), (1536, 576)]
HEAD = (49152, 576)


def rule(shape, isa, paths=linears.LINEAR_PATHS, dtype=F32, onednn=True):
    return [auto_path(*shape, dtype, r, isa=isa, onednn=onednn, paths=paths) for r in range(3)]


def test_auto_rule_follows_the_linear_benchmarks():
    # AVX-512: F.linear for one row of a decoder shape, the panel kernel everywhere else
    for shape in DECODER:
        assert rule(shape, "avx512") == ["dense", "panel", "panel"], shape
    assert rule(HEAD, "avx512") == ["panel"] * 3
    # AVX2: the panel kernel at every row count
    for shape in DECODER + [HEAD]:
        assert rule(shape, "avx2") == ["panel"] * 3, shape
    # without the panel kernel: oneDNN for the head; by shape and ISA for the others
    no_panel = ("dense", "onednn")
    assert rule(HEAD, "avx512", no_panel) == rule(HEAD, "avx2", no_panel) == ["onednn"] * 3
    assert rule((1536, 576), "avx2", no_panel) == ["onednn"] * 3
    assert rule((192, 576), "avx2", no_panel) == ["dense", "onednn", "onednn"]
    assert rule((576, 576), "avx512", no_panel) == ["dense", "onednn", "onednn"]
    assert rule((192, 576), "avx512", no_panel) == ["dense"] * 3
    assert rule((576, 576), "base") == ["dense", "onednn", "onednn"]      # unmeasured panel
    assert rule(HEAD, "avx2", no_panel, onednn=False) == ["dense"] * 3
    assert rule(HEAD, "avx2", ("dense",)) == ["dense"] * 3
    assert rule(HEAD, "avx2", dtype=torch.bfloat16) == ["dense"] * 3
    assert (HEAD[0] * HEAD[1] >= LARGE_WEIGHT
            > max(o * i for o, i in DECODER))


def test_auto_plan_covers_every_cpu_linear_shape():
    target = tiny_target(seed=20)
    shapes = {(m.out_features, m.in_features, m.weight.dtype) for m in target.modules()
              if isinstance(m, torch.nn.Linear)}
    plan = auto_plan(target, isa="avx512")
    assert set(plan.linears) == shapes and plan.fused and plan.source == "auto"
    assert all(p == ("dense", "panel", "panel") for p in plan.linears.values())
    only_dense = auto_plan(target, paths=("dense",))
    assert only_dense.linears == {}                # nothing to choose: F.linear, left out


@pytest.fixture
def no_timing(monkeypatch):
    """Any timing of a linear layer fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("timed a linear layer")

    monkeypatch.setattr(linears, "interleaved_medians", refuse)
    monkeypatch.setattr(linears, "plan_linears", refuse)
    monkeypatch.setattr(plans, "plan_linears", refuse)


def test_auto_plan_times_nothing_in_preparation_or_generation(no_timing):
    target = tiny_target(seed=21)
    runtime = TargetRuntime.prepare(target)
    assert runtime.plan.source == "auto" and runtime.info["packed_linears"] > 0
    prompt = torch.arange(3, 12)[None]
    want = autoregressive_generate(target, prompt, 5).tokens
    assert autoregressive_generate(runtime, prompt, 5).tokens == want
    drafter = tiny_drafter(target)
    drafter._sharpdraft_packed = True      # drafters pack by measurement (out of scope here)
    assert speculative_generate(target, drafter, prompt, 5).tokens == want
    assert generate_batch(target, [prompt[0].tolist()], 5, pad_token_id=0,
                          eos_token_id=None) == [want]


def test_measure_is_plan_linears(monkeypatch):
    target = tiny_target(seed=22)
    measured = {(64, 64, F32): ("onednn", "panel", "dense")}
    monkeypatch.setattr(plans, "plan_linears", lambda model, paths=None: dict(measured))
    runtime = TargetRuntime.prepare(target, "measure")
    assert runtime.plan.linears == measured and runtime.plan.source == "measure"
    assert runtime.info["linear_plan"] == {"64x64 float32": ["onednn", "panel", "dense"]}
    packed = [m for m in runtime.model.modules() if isinstance(m, linears.PackedLinear)]
    assert packed and all(m.use_packed == ("onednn", "panel", "dense") for m in packed)
    unpacked = TargetRuntime.prepare(target, "measure", pack=False)      # times nothing
    assert unpacked.plan.linears == {} and unpacked.info["packed_linears"] == 0


def test_a_saved_plan_reads_back_and_prepares_the_same_runtime(tmp_path):
    target = tiny_target(seed=23)
    auto = TargetRuntime.prepare(target)
    plan = RuntimePlan({**auto.plan.linears, (48, 32, torch.bfloat16): ("dense", "onednn",
                                                                       "onednn")}, False)
    path = plan.save(tmp_path / "plans" / "tiny.json")
    assert path.exists() and [p.name for p in path.parent.iterdir()] == ["tiny.json"]
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["fused"] is False
    assert data["linears"]["48x32 bfloat16"] == ["dense", "onednn", "onednn"]
    loaded = RuntimePlan.load(path)
    assert loaded == plan and loaded.source == str(path)
    auto.plan.save(path)                                                   # overwritten
    from_file = TargetRuntime.prepare(target, str(path))
    assert from_file.plan == auto.plan and from_file.info == auto.info
    prompt = torch.arange(5, 14)[None]
    assert (autoregressive_generate(from_file, prompt, 5).tokens
            == autoregressive_generate(auto, prompt, 5).tokens)
    assert TargetRuntime.prepare(target, auto.plan).plan is auto.plan


GOOD = {"version": 1, "fused": True, "linears": {"64x64 float32": ["dense", "panel", "panel"]}}


def _edit(**fields):
    data = json.loads(json.dumps(GOOD))
    for k, v in fields.items():
        if v is KeyError:
            del data[k]
        else:
            data[k] = v
    return json.dumps(data)


@pytest.mark.parametrize("text, match", [
    (None, "cannot read the plan file"),
    ("{not json", r"not a JSON plan file \(line 1"),
    ("[1, 2]", "want a JSON object with fields version, fused, linears, got list"),
    (_edit(extra=1), "unknown field 'extra'"),
    (_edit(fused=KeyError), "missing field 'fused'"),
    (_edit(version=2), "field 'version': want 1, got 2"),
    (_edit(version=True), "field 'version': want 1"),
    (_edit(fused="yes"), "field 'fused': want true or false"),
    (_edit(linears=[]), "field 'linears': want an object"),
    (_edit(linears={"64x64": ["dense"] * 3}), "field 'linears': shape '64x64'"),
    (_edit(linears={"0x64 float32": ["dense"] * 3}), "shape '0x64 float32'"),
    (_edit(linears={"64x64 float7": ["dense"] * 3}), "shape '64x64 float7'"),
    (_edit(linears={"64x64 float32": ["dense"] * 2}), "field 'linears' '64x64 float32': want 3"),
    (_edit(linears={"64x64 float32": ["dense", "q8_0", "panel"]}),
     "field 'linears' '64x64 float32'"),
])
def test_a_bad_plan_file_is_refused_naming_file_and_field(tmp_path, monkeypatch, text, match):
    path = tmp_path / "plan.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        RuntimePlan.load(path)
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)
    # before any work: the model is never copied
    monkeypatch.setattr(rt, "shared_copy", lambda model: pytest.fail("copied the model"))
    with pytest.raises(ValueError, match=match):
        TargetRuntime.prepare(tiny_target(seed=24), path)


def test_bad_plans_in_code_name_the_field():
    with pytest.raises(ValueError, match="RuntimePlan.linears\\['64x64 float32'\\]: want 3"):
        RuntimePlan({(64, 64, F32): ("dense",)})
    with pytest.raises(ValueError, match="RuntimePlan.linears: shape"):
        RuntimePlan({(64, "64", F32): ("dense",) * 3})
    with pytest.raises(ValueError, match="RuntimePlan.fused"):
        RuntimePlan({}, fused=1)
    with pytest.raises(TypeError, match="plan: want 'auto', 'measure'"):
        TargetRuntime.prepare(tiny_target(seed=25), 42)
