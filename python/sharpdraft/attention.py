"""SharpConfig and the "sharp" attention implementation for transformers models.

`register()` adds "sharp" to transformers' attention interface (and its mask interface, which
then builds boolean masks, True = visible, as for SDPA), so any Hugging Face model can run its
attention through `sharpdraft_ext.sharp_attention`:

    from sharpdraft.attention import SharpConfig, register, set_sharp_config
    register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sharp")
    set_sharp_config(model, SharpConfig(mode="fixed_slope", slope=0.2, n_ref=2048))

transformers hands the function q (B, Hq, Lq, D) and k, v (B, Hk, Lk, D) (the KV cache already
concatenated); GQA is passed to the kernel as is. With no mask a causal module gets the kernel's
bottom-right causal alignment (the last query sits on the last key, as in cached decoding); a
boolean mask (causal + padding, built by transformers) is passed as attn_mask, and each row's
cardinality n_i is counted from it.
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch

import sharpdraft_ext as ext
from sharpdraft_ext.defaults import DEFAULT_CONTRAST, DEFAULT_N_REF, DEFAULT_SLOPE, DEFAULT_TOPK

MODES = ("none", "fixed_slope", "exact_topk")


@dataclass
class SharpConfig:
    """Parameters of cardinality-aware query scaling (spec §1).

    mode: "fixed_slope" (beta = 1 + slope ln(n / n_ref)), "exact_topk", or "none" (beta = 1,
    plain attention: the frozen baseline). slope: lambda. n_ref: reference cardinality (a
    drafter's training context length). topk, contrast: k and Delta of the exact correction.
    beta_min, beta_max: clamp of beta (beta_min = beta_max = c with slope 0 is a constant
    beta = c). layer_slopes: calibrated slopes (spec §7), one entry per drafter layer, each a
    float or a list of per-head floats; a layer's entry replaces `slope` in that layer (layers
    past the list, and calls that name no layer, use `slope`).
    """

    mode: str = "fixed_slope"
    slope: float = DEFAULT_SLOPE
    n_ref: int = DEFAULT_N_REF
    topk: int = DEFAULT_TOPK
    contrast: float = DEFAULT_CONTRAST
    beta_min: float = 1.0
    beta_max: float = math.inf
    layer_slopes: Optional[list] = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"SharpConfig.mode must be one of {MODES}, got {self.mode!r}")
        if int(self.n_ref) < 1:
            raise ValueError(f"SharpConfig.n_ref must be >= 1, got {self.n_ref}")
        if not math.isfinite(self.slope):
            raise ValueError(f"SharpConfig.slope must be finite, got {self.slope}")
        for i, entry in enumerate(self.layer_slopes or []):
            values = entry if isinstance(entry, (list, tuple)) else [entry]
            if not values or not all(isinstance(x, (int, float)) and math.isfinite(x)
                                     for x in values):
                raise ValueError(f"SharpConfig.layer_slopes[{i}] must be a finite float or a "
                                 f"non-empty list of finite floats, got {entry!r}")

    def kernel_kwargs(self, layer: Optional[int] = None) -> dict:
        """Keyword arguments of `sharpdraft_ext.sharp_attention` for drafter layer `layer`
        (its calibrated slope, a float or a per-head float32 tensor, when it has one)."""
        kw = dataclasses.asdict(self)
        slopes = kw.pop("layer_slopes")
        if slopes and layer is not None and layer < len(slopes):
            entry = slopes[layer]
            kw["slope"] = (torch.tensor(entry, dtype=torch.float32)
                           if isinstance(entry, (list, tuple)) else float(entry))
        return kw

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "SharpConfig":
        return cls(**(d or {}))


_OBSERVERS: list = []


@contextmanager
def observe(callback):
    """Call `callback(module, layer, q, k, kwargs, sharp_kwargs)` on every `attend` inside the
    block (q, k as the kernel sees them; kwargs: causal / window / attn_mask / scale ...;
    sharp_kwargs: the scaling keywords, slope resolved for the layer). For analyses
    (`sharpdraft.eval`), never the hot path: with no observer `attend` checks one list."""
    _OBSERVERS.append(callback)
    try:
        yield callback
    finally:
        _OBSERVERS.remove(callback)


def observed() -> bool:
    """Whether an `observe` callback is active (fused code that bypasses `attend` checks it,
    so analyses still see every attention call)."""
    return bool(_OBSERVERS)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sharp: SharpConfig,
           layer: Optional[int] = None, module: Optional[torch.nn.Module] = None,
           **kwargs) -> torch.Tensor:
    """`sharpdraft_ext.sharp_attention(q, k, v, **kwargs, **sharp.kernel_kwargs(layer))`; when
    training (autograd on and q requires grad) the differentiable reference computes the same
    maths without upcasting, since the fused kernel has no backward; so it does for float32
    CUDA tensors (a drafter trained in float32 on a GPU, evaluated), since the CUDA kernel
    runs bfloat16 and float16 only.

    layer: the drafter layer index (selects its calibrated slope); module: the calling
    attention module (what `observe` callbacks see, to tell layers and models apart). Keys and
    values of another dtype than q (a 16-bit KV cache) take q in their dtype; the output comes
    back in q's (as the fused decoder does it)."""
    skw = sharp.kernel_kwargs(layer)
    for callback in _OBSERVERS:
        callback(module, layer, q, k, kwargs, skw)
    if (torch.is_grad_enabled() and q.requires_grad) or (q.is_cuda and q.dtype == torch.float32):
        return ext.reference.sharp_attention_ref(q, k, v, upcast=False, **kwargs, **skw)
    if k.dtype != q.dtype:          # a 16-bit KV cache: the queries in its dtype, the out back
        out = ext.sharp_attention(q.to(k.dtype), k, v, **kwargs, **skw)
        return (out[0].to(q.dtype), out[1]) if isinstance(out, tuple) else out.to(q.dtype)
    return ext.sharp_attention(q, k, v, **kwargs, **skw)


