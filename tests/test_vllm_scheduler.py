"""The kvpos connector's scheduler side and request parameters without an engine (no vLLM import): loads for new
and resumed requests, claims that agree with what the worker will find, reports that count what was loaded, and
strict parameters (fuzzed)."""
import os
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpos.integrations.vllm.params import kvpos_salt, parse_request
from kvpos.integrations.vllm.scheduler import SchedulerSide, WorkerReport
from kvpos.store import ChunkKV, ChunkStore, Fingerprint, MemoryBackend

FP = Fingerprint(model="m" * 64, weights="w" * 64, dtype="float32", anchor="", rope="r" * 64)
BLOCK = 16


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list
    kv_transfer_params: dict
    cache_salt: str | None = None
    num_preemptions: int = 0


def _side(backend, salted=True):
    stores = {}

    def store_of(anchor, memory):
        if anchor not in stores:
            stores[anchor] = ChunkStore(backend, FP.with_anchor(torch.tensor(anchor, dtype=torch.long)),
                                        on_mismatch="recompute")
        return stores[anchor]
    return SchedulerSide(BLOCK, store_of, salted, True, None), store_of


def _put(store_of, anchor, ids, start):
    store = store_of(tuple(anchor), True)
    S = len(ids)
    store.put(ChunkKV(torch.tensor(ids), torch.zeros(1, 1, S, 4), torch.zeros(1, 1, S, 4), start, store.fingerprint))


def _request(backend, store_of, n_chunks=3, chunk=20, stored=None, rid="r1"):
    anchor = list(range(1, 11))
    prompt, segs, pos = list(anchor), [[0, 10, "anchor"]], 10
    _put(store_of, [], anchor, 0)
    for c in range(n_chunks):
        ids = [100 + 50 * c + i for i in range(chunk)]
        if stored is None or c in stored:
            _put(store_of, anchor, ids, 10)
        prompt += ids
        segs.append([pos, pos + chunk, "chunk"])
        pos += chunk
    prompt += [7, 8, 9]
    return Req(rid, prompt, {"kvpos": {"segments": segs}}, kvpos_salt(segs))


def _new(req, blocks, computed):
    return SimpleNamespace(req_id=req.request_id, block_ids=(blocks,), num_computed_tokens=computed)


def _output(new=(), cached=(), resumed=(), scheduled=None):
    c = SimpleNamespace(req_ids=[x[0] for x in cached], resumed_req_ids=set(resumed),
                        new_block_ids=[x[1] for x in cached], num_computed_tokens=[x[2] for x in cached])
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=c, num_scheduled_tokens=scheduled or {})


def test_a_resumed_request_gets_its_loads_again_into_its_new_blocks():
    backend = MemoryBackend()
    side, store_of = _side(backend)
    req = _request(backend, store_of)                       # 73 tokens: 64 claimable (4 blocks of 16)
    assert side.matched_tokens(req, 0) == 64
    side.after_alloc(req, [0, 1, 2, 3, 4], 64)
    first = side.build(_output(new=[_new(req, [0, 1, 2, 3, 4], 64)], scheduled={"r1": 9}))
    assert [(io.index, io.lo, io.hi) for io in first.loads] == [(0, 0, 10), (1, 10, 30), (2, 30, 50), (3, 50, 64)]
    side.take_report(WorkerReport({"r1": [(io.index, io.lo, io.hi, None) for io in first.loads]}))
    # preempted: vLLM frees its blocks, asks again when it schedules it anew, and lists it as resumed
    req.num_preemptions = 1
    assert side.matched_tokens(req, 0) == 64
    side.after_alloc(req, [7, 6, 5, 9, 8], 64)
    again = side.build(_output(cached=[("r1", ([7, 6, 5, 9, 8],), 64)], resumed={"r1"}, scheduled={"r1": 9}))
    assert [(io.index, io.lo, io.hi) for io in again.loads] == [(i, io.lo, io.hi) for i, io in
                                                               enumerate(first.loads)]
    assert all(io.block_ids == [7, 6, 5, 9, 8] for io in again.loads)
    side.take_report(WorkerReport({"r1": [(io.index, io.lo, io.hi, None) for io in again.loads]}))
    rep = side.finished(req)
    assert rep["loaded_tokens"] == 64 and rep["loaded_segments"] == 4 and rep["preemptions"] == 1 \
        and rep["load_rounds"] == 2


