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
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvpos._checks import fail
from kvpos.cache import PositionedKV

from .scope import drop_handoff, pending_handoff

__all__ = ["NAME", "AttentionCall", "AttentionBackend", "Binding", "StepMemo", "bind_attention", "current_binding",
           "decode_mask",
           "allowed_from_mask", "layers_heads", "RawHandoff", "uses_kvpos_attention", "switch_to_kvpos"]

NAME = "kvpos"
_BINDING: contextvars.ContextVar["Binding | None"] = contextvars.ContextVar("kvpos_attention_binding", default=None)


@dataclass
class AttentionCall:
    """One attention call of one layer, as transformers makes it.

    query [B, Hq, q, D] rotated; key/value [B, H, N, D] (what cache.update returned: every slot of the layer);
    mask: transformers' 4-D mask (bool or additive float) or None; scaling: the softmax scale; n_keys: N.

    A decode step of a storage="raw" cache hands raw keys to attention: a bound backend's call then gets its rotated
    `key` / `value` only when it reads them (rotated into the read buffer on first access, `read` below), so a
    backend that reads the cache's raw keys itself (Ms-PoE, PINE-lite: the fused position-map kernel) never pays
    for rotating every key."""

    layer: int
    query: torch.Tensor
    _key: torch.Tensor | None
    _value: torch.Tensor | None
    mask: torch.Tensor | None
    scaling: float
    _plain: Callable[[], torch.Tensor]
    n_keys: int = 0
    read: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None   # lazy (key, value) of a raw hand-off
    handed_by: PositionedKV | None = None                                 # the cache that handed its raw keys
    window: int | None = None     # the layer's sliding window (keys at slot distance >= window hidden), None: full
    read_state: Any = None        # a raw hand-off's read state: the forward's tables, shared by all its layers

    @property
    def key(self) -> torch.Tensor:
        if self._key is None:
            self._key, self._value = self.read()
        return self._key

    @property
    def value(self) -> torch.Tensor:
        if self._value is None:
            self._key, self._value = self.read()
        return self._value

    def plain(self) -> torch.Tensor:
        """transformers' SDPA for this call, [B, q, Hq, D] (what a backend returns when plain attention is its exact
        answer)."""
        return self._plain()

    def allowed(self) -> torch.Tensor:
        """[B|1, 1, q, N] bool: which keys each query may attend to."""
        return allowed_from_mask(self.mask, self.query.shape[2], self.n_keys, self.query.device)

    @staticmethod
    def finish(out: torch.Tensor) -> torch.Tensor:
        """A backend's [B, Hq, q, D] result in transformers' layout [B, q, Hq, D]."""
        return out.transpose(1, 2).contiguous()


class StepMemo:
    """What a bound backend derives from a decode call once per forward and mask, not once per layer: every layer of
    one forward gets the same raw hand-off read state (`AttentionCall.read_state`) and transformers' mask tensor
    (one per layer type), so `get(call, make)` calls `make()` for the first layer of each and returns its value to
    the others. Kept by identity (the read state, the mask object) and the mask's version counter, so a mask
    written in place is seen; a call without a read state (no raw hand-off) is never kept. A new forward (a new
    read state) drops what the last one kept; the read state itself is held weakly (its tables and scratch go with
    the forward, not with the backend)."""

    def __init__(self) -> None:
        self._forward: weakref.ref | None = None
        self._kept: dict = {}             # (id(mask), window) -> (mask, its version, value)

    def get(self, call: AttentionCall, make: Callable[[], Any]) -> Any:
        st, m = call.read_state, call.mask
        if st is None:
            return make()
        if self._forward is None or self._forward() is not st:
            self._forward, self._kept = weakref.ref(st), {}
        key = (id(m), call.window)
        got = self._kept.get(key)
        if got is not None and got[0] is m and (m is None or got[1] == m._version):
            return got[2]
        value = make()
        self._kept[key] = (m, None if m is None else m._version, value)
        return value


def decode_mask(allowed: torch.Tensor) -> torch.Tensor | None:
    """A decode row's visibility allowed [B, 1, 1, N] bool as the fused kernels take it: None where every key is
    visible, else additive float32 [B, N] (-inf on the hidden keys)."""
    if bool(allowed.all()):
        return None
    return torch.zeros(allowed.shape[0], allowed.shape[-1]).masked_fill_(~allowed[:, 0, 0], float("-inf"))


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
        if call.handed_by is not None and call.handed_by is cache and call.n_keys == n:
            return cache                  # its raw keys, handed to this very call (RawHandoff.check_call)
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


