"""The drafter registry: every kind builds, fits its target, drafts losslessly, and names a
training recipe the CLI can run."""
import argparse

import pytest
import torch

from sharpdraft import training
from sharpdraft.drafters import registry
from sharpdraft.drafters.base import Drafter
from sharpdraft.inference.engine import autoregressive_generate, speculative_generate
from sharpdraft_helpers import TARGET_FAMILIES


class Tok:
    pad_token_id, eos_token_id, unk_token_id = None, 1, None
    vocab_size = 256

    def __len__(self):
        return 256


@pytest.mark.parametrize("family", sorted(TARGET_FAMILIES))
@pytest.mark.parametrize("name", registry.names())
def test_every_kind_builds_an_untrained_drafter_that_fits_and_is_lossless(name, family):
    """On Llama, Qwen3 (q/k norms) and Qwen2 (q/k/v biases) targets alike."""
    target = TARGET_FAMILIES[family]()
    kind = registry.get(name)
    if family != "llama" and name in ("pard", "longspark"):   # started from the Llama layers
        with pytest.raises(ValueError, match=f"target model_type '{family}': the "):
            registry.build_untrained(name, target, Tok(), layers=2, block_size=4, seed=3)
        return
    d = registry.build_untrained(name, target, Tok(), layers=2, block_size=4, seed=3)
    assert isinstance(d, kind.cls) and isinstance(d, Drafter) and not d.training
    assert d.target_problems(target) == []
    again = registry.build_untrained(name, target, Tok(), layers=2, block_size=4, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(),
                                                 again.state_dict().values()))  # seeded
    prompt = torch.tensor([[5, 9, 14, 3, 7, 22, 8]])
    assert (speculative_generate(target, d, prompt, 10).tokens
            == autoregressive_generate(target, prompt, 10).tokens)


@pytest.mark.parametrize("name", [n for n in registry.names() if registry.get(n).trainable])
def test_every_trainable_kind_names_a_recipe_with_the_shared_options(name):
    module = training.recipe(name)
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    args = p.parse_args(["--out", "x", "--corpus", "c", "--max-minutes", "1"])
    assert args.corpus == "c" and args.max_minutes == 1.0 and callable(module.main)


def test_unknown_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown drafter 'medusa'.*dflash"):
        registry.get("medusa")
    with pytest.raises(ValueError, match="unknown drafter"):
        training.recipe("medusa")
    with pytest.raises(ValueError, match="'zlab-dflash' has no training recipe; trainable: dflash"):
        training.recipe("zlab-dflash")


def test_tree_flag_follows_the_drafter_class():
    assert [n for n in registry.names() if registry.get(n).trees] == ["eagle3", "specforge-eagle3"]
