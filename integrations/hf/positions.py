"""How positions reach the cache: the rotary-module hook that records each forward (model and positions, in the
per-forward scope: kvpos.integrations.hf.scope) and the positions a model or a direct caller passes to
`cache.update`."""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch


from .scope import record_note
from .specs import rotary_modules


@dataclass(frozen=True)
class ForwardNote:
    """Which model's forward is running (weak reference) and its positions, as the rotary module saw them."""

    model: weakref.ref
    positions: torch.Tensor | None


def _record_forward(model_ref: weakref.ref, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():
        return          # torch.compile cannot trace context variables; traced forwards are checked by shape instead
    pos = kwargs.get("position_ids")
    if pos is None and len(args) >= 2:
        pos = args[1]
    record_note(ForwardNote(model_ref, pos))


def install_forward_hook(model: torch.nn.Module) -> weakref.ref:
    """Record every forward of `model` from its rotary modules (idempotent); returns the model's weak reference."""
    ref = weakref.ref(model)
    for m in rotary_modules(model):
        mine = [h for h in m._forward_pre_hooks.values()
                if isinstance(h, functools.partial) and h.func is _record_forward]
        if any(h.args[0]() is model for h in mine):
            continue
        m.register_forward_pre_hook(functools.partial(_record_forward, ref), with_kwargs=True)
    return ref


def passed_positions(kwargs: dict) -> torch.Tensor | None:
    """The position_ids handed to `cache.update`: by a model (`kwargs={...}` or keywords) or by a direct caller
    (`cache_kwargs={...}`, or that dict as the fourth positional argument), or None."""
    for name in ("cache_kwargs", "kwargs"):
        inner = kwargs.get(name)
        if isinstance(inner, dict) and inner.get("position_ids") is not None:
            return inner["position_ids"]
    return kwargs.get("position_ids")


def direct_positions(kwargs: dict) -> bool:
    """True when a direct caller (not a model forward) passed the positions: `cache_kwargs={"position_ids": ...}`."""
    inner = kwargs.get("cache_kwargs")
    return isinstance(inner, dict) and inner.get("position_ids") is not None


NO_POSITIONS_FIX = ("run the model's forward (its rotary module records the positions), or pass them: "
                     "cache.update(k, v, layer_idx, cache_kwargs={'position_ids': pos}) with pos int64 [B|1, S]")
