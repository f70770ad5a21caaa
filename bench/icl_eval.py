"""Many-shot in-context learning with parallel encoding: hundreds of demonstrations, sequential vs parallel vs APE.

    python bench/icl_eval.py --json results/icl_eval.json [--demos 50 100 200 400] [--queries 60] [--group 20]

Task (real labelled data, offline): FanOutQA questions (PyPI package fanoutqa, its dev + test JSON read at run time,
never committed; CC BY-SA 4.0) carry human-assigned topic categories. Items whose first category is one of LABELS
form a 6-way topic classification; a fixed seed splits them into a demonstration pool and held-out queries.
Prompt: an instruction (the shared anchor), demonstrations "Question: ...\\nTopic: <label>\\n\\n", then the query
"Question: ...\\nTopic:". The prediction is the label whose first token gets the highest logit (all six differ).

Methods: sequential = one full prefill of all demonstrations (the reference; only while they fit the 8k window);
parallel = demonstrations in groups of --group, each group encoded once after the anchor, all groups sharing one
position range (T = S = 1); ape = the same with APE temperature/scale. JSON rows:
{"demos", "method", "accuracy", "tokens", "prefill_positions"}.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import sys

import torch
from tqdm import tqdm

from _common import bench_parser, machine, markdown_table, parse_bench_args, plot, write_outputs
from kvpos.ape import DEFAULT_SCALE, DEFAULT_TEMPERATURE, ApeParams
from kvpos.integrations.ape import ApeBackend
from kvpos.integrations.compose import ChunkComposer
from kvpos.integrations.hf import extend, load_model

LABELS = ["Geography", "History", "Sports", "Film Studies", "Music", "Economics"]
INSTRUCTION = ("Classify each question by its topic: " + ", ".join(LABELS) + ".\n\n")


def fanout_items() -> list[dict]:
    spec = importlib.util.find_spec("fanoutqa")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("icl_eval: expected PyPI package fanoutqa (pip install --no-deps fanoutqa), got none")
    d = os.path.join(list(spec.submodule_search_locations)[0], "data")
    items = []
    for name in ("fanout-final-dev.json", "fanout-final-test.json"):
        with open(os.path.join(d, name), encoding="utf-8") as f:
            for q in json.load(f):
                cats = q.get("categories") or []
                if cats and cats[0] in LABELS:
                    items.append({"question": q["question"].strip(), "label": cats[0]})
    return items


def main() -> None:
    ap = bench_parser(__doc__, seed=0, plot=True)
    ap.add_argument("--demos", type=int, nargs="+", default=[50, 100, 200, 400])
    ap.add_argument("--queries", type=int, default=60)
    ap.add_argument("--group", type=int, default=20, help="demonstrations per parallel chunk")
    ap.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE)
    ap.add_argument("--scale", type=float, default=DEFAULT_SCALE)
    a = parse_bench_args(ap)
    model, tok = load_model(a.model)
    items = fanout_items()
    rng = random.Random(a.seed)
    rng.shuffle(items)
    queries, pool = items[: a.queries], items[a.queries:]
    label_tok = [tok(" " + l, add_special_tokens=False).input_ids[0] for l in LABELS]
    assert len(set(label_tok)) == len(LABELS), "label first tokens must differ"
    enc = lambda s: torch.tensor(tok(s, add_special_tokens=False).input_ids)  # noqa: E731
    anchor = enc(INSTRUCTION)
    cc = ChunkComposer(model, anchor)
    max_pos = model.config.max_position_embeddings
    rows = []
    for n in a.demos:
        demos = pool[:n]
        texts = [f"Question: {d['question']}\nTopic: {d['label']}\n\n" for d in demos]
        groups = [enc("".join(texts[i:i + a.group])) for i in range(0, len(texts), a.group)]
        total = anchor.numel() + sum(g.numel() for g in groups)
        cc.precompute(groups, progress=True)
        methods = ["parallel", "ape"] + (["sequential"] if total + 64 < max_pos else [])
        correct = {m: [] for m in methods}
        for q in tqdm(queries, desc=f"{n} demos ({total} tokens)", file=sys.stdout):
            qids = enc(f"Question: {q['question']}\nTopic:")[None]
            gold = LABELS.index(q["label"])
            for m in methods:
                if m == "sequential":
                    cache, _ = cc.compose(groups, layout="sequential", link_k=10 ** 6)   # = one full prefill
                    logits = extend(model, cache, qids)
                else:
                    cache, _ = cc.compose(groups, layout="parallel")
                    ape = ApeBackend(ApeParams(a.temperature, a.scale)) if m == "ape" else None
                    logits = extend(model, cache, qids, attention=ape)
                pred = int(logits[0, -1, label_tok].argmax())
                correct[m].append(pred == gold)
        par_span = anchor.numel() + max(g.numel() for g in groups)
        for m in methods:
            rows.append({"demos": n, "method": m, "accuracy": 100.0 * statistics.fmean(correct[m]), "tokens": total,
                         "prefill_positions": total if m == "sequential" else par_span})
    table = markdown_table(rows, ["demos", "method", "accuracy", "tokens", "prefill_positions"],
                           {"accuracy": ".1f"})
    payload = {"model": getattr(model, "name_or_path", "?"), "labels": LABELS, "queries": a.queries,
               "group": a.group, "temperature": a.temperature, "scale": a.scale, "chance": 100.0 / len(LABELS),
               "data": "fanoutqa dev+test questions, first category as label", "machine": machine(), "rows": rows}
    write_outputs(a.json, payload, table)
    png = a.plot or (a.json and a.json.rsplit(".", 1)[0] + ".png")
    series = {m: ([r["demos"] for r in rows if r["method"] == m], [r["accuracy"] for r in rows if r["method"] == m])
              for m in ("sequential", "parallel", "ape")}
    plot(png, series, "demonstrations", "accuracy (%)", "Many-shot topic classification (FanOutQA)", logx=True)


if __name__ == "__main__":
    main()
