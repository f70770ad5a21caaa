"""RepoBench-C-style next-line completion after code edits: full vs pie vs naive vs pie+k, on real code.

    python bench/pie_eval.py --json results/pie_eval.json [--samples 200] [--context-tokens 2048] [--k 8]
                             [--corpus DIR] [--model smollm2|gemma3|PATH] [--tasks insertion deletion multi]
                             [--tail 128] [--blend 0.1 0.2] [--also pie+k16+tail256 pie+tail512]
                             [--skip naive pie+k]

Samples (the FINAL document is always the real file):
  a target line L of a real source file with ~context-tokens tokens of the file before it; the document is the
  text up to the end of line L-1, WITHOUT its final newline (a prompt ending in a bare newline token is out of
  distribution: see ../shared/notes/evaluation.md). The model's prediction is the text after its first generated
  newline, up to the next newline.
  insertion  the cache holds the document with 1-4 real lines removed; the edit puts them back
  deletion   the cache holds the document with 1-4 real lines from elsewhere in the corpus added; the edit removes them
  multi      three edits of both kinds
Strategies: full, pie, naive (conflict fast: stale positions kept, generation at the true positions), pie+k (also
re-encode k tokens after each edit); optional pie+tail (--tail) and pie+blend<r> (--blend: CacheBlend over the stale
tokens, layers 0-1 refreshed for all, the r whose layer-1 values moved most carried through all layers); --also takes
any further specs "pie[+k<K>][+tail<T>]" (e.g. pie+k16+tail256: k tokens after each edit AND the last T tokens before
the cursor re-encoded) or "pie+attn<P>[+probe<Q>][+tail<T>]" (query-aware: the last Q tokens' attention picks P% of
the stale tokens to re-encode, EditSession's pie+attn; +tail<T> re-encodes the last T tokens first).
Edits go through the text-level API: re-tokenize the new text, diff on tokens, apply.
--skip drops base strategies (full always runs: it is the reference).
--int8 SPEC... runs those strategies again on an int8 cache (PositionedCache storage="int8": keys int8 per channel
over 32-token groups before RoPE, values per token, the newest <= 32 tokens unquantized; new tokens encoded piece by
piece), reported as "<spec>@int8" and compared with the float `full` like every strategy (e.g. full@int8 is the
quantization alone; no blend / attn repairs there).
Metrics per strategy: em / es (edit similarity, 0-100) of the predicted vs the real next line, agree_full (% same
prediction as full), update_s (median seconds to bring the cache up to date) and its ratio to full.
The JSON also holds "records" (one per sample: task, file, line, token edits, to_cursor = untouched tokens between
the last edit and the cursor, each strategy's predicted line) and "by_distance" (agreement with full per strategy,
binned by to_cursor per task and for all; also a second markdown table and <json>_distance.png).
--gate SPEC:MARGIN... runs EditSession.complete (reported as SPEC/mMARGIN): update with SPEC, generate, and at the
first step whose margin (log p top-1 - log p top-2) falls below MARGIN nats redo the edit with prefix and generate
again; its update_s counts both updates and the abandoned generation. Every record keeps each strategy's step margins
("margins"), generation seconds ("gen_s") and, for gates, "fell_back" (experiments/pie_gate.py replays floors from them).
--reference JSON does not run full: its predictions (and times) come from an earlier run of the same samples.
--report JSON re-renders a finished run's tables and plots from its saved records, without the model.
--resume continues the run saved in --json (checkpoints are written every 25 samples): the same settings give the same
samples, the saved ones are kept (checked by task, file and line), the rest are run; a 200-per-task run (~3 h on two
cores) can so be spread over several sittings. Ratios are per sample, side by side, within whichever sitting ran it.
Default corpus: the fixed list STDLIB_FILES of Python standard-library modules found on this machine.
"""
from __future__ import annotations

import difflib
import json
import os
import random
import statistics
import sys
import sysconfig
import time

import torch
from tqdm import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from _common import bench_parser, machine, markdown_table, parse_bench_args, plot, write_outputs
from kvpos.edits import Strategy, diff_tokens
from kvpos.integrations.hf import MarginWatch, load_model
from kvpos.integrations.pie import EditSession

