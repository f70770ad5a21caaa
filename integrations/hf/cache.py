"""PositionedCache: the core PositionedKV speaking transformers' `Cache` protocol (a thin shim).

Letters: B batch · H kv heads · T cached slots · S new tokens · D head_dim.

How positions arrive (transformers 5.x): attention layers call `cache.update(k_rotated, v, layer_idx,
kwargs={..., "position_ids": [B|1, S]})` after applying RoPE. The first layer of a forward reads the positions and
the core (`PositionedKV.write_rotated_`) keeps them for every later layer of that forward. Models that do not pass
position_ids to the cache (GPT-NeoX) are covered by a forward pre-hook on the rotary module that records the running
forward's positions in a context variable (per thread, never on the module).
"""
from __future__ import annotations

import contextvars
from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpos._checks import fail
from kvpos.cache import PositionedKV, SlotLayer
from kvpos.rope import RopeSpec, rope_specs_from_model

__all__ = ["PositionedCache", "PositionedLayer"]

# positions of the running forward, recorded by the rotary-module hook (per thread / task, one value per forward)
_ROTARY_POSITIONS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("kvpos_rotary_positions",
                                                                                          default=None)


def _record_positions(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    pos = kwargs.get("position_ids")
    if pos is None and len(args) >= 2:
        pos = args[1]
    _ROTARY_POSITIONS.set(pos)


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")
            or n.endswith("rotary_emb")]


def _install_position_hook(model: torch.nn.Module) -> None:
    """Record the running forward's positions from every rotary module (idempotent)."""
    for m in _rotary_modules(model):
        if not any(h is _record_positions for h in m._forward_pre_hooks.values()):
            m.register_forward_pre_hook(_record_positions, with_kwargs=True)


class PositionedLayer(SlotLayer, CacheLayerMixin):
    """One decoder layer of a PositionedCache: SlotLayer storage speaking the transformers CacheLayerMixin protocol."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: "PositionedCache", index: int, spec: RopeSpec, raw_dtype: torch.dtype | None) -> None:
        SlotLayer.__init__(self, spec, raw_dtype)  # CacheLayerMixin.__init__ would overwrite the keys/values views
        self._owner = owner
        self.index = index

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.rot_k is not None

    @property
    def device(self) -> torch.device:
        return self.rot_k.device if self.rot_k is not None else torch.device("cpu")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.reserve(key_states, value_states, 0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._owner.update(key_states, value_states, self.index, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return -1

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


class PositionedCache(PositionedKV, Cache):
    """A transformers Cache that stores keys unrotated beside int64 positions and re-rotates only moved slots.

    Use it anywhere a DynamicCache goes:

        cache = PositionedCache.from_model(model)
        out = model.generate(ids, cache=cache, max_new_tokens=20)     # same tokens as DynamicCache
        cache.shift_(10, 40, +100)                                   # move slots 10..39 by +100 positions
        out2 = kvpos.integrations.hf.generate(model, cache, more_ids, max_new_tokens=20)

    Memory: raw keys + rotated keys + values (1.5x a DynamicCache); buffers grow geometrically (no per-step cat).
    """

    def __init__(self, specs: Sequence[RopeSpec], raw_dtype: torch.dtype | None = None,
                 model_id: str | None = None) -> None:
        PositionedKV.__init__(self, specs, raw_dtype)
        Cache.__init__(self, layers=self.layers)
        self.model_id = model_id

    def _new_layer(self, index: int, spec: RopeSpec) -> PositionedLayer:
        return PositionedLayer(self, index, spec, self.raw_dtype)

    def empty_like(self) -> "PositionedCache":
        return type(self)(self.specs, self.raw_dtype, self.model_id)

    @classmethod
    def from_model(cls, model: torch.nn.Module, raw_dtype: torch.dtype | None = None,
                   angle_dtype: torch.dtype = torch.float32) -> "PositionedCache":
        """Build an empty cache for `model` (one RopeSpec per layer; refuses models it cannot serve exactly)."""
        specs = rope_specs_from_model(model, angle_dtype=angle_dtype)
        _install_position_hook(model)
        return cls(specs, raw_dtype=raw_dtype, model_id=getattr(model, "name_or_path", None))

    @classmethod
    def from_dynamic(cls, model: torch.nn.Module, cache: Cache, positions: Any = None,
                     raw_dtype: torch.dtype | None = None) -> "PositionedCache":
        """Convert a filled DynamicCache (rotated keys at `positions`, default 0..T-1) into a PositionedCache.

        The rotated keys are kept as they are; raw keys come from one un-rotation. The DynamicCache is not modified.
        """
        out = cls.from_model(model, raw_dtype=raw_dtype)
        if len(cache.layers) != len(out.layers):
            fail("from_dynamic cache", f"{len(out.layers)} layers", len(cache.layers))
        T = cache.get_seq_length()
        if T == 0:
            return out
        for i, l in enumerate(cache.layers):
            if l.keys is None or l.keys.shape[2] != T:
                fail(f"from_dynamic layer {i}", f"{T} cached keys (sliding-window layers keep fewer)",
                     None if l.keys is None else l.keys.shape[2])
        kv = [(l.keys, l.values) for l in cache.layers]
        return cls.from_rotated(out.specs, kv, positions, raw_dtype, model_id=out.model_id)

    # -- the transformers write path -----------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store S new slots of layer `layer_idx`: k [B, H, S, D] already rotated by the model; returns all
        (rotated keys, values) of the layer."""
        pos = self._incoming_positions(layer_idx, key_states, kwargs)
        return self.write_rotated_(layer_idx, key_states, value_states, pos)

    def _incoming_positions(self, index: int, k: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """[B, S] int64 positions of the keys the model is handing over (read once per forward)."""
        fw = self._forward
        B, S = k.shape[0], k.shape[2]
        if fw is not None and index not in fw.done and self._overwrite is None and fw.S == S:
            return fw.pos                                    # a later layer of the running forward
        inner = kwargs.get("kwargs") if isinstance(kwargs.get("kwargs"), dict) else kwargs
        pos = inner.get("position_ids") if isinstance(inner, dict) else None
        if pos is None:
            pos = _ROTARY_POSITIONS.get()
        if pos is None:
            fail(f"cache.update layer {index}: position_ids", "the positions of the new keys (passed by the model "
                 "or recorded from its rotary module)", None, "build the cache with PositionedCache.from_model(model)")
        if pos.dim() == 3:
            fail("position_ids", "[B, S] (1-D positions per token)", tuple(pos.shape), "M-RoPE is not supported")
        if pos.shape[-1] != S or pos.shape[0] not in (1, B):
            # a position tensor of a different forward (stale hook) or a model slicing tokens: refuse, never guess
            fail(f"cache.update layer {index}: position_ids", f"[B|1, S] = [{B}|1, {S}] for {S} new keys",
                 tuple(pos.shape))
        return pos.to(device=k.device, dtype=torch.long).expand(B, S)

    # -- transformers Cache protocol -----------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._settle()
        return self.layers[layer_idx].n if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        self._settle()
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder batch rows for beam search."""
        self.reorder_rows_(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_rows_(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.batch_size > 0:
            self.reorder_rows_(torch.arange(self.table.batch_size).repeat_interleave(repeats))

    def __repr__(self) -> str:
        return PositionedKV.__repr__(self)
