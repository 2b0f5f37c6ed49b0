"""SharpDraft inside vLLM's own speculative decoding: a vLLM general plugin.

vLLM drafts with DFlash (``method "dflash"``), EAGLE-3 (``"eagle3"``) and PARD (``"draft_model"``
with ``parallel_drafting``) through its own proposers, paged KV cache and attention backends.
This plugin multiplies each of the *drafter's* query rows by beta(n_i), SharpDraft's
cardinality-aware query scale, before vLLM's attention backend runs; the target's attention is
never touched. Switched on by one environment variable::

    SHARPDRAFT_VLLM_MODE=fixed_slope python serve.py     # or: none, exact_topk; unset/off: no-op

and tuned by two more: ``SHARPDRAFT_VLLM_SLOPE`` (lambda, a finite float; default: the drafter's
calibrated ``sharp_slopes`` from its config.json, else 0.2) and ``SHARPDRAFT_VLLM_N_REF`` (the
reference cardinality, an int >= 1; default: the drafter's ``train_context`` from its
config.json, else 2048). Mode ``none`` installs the hook with beta = 1: the drafts are vLLM's own.

The maths (docs/spec.md, the paper): sharp attention is softmax(beta_i * scale * q_i . k_j) v,
so scaling q_i by beta_i before any attention kernel gives sharp attention exactly (up to the
rounding of q_i * beta_i in q's dtype). n_i is counted from vLLM's attention metadata, per token
of the batch: a causal row at position i of a request with query length L and sequence length S
sees S - L + i + 1 keys; a non-causal row (DFlash's block) sees all S keys, i.e. the context keys
vLLM wrote plus the whole block; a sliding window caps the count. beta_i is computed by
`sharpdraft_ext.query_scale` (the kernel's own code) on CPU and by its float64 reference
(`sharpdraft_ext.reference.query_scale_ref`, no host synchronisation) on CUDA.

Why this lever (docs/vllm.md): all three proposers load their drafter through
`SpecDecodeBaseProposer.load_model`, which also names the drafter's attention layers
(``_draft_attn_layer_names``). The plugin wraps that method and, after it, the ``forward`` of
those layers' backend implementations, whichever backend vLLM chose (CPU_ATTN on CPU;
FlashAttention, FlashInfer, Triton... on CUDA). The two other levers fail on one path: vLLM's CPU platform
ignores a drafter-only ``attention_backend`` (it always returns CPU_ATTN), and PARD's drafter
is a plain LlamaForCausalLM / Qwen3ForCausalLM, the target's own class, so replacing draft
model classes in the registry would change the target too.

Sources: vLLM 0.32 (vllm/plugins, vllm/v1/spec_decode/llm_base_proposer.py,
vllm/v1/attention/backends/cpu_attn.py and flash_attn.py, vllm/model_executor/layers/attention).
"""
from __future__ import annotations

import logging
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

import sharpdraft_ext as ext
from sharpdraft_ext.defaults import DEFAULT_SLOPE
from sharpdraft import settings
from sharpdraft.drafters.config_checks import DEFAULT_TRAIN_CONTEXT

ENV_MODE = "SHARPDRAFT_VLLM_MODE"
ENV_SLOPE = "SHARPDRAFT_VLLM_SLOPE"
ENV_N_REF = "SHARPDRAFT_VLLM_N_REF"
OFF = "off"

logger = logging.getLogger("vllm.sharpdraft")     # a child of vLLM's logger: printed with it


@dataclass(frozen=True)
class PluginSettings:
    """The plugin's settings, read from the environment (`settings_from_env`).

    mode: "none", "fixed_slope" or "exact_topk" (as `SharpConfig.mode`). slope: lambda, or None
    for the drafter's calibrated slopes (else 0.2). n_ref: the reference cardinality, or None for
    the drafter's training context (else 2048).
    """

    mode: str
    slope: Optional[float] = None
    n_ref: Optional[int] = None


def settings_from_env(environ: Mapping[str, str] = os.environ) -> Optional[PluginSettings]:
    """The plugin's settings from SHARPDRAFT_VLLM_MODE / _SLOPE / _N_REF (declared and parsed
    in `sharpdraft.settings`); None when the mode is unset, empty or "off" (the plugin then
    changes nothing).

    Raises:
        ValueError naming the variable: an unknown mode, a slope that is not a finite number, an
        n_ref that is not an integer >= 1, or a slope / n_ref set while the plugin is off.
    """
    mode = settings.get(ENV_MODE, environ)
    slope = settings.get(ENV_SLOPE, environ)
    n_ref = settings.get(ENV_N_REF, environ)
    if mode == OFF:
        for name, value in ((ENV_SLOPE, slope), (ENV_N_REF, n_ref)):
            if value is not None:
                raise ValueError(f"{name}={environ[name].strip()} is set but {ENV_MODE} is not: "
                                 f"set {ENV_MODE}=fixed_slope (or none / exact_topk) to switch "
                                 f"SharpDraft on")
        return None
    return PluginSettings(mode=mode, slope=slope, n_ref=n_ref)