STDLIB_FILES = [
    "argparse.py", "ast.py", "calendar.py", "configparser.py", "csv.py", "dataclasses.py", "difflib.py",
    "enum.py", "fractions.py", "ftplib.py", "functools.py", "gettext.py", "heapq.py", "inspect.py", "ipaddress.py",
    "locale.py", "mailbox.py", "pathlib.py", "pdb.py", "pickle.py", "pprint.py", "shutil.py", "smtplib.py",
    "statistics.py", "string.py", "subprocess.py", "tarfile.py", "tempfile.py", "textwrap.py", "threading.py",
    "tokenize.py", "traceback.py", "typing.py", "uuid.py", "zipfile.py", "json/decoder.py", "json/encoder.py",
    "email/_header_value_parser.py", "email/message.py", "http/client.py", "http/server.py", "logging/__init__.py",
    "collections/__init__.py", "asyncio/base_events.py", "asyncio/tasks.py", "unittest/case.py",
    "urllib/request.py", "urllib/parse.py", "xml/dom/minidom.py", "importlib/_bootstrap_external.py",
]
STRATEGIES = ["full", "prefix", "pie", "naive", "pie+k"]
SKIPPABLE = STRATEGIES[2:]          # full is the reference of every agreement, prefix (exact) the reference of cost
DIST_BINS = (0, 64, 256, 1024)      # tokens between the end of the last edit and the cursor: [0,64) [64,256) ...


def corpus_files(corpus: str | None) -> list[str]:
    if corpus is None:
        root = sysconfig.get_paths()["stdlib"]
        files = [os.path.join(root, f) for f in STDLIB_FILES if os.path.exists(os.path.join(root, f))]
    else:
        if not os.path.isdir(corpus):
            raise SystemExit(f"--corpus: expected a directory of source files, got {corpus!r}")
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(corpus) for f in fs
                       if f.endswith((".py", ".js", ".ts", ".java", ".go", ".rs", ".c", ".cpp", ".rb")))
    files = [f for f in files if os.path.getsize(f) > 4000]
    if not files:
        raise SystemExit("corpus: no source files over 4 KB found")
    return files


def _good_line(s: str) -> bool:
    t = s.strip()
    return len(t) >= 6 and not t.startswith(("#", '"""', "'''")) and t not in ("else:", "try:", "finally:")


class _Lines:
    """A file's lines and token counts (cached)."""

    def __init__(self, path: str, tok) -> None:
        with open(path, encoding="utf-8", errors="replace") as f:
            self.lines = f.read().split("\n")
        self.ntok = [len(tok(l + "\n", add_special_tokens=False).input_ids) for l in self.lines]


def make_sample(rng: random.Random, files, cache: dict, tok, ctx_tokens: int, task: str) -> dict | None:
    path = rng.choice(files)
    if path not in cache:
        cache[path] = _Lines(path, tok)
    F = cache[path]
    if sum(F.ntok) < ctx_tokens + 50:
        return None
    for _ in range(20):
        L = rng.randrange(len(F.lines))
        if not _good_line(F.lines[L]):
            continue
        start, n = L, 0
        while start > 0 and n < ctx_tokens:
            start -= 1
            n += F.ntok[start]
        if n < ctx_tokens * 0.9:
            continue
        doc = F.lines[start:L]
        break
    else:
        return None
    # edits on line ranges of the final document `doc` (list of lines); the first 2 and last 3 lines stay untouched
    kinds = [task] if task != "multi" else [rng.choice(["insertion", "deletion"]) for _ in range(3)]
    n_lines = len(doc)
    if n_lines < 30:
        return None
    slots = sorted(rng.sample(range(2, n_lines - 3), len(kinds)))
    old = list(doc)
    for at, kind in sorted(zip(slots, kinds), reverse=True):       # edit from the end so indices stay valid
        b = rng.randint(1, 4)
        if kind == "insertion":                                      # cache lacks real lines: remove them
            b = min(b, n_lines - 3 - at)
            del old[at:at + b]
        else:                                                        # cache has foreign real lines: add them
            src_path = rng.choice(files) if rng.random() < 0.5 else path
            if src_path not in cache:
                cache[src_path] = _Lines(src_path, tok)
            src = [l for l in cache[src_path].lines if l.strip()]
            j = rng.randrange(max(1, len(src) - b))
            old[at:at] = src[j:j + b]
    return {"path": path, "line": L, "old": "\n".join(old), "new": "\n".join(doc), "target": F.lines[L],
            "task": task}


