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
    """One stored chunk holding three passages in order, loaded where it was computed: exact prefix reuse."""
    rb = RequestBuilder(tok)
    ps = _passages(tok, 3, seed=11)
    joined = " ".join(ps)
    precompute(engine, rb, [joined], progress=False)
    prompt, params = rb.request([joined], "Summarize the passage in one sentence.")
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
