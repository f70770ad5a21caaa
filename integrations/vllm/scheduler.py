"""The scheduler side of the kvpos connector: which leading tokens of a request the store can supply, the loads and
saves of each engine step, and each request's report. No vLLM import (vLLM's objects are read by attribute), so
it is tested without an engine (tests/test_vllm_scheduler.py).

Per request (`Plan`): the segments (anchor, passages), the run of leading tokens claimed from the store at the
last time vLLM asked (`local` .. `load_end`), the blocks vLLM gave it, and what the worker reported of each load.
vLLM asks again when a preempted request is scheduled anew; the loads are issued whenever vLLM allocated blocks
for claimed tokens (`update_state_after_alloc`), for new and resumed requests alike.

Metadata is the only bridge to the worker (`KvposMetadata`); the worker reports load outcomes and the keys of its
memory tier back (`KvposWorkerMeta`, through vLLM's connector output).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvpos.store import ChunkStore

from .params import RequestParams, parse_request

__all__ = ["SegmentIO", "RowLayout", "KvposMetadataFields", "WorkerReport", "Plan", "SchedulerSide"]


@dataclass
class SegmentIO:
    """One stored chunk a worker loads or saves: its tokens [start, end) of the prompt, the part [lo, hi) handled
    in this step, its content ids and the ids it was encoded after (none for the anchor; anchor + lead)."""

    req_id: str
    kind: str
    index: int
    start: int
    end: int
    lo: int
    hi: int
    ids: list[int]
    anchor_ids: list[int]
    block_ids: list[int]
    memory: bool = True
    position: int = -1             # logical position of the segment's first token (-1: its token index, start)

    def __post_init__(self) -> None:
        if self.position < 0:
            self.position = self.start


@dataclass
class RowLayout:
    """A scheduled request whose logical positions and visibility differ from vLLM's (the kvpos attention backend
    reads it): its blocks (the worker finds the request's batch row by the block its last scheduled token goes
    to), anchor length, passage lengths and layout (kvpos.compose.plan_layout)."""

    req_id: str
    block_ids: list[int]
    anchor_len: int
    lengths: list[int]
    layout: str
    ape: tuple[float, float] | None = None      # APE's (temperature, scale) over the passages


@dataclass
class KvposMetadataFields:
    loads: list[SegmentIO] = field(default_factory=list)
    saves: list[SegmentIO] = field(default_factory=list)
    rows: list[RowLayout] = field(default_factory=list)


@dataclass
class WorkerReport:
    """What workers tell the scheduler after a step: per request the outcome of each load (segment index, lo, hi,
    None or the reason it failed), and the keys their memory tier holds (None: unchanged)."""

    loads: dict = field(default_factory=dict)
    memory_keys: frozenset | None = None

    def merge(self, other: "WorkerReport") -> "WorkerReport":
        loads = {k: list(v) for k, v in self.loads.items()}
        for k, v in other.loads.items():
            loads.setdefault(k, []).extend(v)
        keys = self.memory_keys if other.memory_keys is None else (
            other.memory_keys if self.memory_keys is None else self.memory_keys | other.memory_keys)
        return WorkerReport(loads, keys)


@dataclass
class Plan:
    """Scheduler-side state of one request."""

    params: RequestParams | None
    prompt: list[int]
    n_given: int = 0               # segments the request gave (for the report of a refused request)
    local: int = 0                 # tokens vLLM had computed locally when it last asked
    load_end: int = 0              # tokens [local, load_end) are claimed from the store
    save: list[int] = field(default_factory=list)     # indices of segments to save once computed
    block_ids: list[int] = field(default_factory=list)
    refused: str | None = None
    issued: list[tuple[int, int, int]] = field(default_factory=list)   # the loads of the last claim
    rounds: int = 0                # times loads were issued (more than once: resumed after a preemption)
    outcomes: dict = field(default_factory=dict)      # (index, lo, hi) -> None (loaded) or the failure reason

    @property
    def segments(self) -> tuple[tuple[int, int, str], ...]:
        return self.params.segments if self.params is not None else ()

    def report(self, preemptions: int) -> dict:
        done = [k for k in self.issued if k in self.outcomes]
        ok = [k for k in done if self.outcomes[k] is None]
        out = {"loaded_tokens": sum(hi - lo for _, lo, hi in ok), "local_tokens": self.local,
               "loaded_segments": len({i for i, _, _ in ok}), "segments": len(self.segments) or self.n_given,
               "claimed_tokens": max(0, self.load_end - self.local),
               "kv_blocks": list(self.block_ids)}     # the engine's KV blocks the request held (memory accounting)
        failed = [f"segment {i} tokens [{lo}, {hi}): {self.outcomes[(i, lo, hi)]}" for i, lo, hi in done
                  if self.outcomes[(i, lo, hi)] is not None]
        if failed:
            out["load_failed"] = failed           # vLLM recomputed from the first failed block on
        if preemptions:
            out["preemptions"] = preemptions
        if self.rounds > 1:
            out["load_rounds"] = self.rounds
        if self.refused:
            out["refused"] = self.refused
        return out


class SchedulerSide:
    """The connector's scheduler-side state. `store_of(anchor_ids, memory)` gives the ChunkStore of chunks encoded
    after an anchor; `salted`: the engine runs with prefix caching (kvpos requests must carry the kvpos salt)."""

    def __init__(self, block: int, store_of: Callable[[tuple[int, ...], bool], ChunkStore], salted: bool,
                 default_save: bool, limit: int | None, log: Any = None, raw: bool = False) -> None:
        self.block = block
        self.raw = raw                          # the engine runs the kvpos attention backend
        self.store_of = store_of
        self.salted = salted
        self.default_save = default_save
        self.limit = limit                      # the exact range of a length-dependent RoPE, or None
        self.log = log
        self.plans: dict[str, Plan] = {}
        self.to_load: set[str] = set()
        self.worker_memory: frozenset = frozenset()   # keys the worker's memory tier held at its last report
        # reports of requests that finished in the step their loads ran: vLLM finishes requests before it hands
        # the connector that step's worker report, so they are completed (in place) when the report comes
        self.unsettled: dict[str, tuple[Plan, int, dict]] = {}

    # -- asked by vLLM ------------------------------------------------------------------------------------------------
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """How many tokens beyond `num_computed_tokens` the store supplies (0 for a request without kvpos params or
        one refused, whose reason goes into its report)."""
        params = (getattr(request, "kv_transfer_params", None) or {}).get("kvpos")
        if params is None:
            return 0
        plan = self.plans.get(request.request_id)
        if plan is None:
            plan = self.plans[request.request_id] = self._new_plan(request, params)
        if plan.refused:
            return 0
        prompt, segs = plan.prompt, plan.segments
        run = 0
        for seg in segs:
            if seg[1] <= num_computed_tokens or self._stored(plan, seg):
                run = seg[1]
            else:
                break
        end = min(run, len(prompt) - 1) // self.block * self.block
        plan.local, plan.load_end = num_computed_tokens, max(num_computed_tokens, end)
        # save the position-independent segments vLLM computes whole: the anchor and the passage right after it
        # (sequential), every passage (parallel: each is encoded after the anchor alone)
        # (a lead request saves nothing: its passages were not computed after the lead)
        free = range(len(segs)) if plan.params.layout == "parallel" else range(min(2, len(segs)))
        plan.save = [i for i in free if plan.params.save and not plan.params.lead and segs[i][0] >= plan.load_end]
        return plan.load_end - num_computed_tokens

    def _new_plan(self, request: Any, params: Any) -> Plan:
        prompt = list(getattr(request, "prompt_token_ids", None) or [])
        n_given = len(params["segments"]) if isinstance(params, dict) and isinstance(params.get("segments"), list) \
            else 0
        try:
            parsed = parse_request(params, len(prompt), getattr(request, "cache_salt", None), self.salted,
                                   self.default_save, self.raw)
            if self.limit is not None and len(prompt) > self.limit:
                raise ValueError(f"kvpos request: expected at most {self.limit} tokens (the exact range of this "
                                 f"model's length-dependent RoPE), got {len(prompt)}")
        except ValueError as e:
            if self.log is not None:
                self.log.warning("kvpos: request %s refused: %s", request.request_id, e)
            return Plan(None, prompt, n_given, refused=str(e))
        return Plan(parsed, prompt, n_given)

    @staticmethod
    def _encoded_after(plan: Plan, kind: str) -> list[int]:
        """The ids a stored segment of this kind was encoded after: none for the anchor, anchor + lead for a chunk."""
        a, b, _ = plan.segments[0]
        return [] if kind == "anchor" else plan.prompt[a:b] + list(plan.params.lead)

    def _stored(self, plan: Plan, seg: tuple[int, int, str]) -> bool:
        ids = plan.prompt[seg[0]:seg[1]]
        store = self.store_of(tuple(self._encoded_after(plan, seg[2])), plan.params.memory)
        if plan.params.memory and store.key(torch.tensor(ids)) in self.worker_memory:
            return True
        return store.contains(torch.tensor(ids))

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated blocks for `request` (new, or resumed after a preemption): loads are due for the tokens it
        accepted from the store."""
        plan = self.plans.get(request.request_id)
        if plan is None or plan.refused:
            return
        plan.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            plan.load_end = plan.local
            self.to_load.discard(request.request_id)
            return
        plan.load_end = plan.local + num_external_tokens
        self.to_load.add(request.request_id)

    def build(self, scheduler_output: Any) -> KvposMetadataFields:
        """This step's loads (requests vLLM allocated claimed blocks for) and saves."""
        meta = KvposMetadataFields()
        for new in scheduler_output.scheduled_new_reqs:
            plan = self.plans.get(new.req_id)
            if plan is None or plan.refused:
                continue
            plan.block_ids = list(new.block_ids[0])
            self._step(meta, new.req_id, plan, new.num_computed_tokens,
                       scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self.plans.get(req_id)
            if plan is None or plan.refused:
                continue
            blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                plan.block_ids = list(blocks[0]) if blocks is not None else plan.block_ids
            elif blocks is not None:
                plan.block_ids = plan.block_ids + list(blocks[0])
            self._step(meta, req_id, plan, cached.num_computed_tokens[i],
                       scheduler_output.num_scheduled_tokens.get(req_id, 0))
        self.to_load.clear()
        return meta

    def _step(self, meta: KvposMetadataFields, req_id: str, plan: Plan, computed: int, scheduled: int) -> None:
        if (plan.params.layout != "sequential" or plan.params.ape is not None) and scheduled > 0:
            segs = plan.segments
            meta.rows.append(RowLayout(req_id, list(plan.block_ids), segs[0][1] - segs[0][0],
                                       [b - a for a, b, _ in segs[1:]], plan.params.layout, plan.params.ape))
        if req_id in self.to_load:
            self._add_loads(meta, req_id, plan)
        if plan.save:
            self._add_saves(meta, req_id, plan, computed, scheduled)

    def _io(self, req_id: str, plan: Plan, i: int, lo: int, hi: int) -> SegmentIO:
        a, b, kind = plan.segments[i]
        anchor = plan.segments[0]
        position = anchor[1] if plan.params.layout == "parallel" and kind != "anchor" else a
        return SegmentIO(req_id, kind, i, a, b, lo, hi, plan.prompt[a:b], self._encoded_after(plan, kind),
                         plan.block_ids, plan.params.memory, position)

    def _add_loads(self, meta: KvposMetadataFields, req_id: str, plan: Plan) -> None:
        plan.issued = []
        plan.rounds += 1
        for i, (a, b, _) in enumerate(plan.segments):
            lo, hi = max(a, plan.local), min(b, plan.load_end)
            if lo < hi:
                meta.loads.append(self._io(req_id, plan, i, lo, hi))
                plan.issued.append((i, lo, hi))

    def _add_saves(self, meta: KvposMetadataFields, req_id: str, plan: Plan, computed: int, scheduled: int) -> None:
        """Tokens [computed, computed + scheduled) are computed this step: save the parts of save-segments in it."""
        lo_step, hi_step = max(computed, plan.load_end), computed + scheduled
        for i in plan.save:
            a, b, _ = plan.segments[i]
            lo, hi = max(a, lo_step), min(b, hi_step)
            if lo < hi:
                meta.saves.append(self._io(req_id, plan, i, lo, hi))

    def take_report(self, report: WorkerReport | None) -> None:
        """The workers' report of a step: load outcomes into the plans, the memory tier's keys."""
        unsettled, self.unsettled = self.unsettled, {}
        if report is None:
            return
        for req_id, outcomes in report.loads.items():
            plan = self.plans.get(req_id) or (unsettled[req_id][0] if req_id in unsettled else None)
            if plan is not None:
                for i, lo, hi, why in outcomes:
                    plan.outcomes[(i, lo, hi)] = why
        for plan, preemptions, out in unsettled.values():
            out.clear()
            out.update(plan.report(preemptions))
        if report.memory_keys is not None:
            self.worker_memory = report.memory_keys

    def finished(self, request: Any) -> dict | None:
        """The request's kvpos report (None for a request without kvpos params)."""
        self.to_load.discard(request.request_id)
        plan = self.plans.pop(request.request_id, None)
        if plan is None:
            return None
        preemptions = int(getattr(request, "num_preemptions", 0) or 0)
        out = plan.report(preemptions)
        if any(k not in plan.outcomes for k in plan.issued):
            self.unsettled[request.request_id] = (plan, preemptions, out)
        return out
