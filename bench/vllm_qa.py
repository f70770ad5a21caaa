"""Chunk reuse on real multi-document questions through vLLM and the kvpos connector: the QA mode of
bench/bench_vllm.py (the engine-side twin of bench/rag_qa.py).

    .venv-vllm/bin/python bench/bench_vllm.py --data squad --n 100 --split heldout --records R.jsonl --json X.json
    .venv-vllm/bin/python bench/bench_vllm.py --report R.jsonl --json X.json        # table + plot from records

The connector serves the sequential layout (every passage encoded alone after the anchor, loaded and rotated to its
place); with `--attention` (the kvpos attention backend, KVPOS_VLLM_ATTENTION=1) the engine also serves the
parallel layout and APE over it. Repairs are not in the engine. Methods:

  full            plain vLLM prefill (a cache salt of its own: nothing reused)
  kvpos           the connector loads anchor + every passage from its worker-memory tier
  prefix          vLLM's own prefix cache, warmed by a request over the same passages in another order (exact;
                  every --prefix-every'th item)
  kvpos_redis     as kvpos, every chunk fetched from Redis (every --prefix-every'th item)
  kvpos_parallel  (--attention) the passages loaded at overlapping positions after the anchor, not visible to
                  each other, the question after the longest
  kvpos_ape       (--attention) the parallel layout with APE's temperature 0.7 and scale 1.0 over the passages
  kvpos_lead      (--lead j) as kvpos, the passages stored after j lead passages (RequestBuilder(lead=...))

Every passage is stored first (not timed). Per (item, method) two requests: the answer (greedy, --max-new tokens;
TTFT is the engine's own first_token_latency of that request, sent alone) and the gold answer teacher forced after
the prompt (prompt_logprobs over the computed rows: mean gold NLL and the first-token argmax). For full and kvpos a
third request gives the first token's whole distribution (logprobs=-1), for KL(full || kvpos). Records carry the
fields of bench/rag_qa.py (its summary, table and plot are reused); a measure a method does not take is null.
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
from typing import Any, Sequence

from tqdm import tqdm

from kvpos.data import answer_correct, normalize_answer
from kvpos.integrations.vllm.engine import precompute

FULL_VOCAB = -1


def _sp(max_tokens: int, params: dict | None = None, **kw: Any):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                          extra_args={"kv_transfer_params": params} if params else None, **kw)


def _one(llm, prompt: dict, sp) -> Any:
    return llm.generate([prompt], [sp], use_tqdm=False)[0]


def _salted(prompt: dict, salt: str, kvpos: bool) -> dict:
    """The prompt under a salt of its own; a kvpos request keeps the connector's salt in front."""
    return {**prompt, "cache_salt": (prompt["cache_salt"] if kvpos else "") + salt}


def _params(params: dict | None, memory: bool) -> dict | None:
    return None if params is None else {"kvpos": {**params["kvpos"], "save": False, "memory": memory}}


def gold_scores(out, n_prompt: int, gold: Sequence[int]) -> tuple[float, int]:
    """(mean NLL of the gold tokens, the argmax token at the first answer position) from prompt_logprobs of a
    request whose prompt is the question prompt (n_prompt tokens) followed by the gold tokens."""
    rows = out.prompt_logprobs
    nll = -sum(rows[n_prompt + j][g].logprob for j, g in enumerate(gold)) / len(gold)
    first = next(t for t, lp in rows[n_prompt].items() if lp.rank == 1)
    return nll, int(first)


def _first_dist(out) -> dict[int, float]:
    return {int(t): float(lp.logprob) for t, lp in out.outputs[0].logprobs[0].items()}