def register() -> None:
    """The ``vllm.general_plugins`` entry point (run by vLLM in every one of its processes).

    Reads the settings (a bad one raises ValueError here, at engine start, before any model is
    loaded); when switched on, wraps `SpecDecodeBaseProposer.load_model` so that the drafter's
    attention layers are hooked once the drafter is loaded. Idempotent.
    """
    settings = settings_from_env()
    proposer_class = _proposer_class(import_vllm=settings is not None)
    if proposer_class is None:
        return
    original = proposer_class.load_model
    if getattr(original, "_sharpdraft_settings", None) is not None:
        original = original.__wrapped__
    if settings is None:                 # switched off in a process that had it on: undo
        proposer_class.load_model = original
        return

    def load_model(self, target_model):
        original(self, target_model)
        install(self, settings)

    load_model.__wrapped__ = original
    load_model._sharpdraft_settings = settings
    load_model.__doc__ = original.__doc__
    proposer_class.load_model = load_model


def _proposer_class(import_vllm: bool):
    """vLLM's SpecDecodeBaseProposer; when not `import_vllm`, only if vLLM is already imported
    (so that a switched-off plugin never imports vLLM itself)."""
    import sys

    if not import_vllm and "vllm.v1.spec_decode.llm_base_proposer" not in sys.modules:
        return None
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    return SpecDecodeBaseProposer


# ---------------------------------------------------------------------------------------------
# Cardinality and beta from vLLM's attention metadata
# ---------------------------------------------------------------------------------------------
def cardinality(attn_metadata, num_tokens: int, window: Optional[int] = None) -> torch.Tensor:
    """n_i for every token row of one attention call, from vLLM's metadata.

    Args:
        attn_metadata: a vLLM v1 attention metadata with ``query_start_loc`` (int (B + 1,)),
            ``seq_lens`` (int (B,)) and ``causal`` (bool, or an int (B,) tensor, 1 = causal);
            a CPU ``dynamic_causal`` tensor, when set, replaces ``causal``.
        num_tokens: rows of the call (padding rows past query_start_loc[B] get n = 1).
        window: a sliding window (keys), or None.

    Returns:
        int64 (num_tokens,) on the metadata's device: S_r - L_r + i + 1 for a causal row i of
        request r (query length L_r, sequence length S_r keys including the new ones), S_r for a
        non-causal row, capped at `window`.
    """
    seq_lens = attn_metadata.seq_lens.to(torch.int64)
    num_reqs = seq_lens.shape[0]
    qsl = attn_metadata.query_start_loc[: num_reqs + 1].to(torch.int64)
    rows = torch.arange(num_tokens, device=seq_lens.device, dtype=torch.int64)
    req = torch.searchsorted(qsl[1:], rows, right=True).clamp_max(num_reqs - 1)
    start, end = qsl[req], qsl[req + 1]
    n_full = seq_lens[req]
    n_causal = n_full - (end - start) + (rows - start) + 1
    causal = getattr(attn_metadata, "dynamic_causal", None)
    if causal is None:
        causal = getattr(attn_metadata, "causal", True)
    if isinstance(causal, torch.Tensor):
        n = torch.where(causal.to(seq_lens.device)[req] != 0, n_causal, n_full)
    else:
        n = n_causal if causal else n_full
    if window is not None:
        n = n.clamp_max(int(window))
    return torch.where(rows < qsl[-1], n, torch.ones_like(n)).clamp_min(1)


def _window(impl) -> Optional[int]:
    """The impl's sliding window in keys (vLLM's CPU impl keeps an int, FlashAttention a
    (left, right) pair with left = window - 1; -1 or None: no window)."""
    w = getattr(impl, "sliding_window", None)
    if isinstance(w, (tuple, list)):
        return None if w[0] < 0 else int(w[0]) + 1
    return None if w is None or w < 0 else int(w)


