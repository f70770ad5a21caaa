"""Keys stored once (storage="raw", rotate-on-read) against the default storage="rotated", on every path users
take, side by side in one run on the default model: is "raw" at least as fast AND exact enough to be the default?

    python bench/bench_storage.py --json results/bench_storage.json [--reps 3] [--no-compile]

Paths (each run on both storages from the same inputs, alternating rotated / raw for `--reps` rounds; the median
time of each is reported and ratio = rotated time / raw time, > 1 meaning raw is faster):
  prefill       extend() over a 512 / 2048-token context (real text: Python standard-library source)
  decode        kvpos generate() of `--steps` greedy tokens after a 512 / 2048 context, fp32 and bf16
  compiled      decode through torch.compile(model.forward) (cache reserved for the new tokens); fixed capacity
                (capacity=, for fullgraph / StaticCache-like decoding) is tried on both
  ape           generate() under use_ape over a parallel layout of 4 stored chunks
  window        generate() under use_window (windowed-RoPE retrieval, 5% budget) after a 2048 context
  repairs       compose() of 4 stored chunks, sequential, link_k=16 + selective recompute 15% (recompute forwards)
  edits         EditSession.apply of a one-line replacement in a 1024-token document (strategy "pie")
  shift         shift_ of every slot by +100 positions (a position operation)
Exactness: "same" = the greedy tokens (or first tokens / argmax of the last logits) of raw equal rotated's;
max_abs_logit_diff where logits are compared. Decode at 8k / 32k and memory are in results/bench_memory.md.
A path a storage cannot take is reported with the reason (the error it raises), never skipped silently.
"""
from __future__ import annotations

import inspect
import json
import statistics
import time
from typing import Any, Callable

import torch
from tqdm import tqdm

from kvpos import Replace
from kvpos.window import WindowConfig
from kvpos.integrations.ape import use_ape
from kvpos.integrations.compose import ChunkComposer
from kvpos.integrations.hf import PositionedCache, extend, generate, load_model
from kvpos.integrations.pie import EditSession
from kvpos.integrations.window import use_window

from _common import bench_parser, machine, markdown_table, parse_bench_args, write_outputs

STORAGES = ("rotated", "raw")


def text_ids(tok: Any, n: int, offset: int = 0) -> torch.Tensor:
    """[1, n] token ids of real text (the standard library's own source, json then inspect)."""
    src = open(json.__file__).read() + open(inspect.__file__).read()
    ids = tok(src, return_tensors="pt").input_ids[0]
    if ids.numel() < offset + n:
        raise ValueError(f"text_ids: expected {offset + n} tokens of standard-library source, got {ids.numel()}")
    return ids[offset: offset + n][None]


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def side_by_side(reps: int, run: Callable[[str], tuple[Any, float]]) -> dict:
    """run(storage) -> (output, seconds) for both storages, alternating, `reps` rounds; the first round's outputs
    are compared. Returns per storage the median seconds, or the refusal."""
    outs, secs, refused = {}, {s: [] for s in STORAGES}, {}
    for r in range(reps):
        for s in (STORAGES if r % 2 == 0 else STORAGES[::-1]):
            if s in refused:
                continue
            try:
                out, t = run(s)
            except (ValueError, TypeError) as e:
                refused[s] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            outs.setdefault(s, out)
            secs[s].append(t)
    return {"outs": outs, "secs": {s: statistics.median(v) for s, v in secs.items() if v}, "refused": refused}


def row(path: str, setting: str, res: dict, compare: Callable[[Any, Any], dict]) -> dict:
    r = {"path": path, "setting": setting}
    for s in STORAGES:
        r[f"{s}_s"] = res["secs"].get(s)
        if s in res["refused"]:
            r[f"{s}_refused"] = res["refused"][s]
    if len(res["outs"]) == 2:
        r.update(compare(res["outs"]["rotated"], res["outs"]["raw"]))
        r["ratio"] = r["rotated_s"] / r["raw_s"]
    return r


def same_tokens(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"same": bool(torch.equal(a, b))}


def same_logits(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"same": bool(torch.equal(a.argmax(-1), b.argmax(-1))),
            "max_abs_logit_diff": float((a.float() - b.float()).abs().max())}


def prefill(model, ids, storage):
    cache = PositionedCache.from_model(model, storage=storage)
    return extend(model, cache, ids, last_logits=True)[0, -1], cache


def paths_exact(a, model, tok, rows):
    for n in (512, 2048):
        ids = text_ids(tok, n)
        res = side_by_side(a.reps, lambda s: timed(lambda: prefill(model, ids, s)[0]))
        rows.append(row("prefill", f"{n} tokens fp32", res, same_logits))
    for dtype in (torch.float32, torch.bfloat16):
        m = model if dtype == torch.float32 else load_model(a.model, dtype=torch.bfloat16)[0]
        for n in (512, 2048):
            ids = text_ids(tok, n)
            q = text_ids(tok, 8, offset=n)
            base = {s: prefill(m, ids, s)[1] for s in STORAGES}

            def dec(s):
                cache = base[s].copy(headroom=a.steps + 8)
                out, t = timed(lambda: generate(m, cache, q, max_new_tokens=a.steps, do_sample=False,
                                                min_new_tokens=a.steps))
                return out, t / a.steps
            res = side_by_side(a.reps, dec)
            rows.append(row("decode", f"{n} ctx {str(dtype).replace('torch.', '')} (s/token)", res, same_tokens))
    ids = text_ids(tok, 1024)
    base = {s: prefill(model, ids, s)[1] for s in STORAGES}

    def shift(s):
        cache = base[s].copy()
        _, t = timed(lambda: cache.shift_(0, cache.num_slots, 100))
        return cache.positions.clone(), t
    rows.append(row("shift", "1024 slots +100", side_by_side(a.reps, shift), same_tokens))


