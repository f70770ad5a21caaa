"""An engine with kvpos's attention backend, run in its own process (the backend replaces CPU_ATTN for every engine
of a process): the kvpos connector with attention=True over the given store, prefix caching on.

    KVPOS_VLLM_ATTENTION=1 python attention_engine.py MODEL STORE OUT.json

Writes {"cases": [{"name", "prompt", "params", "tokens", "logprobs": {token: logprob} of the first step, "kvpos":
report}]}; the test process checks them against vLLM's own backend and the transformers reference.
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

N_TOKENS = 8
APE = (0.6, 0.9)                 # APE's (temperature, scale) of the APE case


def cases(tok):
    """(name, prompt, kv_transfer_params or None) in the order they run."""
    from kvpos.data import passages
    from kvpos.integrations.vllm.requests import RequestBuilder

    rb = RequestBuilder(tok)
    stream = passages(tok, 90, seed=41)
    ps = [next(stream) for _ in range(4)]
    ps[2] += " The access code for the north warehouse is 6180."
    q = "What is the access code for the north warehouse?"
    text = tok.apply_chat_template([{"role": "user", "content": ps[0] + "\n\n" + q}], add_generation_prompt=True,
                                   tokenize=False)
    plain = tok(text, add_special_tokens=False).input_ids
    out = [("plain", {"prompt_token_ids": list(plain)}, None)]
    for name, order, layout, ape in [("parallel_computed", [0, 1, 2], "parallel", None),
                                     ("parallel_loaded", [2, 0, 1], "parallel", None),
                                     ("sequential_loaded", [1, 2, 0], "sequential", None),
                                     ("parallel_mixed", [2, 1, 3], "parallel", None),
                                     ("parallel_ape", [1, 3, 0, 2], "parallel", APE)]:
        prompt, params = rb.request([ps[i] for i in order], q, layout=layout, salt=name, ape=ape)
        out.append((name, prompt, params))
    return out


def main(model: str, store: str, out: str) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from kvpos.integrations.vllm.engine import engine_kwargs

    tok = AutoTokenizer.from_pretrained(model)
    llm = LLM(**engine_kwargs(model, store, attention=True), dtype="float32", enforce_eager=True, max_model_len=1152,
              max_num_seqs=4, enable_prefix_caching=True, max_num_batched_tokens=1152, seed=0,
              num_gpu_blocks_override=12)
    rows = []
    for name, prompt, params in cases(tok):
        sp = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        o = llm.generate(prompt, sp, use_tqdm=False)[0]
        rows.append({"name": name, "prompt": prompt, "params": params, "tokens": list(o.outputs[0].token_ids),
                     "logprobs": {int(t): float(x.logprob) for t, x in o.outputs[0].logprobs[0].items()},
                     "kvpos": (o.kv_transfer_params or {}).get("kvpos")})
    with open(out, "w") as f:
        json.dump({"cases": rows}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
