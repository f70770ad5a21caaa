"""KvposConnector: position-independent chunk reuse inside vLLM, as a V1 KV connector loaded by module path.

    LLM(**kvpos.integrations.vllm.engine.engine_kwargs(model_dir, store="redis://127.0.0.1:6379/0"))
    # = LLM(model=model_dir, kv_transfer_config=KVTransferConfig(kv_connector="KvposConnector",
    #       kv_connector_module_path="kvpos.integrations.vllm.connector", kv_role="kv_both",
    #       kv_load_failure_policy="recompute", kv_connector_extra_config={"store": "redis://127.0.0.1:6379/0"}))

A request says where its anchor and passages are (kvpos.integrations.vllm.requests builds it, and the cache salt
that keeps loaded blocks out of plain requests' prefix-cache hits: see params.py):

    SamplingParams(extra_args={"kv_transfer_params": {"kvpos": {"segments": [[0, A, "anchor"], [A, A + S1, "chunk"],
                                                                            ...]}}})

Scheduler side (scheduler.py): the anchor and every following passage whose raw KV the kvpos ChunkStore holds under
this engine's fingerprint (any order, any offset) form one run from token 0; vLLM is told it can load that run,
cut to whole blocks and to all but the last prompt token; loads are issued whenever vLLM allocates blocks for it
(a new request, or one resumed after a preemption). Worker side (worker.py): each stored chunk is fetched
(verified: checksum, fingerprint, ids, finite values), its raw keys are rotated ONCE to the positions the prompt
gives them (vLLM places token i at position i) with the model's RoPE specs, and keys and values are written into
vLLM's paged cache; a chunk that cannot be served is reported and its blocks recomputed by vLLM
(kv_load_failure_policy="recompute", required). The question and any passage not in the store are computed by
vLLM. Passages vLLM computes right after the anchor (and the anchor itself) are un-rotated and saved back, in the
store format and under the fingerprint of the transformers path, so a passage computed once is reused at any
position by any engine sharing the store. A request that cannot be served exactly (bad parameters, positions beyond
a length-dependent RoPE's exact range, no kvpos cache salt while prefix caching is on) is refused with the reason
in its output's kv_transfer_params["kvpos"] and runs as a plain vLLM request; nothing is skipped silently.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 KVConnectorRole, KVConnectorWorkerMetadata)
from vllm.logger import init_logger

from kvpos._checks import fail
from kvpos.store import (ChunkStore, DiskBackend, Fingerprint, MemoryBackend, RedisBackend, TieredBackend,
                         checkpoint_digest, config_digest, rope_digest)

from .params import parse_segments
from .scheduler import KvposMetadataFields, SchedulerSide, WorkerReport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.kvpos")             # under vLLM's logger, so its handlers print it

__all__ = ["KvposConnector", "KvposMetadata", "KvposWorkerMeta", "parse_segments", "open_store_backend"]


def open_store_backend(spec: str, scheme: str = "float") -> Any:
    """A ChunkStore backend from "redis://host:port/db[?prefix=p]" or "disk:///absolute/root"; scheme: how it
    writes new entries ("float", "int8" or "int4", kvpos.store.SCHEMES)."""
    m = re.fullmatch(r"redis://([^:/]+):(\d+)(?:/(\d+))?(?:\?prefix=([A-Za-z0-9._:-]*))?", spec or "")
    if m:
        return RedisBackend(m[1], int(m[2]), int(m[3] or 0), prefix=m[4] if m[4] is not None else "kvpos:",
                            scheme=scheme)
    if isinstance(spec, str) and spec.startswith("disk://") and os.path.isabs(spec[len("disk://"):]):
        return DiskBackend(spec[len("disk://"):], scheme=scheme)
    fail("kv_connector_extra_config store", "'redis://host:port/db' or 'disk:///absolute/path'", repr(spec))


@dataclass
class KvposMetadata(KVConnectorMetadata, KvposMetadataFields):
    """Scheduler -> worker, each step: the loads and saves (scheduler.SegmentIO)."""


@dataclass
class KvposWorkerMeta(KVConnectorWorkerMetadata, WorkerReport):
    """Worker -> scheduler, each step: load outcomes and the memory tier's keys (scheduler.WorkerReport)."""

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KvposWorkerMeta":
        m = self.merge(other)
        return KvposWorkerMeta(m.loads, m.memory_keys)


def _extra(cfg: Any, key: str, default: Any, ok: Any, expected: str) -> Any:
    v = cfg.get_from_extra_config(key, default)
    if not ok(v):
        fail(f"kv_connector_extra_config {key}", expected, f"{type(v).__name__} {v!r}")
    return v


