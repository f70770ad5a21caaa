"""The worker side of the kvpos connector: stored chunks into vLLM's paged cache (raw keys rotated once to the
positions the prompt gives them; with the kvpos attention backend, `raw=True`, written as they are), computed
passages back into the store (keys un-rotated, or as they are when raw), and a report of what each load did.
The paged layout: paged.py.
"""
from __future__ import annotations

import re
import time
from typing import Any, Callable

import torch

from kvpos._checks import fail
from kvpos.rope import rotate, unrotate
from kvpos.store import ChunkKV, ChunkStore, CorruptChunkError, FingerprintMismatch, StoreUnavailable

from .flash_layout import FlashLayout
from .paged import PagedLayout
from .scheduler import KvposMetadataFields, SegmentIO, WorkerReport

__all__ = ["WorkerSide"]


class _Pending:
    """A segment being saved while vLLM computes it, possibly over several steps (and again after a preemption):
    per layer (raw keys, values) [H, S, D] and which tokens have arrived."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def put(self, layer: int, lo: int, raw: torch.Tensor, v: torch.Tensor) -> None:
        """raw / v: [H, s, D] of tokens [lo, lo + s) of the segment."""
        if layer not in self.layers:
            H, _, D = raw.shape
            self.layers[layer] = (raw.new_zeros(H, self.n, D), v.new_zeros(H, self.n, v.shape[2]),
                                  torch.zeros(self.n, dtype=torch.bool))
        k_buf, v_buf, seen = self.layers[layer]
        s = raw.shape[1]
        k_buf[:, lo:lo + s], v_buf[:, lo:lo + s], seen[lo:lo + s] = raw, v, True

    def complete(self, n_layers: int) -> bool:
        return len(self.layers) == n_layers and all(bool(seen.all()) for _, _, seen in self.layers.values())


class WorkerSide:
    """The connector's worker-side state. `store_of(anchor_ids, memory)` as on the scheduler side; `memory_keys()`
    the keys the worker-memory tier holds (None without one)."""

    def __init__(self, block: int, specs: list, dtype: torch.dtype, store_of: Callable[[tuple, bool], ChunkStore],
                 memory_keys: Callable[[], frozenset | None], log: Any, raw: bool = False) -> None:
        self.block = block
        self.raw = raw                 # the kvpos attention backend holds raw keys in the paged cache
        self.specs = specs
        self.dtype = dtype
        self.store_of = store_of
        self.memory_keys = memory_keys
        self.log = log
        self.kv: dict[int, torch.Tensor] = {}
        self.pending: dict[tuple[str, int], _Pending] = {}
        self.failed_blocks: set[int] = set()
        self.report = WorkerReport()
        self.reported_memory: frozenset | None = None
        self.paged = PagedLayout(dtype)
        self.groups: list[tuple[list[int], Any]] | None = None

    # -- vLLM's paged cache -----------------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, t in kv_caches.items():
            m = re.search(r"\.(\d+)\.", name)
            if m is None:
                fail("kvpos register_kv_caches", "layer names with a layer index", name)
            self.kv[int(m[1])] = t
        if sorted(self.kv) != list(range(len(self.specs))):
            fail("kvpos register_kv_caches", f"{len(self.specs)} attention layers", sorted(self.kv))
        if any(t.is_cuda for t in self.kv.values()):     # vLLM's CUDA build: the FlashAttention layout (untried)
            self.paged = FlashLayout(self.dtype)

    def _slots(self, io: SegmentIO, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(lo, hi)
        blocks = torch.tensor(io.block_ids)[t // self.block]
        return blocks, t % self.block

    def _spec_groups(self) -> list[tuple[list[int], Any]]:
        """Layers grouped by identical RoPE spec (most models: one group), each rotated in one call."""
        if self.groups is None:
            by: dict[str, tuple[list[int], Any]] = {}
            for l, spec in enumerate(self.specs):
                by.setdefault(spec.identity, ([], spec))[0].append(l)      # the one "same spec" rule
            self.groups = list(by.values())
        return self.groups

    # -- loads ------------------------------------------------------------------------------------------------------
    def load(self, meta: KvposMetadataFields) -> None:
        """Fetch (verified) and write every load of the step; a chunk that cannot be served marks its blocks failed
        (vLLM recomputes them) and its reason goes into the report."""
        t0, fetch, tokens, chunks = time.perf_counter(), 0.0, 0, 0
        for io in meta.loads:
            t = time.perf_counter()
            why = None
            store = self.store_of(tuple(io.anchor_ids), io.memory)
            st = store.stats
            noted = st.mismatches + st.corrupt + st.unavailable
            try:
                chunk = store.get(torch.tensor(io.ids))
                if chunk is None:
                    last = st.events[-1] if st.mismatches + st.corrupt + st.unavailable > noted else None
                    why = (f"{last['kind']}: {last['detail'][:200]}" if last else
                           "not in the store any more (evicted since the scheduler looked)")
            except (StoreUnavailable, CorruptChunkError, FingerprintMismatch) as e:
                why = f"{type(e).__name__}: {str(e)[:200]}"
            fetch += time.perf_counter() - t
            if why is None:
                try:
                    self._write(io, chunk)
                except ValueError as e:
                    why = f"{type(e).__name__}: {str(e)[:200]}"
            if why is not None:
                self.log.warning("kvpos: request %s segment %d not loaded (vLLM recomputes it): %s", io.req_id,
                                 io.index, why)
                self.failed_blocks.update(int(b) for b in self._slots(io, io.lo, io.hi)[0].unique())
            else:
                tokens += io.hi - io.lo
                chunks += 1
            self.report.loads.setdefault(io.req_id, []).append((io.index, io.lo, io.hi, why))
        total = time.perf_counter() - t0
        self.log.info("kvpos: loaded %d tokens from %d of %d chunks in %.3fs (fetch %.3fs, rotate + write %.3fs)",
                      tokens, chunks, len(meta.loads), total, fetch, total - fetch)

    def _write(self, io: SegmentIO, chunk: ChunkKV) -> None:
        """Rotate the chunk's raw keys [L, H, S, D] to positions io.lo..io.hi-1 and write keys and values with
        vLLM's own cache op (its block layout)."""
        L, H, S, D = chunk.raw_keys.shape
        if (L, S) != (len(self.specs), io.end - io.start) or H != self.kv[0].shape[1]:
            fail(f"kvpos chunk of request {io.req_id}", f"[{len(self.specs)} layers, {self.kv[0].shape[1]} kv heads, "
                 f"{io.end - io.start} tokens, D]", tuple(chunk.raw_keys.shape))
        blocks, offs = self._slots(io, io.lo, io.hi)
        slots = blocks * self.block + offs
        part = slice(io.lo - io.start, io.hi - io.start)
        pos = torch.arange(io.lo, io.hi)
        dtype = self.kv[0].dtype
        for layers, spec in self._spec_groups():
            sel = slice(layers[0], layers[-1] + 1) if layers == list(range(layers[0], layers[-1] + 1)) else layers
            raw = chunk.raw_keys[sel, :, part].to(dtype)                     # [G, H, s, D] (a view when it can)
            k = (raw if self.raw else rotate(raw, pos, spec)).transpose(1, 2)   # [G, s, H, D] views
            v = chunk.values[sel, :, part].to(dtype).transpose(1, 2)
            for g, l in enumerate(layers):
                self.paged.write(self.kv[l], k[g], v[g], slots)

    def take_failed_blocks(self) -> set[int]:
        out, self.failed_blocks = self.failed_blocks, set()
        return out

    # -- saves ------------------------------------------------------------------------------------------------------
    def save_layer(self, meta: KvposMetadataFields, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy this step's part of every save-segment out of `kv_layer`, keys un-rotated."""
        m = re.search(r"\.(\d+)\.", layer_name)
        layer = int(m[1]) if m else -1
        if layer not in self.kv:
            return
        for io in meta.saves:
            blocks, offs = self._slots(io, io.lo, io.hi)
            k, v = self.paged.gather(kv_layer, blocks, offs)                  # [H, s, D]
            raw = k if self.raw else unrotate(k[None].float(), torch.arange(io.lo, io.hi),
                                               self.specs[layer])[0].to(k.dtype)
            key = (io.req_id, io.start)
            if key not in self.pending:
                self.pending[key] = _Pending(io.end - io.start)
            self.pending[key].put(layer, io.lo - io.start, raw, v)

    def finish_saves(self, meta: KvposMetadataFields) -> None:
        """Store every save-segment whose tokens have all arrived (position-independent segments only)."""
        for io in meta.saves:
            key = (io.req_id, io.start)
            p = self.pending.get(key)
            if p is None or not p.complete(len(self.specs)):
                continue                                          # more of the segment comes in a later step
            del self.pending[key]
            if io.position != (0 if io.kind == "anchor" else len(io.anchor_ids)):
                continue                                          # only position-independent segments are saved
            store = self.store_of(tuple(io.anchor_ids), True)
            ks = torch.stack([p.layers[l][0] for l in range(len(self.specs))]).contiguous()
            vs = torch.stack([p.layers[l][1] for l in range(len(self.specs))]).contiguous()
            store.put(ChunkKV(torch.tensor(io.ids, dtype=torch.long), ks, vs, io.start, store.fingerprint))

    def forget(self, finished_req_ids: set[str]) -> None:
        """Drop partial saves of requests that ended before their segment did."""
        for key in [k for k in self.pending if k[0] in finished_req_ids]:
            del self.pending[key]

    def take_report(self) -> WorkerReport | None:
        """The step's load outcomes and, when it changed, the memory tier's keys (None: nothing to say)."""
        keys = self.memory_keys()
        changed = keys is not None and keys != self.reported_memory
        if not self.report.loads and not changed:
            return None
        out = WorkerReport(self.report.loads, keys if changed else None)
        self.report = WorkerReport()
        if changed:
            self.reported_memory = keys
        return out
