"""What a margin gate would do, replayed on a finished pie_eval run's records (no model): choose the floor on a
calibration split before running EditSession.complete for real on held-out samples.

    PYTHONPATH=bench python experiments/pie_gate.py results/pie_gate_calib_seed1_run.json --base auto+b20 auto+b25 [--pairs A,B] \
        --margins 0.25 0.5 1 1.5 2 --json results/pie_gate_calib_seed1.json

The gate (EditSession.complete): update with the base strategy and generate; at the first generated step whose margin
(log p top-1 - log p top-2, nats) is below the floor, abandon and redo the edit with prefix (exact). Replayed per
sample from the run's records (pie_eval >= the version that saves "margins" and "gen_s"):
  exact base choice (auto resolved to prefix)  -> the base's prediction and update time (never gated)
  every margin of the base's generation >= floor -> the base's prediction and update time
  else (first low step j of m steps)            -> prefix's prediction; cost = base update + gen_s x (j+1)/m
                                                   (the abandoned generation, pro rata) + prefix's update
Agreement is with full's prediction; cost is the mean over the task's samples over prefix's mean update time (the
same ratio pie_eval reports). The abandoned generation's share is an estimate (steps pro rata); the held-out run
measures it. Writes JSON + markdown + a PNG (agreement vs cost, one line per task and base through the floors).

--pairs A,B replays a second gate on runs without margins: trust A's line when another approximation B predicts the
same line, else prefix; cost = both updates (+ prefix's on a fall-back), the agreement check itself not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from _common import markdown_table, plot, write_outputs


def replay(rec: dict, base: str, floor: float) -> tuple[str, float, bool]:
    """(prediction, cost in s, fell back) of the gate with `floor` over `base` on one record."""
    if rec.get("chosen", {}).get(base) == "prefix" or floor <= 0:
        return rec["pred"][base], rec["update_s"][base], False
    ms = rec["margins"][base]
    low = next((j for j, m in enumerate(ms) if m < floor), None)
    if low is None:
        return rec["pred"][base], rec["update_s"][base], False
    wasted = rec["gen_s"][base] * (low + 1) / len(ms)
    return rec["pred"]["prefix"], rec["update_s"][base] + wasted + rec["update_s"]["prefix"], True


def replay_pair(rec: dict, a: str, b: str) -> tuple[str, float, bool]:
    """(prediction, cost in s, fell back) of the agreement gate: trust a's line when b (another approximation)
    predicts the same line, else recompute with prefix. Cost: both updates (+ prefix's on a fall-back); checking b's
    agreement by one teacher-forced forward of a's line is not counted (a lower bound on the gate's cost)."""
    cost = rec["update_s"][a] + rec["update_s"][b]
    if rec["pred"][a] == rec["pred"][b]:
        return rec["pred"][a], cost, False
    return rec["pred"]["prefix"], cost + rec["update_s"]["prefix"], True


def _row(task: str, recs: list[dict], base: str, floor, out: list[tuple[str, float, bool]]) -> dict:
    """One table row from the replayed (prediction, cost, fell back) of each record."""
    mp = statistics.fmean(r["update_s"]["prefix"] for r in recs)
    return {"task": task, "base": base, "floor": floor, "n": len(recs),
            "agree_full": 100.0 * statistics.fmean(p == r["pred"]["full"] for (p, _, _), r in zip(out, recs)),
            "mean_ratio_vs_prefix": statistics.fmean(c for _, c, _ in out) / mp,
            "fell_back": 100.0 * statistics.fmean(f for _, _, f in out)}


def _by_task(records: list[dict]) -> list[tuple[str, list[dict]]]:
    return [(t, [r for r in records if t in ("all", r["task"])]) for t in sorted({r["task"] for r in records}) + ["all"]]


def pair_table(records: list[dict], pairs: list[tuple[str, str]]) -> list[dict]:
    """One row per task (and "all") and pair: agree_full (%), mean_ratio_vs_prefix, fell_back (%), n."""
    return [_row(task, recs, f"{a} checked by {b}", "", [replay_pair(r, a, b) for r in recs])
            for task, recs in _by_task(records) for a, b in pairs]


def table(records: list[dict], bases: list[str], floors: list[float]) -> list[dict]:
    """One row per task (and "all"), base and floor: agree_full (%), mean_ratio_vs_prefix, fell_back (%), n."""
    return [_row(task, recs, base, floor, [replay(r, base, floor) for r in recs])
            for task, recs in _by_task(records) for base in bases for floor in [0.0, *floors]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a pie_eval JSON with records holding margins and gen_s")
    ap.add_argument("--base", nargs="*", default=[], help="strategies of that run to gate by margin, e.g. auto+b25")
    ap.add_argument("--pairs", nargs="*", default=[], metavar="A,B",
                    help="also replay the agreement gate: trust A's line when B predicts the same, else prefix")
    ap.add_argument("--margins", type=float, nargs="+", default=[0.25, 0.5, 1.0, 1.5, 2.0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not os.path.isfile(a.run):
        raise SystemExit(f"run: expected a pie_eval JSON file, got {a.run!r} (no such file)")
    with open(a.run) as f:
        run = json.load(f)
    recs = run.get("records") if isinstance(run, dict) else None
    if not recs:
        raise SystemExit(f"run: expected a pie_eval JSON with records, got {a.run!r} without them")
    pairs = [tuple(p.split(",")) for p in a.pairs]
    if not a.base and not pairs or any(len(p) != 2 for p in pairs):
        raise SystemExit(f"expected --base STRATEGY... and / or --pairs A,B..., got base={a.base} pairs={a.pairs}")
    for i, r in enumerate(recs):
        missing = [b for b in a.base if b not in r.get("margins", {}) or b not in r.get("gen_s", {})]
        missing += [x for p in pairs for x in p if x not in r["pred"]]
        if missing or "prefix" not in r["pred"]:
            raise SystemExit(f"run: expected records with prefix, the margins / gen_s of {a.base} and the predictions "
                             f"of {a.pairs}, got record {i} without {missing or ['prefix']} (run pie_eval with those "
                             f"strategies, this version)")
    bad = [m for m in a.margins if not 0.0 < m < 100.0]
    if bad:
        raise SystemExit(f"--margins: expected floors in nats in (0, 100), got {bad}")
    rows = table(recs, a.base, sorted(set(a.margins))) + pair_table(recs, pairs)
    rows.sort(key=lambda r: (r["task"] == "all", r["task"]))
    md = markdown_table(rows, ["task", "base", "floor", "n", "agree_full", "mean_ratio_vs_prefix", "fell_back"],
                        {"floor": ".2f", "agree_full": ".1f", "mean_ratio_vs_prefix": ".3f", "fell_back": ".1f"})
    write_outputs(a.json, {"run": a.run, "seed": run.get("seed"), "samples": run.get("samples"), "rows": rows},
                  "Margin gate replayed on the records of " + a.run + " (floor 0 = the base ungated)\n\n" + md)
    if a.json:
        series = {f"{t} {b}": ([r["mean_ratio_vs_prefix"] for r in rows if (r["task"], r["base"]) == (t, b)],
                               [r["agree_full"] for r in rows if (r["task"], r["base"]) == (t, b)])
                  for t in sorted({r["task"] for r in rows}) for b in a.base}
        series.update({f"{r['task']} {r['base']}": ([r["mean_ratio_vs_prefix"]], [r["agree_full"]]) for r in rows
                       if r["floor"] == ""})
        plot(a.json.rsplit(".", 1)[0] + ".png", series, "mean cost / exact prefix reuse (same samples)",
             "agreement with full (%)", "Margin gate: floors 0 (left) upward, replayed")


if __name__ == "__main__":
    main()
