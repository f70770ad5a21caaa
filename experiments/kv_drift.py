"""How much of chunk reuse's gap on real questions is systematic? Two store-time candidates, calibration only.

    PYTHONPATH=bench python experiments/kv_drift.py --n 40 --fit 20 --leads 1 2 4 --json results/kv_drift_squad_cal.json
    PYTHONPATH=bench python experiments/kv_drift.py --data hotpotqa --n 40 --fit 20 --leads 1 2 4 --lin 0 2 \
        --json results/kv_drift_hotpotqa_cal.json

On SQuAD calibration items (one user turn per passage, 9 distractors), per item:
  full        one forward of the prompt + gold answer: gold NLL, first-token distribution, and the in-context raw KV
  sequential  every chunk encoded alone after the anchor, placed at its sequential positions (kvpos's reuse)
  lead<j>     every chunk encoded after the anchor + j fixed "lead" passages (calibration paragraphs of another
              article), the lead's slots dropped: the chunk has seen *a* context before it, not the request's
  lin         sequential + a per-layer affine map of each stored chunk token's raw KV toward its in-context KV,
              fitted by ridge regression on the first --fit items (in-context minus alone KV, chunks after the
              first), applied to the other items
Reported on the items after --fit: mean gold NLL minus full's, first-token agreement, KL(full || method), and for
lin the share of the KV deviation its map explains (R^2 on the evaluation items).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from tqdm import tqdm

from _common import machine, markdown_table, write_outputs
from kvpos.data import hotpotqa_items, squad_items
from kvpos.integrations.hf import PositionedCache, extend, load_default_model
from kvpos.integrations.rag import RagPipeline
from kvpos.compose import plan_layout


def raw_kv_of(cache: PositionedCache, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in cache.raw_kv(start, end)]


def encode_after(model, prefix: PositionedCache, ids: torch.Tensor, skip: int) -> list:
    """Raw KV [L] of `ids` encoded after the cache `prefix` (its first `skip` slots dropped from the result)."""
    c = prefix.copy(headroom=ids.numel())
    extend(model, c, ids[None])
    return raw_kv_of(c, skip, c.num_slots)


def scored(model, cache: PositionedCache, q: torch.Tensor, gold: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(gold NLL per token, first-token log-probs [V]) of question q then gold teacher forced on `cache`."""
    logits = extend(model, cache, torch.cat([q, gold[:-1]])[None])[0].float()
    lp = torch.log_softmax(logits[q.numel() - 1:], -1)
    return float(-lp.gather(1, gold[:, None]).mean()), lp[0]


def composed(anchor: PositionedCache, kvs: list, lengths: list[int]) -> PositionedCache:
    A = anchor.num_slots
    plan = plan_layout(A, lengths, "sequential")
    cache = anchor.copy(headroom=sum(lengths) + 64)
    for i, kv in enumerate(kvs):
        cache.append_raw_(kv, plan.positions(i))
    return cache


