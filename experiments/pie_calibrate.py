"""Fit `auto`'s rule on a calibration run of pie_eval (another seed than the evaluation), from its per-sample records.

    python bench/pie_eval.py --seed 1 --samples 40 --skip pie naive pie+k --also pie+k64+tail512 ... \\
        --json results/pie_calib_seed1.json
    PYTHONPATH=bench python experiments/pie_calibrate.py --records results/pie_calib_seed1.json --json results/pie_auto_calibration.json

auto(R, V): per sample, prefix (exact) when at most R tokens of the new document follow the first edit, else V (a
pie+k<K>+tail<T> strategy of the run). Its outcome on a sample is the outcome of the strategy it picks, which the run
measured on that very sample: agreement with full and update time. For every R on a grid and every V, the script
reports agreement per task and the mean update time relative to prefix on the same samples, and picks the cheapest
rule (max over tasks of that ratio) whose agreement is at least --target on every task. The chosen R, K, T become
kvpos.edits.AUTO_PREFIX_MAX / AUTO_K / AUTO_TAIL; the evaluation then runs on other samples (seed 0).
"""
from __future__ import annotations

import argparse
import json
import statistics

from _common import machine, markdown_table, plot, write_outputs
from kvpos.edits import Strategy

TASKS = ("insertion", "deletion", "multi")


def candidates(records: list[dict]) -> list[str]:
    """The strategies of the run that auto can use when it does not pick prefix: pie with k and tail only."""
    out = []
    for name in records[0]["pred"]:
        try:
            s = Strategy.parse(name)
        except ValueError:
            continue
        if s.base == "pie" and s.repair is None:
            out.append(name)
    return out


def evaluate(records: list[dict], R: int, V: str) -> dict:
    """Per task: agreement (%) and mean update time / prefix's, for auto(R, V) on these records."""
    out = {}
    for task in TASKS:
        rs = [r for r in records if r["task"] == task]
        if not rs:
            continue
        pick = ["prefix" if r["to_first"] <= R else V for r in rs]
        agree = [r["pred"][p] == r["pred"]["full"] for r, p in zip(rs, pick)]
        t = [r["update_s"][p] for r, p in zip(rs, pick)]
        tp = [r["update_s"]["prefix"] for r in rs]
        out[task] = {"agree": 100.0 * statistics.fmean(agree), "ratio": statistics.fmean(t) / statistics.fmean(tp),
                     "prefix_share": 100.0 * statistics.fmean(p == "prefix" for p in pick), "n": len(rs)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", required=True, help="a pie_eval JSON with records (prefix and pie variants)")
    ap.add_argument("--target", type=float, default=96.5, help="agreement every task must reach (%%)")
    ap.add_argument("--grid", type=int, nargs="+", default=[0, 64, 128, 192, 256, 384, 512, 640, 768, 1024, 1536])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with open(a.records) as f:
        run = json.load(f)
    records = run.get("records") or []
    if not records or "to_first" not in records[0] or "prefix" not in records[0]["pred"]:
        raise SystemExit(f"--records: expected a pie_eval run with per-sample records, prefix and to_first, got "
                         f"{sorted(records[0]) if records else 'no records'}")
    cands = candidates(records)
    if not cands:
        raise SystemExit("--records: the run has no pie+k<K>+tail<T> strategy for auto to use")
    rows = []
    for V in cands:
        for R in a.grid:
            res = evaluate(records, R, V)
            row = {"rule": f"auto(R={R}, {V})", "R": R, "V": V,
                   "worst_agree": min(x["agree"] for x in res.values()),
                   "worst_ratio_vs_prefix": max(x["ratio"] for x in res.values())}
            for t, x in res.items():
                row[f"{t}_agree"], row[f"{t}_ratio"], row[f"{t}_prefix%"] = x["agree"], x["ratio"], x["prefix_share"]
            rows.append(row)
    ok = [r for r in rows if r["worst_agree"] >= a.target]
    chosen = min(ok, key=lambda r: (r["worst_ratio_vs_prefix"], -r["worst_agree"])) if ok else None
    cols = ["rule", "worst_agree", "worst_ratio_vs_prefix"] + [f"{t}_{m}" for t in TASKS for m in ("agree", "ratio")]
    table = markdown_table(rows, cols, {c: ".3f" if "ratio" in c else ".1f" for c in cols[1:]})
    if chosen is not None:
        s = Strategy.parse(chosen["V"])
        table += (f"\n\nChosen (agreement >= {a.target}% on every task, lowest worst-task cost): R={chosen['R']}, "
                  f"K={s.k}, T={s.tail}: worst agreement {chosen['worst_agree']:.1f}%, worst mean time "
                  f"{chosen['worst_ratio_vs_prefix']:.3f} of prefix's (calibration samples, seed {run.get('seed', '?')}).")
    else:
        table += f"\n\nNo rule reaches {a.target}% on every task on these samples."
    payload = {"records": a.records, "target": a.target, "machine": machine(), "rows": rows, "chosen": chosen}
    write_outputs(a.json, payload, table)
    if a.json:
        series = {V: ([r["worst_ratio_vs_prefix"] for r in rows if r["V"] == V],
                      [r["worst_agree"] for r in rows if r["V"] == V]) for V in cands}
        series["prefix (exact reference)"] = ([1.0], [100.0])
        plot(a.json.rsplit(".", 1)[0] + ".png", series, "worst-task mean update time / prefix",
             "worst-task agreement with full (%)", "auto(R, V) on the calibration split (R grid along each line)")


if __name__ == "__main__":
    main()
