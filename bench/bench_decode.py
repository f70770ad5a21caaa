"""Decode tokens/s: PositionedCache vs transformers DynamicCache, side by side in one run, on the default model.

    python bench/bench_decode.py --json results/bench_decode.json [--contexts 512 2048 4096] [--steps 32]

Each context is prefilled once (DynamicCache); the PositionedCache is built from it (same keys). Then both decode
`--steps` greedy tokens from identical copies, alternating A/B/A/B for `--reps` rounds; the median per-token time
gives tokens/s. Correctness is asserted once per context before timing (identical greedy tokens).
Look at: ratio = PositionedCache tokens/s / DynamicCache tokens/s (target >= 1.0 at 2048 and above).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache

from _common import machine, markdown_table, plot, write_outputs
from kvpos.integrations.hf import PositionedCache, load_model


@torch.no_grad()
def decode(model, cache, first, steps):
    """Greedy decode `steps` tokens with a plain forward loop; returns (tokens, per-token seconds)."""
    nxt, toks, ts = first, [], []
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(nxt, cache=cache, use_cache=True).logits
        nxt = logits[:, -1:].argmax(-1)
        ts.append(time.perf_counter() - t)
        toks.append(int(nxt))
    return toks, ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=None, help="default: embedded SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (default: beside --json)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, _ = load_model(a.model)
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
