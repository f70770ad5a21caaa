"""A second engine for the preemption test, run in its own process: prefix caching OFF and 8 blocks of 128 tokens,
so that every preempted request is resumed from nothing and must have its stored passages loaded again.

    python preempt_engine.py MODEL REDIS_URL OUT.json     # writes {"alone": [...], "together": [...]}
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(model: str, redis_url: str, out: str) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from kvpos.data import passages
    from kvpos.integrations.vllm.engine import engine_kwargs, precompute
    from kvpos.integrations.vllm.requests import RequestBuilder

    tok = AutoTokenizer.from_pretrained(model)
    llm = LLM(**engine_kwargs(model, redis_url), dtype="float32", enforce_eager=True, max_model_len=896,
              max_num_seqs=4, enable_prefix_caching=False, max_num_batched_tokens=896, seed=0,
              num_gpu_blocks_override=8)
    rb = RequestBuilder(tok)
    stream = passages(tok, 150, seed=31)
    ps = [next(stream) for _ in range(8)]
    precompute(llm, rb, ps, progress=False)
    reqs = [rb.request([ps[2 * i + 1], ps[2 * i]], "Write a long story about the passages.") for i in range(4)]
    sps = [SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True,
                          extra_args={"kv_transfer_params": params}) for _, params in reqs]
    rows = {"alone": [llm.generate(p, sp, use_tqdm=False)[0] for (p, _), sp in zip(reqs, sps)],
            "together": llm.generate([p for p, _ in reqs], sps, use_tqdm=False)}
    with open(out, "w") as f:
        json.dump({k: [{"tokens": list(o.outputs[0].token_ids), "kvpos": o.kv_transfer_params["kvpos"]} for o in v]
                   for k, v in rows.items()}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
