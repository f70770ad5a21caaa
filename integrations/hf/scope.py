"""The per-forward scope: what one thread's running forward carries between the calls transformers makes, in ONE
context variable (per thread and per asyncio task, so concurrent requests never see each other's forward).

transformers calls the rotary module, `cache.update` and the attention function of each layer separately and
passes nothing of kvpos's between them. Two things must travel:

    note     ForwardNote   which model runs and at which positions (recorded by the rotary-module hook at the start
                           of a forward; consumed by the cache's first write of that forward)
    handoff  RawHandoff    raw keys a storage "raw" / "int8" cache just returned to a layer (set by cache.update,
                           taken by that layer's "kvpos" attention call, which rotates them on read)

The scope is immutable: each change sets a new one, so a scope copied into another task never changes under it.
(The attention binding, `bind_attention`, is a user scope around a whole call, not per forward: attention.py.)"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["ForwardScope", "current_scope", "record_note", "take_note", "hand_off", "pending_handoff",
           "drop_handoff"]


@dataclass(frozen=True)
class ForwardScope:
    """The running forward of this thread / task (see the module)."""

    note: Any = None          # ForwardNote | None (kvpos.integrations.hf.positions)
    handoff: Any = None       # RawHandoff | None (kvpos.integrations.hf.attention)


_SCOPE: contextvars.ContextVar[ForwardScope] = contextvars.ContextVar("kvpos_forward_scope", default=ForwardScope())


def current_scope() -> ForwardScope:
    return _SCOPE.get()


def record_note(note: Any) -> None:
    """The rotary-module hook: a forward of `note.model` starts at `note.positions`."""
    _SCOPE.set(replace(_SCOPE.get(), note=note))


def take_note() -> Any:
    """The running forward's note, consumed (the next forward records its own), or None."""
    scope = _SCOPE.get()
    if scope.note is not None:
        _SCOPE.set(replace(scope, note=None))
    return scope.note


def hand_off(read: Any) -> None:
    """Announce raw keys to this thread's next "kvpos" attention call (the cache's update calls this)."""
    _SCOPE.set(replace(_SCOPE.get(), handoff=read))


def pending_handoff() -> Any:
    """The last hand-off announced in this thread (taken or not: see RawHandoff.calls), or None."""
    return _SCOPE.get().handoff


def drop_handoff() -> None:
    """Withdraw the pending hand-off (a refused one must not be taken by a later call)."""
    _SCOPE.set(replace(_SCOPE.get(), handoff=None))
