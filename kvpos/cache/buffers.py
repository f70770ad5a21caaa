"""Buffer allocation and growth shared by the slot table and the storages (all-or-nothing regrow; fixed
capacity buffers hold one overflow slot)."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from .._checks import fail


GROWTH = 2.0            # capacity multiplier when a buffer is full
# fixed capacity C: buffers hold C + 1 slots; a compiled forward past C writes into the last one (never a valid
# slot) and then raises, instead of indexing past the buffer in generated code
_OVERFLOW = 1
_MIN_CAPACITY = 64
MAX_POSITION = 2 ** 40  # positions must stay below this (far beyond any RoPE context; keeps int64 math exact)
SEGMENT_RANGE = (-(2 ** 31), 2 ** 31 - 1)   # segment labels are int32


def _grown(old_cap: int, need: int) -> int:
    cap = max(old_cap, _MIN_CAPACITY)
    while cap < need:
        cap = int(math.ceil(cap * GROWTH))
    return cap


def _alloc(shape: Sequence[int], dtype: torch.dtype, device: torch.device, fill: float | bool | None = None
           ) -> torch.Tensor:
    """torch.empty (or full, with `fill`) whose failure is a MemoryError naming the size (torch raises a RuntimeError)."""
    try:
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        return t if fill is None else t.fill_(fill)
    except (RuntimeError, MemoryError) as e:
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        raise MemoryError(f"cache buffer: expected {n / 2**30:.2f} GiB for shape {list(shape)} {dtype}, got an "
                          f"allocation failure ({type(e).__name__}); the cache is unchanged") from e


def _sized(fixed: int | None, old: int, need: int, grow: Callable[[int, int], int]) -> int:
    """The capacity for `need` slots: `grow(old, need)`, or the fixed capacity (refusing more than it holds)."""
    if fixed is None:
        return grow(old, need)
    if need > fixed:
        fail("fixed-capacity cache", f"at most {fixed} slots (its capacity)", f"{need} slots",
             "build the cache with a larger capacity=, or without capacity= (buffers then grow)")
    return fixed


def _static_buffer(t: torch.Tensor) -> torch.Tensor:
    """Tell torch.compile that a fixed-capacity buffer keeps its address (as transformers' StaticCache does: the
    compiler then treats it like a module buffer, and CUDA graphs can capture it); no effect on eager code."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
    return t


def _dynamic_capacity(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Tell torch.compile that `t`'s capacity dimension changes (a regrow then reuses the compiled graphs instead of
    specialising on each size); no effect on eager code. Inside a trace the new buffer is already symbolic."""
    if not torch.compiler.is_compiling():
        torch._dynamo.maybe_mark_dynamic(t, dim)
    return t


def _regrow(bufs: Sequence[torch.Tensor], dim: int, cap: int, valid: int, fixed: bool = False) -> list[torch.Tensor]:
    """New buffers of capacity `cap` along `dim` holding the first `valid` entries of each of `bufs` (fixed: a
    fixed-capacity cache's buffers: zeros beyond `valid`, static size under torch.compile).

    All new buffers are allocated before any copy, so an allocation failure leaves the caller's buffers in use."""
    new = []
    for b in bufs:
        shape = list(b.shape)
        shape[dim] = cap + _OVERFLOW if fixed else cap
        new.append(_static_buffer(_alloc(shape, b.dtype, b.device, 0)) if fixed else
                   _dynamic_capacity(_alloc(shape, b.dtype, b.device), dim))
    for b, n in zip(bufs, new):
        n.narrow(dim, 0, valid).copy_(b.narrow(dim, 0, valid))
    return new




def _grown_tight(old_cap: int, need: int) -> int:
    """Capacity for storage="raw": `need` plus a small step (at most ~0.8% slack beyond 2k slots; a regrow copies
    the valid slots once per step, still far less than a cat per token)."""
    return max(old_cap, need + max(16, need // 128)) if need > old_cap else old_cap