def test_a_running_request_is_never_loaded_twice_and_a_local_hit_is_not_claimed():
    backend = MemoryBackend()
    side, store_of = _side(backend)
    req = _request(backend, store_of)
    assert side.matched_tokens(req, 32) == 32               # vLLM's prefix cache holds 2 blocks: claim the rest
    side.after_alloc(req, [0, 1, 2, 3, 4], 32)
    meta = side.build(_output(new=[_new(req, [0, 1, 2, 3, 4], 64)], scheduled={"r1": 9}))
    assert [(io.index, io.lo, io.hi) for io in meta.loads] == [(2, 32, 50), (3, 50, 64)]
    later = side.build(_output(cached=[("r1", None, 73)], scheduled={"r1": 1}))
    assert later.loads == []


def test_vllm_accepting_nothing_issues_no_load_and_reports_no_loaded_tokens():
    backend = MemoryBackend()
    side, store_of = _side(backend)
    req = _request(backend, store_of)
    side.matched_tokens(req, 0)
    side.after_alloc(req, [0, 1, 2, 3, 4], 0)               # e.g. a local sub-block hit kept instead
    assert side.build(_output(new=[_new(req, [0, 1, 2, 3, 4], 0)], scheduled={"r1": 73})).loads == []
    rep = side.finished(req)
    assert rep["loaded_tokens"] == 0 and rep["claimed_tokens"] == 0


def test_failed_loads_are_reported_with_their_reason_and_not_counted():
    backend = MemoryBackend()
    side, store_of = _side(backend)
    req = _request(backend, store_of)
    side.matched_tokens(req, 0)
    side.after_alloc(req, [0, 1, 2, 3, 4], 64)
    meta = side.build(_output(new=[_new(req, [0, 1, 2, 3, 4], 0)], scheduled={"r1": 9}))
    outcomes = [(io.index, io.lo, io.hi, "corrupt: checksum mismatch" if io.index == 2 else None) for io in meta.loads]
    side.take_report(WorkerReport({"r1": outcomes[:2]}).merge(WorkerReport({"r1": outcomes[2:]})))
    rep = side.finished(req)
    assert rep["loaded_segments"] == 3 and rep["loaded_tokens"] == 64 - 20
    assert rep["load_failed"] == ["segment 2 tokens [30, 50): corrupt: checksum mismatch"]


def test_a_request_finished_in_the_step_of_its_loads_reports_them_once_the_worker_report_comes():
    """vLLM finishes a one-token request (and hands the connector its report) before it passes on that step's
    worker report: the report it returned is completed in place then, failures included."""
    backend = MemoryBackend()
    side, store_of = _side(backend)
    req = _request(backend, store_of)
    side.matched_tokens(req, 0)
    side.after_alloc(req, [0, 1, 2, 3, 4], 64)
    meta = side.build(_output(new=[_new(req, [0, 1, 2, 3, 4], 0)], scheduled={"r1": 73}))
    rep = side.finished(req)                                # the order of vLLM's update_from_output
    assert rep["loaded_tokens"] == 0 and rep["claimed_tokens"] == 64
    side.take_report(WorkerReport({"r1": [(io.index, io.lo, io.hi, "missing" if io.index == 3 else None)
                                          for io in meta.loads]}))
    assert rep["loaded_tokens"] == 50 and rep["loaded_segments"] == 3
    assert rep["load_failed"] == ["segment 3 tokens [50, 64): missing"]
    side.take_report(WorkerReport({}))                      # settled once: later reports leave it alone
    assert rep["loaded_tokens"] == 50 and side.unsettled == {}


