"""Position bias of a pairwise judge: a SQuAD question, its paragraph, and two candidate answers (the gold one and
the answer of another question on the same paragraph), asked in both orders.

    python bench/judge_eval.py --n 100 --methods full sequential sequential+pine --json results/judge_eval.json
    python bench/judge_eval.py --report R.jsonl --json results/judge_eval.json

Prompt (chat template, one user turn each): the paragraph, "Candidate answer: <A>", "Candidate answer: <B>", then
"Which candidate answer above answers the question? Question: ...". The judge's pick is the candidate whose text,
teacher forced as the reply, has the higher mean log-probability (RagPipeline.score: the same request path as every
method). Per method (bench/rag_qa.py names; the paragraph and candidates are the chunks): accuracy (gold picked,
over both orders), swap agreement (the same candidate picked in both orders), first-slot rate (how often the
candidate in the first slot is picked: 50% is unbiased). PINE-lite (+pine) is order-invariant by construction, so
its swap agreement is 100% up to ties; what it costs in accuracy is the measure. Records resume (--records).
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch
from tqdm import tqdm

import rag_qa
from _common import bench_parser, machine, markdown_table, parse_bench_args, write_outputs
from kvpos.data import squad_judge_items
from kvpos.integrations.hf import load_model
from kvpos.integrations.rag import ChatPromptBuilder, RagPipeline

PREFIX = "Which candidate answer above answers the question? Reply with that answer.\nQuestion: "


@torch.no_grad()
def candidate_logprob(rag: RagPipeline, parts, method, text: str) -> float:
    """Mean log-probability of `text` teacher forced as the reply to the request `parts` under `method`."""
    ids = torch.tensor(rag.tok(text, add_special_tokens=False).input_ids, dtype=torch.long)
    logits = rag.score(parts, method, ids)[0].float()
    Q = parts.question.numel()
    lp = torch.log_softmax(logits[Q - 1:Q - 1 + ids.numel()], -1)
    return float(lp.gather(1, ids[:, None]).mean())


def judge(rag: RagPipeline, item: dict, method) -> dict:
    """Both orders of one item: the pick (0 = gold, 1 = wrong) and the log-probabilities per order."""
    out = {}
    for order, cands in (("gold_first", (item["gold"], item["wrong"])), ("wrong_first", (item["wrong"], item["gold"]))):
        parts = rag.builder.parts([item["paragraph"], *(f"Candidate answer: {c}" for c in cands)], item["question"])
        lps = [candidate_logprob(rag, parts, method, c) for c in cands]
        first_wins = lps[0] >= lps[1]
        out[order] = {"logprobs": lps, "picked_first": first_wins,
                      "picked_gold": first_wins == (order == "gold_first")}
    return out


def summarize(rows: list[dict]) -> list[dict]:
    table = []
    for m in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == m]
        picks = [r[o] for r in rs for o in ("gold_first", "wrong_first")]
        table.append({"method": m, "items": len(rs),
                      "accuracy": 100 * statistics.fmean(p["picked_gold"] for p in picks),
                      "swap_agreement": 100 * statistics.fmean(
                          r["gold_first"]["picked_gold"] == r["wrong_first"]["picked_gold"] for r in rs),
                      "first_slot_rate": 100 * statistics.fmean(p["picked_first"] for p in picks)})
    return table


def report(rows: list[dict], json_path: str | None, extra: dict) -> None:
    table = summarize(rows)
    write_outputs(json_path, {**extra, "machine": machine(), "methods": table},
                  markdown_table(table, ["method", "items", "accuracy", "swap_agreement", "first_slot_rate"],
                                 {"accuracy": ".1f", "swap_agreement": ".1f", "first_slot_rate": ".1f"}))


def main(argv=None) -> None:
    ap = bench_parser(__doc__.split("\n")[0], seed=0, records=True)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--split", choices=["calibration", "heldout"], default="heldout")
    ap.add_argument("--methods", nargs="+", default=["full", "sequential", "sequential+pine"])
    a = parse_bench_args(ap, argv)
    if a.report:
        report(rag_qa.read_records(a.report), a.json, {"records": a.report})
        return
    if a.n < 1:
        ap.error(f"--n: expected an int >= 1, got {a.n}")
    model, tok = load_model(a.model)
    rag = RagPipeline(model, tok, builder=ChatPromptBuilder(tok, question_prefix=PREFIX))
    methods = [rag_qa.method_from_name(m) for m in a.methods]
    done = {(r["id"], r["method"]) for r in rag_qa.read_records([a.records])} \
        if a.records and os.path.exists(a.records) else set()
    rows = []
    for item in tqdm(squad_judge_items(a.n, a.split), desc="judge (both orders)", file=sys.stdout, unit="q"):
        for m in methods:
            if (item["id"], m.name) in done:
                continue
            row = {"id": item["id"], "method": m.name, **judge(rag, item, m)}
            rows.append(row)
            if a.records:
                with open(a.records, "a") as f:
                    f.write(json.dumps(row) + "\n")
    rows = rag_qa.read_records([a.records]) if a.records else rows
    report(rows, a.json, {"args": vars(a), "model": getattr(model, "name_or_path", "?")})


if __name__ == "__main__":
    main()
