"""Windowed-RoPE retrieval on transformers: the attention backend, its scope and windowed prefill.

The mathematics (kvpos.window) scores far keys from their RAW form at a fixed distance r, which the PositionedCache
already keeps: the same store serves every query position and can be indexed, compressed and offloaded once.

    with use_window(model, cache, WindowConfig(budget=0.05)) as backend:    # or extend(..., attention=backend)
        out = generate(model, cache, question_ids, max_new_tokens=8)
    backend.stats       # {"far_slots": ..., "selected": ..., "recall": [...]} of the last call

selector="store" decodes (one query, batch 1) from a compact far store (int8 raw keys + fp16 values, the int8
keys doubling as the index, fused C scoring) kept by the backend for the scope and extended as tokens leave the
window; other rows use the dense formulation with the int8 index. Layers below cfg.dense_layers attend densely by
design (plain attention). Every other mismatch raises: keys that are not the bound cache's, hidden slots under the
far store.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Iterator

import torch

from kvpos._checks import fail
from kvpos.cache import PositionedKV
from kvpos.posmap import window_decode_map
from kvpos.window import FarStore, WindowConfig, far_query, sparse_decode_attention, windowed_attend
from kvpos.integrations.hf import AttentionCall, Binding, PositionedCache, bind_attention, extend

__all__ = ["WindowBackend", "use_window", "windowed_prefill", "WindowConfig"]


class WindowBackend:
    """Attention backend: windowed-RoPE retrieval over the bound cache (cfg: kvpos.window.WindowConfig).

    stats: a dict the backend fills on every call ("far_slots", "selected", and "recall" of the index selectors).
    Decode steps over storage="raw" under a policy that reads every key at a fixed mapped position (LM-Infinite
    without top-k, StreamingLLM, STRING, selector "all": kvpos.posmap.window_decode_map) run the fused kernel with
    one rotation table of the mapped positions per step; `read_counts` says which path served."""

    needs_cache = True

    def __init__(self, cfg: WindowConfig | None = None, **kw: Any) -> None:
        cfg = cfg if cfg is not None else WindowConfig(**kw)
        if kw and cfg is not None:
            cfg = replace(cfg, **kw)
        if not isinstance(cfg, WindowConfig):
            fail("WindowBackend cfg", "a WindowConfig", type(cfg).__name__, exc=TypeError)
        self.cfg = cfg
        self.stats: dict = {}
        self._stores: dict[int, FarStore] = {}          # selector="store": layer -> far store of this scope
        self.read_counts = {"fused": 0, "torch": 0}
        self._map: tuple | None = None                  # (positions, allowed, decode map) of the last step

    def __call__(self, call: AttentionCall, binding: Binding) -> torch.Tensor:
        cache = binding.cache_layer_keys(call)
        if call.layer < self.cfg.dense_layers:
            return call.plain()                          # dense layers attend densely, by design
        layer = cache.layers[call.layer]
        B, Hq, Lq, D = call.query.shape
        N = call.n_keys
        q_pos = cache.table.pos[:, N - Lq:].to(call.query.device)
        allowed = call.allowed()
        out = self._decode_fused(cache, call, allowed) if Lq == 1 and self.cfg.selector != "store" else None
        self.read_counts["torch" if out is None else "fused"] += 1
        if out is not None:
            return AttentionCall.finish(out.to(call.query.dtype))
        if bool(allowed.all()):
            allowed = None
        if self.cfg.selector == "store" and Lq == 1 and B == 1:
            if allowed is not None:
                fail("WindowBackend (selector='store')", "a cache without hidden or padded slots",
                     "a mask hiding some slots", "unhide_ them, or use selector='index'")
            return self._store_decode(call, layer, q_pos)
        cfg = replace(self.cfg, selector="index") if self.cfg.selector == "store" else self.cfg
        out = windowed_attend(call.query, call.key, layer.raw_keys, layer.values, layer.spec, q_pos, cfg,
                              call.scaling, allowed, stats=self.stats)
        return AttentionCall.finish(out)

    def _decode_fused(self, cache: PositionedKV, call: AttentionCall, allowed: torch.Tensor) -> torch.Tensor | None:
        """One query row over storage="raw", keys read at the policy's mapped positions by the fused kernel:
        [B, Hq, 1, D] float32, or None (a policy that selects keys by score, another storage, no kernel)."""
        N = call.n_keys
        m = self._decode_map(cache.table.pos[:, :N], allowed[:, 0, 0])
        if m is None:
            return None
        out = cache.decode_mapped(call.layer, call.query[:, :, :1], m[1], call.scaling, positions=m[0],
                                  state=call.read_state)
        if out is None:
            return None
        far = max(0, N - min(self.cfg.sinks, N) - min(self.cfg.window, max(0, N - self.cfg.sinks)))
        self.stats["far_slots"], self.stats["selected"] = far, 0 if self.cfg.selector == "none" else far
        return out[:, :, None]

    def _decode_map(self, pos: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mapped positions [B, N], additive mask [B, N]) of the policy for the last slot's query, or None;
        computed again only when the slots' positions or the allowed keys change (once per step: its layers share
        them; the check is against copies, so an in-place change is seen)."""
        last = self._map
        if (last is None or last[0].shape != pos.shape or last[1].shape != allowed.shape
                or not torch.equal(last[0], pos) or not torch.equal(last[1], allowed)):
            m = window_decode_map(self.cfg, pos)
            if m is not None:
                keep = m[1] & allowed
                m = (m[0], torch.zeros(keep.shape, dtype=torch.float32).masked_fill_(~keep, float("-inf")))
            last = self._map = (pos.clone(), allowed.clone(), m)
        return last[2]

    def _store_decode(self, call: AttentionCall, layer: Any, q_pos: torch.Tensor) -> torch.Tensor:
        cfg, N = self.cfg, call.key.shape[2]
        lo, hi = cfg.sinks, max(cfg.sinks, N - cfg.window)           # far slots [lo, hi)
        st = self._stores.get(call.layer)
        if st is None:
            st = self._stores[call.layer] = FarStore(layer.raw_keys[0, :, lo:hi], layer.values[0, :, lo:hi])
        elif lo + st.num_slots < hi:                                  # tokens that left the window since
            a = lo + st.num_slots
            st.append(layer.raw_keys[0, :, a:hi], layer.values[0, :, a:hi])
        elif lo + st.num_slots > hi:
            fail("WindowBackend (selector='store')", f"a cache that only grows within the scope ({lo + st.num_slots}"
                 f" far slots stored)", f"{hi} far slots", "open a new use_window scope after deleting slots")
        local = torch.cat([torch.arange(0, min(lo, N)), torch.arange(hi, N)])
        lk, lv = call.key[0][:, local], layer.values[0][:, local]     # call.key: the layer's keys (checked)
        q = call.query[0, :, 0]                                       # [Hq, D]
        qf = far_query(call.query, q_pos, layer.spec, cfg.distance)[0, :, 0]
        k = cfg.k_for(st.num_slots)
        self.stats["far_slots"], self.stats["selected"] = st.num_slots, k
        out = sparse_decode_attention(q, qf, lk, lv, st, k, call.scaling)
        return out.to(call.query.dtype).view(1, 1, *out.shape)       # [B=1, q=1, Hq, D]


@contextlib.contextmanager
def use_window(model: torch.nn.Module, cache: PositionedKV, cfg: WindowConfig | None = None, **kw: Any
               ) -> Iterator[WindowBackend]:
    """Within the block, `model` attends with windowed-RoPE retrieval over `cache` (cfg or WindowConfig(**kw));
    yields the backend (its `stats`)."""
    backend = WindowBackend(cfg, **kw)
    with bind_attention(model, backend, cache):
        yield backend


@torch.no_grad()
def windowed_prefill(model: torch.nn.Module, ids: torch.Tensor, cfg: WindowConfig, chunk: int = 512
                     ) -> PositionedCache:
    """A new cache holding `ids` [1, S], prefilled in chunks of `chunk` tokens with windowed attention (the first
    chunk densely), so that no query ever attends to a far key at its true distance: contexts beyond the model's
    training window."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        fail("windowed_prefill chunk", "an int >= 1", chunk)
    cache = PositionedCache.from_model(model)
    extend(model, cache, ids[:, :chunk])
    backend = WindowBackend(cfg)
    for s in range(chunk, ids.shape[1], chunk):
        extend(model, cache, ids[:, s:s + chunk], attention=backend)
    return cache
