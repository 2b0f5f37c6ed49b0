"""The draft session protocol: what `sharpdraft.inference` calls on a drafter and on the session it
starts, as `typing.Protocol`s (runtime-checkable: `isinstance(session, DraftSession)` tells
whether the methods are there; `session_problems` also checks their parameter names and the
capabilities the drafter's flags claim).

A generation starts one session per prompt, after the target's prefill:

    session = drafter.start(target, prompt_ids, hidden_states, target_cache)

then, every step, `propose` (chain) or `propose_tree` (tree) after the last committed token, the
target verifies the drafts, and `commit` hands the session what was accepted. The arguments:

    target          the transformers causal LM drafted for (the runtime's prepared copy); the
                    drafter reads its embeddings and LM head, never changes it
    prompt_ids      (1, T) int64 token ids of the prompt
    hidden_states   {index: (1, rows, hidden) tensor} of the target's hidden states, indexed as
                    transformers' output_hidden_states (0 = embeddings, l + 1 = decoder layer l's
                    output); it holds the drafter's `hidden_layers` (a full output_hidden_states
                    tuple also works); prefill: the T prompt rows, commit: the verification rows
    target_cache    the target's KV cache after the prefill (the runtime's, or a transformers
                    Cache): a drafter may read it in place (LongSpark needs it), never writes it
    last, position  the last committed token id (int) and its position (int, 0-based: the number
                    of tokens committed before it)
    draw            draw(row) -> int: the token drawn from one row of float32 logits (target
                    vocab,) (argmax, or a sample at the generation's temperature)

The engine passes `stop_below=p` (float in (0, 1]) to `propose` only when the drafter's
`drafts_one_by_one` is True, and calls `propose_tree` only when its `drafts_trees` is True. It
passes `max_drafts=k` (0 <= k < drafter.max_drafts) only to a propose that takes it: the "auto"
draft policy (`inference.policy`) then asks for fewer drafts, or for none (a target-only step,
after which `commit` follows as usual with the one committed token); a session without it always
gets full drafts.
"""
from __future__ import annotations

import inspect
from typing import Callable, List, Mapping, Optional, Protocol, Tuple, runtime_checkable

import torch

Draw = Callable[[torch.Tensor], int]
HiddenStates = Mapping[int, torch.Tensor]


@runtime_checkable
class DraftSession(Protocol):
    """A chain-drafting session (what `drafter.start(...)` returns)."""

    def propose(self, last: int, position: int, draw: Draw,
                max_drafts: Optional[int] = None) -> Tuple[List[int], torch.Tensor]:
        """Draft after `last` (committed, at `position`; `position` is the number of committed
        positions before it); at most `max_drafts` drafts when given (0: none, and no drafter
        work beyond noting `last`; optional, see the module docstring).

        Returns:
            (drafts, logits): n <= drafter.max_drafts draft token ids (list of int) and their
            float32 logits (n, target vocab); row j - 1 is the distribution draft j was drawn
            from (`draw(row)`), given the committed tokens, `last` and drafts 1 .. j - 1.
        """

    def commit(self, accepted: List[int], hidden_states: Optional[HiddenStates]) -> None:
        """Take the verification's result: `accepted`, the tokens it committed after `last`
        (accepted drafts, then the target's own token), and `hidden_states`, the target's hidden
        states of the verification rows ([last] + drafts, or the accepted tree path), or None
        when the drafter does not read them (`needs_hidden_states` False)."""

    def state_bytes(self) -> int:
        """Bytes of the session's own state (its caches and pending features; not the weights,
        the target or the target's cache): what grows with the context."""


@runtime_checkable
class OneByOneSession(DraftSession, Protocol):
    """A session of a drafter with `drafts_one_by_one`: one drafter forward per draft."""

    def propose(self, last: int, position: int, draw: Draw, stop_below: float = 0.0,
                max_drafts: Optional[int] = None) -> Tuple[List[int], torch.Tensor]:
        """`DraftSession.propose`, stopping after the first draft whose drafter probability
        (temperature 1) is below `stop_below` (0: never), the draft at which the engine's
        draft_threshold cuts anyway, sparing the forwards after it."""


