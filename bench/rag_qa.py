"""Chunk reuse on real multi-document questions (SQuAD 2.0 dev, HotpotQA dev): the QA mode of bench/rag_eval.py.

    python bench/rag_eval.py --data squad --n 300 --format turns --records R.jsonl --json results/X.json
    python bench/rag_eval.py --data hotpotqa --n 300 --format message --shard 0/2 --threads 1 --records R0.jsonl
    python bench/rag_eval.py --report R0.jsonl R1.jsonl --json results/X.json     # merge shards, table + plot

Every item runs every method on ONE request each (RagPipeline.answer_scored): the greedy answer, the first-token
distribution and the gold answer teacher forced on the same cache. Per (item, method) a record line is appended to
--records as soon as the item's methods are done, so a run that is cut off resumes where it stopped.

Measures per method (over the items; paired with full prefill on the same items):
  accuracy        % answers containing a gold answer (normalized as SQuAD / lost-in-the-middle do)
  acc_vs_full     accuracy as % of full prefill's; d_acc: difference in points with a paired bootstrap 95% CI
  nll, d_nll      mean per-token NLL of the (first) gold answer after the question; d_nll = method - full (CI)
  d_nll_median    the median over items of the paired difference (a mean carried by a few items shows here)
  first_agree     % first answer tokens equal to full prefill's;  kl: mean KL(full || method), first token
  agree           % answers identical to full prefill's (normalized text)
  ttft_s          median time to the first token with every chunk already stored (compose + repairs + question)
  speedup         median over items of full's TTFT / this method's (same item, same process)
  vs_prefix       median TTFT / exact prefix reuse's (the previous request held the passages in another order;
                  measured on every --prefix-every'th item)
  recomputed      mean % of the prompt's tokens computed for the request (question included)

Method names: a base (full, prefix, sequential, parallel) and repairs joined by "+": link<k> (EPIC link tokens),
sel<pct> (CacheBlend selective recompute), attn<pct> (query-aware re-encode), apeT<t> (APE temperature),
tail<k> (the last k tokens of every chunk in context), last<m> (the m chunks nearest the question in context),
probe<m> (the m chunks the question reads most, in context), lead<j> (chunks stored encoded after j lead passages,
`lead_passages`: no cost per request), and read-time position policies (docs/positions.md):
mspoe (Ms-PoE; "full+mspoe" is its full form) and pine ("full+pine": PINE's full form, the passages prefilled
together under its document phase; with chunk reuse PINE-lite). E.g. "sequential+probe1+tail8".
"""
from __future__ import annotations

import json
import os
import random
import re
import statistics
import sys
from typing import Any, Sequence

import torch
from tqdm import tqdm

from _common import machine, markdown_table, write_outputs
from kvpos.ape import ApeParams
from kvpos.data import answer_correct, hotpotqa_items, normalize_answer, passages, squad_items
from kvpos.integrations.rag import RagMethod, RagPipeline

QA_SETS = ("squad", "squad-hard", "hotpotqa")
_KNOB = re.compile(r"^(link|sel|attn|apeT|tail|last|probe|lead)(\d+(?:\.\d+)?)$")


def method_from_name(name: str) -> RagMethod:
    """The RagMethod a name of the grammar above stands for (ValueError naming the bad part otherwise)."""
    base, *knobs = name.split("+")
    if base not in ("full", "prefix", "sequential", "parallel"):
        raise ValueError(f"method {name!r}: expected a base full / prefix / sequential / parallel, got {base!r}")
    kw: dict[str, Any] = {}
    for k in knobs:
        if k in ("mspoe", "pine"):
            kw["position"] = "ms_poe" if k == "mspoe" else "pine" if base == "full" else "pine_lite"
            continue
        m = _KNOB.match(k)
        if m is None:
            raise ValueError(f"method {name!r}: expected repairs link<k> sel<pct> attn<pct> apeT<t> tail<k> last<m> "
                             f"probe<m> lead<j> or a position policy mspoe / pine, got {k!r}")
        what, v = m.group(1), m.group(2)
        if what == "apeT":
            kw["ape"] = ApeParams(float(v), 1.0)
        elif what in ("sel", "attn"):
            kw["recompute_ratio" if what == "sel" else "attn_ratio"] = float(v) / 100
        else:
            kw[{"link": "link_k", "tail": "tail_k", "last": "last_chunks", "probe": "probe_chunks",
                "lead": "lead"}[what]] = int(v)
    return RagMethod(name, layout=base, **kw)


