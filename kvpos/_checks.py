"""One place for argument errors: every message names what, expected, got and (where useful) the fix."""
from __future__ import annotations

from typing import Any, NoReturn

import torch


def fail(what: str, expected: str, got: Any, fix: str | None = None, exc: type[Exception] = ValueError) -> NoReturn:
    """Raise `exc` with the house message format: "<what>: expected <expected>, got <got>[; <fix>]"."""
    msg = f"{what}: expected {expected}, got {got}"
    if fix:
        msg += f"; {fix}"
    raise exc(msg)


def check_int(what: str, value: Any) -> int:
    """Return `value` as a Python int, or raise TypeError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int,)):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            return int(value.item())
        fail(what, "an int", f"{type(value).__name__} {value!r}", exc=TypeError)
    return int(value)


def check_fraction(what: str, value: Any) -> float:
    """Return `value` (an int or float in [0, 1]) as a float, or raise ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        fail(what, "a fraction in [0, 1]", value)
    return float(value)


def check_range(what: str, start: Any, end: Any, n: int) -> tuple[int, int]:
    """Validate a slot range [start, end) inside [0, n]."""
    start, end = check_int(f"{what} start", start), check_int(f"{what} end", end)
    if not 0 <= start <= end <= n:
        fail(what, f"0 <= start <= end <= T={n}", f"start={start}, end={end}")
    return start, end


def check_tensor(what: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        fail(what, "a torch.Tensor", type(x).__name__, exc=TypeError)
    return x


def as_positions(what: str, pos: Any, batch: int, length: int, device: torch.device | None = None) -> torch.Tensor:
    """Return positions as an int64 tensor [B, S]; accept [S], [1, S] or [B, S] (ints, lists or integer tensors)."""
    if not isinstance(pos, torch.Tensor):
        try:
            pos = torch.as_tensor(pos)
        except Exception:  # noqa: BLE001 - any conversion failure is a type error for the caller
            fail(what, "an integer tensor or list of ints", type(pos).__name__, exc=TypeError)
        if pos.numel() == 0:
            pos = pos.long()                    # [] converts to float32; an empty list of ints is meant
    if pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
        fail(what, "integer positions (int64)", f"dtype {pos.dtype}", "pass torch.long positions", exc=TypeError)
    if pos.dim() == 1:
        pos = pos[None]
    if pos.dim() != 2 or pos.shape[-1] != length or pos.shape[0] not in (1, batch):
        fail(what, f"{length} positions, shape [S]={length} or [B, S]={(batch, length)}", f"shape {tuple(pos.shape)}")
    pos = pos.to(dtype=torch.long, device=device)
    if pos.numel() and int(pos.min()) < 0:
        fail(what, "positions >= 0", f"min {int(pos.min())}")
    return pos.expand(batch, length)


def as_token_ids(what: str, ids: Any) -> torch.Tensor:
    """1-D int64 token ids from [S] or [1, S] (tensor, list or tuple); raises naming `what` otherwise."""
    t = torch.as_tensor(ids)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
        fail(what, "1-D integer token ids [S] (or [1, S])", f"{tuple(t.shape)} {t.dtype}")
    return t.long()


def check_slot_index(what: str, slots: Any, n: int) -> torch.Tensor:
    """1-D int64 slot indices in [0, n), distinct; refuses floats, bools (a mask: use .nonzero()) and other shapes."""
    if isinstance(slots, torch.Tensor):
        idx = slots
    else:
        if isinstance(slots, (str, bytes)) or not hasattr(slots, "__iter__"):
            fail(what, "a 1-D list or tensor of slot indices", type(slots).__name__, exc=TypeError)
        items = list(slots)
        for i, x in enumerate(items):
            if isinstance(x, bool) or not isinstance(x, int):
                fail(f"{what}[{i}]", "an int slot index", f"{type(x).__name__} {x!r}", exc=TypeError)
        idx = torch.tensor(items, dtype=torch.long)
    if idx.dtype == torch.bool:
        fail(what, "integer slot indices", "a bool mask", "pass mask.nonzero().flatten()", exc=TypeError)
    if idx.is_floating_point() or idx.is_complex():
        fail(what, "integer slot indices", f"dtype {idx.dtype}", exc=TypeError)
    if idx.dim() != 1:
        fail(what, "a 1-D index list", tuple(idx.shape))
    idx = idx.long().cpu()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        fail(what, f"indices in [0, {n})", f"min {int(idx.min())}, max {int(idx.max())}")
    if idx.unique().numel() != idx.numel():
        fail(what, "distinct indices", "repeated indices")
    return idx