class _TwoNewlines(StoppingCriteria):
    """Stop once the generated text holds two newlines (the predicted line is complete)."""

    def __init__(self, tok, start: int) -> None:
        self.tok, self.start = tok, start

    def __call__(self, input_ids, scores, **kw) -> torch.Tensor:
        text = self.tok.decode(input_ids[0, self.start:])
        return torch.tensor([text.count("\n") >= 2])


def predicted_line(text: str) -> str:
    if "\n" not in text:
        return ""
    return text.split("\n", 2)[1]


def edit_similarity(a: str, b: str) -> float:
    a, b = a.strip(), b.strip()
    if not a and not b:
        return 100.0
    return 100.0 * difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def summarize(res: dict) -> dict:
    """Per task and strategy: em / es / agree_full (%), update_s (median), update_ratio_vs_full (medians),
    update_mean_s and mean_ratio_vs_prefix / mean_ratio_vs_full (ratios of MEAN update times on the same samples),
    tokens_encoded (mean), n."""
    out = {}
    for task, per in res.items():
        if not per["full"]["em"]:
            continue
        tf = statistics.median(per["full"]["t"])
        mf, mp = statistics.fmean(per["full"]["t"]), statistics.fmean(per["prefix"]["t"])
        out[task] = {s: {"em": 100.0 * statistics.fmean(d["em"]), "es": statistics.fmean(d["es"]),
                         "agree_full": 100.0 * statistics.fmean(d["agree"]), "update_s": statistics.median(d["t"]),
                         "update_ratio_vs_full": statistics.median(d["t"]) / tf,
                         "update_mean_s": statistics.fmean(d["t"]),
                         "mean_ratio_vs_prefix": statistics.fmean(d["t"]) / mp,
                         "mean_ratio_vs_full": statistics.fmean(d["t"]) / mf,
                         "tokens_encoded": statistics.fmean(d["enc"]), "n": len(d["em"])}
                     for s, d in per.items()}
    return out


def parse_gate(spec: str) -> tuple[str, Strategy, float]:
    """--gate SPEC:MARGIN -> (report name "SPEC/mMARGIN", Strategy, margin in nats). SystemExit on a bad spec."""
    head, sep, tail = spec.rpartition(":")
    try:
        margin = float(tail) if sep else -1.0
    except ValueError:
        margin = -1.0
    if not sep or not 0.0 < margin < 100.0:
        raise SystemExit(f"--gate: expected SPEC:MARGIN with a margin in nats in (0, 100), e.g. auto+b25:1.5, "
                         f"got {spec!r}")
    try:
        strat = Strategy.parse(head)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--gate: {e}") from None
    if strat.base in ("full", "prefix"):
        raise SystemExit(f"--gate: expected an approximate strategy (pie / naive / auto), got {head!r} (exact: "
                         f"never gated)")
    return f"{head}/m{tail}", strat, margin


def gate_margins(gates: tuple[str, ...]) -> dict[str, float]:
    """{report name: margin} of the --gate specs."""
    return {name: m for name, _, m in map(parse_gate, gates)}


