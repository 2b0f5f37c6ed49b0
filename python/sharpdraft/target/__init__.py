"""The target model: loading it offline (`loading`), and running it at its hardware floor for
speculative decoding (`runtime.TargetRuntime` over a preallocated `kv_cache` and measured
`linears` plans; `precision` holds the measured dtype rules).

Layer: above `sharpdraft.attention` and `sharpdraft_ext`; below drafters, inference and the rest.
"""
from .kv_cache import PreallocatedCache, PreallocatedLayer
from .linears import LINEAR_PATHS, PANEL_MAX_ROWS, ROW_REGIMES, PackedLinear, plan_linears
from .loading import load_target, resolve_target
from .precision import choose_autocast, choose_dtype
from .runtime import TargetRuntime, captured_hidden_states, prepare_drafter, prepare_target

__all__ = ["LINEAR_PATHS", "PANEL_MAX_ROWS", "ROW_REGIMES", "PackedLinear", "PreallocatedCache",
           "PreallocatedLayer", "TargetRuntime", "captured_hidden_states", "choose_autocast",
           "choose_dtype", "load_target", "plan_linears", "prepare_drafter", "prepare_target",
           "resolve_target"]