def features(k: torch.Tensor, v: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """[S, H*D + H*Dv + 2] per token: its raw key and value (all heads), a bias, log1p(tokens before its chunk)."""
    S = k.shape[2]
    kk = k[0].permute(1, 0, 2).reshape(S, -1)
    vv = v[0].permute(1, 0, 2).reshape(S, -1)
    return torch.cat([kk, vv, torch.ones(S, 1), torch.log1p(before.float())[:, None] / 8], 1).double()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--fit", type=int, default=20)
    ap.add_argument("--leads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--ridge", type=float, default=1.0)
    ap.add_argument("--lin", type=int, nargs="*", default=[0], help="lead counts whose encodings get a fitted map")
    ap.add_argument("--data", default="squad", choices=["squad", "hotpotqa"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_default_model()
    rag = RagPipeline(model, tok)
    if a.data == "squad":
        items = squad_items(a.n + 5, k=9, split="calibration", seed=0)
    else:
        items = hotpotqa_items(a.n + 5, split="calibration")
    lead_items, items = items[:5], items[5:5 + a.n]
    anchor = rag.composer.anchor
    A = anchor.length
    lead_ids = [rag.builder.chunk_ids(p) for p in lead_items[0]["paragraphs"][:max(a.leads + a.lin, default=0)]]
    lead_caches = {0: anchor.cache}
    for j in sorted(set(a.leads + a.lin) - {0}):
        c = anchor.cache.copy()
        for ids in lead_ids[:j]:
            extend(model, c, ids[None])
        lead_caches[j] = c
    L = len(anchor.cache.layers)
    xtx = {j: [None] * L for j in a.lin}
    xty = {j: [None] * L for j in a.lin}
    W = {}
    rows = []
    for n, item in enumerate(tqdm(items, desc="kv_drift", unit="q")):
        parts = rag.builder.parts(item["paragraphs"], item["question"])
        gold = torch.tensor(tok(item["answers"][0], add_special_tokens=False).input_ids, dtype=torch.long)
        lengths = [c.numel() for c in parts.chunks]
        full = PositionedCache.from_model(model)
        ctx_ids = torch.cat([parts.anchor, *parts.chunks])
        extend(model, full, ctx_ids[None])
        ctx_kv = raw_kv_of(full, A, full.num_slots)
        f_nll, f_lp = scored(model, full, parts.question, gold)
        enc = {j: [encode_after(model, lead_caches[j], c, lead_caches[j].num_slots) for c in parts.chunks]
               for j in sorted(set((a.leads if n >= a.fit else []) + a.lin + [0]))}
        alone = enc[0]
        cats = {j: [(torch.cat([kv[l][0] for kv in enc[j]], 2), torch.cat([kv[l][1] for kv in enc[j]], 2))
                    for l in range(L)] for j in a.lin}
        before = torch.cat([torch.full((s,), sum(lengths[:i])) for i, s in enumerate(lengths)])
        later = before > 0
        rec = {"id": item["id"], "full": f_nll}
        res = {}
        if n >= a.fit:
            res["sequential"] = scored(model, composed(anchor.cache, alone, lengths), parts.question, gold)
            for j in a.leads:
                res[f"lead{j}"] = scored(model, composed(anchor.cache, enc[j], lengths), parts.question, gold)
        for j, cat_alone in cats.items():
            name = "lin" if j == 0 else f"lead{j}+lin"
            if n < a.fit:
                fit_layers(cat_alone, ctx_kv, before, later, xtx[j], xty[j], L)
                continue
            if j not in W:
                W[j] = [torch.linalg.solve(xtx[j][l] + a.ridge * torch.eye(xtx[j][l].shape[0], dtype=torch.float64),
                                           xty[j][l]) for l in range(L)]
            res[name], rec[name + "_r2"] = corrected(model, anchor, cat_alone, ctx_kv, W[j], before, later,
                                                     lengths, parts.question, gold, L)
        if n >= a.fit:
            for m, (nll, lp) in res.items():
                rec[m] = {"d_nll": nll - f_nll, "first": int(lp.argmax()) == int(f_lp.argmax()),
                          "kl": float((f_lp.exp() * (f_lp - lp)).sum())}
            rows.append(rec)
            tqdm.write(json.dumps({m: (round(r["d_nll"], 3), r["first"]) if isinstance(r, dict) else r
                                   for m, r in rec.items() if m != "id"}))
    methods = [m for m in rows[0] if isinstance(rows[0][m], dict)]
    summary = {m: {"d_nll": statistics.fmean(r[m]["d_nll"] for r in rows),
                   "abs_d_nll": statistics.fmean(abs(r[m]["d_nll"]) for r in rows),
                   "first_agree": 100 * statistics.fmean(r[m]["first"] for r in rows),
                   "kl": statistics.fmean(r[m]["kl"] for r in rows)} for m in methods}
    for m in list(summary):
        if m + "_r2" in rows[0]:
            summary[m]["r2"] = statistics.fmean(r[m + "_r2"] for r in rows)
    write_report(a.json, {"args": vars(a), "machine": machine(), "summary": summary, "rows": rows})


def write_report(path: str | None, payload: dict) -> None:
    """JSON + a markdown table of the summary (one row per method)."""
    rows = [{"method": m, **r} for m, r in payload["summary"].items()]
    write_outputs(path, payload, markdown_table(rows, ["method", "d_nll", "abs_d_nll", "first_agree", "kl", "r2"],
                                                {"d_nll": "+.3f", "abs_d_nll": ".3f", "first_agree": ".1f",
                                                 "kl": ".3f", "r2": ".3f"}))


def fit_layers(cat_alone, ctx_kv, before, later, xtx, xty, L) -> None:
    """Accumulate the ridge normal equations of every layer (chunks after the first only)."""
    for l in range(L):
        x = features(*cat_alone[l], before)[later]
        y = torch.cat([(ctx_kv[l][0] - cat_alone[l][0])[0].permute(1, 0, 2).reshape(len(before), -1),
                       (ctx_kv[l][1] - cat_alone[l][1])[0].permute(1, 0, 2).reshape(len(before), -1)],
                      1).double()[later]
        xtx[l] = x.T @ x if xtx[l] is None else xtx[l] + x.T @ x
        xty[l] = x.T @ y if xty[l] is None else xty[l] + x.T @ y


def corrected(model, anchor, cat_alone, ctx_kv, W, before, later, lengths, q, gold, L):
    """Score the sequential cache with every chunk after the first moved by the fitted map; (score, R^2)."""
    fixed, sse, sst = [], 0.0, 0.0
    for l in range(L):
        k, v = cat_alone[l]
        H, D = k.shape[1], k.shape[3]
        d = features(k, v, before) @ W[l]
        d[~later] = 0
        dk = d[:, :H * D].reshape(-1, H, D).permute(1, 0, 2)[None].float()
        dv = d[:, H * D:].reshape(-1, H, v.shape[3]).permute(1, 0, 2)[None].float()
        tk, tv = ctx_kv[l][0] - k, ctx_kv[l][1] - v
        sse += float(((tk - dk)[:, :, later] ** 2).sum() + ((tv - dv)[:, :, later] ** 2).sum())
        sst += float((tk[:, :, later] ** 2).sum() + (tv[:, :, later] ** 2).sum())
        fixed.append((k + dk, v + dv))
    cuts = torch.tensor(lengths).cumsum(0).tolist()
    kvs = [[(fk[:, :, s:e], fv[:, :, s:e]) for fk, fv in fixed] for s, e in zip([0] + cuts[:-1], cuts)]
    return scored(model, composed(anchor.cache, kvs, lengths), q, gold), 1 - sse / sst


if __name__ == "__main__":
    main()
