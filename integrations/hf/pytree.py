"""torch.export support: a growing PositionedCache as a pytree node (opt-in, like transformers' own cache
registration)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvpos._checks import fail

from .cache import PositionedCache


@dataclass(frozen=True)
class _TreeContext:
    """What a flattened PositionedCache keeps besides its tensors: compared by value (the specs by their rotation
    keys); the model binding and the spec objects travel along without taking part in comparisons."""

    cls: type
    storage: str
    raw_dtype: torch.dtype | None
    spec_keys: tuple
    layers: tuple                                   # per layer: the dtype of the keys attention reads, or None
    table: bool                                     # whether the slot table is allocated
    specs: tuple = field(compare=False)
    origin: Any = field(compare=False)
    model_id: str | None = field(compare=False)


def _tree_flatten(cache: PositionedCache) -> tuple[list[torch.Tensor], _TreeContext]:
    """Leaves: per allocated layer its valid slots of each buffer ([B, H, T, D] views), then the table's
    positions / visibility / segments ([B, T]). T is a tensor size, so an export can make it dynamic."""
    if cache.capacity is not None:
        fail("torch.export of a PositionedCache", "a growing cache (capacity=None)", f"capacity={cache.capacity}",
             "export with PositionedCache.from_model(model); a fixed capacity's slot count is not a tensor size")
    if cache.offloading:
        fail("torch.export of a PositionedCache", "offloading=False", "offloading=True")
    if cache.mode.quantized:
        fail("torch.export of a PositionedCache", "storage 'rotated' or 'raw'", "storage='int8'",
             "quantized storage runs eagerly only")
    leaves: list[torch.Tensor] = []
    for l in cache.layers:
        if l.allocated:
            leaves += [b[:, :, : l.n] for b in l.buffers()]
    table = cache.table.valid_buffers()
    if table is not None:
        leaves += list(table)
    ctx = _TreeContext(type(cache), cache.storage, cache.raw_dtype, tuple(s.identity for s in cache.specs),
                       tuple(l.key_dtype if l.allocated else None for l in cache.layers), table is not None,
                       tuple(cache.specs), cache.origin, cache.model_id)
    return leaves, ctx


def _tree_unflatten(leaves: Any, ctx: _TreeContext) -> PositionedCache:
    """A cache around `leaves` (the tensors themselves, not copies): every layer holds exactly its T slots."""
    cache = ctx.cls(list(ctx.specs), ctx.raw_dtype, ctx.origin, ctx.model_id, storage=ctx.storage)
    it = iter(list(leaves))
    for l, key_dtype in zip(cache.layers, ctx.layers):
        if key_dtype is not None:
            l.set_buffers([next(it) for _ in l.buffer_names])
            l.key_dtype, l.n = key_dtype, l.v.shape[2]
    if ctx.table:
        cache.table.adopt_(next(it), next(it), next(it))
    return cache


def _tree_flatten_with_keys(cache: PositionedCache) -> tuple[list, _TreeContext]:
    from torch.utils._pytree import SequenceKey

    leaves, ctx = _tree_flatten(cache)
    return [(SequenceKey(i), x) for i, x in enumerate(leaves)], ctx


def register_pytree(cls: type = PositionedCache) -> None:
    """Register `cls` as a torch pytree node, so that `torch.export.export(model, ..., {"cache": cache})` accepts a
    PositionedCache as an input and returns one (what transformers' exporters do for their own caches). Opt-in and
    idempotent: registration changes how torch's tree utilities see every instance, so kvpos never does it on
    import. The exported program keeps the RoPE specs and model binding in memory (no `torch.export.save`)."""
    import torch.utils._pytree as pytree

    if cls in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(cls, _tree_flatten, _tree_unflatten,
                                flatten_with_keys_fn=_tree_flatten_with_keys)
