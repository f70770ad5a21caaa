"""Decode cost of read-time position maps (Ms-PoE's per-head scales, PINE-lite's per-(head, document) offsets) vs
plain rotate-on-read decode, side by side in one run, on the default model's shapes.

    python bench/bench_posmap.py --json results/bench_posmap.json [--contexts 2048 8192] [--steps 8] [--reps 5]

Per context N, a storage="raw" PositionedCache of the model's layers holds N slots of random raw keys and values
at positions 0..N-1 (timing does not depend on their content): 32 anchor slots, then 8 documents (segments
SEG_CHUNK0 + d), then question slots. Two levels, each method timed in the same rounds (the order rotating):

- attention: one decode query per layer over the cache, summed over the layers: `decode_fused` (the plain fused
  raw-key kernel) vs `decode_mapped` with Ms-PoE's ratios (every query head rotating keys at its own scale,
  factored tables) and with one query variant per document (PINE-lite's offsets; its importance pass excluded);
- step: one whole greedy decode step of the model over the cache (a backend bound once per round of steps, as
  generate binds once): plain
  (storage="raw", fused kernel), Ms-PoE through the fused kernel, PINE-lite through it (importance included), and
  Ms-PoE over storage="rotated" (its torch path: every query head's keys rotated into a copy), and the length
  policies of bench/length_eval.py (StreamingLLM, LM-Infinite, STRING: keys read at mapped positions in the fused
  kernel; wrope: kvpos's windowed retrieval, a top-k selection in torch) with STRING over storage="rotated" (its
  dense torch path) beside them.
  The step's slot is dropped after it (drop_tail_), so every step reads N slots.
- prefill (--prefill-contexts, default 2048; --prefill-reps rounds): one forward over N random tokens (32 anchor
  tokens, then 8 documents) into a fresh cache: plain, Ms-PoE's full form (the prompt under its scales, head orders
  scored at the first call, as `full+mspoe` runs) and PINE's full form (`pine_prefill`: the documents under its
  document phase).

Medians over --reps rounds of --steps calls; ratios are method / plain of the same level. The acceptance target of
the position-bias issue is <= 1.15x plain at 2k and 8k (per-head / per-query decode in the fused kernel).
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
from tqdm import tqdm

from _common import bench_parser, machine, markdown_table, parse_bench_args, write_outputs
from kvpos.compose import SEG_CHUNK0, SEG_QUERY
from kvpos.integrations.hf import PositionedCache, bind_attention, extend, load_model
from kvpos.integrations.mspoe import MsPoEBackend, use_ms_poe
from kvpos.integrations.pine import PineLiteBackend, pine_prefill
from kvpos.integrations.window import WindowBackend
from kvpos.integrations.hf.specs import head_dim
from kvpos.posmap import ms_poe_scales
from length_eval import policies

N_DOCS, ANCHOR, QUESTION = 8, 32, 32


def filled_cache(model, n: int, storage: str, seed: int) -> PositionedCache:
    """A cache of `storage` holding n random slots laid out as anchor, N_DOCS documents, question (docstring)."""
    cfg = model.config
    H, D = cfg.num_key_value_heads, head_dim(cfg)
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g))
          for _ in range(cfg.num_hidden_layers)]
    seg = torch.full((1, n), SEG_QUERY, dtype=torch.int32)
    seg[0, :ANCHOR] = 0
    doc_len = (n - ANCHOR - QUESTION) // N_DOCS
    for d in range(N_DOCS):
        seg[0, ANCHOR + d * doc_len: ANCHOR + (d + 1) * doc_len] = SEG_CHUNK0 + d
    cache = PositionedCache.from_model(model, storage=storage)
    cache.append_raw_(kv, torch.arange(n), segment=seg)
    return cache


def attention_level(model, cache: PositionedCache, n: int, scales, seed: int) -> dict[str, callable]:
    """One decode query per layer over every layer of `cache`: the plain fused kernel and the mapped ones."""
    cfg = model.config
    L, Hq, D = cfg.num_hidden_layers, cfg.num_attention_heads, head_dim(cfg)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hq, D, generator=g)
    q_docs = torch.randn(1, Hq, N_DOCS + 1, D, generator=g)
    seg = cache.table.segment[:, :n]
    variant = torch.where(seg >= SEG_CHUNK0, seg.long() - SEG_CHUNK0 + 1, torch.zeros_like(seg, dtype=torch.long))
    sm = D ** -0.5

    def run(fn):
        def go(steps):
            for _ in range(steps):
                st = cache.read_state()
                for i in range(L):
                    if fn(i, st) is None:
                        raise RuntimeError(f"the fused kernel did not serve layer {i} (kvpos.kernel_status())")
        return go

    return {"plain": run(lambda i, st: cache.decode_fused(i, st, q, None, sm)),
            "ms_poe": run(lambda i, st: cache.decode_mapped(i, q[:, :, None], None, sm,
                                                            ratios=scales.for_layer(i), state=st)),
            "pine_offsets": run(lambda i, st: cache.decode_mapped(i, q_docs, None, sm, seg=variant, state=st))}


def step_level(model, caches: dict[str, PositionedCache], n: int, scales) -> dict[str, callable]:
    """One greedy decode step of the whole model per method, the new slot deleted afterwards."""
    tok = torch.tensor([[42]])

    def run(cache, make_backend):
        def go(steps):
            backend = make_backend()
            scope = bind_attention(model, backend, cache) if backend is not None else contextlib.nullcontext()
            with torch.no_grad(), scope:                     # bound once per round, as generate binds once
                for _ in range(steps):
                    extend(model, cache, tok)
                    cache.drop_tail_(n)
        return go

    fns = {"plain": run(caches["raw"], lambda: None),
           "ms_poe": run(caches["raw"], lambda: MsPoEBackend(scales)),
           "pine_lite": run(caches["raw"], PineLiteBackend),
           "ms_poe_torch": run(caches["rotated"], lambda: MsPoEBackend(scales))}
    for name, cfg in policies(model.config.max_position_embeddings).items():
        if cfg is not None:                                  # the length policies of bench/length_eval.py
            fns[name] = run(caches["raw"], lambda cfg=cfg: WindowBackend(cfg))
    fns["string_torch"] = run(caches["rotated"], lambda: WindowBackend(policies(model.config.max_position_embeddings)["string"]))
    return fns


def prefill_level(model, n: int, seed: int) -> dict[str, callable]:
    """One forward over n random tokens (anchor + N_DOCS documents) into a fresh cache per method and call."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, n), generator=g)
    doc_len = (n - ANCHOR) // N_DOCS
    docs = [ids[0, ANCHOR + d * doc_len: ANCHOR + (d + 1) * doc_len] for d in range(N_DOCS)]
    used = ids[:, :ANCHOR + N_DOCS * doc_len]

    def plain(steps):
        for _ in range(steps):
            extend(model, PositionedCache.from_model(model), used)

    def ms_poe_full(steps):
        for _ in range(steps):
            cache = PositionedCache.from_model(model)
            with use_ms_poe(model, cache):
                extend(model, cache, used)

    def pine_full(steps):
        for _ in range(steps):
            pine_prefill(model, ids[:, :ANCHOR], docs)

    return {"plain": plain, "ms_poe_full": ms_poe_full, "pine_full": pine_full}


