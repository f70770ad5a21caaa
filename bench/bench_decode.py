"""Decode tokens/s: PositionedCache vs transformers DynamicCache, side by side in one run, on the default model.

    python bench/bench_decode.py --json results/bench_decode.json [--contexts 512 2048 4096] [--steps 32]

Each context is prefilled once (DynamicCache); the PositionedCache is built from it (same keys). Then both decode
`--steps` greedy tokens from identical copies, alternating A/B/A/B for `--reps` rounds; the median per-token time
gives tokens/s. Correctness is asserted once per context before timing (identical greedy tokens).
Look at: ratio = PositionedCache tokens/s / DynamicCache tokens/s (target >= 1.0 at 2048 and above).

    python bench/bench_decode.py --compile --json results/bench_decode_compile.json

--compile: every cache decodes through torch.compile(model.forward) (inductor, default mode): DynamicCache,
StaticCache, PositionedCache (reserved for the decoded tokens, so no buffer grows) and the fixed-capacity
PositionedCache (capacity = context + steps, like the StaticCache). Each cache type gets its own compiled entry
(its own dynamo cache, so no type evicts another's graphs); two warm-up steps per copy absorb compilation. Each
round decodes every cache once, in an order that rotates from round to round. Ratios: PositionedCache / DynamicCache
and fixed-capacity PositionedCache / StaticCache (target >= 0.95 each), taken per round (both caches of a pair decode
in the same round) and reported as the median over rounds, with the smallest and largest round beside it.
"""
from __future__ import annotations

import copy
import gc
import statistics
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache, StaticCache

from _common import bench_parser, machine, markdown_table, parse_bench_args, plot, write_outputs
from kvpos.integrations.hf import PositionedCache, load_model


@torch.no_grad()
def decode(model, cache, first, steps, fwd=None):
    """Greedy decode `steps` tokens with a plain forward loop (through `fwd`, default the model); returns (tokens,
    per-token seconds)."""
    fwd = model if fwd is None else fwd
    nxt, toks, ts = first, [], []
    for _ in range(steps):
        t = time.perf_counter()
        logits = fwd(input_ids=nxt, cache=cache, use_cache=True).logits
        nxt = logits[:, -1:].argmax(-1)
        ts.append(time.perf_counter() - t)
        toks.append(int(nxt))
    return toks, ts


def compiled_entry(model, name):
    """torch.compile of a fresh entry function calling model.forward: its own code object, hence its own dynamo
    cache (one per cache type, so that types never evict each other's graphs or share a recompile limit)."""
    def entry(**kw):
        return model.forward(**kw)

    entry.__code__ = entry.__code__.replace(co_name=f"decode_{name}")
    return torch.compile(entry)


def static_from(model, dyn, cap):
    """A StaticCache of `cap` slots holding the DynamicCache's keys and values."""
    st = StaticCache(config=model.config, max_cache_len=cap)
    with torch.no_grad():
        for i, (sl, dl) in enumerate(zip(st.layers, dyn.layers)):
            sl.lazy_initialization(dl.keys, dl.values)
            sl.update(dl.keys, dl.values)
    return st


def run_compiled(a, model, ctx, ids, rows):
    """One context, four caches through torch.compile, `reps` rounds, the order rotating each round."""
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(ids, cache=dyn, use_cache=True).logits[:, -1:].argmax(-1)
    pos = PositionedCache.from_dynamic(model, dyn)
    cap = ctx + a.steps + 8
    fixed = PositionedCache.from_rotated(pos.specs, [(l.keys, l.values) for l in dyn.layers], capacity=cap,
                                         origin=pos.origin, model_id=pos.model_id)
    sources = {"DynamicCache": lambda: copy.deepcopy(dyn), "StaticCache": lambda: static_from(model, dyn, cap),
               "PositionedCache": lambda: pos.copy(headroom=a.steps + 8),
               "PositionedCache fixed": lambda: fixed.copy()}
    fwds = a.compiled
    ref = None
    for name, make in sources.items():
        toks, _ = decode(model, make(), first, 4, fwds[name])
        ref = toks if ref is None else ref
        assert toks == ref, f"context {ctx}: {name} tokens {toks} != DynamicCache tokens {ref}"
    names = list(sources)
    times = {name: [] for name in names}
    rounds = {name: [] for name in names}        # per-round median seconds per token, for paired ratios
    for r in tqdm(range(a.reps), desc=f"context {ctx} rounds", leave=False):
        for name in names[r % len(names):] + names[:r % len(names)]:   # order rotates: no cache always runs last
            _, ts = decode(model, make_and_drop(sources[name]), first, a.steps + 2, fwds[name])
            times[name].extend(ts[2:])
            rounds[name].append(statistics.median(ts[2:]))
    for name in names:
        ts = times[name]
        ref_name = "DynamicCache" if name in ("DynamicCache", "PositionedCache") else "StaticCache"
        paired = [b / t for t, b in zip(rounds[name], rounds[ref_name])]   # same round, side by side
        rows.append({"context": ctx, "cache": name, "compiled": True, "tokens_per_s": 1.0 / statistics.median(ts),
                     "ms_per_token": 1e3 * statistics.median(ts), "ratio_vs": ref_name,
                     "ratio": statistics.median(paired), "ratio_min": min(paired), "ratio_max": max(paired)})