@runtime_checkable
class TreeDraftSession(DraftSession, Protocol):
    """A session of a drafter with `drafts_trees`."""

    def propose_tree(self, last: int, position: int):
        """A draft tree (`drafters.trees.DraftTree`: tokens, parents, depths, at most
        drafter.max_tree_nodes nodes, at most drafter.max_tree_depth deep) after `last`
        (committed, at `position`)."""


@runtime_checkable
class SessionDrafter(Protocol):
    """What the engine reads off a drafter: its capabilities and sizes, and `start`.

    needs_hidden_states: whether sessions read the target's hidden states. hidden_layers: the
    indices of those it reads (output_hidden_states numbering; [] when it needs none).
    max_drafts: the most drafts a chain propose returns. drafts_one_by_one: sessions take
    `stop_below`. drafts_trees: sessions have `propose_tree`; max_tree_nodes / max_tree_depth:
    the largest tree (0 for a chain-only drafter).
    """

    needs_hidden_states: bool
    hidden_layers: list
    max_drafts: int
    drafts_one_by_one: bool
    drafts_trees: bool
    max_tree_nodes: int
    max_tree_depth: int

    def start(self, target, prompt_ids: torch.Tensor, hidden_states: Optional[HiddenStates],
              target_cache=None) -> DraftSession:
        """A session after the target's prefill over `prompt_ids` (see the module docstring)."""


# the leading parameter names of each method, as the engine passes them
_PARAMETERS = {"propose": ("last", "position", "draw"), "commit": ("accepted", "hidden_states"),
               "state_bytes": (), "propose_tree": ("last", "position")}


def _parameter_problems(session, method: str, keyword: Optional[str] = None) -> List[str]:
    """How `session.method`'s parameters differ from those the engine passes."""
    params = inspect.signature(getattr(session, method)).parameters
    names = [p.name for p in params.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    want = _PARAMETERS[method]
    problems = []
    if tuple(names[:len(want)]) != want:
        problems.append(f"{method} takes ({', '.join(names)}), expected "
                        f"({', '.join(want)}{', ...' if keyword else ''})")
    required = [p.name for p in params.values() if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)][len(want):]
    if required:
        problems.append(f"{method} requires {', '.join(required)}, which the engine never passes")
    if keyword and keyword not in params:
        problems.append(f"{method} has no {keyword} keyword")
    return problems


def session_problems(drafter, session) -> List[str]:
    """Why `session` (started by `drafter`) does not follow the protocol the engine calls, one
    line per problem: a missing method (`DraftSession`, and `TreeDraftSession` when
    drafter.drafts_trees), a method whose parameters are not those the engine passes, or a
    propose without `stop_below` when drafter.drafts_one_by_one; also a drafter missing the
    `SessionDrafter` attributes. Empty when it follows it."""
    problems = []
    if not isinstance(drafter, SessionDrafter):
        missing = [a for a in _attributes(SessionDrafter) if not hasattr(drafter, a)]
        problems.append(f"{type(drafter).__name__} lacks {', '.join(missing)}")
    wanted = [DraftSession] + ([TreeDraftSession] if getattr(drafter, "drafts_trees", False)
                               else [])
    for proto in wanted:
        missing = [m for m in _attributes(proto) if not callable(getattr(session, m, None))]
        if missing:
            problems.append(f"{type(session).__name__} lacks {', '.join(missing)} "
                            f"({proto.__name__})")
    one_by_one = getattr(drafter, "drafts_one_by_one", False)
    for method in _PARAMETERS:
        if callable(getattr(session, method, None)):
            keyword = "stop_below" if method == "propose" and one_by_one else None
            problems += [f"{type(session).__name__}.{p}"
                         for p in _parameter_problems(session, method, keyword)]
    return problems


def _attributes(proto) -> List[str]:
    """The members a Protocol class declares (methods and annotated attributes)."""
    names = set(getattr(proto, "__annotations__", {}))
    for cls in proto.__mro__:
        if cls in (Protocol, object) or not getattr(cls, "_is_protocol", False):
            continue
        names |= {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
        names |= set(getattr(cls, "__annotations__", {}))
    return sorted(names)
