"""PositionedLayer / PositionedQuantLayer: a core storage layer speaking transformers' CacheLayerMixin protocol
(its reads go through the owning PositionedCache)."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvpos._checks import fail
from kvpos.cache import QuantSlotLayer, SlotLayer
from kvpos.rope import RopeSpec


if TYPE_CHECKING:
    from .cache import PositionedCache


class PositionedLayer(SlotLayer, CacheLayerMixin):
    """One decoder layer of a PositionedCache: SlotLayer storage speaking the transformers CacheLayerMixin protocol."""

    is_sliding = False
    is_croppable = True
    supports_early_init = True

    def __init__(self, owner: "PositionedCache", index: int, spec: RopeSpec, raw_dtype: torch.dtype | None,
                 storage: str = "rotated", fixed: int | None = None) -> None:
        SlotLayer.__init__(self, spec, raw_dtype, storage, fixed)  # CacheLayerMixin.__init__ would overwrite keys/values
        self._owner_ref = weakref.ref(owner)       # no reference cycle: a dropped cache frees its buffers at once
        self.index = index

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
        """[B, H, T, D] keys at their current positions (storage="raw": rotated on read, see layer_keys)."""
        self._owner.sync_count()
        if self.mode.keeps_rotated:
            return None if self.rot_k is None else self.rot_k[:, :, : self.n]
        return self._owner.layer_keys(self.index)

    @property
    def device(self) -> torch.device:
        """The device the layer computes on (where `prefetch` brings offloaded buffers back)."""
        home = getattr(self, "_home", None)
        if home is not None:
            return home
        return self.v.device if self.allocated else torch.device("cpu")

    @property
    def raw_keys(self) -> torch.Tensor | None:  # type: ignore[override]
        """[B, H, T, D] keys before RoPE."""
        self._owner.sync_count()
        return None if self.raw_k is None else self.raw_k[:, :, : self.n]

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        """[B, H, T, D] values."""
        self._owner.sync_count()
        return None if self.v is None else self.v[:, :, : self.n]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.reserve(key_states, value_states, 0)

    def offload(self) -> None:
        """Move this layer's buffers to CPU (transformers' layer offloading); `prefetch` brings them back."""
        if self.allocated:
            self._home = self.device
            self.set_buffers([t.to("cpu", non_blocking=True) for t in self.buffers()])

    def prefetch(self) -> None:
        """Bring offloaded buffers back to the layer's device."""
        if self.allocated and self.v.device != self.device:
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


class PositionedQuantLayer(QuantSlotLayer, PositionedLayer):
    """A PositionedLayer with storage="int8" (QuantSlotLayer's buffers and reads, PositionedLayer's protocol)."""

    def __init__(self, owner: "PositionedCache", index: int, spec: RopeSpec, raw_dtype: torch.dtype | None,
                 storage: str = "int8", fixed: int | None = None) -> None:
        QuantSlotLayer.__init__(self, spec, raw_dtype, storage, fixed)
        self._owner_ref = weakref.ref(owner)
        self.index = index
