"""The target model: loading it offline (`loading`), and running it at its hardware floor for
speculative decoding (`runtime.TargetRuntime.prepare`: a prepared copy of the model over a
preallocated `kv_cache`, its `linears` run by a `plan.RuntimePlan`; `precision` holds the
measured dtype rules).

Layer: above `sharpdraft.attention` and `sharpdraft_ext`; below drafters, inference and the rest.
"""
from .kv_cache import PreallocatedCache, PreallocatedLayer
from .linears import LINEAR_PATHS, PANEL_MAX_ROWS, ROW_REGIMES, PackedLinear, plan_linears
from .loading import load_target, resolve_target
from .precision import choose_autocast, choose_dtype
from .plan import RuntimePlan, auto_plan, measured_plan
from .runtime import TargetRuntime, captured_hidden_states, prepare_drafter

__all__ = ["LINEAR_PATHS", "PANEL_MAX_ROWS", "ROW_REGIMES", "PackedLinear", "PreallocatedCache",
           "PreallocatedLayer", "RuntimePlan", "TargetRuntime", "auto_plan",
           "captured_hidden_states", "choose_autocast", "choose_dtype", "load_target",
           "measured_plan", "plan_linears", "prepare_drafter", "resolve_target"]
