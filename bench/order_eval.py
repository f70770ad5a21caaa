"""Document order on real questions: AttnRank (the attention basin) vs the fixed reorders RAG frameworks ship.

    python bench/order_eval.py --data hotpotqa --docs 5 --profile-n 100 --n 100 --json results/order_eval.json
    python bench/order_eval.py --report R.jsonl --json results/order_eval.json          # tables from records

Stage 1 (calibration split): for --profile-n questions, the documents composed from the chunk store in the sequential
layout (dataset order) and the question's attention mass per layer and document slot accumulated
(kvpos.ordering.AttentionBasin via integrations/attnrank.segment_mass); the profile, edge ratios and the basin layer
go to <json stem>_basin.json with a heatmap PNG. Stage 2 (held-out split): each question's documents ranked by BM25
against the question, laid out by every order (random, descending = best first, ascending = best last, lim, attnrank:
kvpos.ordering.order_for), and answered by each method (bench/rag_qa.py names, e.g. full sequential); records
"<id>%<order>" resume. Reported per (order, method): accuracy, gold NLL, and where the gold documents landed.
--docs k keeps the gold paragraph(s) and the first distractors, k documents in all (the dataset's order).
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import zlib
from collections import Counter

import torch
from tqdm import tqdm

import rag_qa
from _common import bench_parser, machine, markdown_table, parse_bench_args, write_outputs
from kvpos.ordering import ORDERS, AttentionBasin, order_for, place
from kvpos.integrations.attnrank import segment_mass
from kvpos.integrations.hf import load_model
from kvpos.integrations.rag import ChatPromptBuilder, RagPipeline


def bm25_rank(question: str, paragraphs: list[str], k1: float = 1.5, b: float = 0.75) -> list[int]:
    """Paragraph indices by BM25 score against the question (descending; ties by index), IDF over these paragraphs."""
    tok = lambda t: re.findall(r"\w+", t.lower())                                  # noqa: E731
    docs = [tok(p) for p in paragraphs]
    avg = statistics.fmean(len(d) for d in docs) or 1.0
    df = Counter(w for d in docs for w in set(d))
    n = len(docs)
    scores = []
    for d in docs:
        tf = Counter(d)
        s = 0.0
        for w in set(tok(question)):
            if tf[w]:
                idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
                s += idf * tf[w] * (k1 + 1) / (tf[w] + k1 * (1 - b + b * len(d) / avg))
        scores.append(s)
    return sorted(range(n), key=lambda i: (-scores[i], i))


def trimmed(items: list[dict], k: int | None) -> list[dict]:
    """Items with their gold paragraphs and the first distractors, k paragraphs in all (dataset order)."""
    if k is None:
        return items
    out = []
    for x in items:
        if k < len(x["gold"]):
            raise ValueError(f"--docs: expected at least {len(x['gold'])} (the gold paragraphs), got {k}")
        keep = sorted(x["gold"] + [i for i in range(len(x["paragraphs"])) if i not in x["gold"]][:k - len(x["gold"])])
        out.append({**x, "paragraphs": [x["paragraphs"][i] for i in keep], "gold": [keep.index(g) for g in x["gold"]]})
    return out


@torch.no_grad()
def profile(rag: RagPipeline, items: list[dict]) -> AttentionBasin:
    """Stage 1: the question's per-layer mass over the document slots, composed in the sequential layout."""
    basin = AttentionBasin(len(items[0]["paragraphs"]))
    for x in tqdm(items, desc="AttnRank profile", file=sys.stdout, unit="q"):
        parts = rag.builder.parts(x["paragraphs"], x["question"])
        cache, info = rag.composer.compose(parts.chunks, layout="sequential")
        basin.add(segment_mass(rag.model, cache, list(info.plan.slots), parts.question))
    return basin


