"""The storage modes as data: what each holds and can do. `storage_mode(name)` resolves the user-facing
`storage=` string once (the only place that compares it); everything else asks the mode's capabilities.

    mode      holds                                   keeps_rotated  quantized  fixed_capacity  recompute
    rotated   raw keys, rotated keys, values          yes            no         yes             yes
    raw       raw keys, values (rotated on read)      no             no         no              yes
    int8      int8 raw keys and values + scales       no             yes        no              no
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._checks import fail

__all__ = ["StorageMode", "ROTATED", "RAW", "INT8", "STORAGE_MODES", "STORAGES", "storage_mode"]


@dataclass(frozen=True)
class StorageMode:
    """A storage mode's capabilities (compare modes by identity: `a is b`)."""

    name: str
    keeps_rotated: bool     # rotated keys are stored: attention reads them; a position change re-rotates moved slots
    quantized: bool         # keys and values are int8 codes with scales (approximate)
    fixed_capacity: bool    # a fixed-capacity mode (static shapes for torch.compile) exists
    recompute: bool         # overwrite / recompute forwards (edit and RAG repairs) are supported

    @property
    def rotates_on_read(self) -> bool:
        """Keys are rotated when read (from raw or int8 storage), never kept rotated."""
        return not self.keeps_rotated

    def __repr__(self) -> str:
        return f"StorageMode({self.name!r})"


ROTATED = StorageMode("rotated", keeps_rotated=True, quantized=False, fixed_capacity=True, recompute=True)
RAW = StorageMode("raw", keeps_rotated=False, quantized=False, fixed_capacity=False, recompute=True)
INT8 = StorageMode("int8", keeps_rotated=False, quantized=True, fixed_capacity=False, recompute=False)
STORAGE_MODES = (ROTATED, RAW, INT8)
STORAGES = tuple(m.name for m in STORAGE_MODES)


def storage_mode(storage: Any, what: str = "storage") -> StorageMode:
    """The StorageMode named `storage` ("rotated", "raw" or "int8"; a StorageMode passes through); ValueError
    naming `what` otherwise."""
    if isinstance(storage, StorageMode):
        return storage
    for mode in STORAGE_MODES:
        if storage == mode.name:
            return mode
    fail(what, " or ".join(repr(x) for x in STORAGES), repr(storage))