@dataclass
class RawHandoff:
    """Raw keys a storage="raw" PositionedCache handed to the next attention call of `layer` (one decode token per
    row): the call rotates them on read itself. `strict`: the cache's read="fused" (an attention call the kernel
    cannot serve raises, after dropping the forward's slots from `n0` on) instead of rotating into a buffer.

    The hand-off is checked at every call: the attention of `layer` must receive exactly the keys and values the
    cache returned (`ptr`, `vptr`), once. An architecture that changes them in between (repeats them, splits the
    values, calls attention twice) would otherwise read unrotated keys as if rotated: the call raises instead
    (`calls` counts the attention calls that took this hand-off)."""

    cache_ref: Any                    # weakref.ref to the PositionedKV (a context variable never keeps a cache alive)
    layer: int
    ptr: int
    n: int
    n0: int
    state: Any
    strict: bool
    vptr: int = 0
    modules: frozenset = frozenset()  # ids of the modules of the cache's model (other models' calls pass by)
    calls: int = 0

    @property
    def cache(self) -> PositionedKV:
        cache = self.cache_ref()
        if cache is None:
            fail(f"raw keys of layer {self.layer}", "their PositionedCache alive", "a dropped cache")
        return cache

    def current(self) -> bool:
        """Whether the cache still holds exactly the slots it handed out (alive, the layer's `n` slots in the same
        key buffer). A stale hand-off (the cache moved on: more or fewer slots, a regrown buffer, or a dropped
        cache) is inert: an attention call whose keys happen to reuse its freed address must not be judged by it,
        nor its cache's slots dropped."""
        cache = self.cache_ref()
        if cache is None:
            return False
        l = cache.layers[self.layer]
        return l.allocated and l.n == self.n and l.key_store.data_ptr() == self.ptr

    def matches(self, module: torch.nn.Module, key: torch.Tensor) -> bool:
        return getattr(module, "layer_idx", None) == self.layer and key.data_ptr() == self.ptr \
            and key.shape[2] == self.n

    def check_call(self, module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether this attention call takes the hand-off (raises if it touches it wrongly)."""
        mine = getattr(module, "layer_idx", None) == self.layer and id(module) in self.modules
        raw_key = key.data_ptr() == self.ptr
        if not mine or (self.calls and not raw_key) or not self.current():
            return False
        why = None
        if self.calls:
            why = "a second attention call on the raw keys (the architecture attends twice per layer)"
        elif not raw_key or key.shape[2] != self.n:
            why = (f"keys {tuple(key.shape)} other than the raw keys the cache returned (the architecture changes "
                   "them between cache.update and attention, e.g. repeats them)")
        elif value.data_ptr() != self.vptr:
            why = "values other than those the cache returned (the architecture changes them before attention)"
        if why is not None:
            drop_handoff()
            self.cache.drop_tail_(self.n0)
            fail(f"PositionedCache(storage={self.cache.storage!r}) layer {self.layer}: raw-key hand-off",
                 "the attention call receiving the raw keys and values the cache returned, once", why,
                 "build the cache with read='torch' (keys rotated into a buffer: exact for every architecture)")
        self.calls += 1
        return True


_UNFUSED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


def _why_not_fused(module: torch.nn.Module, query: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float, kwargs: dict) -> str | None:
    """Why the fused raw-key kernel cannot serve this call, or None."""
    for k in _UNFUSED_KWARGS:
        if kwargs.get(k) is not None:
            return f"the attention call passes {k}"
    if dropout:
        return f"dropout={dropout}"
    if kwargs.get("output_attentions"):
        return "output_attentions=True"
    if query.shape[2] != 1:
        return f"{query.shape[2]} query tokens per row (the kernel serves one)"
    if query.shape[1] % value.shape[1] or query.shape[1] // value.shape[1] > 16:
        return f"{query.shape[1]} query heads over {value.shape[1]} kv heads (needs a multiple, at most 16x)"
    if attention_mask is not None and attention_mask.dim() != 4:
        return f"a {attention_mask.dim()}-D attention mask"
    return None


def _additive_mask(mask: torch.Tensor | None, N: int) -> torch.Tensor | None:
    """transformers' 4-D mask for one query token [B|1, 1|H, 1, >=N] -> additive float32 [B|1, N], or None."""
    if mask is None:
        return None
    m = mask[:, 0, -1, -N:]
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=torch.float32).masked_fill_(~m, float("-inf"))
    return m.to(torch.float32)


def _fused_read(read: RawHandoff, module: torch.nn.Module, query: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                kwargs: dict) -> tuple[torch.Tensor | None, str | None]:
    """(out [B, 1, Hq, D] from the fused kernel over the cache's raw keys, None) or (None, why it cannot serve)."""
    why = _why_not_fused(module, query, value, attention_mask, dropout, kwargs)
    if why is not None:
        return None, why
    sm = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    cache = read.cache
    out = cache.decode_fused(read.layer, read.state, query[:, :, 0],
                             _additive_mask(attention_mask, cache.layers[read.layer].n), sm)
    if out is None:
        return None, "the kernel cannot serve these tensors (kvpos._kernels.kernel_status())"
    cache.read_counts["fused"] += 1
    return out.to(query.dtype)[:, None], None