def strategy_names(ks: list[int], tail: int = 0, blend: tuple[float, ...] = (), also: tuple[str, ...] = (),
                   skip: tuple[str, ...] = (), int8: tuple[str, ...] = (), gates: tuple[str, ...] = ()
                   ) -> list[tuple[str, Strategy]]:
    """(report name, Strategy): "pie+k" is pie with the first k; further k values report as "pie+k<k>"; with
    tail > 0, "pie+tail" is PIE that also re-encodes the last `tail` tokens before the cursor; each blend ratio r
    adds "pie+blend<100 r>"; then the --also specs (kvpos.edits.Strategy grammar, reported under the spec as
    written). `skip` drops some of pie / naive / pie+k (pie+k: every --k value; full is the reference and always
    runs). Raises SystemExit naming a bad spec."""
    bad = sorted(set(skip) - set(SKIPPABLE))
    if bad:
        raise SystemExit(f"--skip: expected some of {', '.join(SKIPPABLE)} (full always runs), got {bad}")
    out = [("full", Strategy("full")), ("prefix", Strategy("prefix")), ("pie", Strategy("pie")),
           ("naive", Strategy("naive")), ("pie+k", Strategy("pie", k=ks[0]))]
    out = [x for x in out if x[0] not in skip]
    out += [(f"pie+k{k}", Strategy("pie", k=k)) for k in ks[1:] if "pie+k" not in skip]
    out += [("pie+tail", Strategy("pie", tail=tail))] if tail else []
    out += [(f"pie+blend{round(100 * r)}", Strategy("pie", repair="blend", ratio=r)) for r in blend]
    for spec in also:
        try:
            out.append((spec, Strategy.parse(spec)))
        except (ValueError, TypeError) as e:
            raise SystemExit(f"--also: {e}") from None
    for spec in int8:
        try:
            strat = Strategy.parse(spec)
        except (ValueError, TypeError) as e:
            raise SystemExit(f"--int8: {e}") from None
        if strat.repair is not None:
            raise SystemExit(f"--int8: expected strategies without blend / attn repairs (int8 slots are written "
                             f"once), got {spec}")
        out.append((f"{spec}@int8", strat))
    out += [(name, strat) for name, strat, _ in map(parse_gate, gates)]
    names = [n for n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SystemExit(f"strategies: each reported once, got {dup} twice (drop it from --also)")
    return out


@torch.no_grad()
def run(model, tok, samples: list[dict], ks: list[int], max_new: int, checkpoint=None, every: int = 25,
        tail: int = 0, blend: tuple[float, ...] = (), also: tuple[str, ...] = (), skip: tuple[str, ...] = (),
        records: list | None = None, int8: tuple[str, ...] = (), gates: tuple[str, ...] = (),
        reference: dict | None = None) -> dict:
    """Score every strategy on every sample; returns summarize()'s table. When `records` is a list, one dict per
    sample is appended to it: task, file, line, number of token edits, `to_cursor` (untouched tokens between the end
    of the last edit and the cursor), the target and each strategy's predicted line. `reference`: {(task, path,
    line): record of an earlier run of the same samples}: full is not run, its prediction and time are read there."""
    names = strategy_names(ks, tail, blend, also, skip, int8, gates)
    gate = gate_margins(gates)
    res = scores_from_records(records or [], [n for n, _ in names])
    for i, smp in enumerate(tqdm(samples, desc="pie_eval samples", file=sys.stdout)):
        if checkpoint is not None and i and i % every == 0:
            checkpoint(summarize(res), partial=True)
        old_ids = tok(smp["old"]).input_ids        # with the tokenizer's own specials (Gemma's <bos>; none for SmolLM2)
        edits = diff_tokens(old_ids, tok(smp["new"]).input_ids)
        base = EditSession(model, old_ids)
        base_q = EditSession(model, old_ids, storage="int8") if int8 else None
        preds, times, enc, chosen = {}, {}, {}, {}
        margins, gen_s, fell = {}, {}, {}
        if reference is not None:
            ref = reference[(smp["task"], smp["path"], smp["line"])]
            preds["full"], times["full"], enc["full"] = (ref["pred"]["full"], ref["update_s"]["full"],
                                                         ref["tokens_encoded"]["full"])
            _score(res[smp["task"]]["full"], preds["full"], smp["target"], preds["full"], times["full"], enc["full"])
        for name, strat in names:
            if name == "full" and reference is not None:
                continue
            src = base_q if name.endswith("@int8") else base
            sess = EditSession(model, old_ids, cache=src.cache.copy())
            stop = StoppingCriteriaList([_TwoNewlines(tok, 1)])
            gk = {"max_new_tokens": max_new, "stopping_criteria": stop, "pad_token_id": tok.eos_token_id}
            if name in gate:
                t0 = time.perf_counter()
                c = sess.complete(edits, strat, min_margin=gate[name], **gk)
                gen_s[name] = time.perf_counter() - t0 - c.cost_s     # the returned generation (+ bookkeeping)
                gen, cost, n_enc, used, fell[name] = c.ids, c.cost_s, c.tokens_encoded, c.update.strategy, c.fell_back
                margins[name] = c.margins
                if c.fell_back:
                    used = f"{c.first.strategy}=>{used}"
            else:
                r = sess.apply_text(tok, smp["new"], strat, add_special_tokens=True)
                watch = MarginWatch()
                t0 = time.perf_counter()
                gen = sess.generate(**watch.gen_kwargs(gk))
                gen_s[name], margins[name] = time.perf_counter() - t0, watch.margins
                cost, n_enc, used = r.update_s, r.tokens_encoded, r.strategy
            pred = predicted_line(tok.decode(gen))
            preds[name] = pred
            _score(res[smp["task"]][name], pred, smp["target"], preds["full"], cost, n_enc)
            times[name], enc[name] = cost, n_enc
            if "->" in used or "=>" in used:
                chosen[name] = used.split("->", 1)[-1]
        if records is not None:
            n_new = len(tok(smp["new"]).input_ids)
            first_new = edits[0].start if edits else n_new
            records.append({"task": smp["task"], "path": smp["path"], "line": smp["line"], "edits": len(edits),
                            "to_cursor": len(old_ids) - edits[-1].end if edits else len(old_ids),
                            "to_first": n_new - first_new, "target": smp["target"], "pred": preds,
                            "update_s": times, "tokens_encoded": enc, "chosen": chosen, "fell_back": fell,
                            "gen_s": gen_s, "margins": {k: [round(m, 3) for m in v] for k, v in margins.items()}})
    return summarize(res)


def _score(d: dict, pred: str, target: str, full: str, t: float, enc: int) -> None:
    d["em"].append(pred.strip() == target.strip())
    d["es"].append(edit_similarity(pred, target))
    d["agree"].append(pred == full)
    d["t"].append(t)
    d["enc"].append(enc)


def scores_from_records(records: list[dict], names: list[str]) -> dict:
    """run()'s per-task score lists rebuilt from saved records (a resumed run continues from them). Raises
    SystemExit when a record lacks one of the strategies `names`."""
    res = {t: {n: {"em": [], "es": [], "agree": [], "t": [], "enc": []} for n in names}
           for t in ("insertion", "deletion", "multi")}
    for i, rec in enumerate(records):
        missing = sorted(set(names) - set(rec["pred"]))
        if missing:
            raise SystemExit(f"--resume: expected records with every strategy of this run, got record {i} "
                             f"without {missing}")
        for n in names:
            _score(res[rec["task"]][n], rec["pred"][n], rec["target"], rec["pred"]["full"],
                   rec["update_s"][n], rec["tokens_encoded"][n])
    return res


def resume_records(path: str, settings: dict, samples: list[dict]) -> list[dict]:
    """The records of an earlier run of the same settings (seed, samples, strategies, ...) whose samples are the
    first of `samples` (checked by task, file and line); the run continues after them. SystemExit otherwise."""
    if not os.path.isfile(path):
        raise SystemExit(f"--resume: expected a pie_eval JSON written with --json, got {path!r} (no such file)")
    with open(path) as f:
        old = json.load(f)
    if not isinstance(old, dict) or "records" not in old:
        raise SystemExit(f"--resume: expected a pie_eval JSON with 'records', got {path!r} without them")
    unsaved = {"max_new": 40, "int8": [], "gate": [], "reference": None}   # settings older JSONs did not save, at their values then
    diff = {k: (old.get(k, unsaved.get(k)), v) for k, v in settings.items() if old.get(k, unsaved.get(k)) != v}
    if diff:
        raise SystemExit(f"--resume: expected the settings of {path} (saved, given): got {diff}")
    recs = old["records"]
    for i, (rec, smp) in enumerate(zip(recs, samples)):
        if (rec["task"], rec["path"], rec["line"]) != (smp["task"], smp["path"], smp["line"]):
            raise SystemExit(f"--resume: expected saved sample {i} to be this run's ({smp['task']} {smp['path']}:"
                             f"{smp['line']}), got {rec['task']} {rec['path']}:{rec['line']}")
    if len(recs) > len(samples):
        raise SystemExit(f"--resume: expected at most {len(samples)} saved samples, got {len(recs)}")
    return recs


def read_reference(path: str, settings: dict, samples: list[dict]) -> dict:
    """--reference: {(task, path, line): record} of an earlier run whose seed, context, corpus and max_new match and
    which holds every sample of `samples` (with the same target). SystemExit naming the mismatch otherwise."""
    if not os.path.isfile(path):
        raise SystemExit(f"--reference: expected a pie_eval JSON written with --json, got {path!r} (no such file)")
    with open(path) as f:
        old = json.load(f)
    if not isinstance(old, dict) or not old.get("records"):
        raise SystemExit(f"--reference: expected a pie_eval JSON with records, got {path!r} without them")
    for k in ("seed", "context_tokens", "corpus", "max_new"):
        if old.get(k, 40 if k == "max_new" else None) != settings[k]:
            raise SystemExit(f"--reference: expected a run with {k}={settings[k]!r}, got {old.get(k)!r} in {path}")
    ref = {(r["task"], r["path"], r["line"]): r for r in old["records"]}
    for s in samples:
        r = ref.get((s["task"], s["path"], s["line"]))
        if r is None or r["target"] != s["target"] or "full" not in r["pred"]:
            raise SystemExit(f"--reference: expected every sample of this run in {path}, got none (or a different "
                             f"one) for {s['task']} {s['path']}:{s['line']}")
    return ref


def by_distance(records: list[dict], bins: tuple[int, ...] = DIST_BINS) -> list[dict]:
    """Agreement with full per strategy, grouped by `to_cursor` (tokens between the last edit and the cursor), for
    each task and for all tasks together: rows {"task": task | "all", "to_cursor": "[lo,hi)", "lo": lo, "n": count,
    "<strategy>": % same line as full}."""
    rows = []
    tasks = sorted({r["task"] for r in records}, key=("insertion", "deletion", "multi").index)
    for task in tasks + ["all"]:
        mine = [r for r in records if task in ("all", r["task"])]
        for lo, hi in zip(bins, bins[1:] + (None,)):
            sel = [r for r in mine if r["to_cursor"] >= lo and (hi is None or r["to_cursor"] < hi)]
            if not sel:
                continue
            row = {"task": task, "to_cursor": f"[{lo},{hi if hi is not None else 'inf'})", "lo": lo, "n": len(sel)}
            for s in sel[0]["pred"]:
                row[s] = 100.0 * statistics.fmean(r["pred"][s] == r["pred"]["full"] for r in sel)
            rows.append(row)
    return rows


def _strategies(rows: list[dict]) -> list[str]:
    return [s for s in rows[0] if s not in ("task", "to_cursor", "lo", "n", "full")]


def plot_distance(rows: list[dict], path: str | None) -> None:
    """Agreement with full vs distance from the last edit to the cursor (all tasks), one line per strategy."""
    rows = [r for r in rows if r["task"] == "all"]
    if not rows:
        return
    xs = [2 * r["lo"] if r["lo"] else 32 for r in rows]      # bins [0,64) [64,256) ... plotted near their middle
    plot(path, {s: (xs, [r[s] for r in rows]) for s in _strategies(rows)},
         "tokens between the last edit and the cursor (bin middle)", "agreement with full (%)",
         "Agreement with full by distance from the last edit to the cursor", logx=True)


def render(payload: dict) -> str:
    """The markdown report of a payload: the per-task strategy table, then agreement by distance to the cursor."""
    rows = [{"task": t, "strategy": s, **m} for t, per in payload["tasks"].items() for s, m in per.items()]
    cols = ["task", "strategy", "n", "em", "es", "agree_full", "update_s", "update_ratio_vs_full",
            "mean_ratio_vs_prefix", "tokens_encoded"]
    table = markdown_table(rows, [c for c in cols if c in rows[0]],
                           {"em": ".1f", "es": ".1f", "agree_full": ".1f", "update_s": ".3f",
                            "update_ratio_vs_full": ".3f", "mean_ratio_vs_prefix": ".3f", "tokens_encoded": ".0f"})
    dist = payload.get("by_distance") or []
    if dist:
        cols = ["task", "to_cursor", "n"] + _strategies(dist)
        table += ("\n\nAgreement with full (%) by tokens between the last edit and the cursor:\n\n"
                  + markdown_table(dist, cols, {c: ".1f" for c in cols[3:]}))
    return table


def write_report(path: str | None, payload: dict) -> None:
    """Print the report; write JSON + markdown and the two plots beside `path` (a stopped run's plots show the
    samples it finished; its JSON says partial)."""
    write_outputs(path, payload, render(payload))
    if path:
        plot_cost_quality(payload["tasks"], path.rsplit(".", 1)[0] + ".png")
        plot_distance(payload.get("by_distance") or [], path.rsplit(".", 1)[0] + "_distance.png")


def rerender(path: str) -> None:
    """--report: recompute the distance table from a finished run's saved records and rewrite its outputs."""
    if not os.path.isfile(path):
        raise SystemExit(f"--report: expected a pie_eval JSON file, got {path!r} (no such file)")
    with open(path) as f:
        payload = json.load(f)
    if not isinstance(payload, dict) or "tasks" not in payload or "records" not in payload:
        raise SystemExit(f"--report: expected a pie_eval JSON with 'tasks' and 'records' (written with --json by "
                         f"this version), got keys {sorted(payload) if isinstance(payload, dict) else type(payload)}")
    payload["by_distance"] = by_distance(payload["records"])
    write_report(path, payload)


def plot_cost_quality(tasks: dict, path: str | None) -> None:
    """Agreement with full vs mean update time relative to exact prefix reuse on the same samples, one line per task
    through its strategies; prefix (exact, cost 1) is the reference point every approximation must beat."""
    series = {}
    for t, per in tasks.items():
        pts = sorted((m["mean_ratio_vs_prefix"], m["agree_full"], s) for s, m in per.items()
                     if s not in ("naive", "full") and "mean_ratio_vs_prefix" in m)   # runs before prefix: no cost
        series[t] = ([x for x, _, _ in pts], [y for _, y, _ in pts])
    series["prefix (exact reference)"] = ([1.0], [100.0])
    plot(path, series, "mean update time / exact prefix reuse (same samples)", "agreement with full (%)",
         "Edit strategies: quality vs cost relative to prefix reuse", logx=True)


def main() -> None:
    ap = bench_parser(__doc__, seed=0, model_help="smollm2 (default), gemma3, a .gguf path or a model directory")
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--samples", type=int, default=200, help="per task")
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--k", type=int, nargs="+", default=[16, 64],
                    help="pie+k: tokens re-encoded after each edit; the first value is reported as 'pie+k', "
                         "others as 'pie+k<k>'")
    ap.add_argument("--tail", type=int, default=0,
                    help="also report pie+tail: PIE that re-encodes the last TAIL tokens before the cursor")
    ap.add_argument("--blend", type=float, nargs="*", default=[],
                    help="also report pie+blend<100 r> for each ratio r: CacheBlend on the stale tokens after the edits")
    ap.add_argument("--also", nargs="*", default=[],
                    help="further strategies pie[+k<K>][+tail<T>] or pie+attn<P>[+probe<Q>][+tail<T>], e.g. "
                         "pie+k16+tail256 pie+attn10 (reported under that name)")
    ap.add_argument("--skip", nargs="*", default=[],
                    help=f"drop some of {' '.join(SKIPPABLE)} (full always runs), e.g. for a run of --also specs only")
    ap.add_argument("--int8", nargs="*", default=[],
                    help="strategies to run again on an int8 cache, reported as <spec>@int8 (e.g. full prefix pie)")
    ap.add_argument("--gate", nargs="*", default=[], metavar="SPEC:MARGIN",
                    help="gated strategies (EditSession.complete), e.g. auto+b25:1.5: update with SPEC and generate; "
                         "at the first step whose margin (log p top-1 - log p top-2) is below MARGIN nats, redo the "
                         "edit with prefix (exact) and generate again; update_s counts both updates and the abandoned "
                         "generation. Reported as SPEC/mMARGIN")
    ap.add_argument("--reference", default=None, metavar="JSON",
                    help="do not run full: read its predictions (and times) from this earlier pie_eval run of the same "
                         "seed, context and corpus (every sample of this run must be in it, checked by task, file, "
                         "line and target). Ratios to prefix stay side by side in this run; ratios to full do not")
    ap.add_argument("--tasks", nargs="+", default=["insertion", "deletion", "multi"])
    ap.add_argument("--max-new", type=int, default=40)
    ap.add_argument("--resume", action="store_true",
                    help="continue the run saved in --json (same settings): its finished samples are kept, the "
                         "rest are run, and the tables cover all")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="no run: re-render the tables and plots of a finished run from its saved records")
    a = parse_bench_args(ap)
    if a.report:
        return rerender(a.report)
    if not 256 <= a.context_tokens <= 8000:
        raise SystemExit(f"--context-tokens: expected 256..8000, got {a.context_tokens}")
    for r in a.blend:
        if not 0.0 < r <= 1.0:
            raise SystemExit(f"--blend: expected ratios in (0, 1], got {r}")
    names = strategy_names(a.k, a.tail, tuple(a.blend), tuple(a.also), tuple(a.skip), tuple(a.int8),
                           tuple(a.gate))  # fail early
    model, tok = load_model(a.model)
    for name, strat in names:                       # what this model cannot do fails before the run, with the reason
        try:
            strat.check(getattr(model.config, "layer_types", None) or [])
        except ValueError as e:
            raise SystemExit(f"--also {name}: {e}") from None
    files = corpus_files(a.corpus)
    rng = random.Random(a.seed)
    cache: dict = {}
    per_task: dict[str, list[dict]] = {t: [] for t in a.tasks}
    for task in a.tasks:
        while len(per_task[task]) < a.samples:
            s = make_sample(rng, files, cache, tok, a.context_tokens, task)
            if s is not None:
                per_task[task].append(s)
    # interleave the tasks so that checkpoints written during the run cover every task
    samples = [per_task[t][i] for i in range(a.samples) for t in a.tasks]
    settings = {"samples": a.samples, "seed": a.seed, "context_tokens": a.context_tokens, "k": a.k, "tail": a.tail,
                "blend": a.blend, "also": a.also, "skip": a.skip, "int8": a.int8, "gate": a.gate, "max_new": a.max_new,
                "reference": a.reference,
                "corpus": a.corpus or "stdlib: " + ", ".join(STDLIB_FILES)}
    if a.resume and not a.json:
        raise SystemExit("--resume: expected --json naming the run to continue, got none")
    reference = read_reference(a.reference, settings, samples) if a.reference else None
    records: list[dict] = resume_records(a.json, settings, samples) if a.resume else []
    done = len(records)

    def report(res: dict, partial: bool = False) -> None:
        payload = {"model": getattr(model, "name_or_path", "?"), **settings, "partial": partial,
                   "resumed_at": done if a.resume else None, "machine": machine(),
                   "tasks": {t: {s: {kk: m[kk] for kk in ("em", "es", "agree_full", "update_s",
                                                          "update_ratio_vs_full", "update_mean_s",
                                                          "mean_ratio_vs_prefix", "mean_ratio_vs_full",
                                                          "tokens_encoded", "n")}
                                 for s, m in per.items()} for t, per in res.items()},
                   "by_distance": by_distance(records), "records": records}
        write_report(a.json, payload)

    report(run(model, tok, samples[done:], a.k, a.max_new, checkpoint=report, tail=a.tail, blend=tuple(a.blend),
               also=tuple(a.also), skip=tuple(a.skip), records=records, int8=tuple(a.int8), gates=tuple(a.gate),
               reference=reference))


if __name__ == "__main__":
    main()
