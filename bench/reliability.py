"""The reliability table: outcome counts of the long fuzz profile, plus what the weights fingerprint costs.

    make fuzz      # KVPOS_FUZZ=long pytest (fuzz, reliability, architecture sweep, connector scheduler), then this
    python bench/reliability.py --outcomes results/reliability_outcomes.json --json results/reliability.json

Rows: category | cases tried | ok | clear error | silent wrong | obscure error | state corrupted. "ok" = the call
succeeded and every invariant held (or a damaged entry was byte-identical to the original); "clear error" = it was
refused with a ValueError/TypeError/store error naming what was expected (or a damaged entry was detected and
dropped); the last three must be 0. The fingerprint cost is measured on the default model (SmolLM2-135M fp32):
the full sha256 over every weight, and the O(#tensors) check that decides whether to recompute it.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from _common import bench_parser, machine, markdown_table, parse_bench_args, write_outputs
from kvpos.store import WeightsDigest
from kvpos.integrations.hf import DEFAULT_MODEL_NAME, load_default_model

OUTCOMES = ("ok", "clear error", "silent wrong", "obscure error", "state corrupted")


def fingerprint_cost(reps: int = 3) -> dict:
    model, _ = load_default_model(torch.float32)
    w = WeightsDigest(model)
    full = []
    for _ in range(reps):
        t = time.perf_counter()
        w.refresh()
        full.append(time.perf_counter() - t)
    check = []
    for _ in range(20):
        t = time.perf_counter()
        w.digest()
        check.append(time.perf_counter() - t)
    n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"model": DEFAULT_MODEL_NAME, "bytes_hashed": n_bytes,
            "full_digest_s": statistics.median(full), "change_check_s": statistics.median(check),
            "tensors": len(model.state_dict())}


def main() -> None:
    ap = bench_parser(__doc__, model=False)
    ap.add_argument("--outcomes", required=True, help="JSON written by the fuzz run (KVPOS_FUZZ_REPORT)")
    a = parse_bench_args(ap)
    with open(a.outcomes) as f:
        counts = json.load(f)
    rows = []
    for cat in sorted(counts):
        c = counts[cat]
        unknown = sorted(set(c) - set(OUTCOMES))
        if unknown:
            raise SystemExit(f"--outcomes: expected outcomes among {OUTCOMES}, got {unknown} in {cat!r}")
        rows.append({"category": cat, "cases tried": sum(c.values()), **{o: c.get(o, 0) for o in OUTCOMES}})
    fp = fingerprint_cost()
    table = markdown_table(rows, ["category", "cases tried", *OUTCOMES])
    table += (f"\n\nWeights fingerprint on {fp['model']}: sha256 over {fp['bytes_hashed'] / 1e6:.0f} MB of "
              f"{fp['tensors']} tensors in {fp['full_digest_s']:.2f} s (once, and again only after a weight "
              f"changes); the change check before each use takes {fp['change_check_s'] * 1e3:.2f} ms.")
    bad = sum(r[o] for r in rows for o in ("silent wrong", "obscure error", "state corrupted"))
    write_outputs(a.json, {"machine": machine(), "rows": rows, "fingerprint": fp, "bad_outcomes": bad}, table)
    if bad:
        raise SystemExit(f"reliability: {bad} cases were silently wrong, obscure or corrupting (see the table)")


if __name__ == "__main__":
    main()