def test_the_claim_agrees_with_what_the_worker_finds():
    """A passage stored under another anchor, or by another model, is not claimed (the worker would miss)."""
    backend = MemoryBackend()
    side, store_of = _side(backend)
    req = _request(backend, store_of, stored={0, 2})        # chunk 1 missing: the run stops after chunk 0
    assert side.matched_tokens(req, 0) == 16                # [0, 30) cut to whole blocks
    other = ChunkStore(backend, replace(FP, model="x" * 64).with_anchor(torch.arange(1, 11)))
    ids = req.prompt_token_ids[30:50]
    other.put(ChunkKV(torch.tensor(ids), torch.zeros(1, 1, 20, 4), torch.zeros(1, 1, 20, 4), 10, other.fingerprint))
    req2 = replace(req, request_id="r2")
    assert side.matched_tokens(req2, 0) == 16               # another model's entry under the same key: not claimed
    side.worker_memory = frozenset({store_of(tuple(range(1, 11)), True).key(torch.tensor(ids))})
    req3 = replace(req, request_id="r3")
    assert side.matched_tokens(req3, 0) == 64               # ... unless the worker's memory tier holds it


def test_without_the_kvpos_salt_a_request_is_refused_with_prefix_caching_and_served_without():
    backend = MemoryBackend()
    for salted, want in ((True, 0), (False, 64)):
        side, store_of = _side(backend, salted)
        req = replace(_request(backend, store_of), cache_salt="mine")
        assert side.matched_tokens(req, 0) == want
        rep = side.finished(req)
        assert ("cache_salt" in rep.get("refused", "")) == salted and rep["segments"] == 4


# -- parameters, fuzzed -----------------------------------------------------------------------------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 200) | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)
segment_lists = st.lists(st.tuples(st.integers(-2, 60), st.integers(-2, 60),
                                   st.sampled_from(["anchor", "chunk", "x"])).map(list), max_size=5)
# mostly well-formed: contiguous cuts of [0, end], so that valid requests are drawn too
valid_segments = st.lists(st.integers(1, 55), min_size=1, max_size=5, unique=True).map(
    lambda cuts: [[a, b, "anchor" if i == 0 else "chunk"] for i, (a, b) in enumerate(zip([0] + sorted(cuts),
                                                                                        sorted(cuts)))])


@settings(max_examples=4000 if os.environ.get("KVPOS_FUZZ") == "long" else 400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=st.one_of(json_values, st.fixed_dictionaries({"segments": valid_segments | segment_lists | json_values},
                                                           optional={"save": st.booleans() | json_values,
                                                                     "memory": st.booleans() | json_values})),
       salt=st.one_of(st.none(), st.text(max_size=4)), salted=st.booleans())
def test_request_parameters_are_parsed_exactly_or_refused_by_name(params, salt, salted, fuzz_record):
    try:
        got = parse_request(params, 50, salt, salted, True)
    except ValueError as e:
        fuzz_record("connector parameters", "clear error")
        assert str(e).startswith("kvpos ") and ": expected " in str(e), e
        return
    except Exception as e:  # noqa: BLE001
        fuzz_record("connector parameters", "obscure error")
        raise AssertionError(f"{type(e).__name__}: {e}") from e
    segs = params["segments"]
    ok = (set(params) <= {"segments", "save", "memory"} and all(type(params.get(k, True)) is bool
                                                                 for k in ("save", "memory"))
          and segs[0][:3] == [0, segs[0][1], "anchor"] and all(s[2] == "chunk" for s in segs[1:])
          and all(a[1] == b[0] for a, b in zip(segs, segs[1:])) and all(0 <= s[0] < s[1] <= 50 for s in segs)
          and (not salted or (isinstance(salt, str) and salt.startswith(kvpos_salt(segs)))))
    fuzz_record("connector parameters", "ok" if ok else "silent wrong")
    assert ok and got.segments == tuple(tuple(s) for s in segs) and got.save == params.get("save", True)


def test_a_string_boolean_and_a_wrong_segments_type_are_named():
    segs = [[0, 4, "anchor"], [4, 9, "chunk"]]
    with pytest.raises(ValueError, match=r"kvpos save: expected true or false \(a JSON boolean\), got str 'false'"):
        parse_request({"segments": segs, "save": "false"}, 20, None, False, True)
    with pytest.raises(ValueError, match=r"kvpos segments: expected a non-empty list .*, got dict"):
        parse_request({"segments": {"a": 1}}, 20, None, False, True)
    with pytest.raises(ValueError, match=r"unknown keys \['segment'\]"):
        parse_request({"segments": segs, "segment": 1}, 20, None, False, True)
    assert parse_request({"segments": segs}, 20, kvpos_salt(segs) + "tenant", True, True).segments[1] == (4, 9, "chunk")