def timed_rounds(fns: dict[str, callable], steps: int, reps: int, desc: str) -> dict[str, float]:
    """Median seconds per call of each function, rounds rotating the order."""
    names = list(fns)
    for f in fns.values():
        f(1)                                                 # warm-up (kernel build, allocations)
    times = {k: [] for k in names}
    for r in tqdm(range(reps), desc=desc, leave=False):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            fns[k](steps)
            times[k].append((time.perf_counter() - t) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    ap = bench_parser(__doc__, seed=0)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefill-contexts", type=int, nargs="*", default=[2048],
                    help="prompt lengths of the prefill level (none: skip it)")
    ap.add_argument("--prefill-reps", type=int, default=3)
    a = parse_bench_args(ap, argv)
    model, _ = load_model(a.model)
    cfg = model.config
    scales = ms_poe_scales(cfg.num_hidden_layers, cfg.num_attention_heads)
    rows = []
    for n in a.contexts:
        raw = filled_cache(model, n, "raw", a.seed)
        att = timed_rounds(attention_level(model, raw, n, scales, 1), a.steps, a.reps, f"attention {n}")
        rotated = filled_cache(model, n, "rotated", a.seed)
        stp = timed_rounds(step_level(model, {"raw": raw, "rotated": rotated}, n, scales), a.steps, a.reps,
                           f"step {n}")
        for level, t in (("attention", att), ("step", stp)):
            for k, v in t.items():
                rows.append({"context": n, "level": level, "method": k, "ms": 1e3 * v, "vs_plain": v / t["plain"]})
        del raw, rotated
    for n in a.prefill_contexts:
        with torch.no_grad():
            t = timed_rounds(prefill_level(model, n, a.seed), 1, a.prefill_reps, f"prefill {n}")
        rows += [{"context": n, "level": "prefill", "method": k, "ms": 1e3 * v, "vs_plain": v / t["plain"]}
                 for k, v in t.items()]
    table = markdown_table(rows, ["context", "level", "method", "ms", "vs_plain"],
                           {"ms": ".2f", "vs_plain": ".2f"})
    write_outputs(a.json, {"machine": machine(), "args": vars(a), "rows": rows}, table)


if __name__ == "__main__":
    main()