class KvposConnector(KVConnectorBase_V1):
    """See the module docstring. extra config: store (required), namespace ("default"), save (true), memory_mb
    (1024: a worker-memory tier in front of the store, 0 for none), scheme ("float"; "int8" / "int4" write quantized
    entries), attention (false; true: the engine runs the kvpos attention backend, attention.py, so keys are loaded
    and saved raw and the parallel layout is served). Per request: segments, save, memory (true: use the memory
    tier; false: read from the store itself), layout ("sequential"; "parallel" with attention)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        policy = getattr(cfg, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            fail("KvposConnector kv_load_failure_policy", "'recompute' (a chunk gone, corrupt or of another "
                 "fingerprint between scheduling and loading is then recomputed by vLLM)", repr(policy),
                 "use engine_kwargs(...), or add \"kv_load_failure_policy\": \"recompute\" to --kv-transfer-config")
        block = int(vllm_config.cache_config.block_size)
        self._namespace = _extra(cfg, "namespace", "default", lambda v: isinstance(v, str) and v, "a non-empty string")
        save = _extra(cfg, "save", True, lambda v: isinstance(v, bool), "true or false")
        self._raw_keys = _extra(cfg, "attention", False, lambda v: isinstance(v, bool), "true or false")
        self._far = open_store_backend(cfg.get_from_extra_config("store", None),
                                       cfg.get_from_extra_config("scheme", "float"))
        memory_mb = _extra(cfg, "memory_mb", 1024, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                           "an int >= 0 (MiB of worker memory; 0 = no memory tier)")
        self._memory = MemoryBackend(memory_mb << 20) if memory_mb else None
        self._near = TieredBackend(self._memory, self._far) if memory_mb else self._far
        mc = vllm_config.model_config
        from kvpos.integrations.hf.specs import rope_specs_from_config

        specs = rope_specs_from_config(mc.hf_config)
        t = time.perf_counter()
        self._fingerprint = Fingerprint(config_digest(mc.hf_config), checkpoint_digest(mc.model),
                                        str(mc.dtype).replace("torch.", ""), "", rope_digest(specs))
        logger.info("kvpos: fingerprint %s in %.2fs (role %s)", self._fingerprint.short(), time.perf_counter() - t, role)
        self._stores: dict[tuple[bool, tuple[int, ...]], ChunkStore] = {}
        limits = [s.max_exact_position for s in specs if s.max_exact_position is not None]
        salted = bool(vllm_config.cache_config.enable_prefix_caching)
        self._sched = SchedulerSide(block, self._store, salted, save, min(limits) if limits else None, logger,
                                    self._raw_keys) if role == KVConnectorRole.SCHEDULER else None
        self._worker = None
        if role == KVConnectorRole.WORKER:
            from .worker import WorkerSide

            self._worker = WorkerSide(block, specs, mc.dtype, self._store,
                                      lambda: None if self._memory is None else self._memory.keys(), logger, self._raw_keys)

    def _store(self, anchor_ids: tuple[int, ...], memory: bool = True) -> ChunkStore:
        """The store of chunks encoded after `anchor_ids` (the anchor itself: after the empty anchor); with
        memory=False the far store alone (no worker-memory tier)."""
        key = (memory, tuple(anchor_ids))
        st = self._stores.get(key)
        if st is None:
            fp = self._fingerprint.with_anchor(torch.tensor(key[1], dtype=torch.long))
            st = self._stores[key] = ChunkStore(self._near if memory else self._far, fp, self._namespace,
                                                on_mismatch="recompute", on_unavailable="recompute")
        return st

    # -- scheduler side --------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._sched.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        f = self._sched.build(scheduler_output)
        return KvposMetadata(f.loads, f.saves, f.rows)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._sched.take_report(meta if isinstance(meta, WorkerReport) else None)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        report = self._sched.finished(request)
        return False, None if report is None else {"kvpos": report}

    # -- worker side -----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from .plugin import ENV, enabled

        if enabled() != self._raw_keys:
            fail("KvposConnector attention", f"the kvpos attention backend ({ENV}=1) exactly when "
                 "kv_connector_extra_config attention is true", f"{ENV}={enabled()}, attention={self._raw_keys}",
                 "raw keys in the paged cache need both: engine_kwargs(..., attention=True) with "
                 f"{ENV}=1, or neither")
        self._worker.register(kv_caches)

    def step_rows(self) -> list:
        """The layouts (scheduler.RowLayout) of this step's requests whose positions are not vLLM's; the kvpos
        attention backend reads them."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return list(meta.rows) if isinstance(meta, KvposMetadata) else []

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvposMetadata) and meta.loads:
            self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvposMetadata) and meta.saves:
            self._worker.save_layer(meta, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvposMetadata) and meta.saves:
            self._worker.finish_saves(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._worker.forget(finished_req_ids)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        r = self._worker.take_report()
        return None if r is None else KvposWorkerMeta(r.loads, r.memory_keys)