def set_sharp_config(model: torch.nn.Module, sharp: SharpConfig) -> None:
    """Attach `sharp` to a model loaded with attn_implementation="sharp" (stored in its config)."""
    model.config.sharp_config = dataclasses.asdict(sharp)


def sharp_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                            dropout: float = 0.0, scaling: Optional[float] = None,
                            is_causal: Optional[bool] = None, **kwargs):
    """transformers attention-interface function running `sharpdraft_ext.sharp_attention`.

    Args:
        module: the attention module; its `config.sharp_config` (a dict, see `set_sharp_config`)
            or a `sharp_config` keyword selects the scaling, default SharpConfig().
        query: (B, Hq, Lq, D); key, value: (B, Hk, Lk, D), Hq % Hk == 0.
        attention_mask: None or bool, broadcastable to (B, Hq, Lq, Lk), True = visible; or an
            additive float mask of 0 (visible) and large negative values (masked), as
            transformers' eager masks are (`visible_mask`).
        dropout: must be 0 (inference kernel).
        scaling: softmax scale (default 1 / sqrt(D)).
        is_causal: overrides `module.is_causal` when no mask is given.

    Returns:
        (out (B, Lq, Hq, D) in query's dtype, None). With autograd on and a query that requires
        grad (training) the differentiable reference (same maths, no upcast) computes it.

    Raises:
        ValueError: dropout > 0, a softcap, or a float attention_mask that adds biases
            (values other than 0 and masking ones).
    """
    if dropout:
        raise ValueError(f"sharp attention: dropout must be 0 (got {dropout}); call model.eval()")
    if kwargs.get("softcap") is not None:
        raise ValueError("sharp attention: softcap is not supported")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = visible_mask(attention_mask)
    sharp = kwargs.get("sharp_config") or SharpConfig.from_dict(
        getattr(module.config, "sharp_config", None))
    causal = False
    window = None
    if attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        causal = causal and query.shape[2] > 1
        window = kwargs.get("sliding_window") if causal else None
    out = attend(query, key, value, sharp, layer=getattr(module, "layer_idx", None),
                 module=module, causal=causal, window=window, attn_mask=attention_mask,
                 scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def visible_mask(mask: torch.Tensor) -> torch.Tensor:
    """The boolean mask (True = visible) of an additive float attention mask whose entries are 0
    (visible) or masking values (-inf, or below half the dtype's lowest finite value, as
    transformers' eager masks use torch.finfo(dtype).min).

    Raises:
        ValueError: another value (an additive bias such as ALiBi's, which sharp attention does
            not apply).
    """
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(f"sharp attention: attention_mask must be bool or float, got {mask.dtype}")
    masked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(((mask == 0) | masked).all()):
        raise ValueError("sharp attention: attention_mask adds biases (values other than 0 and "
                         "-inf); only masks that hide keys are supported")
    return ~masked


def sharp_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
               mask_function=None, attention_mask: Optional[torch.Tensor] = None,
               allow_is_causal_skip: bool = True, **kwargs) -> Optional[torch.Tensor]:
    """transformers mask-interface function for "sharp": None where the mask would be plain
    causal with the queries on the last keys (no padding, no window, no custom pattern), since
    the kernel's bottom-right `causal=True` is then the same mask and needs no tensor; else the
    SDPA-style boolean mask (True = visible)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = mask_function or causal_mask_function
    plain = (allow_is_causal_skip and mask_function is causal_mask_function
             and kwargs.get("local_size") is None and not isinstance(q_offset, torch.Tensor)
             and q_offset + q_length == kv_offset + kv_length)
    if plain and (attention_mask is None or (attention_mask.shape[-1] >= kv_offset + kv_length
                                             and bool(attention_mask.all()))):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip,
                     **kwargs)


def register(name: str = "sharp") -> None:
    """Register `sharp_attention_forward` and its mask function `sharp_mask` under `name`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(name, sharp_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sharp_mask)


