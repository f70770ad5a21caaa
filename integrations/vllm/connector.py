"""KvposConnector: position-independent chunk reuse inside vLLM, as a V1 KV connector loaded by module path.

    LLM(model=folder, kv_transfer_config=KVTransferConfig(
        kv_connector="KvposConnector", kv_connector_module_path="kvpos.integrations.vllm.connector",
        kv_role="kv_both", kv_connector_extra_config={"store": "redis://127.0.0.1:6379/0"}))

A request says where its anchor and passages are (kvpos.integrations.vllm.requests builds it):

    SamplingParams(extra_args={"kv_transfer_params": {"kvpos": {"segments": [[0, A, "anchor"], [A, A + S1, "chunk"],
                                                                            ...]}}})

Scheduler side: the anchor and every following passage whose raw KV the kvpos ChunkStore holds (any order, any
offset) form one run from token 0; vLLM is told it can load that run, cut to whole blocks and to all but the last
prompt token. Worker side: each stored chunk is fetched (verified: checksum, fingerprint, ids), its raw keys are
rotated ONCE to the positions the prompt gives them (vLLM places token i at position i) with the model's RoPE specs,
and keys and values are written into vLLM's paged cache. The question and any passage not in the store are computed
by vLLM. Passages vLLM computes right after the anchor (and the anchor itself) are un-rotated and saved back, in the
store format and under the fingerprint of the transformers path, so a passage computed once is reused at any
position by any engine sharing the store. A passage computed after other passages saw them: it is not saved (its KV
is not position-independent). A request that cannot be served exactly (bad segments, positions beyond a
length-dependent RoPE's exact range) is refused with the reason in its output's kv_transfer_params["kvpos"] and
runs as a plain vLLM request; nothing is skipped silently.

Paged KV on vLLM's CPU backend, per layer: [blocks, kv heads, block size, 2 x head dim], each block's interior in a
layout of the attention kernel's instruction set. Writes go through vLLM's own `cpu_attn_reshape_and_cache`; reads
(for saving) use the element map that op produces on a scratch block, computed once.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 KVConnectorRole)
from vllm.logger import init_logger
import vllm._custom_ops as vllm_ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvpos._checks import fail
from kvpos.rope import rotate, unrotate
from kvpos.store import (ChunkKV, ChunkStore, CorruptChunkError, DiskBackend, Fingerprint, FingerprintMismatch,
                         MemoryBackend, RedisBackend, StoreUnavailable, TieredBackend, checkpoint_digest,
                         config_digest, rope_digest)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.kvpos")             # under vLLM's logger, so its handlers print it

__all__ = ["KvposConnector", "KvposMetadata", "parse_segments", "open_store"]


def open_store_backend(spec: str, scheme: str = "float") -> Any:
    """A ChunkStore backend from "redis://host:port/db[?prefix=p]" or "disk:///absolute/root"; scheme: how it
    writes new entries ("float", "int8" or "int4", kvpos.store.SCHEMES)."""
    m = re.fullmatch(r"redis://([^:/]+):(\d+)(?:/(\d+))?(?:\?prefix=([A-Za-z0-9._:-]*))?", spec or "")
    if m:
        return RedisBackend(m[1], int(m[2]), int(m[3] or 0), prefix=m[4] if m[4] is not None else "kvpos:",
                            scheme=scheme)
    if spec.startswith("disk://") and os.path.isabs(spec[len("disk://"):]):
        return DiskBackend(spec[len("disk://"):], scheme=scheme)
    fail("kv_connector_extra_config store", "'redis://host:port/db' or 'disk:///absolute/path'", repr(spec))


def parse_segments(params: Any, n_prompt: int) -> list[tuple[int, int, str]]:
    """Validate kv_transfer_params["kvpos"]["segments"]: contiguous [start, end, kind] from token 0, the first the
    anchor, the rest chunks, inside the prompt. Raises ValueError naming the problem."""
    if not isinstance(params, dict) or not isinstance(params.get("segments"), list) or not params["segments"]:
        fail("kvpos segments", "a non-empty list of [start, end, kind]", type(params).__name__)
    out, pos = [], 0
    for i, s in enumerate(params["segments"]):
        if not isinstance(s, (list, tuple)) or len(s) != 3 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                      for x in s[:2]):
            fail(f"kvpos segments[{i}]", "[start, end, kind] with int start < end", s)
        a, b, kind = s
        want = "anchor" if i == 0 else "chunk"
        if kind != want or a != pos or b <= a or b > n_prompt:
            fail(f"kvpos segments[{i}]", f"[{pos}, end <= {n_prompt}, {want!r}] (contiguous from token 0)", s)
        out.append((a, b, kind))
        pos = b
    return out


@dataclass
class SegmentIO:
    """One stored chunk a worker loads or saves: its tokens [start, end) of the prompt, the part [lo, hi) handled
    in this step, its content ids and the anchor it was encoded after."""

    req_id: str
    kind: str
    start: int
    end: int
    lo: int
    hi: int
    ids: list[int]
    anchor_ids: list[int]
    block_ids: list[int]
    memory: bool = True


@dataclass
class KvposMetadata(KVConnectorMetadata):
    loads: list[SegmentIO] = field(default_factory=list)
    saves: list[SegmentIO] = field(default_factory=list)


@dataclass
class _Plan:
    """Scheduler-side state of one request."""

    segments: list[tuple[int, int, str]]
    prompt: list[int]
    local: int = 0                 # tokens vLLM had computed locally when asked
    load_end: int = 0              # tokens [local, load_end) come from the store
    save: list[int] = field(default_factory=list)     # indices of segments to save once computed
    want_save: bool = True
    memory: bool = True
    block_ids: list[int] = field(default_factory=list)
    refused: str | None = None
    loaded_segments: int = 0


class KvposConnector(KVConnectorBase_V1):
    """See the module docstring. extra config: store (required), namespace ("default"), save (True), memory_mb
    (1024: a worker-memory tier in front of the store, 0 for none), scheme ("float"; "int8" / "int4" write quantized entries).
    Per request: segments, save, memory (True: use the memory tier; False: read from the store itself)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self._block = int(vllm_config.cache_config.block_size)
        self._namespace = str(cfg.get_from_extra_config("namespace", "default"))
        self._save = bool(cfg.get_from_extra_config("save", True))
        self._far = open_store_backend(cfg.get_from_extra_config("store", None),
                                       cfg.get_from_extra_config("scheme", "float"))
        memory_mb = cfg.get_from_extra_config("memory_mb", 1024)
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 0:
            fail("kv_connector_extra_config memory_mb", "an int >= 0 (MiB of worker memory; 0 = no memory tier)",
                 memory_mb)
        self._near = TieredBackend(MemoryBackend(memory_mb << 20), self._far) if memory_mb else self._far
        mc = vllm_config.model_config
        from kvpos.integrations.hf.models import rope_specs_from_config

        self._specs = rope_specs_from_config(mc.hf_config)
        dtype = str(mc.dtype).replace("torch.", "")
        t = time.perf_counter()
        self._fingerprint = Fingerprint(config_digest(mc.hf_config), checkpoint_digest(mc.model), dtype, "",
                                        rope_digest(self._specs))
        logger.info("kvpos: fingerprint %s in %.2fs (role %s)", self._fingerprint.short(), time.perf_counter() - t, role)
        self._stores: dict[tuple[bool, tuple[int, ...]], ChunkStore] = {}
        self._plans: dict[str, _Plan] = {}
        self._kv: dict[int, torch.Tensor] = {}
        self._pending: dict[tuple[str, int], dict[int, list]] = {}
        self._failed: set[int] = set()
        self._limits = [s.max_exact_position for s in self._specs if s.max_exact_position is not None]
        self._dtype = mc.dtype
        self._isa: str | None = None
        self._maps: tuple[torch.Tensor, torch.Tensor] | None = None
        self._groups: list[tuple[list[int], Any]] | None = None

    # -- shared ------------------------------------------------------------------------------------------------------
    def _store(self, anchor_ids: list[int] | tuple[int, ...], memory: bool = True) -> ChunkStore:
        """The store of chunks encoded after `anchor_ids` (the anchor itself: after the empty anchor); with
        memory=False the far store alone (no worker-memory tier)."""
        key = (memory, tuple(anchor_ids))
        st = self._stores.get(key)
        if st is None:
            fp = self._fingerprint.with_anchor(torch.tensor(key[1], dtype=torch.long))
            st = self._stores[key] = ChunkStore(self._near if memory else self._far, fp, self._namespace,
                                                on_mismatch="recompute", on_unavailable="recompute")
        return st

    def _segment_store(self, prompt: list[int], seg: tuple[int, int, str], anchor: tuple[int, int, str]) -> ChunkStore:
        return self._store(() if seg[2] == "anchor" else prompt[anchor[0]:anchor[1]])

    # -- scheduler side --------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = (request.kv_transfer_params or {}).get("kvpos")
        if params is None:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        plan = self._plans.get(request.request_id)
        if plan is None:
            try:
                plan = _Plan(parse_segments(params, len(prompt)), prompt)
                if self._limits and len(prompt) > min(self._limits):
                    fail("kvpos request", f"at most {min(self._limits)} tokens (the exact range of this model's "
                         "length-dependent RoPE)", len(prompt))
            except ValueError as e:
                self._plans[request.request_id] = _Plan([], prompt, refused=str(e))
                logger.warning("kvpos: request %s refused: %s", request.request_id, e)
                return 0, False
            self._plans[request.request_id] = plan
            plan.want_save = bool(params.get("save", self._save))
            plan.memory = bool(params.get("memory", True))
        if plan.refused:
            return 0, False
        run, anchor = 0, plan.segments[0]
        for i, seg in enumerate(plan.segments):
            if seg[1] <= num_computed_tokens or self._segment_store(prompt, seg, anchor).contains(
                    torch.tensor(prompt[seg[0]:seg[1]])):
                run = seg[1]
            else:
                break
        end = min(run, len(prompt) - 1) // self._block * self._block
        plan.local, plan.load_end = num_computed_tokens, max(num_computed_tokens, end)
        # save the anchor and the passage right after it (position-independent) when vLLM computes them whole
        plan.save = [i for i in (0, 1)[:len(plan.segments)] if plan.want_save and plan.segments[i][0] >= plan.load_end]
        return plan.load_end - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvposMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._plans.get(new.req_id)
            if plan is None or plan.refused:
                continue
            plan.block_ids = list(new.block_ids[0])
            if plan.load_end > plan.local:
                self._add_loads(meta, new.req_id, plan)
            self._add_saves(meta, new.req_id, plan, new.num_computed_tokens,
                            scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self._plans.get(req_id)
            if plan is None or plan.refused or not plan.save:
                continue
            blocks = cached.new_block_ids[i]
            if blocks is not None:
                plan.block_ids = list(blocks[0]) if req_id in cached.resumed_req_ids else plan.block_ids + list(blocks[0])
            self._add_saves(meta, req_id, plan, cached.num_computed_tokens[i],
                            scheduler_output.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _io(self, req_id: str, plan: _Plan, i: int, lo: int, hi: int) -> SegmentIO:
        a, b, kind = plan.segments[i]
        anchor = plan.segments[0]
        return SegmentIO(req_id, kind, a, b, lo, hi, plan.prompt[a:b],
                         [] if kind == "anchor" else plan.prompt[anchor[0]:anchor[1]], plan.block_ids, plan.memory)

    def _add_loads(self, meta: KvposMetadata, req_id: str, plan: _Plan) -> None:
        for i, (a, b, _) in enumerate(plan.segments):
            lo, hi = max(a, plan.local), min(b, plan.load_end)
            if lo < hi:
                meta.loads.append(self._io(req_id, plan, i, lo, hi))
                plan.loaded_segments += 1

    def _add_saves(self, meta: KvposMetadata, req_id: str, plan: _Plan, computed: int, scheduled: int) -> None:
        """Tokens [computed, computed + scheduled) are computed this step: save the parts of save-segments in it."""
        lo_step, hi_step = max(computed, plan.load_end), computed + scheduled
        for i in plan.save:
            a, b, _ = plan.segments[i]
            lo, hi = max(a, lo_step), min(b, hi_step)
            if lo < hi:
                meta.saves.append(self._io(req_id, plan, i, lo, hi))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        plan = self._plans.pop(request.request_id, None)
        if plan is None:
            return False, None
        report = {"loaded_tokens": max(0, plan.load_end - plan.local), "local_tokens": plan.local,
                  "loaded_segments": plan.loaded_segments, "segments": len(plan.segments)}
        if plan.refused:
            report["refused"] = plan.refused
        return False, {"kvpos": report}

    # -- worker side -----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, t in kv_caches.items():
            m = re.search(r"\.(\d+)\.", name)
            if m is None:
                fail("kvpos register_kv_caches", "layer names with a layer index", name)
            self._kv[int(m[1])] = t
        if sorted(self._kv) != list(range(len(self._specs))):
            fail("kvpos register_kv_caches", f"{len(self._specs)} attention layers", sorted(self._kv))

    def _slots(self, io: SegmentIO, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(lo, hi)
        blocks = torch.tensor(io.block_ids)[t // self._block]
        return blocks, t % self._block

    def _halves(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) views of one layer's paged tensor, as the CPU attention backend makes them."""
        nb, H, bs, d2 = kv.shape
        return kv.view(nb, H, 2 * bs, d2 // 2).chunk(2, dim=2)

    def _element_maps(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where vLLM's cache op puts key / value element (offset o, dim d) inside one head's block: two [bs, D]
        int64 maps into the block interior flattened, found by writing coded values into a scratch block."""
        if self._maps is None:
            _, H, bs, d2 = kv.shape
            D = d2 // 2
            self._isa = _get_attn_isa(self._dtype, bs, D, "auto")
            scratch = torch.zeros(1, H, bs, d2, dtype=torch.float32)
            code = (torch.arange(bs * D, dtype=torch.float32) + 1).view(bs, 1, D).expand(bs, H, D).contiguous()
            kc, vc = self._halves(scratch)
            vllm_ops.cpu_attn_reshape_and_cache(code, -code, kc, vc, torch.arange(bs), self._isa)
            flat = scratch[0, 0].reshape(-1)
            kmap, vmap = torch.full((bs * D,), -1, dtype=torch.long), torch.full((bs * D,), -1, dtype=torch.long)
            kmap[(flat[flat > 0] - 1).long()] = (flat > 0).nonzero().flatten()
            vmap[(-flat[flat < 0] - 1).long()] = (flat < 0).nonzero().flatten()
            if bool((kmap < 0).any()) or bool((vmap < 0).any()):
                fail("kvpos paged layout", "every key and value element found in the block", "missing elements")
            self._maps = (kmap.view(bs, D), vmap.view(bs, D))
        return self._maps

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvposMetadata) or not meta.loads:
            return
        t0, fetch, tokens = time.perf_counter(), 0.0, 0
        for io in meta.loads:
            t = time.perf_counter()
            store = self._store(io.anchor_ids, io.memory)
            try:
                chunk = store.get(torch.tensor(io.ids))
            except (StoreUnavailable, CorruptChunkError, FingerprintMismatch) as e:
                chunk = None
                logger.warning("kvpos: chunk for request %s unavailable: %s", io.req_id, e)
            fetch += time.perf_counter() - t
            if chunk is None:                                   # gone since the scheduler looked: vLLM recomputes
                self._failed.update(int(b) for b in self._slots(io, io.lo, io.hi)[0].unique())
                continue
            self._write(io, chunk)
            tokens += io.hi - io.lo
        total = time.perf_counter() - t0
        logger.info("kvpos: loaded %d tokens from %d chunks in %.3fs (fetch %.3fs, rotate + write %.3fs)", tokens,
                    len(meta.loads), total, fetch, total - fetch)

    def _write(self, io: SegmentIO, chunk: ChunkKV) -> None:
        """Rotate the chunk's raw keys [L, H, S, D] to positions io.lo..io.hi-1 and write keys and values with
        vLLM's own cache op (its block layout)."""
        blocks, offs = self._slots(io, io.lo, io.hi)
        slots = blocks * self._block + offs
        part = slice(io.lo - io.start, io.hi - io.start)
        pos = torch.arange(io.lo, io.hi)
        self._element_maps(self._kv[0])
        dtype = self._kv[0].dtype
        for layers, spec in self._spec_groups():
            sel = slice(layers[0], layers[-1] + 1) if layers == list(range(layers[0], layers[-1] + 1)) else layers
            raw = chunk.raw_keys[sel, :, part].to(dtype)                     # [G, H, s, D] (a view when it can)
            k = rotate(raw, pos, spec).transpose(1, 2).contiguous()          # [G, s, H, D]: one rotation per group
            v = chunk.values[sel, :, part].to(dtype).transpose(1, 2).contiguous()
            for g, l in enumerate(layers):
                kc, vc = self._halves(self._kv[l])
                vllm_ops.cpu_attn_reshape_and_cache(k[g], v[g], kc, vc, slots, self._isa)

    def _spec_groups(self) -> list[tuple[list[int], Any]]:
        """Layers grouped by identical RoPE spec (most models: one group), each rotated in one call."""
        if self._groups is None:
            by: dict[tuple[str, bytes], tuple[list[int], Any]] = {}
            for l, spec in enumerate(self._specs):
                key = (json.dumps(spec.describe(), sort_keys=True) + str(spec.angle_dtype),
                       spec.inv_freq.double().numpy().tobytes())
                by.setdefault(key, ([], spec))[0].append(l)
            self._groups = list(by.values())
        return self._groups

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvposMetadata) or not meta.saves:
            return
        m = re.search(r"\.(\d+)\.", layer_name)
        layer = int(m[1]) if m else -1
        if layer not in self._kv:
            return
        kmap, vmap = self._element_maps(kv_layer)
        nb, H = kv_layer.shape[:2]
        flat = kv_layer.view(nb, H, -1)
        for io in meta.saves:
            blocks, offs = self._slots(io, io.lo, io.hi)
            k = flat[blocks[:, None], :, kmap[offs]].permute(2, 0, 1)[None]   # [1, H, s, D] rotated
            v = flat[blocks[:, None], :, vmap[offs]].permute(2, 0, 1)[None]
            raw = unrotate(k.float(), torch.arange(io.lo, io.hi), self._specs[layer]).to(k.dtype)
            self._pending.setdefault((io.req_id, io.start), {}).setdefault(layer, []).append((io.lo, raw, v.clone()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for key in [k for k in self._pending if k[0] in finished_req_ids]:
            del self._pending[key]                                # a request that ended before its segment did
        return None, None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvposMetadata):
            return
        for io in meta.saves:
            parts = self._pending.get((io.req_id, io.start))
            if parts is None or len(parts) != len(self._specs):
                continue
            got = sum(r.shape[2] for _, r, _ in parts[0])
            if got < io.end - io.start:
                continue                                          # more of the segment comes in a later step
            del self._pending[(io.req_id, io.start)]
            ks, vs = [], []
            for l in range(len(self._specs)):
                pieces = sorted(parts[l], key=lambda x: x[0])
                ks.append(torch.cat([r for _, r, _ in pieces], 2)[0])
                vs.append(torch.cat([v for _, _, v in pieces], 2)[0])
            start = 0 if io.kind == "anchor" else len(io.anchor_ids)
            if io.start != start:
                continue                                          # only position-independent segments are saved
            store = self._store(io.anchor_ids)
            chunk = ChunkKV(torch.tensor(io.ids, dtype=torch.long), torch.stack(ks).contiguous(),
                            torch.stack(vs).contiguous(), start, store.fingerprint)
            store.put(chunk)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed = self._failed, set()
        return out

