"""Training drafters by distillation from their target (`sharpdraft train <drafter>`).

- `cache`: the feature cache (target forwards computed once per sequence, memory-mapped) over
  the self-distilled corpus or packed raw text;
- `losses`: soft cross-entropy against the target's top-k distributions, the draft vocabulary,
  the feature scale;
- `loop`: the shared options, data loading, optimisation loop (`fit`) and the one `main` of
  every recipe (`Recipe`, `run_recipe`);
- `common`: data helpers the recipes share (anchors, windows, cache columns);
- one recipe module per drafter (`dflash`, `eagle3`, `pard`, `longspark`), each a `RECIPE`
  (`loop.Recipe`: how to build its drafter, its loss and its evaluation, plus the hooks the
  evaluations read) with `add_arguments(parser)` and `main(args)`, named by the drafter registry
  (`drafters.registry`).
"""


def recipe(name: str):
    """The training recipe module of drafter kind `name`.

    Raises:
        ValueError: no such drafter kind, or a kind without a training recipe (a public format).
    """
    import importlib

    from ..drafters import registry

    kind = registry.get(name)
    if not kind.trainable:
        trainable = [n for n in registry.names() if registry.get(n).trainable]
        raise ValueError(f"drafter {name!r} has no training recipe; trainable: "
                         f"{', '.join(trainable)}")
    return importlib.import_module(kind.recipe)


def recipe_of(drafter):
    """The `loop.Recipe` of `drafter`'s kind (`drafters.registry.kind_of`), whose hooks
    (`anchor_leads`, `walk_evaluate`) replay the recipe's teacher-forced drafting.

    Raises:
        ValueError: the drafter's class is not a registered kind.
    """
    from ..drafters import registry

    return recipe(registry.kind_of(drafter).name).RECIPE
