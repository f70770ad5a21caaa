"""Query-aware token re-encode (`attn<pct>`) picked at the composed positions vs at equal distance (issue 31,
calibration questions only).

`attn<pct>` re-encodes the fraction of chunk tokens the question reads most. The question's attention over the
composed cache favours the passages nearest to it (see results/probe_rank.md); here the same pick is made on a copy
of the cache where every passage ends right before the question. Measured without generation: gold-answer NLL,
first-token agreement and KL against full prefill on the same questions.

    .venv/bin/python experiments/attn_equal.py --n 30 --ratios 0.05 0.1
"""
import argparse
import json

import torch

from kvpos.data import hotpotqa_items, squad_items
from kvpos.integrations.hf import load_model
from kvpos.integrations.hf.run import extend
from kvpos.integrations.rag import RagPipeline
from kvpos.integrations.repairs import AttentionMassProbe, recompute_slots
from kvpos.prompt import ChatPromptBuilder


def layer_mass(model, cache, probe_ids, positions):
    N = cache.num_slots
    probe = AttentionMassProbe(N)
    try:
        extend(model, cache, probe_ids.reshape(1, -1), positions=positions, attention=probe)
    finally:
        cache.crop(N - cache.num_slots)
    return torch.stack(probe.mass)


def scores_of(model, cache, q, gold):
    logits = extend(model, cache, torch.cat([q, gold[:-1]])[None])[0, q.numel() - 1:].float()
    lp = torch.log_softmax(logits, -1)
    return lp[0], float(-lp.gather(1, gold[:, None]).mean())


@torch.no_grad()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="squad", choices=["squad", "hotpotqa"])
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.1])
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model("smollm2")
    builder = ChatPromptBuilder(tok, question_prefix="Answer the question from the passages above in a few words.\n"
                                "Question: ")
    rag = RagPipeline(model, tok, builder=builder)
    items = (squad_items(a.n, k=9, split="calibration", seed=0) if a.data == "squad"
             else hotpotqa_items(a.n, split="calibration"))
    acc = {}
    for it in items:
        parts = builder.parts(it["paragraphs"], it["question"])
        gold = torch.tensor(tok(it["answers"][0], add_special_tokens=False).input_ids, dtype=torch.long)
        full_ids = torch.cat([parts.full_ids()[0], gold[:-1]])
        fl = torch.log_softmax(model(full_ids[None]).logits[0, parts.full_ids().shape[1] - 1:].float(), -1)
        f_first, f_nll = fl[0], float(-fl.gather(1, gold[:, None]).mean())
        cache0, info = rag.composer.compose(parts.chunks, layout="sequential")
        plan, ids = info.plan, torch.cat(parts.chunks)
        slots = plan.chunk_slots()
        P = int(cache0.positions.max()) + 1
        qpos = torch.arange(P, P + parts.question.numel(), dtype=torch.long)
        comp = layer_mass(model, cache0, parts.question, qpos)
        eq_cache = cache0.copy()
        for s, e in plan.slots:
            eq_cache.set_positions_(s, e, torch.arange(P - (e - s), P, dtype=torch.long))
        eq = layer_mass(model, eq_cache, parts.question, qpos)
        L = comp.shape[0]
        picks = {"none": None}
        for r in a.ratios:
            n_sel = int(round(r * slots.numel()))
            for name, m in (("composed", comp.mean(0)), ("equal", eq.mean(0)), ("equal_up", eq[L // 2:].mean(0))):
                picks[f"{name}{r:g}"] = slots[torch.topk(m[slots], n_sel).indices].sort().values
        for name, pick in picks.items():
            c = cache0.copy()
            if pick is not None:
                recompute_slots(model, c, pick, ids[pick - plan.anchor_len], plan.allowed()[pick])
            first, nll = scores_of(model, c, parts.question, gold)
            r = acc.setdefault(name, {"d_nll": [], "agree": [], "kl": []})
            r["d_nll"].append(nll - f_nll)
            r["agree"].append(int(first.argmax() == f_first.argmax()))
            r["kl"].append(float((f_first.exp() * (f_first - first)).sum()))
    print(f"{a.data}: {len(items)} calibration items (no generation)")
    out = {}
    for name, r in acc.items():
        out[name] = {k: sum(v) / len(v) for k, v in r.items()}
        print(f"  {name:16s} d_nll {out[name]['d_nll']:+.3f}  first-agree {100 * out[name]['agree']:5.1f}%  "
              f"kl {out[name]['kl']:.4f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
