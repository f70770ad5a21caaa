"""The core's storage layers speaking transformers' CacheLayerMixin protocol (their reads go through the owning
PositionedCache): one class per storage, `LayerProtocol` the shared half.

    PositionedLayer       storage="rotated"   (kvpos.cache.RotatedSlotLayer)
    PositionedRawLayer    storage="raw"       (kvpos.cache.RawSlotLayer)
    PositionedQuantLayer  storage="int8"      (kvpos.cache.QuantSlotLayer)"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvpos._checks import fail
from kvpos.cache import QuantSlotLayer, RawSlotLayer, RotatedSlotLayer, SlotLayer, StorageMode
from kvpos.rope import RopeSpec


if TYPE_CHECKING:
    from .cache import PositionedCache


class LayerProtocol:
    """One decoder layer of a PositionedCache: transformers' CacheLayerMixin protocol over a core storage layer
    (a mixin placed first: `class X(LayerProtocol, SomeSlotLayer, CacheLayerMixin)`, so that the protocol's
    methods come first, then the storage's, then transformers' defaults)."""

    is_sliding = False
    is_croppable = True
    supports_early_init = True

    def __init__(self, owner: "PositionedCache", index: int, spec: RopeSpec, raw_dtype: torch.dtype | None,
                 fixed: int | None = None) -> None:
        # the storage's __init__ (CacheLayerMixin.__init__ would overwrite keys / values)
        self.storage_class().__init__(self, spec, raw_dtype, fixed)
        self._owner_ref = weakref.ref(owner)       # no reference cycle: a dropped cache frees its buffers at once
        self.index = index
        self.home: torch.device | None = None      # where offloaded buffers come back to (see offload)

    @classmethod
    def storage_class(cls) -> type[SlotLayer]:
        """The core storage class this protocol layer speaks for (the next SlotLayer in the MRO)."""
        return next(c for c in cls.__mro__ if issubclass(c, SlotLayer) and not issubclass(c, LayerProtocol))

    @property
    def _owner(self) -> "PositionedCache":
        owner = self._owner_ref()
        if owner is None:
            fail(f"cache layer {self.index}", "its PositionedCache alive", "a layer whose cache was dropped")
        return owner

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.allocated

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        """True for a fixed-capacity cache (static shapes: transformers' generate may compile its decode steps)."""
        return self.fixed is not None

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        """[B, H, T, D] keys at their current positions (storage "raw" / "int8": rotated on read, see
        layer_keys)."""
        self._owner.sync_count()
        return self._owner.layer_keys(self.index)

    @property
    def device(self) -> torch.device:
        """The device the layer computes on (where `prefetch` brings offloaded buffers back)."""
        if self.home is not None:
            return self.home
        return self.slot_device if self.allocated else torch.device("cpu")

    @property
    def raw_keys(self) -> torch.Tensor | None:  # type: ignore[override]
        """[B, H, T, D] keys before RoPE (int8: dequantized)."""
        self._owner.sync_count()
        return self.valid_raw_keys()

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        """[B, H, T, D] values (int8: dequantized)."""
        self._owner.sync_count()
        return self.valid_values()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.reserve(key_states, value_states, 0)

    def offload(self) -> None:
        """Move this layer's buffers to CPU (transformers' layer offloading); `prefetch` brings them back."""
        if self.allocated:
            self.home = self.device
            self.set_buffers([t.to("cpu", non_blocking=True) for t in self.buffers()])

    def prefetch(self) -> None:
        """Bring offloaded buffers back to the layer's device."""
        if self.allocated and self.slot_device != self.device:
            d = self.device
            self.set_buffers([t.to(d, non_blocking=True) for t in self.buffers()])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._owner.update(key_states, value_states, self.index, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.fixed if self.fixed is not None else self.n + query_length), 0

    def get_seq_length(self) -> int:
        self._owner.sync_count()
        return self.n

    def get_max_length(self) -> int:
        return -1 if self.fixed is None else self.fixed

    def reset(self) -> None:
        self._owner.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self._owner.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._owner.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._owner.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._owner.batch_select_indices(indices)


class PositionedLayer(LayerProtocol, RotatedSlotLayer, CacheLayerMixin):
    """A PositionedCache layer with storage="rotated"."""


class PositionedRawLayer(LayerProtocol, RawSlotLayer, CacheLayerMixin):
    """A PositionedCache layer with storage="raw"."""


class PositionedQuantLayer(LayerProtocol, QuantSlotLayer, CacheLayerMixin):
    """A PositionedCache layer with storage="int8"."""


def protocol_layer_class(mode: StorageMode) -> type[LayerProtocol]:
    """The PositionedCache layer class of storage `mode`."""
    for cls in (PositionedLayer, PositionedRawLayer, PositionedQuantLayer):
        if cls.mode is mode:
            return cls
    fail("protocol_layer_class mode", "a StorageMode of kvpos.cache.storages", repr(mode))
