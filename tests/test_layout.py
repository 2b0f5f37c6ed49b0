"""The package's shape: the layer rule (a lower layer never imports a higher one), optional
extras imported only where used, and the public API at the package root."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sharpdraft
from sharpdraft_helpers import tiny_drafter, tiny_eagle3, tiny_target

PKG = Path(sharpdraft.__file__).resolve().parent

# Lowest first. Modules at the package root other than these (small shared helpers) sit at the
# bottom with `attention`; the root __init__ (the public API) may import anything.
LAYERS = ["attention", "target", "drafters", "inference", "data", "training", "eval",
          "integrations", "cli"]


def _layer(module: str) -> int:
    """Layer index of a dotted module name inside sharpdraft ("sharpdraft.x.y" -> layer of x)."""
    parts = module.split(".")
    if len(parts) < 2:
        return len(LAYERS)                      # the root package: the public API, the top
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else 0


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(imported sharpdraft module, line) for every import in the file, relative ones resolved;
    `from pkg import name` counts as pkg.name where pkg.name is a module or package."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "sharpdraft":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "sharpdraft":
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                rel = Path(*sub.split(".")[1:])
                is_module = (PKG / rel).is_dir() or (PKG / rel).with_suffix(".py").is_file()
                yield (sub if is_module else mod), node.lineno


def test_layer_rule_holds_for_every_module():
    violations = []
    for path in sorted(PKG.rglob("*.py")):
        here = _module_name(path)
        if here == "sharpdraft":
            continue
        for mod, line in _imports(path):
            if _layer(mod) > _layer(here):
                violations.append(f"{path.relative_to(PKG)}:{line} ({here}) imports {mod}")
    assert not violations, "a lower layer imports a higher one:\n" + "\n".join(violations)


def test_layer_checker_sees_a_violation(tmp_path):
    """The checker itself: an upward import written into a temporary module is reported."""
    probe = PKG / "target" / "_layout_probe.py"
    probe.write_text("from ..inference import engine\nfrom .. import cli\n")
    try:
        found = [mod for mod, _ in _imports(probe)]
    finally:
        probe.unlink()
    assert found == ["sharpdraft.inference.engine", "sharpdraft.cli"]
    assert all(_layer(m) > _layer("sharpdraft.target._layout_probe") for m in found)


OPTIONAL = ("matplotlib", "psutil")     # the plotting / memory-sampling extras


def test_optional_extras_are_imported_only_inside_functions():
    """matplotlib and psutil are optional: no module imports them at load time (module level,
    or class level)."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body] + [n for c in tree.body if isinstance(c, ast.ClassDef)
                                        for n in c.body]
        for node in top:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in OPTIONAL for n in names):
                found.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not found, "optional extras imported at load time: " + ", ".join(found)


@pytest.mark.parametrize("module", ["sharpdraft", "sharpdraft.cli"])
def test_importing_the_api_or_the_cli_loads_no_plotting(module):
    """(psutil cannot be checked this way: transformers imports it itself where installed.)"""
    code = f"import sys, {module}; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_public_api_names():
    assert set(sharpdraft.__all__) >= {"load_target", "load_drafter", "generate", "SharpConfig",
                                       "__version__"}
    assert sharpdraft.__version__.count(".") >= 2


def test_generate_matches_target_only_greedy_decoding():
    """`generate` with a drafter (chain and tree) gives the target-only greedy tokens; those are
    checked against an independent argmax loop over the Hugging Face forward."""
    target = tiny_target()
    ids = torch.randint(1, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    want, seq = [], ids
    with torch.no_grad():
        for _ in range(12):
            tok = int(target(seq).logits[0, -1].argmax())
            want.append(tok)
            seq = torch.cat([seq, torch.tensor([[tok]])], dim=1)
    assert sharpdraft.generate(target, None, ids, max_new_tokens=12).tokens == want
    chain = sharpdraft.generate(target, tiny_drafter(target), ids, max_new_tokens=12)
    assert chain.tokens == want
    tree = sharpdraft.generate(target, tiny_eagle3(target), ids, max_new_tokens=12, tree=True)
    assert tree.tokens == want


def test_generate_refuses_bad_arguments_by_name():
    target = tiny_target()
    ids = torch.randint(1, 256, (1, 8))
    with pytest.raises(ValueError, match="^prompt"):
        sharpdraft.generate(target, None, "text without a tokenizer")
    with pytest.raises(ValueError, match="tree"):
        sharpdraft.generate(target, tiny_drafter(target), ids, tree=True)


def test_load_drafter_round_trip_and_sharp_defaults(tmp_path):
    """A saved drafter loads back by folder (kind detected from its config) with the same
    weights; SharpDraft defaults to slope 0.2 at n_ref = the training context; sharp=False is
    the frozen drafter; a bad option is refused by name."""
    target = tiny_target()
    saved = tiny_drafter(target)
    saved.save(tmp_path / "d")
    d = sharpdraft.load_drafter(tmp_path / "d", target)
    assert type(d) is type(saved)
    for (k, a), (_, b) in zip(saved.state_dict().items(), d.state_dict().items()):
        assert torch.equal(a, b), k
    assert (d.sharp.mode, d.sharp.slope, d.sharp.n_ref) == ("fixed_slope", 0.2,
                                                             saved.config.train_context)
    frozen = sharpdraft.load_drafter(tmp_path / "d", target, sharp=False, n_ref=77)
    assert (frozen.sharp.mode, frozen.sharp.n_ref) == ("none", 77)
    with pytest.raises(ValueError, match="tree_topk"):
        sharpdraft.load_drafter(tmp_path / "d", target, overrides={"tree_topk": 2})
    with pytest.raises(FileNotFoundError, match="no-such"):
        sharpdraft.load_drafter(tmp_path / "no-such", target)


def test_load_drafter_tree_overrides_reach_the_drafter(tmp_path):
    target = tiny_target()
    tiny_eagle3(target).save(tmp_path / "e")
    e = sharpdraft.load_drafter(tmp_path / "e", target, overrides={"tree_tokens": 5})
    assert e.max_tree_nodes == 5 and e.tree_shape()["tree_tokens"] == 5