def test_a_parallel_request_carries_its_layout_and_saves_every_passage_at_the_anchors_end():
    """With the kvpos attention backend (raw=True): the step metadata carries the request's layout and blocks for
    the worker's attention, and every passage vLLM computes is saved (each saw only the anchor) with its logical
    start A; without the backend the layout is refused with the reason."""
    backend = MemoryBackend()
    side, store_of = _side(backend)
    side.raw = True
    req = _request(backend, store_of, stored=[])            # only the anchor is stored: 0 whole blocks to claim
    segs = req.kv_transfer_params["kvpos"]["segments"]
    req = replace(req, kv_transfer_params={"kvpos": {"segments": segs, "layout": "parallel"}},
                  cache_salt=kvpos_salt(segs, "parallel"))
    assert side.matched_tokens(req, 0) == 0
    side.after_alloc(req, [0, 1, 2, 3, 4], 0)
    meta = side.build(_output(new=[_new(req, [0, 1, 2, 3, 4], 0)], scheduled={"r1": 73}))
    assert [(r.req_id, r.block_ids, r.anchor_len, r.lengths, r.layout) for r in meta.rows] == \
        [("r1", [0, 1, 2, 3, 4], 10, [20, 20, 20], "parallel")]
    assert [(io.index, io.position) for io in meta.saves] == [(0, 0), (1, 10), (2, 10), (3, 10)]

    plain, _ = _side(backend)                               # vLLM's own attention
    refused = replace(req, request_id="r2")
    assert plain.matched_tokens(refused, 0) == 0 and "KVPOS_VLLM_ATTENTION" in plain.plans["r2"].refused
    assert kvpos_salt(segs) != kvpos_salt(segs, "parallel")  # a layout never shares prefix-cache blocks with another


def test_a_lead_request_loads_chunks_encoded_after_anchor_and_lead_and_saves_nothing():
    """kv_transfer_params "lead": the passages come from the store of chunks encoded after anchor + lead (the
    loads carry those ids to the worker), chunks stored after the anchor alone are not claimed, nothing the engine
    computes is saved, and the salt differs from the request without a lead."""
    backend = MemoryBackend()
    side, store_of = _side(backend)
    req = _request(backend, store_of, stored=[])             # chunks stored after the anchor alone: none after a lead
    segs = req.kv_transfer_params["kvpos"]["segments"]
    lead = [60, 61, 62, 63]
    anchor = req.prompt_token_ids[:10]
    for c in range(2):
        _put(store_of, anchor + lead, req.prompt_token_ids[10 + 20 * c:30 + 20 * c], 14)
    led = replace(req, kv_transfer_params={"kvpos": {"segments": segs, "lead": lead}},
                  cache_salt=kvpos_salt(segs, lead=lead))
    assert side.matched_tokens(led, 0) == 48                 # anchor + 2 passages = 50 tokens, whole blocks of 16
    side.after_alloc(led, [0, 1, 2, 3, 4], 48)
    meta = side.build(_output(new=[_new(led, [0, 1, 2, 3, 4], 0)], scheduled={"r1": 73}))
    assert [(io.index, io.anchor_ids) for io in meta.loads] == [(0, []), (1, anchor + lead), (2, anchor + lead)]
    assert meta.saves == [] and side.plans["r1"].save == []
    assert kvpos_salt(segs, lead=lead) != kvpos_salt(segs) and kvpos_salt(segs, lead=[]) == kvpos_salt(segs)

    plain, _ = _side(backend)
    bare = replace(req, request_id="r2")
    assert plain.matched_tokens(bare, 0) == 0               # only the 10-token anchor stored: no whole block
    with pytest.raises(ValueError, match="kvpos lead: expected a list of token ids"):
        parse_request({"segments": segs, "lead": [1, -2]}, len(req.prompt_token_ids), None, False, True)
    with pytest.raises(ValueError, match="kvpos request cache_salt: expected a salt starting with"):
        parse_request({"segments": segs, "lead": lead}, len(req.prompt_token_ids), kvpos_salt(segs), True, True)