@dataclass
class LayerScale:
    """How one drafter attention layer scales its queries. slope: a float, or a per-head
    (Hq,) float32 tensor (calibrated)."""

    name: str
    index: int
    mode: str
    slope: object
    n_ref: int
    window: Optional[int]

    def beta(self, n: torch.Tensor, num_heads: int) -> torch.Tensor:
        """beta for rows with cardinalities n (T,): float32 (T, 1) or (T, Hq) (per-head slope)."""
        per_head = isinstance(self.slope, torch.Tensor)
        nn_ = n[None, :].expand(num_heads, -1) if per_head else n
        kw = dict(mode=self.mode, slope=self.slope, n_ref=self.n_ref)
        if n.device.type == "cpu":
            beta = ext.query_scale(nn_, **kw)
        else:
            beta = ext.reference.query_scale_ref(nn_, **kw).to(torch.float32)
        return beta.t() if per_head else beta[:, None]


# ---------------------------------------------------------------------------------------------
# Observers (tests and analyses; the hot path checks one empty list)
# ---------------------------------------------------------------------------------------------
_OBSERVERS: list = []


@dataclass
class AttentionCall:
    """One drafter attention call, as an observer sees it (after vLLM's backend ran).

    query (T, Hq, D) as vLLM passed it (before the scaling); key, value (T, Hk, D) the new
    keys; cardinality (T,) int64; beta (T, 1) or (T, Hq) float32; output (T, Hq, Dv);
    attn_metadata and kv_cache as the backend received them.
    """

    layer: LayerScale
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cardinality: torch.Tensor
    beta: torch.Tensor
    output: torch.Tensor
    attn_metadata: object
    kv_cache: torch.Tensor
    softmax_scale: float


@dataclass
class CacheWrite:
    """One KV-cache write of a drafter layer: key, value (T, Hk, D) at slot_mapping (T,)."""

    layer: LayerScale
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor


@contextmanager
def observe(callback: Callable[[object], None]):
    """Call `callback(event)` (an AttentionCall or a CacheWrite) for every drafter attention
    call and KV-cache write inside the block, in the process that runs the drafter (for tests:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps vLLM's engine in the caller's process)."""
    _OBSERVERS.append(callback)
    try:
        yield callback
    finally:
        _OBSERVERS.remove(callback)


# ---------------------------------------------------------------------------------------------
# Installing the hook on a loaded drafter
# ---------------------------------------------------------------------------------------------
def _layer_index(name: str) -> int:
    found = re.findall(r"layers\.(\d+)\.", name)
    return int(found[-1]) if found else 0


def layer_scales(names, draft_config, settings: PluginSettings, num_heads: Mapping[str, int]
                 ) -> list:
    """A LayerScale for each drafter attention layer name (ordered by layer number).

    draft_config: the drafter's config (vLLM's ``draft_model_config.hf_config``): its
    ``train_context`` is the default n_ref and its ``sharp_slopes`` (one entry per drafter
    layer, a float or a per-head list) the default slopes. num_heads: query heads per layer.

    Raises:
        ValueError naming the config field: a train_context or sharp_slopes entry of the wrong
        kind, or a per-head entry whose length is not the layer's head count; or the kernel's
        own message for settings it refuses (exact_topk needs n_ref > topk = 32).
    """
    n_ref = settings.n_ref
    if n_ref is None:
        n_ref = getattr(draft_config, "train_context", None) or DEFAULT_TRAIN_CONTEXT
        if not isinstance(n_ref, int) or isinstance(n_ref, bool) or n_ref < 1:
            raise ValueError(f"the drafter's config.json train_context must be an integer >= 1 "
                             f"(the default n_ref), got {n_ref!r}")
    calibrated = getattr(draft_config, "sharp_slopes", None) if settings.slope is None else None
    ordered = sorted(names, key=lambda s: (_layer_index(s), s))
    first = _layer_index(ordered[0]) if ordered else 0
    scales = []
    for name in ordered:
        index = _layer_index(name) - first
        slope = DEFAULT_SLOPE if settings.slope is None else settings.slope
        if calibrated and index < len(calibrated):
            entry = calibrated[index]
            if isinstance(entry, (list, tuple)):
                if len(entry) != num_heads[name]:
                    raise ValueError(f"the drafter's config.json sharp_slopes[{index}] has "
                                     f"{len(entry)} per-head slopes, layer {name} has "
                                     f"{num_heads[name]} query heads")
                slope = torch.tensor([float(x) for x in entry], dtype=torch.float32)
            elif isinstance(entry, (int, float)) and math.isfinite(entry):
                slope = float(entry)
            else:
                raise ValueError(f"the drafter's config.json sharp_slopes[{index}] must be a "
                                 f"finite float or a list of them, got {entry!r}")
        scale = LayerScale(name=name, index=index, mode=settings.mode, slope=slope,
                           n_ref=int(n_ref), window=None)
        try:                                   # the kernel's own checks, before any request
            scale.beta(torch.ones(1, dtype=torch.int64), num_heads[name])
        except ValueError as err:
            raise ValueError(f"SharpDraft settings for drafter layer {name}: {err}") from None
        scales.append(scale)
    return scales


