"""Training drafters by distillation from their target (`sharpdraft train <drafter>`).

- `cache`: the feature cache (target forwards computed once per sequence, memory-mapped) over
  the self-distilled corpus or packed raw text;
- `losses`: soft cross-entropy against the target's top-k distributions, the draft vocabulary,
  the feature scale;
- `loop`: the shared options, data loading and optimisation loop (`fit`);
- one recipe module per drafter (`dflash`, `eagle3`, `pard`), each with `add_arguments(parser)`
  and `main(args)`; `RECIPES` names them.
"""
RECIPES = {"dflash": "sharpdraft.training.dflash", "eagle3": "sharpdraft.training.eagle3",
           "pard": "sharpdraft.training.pard"}


def recipe(name: str):
    """The recipe module of drafter kind `name` (a key of RECIPES)."""
    import importlib

    if name not in RECIPES:
        raise ValueError(f"no training recipe for drafter {name!r}; known: {sorted(RECIPES)}")
    return importlib.import_module(RECIPES[name])
