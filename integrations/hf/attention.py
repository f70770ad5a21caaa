"""One declared attention binding for transformers: which backend serves which model and which cache, in a scope.

transformers calls an attention function by the name in `model.config._attn_implementation` and never passes the
cache. kvpos registers ONE function, "kvpos", on first use. It reads the binding of the current scope (a
`contextvars.ContextVar`: per thread and per asyncio task, so concurrent requests never see each other's binding):

    with bind_attention(model, backend, cache):      # e.g. kvpos.integrations.ape.ApeBackend(...)
        model(...) / model.generate(...)             # every attention call of `model` goes to backend(call)

Outside any binding, and for modules of another model, "kvpos" is exactly transformers' SDPA (same function, same
mask), so switching a model to it changes nothing by itself. A backend that cannot serve a call raises; it never
runs something else quietly.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvpos._checks import fail
from kvpos.cache import PositionedKV

__all__ = ["NAME", "AttentionCall", "AttentionBackend", "Binding", "bind_attention", "current_binding",
           "allowed_from_mask", "layers_heads"]

NAME = "kvpos"
_BINDING: contextvars.ContextVar["Binding | None"] = contextvars.ContextVar("kvpos_attention_binding", default=None)


@dataclass
class AttentionCall:
    """One attention call of one layer, as transformers makes it.

    query [B, Hq, q, D] rotated; key/value [B, H, N, D] (what cache.update returned: every slot of the layer);
    mask: transformers' 4-D mask (bool or additive float) or None; scaling: the softmax scale."""

    layer: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    scaling: float
    _plain: Callable[[], torch.Tensor]

    def plain(self) -> torch.Tensor:
        """transformers' SDPA for this call, [B, q, Hq, D] (what a backend returns when plain attention is its exact
        answer)."""
        return self._plain()

    def allowed(self) -> torch.Tensor:
        """[B|1, 1, q, N] bool: which keys each query may attend to."""
        return allowed_from_mask(self.mask, self.query.shape[2], self.key.shape[2], self.key.device)

    @staticmethod
    def finish(out: torch.Tensor) -> torch.Tensor:
        """A backend's [B, Hq, q, D] result in transformers' layout [B, q, Hq, D]."""
        return out.transpose(1, 2).contiguous()


class AttentionBackend(Protocol):
    """What a binding serves: `backend(call, binding) -> [B, q, Hq, D]`; `needs_cache` says whether it reads the
    bound cache (then the call's keys must be that cache's keys)."""

    needs_cache: bool

    def __call__(self, call: AttentionCall, binding: "Binding") -> torch.Tensor: ...


@dataclass
class Binding:
    """A backend bound to a model (its attention modules) and optionally a cache, for one scope."""

    backend: AttentionBackend
    cache: PositionedKV | None
    modules: frozenset

    def cache_layer_keys(self, call: AttentionCall) -> PositionedKV:
        """The bound cache, after checking that the call's keys are its layer's keys (same slots, same storage)."""
        cache = self.cache
        if cache is None:
            fail(f"{type(self.backend).__name__}", "a cache bound with the backend", None,
                 "bind_attention(model, backend, cache)")
        n = cache.layers[call.layer].n
        if not cache.holds_keys(call.layer, call.key):
            fail(f"{type(self.backend).__name__} layer {call.layer}",
                 f"the keys of the bound cache ({n} slots)", f"other keys ({call.key.shape[2]} slots)",
                 "run the forward with cache=<the bound cache>; the backend reads that cache's slots")
        return cache


def allowed_from_mask(mask: torch.Tensor | None, q: int, N: int, device: torch.device) -> torch.Tensor:
    """[B|1, 1, q, N] bool from transformers' 4-D mask (bool, or additive float); None = causal over physical slots
    (the queries are the last q of N slots)."""
    if mask is None:
        i = torch.arange(q, device=device)[:, None] + (N - q)
        return (torch.arange(N, device=device)[None] <= i)[None, None]
    if mask.dtype == torch.bool:
        return mask[..., -N:]
    return mask[..., -N:] > torch.finfo(mask.dtype).min / 2


def _kvpos_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The "kvpos" attention implementation: the bound backend for modules of the bound model, SDPA otherwise."""
    b = _BINDING.get()
    if b is None or id(module) not in b.modules:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    sm = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    call = AttentionCall(module.layer_idx, query, key, value, attention_mask, sm,
                         lambda: sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                                        scaling=scaling, **kwargs)[0])
    return b.backend(call, b), None


def _kvpos_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """SDPA's mask; a concrete one (no causal skip) while a binding is active: backends need to know what each
    query may see."""
    if _BINDING.get() is not None:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _switch(model: torch.nn.Module) -> None:
    """Register "kvpos" (idempotent) and switch `model` to it; only from SDPA, whose numerics it keeps."""
    AttentionInterface.register(NAME, _kvpos_attention)
    AttentionMaskInterface.register(NAME, _kvpos_mask)
    cur = model.config._attn_implementation
    if cur == NAME:
        return
    if cur != "sdpa":
        fail("bind_attention model", "a model using attn_implementation='sdpa' (kvpos's attention is SDPA outside a "
             "binding)", repr(cur), "load it with attn_implementation='sdpa' or call model.set_attn_implementation('sdpa')")
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        fail("bind_attention model", f"a model that accepts attn_implementation={NAME!r}",
             f"{type(model).__name__} kept {model.config._attn_implementation!r}",
             "this architecture does not use transformers' AttentionInterface")


@contextlib.contextmanager
def bind_attention(model: torch.nn.Module, backend: AttentionBackend, cache: PositionedKV | None = None
                   ) -> Iterator[Binding]:
    """Within the block, `model`'s attention calls (this thread / task only) go to `backend`, reading `cache`.

    The model is switched to the "kvpos" implementation (SDPA outside a binding) and stays on it."""
    if getattr(backend, "needs_cache", False) and not isinstance(cache, PositionedKV):
        fail(f"{type(backend).__name__} cache", "a PositionedCache (the cache the forward runs with)",
             type(cache).__name__, exc=TypeError)
    _switch(model)
    binding = Binding(backend, cache, frozenset(id(m) for m in model.modules()))
    token = _BINDING.set(binding)
    try:
        yield binding
    finally:
        _BINDING.reset(token)


def current_binding() -> Binding | None:
    """The binding of the current scope (None outside bind_attention)."""
    return _BINDING.get()


def layers_heads(model: torch.nn.Module) -> tuple[int, int]:
    """(L layers, Hq query heads) of a transformers causal LM."""
    cfg = getattr(model.config, "text_config", model.config)
    return int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