def make_and_drop(make):
    """A fresh cache from `make`, after collecting the previous round's garbage (so no cache decodes beside the
    freed buffers of another)."""
    gc.collect()
    return make()


def main_compiled(a, model) -> None:
    torch._dynamo.config.recompile_limit = 16     # StaticCache specialises on each capacity (one per context)
    a.compiled = {name: compiled_entry(model, name.replace(" ", "_"))
                  for name in ("DynamicCache", "StaticCache", "PositionedCache", "PositionedCache fixed")}
    g = torch.Generator().manual_seed(0)
    rows = []
    t0 = time.perf_counter()
    for ctx in tqdm(a.contexts, desc="contexts"):
        ids = torch.randint(100, model.config.vocab_size - 100, (1, ctx), generator=g)
        run_compiled(a, model, ctx, ids, rows)
    table = markdown_table(rows, ["context", "cache", "tokens_per_s", "ms_per_token", "ratio_vs", "ratio",
                                  "ratio_min", "ratio_max"],
                           {"tokens_per_s": ".2f", "ms_per_token": ".1f", "ratio": ".3f", "ratio_min": ".3f",
                            "ratio_max": ".3f"})
    payload = {"model": getattr(model, "name_or_path", "?"), "steps": a.steps, "reps": a.reps, "compiled": True,
               "torch": torch.__version__, "wall_s": time.perf_counter() - t0, "machine": machine(), "rows": rows}
    write_outputs(a.json, payload, table)
    png = a.plot or (a.json and a.json.rsplit(".", 1)[0] + ".png")
    names = ("DynamicCache", "StaticCache", "PositionedCache", "PositionedCache fixed")
    series = {n: ([r["context"] for r in rows if r["cache"] == n], [r["tokens_per_s"] for r in rows if r["cache"] == n])
              for n in names}
    plot(png, series, "context tokens", "compiled decode tokens/s", "Compiled decode (torch.compile, inductor), "
         "SmolLM2-135M fp32, CPU", logx=True)


def main() -> None:
    ap = bench_parser(__doc__, plot=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="decode through torch.compile (four caches, see above)")
    a = parse_bench_args(ap)
    model, _ = load_model(a.model)
    if a.compile:
        return main_compiled(a, model)
    g = torch.Generator().manual_seed(0)
    rows = []
    for ctx in tqdm(a.contexts, desc="contexts"):
        ids = torch.randint(100, model.config.vocab_size - 100, (1, ctx), generator=g)
        dyn = DynamicCache(config=model.config)
        with torch.no_grad():
            first = model(ids, cache=dyn, use_cache=True).logits[:, -1:].argmax(-1)
        pos = PositionedCache.from_dynamic(model, dyn)
        ta, _ = decode(model, copy.deepcopy(dyn), first, 4)
        tb, _ = decode(model, pos.copy(), first, 4)
        assert ta == tb, f"context {ctx}: PositionedCache tokens {tb} != DynamicCache tokens {ta}"
        times = {"DynamicCache": [], "PositionedCache": []}
        for _ in range(a.reps):
            for name, src in (("DynamicCache", dyn), ("PositionedCache", pos)):
                c = copy.deepcopy(src) if name == "DynamicCache" else src.copy()
                _, ts = decode(model, c, first, a.steps)
                times[name].extend(ts[1:])  # first step after a copy warms the allocator
        for name, ts in times.items():
            rows.append({"context": ctx, "cache": name, "tokens_per_s": 1.0 / statistics.median(ts),
                         "ms_per_token": 1e3 * statistics.median(ts)})
        r = rows[-1]["tokens_per_s"] / rows[-2]["tokens_per_s"]
        rows[-1]["ratio_vs_dynamic"] = r
        rows[-2]["ratio_vs_dynamic"] = 1.0
    table = markdown_table(rows, ["context", "cache", "tokens_per_s", "ms_per_token", "ratio_vs_dynamic"],
                           {"tokens_per_s": ".2f", "ms_per_token": ".1f", "ratio_vs_dynamic": ".3f"})
    payload = {"model": getattr(model, "name_or_path", "?"), "steps": a.steps, "reps": a.reps, "machine": machine(),
               "rows": rows}
    write_outputs(a.json, payload, table)
    png = a.plot or (a.json and a.json.rsplit(".", 1)[0] + ".png")
    series = {name: ([r["context"] for r in rows if r["cache"] == name],
                     [r["tokens_per_s"] for r in rows if r["cache"] == name])
              for name in ("DynamicCache", "PositionedCache")}
    plot(png, series, "context tokens", "decode tokens/s", "Decode speed, SmolLM2-135M fp32, CPU", logx=True)


if __name__ == "__main__":
    main()