INSTRUCTION = "Answer the question from the passages above in a few words."


def question_prefix(instruction: str) -> str:
    """What comes before the question in the last user turn (the same for the transformers and vLLM harnesses)."""
    return f"{instruction}\nQuestion: " if instruction else "Question: "


def load_items(data: str, n: int, split: str, seed: int, distractors: int, borrow: int = 0) -> list[dict]:
    """`n` items of a QA set's `split`: a fixed seeded sample over the whole set, in the sample's random order.

    The order is the sample's own, not the dataset's, so any first part of a run (a run cut short) is itself a
    uniform sample of the split; the set of items depends only on (data, n, split, seed, distractors, borrow)."""
    if borrow and data != "hotpotqa":
        raise ValueError(f"--borrow: expected 0 for {data} (SQuAD takes --distractors), got {borrow}")
    if data == "hotpotqa":
        pool = hotpotqa_items(None, split=split, borrowed=borrow, seed=seed)
    else:
        pool = squad_items(None, k=distractors, hard=data == "squad-hard", split=split, seed=seed)
    if n > len(pool):
        raise ValueError(f"--n: expected at most {len(pool)} {split} items of {data}, got {n}")
    keep = random.Random(seed).sample(range(len(pool)), n)
    return [pool[i] for i in keep]


def lead_passages(data: str, n: int, source: str, tok: Any = None) -> list[str]:
    """`n` lead passages (RagPipeline(lead=...)), fixed in code: source "calibration" takes the paragraphs of the
    data set's LAST calibration items, in order (a run samples its items from the whole split, so a lead passage
    is rarely one of its passages; SQuAD shares paragraphs between questions, so a held-out request may still hold
    one), "essays" Paul Graham essay passages of ~150 tokens (another corpus; needs `tok`)."""
    if n == 0:
        return []
    if source == "essays":
        if tok is None:
            raise ValueError("lead_passages: source 'essays' needs the tokenizer, got none")
        it = passages(tok, 150, seed=1)
        return [next(it) for _ in range(n)]
    if source != "calibration":
        raise ValueError(f"--lead-source: expected calibration or essays, got {source!r}")
    pool = hotpotqa_items(None, split="calibration") if data == "hotpotqa" else \
        squad_items(None, k=9, split="calibration", seed=0)
    out: list[str] = []
    for x in reversed(pool):
        out += [p for p in x["paragraphs"] if p not in out]
        if len(out) >= n:
            return out[:n]
    raise ValueError(f"lead_passages: expected {n} calibration paragraphs of {data}, got {len(out)}")


def gold_moved(items: Sequence[dict], positions: Sequence[int]) -> list[dict]:
    """Each item once per gold position: its gold paragraph(s) taken out and put back, in their order, from
    position p on (HotpotQA's pair stays together); ids "<id>@<p>". Lost-in-the-middle curves."""
    out = []
    for x in items:
        gold = [x["paragraphs"][i] for i in x["gold"]]
        rest = [q for i, q in enumerate(x["paragraphs"]) if i not in x["gold"]]
        for p in positions:
            if not 0 <= p <= len(rest):
                raise ValueError(f"--gold-at: expected positions in [0, {len(rest)}] for {len(x['paragraphs'])} "
                                 f"paragraphs with {len(gold)} gold, got {p}")
            out.append({**x, "id": f"{x['id']}@{p}", "paragraphs": rest[:p] + gold + rest[p:],
                        "gold": list(range(p, p + len(gold))), "gold_at": p})
    return out


def reordered(items: Sequence[dict], k: int, seed: int) -> list[dict]:
    """Each item in k seeded random orders of its paragraphs (the first one its own), ids "<id>#<j>": order
    sensitivity."""
    if k < 2:
        raise ValueError(f"--orders: expected an int >= 2 (orders to compare), got {k}")
    out = []
    for x in items:
        rng = random.Random(f"{seed}:{x['id']}")
        n = len(x["paragraphs"])
        for j in range(k):
            order = list(range(n)) if j == 0 else rng.sample(range(n), n)
            out.append({**x, "id": f"{x['id']}#{j}", "paragraphs": [x["paragraphs"][i] for i in order],
                        "gold": sorted(order.index(g) for g in x["gold"])})
    return out