def paths_compiled(a, model, tok, rows):
    ids, q = text_ids(tok, 512), text_ids(tok, 1, offset=512)
    fwd = torch.compile(model.forward)

    def dec(s, capacity):
        with torch.no_grad():
            cache = PositionedCache.from_model(model, storage=s, capacity=capacity)
            pos = torch.arange(512)[None]
            first = fwd(input_ids=ids, position_ids=pos, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            if capacity is None:
                cache.reserve_(512 + a.steps + 2)
            nxt, toks, ts = first, [], []
            for i in range(a.steps + 2):
                t = time.perf_counter()
                nxt = fwd(input_ids=nxt, position_ids=torch.tensor([[512 + i]]), cache=cache,
                          use_cache=True).logits[:, -1:].argmax(-1)
                ts.append(time.perf_counter() - t)
                toks.append(int(nxt))
        return torch.tensor(toks), statistics.median(ts[2:])
    for capacity, name in ((None, "compiled decode 512 ctx (s/token)"),
                           (512 + a.steps + 8, "compiled fixed-capacity decode 512 ctx (s/token)")):
        rows.append(row("compiled", name, side_by_side(a.reps, lambda s: dec(s, capacity)), same_tokens))


def paths_flows(a, model, tok, rows):
    anchor = text_ids(tok, 24)[0]
    chunks = [text_ids(tok, 256, offset=100 + 300 * i)[0] for i in range(4)]
    q = text_ids(tok, 12, offset=2000)
    composer = ChunkComposer(model, anchor)
    composer.precompute(chunks, progress=False)

    def ape(s):
        cache, _ = composer.compose(chunks, layout="parallel", storage=s)
        with use_ape(model, cache, temperature=0.5, scale=0.8):
            return timed(lambda: generate(model, cache, q, max_new_tokens=a.steps, do_sample=False,
                                          min_new_tokens=a.steps))
    rows.append(row("ape", "4 x 256-token chunks, parallel", side_by_side(a.reps, ape), same_tokens))

    def repairs(s):
        (cache, _), t = timed(lambda: composer.compose(chunks, layout="sequential", link_k=16,
                                                       recompute_ratio=0.15, storage=s))
        return extend(model, cache, q, last_logits=True)[0, -1], t
    rows.append(row("repairs", "compose 4 chunks, link_k=16 + recompute 15%", side_by_side(a.reps, repairs),
                    same_logits))

    ids = text_ids(tok, 2048)
    base = {s: prefill(model, ids, s)[1] for s in STORAGES}

    def window(s):
        cache = base[s].copy(headroom=a.steps + 16)
        with use_window(model, cache, WindowConfig(sinks=8, window=64, distance=1024, budget=0.05)):
            return timed(lambda: generate(model, cache, q, max_new_tokens=a.steps, do_sample=False,
                                          min_new_tokens=a.steps))
    rows.append(row("window", "2048 ctx, 5% far budget", side_by_side(a.reps, window), same_tokens))

    doc = text_ids(tok, 1024)[0]
    line = text_ids(tok, 12, offset=3000)[0].tolist()

    def edit(s):
        session = EditSession(model, doc, storage=s)
        res = session.apply(Replace(500, 510, line), strategy="pie")
        out = session.generate(max_new_tokens=8, do_sample=False)
        return out, res.update_s
    rows.append(row("edits", "1024-token document, 10 tokens replaced (pie)", side_by_side(a.reps, edit),
                    same_tokens))


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled paths")
    a = parse_bench_args(ap)
    model, tok = load_model(a.model)
    rows: list[dict] = []
    t0 = time.perf_counter()
    stages = [paths_exact, paths_flows] + ([] if a.no_compile else [paths_compiled])
    for stage in tqdm(stages, desc="paths"):
        stage(a, model, tok, rows)
    cols = ["path", "setting", "rotated_s", "raw_s", "ratio", "same", "max_abs_logit_diff", "raw_refused"]
    table = markdown_table(rows, cols, {"rotated_s": ".4f", "raw_s": ".4f", "ratio": ".2f",
                                        "max_abs_logit_diff": ".2e"})
    payload = {"model": getattr(model, "name_or_path", "?"), "reps": a.reps, "steps": a.steps,
               "wall_s": time.perf_counter() - t0, "machine": machine(), "rows": rows}
    write_outputs(a.json, payload, table)


if __name__ == "__main__":
    main()