def arranged(items: list[dict], basin: AttentionBasin, seed: int) -> list[dict]:
    """Every item once per order: BM25-ranked paragraphs placed by the order, ids "<id>%<order>"."""
    out = []
    for x in items:
        ranked = bm25_rank(x["question"], x["paragraphs"])
        n = len(ranked)
        for name in ORDERS:
            layout = place(ranked, order_for(name, n, basin, seed=zlib.crc32(f"{seed}:{x['id']}".encode())))
            out.append({**x, "id": f"{x['id']}%{name}", "paragraphs": [x["paragraphs"][i] for i in layout],
                        "gold": sorted(layout.index(g) for g in x["gold"])})
    return out


def report(rows: list[dict], json_path: str | None, extra: dict) -> None:
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(str(r["id"]).rsplit("%", 1)[1], []).append({**r, "id": str(r["id"]).rsplit("%", 1)[0]})
    table = []
    for order in [o for o in ORDERS if o in by]:
        for m, s in rag_qa.summarize(by[order]).items():
            gold = [statistics.fmean(r["gold"]) for r in by[order] if r["method"] == m]
            table.append({"order": order, "method": m, "n": s["n"], "accuracy": s["accuracy"], "nll": s["nll"],
                          "mean_gold_slot": statistics.fmean(gold)})
    write_outputs(json_path, {**extra, "machine": machine(), "rows": table},
                  markdown_table(table, ["order", "method", "n", "accuracy", "nll", "mean_gold_slot"],
                                 {"accuracy": ".1f", "nll": ".3f", "mean_gold_slot": ".2f"}))


def _basin_outputs(basin: AttentionBasin, path: str, tau: float) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prof = basin.profile()
    out = {"probes": basin.probes, "profile": prof.tolist(), "edge_ratio": basin.edge_ratio().tolist(),
           "tau": tau, "basin_layer": basin.basin_layer(tau), "slot_order": basin.slot_order(tau=tau)}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(prof.numpy(), aspect="auto", cmap="viridis")
    ax.set_xlabel("document slot")
    ax.set_ylabel("layer")
    ax.set_title(f"question attention per document slot ({basin.probes} probes); basin layer {out['basin_layer']}",
                 fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return out


def main(argv=None) -> None:
    ap = bench_parser(__doc__.split("\n")[0], seed=0, records=True)
    ap.add_argument("--data", choices=["squad", "squad-hard", "hotpotqa"], default="hotpotqa")
    ap.add_argument("--docs", type=int, default=None, help="documents per question (gold + first distractors)")
    ap.add_argument("--profile-n", type=int, default=100)
    ap.add_argument("--n", type=int, default=100, help="held-out questions (each in every order)")
    ap.add_argument("--tau", type=float, default=1.5, help="basin threshold on the edge ratio")
    ap.add_argument("--methods", nargs="+", default=["full", "sequential"])
    ap.add_argument("--max-new", type=int, default=24)
    a = parse_bench_args(ap, argv)
    if a.report:
        report(rag_qa.read_records(a.report), a.json, {"records": a.report})
        return
    model, tok = load_model(a.model)
    builder = ChatPromptBuilder(tok, question_prefix=rag_qa.question_prefix(rag_qa.INSTRUCTION))
    rag = RagPipeline(model, tok, builder=builder)
    cal = trimmed(rag_qa.load_items(a.data, a.profile_n, "calibration", a.seed, 9), a.docs)
    basin = profile(rag, cal)
    stem = os.path.splitext(a.json)[0] if a.json else "order_eval"
    info = _basin_outputs(basin, stem + "_basin.json", a.tau)
    held = arranged(trimmed(rag_qa.load_items(a.data, a.n, "heldout", a.seed, 9), a.docs), basin, a.seed)
    methods = [rag_qa.method_from_name(m) for m in a.methods]
    meta = {"data": a.data, "format": "turns", "split": "heldout", "model": getattr(model, "name_or_path", "?")}
    rows = rag_qa.run_items(rag, methods, held, a.max_new, a.records, 10 ** 9, meta)
    report(rag_qa.read_records([a.records]) if a.records else rows, a.json,
           {"args": vars(a), "basin": {k: info[k] for k in ("probes", "basin_layer", "slot_order", "tau")}})


if __name__ == "__main__":
    main()
