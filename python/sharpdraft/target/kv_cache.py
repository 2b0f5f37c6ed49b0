"""The target's KV cache: `PreallocatedCache`, one buffer per layer sized for the whole
generation, written in place; cropping moves a length, a tree's accepted path is a gather, and
a batched generation drops its finished rows with `batch_select_indices`."""
from __future__ import annotations

import inspect
from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def _cache_kwarg() -> str:
    """The keyword transformers' models and decoder layers take a Cache by: "cache" from
    transformers 5.2x (with "past_key_values" deprecated), "past_key_values" before (5.19, the
    version vLLM 0.32 pins)."""
    params = inspect.signature(LlamaDecoderLayer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE_KWARG = _cache_kwarg()


class PreallocatedLayer(CacheLayerMixin):
    """One layer's keys and values in buffers of `capacity` rows, (B, Hk, capacity, D), in
    `dtype` (None: the first keys' dtype; a 16-bit dtype stores rounded keys and values).

    `keys` / `values` are views of the first `length` rows (strided: the kernel reads any
    strides with a unit last stride).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.capacity = int(capacity)
        self.dtype = dtype
        self.length = 0
        self.key_buffer: Optional[torch.Tensor] = None
        self.value_buffer: Optional[torch.Tensor] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        dtype = self.dtype or key_states.dtype
        self.key_buffer = key_states.new_empty((b, h, self.capacity, d), dtype=dtype)
        self.value_buffer = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]),
                                                   dtype=dtype)
        self.device, self.dtype = key_states.device, dtype
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self.key_buffer[:, :, :self.length]
        self.values = self.value_buffer[:, :, :self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"PreallocatedCache: {end} positions exceed its capacity "
                               f"{self.capacity}; start the runtime with a larger capacity")
        self.key_buffer[:, :, self.length:end].copy_(key_states)
        self.value_buffer[:, :, self.length:end].copy_(value_states)
        self.length = end
        self._views()
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        """HF convention: a negative count removes that many trailing rows."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of rows to remove")
        if tokens_to_remove == 0:                   # nothing to drop (the views stand)
            return
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self._views()

    def keep(self, start: int, rows: torch.Tensor) -> None:
        """Keep rows [0, start) and then start + rows (in that order); the length becomes
        start + len(rows)."""
        if self.is_initialized:
            src = start + rows
            n = rows.numel()
            for buf in (self.key_buffer, self.value_buffer):
                buf[:, :, start:start + n].copy_(buf.index_select(2, src))
        self.length = start + rows.numel()
        if self.is_initialized:
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows `indices` ((n,) int64 on the layer's device), in that order:
        new buffers of n rows replace the old ones; length and capacity stay."""
        if self.is_initialized:
            self.key_buffer = self.key_buffer.index_select(0, indices)
            self.value_buffer = self.value_buffer.index_select(0, indices)
            self._views()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._views()


class PreallocatedCache(Cache):
    """A transformers Cache of `PreallocatedLayer`s (one per decoder layer), keys and values in
    `dtype` (None: the model's)."""

    def __init__(self, num_layers: int, capacity: int, dtype: Optional[torch.dtype] = None):
        super().__init__(layers=[PreallocatedLayer(capacity, dtype) for _ in range(num_layers)])
        self.capacity = int(capacity)

    def crop_to(self, length: int) -> None:
        """Drop every row past the first `length`."""
        for layer in self.layers:
            layer.crop(min(0, length - layer.length))

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Keep rows [0, start) and then start + rows of every layer (a tree's accepted path)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        for layer in self.layers:
            layer.keep(start, idx.to(layer.device) if layer.is_initialized else idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows `indices` ((n,) int64, on the cache's device) of every
        layer, in that order (a batched generation dropping its finished rows); a copy, so worth
        it only once enough rows have finished."""
        for layer in self.layers:
            layer.batch_select_indices(indices)
