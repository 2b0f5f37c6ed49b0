"""Training drafters by distillation from their target (`sharpdraft train <drafter>`).

- `cache`: the feature cache (target forwards computed once per sequence, memory-mapped) over
  the self-distilled corpus or packed raw text;
- `losses`: soft cross-entropy against the target's top-k distributions, the draft vocabulary,
  the feature scale;
- `loop`: the shared options, data loading and optimisation loop (`fit`);
- one recipe module per drafter (`dflash`, `eagle3`, `pard`), each with `add_arguments(parser)`
  and `main(args)`, named by the drafter registry (`drafters.registry`).
"""


def recipe(name: str):
    """The training recipe module of drafter kind `name`.

    Raises:
        ValueError: no such drafter kind.
    """
    import importlib

    from ..drafters import registry

    return importlib.import_module(registry.get(name).recipe)
