"""Agreement vs cost of edit rules "prefix when it is cheap, else strategy S", from saved pie_eval records.

    PYTHONPATH=bench python experiments/pie_frontier.py results/pie_calib_seed1.json [more.json ...] --json results/pie_frontier_seed1.json
                                 [--lambdas 0 1 1.5 2 3] [--target-agree 95] [--target-ratio 0.5]

For every strategy S a pie_eval run recorded (besides full, prefix and naive) and every lambda: per sample, the rule
takes `prefix` (exact) when prefix re-encodes at most lambda x the tokens S re-encodes, else S. Both branches were run
on the same sample, so the rule's prediction, tokens and update time are read from the record, not modelled: this is
what running the rule would have given, within timing noise. lambda = 0 is S alone.
Per task: agreement with full (%), and cost as ratios of sums over the task's samples to prefix's: tokens re-encoded
and measured update time. A rule meets the target when, on every task, agreement >= --target-agree at a time ratio
<= --target-ratio. Writes JSON + markdown (every rule, then the cheapest rule per agreement level) + PNG (agreement vs
time ratio per task, the target marked).
Use it on calibration runs to choose rules; on held-out runs it only describes (choosing there fits the test set).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from _common import markdown_table, plot, write_outputs

TASKS = ("insertion", "deletion", "multi")
NOT_RULES = ("full", "prefix", "naive")


def load_records(paths: list[str]) -> list[dict]:
    """The records of pie_eval JSON files (each with full and prefix). Raises SystemExit naming what is missing."""
    out = []
    for p in paths:
        if not os.path.isfile(p):
            raise SystemExit(f"records: expected a pie_eval JSON written with --json, got {p!r} (no such file)")
        with open(p) as f:
            d = json.load(f)
        recs = d.get("records") if isinstance(d, dict) else None
        if not recs:
            raise SystemExit(f"records: expected a pie_eval JSON with 'records', got {p!r} without them")
        for i, r in enumerate(recs):
            for need in ("full", "prefix"):
                if need not in r["pred"]:
                    raise SystemExit(f"records: expected every record to hold '{need}', got {p} record {i} without")
        out += [{**r, "source": os.path.basename(p)} for r in recs]
    return out


def rule_outcome(rec: dict, strategy: str, lam: float) -> tuple[bool, float, float]:
    """(agrees with full, tokens, update seconds) of "prefix when its tokens <= lam x the strategy's, else it"."""
    tp, ts = rec["tokens_encoded"]["prefix"], rec["tokens_encoded"][strategy]
    pick = "prefix" if lam > 0 and tp <= lam * ts else strategy
    return rec["pred"][pick] == rec["pred"]["full"], rec["tokens_encoded"][pick], rec["update_s"][pick]


def evaluate(records: list[dict], lambdas: list[float]) -> list[dict]:
    """One row per (strategy, lambda, task): n, agree (%), token_ratio and time_ratio (sums vs prefix's)."""
    strategies = sorted({s for r in records for s in r["pred"]} - set(NOT_RULES))
    rows = []
    for s in strategies:
        for lam in lambdas:
            for task in TASKS:
                sel = [r for r in records if r["task"] == task and s in r["pred"]]
                if not sel:
                    continue
                got = [rule_outcome(r, s, lam) for r in sel]
                rows.append({"strategy": s, "lambda": lam, "task": task, "n": len(sel),
                             "agree": 100.0 * statistics.fmean(a for a, _, _ in got),
                             "token_ratio": sum(t for _, t, _ in got) / sum(r["tokens_encoded"]["prefix"] for r in sel),
                             "time_ratio": sum(u for _, _, u in got) / sum(r["update_s"]["prefix"] for r in sel)})
    return rows


def rules(rows: list[dict], agree: float, ratio: float) -> list[dict]:
    """Per (strategy, lambda): the worst task's agreement and time ratio, and whether every task meets the target."""
    out = []
    for key in dict.fromkeys((r["strategy"], r["lambda"]) for r in rows):
        mine = [r for r in rows if (r["strategy"], r["lambda"]) == key]
        out.append({"strategy": key[0], "lambda": key[1], "tasks": len(mine),
                    "min_agree": min(r["agree"] for r in mine), "max_time_ratio": max(r["time_ratio"] for r in mine),
                    "max_token_ratio": max(r["token_ratio"] for r in mine),
                    "meets_target": all(r["agree"] >= agree and r["time_ratio"] <= ratio for r in mine)})
    return sorted(out, key=lambda r: (-r["min_agree"], r["max_time_ratio"]))


def render(rows: list[dict], summary: list[dict], agree: float, ratio: float) -> str:
    met = [r for r in summary if r["meets_target"]]
    head = (f"Rules meeting the target (every task >= {agree:g}% agreement at <= {ratio:g}x prefix's update time): "
            + (", ".join(f"{r['strategy']} lambda={r['lambda']:g}" for r in met) if met else "none") + "\n\n")
    f = {"agree": ".1f", "token_ratio": ".3f", "time_ratio": ".3f", "lambda": "g", "min_agree": ".1f",
         "max_time_ratio": ".3f", "max_token_ratio": ".3f"}
    return (head + "Per rule, worst task:\n\n"
            + markdown_table(summary, ["strategy", "lambda", "tasks", "min_agree", "max_time_ratio",
                                       "max_token_ratio", "meets_target"], f)
            + "\n\nPer rule and task:\n\n"
            + markdown_table(rows, ["strategy", "lambda", "task", "n", "agree", "token_ratio", "time_ratio"], f))


def plot_frontier(rows: list[dict], path: str | None, agree: float, ratio: float) -> None:
    """Per task, the upper-left frontier of (time ratio, agreement) over all rules; the target corner marked."""
    series = {}
    for task in TASKS:
        pts = sorted((r["time_ratio"], r["agree"]) for r in rows if r["task"] == task)
        front, best = [], -1.0
        for x, y in pts:
            if y > best:
                front.append((x, y))
                best = y
        if front:
            series[f"{task} (best rule at each cost)"] = ([x for x, _ in front], [y for _, y in front])
    series["target corner"] = ([ratio, ratio], [agree, 100.0])
    series["prefix (exact)"] = ([1.0], [100.0])
    plot(path, series, "update time / exact prefix reuse (same samples)", "agreement with full (%)",
         "Edit rules: best agreement at each cost (per task)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="pie_eval JSON files with records")
    ap.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 1.0, 1.5, 2.0, 3.0])
    ap.add_argument("--target-agree", type=float, default=95.0)
    ap.add_argument("--target-ratio", type=float, default=0.5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if any(lam < 0 for lam in a.lambdas):
        raise SystemExit(f"--lambdas: expected values >= 0, got {a.lambdas}")
    records = load_records(a.runs)
    rows = evaluate(records, a.lambdas)
    summary = rules(rows, a.target_agree, a.target_ratio)
    payload = {"runs": a.runs, "lambdas": a.lambdas, "target_agree": a.target_agree, "target_ratio": a.target_ratio,
               "samples": {t: sum(r["task"] == t for r in records) for t in TASKS}, "rules": summary, "rows": rows}
    write_outputs(a.json, payload, render(rows, summary, a.target_agree, a.target_ratio))
    if a.json:
        plot_frontier(rows, a.json.rsplit(".", 1)[0] + ".png", a.target_agree, a.target_ratio)


if __name__ == "__main__":
    main()
