"""sharpdraft.settings: every SHARPDRAFT_* variable declared once and read through it, values
parsed with one-line errors naming the variable; the SharpDraft defaults in one place
(sharpdraft_ext.defaults), mirrored by the C++ SharpParams and used by every API default."""
import inspect
import re
from pathlib import Path

import pytest

from sharpdraft import settings

ROOT = Path(__file__).resolve().parent.parent
# names that look like variables but are not (a C preprocessor macro)
NOT_VARIABLES = {"SHARPDRAFT_PY_MODULE"}


def _sources(*patterns):
    for pattern in patterns:
        for path in ROOT.glob(pattern):
            if ".venv" not in path.parts and "results" not in path.parts and path.is_file():
                yield path


def test_every_variable_in_the_tree_is_declared():
    named = set()
    for path in _sources("python/**/*.py", "sharpdraft_ext/**/*.py", "csrc/**/*.[ch]*",
                         "scripts/*.sh", "setup.py", "benchmarks/*.py", "benchmarks/*.sh"):
        named |= set(re.findall(r"\bSHARPDRAFT_[A-Z0-9_]+\b", path.read_text(errors="replace")))
    missing = sorted(named - NOT_VARIABLES - set(settings.VARIABLES))
    assert not missing, f"not declared in sharpdraft.settings: {missing}"
    assert len(named - NOT_VARIABLES) >= 8          # the scan found the tree's variables


def test_python_reads_variables_only_through_settings():
    read = re.compile(r"""(environ\.get\(\s*|getenv\(\s*|environ\[\s*)["']SHARPDRAFT_\w+["']"""
                      r"""(?!\s*\]\s*=[^=])""")
    offenders = [str(p.relative_to(ROOT)) for p in _sources("python/**/*.py",
                                                              "sharpdraft_ext/**/*.py")
                 if p.name != "settings.py" and read.search(p.read_text())]
    assert not offenders


def test_every_variable_is_documented_and_typed():
    for var in settings.VARIABLES.values():
        assert var.read_by in ("python", "c++", "build", "scripts"), var.name
        assert len(var.doc) > 20, var.name
        assert settings.get(var.name, {}) == var.default


@pytest.mark.parametrize("name, raw, value", [
    ("SHARPDRAFT_FUSED_LAYERS", "0", False),
    ("SHARPDRAFT_FUSED_LAYERS", " on ", True),
    ("SHARPDRAFT_LINEAR_PATHS", "dense, onednn,", ("dense", "onednn")),
    ("SHARPDRAFT_VLLM_MODE", "Fixed_Slope", "fixed_slope"),
    ("SHARPDRAFT_VLLM_SLOPE", "0.35", 0.35),
    ("SHARPDRAFT_VLLM_N_REF", "512", 512),
    ("SHARPDRAFT_CPU_ISA", "AVX2", "avx2"),
    ("SHARPDRAFT_CUDA", "1", "1"),
    ("SHARPDRAFT_HOME", "~/x", Path.home() / "x"),
])
def test_values_parse(name, raw, value):
    assert settings.get(name, {name: raw}) == value


@pytest.mark.parametrize("name, raw, words", [
    ("SHARPDRAFT_FUSED_LAYERS", "maybe", ["0 or 1"]),
    ("SHARPDRAFT_LINEAR_PATHS", " , ", ["at least one"]),
    ("SHARPDRAFT_VLLM_MODE", "sharp", ["fixed_slope"]),
    ("SHARPDRAFT_VLLM_SLOPE", "nan", ["finite"]),
    ("SHARPDRAFT_VLLM_SLOPE", "-inf", ["finite"]),
    ("SHARPDRAFT_VLLM_N_REF", "2.5", [">= 1"]),
    ("SHARPDRAFT_VLLM_N_REF", "0", [">= 1"]),
    ("SHARPDRAFT_CPU_ISA", "sse2", ["avx512"]),
    ("SHARPDRAFT_CUDA", "yes", ["auto"]),
])
def test_bad_values_name_the_variable(name, raw, words):
    with pytest.raises(ValueError) as err:
        settings.get(name, {name: raw})
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{name}=")
    assert all(w in message for w in words)


def test_unknown_name_is_refused():
    with pytest.raises(KeyError):
        settings.get("SHARPDRAFT_NOPE")


def test_home_falls_back_to_xdg_then_home():
    assert settings.sharpdraft_home({"SHARPDRAFT_HOME": "/a/b"}) == Path("/a/b")
    assert settings.sharpdraft_home({"XDG_CACHE_HOME": "/c"}) == Path("/c/sharpdraft")
    assert settings.sharpdraft_home({}) == Path.home() / ".cache" / "sharpdraft"


def test_vllm_modes_are_the_kernel_modes():
    from sharpdraft.attention import MODES

    parse = settings.VARIABLES["SHARPDRAFT_VLLM_MODE"].parse
    for mode in ("off",) + MODES:
        assert parse(mode) == mode
    with pytest.raises(ValueError) as err:
        parse("x")
    assert set(re.findall(r"\w+", str(err.value).split("one of")[1])) == {"off", *MODES}


def test_docs_page_lists_every_variable():
    assert settings.describe() in (ROOT / "docs" / "settings.md").read_text()


def test_defaults_in_one_place():
    """The C++ SharpParams, SharpConfig and the kernel API default to sharpdraft_ext.defaults."""
    import sharpdraft_ext as ext
    from sharpdraft import SharpConfig
    from sharpdraft_ext import defaults

    header = next(ROOT.glob("csrc/**/sharp_params.h")).read_text()
    cpp = {name: float(v) for name, v in re.findall(
        r"(slope|n_ref|topk|contrast) = ([0-9.]+);", header)}
    assert cpp == {"slope": defaults.DEFAULT_SLOPE, "n_ref": defaults.DEFAULT_N_REF,
                   "topk": defaults.DEFAULT_TOPK, "contrast": defaults.DEFAULT_CONTRAST}
    cfg = SharpConfig()
    assert (cfg.slope, cfg.n_ref, cfg.topk, cfg.contrast) == (
        defaults.DEFAULT_SLOPE, defaults.DEFAULT_N_REF, defaults.DEFAULT_TOPK,
        defaults.DEFAULT_CONTRAST)
    for fn in (ext.sharp_attention, ext.sharp_attention_varlen, ext.query_scale,
               ext.reference.sharp_attention_ref):
        params = inspect.signature(fn).parameters
        assert params["slope"].default == defaults.DEFAULT_SLOPE, fn.__name__
        assert params["n_ref"].default == defaults.DEFAULT_N_REF, fn.__name__