def report_orders(rows: Sequence[dict], json_path: str | None, extra: dict | None = None) -> dict:
    """Order sensitivity (records of `reordered` items): per method, the share of questions whose normalized answer
    is the same in every order, whose first token is, and the mean accuracy over orders."""
    by: dict[str, dict[str, list[dict]]] = {}
    for r in rows:
        by.setdefault(r["method"], {}).setdefault(str(r["id"]).rsplit("#", 1)[0], []).append(r)
    out = []
    for m, qs in by.items():
        full = [rs for rs in qs.values() if len(rs) >= 2]
        out.append({"method": m, "questions": len(full), "orders": statistics.fmean(len(rs) for rs in full),
                    "same_answer": 100 * statistics.fmean(len({normalize_answer(r["text"]) for r in rs}) == 1
                                                          for rs in full),
                    "same_first_token": 100 * statistics.fmean(len({r["first"] for r in rs}) == 1 for rs in full),
                    "accuracy": 100 * statistics.fmean(r["correct"] for rs in full for r in rs)})
    write_outputs(json_path, {**(extra or {}), "machine": machine(), "methods": out},
                  markdown_table(out, ["method", "questions", "orders", "same_answer", "same_first_token", "accuracy"],
                                 {"orders": ".1f", "same_answer": ".1f", "same_first_token": ".1f",
                                  "accuracy": ".1f"}))
    return {"methods": out}


def _done(path: str | None) -> set[str]:
    if not path or not os.path.exists(path):
        return set()
    with open(path) as f:
        return {json.loads(line)["id"] for line in f if line.strip()}