class AttentionPatch:
    """What `patch_attention` changed: `undo()` (or leaving the `with` block) puts every config
    back as it was."""

    def __init__(self, saved: list):
        self._saved = saved

    @property
    def configs(self) -> int:
        """How many distinct configs were patched."""
        return len(self._saved)

    def undo(self) -> None:
        """Restore each patched config's attention implementation and sharp_config (idempotent)."""
        for config, impl, had, old in reversed(self._saved):
            config._attn_implementation = impl
            if had:
                config.sharp_config = old
            elif hasattr(config, "sharp_config"):
                del config.sharp_config
        self._saved = []

    def __enter__(self) -> "AttentionPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def patch_attention(model: torch.nn.Module, sharp: Optional[SharpConfig] = None
                    ) -> AttentionPatch:
    """Route the attention of a Hugging Face-style module (any nn.Module whose attention layers
    look their attention function up by `config._attn_implementation`, as transformers models
    and the public drafters' model files do) through `sharpdraft_ext.sharp_attention`.

    Every distinct config reachable as `.config` of `model` or a submodule is switched to the
    "sharp" implementation (registered here) and given `sharp` (default SharpConfig(): SharpDraft
    with slope 0.2, n_ref 2048). Masks are kept: a boolean or additive 0 / -inf mask is passed
    to the kernel as a boolean mask and each row's cardinality n_i is counted from it; with no
    mask, a module's `is_causal` (or the call's is_causal) selects causal (bottom-right) or full
    attention, so a non-causal DFlash block sees n_i = context + block keys per row. Models
    built with another implementation get the "sharp" mask function for masks built after the
    patch (transformers builds masks per forward).

    Args:
        model: the module; its configs are modified in place.
        sharp: the scaling (mode "none" runs the kernel without scaling).

    Returns:
        An `AttentionPatch`; `.undo()` (or `with patch_attention(...):`) restores the previous
        implementation and sharp_config of every config.

    Raises:
        ValueError naming `model`: no submodule has a config with `_attn_implementation`.
    """
    register()
    sharp = sharp or SharpConfig()
    saved, seen = [], set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or not hasattr(config, "_attn_implementation"):
            continue
        seen.add(id(config))
        saved.append((config, config._attn_implementation, hasattr(config, "sharp_config"),
                      getattr(config, "sharp_config", None)))
        config._attn_implementation = "sharp"
        config.sharp_config = dataclasses.asdict(sharp)
    if not saved:
        raise ValueError(f"model: no submodule of this {type(model).__name__} has a config with "
                         f"_attn_implementation (not a Hugging Face-style module)")
    return AttentionPatch(saved)