def hook_layer(layer, scale: LayerScale) -> None:
    """Wrap `layer.impl.forward` (and its KV-cache write, for observers) so that the layer's
    queries are scaled by beta(n_i) before the backend attends. The impl keeps its class (vLLM
    checks it). Hooking twice replaces the first hook."""
    impl = layer.impl
    scale.window = _window(impl)
    forward = getattr(impl.forward, "_sharpdraft_inner", impl.forward)
    kv_update = getattr(impl, "do_kv_cache_update", None)
    kv_update = getattr(kv_update, "_sharpdraft_inner", kv_update)

    def sharp_forward(attn_layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if attn_metadata is None or query.shape[0] == 0:     # vLLM's warm-up / profiling run
            return forward(attn_layer, query, key, value, kv_cache, attn_metadata,
                           *args, **kwargs)
        n = cardinality(attn_metadata, query.shape[0], scale.window)
        if scale.mode == "none" and not _OBSERVERS:
            return forward(attn_layer, query, key, value, kv_cache, attn_metadata,
                           *args, **kwargs)
        q3 = query.view(query.shape[0], -1, query.shape[-1])
        beta = scale.beta(n, q3.shape[1])
        scaled = query if scale.mode == "none" else \
            (q3.float() * beta[..., None]).to(query.dtype).view(query.shape)
        out = forward(attn_layer, scaled, key, value, kv_cache, attn_metadata, *args, **kwargs)
        if _OBSERVERS:
            output = kwargs.get("output")
            output = out if output is None else output
            call = AttentionCall(scale, q3, key, value, n, beta, output, attn_metadata, kv_cache,
                                 float(impl.scale))
            for callback in list(_OBSERVERS):
                callback(call)
        return out

    sharp_forward._sharpdraft_inner = forward
    impl.forward = sharp_forward
    _HOOKED[:] = [(i, s) for i, s in _HOOKED if i is not impl] + [(impl, scale)]
    if kv_update is not None:
        def observed_kv_update(attn_layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
            result = kv_update(attn_layer, key, value, kv_cache, slot_mapping, *args, **kwargs)
            if _OBSERVERS:
                write = CacheWrite(scale, key, value, slot_mapping)
                for callback in list(_OBSERVERS):
                    callback(write)
            return result

        observed_kv_update._sharpdraft_inner = kv_update
        impl.do_kv_cache_update = observed_kv_update


_HOOKED: list = []          # (impl, LayerScale) in hook order, in the drafter's process


def hooked_layers() -> list:
    """The LayerScale of every drafter layer hooked in this process, in hook order (engines
    built one after another append theirs). A LayerScale's mode, slope and n_ref may be changed
    between requests: the hook reads them at every call."""
    return [scale for _, scale in _HOOKED]


def unhook_all() -> None:
    """Give every hooked layer back its backend's own forward and KV-cache write."""
    for impl, _ in _HOOKED:
        impl.forward = getattr(impl.forward, "_sharpdraft_inner", impl.forward)
        update = getattr(impl, "do_kv_cache_update", None)
        if update is not None:
            impl.do_kv_cache_update = getattr(update, "_sharpdraft_inner", update)
    _HOOKED.clear()


def install(proposer, settings: PluginSettings) -> list:
    """Hook every drafter attention layer of a loaded vLLM proposer; returns their LayerScales.

    Raises:
        ValueError: the drafter's config fields (see `layer_scales`).
    """
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    names = sorted(getattr(proposer, "_draft_attn_layer_names", ()) or ())
    layers = get_layers_from_vllm_config(proposer.vllm_config, Attention, names)
    draft_config = proposer.speculative_config.draft_model_config.hf_config
    scales = layer_scales(list(layers), draft_config, settings,
                          {name: layer.num_heads for name, layer in layers.items()})
    for scale in scales:
        hook_layer(layers[scale.name], scale)
    if scales:
        source = ("SHARPDRAFT_VLLM_N_REF" if settings.n_ref is not None else
                  "config.json train_context" if getattr(draft_config, "train_context", None)
                  else "default")
        slopes = sorted({str(s.slope) if not isinstance(s.slope, torch.Tensor) else "per-head"
                         for s in scales})
        logger.info("sharpdraft: SharpDraft mode %s on %d drafter attention layers "
                    "(n_ref %d from %s, slope %s)", settings.mode, len(scales), scales[0].n_ref,
                    source, ", ".join(slopes))
    else:
        logger.warning("sharpdraft: %s is set but the drafter has no attention layer to hook",
                       ENV_MODE)
    return scales