@torch.no_grad()
def run_items(rag: RagPipeline, methods: Sequence[RagMethod], items: Sequence[dict], max_new: int,
              records: str | None, prefix_every: int, meta: dict) -> list[dict]:
    """Run every method on every item not yet in `records` (appending its lines there); returns the new records."""
    if methods[0].layout != "full":
        raise ValueError("methods: expected full prefill first (every other method is compared with it)")
    tok, done, out = rag.tok, _done(records), []
    todo = [(i, x) for i, x in enumerate(items) if x["id"] not in done]
    for idx, item in tqdm(todo, desc=f"rag_qa {meta['data']} {meta['format']}", file=sys.stdout, unit="q"):
        parts = rag.builder.parts(item["paragraphs"], item["question"])
        rag.precompute(parts.chunks, sorted({m.lead for m in methods if m.reuses}))   # TTFT: every chunk stored
        gold = torch.tensor(tok(item["answers"][0], add_special_tokens=False).input_ids, dtype=torch.long)
        n_prompt = parts.full_ids().shape[1]
        full_lp, full_text, rows = None, None, []
        for m in methods:
            if m.layout == "prefix":
                if idx % prefix_every:
                    continue
                order = list(range(len(parts.chunks)))
                random.Random(idx).shuffle(order)
                rag.prime_prefix(type(parts)(parts.anchor, [parts.chunks[i] for i in order], parts.question))
            got = rag.answer_scored(parts, m, gold, max_new)
            lp = got.first_logprobs
            if full_lp is None:
                full_lp, full_text = lp, normalize_answer(got.text)
            rows.append({**meta, "id": item["id"], "method": m.name, "gold": item["gold"], "n_tokens": n_prompt,
                         "correct": answer_correct(got.text, item["answers"]), "text": got.text,
                         "agree": normalize_answer(got.text) == full_text, "first": int(lp.argmax()),
                         "first_agree": int(lp.argmax()) == int(full_lp.argmax()),
                         "kl": float((full_lp.exp() * (full_lp - lp)).sum()), "nll": got.gold_nll,
                         "ttft_s": got.report["ttft_s"], "tokens_computed": got.report["tokens_computed"],
                         "chunks": got.report.get("reencoded_chunks")})
        if records:
            with open(records, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        out += rows
    return out


def read_records(paths: Sequence[str]) -> list[dict]:
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def _ci(diffs: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap 95% interval of the mean of paired differences."""
    if len(diffs) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(reps))
    return means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


def _paired(recs: dict, full: dict, ids: Sequence[str], key: str) -> tuple[list[float], list[float]]:
    """A measure of a method and of full prefill on the items where both took it (a record's null: not taken)."""
    keep = [i for i in ids if recs[i].get(key) is not None and full[i].get(key) is not None]
    return [float(recs[i][key]) for i in keep], [float(full[i][key]) for i in keep]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarize(rows: Sequence[dict]) -> dict[str, dict]:
    """Per method: the measures of the module docstring, over the items every method ran on (prefix: its own)."""
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(r["method"], {})[r["id"]] = r
    full = by.get("full")
    if not full:
        raise ValueError("records: expected full prefill's records (the reference), got none")
    prefix = by.get("prefix", {})
    out = {}
    for name, recs in by.items():
        ids = [i for i in recs if i in full]
        acc, acc_f = _paired(recs, full, ids, "correct")
        nll, nll_f = _paired(recs, full, ids, "nll")
        t, t_f = _paired(recs, full, ids, "ttft_s")
        on_p = [i for i in ids if i in prefix]
        lo, hi = _ci([a - b for a, b in zip(acc, acc_f)])
        d_nll = [a - b for a, b in zip(nll, nll_f)]
        nlo, nhi = _ci(d_nll)
        mean = lambda key: _mean(_paired(recs, full, ids, key)[0])      # noqa: E731
        out[name] = {
            "n": len(ids), "accuracy": 100 * statistics.fmean(acc),
            "acc_vs_full": 100 * sum(acc) / sum(acc_f) if sum(acc_f) else None,
            "d_acc": 100 * (statistics.fmean(acc) - statistics.fmean(acc_f)), "d_acc_ci": [100 * lo, 100 * hi],
            "nll": _mean(nll), "d_nll": _mean(nll) - _mean(nll_f),
            "d_nll_ci": [nlo, nhi],
            "d_nll_median": statistics.median(d_nll) if d_nll else None,
            "first_agree": 100 * mean("first_agree"),
            "kl": mean("kl"), "agree": 100 * mean("agree"),
            "ttft_s": statistics.median(t), "speedup": statistics.median([b / a for a, b in zip(t, t_f)]),
            "vs_prefix": statistics.median([recs[i]["ttft_s"] / prefix[i]["ttft_s"] for i in on_p]) if on_p else None,
            "recomputed": 100 * statistics.fmean([recs[i]["tokens_computed"] / recs[i]["n_tokens"] for i in ids]),
            "n_tokens": statistics.fmean([recs[i]["n_tokens"] for i in ids]),
        }
    return out


COLS = ["method", "n", "accuracy", "acc_vs_full", "d_acc", "nll", "d_nll", "d_nll_median", "first_agree", "kl", "agree",
        "ttft_s", "speedup", "vs_prefix", "recomputed"]


def table(summary: dict[str, dict]) -> str:
    rows = []
    for name, r in summary.items():
        row = {"method": name, **r}
        row["d_acc"] = f"{r['d_acc']:+.1f} [{r['d_acc_ci'][0]:+.1f}, {r['d_acc_ci'][1]:+.1f}]"
        row["d_nll"] = f"{r['d_nll']:+.3f} [{r['d_nll_ci'][0]:+.3f}, {r['d_nll_ci'][1]:+.3f}]"
        rows.append(row)
    fmt = {c: ".1f" for c in COLS[2:]} | {"nll": ".3f", "kl": ".3f", "ttft_s": ".3f", "speedup": ".2f",
                                          "vs_prefix": ".2f", "n": "d", "d_nll_median": "+.3f"}
    return markdown_table(rows, COLS, fmt)


def plot_frontier(summary: dict[str, dict], path: str, title: str) -> None:
    """Two panels over speedup vs full prefill (log x): accuracy as % of full's, and first-token agreement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, key, label in ((axes[0], "acc_vs_full", "accuracy, % of full prefill"),
                           (axes[1], "first_agree", "first-token agreement with full (%)")):
        for name, r in summary.items():
            x, y = r["speedup"], r[key]
            if y is None:
                continue
            exact = name in ("full", "prefix")
            ax.scatter([x], [y], marker="*" if exact else "o", s=90 if exact else 30,
                       color="black" if exact else None, zorder=3)
            ax.annotate(name.replace("sequential", "seq"), (x, y), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.axhline(100 if key == "acc_vs_full" else 90, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("TTFT speedup vs full prefill (chunks stored)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def report_by_position(rows: Sequence[dict], json_path: str | None, extra: dict | None = None) -> dict:
    """Lost-in-the-middle: the summary per gold position (records of gold_moved items), JSON + markdown + a PNG of
    accuracy and gold NLL against the position, one line per method."""
    by = {}
    for r in rows:
        by.setdefault(int(r["gold"][0]), []).append(r)
    per = {p: summarize(rs) for p, rs in sorted(by.items())}
    lines = []
    for p, summ in per.items():
        lines += [{"gold_at": p, "method": m, **{k: v for k, v in s.items() if k in ("n", "accuracy", "nll", "d_nll",
                                                                                       "first_agree", "speedup")}}
                  for m, s in summ.items()]
    spread = {}
    for m in dict.fromkeys(r["method"] for r in rows):
        nll = [per[p][m]["nll"] for p in per if m in per[p]]
        acc = [per[p][m]["accuracy"] for p in per if m in per[p]]
        spread[m] = {"nll_spread": max(nll) - min(nll), "accuracy_spread": max(acc) - min(acc),
                     "mean_accuracy": statistics.fmean(acc), "mean_nll": statistics.fmean(nll),
                     **paired_by_question(rows, m)}
    payload = {**(extra or {}), "machine": machine(), "positions": list(per), "by_position": lines, "spread": spread}
    table_rows = [{"method": m, **s} for m, s in spread.items()]
    text = markdown_table(lines, ["gold_at", "method", "n", "accuracy", "nll", "d_nll", "first_agree", "speedup"],
                          {"accuracy": ".1f", "nll": ".3f", "d_nll": ".3f", "first_agree": ".1f", "speedup": ".2f"})
    for r in table_rows:
        r["d_acc"] = f"{r['d_acc']:+.1f} [{r['d_acc_ci'][0]:+.1f}, {r['d_acc_ci'][1]:+.1f}]"
        r["d_nll"] = f"{r['d_nll']:+.3f} [{r['d_nll_ci'][0]:+.3f}, {r['d_nll_ci'][1]:+.3f}]"
    text += "\n\n" + markdown_table(table_rows, ["method", "questions", "mean_accuracy", "accuracy_spread", "d_acc",
                                                  "mean_nll", "nll_spread", "d_nll"],
                                      {c: ".3f" for c in ("mean_accuracy", "accuracy_spread", "mean_nll",
                                                          "nll_spread")})
    write_outputs(json_path, payload, text)
    if json_path:
        _plot_positions(per, os.path.splitext(json_path)[0] + ".png")
    return payload


def paired_by_question(rows: Sequence[dict], method: str) -> dict:
    """`method` against full prefill over the questions both ran at every position ("<id>@<p>" records): the mean
    over questions of (accuracy in points, gold NLL) averaged over positions, method - full, with bootstrap 95%
    intervals (questions resampled, so a question's positions stay together)."""
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(str(r["id"]), {})[r["method"]] = r
    per_q: dict[str, list[tuple[float, float]]] = {}
    for i, ms in by.items():
        if method in ms and "full" in ms and ms[method].get("nll") is not None and ms["full"].get("nll") is not None:
            d = (100 * (float(ms[method]["correct"]) - float(ms["full"]["correct"])),
                 float(ms[method]["nll"]) - float(ms["full"]["nll"]))
            per_q.setdefault(i.rsplit("@", 1)[0], []).append(d)
    da = [statistics.fmean(x for x, _ in v) for v in per_q.values()]
    dn = [statistics.fmean(y for _, y in v) for v in per_q.values()]
    return {"questions": len(per_q), "d_acc": _mean(da), "d_acc_ci": list(_ci(da)), "d_nll": _mean(dn),
            "d_nll_ci": list(_ci(dn))}


def _plot_positions(per: dict[int, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    methods = list(dict.fromkeys(m for s in per.values() for m in s))
    for ax, key, label in ((axes[0], "accuracy", "accuracy (%)"), (axes[1], "nll", "gold-answer NLL (nats/token)")):
        for m in methods:
            ps = [p for p in per if m in per[p]]
            ax.plot(ps, [per[p][m][key] for p in ps], marker="o", ms=3, label=m)
        ax.set_xlabel("gold paragraph position")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def report(rows: Sequence[dict], json_path: str | None, extra: dict | None = None) -> dict:
    """Summarize records, write JSON + markdown table + frontier PNG beside json_path."""
    summary = summarize(rows)
    metas = {k: sorted({str(r.get(k)) for r in rows}) for k in ("data", "format", "model", "split")}
    payload = {**metas, "n_items": len({r["id"] for r in rows}), "machine": machine(), **(extra or {}),
               "methods": summary}
    write_outputs(json_path, payload, table(summary))
    if json_path:
        title = f"{'/'.join(metas['data'])} {'/'.join(metas['format'])} {'/'.join(metas['split'])}: " \
                f"{payload['n_items']} questions, {os.path.basename('/'.join(metas['model']))}"
        plot_frontier(summary, os.path.splitext(json_path)[0] + ".png", title)
    return payload