def _raw_attention(read: RawHandoff, module: torch.nn.Module, query: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                   kwargs: dict) -> torch.Tensor | None:
    """[B, 1, Hq, D] from the fused kernel over the cache's raw keys, or None (the caller rotates into a buffer)."""
    out, why = _fused_read(read, module, query, value, attention_mask, dropout, scaling, kwargs)
    if out is None and read.strict:
        read.cache.drop_tail_(read.n0)
        fail(f"PositionedCache(read='fused') layer {read.layer}", "a decode attention call the fused raw-key "
             "kernel serves", why, "use read='auto' (rotate into a buffer where the kernel cannot serve)")
    return out


def _kvpos_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The "kvpos" attention implementation: the bound backend for modules of the bound model, SDPA otherwise.
    Raw keys handed out by a storage="raw" cache are attended by the fused kernel, or rotated first."""
    if torch.compiler.is_compiling() and not getattr(module, "_kvpos_bound", 0):
        # traced: no binding on this model in any thread (bind_attention counts them on the modules), and a cache's
        # traced update never hands out raw keys; context variables would split the graph, so SDPA directly
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b = _BINDING.get()
    read = pending_handoff()
    bound = b is not None and id(module) in b.modules
    if read is not None and read.check_call(module, key, value):
        if bound:                                           # the backend rotates only if it reads call.key
            return b.backend(_call(module, query, None, value, attention_mask, dropout, scaling, kwargs, read), b), None
        out = _raw_attention(read, module, query, value, attention_mask, dropout, scaling, kwargs)
        if out is not None:
            return out, None
        key, value = _rotated(read)                         # the reference path: keys rotated into a buffer
    if not bound:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return b.backend(_call(module, query, key, value, attention_mask, dropout, scaling, kwargs), b), None


def _rotated(read: RawHandoff) -> tuple[torch.Tensor, torch.Tensor]:
    """The handed-off layer's keys rotated into the read buffer, and its values (counted as a torch read)."""
    out = read.cache.read_layer(read.layer)
    read.cache.read_counts["torch"] += 1
    return out


def _call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
          attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, kwargs: dict,
          read: RawHandoff | None = None) -> AttentionCall:
    """The AttentionCall of a bound module; with a raw hand-off `read` (key None, value the values it handed): the
    keys rotated on first access, and `plain()` read by the fused kernel where it serves (as an unbound call)."""
    sm = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    call = AttentionCall(module.layer_idx, query, key, None if read is not None else value, attention_mask, sm,
                         lambda: None, key.shape[2] if key is not None else read.n,
                         None if read is None else (lambda: _rotated(read)),
                         None if read is None else read.cache, _window(module, kwargs),
                         None if read is None else read.state)

    def plain() -> torch.Tensor:
        if read is not None:
            out = _fused_read(read, module, query, value, attention_mask, dropout, scaling, kwargs)[0]
            if out is not None:
                return out
        return sdpa_attention_forward(module, query, call.key, call.value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)[0]

    call._plain = plain
    return call


def _window(module: torch.nn.Module, kwargs: dict) -> int | None:
    """The sliding window transformers applies to this module's mask (its `sliding_window` argument, or the
    module's attribute), None for a full-attention layer."""
    w = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    return None if w is None else int(w)


def _kvpos_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """SDPA's mask; a concrete one (no causal skip) while a binding is active: backends need to know what each
    query may see."""
    if not torch.compiler.is_compiling() and _BINDING.get() is not None:   # (traced: no context variable; a
        kwargs["allow_is_causal_skip"] = False     # skipped mask reads as causal in allowed_from_mask anyway)
    return sdpa_mask(*args, **kwargs)


def _attn_configs(model: torch.nn.Module) -> list:
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return [cfg] if text is cfg else [cfg, text]


def uses_kvpos_attention(model: torch.nn.Module) -> bool:
    """Whether every attention of `model` goes through the "kvpos" implementation."""
    return all(getattr(c, "_attn_implementation", None) == NAME for c in _attn_configs(model))


def switch_to_kvpos(model: torch.nn.Module) -> None:
    """Switch `model` (attn_implementation 'sdpa') to "kvpos": SDPA itself for ordinary keys, the raw-key reader
    for a storage="raw" cache's decode steps."""
    _switch(model)


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
    modules = list(model.modules())
    binding = Binding(backend, cache, frozenset(id(m) for m in modules))
    token = _BINDING.set(binding)
    for m in modules:              # seen by compiled code, which cannot read the context variable
        m._kvpos_bound = getattr(m, "_kvpos_bound", 0) + 1
    try:
        yield binding
    finally:
        _BINDING.reset(token)
        for m in modules:
            m._kvpos_bound -= 1


def current_binding() -> Binding | None:
    """The binding of the current scope (None outside bind_attention)."""
    return _BINDING.get()


def layers_heads(model: torch.nn.Module) -> tuple[int, int]:
    """(L layers, Hq query heads) of a transformers causal LM."""
    cfg = getattr(model.config, "text_config", model.config)
    return int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