def _kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) over the vocabulary (both full log-probability maps)."""
    return sum(math.exp(lp) * (lp - q[t]) for t, lp in p.items())


def _loaded(out) -> int:
    return int(((out.kv_transfer_params or {}).get("kvpos") or {}).get("loaded_tokens", 0))


def _method(llm, prompt: dict, params: dict | None, gold: list[int], salt: str, max_new: int,
            memory: bool = True, scored: bool = True) -> dict:
    """One method on one item: answer (+ TTFT), gold NLL and first token; `params` None: plain vLLM."""
    kv = params is not None
    ans = _one(llm, _salted(prompt, salt + "-a", kv), _sp(max_new, _params(params, memory)))
    text = ans.outputs[0].text
    first = int(ans.outputs[0].token_ids[0])
    n_prompt = len(prompt["prompt_token_ids"])
    computed = n_prompt - (_loaded(ans) if kv else int(ans.num_cached_tokens or 0))
    rec = {"text": text, "first": first, "ttft_s": float(ans.metrics.first_token_latency),
           "tokens_computed": computed, "nll": None, "first_scored": None}
    if scored:
        forced = {**prompt, "prompt_token_ids": prompt["prompt_token_ids"] + gold}
        out = _one(llm, _salted(forced, salt + "-g", kv),
                   _sp(1, _params(params, memory), prompt_logprobs=1, skip_reading_prefix_cache=False,
                       detokenize=False))
        rec["nll"], rec["first_scored"] = gold_scores(out, n_prompt, gold)
    return rec


LAYOUTS = {"kvpos_parallel": ("parallel", None), "kvpos_ape": ("parallel", (0.7, 1.0))}


def run_items(llm, rb, tok, items: Sequence[dict], max_new: int, records: str | None, prefix_every: int,
              meta: dict, attention: bool = False, lead: Any = None) -> list[dict]:
    """Every method on every item not yet in `records` (lines appended per item); returns the new records. With
    `attention` (an engine on the kvpos attention backend) also the LAYOUTS methods; with `lead` (a RequestBuilder
    with lead passages) also kvpos_lead."""
    done = set()
    if records and os.path.exists(records):
        with open(records) as f:
            done = {json.loads(line)["id"] for line in f if line.strip()}
    out = []
    todo = [(i, x) for i, x in enumerate(items) if x["id"] not in done]
    for idx, item in tqdm(todo, desc=f"vllm_qa {meta['data']} {meta['format']}", file=sys.stdout, unit="q"):
        precompute(llm, rb, item["paragraphs"], progress=False)
        prompt, params = rb.request(item["paragraphs"], item["question"], save=False)
        gold = tok(item["answers"][0], add_special_tokens=False).input_ids
        salt = f"{meta['run']}-{item['id']}"
        got = {"full": _method(llm, prompt, None, gold, salt + "-full", max_new),
               "kvpos": _method(llm, prompt, params, gold, salt + "-kv", max_new)}
        asked = {"full": (prompt, None), "kvpos": (prompt, params)}
        for name, (layout, ape) in (LAYOUTS.items() if attention else ()):
            asked[name] = rb.request(item["paragraphs"], item["question"], save=False, layout=layout, ape=ape)
            got[name] = _method(llm, *asked[name], gold, f"{salt}-{name}", max_new)
        if lead is not None:
            precompute(llm, lead, item["paragraphs"], progress=False)
            asked["kvpos_lead"] = lead.request(item["paragraphs"], item["question"], save=False)
            got["kvpos_lead"] = _method(llm, *asked["kvpos_lead"], gold, f"{salt}-lead", max_new)
        dists = {m: _first_dist(_one(llm, _salted(pr, f"{salt}-{m}-d", p is not None),
                                     _sp(1, _params(p, True), logprobs=FULL_VOCAB, detokenize=False)))
                 for m, (pr, p) in asked.items()}
        if idx % prefix_every == 0:
            order = random.Random(idx).sample(range(len(item["paragraphs"])), len(item["paragraphs"]))
            warm, _ = rb.request([item["paragraphs"][i] for i in order], item["question"], save=False)
            _one(llm, _salted(warm, salt + "-pc-a", False), _sp(1))        # the salt _method gives it
            got["prefix"] = _method(llm, prompt, None, gold, salt + "-pc", max_new, scored=False)
            got["kvpos_redis"] = _method(llm, prompt, params, gold, salt + "-kr", max_new, memory=False,
                                         scored=False)
        full = got["full"]
        rows = []
        for name, g in got.items():
            kl = _kl(dists["full"], dists[name]) if name in dists else None
            rows.append({**meta, "id": item["id"], "method": name, "gold": item["gold"],
                         "n_tokens": len(prompt["prompt_token_ids"]), "correct": answer_correct(g["text"],
                                                                                               item["answers"]),
                         "text": g["text"], "agree": normalize_answer(g["text"]) == normalize_answer(full["text"]),
                         "first": g["first"], "first_agree": g["first"] == full["first"],
                         "first_scored_agree": None if g["first_scored"] is None else
                         g["first_scored"] == full["first_scored"],
                         "kl": kl, "nll": g["nll"], "ttft_s": g["ttft_s"], "tokens_computed": g["tokens_computed"],
                         "chunks": None})
        if records:
            with open(records, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        out += rows
    return out
