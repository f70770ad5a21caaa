"""Which slots should the query-aware repair re-encode? (issue 31, calibration questions only)

For calibration items, compose the chunk-reuse cache (sequential, chunks stored after the lead), pick a fixed
budget of chunk slots by several rules, re-encode them in full context (`recompute_slots`, as `attn<pct>` does) and
score the question + gold answer teacher forced: gold NLL, first-token agreement and KL against full prefill on the
same item. Rules (all at the same budget):

    mass        the question's attention mass, mean over layers, heads, rows (what attn<pct> does today)
    mass_trim   the same with each chunk's first token and last 5 (turn separators) never picked
    mass_up     mass averaged over the upper half of the layers only
    mass_low    ... the lower half only
    mass_hmax   per layer the max over query heads, then mean over layers
    mass_late   mass times the slot's relative place in the context (later slots see more of it)
    mass_head3  mass with each chunk's first 3 tokens (its turn header) never picked
    dev_mass    ORACLE: deviation (below) times mass
    dev         ORACLE: the slots whose stored K/V deviate most from full prefill's (relative L2 over all layers)
    dev_late    ORACLE, per slot deviation at the last layer only

The oracle rules need full prefill's KV, which a request does not have: they bound what a selection can gain.

    PYTHONPATH=bench .venv/bin/python experiments/attn_pick.py --data hotpotqa --borrow 12 --n 24 --threads 1
"""
import argparse
import json
import statistics
import sys

import torch
from tqdm import tqdm

import rag_qa
from kvpos.prompt import ChatPromptBuilder
from kvpos.integrations.hf import load_model
from kvpos.integrations.hf.cache import PositionedCache
from kvpos.integrations.hf.run import extend
from kvpos.integrations.rag import RagPipeline
from kvpos.integrations.repairs import AttentionMassProbe, recompute_slots


def head_mass(model, cache, probe_ids):
    N = cache.num_slots
    probe = AttentionMassProbe(N, per_head=True)
    try:
        extend(model, cache, probe_ids.reshape(1, -1), attention=probe)
    finally:
        cache.crop(N - cache.num_slots)
    return torch.stack(probe.mass)                      # [L, Hq, N]


def deviation(a, b, slots, layers=None):
    """Relative L2 deviation per slot of raw keys and values, summed over `layers` (default all)."""
    out = torch.zeros(slots.numel())
    for i in (range(len(a.layers)) if layers is None else layers):
        for x, y in ((a.layers[i].raw_keys, b.layers[i].raw_keys), (a.layers[i].values, b.layers[i].values)):
            x, y = x[0][:, slots].float(), y[0][:, slots].float()      # [H, S, D]
            out += ((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-6)).mean(0)
    return out


def score(model, cache, q_gold, n_q):
    """(first-token log-probs [V], gold NLL) of question + gold teacher forced on a copy of `cache`."""
    logits = extend(model, cache.copy(), q_gold[None])[0].float()
    lps = torch.log_softmax(logits[n_q - 1:-1], -1)
    gold = q_gold[n_q:]
    return lps[0], float(-lps.gather(1, gold[:, None]).mean())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="hotpotqa", choices=["squad", "hotpotqa"])
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--borrow", type=int, default=12)
    p.add_argument("--distractors", type=int, default=19)
    p.add_argument("--lead", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_model("smollm2")
    builder = ChatPromptBuilder(tok, question_prefix=rag_qa.question_prefix(rag_qa.INSTRUCTION), turns=True)
    rag = RagPipeline(model, tok, builder=builder, lead=rag_qa.lead_passages(a.data, a.lead, "calibration", tok))
    items = rag_qa.load_items(a.data, a.n, "calibration", 0, a.distractors, a.borrow if a.data == "hotpotqa" else 0)
    rules = ["none", "mass", "mass_trim", "mass_up", "mass_low", "mass_hmax", "mass_late", "mass_head3", "dev_mass", "dev",
             "dev_late"]
    res = {r: {"d_nll": [], "first": [], "kl": []} for r in rules}
    for it in tqdm(items, file=sys.stdout, unit="q"):
        parts = builder.parts(it["paragraphs"], it["question"])
        gold = torch.tensor(tok(it["answers"][0], add_special_tokens=False).input_ids, dtype=torch.long)
        q_gold = torch.cat([parts.question, gold])
        n_q = parts.question.numel()
        full = PositionedCache.from_model(model)
        extend(model, full, torch.cat([parts.anchor, *parts.chunks])[None])
        f_lp, f_nll = score(model, full, q_gold, n_q)
        comp = rag.composer_for(a.lead)
        base, info = comp.compose(parts.chunks, layout="sequential")
        plan, ids = info.plan, torch.cat(parts.chunks)
        cand = plan.chunk_slots()
        k = int(round(a.budget * cand.numel()))
        hm = head_mass(model, base, parts.question)[:, :, cand]          # [L, Hq, C]
        L = hm.shape[0]
        mass = hm.mean((0, 1))
        trim = torch.ones(cand.numel(), dtype=torch.bool)
        for s, e in plan.slots:
            s0, e0 = s - plan.anchor_len, e - plan.anchor_len
            trim[s0] = False
            trim[max(s0, e0 - 5):e0] = False
        head3 = torch.ones(cand.numel(), dtype=torch.bool)
        for s, e in plan.slots:
            head3[s - plan.anchor_len:min(e, s + 3) - plan.anchor_len] = False
        dev = deviation(base, full, cand)
        rel = (cand - plan.anchor_len + 1).float() / cand.numel()
        picks = {"none": torch.zeros(cand.numel()), "mass": mass, "mass_trim": mass.masked_fill(~trim, -1.0),
                 "mass_up": hm[L // 2:].mean((0, 1)), "mass_low": hm[:L // 2].mean((0, 1)),
                 "mass_hmax": hm.amax(1).mean(0), "mass_late": mass * rel,
                 "mass_head3": mass.masked_fill(~head3, -1.0), "dev_mass": dev * mass,
                 "dev": dev, "dev_late": deviation(base, full, cand, [L - 1])}
        for r in rules:
            c = base.copy()
            if r != "none":
                sel = torch.topk(picks[r], k).indices.sort().values
                recompute_slots(model, c, cand[sel], ids[sel], plan.allowed()[cand[sel]])
            lp, nll = score(model, c, q_gold, n_q)
            res[r]["d_nll"].append(nll - f_nll)
            res[r]["first"].append(float(int(lp.argmax()) == int(f_lp.argmax())))
            res[r]["kl"].append(float((f_lp.exp() * (f_lp - lp)).sum()))
    out = {r: {m: statistics.fmean(v) for m, v in d.items()} for r, d in res.items()}
    print(f"{a.data} calibration, {len(items)} items, lead {a.lead}, budget {a.budget:.0%} of chunk slots")
    print("| rule | d_nll | first_agree | kl |\n|---|---|---|---|")
    for r, d in out.items():
        print(f"| {r} | {d['d_nll']:+.3f} | {100 * d['first']:.1f} | {d['kl']:.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "summary": out, "per_item": res}, f, indent=1)


if __name__ == "__main__":
    main()
