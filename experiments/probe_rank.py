"""Which probe score finds the gold passage? (issue 31, calibration questions only)

For calibration items, compose the sequential chunk-reuse cache, run the question over it with the attention-mass
probe and rank the passages by several scores; report how often the gold passage is ranked first / in the top 2.
Variants: positions as composed (the question reads the nearest passage most: recency) vs every passage moved to end
right before the question ("equal distance", positions are data); sum vs mean over a passage's slots, with and
without its first token and its last 5 (turn separators); all layers vs upper / lower half.

    .venv/bin/python experiments/probe_rank.py --data squad --n 40 --threads 1
"""
import argparse
import json

import torch

from kvpos.data import hotpotqa_items, squad_items
from kvpos.prompt import ChatPromptBuilder
from kvpos.integrations.hf import load_model
from kvpos.integrations.rag import RagPipeline
from kvpos.integrations.repairs import AttentionMassProbe
from kvpos.integrations.hf.run import extend


def per_layer_mass(model, cache, probe_ids, positions):
    N = cache.num_slots
    probe = AttentionMassProbe(N)
    try:
        extend(model, cache, probe_ids.reshape(1, -1), positions=positions, attention=probe)
    finally:
        cache.crop(N - cache.num_slots)
    return torch.stack(probe.mass)                                # [L, N]


def scores(mass, slots):
    L = mass.shape[0]
    out = {}
    for lname, rows in (("all", slice(0, L)), ("low", slice(0, L // 2)), ("up", slice(L // 2, L))):
        m = mass[rows].mean(0)
        for agg in ("sum", "mean"):
            for trim in (False, True):
                vals = []
                for s, e in slots:
                    a, b = (s + 1, e - 5) if trim else (s, e)
                    seg = m[a:b]
                    vals.append(float(seg.sum() if agg == "sum" else seg.mean()))
                out[f"{lname}/{agg}/{'trim' if trim else 'raw'}"] = vals
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="squad", choices=["squad", "hotpotqa"])
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_model("smollm2")
    builder = ChatPromptBuilder(tok, question_prefix="Answer the question from the passages above in a few words.\n"
                                "Question: ")
    rag = RagPipeline(model, tok, builder=builder)
    items = (squad_items(a.n, k=9, split="calibration", seed=0) if a.data == "squad"
             else hotpotqa_items(a.n, split="calibration"))
    hits = {}
    for it in items:
        parts = builder.parts(it["paragraphs"], it["question"])
        cache, info = rag.composer.compose(parts.chunks, layout="sequential")
        slots = list(info.plan.slots)
        P = int(cache.positions.max()) + 1
        qpos = torch.arange(P, P + parts.question.numel(), dtype=torch.long)
        variants = {"composed": per_layer_mass(model, cache, parts.question, qpos)}
        eq = cache.copy()
        for s, e in slots:
            eq.set_positions_(s, e, torch.arange(P - (e - s), P, dtype=torch.long))
        variants["equal"] = per_layer_mass(model, eq, parts.question, qpos)
        gold = set(it["gold"])
        for vname, mass in variants.items():
            for sname, vals in scores(mass, slots).items():
                order = sorted(range(len(vals)), key=lambda i: -vals[i])
                h = hits.setdefault(f"{vname}/{sname}", [0, 0])
                h[0] += order[0] in gold
                h[1] += len(gold & set(order[:2])) > 0
        last = len(slots) - 1
        h = hits.setdefault("baseline/last", [0, 0])
        h[0] += last in gold
        h[1] += len(gold & {last, last - 1}) > 0
    n = len(items)
    rows = sorted(hits.items(), key=lambda kv: -kv[1][0])
    print(f"{a.data}: {n} calibration items; gold passage ranked first / in the top 2")
    for k, (t1, t2) in rows:
        print(f"  {k:28s} {100 * t1 / n:5.1f}%  {100 * t2 / n:5.1f}%")
    print(json.dumps({k: [t1 / n, t2 / n] for k, (t1, t2) in hits.items()}))


if __name__ == "__main__":
    main()
