"""The benchmark harnesses score what they claim: bench/rag_eval.py generates APE answers with APE attention;
bench/pie_eval.py runs the strategy each --also spec names."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import contextlib  # noqa: E402

import bench_memory  # noqa: E402
import pie_eval  # noqa: E402
import pytest  # noqa: E402
import rag_eval  # noqa: E402

from kvpos.edits import Strategy  # noqa: E402
from kvpos.integrations.ape import use_ape  # noqa: E402
from kvpos.integrations.hf import extend, generate  # noqa: E402
from kvpos.integrations.rag import PromptParts, RagPipeline  # noqa: E402
from kvpos.integrations.hf.testing import tiny_model  # noqa: E402


def test_rag_answers_of_ape_methods_are_generated_under_ape_attention():
    """The one RAG answer path (RagPipeline.answer_parts, which bench/rag_eval.py calls) generates APE answers with
    APE attention for the question AND every generated token."""
    model = tiny_model("llama")[0]
    g = torch.Generator().manual_seed(3)
    anchor = torch.randint(3, 128, (5,), generator=g)
    parts = PromptParts(anchor, [torch.randint(3, 128, (9,), generator=g) for _ in range(6)],
                        torch.randint(3, 128, (4,), generator=g))
    rag = RagPipeline(model, _CharTok(), builder=_AnchorOnly(anchor))
    knobs = {"temperature": 0.5, "scale": 0.8}
    m = {x.name: x for x in rag_eval.build_methods([], 0.0, {"ape": knobs})}["ape"]
    got = rag.answer_parts(parts, m, max_new_tokens=9).token_ids

    def manual(ape_for_answer: bool) -> list[int]:
        cache, _ = rag.composer.compose(parts.chunks, layout="parallel")
        with use_ape(model, cache, **knobs):
            first = int(extend(model, cache, parts.question[None])[0, -1].argmax())
        ctx = use_ape(model, cache, **knobs) if ape_for_answer else contextlib.nullcontext()
        with ctx:
            out = generate(model, cache, torch.tensor([[first]]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        return [first] + out[0, 1:].tolist()

    assert got == manual(True)
    assert got != manual(False)      # generating outside APE (an old harness bug) gives other tokens: the test can tell


class _AnchorOnly:
    """A prompt builder stub: the anchor ids only (the test hands PromptParts directly)."""

    def __init__(self, anchor):
        self.anchor_ids = anchor


def test_pie_eval_specs_name_the_session_call():
    names = dict(pie_eval.strategy_names([16], also=("pie+k16+tail256", "pie+tail512", "pie+attn5+probe32")))
    assert names["pie+k16+tail256"] == Strategy("pie", k=16, tail=256)
    assert names["pie+tail512"] == Strategy("pie", tail=512)
    assert names["pie+attn5+probe32"] == Strategy("pie", repair="attn", ratio=0.05, probe=32)
    assert names["pie+k"] == Strategy("pie", k=16) and names["naive"] == Strategy("naive")
    assert list(names) == ["full", "prefix", "pie", "naive", "pie+k", "pie+k16+tail256", "pie+tail512",
                           "pie+attn5+probe32"]
    for bad in ("pie+tail", "k16", "pie+tail256+k16", "pie+attn0", "pie+attn101", "pie+attn10+tail64+probe8"):
        with pytest.raises(SystemExit, match="--also"):
            pie_eval.strategy_names([16], also=(bad,))
    with pytest.raises(SystemExit, match="twice"):
        pie_eval.strategy_names([16, 64], also=("pie+k64",))


class _CharTok:
    """Character-level tokenizer over the tiny models' 128-token vocabulary (ids = code points; "\\n" is 10)."""
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return type("Enc", (), {"input_ids": [min(ord(c), 127) for c in text]})()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(int(i)) for i in ids)


def test_pie_eval_records_where_the_last_edit_sits_and_skips_on_request():
    model = tiny_model("llama")[0]
    tok = _CharTok()
    doc = [f"v{i} = {i}" for i in range(12)]
    doc[1], doc[10] = "ZZZZZZZ", "QQQQQQQ"     # characters found nowhere else: the diff is the line (+- its newline)
    near, far = list(doc), list(doc)
    del near[10]                       # the cache lacks a line just before the cursor
    del far[1]                         # ... or one near the start
    samples = [{"path": "f.py", "line": 12, "old": "\n".join(o), "new": "\n".join(doc), "target": "y = 1",
                "task": "insertion"} for o in (near, far)]
    records: list = []
    res = pie_eval.run(model, tok, samples, [4], max_new=6, skip=("naive", "pie+k"), records=records)
    assert list(res["insertion"]) == ["full", "prefix", "pie"]
    assert res["insertion"]["prefix"]["agree_full"] == 100.0 and res["insertion"]["prefix"]["mean_ratio_vs_prefix"] == 1.0
    after_near, after_far = len("\n".join(doc[11:])), len("\n".join(doc[2:]))   # characters after the lines
    assert records[0]["to_cursor"] in (after_near, after_near + 1)
    assert records[1]["to_cursor"] in (after_far, after_far + 1)
    assert records[0]["edits"] == records[1]["edits"] == 1
    assert set(records[0]["pred"]) == {"full", "prefix", "pie"}
    assert records[0]["to_first"] < records[1]["to_first"]                   # the far edit leaves more to recompute
    assert records[0]["tokens_encoded"]["prefix"] == records[0]["to_first"]
    rows = pie_eval.by_distance(records, bins=(0, 64))
    assert [(r["task"], r["to_cursor"], r["n"]) for r in rows] == [
        ("insertion", "[0,64)", 1), ("insertion", "[64,inf)", 1), ("all", "[0,64)", 1), ("all", "[64,inf)", 1)]
    for r, rec in zip(rows, records + records):
        assert r["pie"] == 100.0 * (rec["pred"]["pie"] == rec["pred"]["full"])
    names = [n for n, _ in pie_eval.strategy_names([16, 64], skip=("pie+k",), also=("pie+attn50",))]
    assert names == ["full", "prefix", "pie", "naive", "pie+attn50"]
    with pytest.raises(SystemExit, match="--skip"):
        pie_eval.strategy_names([4], skip=("full",))


def test_pie_eval_report_rerenders_a_saved_run(tmp_path):
    recs = [{"task": t, "to_cursor": d, "pred": {"full": "a", "pie": p}} for t, d, p in
            [("insertion", 10, "a"), ("insertion", 300, "b"), ("multi", 20, "b"), ("multi", 2000, "a")]]
    m = {"em": 0.0, "es": 50.0, "agree_full": 50.0, "update_s": 0.1, "update_ratio_vs_full": 0.1,
         "tokens_encoded": 3, "n": 2}
    path = tmp_path / "run.json"
    path.write_text(pie_eval.json.dumps({"tasks": {"insertion": {"full": m, "pie": m}}, "records": recs,
                                         "partial": True}))
    pie_eval.rerender(str(path))
    saved = pie_eval.json.loads(path.read_text())
    allrows = {r["to_cursor"]: r["pie"] for r in saved["by_distance"] if r["task"] == "all"}
    assert allrows == {"[0,64)": 50.0, "[256,1024)": 0.0, "[1024,inf)": 100.0}
    md = (tmp_path / "run.md").read_text()
    assert "| multi | [0,64) | 1 | 0.0 |" in md and "| insertion | pie |" in md
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    for p in (bad, tmp_path / "missing.json"):
        with pytest.raises(SystemExit, match="--report"):
            pie_eval.rerender(str(p))


def test_pie_eval_resume_continues_a_saved_run_and_refuses_another(tmp_path):
    """--resume: the saved records are the first samples of this run (same settings), run() continues after them,
    and the tables cover all: agreement and tokens equal an uninterrupted run's."""
    model = tiny_model("llama")[0]
    tok = _CharTok()
    doc = [f"v{i} = {i}" for i in range(12)]
    samples = []
    for k in (2, 5, 9):
        old = list(doc)
        del old[k]
        samples.append({"path": "f.py", "line": k, "old": "\n".join(old), "new": "\n".join(doc), "target": "v1 = 1",
                        "task": "insertion"})
    whole: list = []
    ref = pie_eval.run(model, tok, samples, [4], max_new=6, skip=("naive",), records=whole)
    settings = {"samples": 3, "seed": 0, "also": []}
    path = tmp_path / "run.json"
    path.write_text(pie_eval.json.dumps({**settings, "records": whole[:2], "partial": True}))
    recs = pie_eval.resume_records(str(path), settings, samples)
    assert len(recs) == 2
    res = pie_eval.run(model, tok, samples[2:], [4], max_new=6, skip=("naive",), records=recs)
    assert len(recs) == 3 and [r["line"] for r in recs] == [2, 5, 9]
    for s in ref["insertion"]:
        for key in ("n", "em", "es", "agree_full", "tokens_encoded"):
            assert res["insertion"][s][key] == ref["insertion"][s][key], (s, key)
    with pytest.raises(SystemExit, match=r"--resume: expected the settings of .*'seed': \(0, 1\)"):
        pie_eval.resume_records(str(path), {**settings, "seed": 1}, samples)
    with pytest.raises(SystemExit, match="--resume: expected saved sample 0 to be this run's"):
        pie_eval.resume_records(str(path), settings, samples[1:])
    with pytest.raises(SystemExit, match="without \\['pie\\+k'\\]"):
        pie_eval.scores_from_records([{**whole[0], "pred": {"full": "", "prefix": "", "pie": ""}}],
                                     ["full", "prefix", "pie", "pie+k"])
    with pytest.raises(SystemExit, match="no such file"):
        pie_eval.resume_records(str(tmp_path / "none.json"), settings, samples)


def test_pie_frontier_reads_each_rule_from_the_branch_it_takes(tmp_path):
    """prefix when its tokens <= lambda x the strategy's: agreement, tokens and time come from that branch's record."""
    import pie_frontier

    def rec(task, tp, ts, ok, up=1.0, us=0.25):
        return {"task": task, "pred": {"full": "a", "prefix": "a", "pie+tail8": "a" if ok else "b"},
                "tokens_encoded": {"full": 100, "prefix": tp, "pie+tail8": ts}, "update_s": {"full": 2.0,
                "prefix": up, "pie+tail8": us}}
    recs = [rec("insertion", 10, 20, False), rec("insertion", 90, 20, True, up=3.0)]
    assert pie_frontier.rule_outcome(recs[0], "pie+tail8", 1.0) == (True, 10, 1.0)      # prefix is cheaper: taken
    assert pie_frontier.rule_outcome(recs[0], "pie+tail8", 0.0) == (False, 20, 0.25)    # lambda 0: the strategy
    rows = pie_frontier.evaluate(recs, [0.0, 1.0])
    assert [(r["lambda"], r["agree"], r["token_ratio"], r["time_ratio"]) for r in rows] == [
        (0.0, 50.0, 40 / 100, 0.5 / 4.0), (1.0, 100.0, 30 / 100, 1.25 / 4.0)]
    summary = pie_frontier.rules(rows, 95.0, 0.5)
    assert summary[0]["lambda"] == 1.0 and summary[0]["meets_target"] and not summary[1]["meets_target"]
    path = tmp_path / "run.json"
    path.write_text(pie_eval.json.dumps({"records": [{**recs[0], "pred": {"full": "a", "pie": "a"}}]}))
    with pytest.raises(SystemExit, match="'prefix', got .* record 0 without"):
        pie_frontier.load_records([str(path)])
    with pytest.raises(SystemExit, match="no such file"):
        pie_frontier.load_records([str(tmp_path / "none.json")])


def test_pie_eval_gate_runs_complete_and_reference_skips_full(tmp_path):
    """--gate SPEC:MARGIN runs EditSession.complete: with a floor no step reaches, every PIE update is abandoned and
    redone with prefix (its tokens are both updates', its generation prefix's). --reference reads full's prediction
    from an earlier run of the same samples instead of running it."""
    model = tiny_model("llama")[0]
    tok = _CharTok()
    doc = [f"v{i} = {i}" for i in range(12)]
    samples = []
    for k in (2, 5):
        old = list(doc)
        del old[k]
        samples.append({"path": "f.py", "line": k, "old": "\n".join(old), "new": "\n".join(doc), "target": "v1 = 1",
                        "task": "insertion"})
    recs: list = []
    pie_eval.run(model, tok, samples, [4], max_new=6, skip=("naive", "pie+k"), records=recs, gates=("pie:99",))
    for r in recs:
        assert r["fell_back"] == {"pie/m99": True} and r["chosen"]["pie/m99"] == "pie=>prefix"
        assert r["tokens_encoded"]["pie/m99"] == r["tokens_encoded"]["pie"] + r["tokens_encoded"]["prefix"]
        assert r["margins"]["pie/m99"] == r["margins"]["prefix"] and r["pred"]["pie/m99"] == r["pred"]["prefix"]
        assert r["update_s"]["pie/m99"] > 0 and set(r["margins"]) == {"full", "prefix", "pie", "pie/m99"}
    ref = {(r["task"], r["path"], r["line"]): {**r, "pred": {**r["pred"], "full": "from the reference"}} for r in recs}
    again: list = []
    res = pie_eval.run(model, tok, samples, [4], max_new=6, skip=("naive", "pie+k"), records=again, reference=ref)
    assert [r["pred"]["full"] for r in again] == ["from the reference"] * 2 and "full" not in again[0]["margins"]
    assert res["insertion"]["prefix"]["agree_full"] == 0.0           # scored against the reference's prediction
    for bad in ("pie", "pie:0", "pie:x", "prefix:1", "fast:1"):
        with pytest.raises(SystemExit, match="--gate"):
            pie_eval.parse_gate(bad)
    settings = {"seed": 0, "context_tokens": 2048, "corpus": "c", "max_new": 6}
    path = tmp_path / "ref.json"
    path.write_text(pie_eval.json.dumps({**settings, "records": recs}))
    assert set(pie_eval.read_reference(str(path), settings, samples)) == set(ref)
    with pytest.raises(SystemExit, match="--reference: expected a run with seed=1"):
        pie_eval.read_reference(str(path), {**settings, "seed": 1}, samples)
    with pytest.raises(SystemExit, match="--reference: expected every sample of this run"):
        pie_eval.read_reference(str(path), settings, [{**samples[0], "line": 7}])


def test_pie_gate_replays_the_gate_from_recorded_margins():
    import pie_gate
    rec = {"task": "multi", "pred": {"full": "a", "prefix": "a", "auto": "b"}, "chosen": {"auto": "pie+k64+tail200"},
           "update_s": {"full": 4.0, "prefix": 2.0, "auto": 1.0}, "gen_s": {"auto": 4.0},
           "margins": {"auto": [3.0, 0.5, 2.0, 0.2]}}
    assert pie_gate.replay(rec, "auto", 0.0) == ("b", 1.0, False)
    assert pie_gate.replay(rec, "auto", 0.1) == ("b", 1.0, False)            # no step below 0.1
    assert pie_gate.replay(rec, "auto", 1.0) == ("a", 1.0 + 4.0 * 2 / 4 + 2.0, True)   # stops at step 2 of 4
    exact = {**rec, "chosen": {"auto": "prefix"}}
    assert pie_gate.replay(exact, "auto", 1.0) == ("b", 1.0, False)           # exact choices are never gated
    rows = pie_gate.table([rec, {**rec, "margins": {"auto": [3.0]}}], ["auto"], [1.0])
    row = next(r for r in rows if r["task"] == "multi" and r["floor"] == 1.0)
    assert row["agree_full"] == 50.0 and row["fell_back"] == 50.0 and row["mean_ratio_vs_prefix"] == (5.0 + 1.0) / 2 / 2
    pair = {**rec, "pred": {**rec["pred"], "small": "b"}, "update_s": {**rec["update_s"], "small": 0.5}}
    assert pie_gate.replay_pair(pair, "auto", "small") == ("b", 1.5, False)               # agree: trust a
    other = {**pair, "pred": {**pair["pred"], "small": "c"}}
    assert pie_gate.replay_pair(other, "auto", "small") == ("a", 3.5, True)               # disagree: prefix


@pytest.mark.parametrize("storage, read", [("rotated", "auto"), ("raw", "auto"), ("raw", "torch"), ("int8", "auto"),
                                           ("int8", "torch")])
def test_bench_memory_accounts_every_storage_from_its_own_buffers(storage, read):
    """bench/bench_memory.py's byte accounting reads each storage's buffers (int8 holds codes, not raw keys)."""
    from kvpos.integrations.hf import PositionedCache

    model = tiny_model("llama")[0]
    cache = PositionedCache.from_model(model, storage=storage, read=read)
    extend(model, cache, torch.randint(3, 128, (1, 40)))
    held = sum(b.numel() * b.element_size() for l in cache.layers for b in l.buffers() if b is not None)
    assert bench_memory.cache_bytes(cache) >= held > 0
    scratch = bench_memory.scratch_bytes(cache)
    assert (scratch == 0) == (storage == "rotated"), scratch


import rag_qa  # noqa: E402
from kvpos.integrations.rag import RagMethod  # noqa: E402


def test_rag_qa_method_names_map_to_the_repairs_they_name():
    m = rag_qa.method_from_name("sequential+link16+sel15+attn5+tail8+last1+probe2")
    assert (m.layout, m.link_k, m.recompute_ratio, m.attn_ratio, m.tail_k, m.last_chunks, m.probe_chunks) == \
        ("sequential", 16, 0.15, 0.05, 8, 1, 2)
    assert rag_qa.method_from_name("sequential+apeT0.8").ape.temperature == 0.8
    assert rag_qa.method_from_name("parallel") == RagMethod("parallel", layout="parallel")
    assert rag_qa.method_from_name("full+mspoe").position == "ms_poe"
    assert rag_qa.method_from_name("sequential+pine").position == "pine_lite"
    assert rag_qa.method_from_name("full+pine").position == "pine"          # PINE's full form
    assert rag_qa.method_from_name("sequential+lead2+attn5") == RagMethod("sequential+lead2+attn5", lead=2,
                                                                        attn_ratio=0.05)
    for bad, match in (("seq", "expected a base"), ("sequential+link", "expected repairs"),
                       ("sequential+zz3", "expected repairs"), ("parallel+probe1", "expected layout='sequential'"),
                       ("prefix+pine", "expected 'pine_lite' without APE, with chunk reuse"),
                       ("full+lead1", "expected no repairs, APE or lead with layout='full'")):
        with pytest.raises(ValueError, match=match):
            rag_qa.method_from_name(bad)


def _rec(i, method, correct, nll, first, ttft, kl=0.0, computed=10):
    return {"id": f"q{i}", "method": method, "correct": correct, "nll": nll, "first_agree": first, "kl": kl,
            "agree": first, "ttft_s": ttft, "tokens_computed": computed, "n_tokens": 100}


def test_rag_qa_summary_pairs_every_method_with_full_prefill_on_the_same_items():
    rows = [_rec(0, "full", True, 1.0, True, 4.0, computed=100), _rec(1, "full", False, 2.0, True, 2.0,
                                                                      computed=100),
            _rec(0, "sequential", False, 1.5, False, 1.0, kl=0.2), _rec(1, "sequential", True, 2.1, True, 0.5),
            _rec(2, "sequential", True, 9.0, True, 0.1)]                        # item 2 has no full: not counted
    s = rag_qa.summarize(rows)
    seq = s["sequential"]
    assert seq["n"] == 2 and seq["accuracy"] == 50.0 and seq["acc_vs_full"] == 100.0 and seq["d_acc"] == 0.0
    assert abs(seq["d_nll"] - 0.3) < 1e-9 and seq["first_agree"] == 50.0 and abs(seq["kl"] - 0.1) < 1e-9
    assert abs(seq["d_nll_median"] - 0.3) < 1e-9            # paired differences 0.5 and 0.1: median of two
    assert seq["speedup"] == 4.0 and seq["recomputed"] == 10.0 and s["full"]["recomputed"] == 100.0
    with pytest.raises(ValueError, match="records: expected full prefill's records"):
        rag_qa.summarize([r for r in rows if r["method"] != "full"])


class _Parts:
    """A prompt builder stub for QA items: paragraph strings -> char ids, after a fixed anchor."""

    def __init__(self, anchor):
        self.anchor_ids = anchor
        self.tok = _CharTok()

    def parts(self, paragraphs, question):
        ids = lambda s: torch.tensor(self.tok(s).input_ids)   # noqa: E731
        return PromptParts(self.anchor_ids, [ids(p) for p in paragraphs], ids(question))


def test_rag_qa_runs_every_method_once_per_item_and_resumes_from_its_records(tmp_path):
    model = tiny_model("llama", num_hidden_layers=2)[0]
    anchor = torch.tensor([5, 6, 7, 8])
    rag = RagPipeline(model, _CharTok(), builder=_Parts(anchor))
    items = [{"id": f"q{i}", "question": f"what {i}?", "answers": ["ab"], "gold": [0],
              "paragraphs": [f"para {i} {j} xyz" for j in range(3)]} for i in range(3)]
    methods = [rag_qa.method_from_name(n) for n in ("full", "prefix", "sequential", "sequential+probe1")]
    rec = str(tmp_path / "r.jsonl")
    meta = {"data": "t", "format": "turns", "split": "calibration", "model": "tiny"}
    first = rag_qa.run_items(rag, methods, items[:2], 4, rec, 2, meta)
    assert [(r["id"], r["method"]) for r in first] == [("q0", "full"), ("q0", "prefix"), ("q0", "sequential"),
                                                      ("q0", "sequential+probe1"), ("q1", "full"),
                                                      ("q1", "sequential"), ("q1", "sequential+probe1")]
    full, prefix = first[0], first[1]
    assert full["kl"] == 0.0 and full["first_agree"] and prefix["kl"] < 1e-6 and prefix["first_agree"]
    assert first[3]["chunks"] and len(first[3]["chunks"]) == 1
    again = rag_qa.run_items(rag, methods, items, 4, rec, 2, meta)        # resumes: only q2 runs
    assert {r["id"] for r in again} == {"q2"}
    assert len(rag_qa.read_records([rec])) == 7 + 4
    with pytest.raises(ValueError, match="methods: expected full prefill first"):
        rag_qa.run_items(rag, methods[1:], items, 4, None, 2, meta)


import length_eval  # noqa: E402


def test_length_eval_summary_buckets_nll_by_position_and_pairs_prefill_cost_with_plain():
    rows = [{"policy": "plain", "seed": 0, "nll": [1.0] * 2048 + [2.0] * 2048 + [4.0] * 1000, "found": True,
             "prefill_s": 2.0, "tokens": 5096},
            {"policy": "lm_infinite", "seed": 0, "nll": [1.0] * 2048 + [2.0] * 2048 + [2.0] * 1000, "found": False,
             "prefill_s": 5.0, "tokens": 5096}]
    plain, lmi = length_eval.summarize(rows, 2048)
    assert (plain["nll_0"], plain["nll_2048"], plain["nll_4096"]) == (1.0, 2.0, 4.0)
    assert plain["last_vs_2k"] == 2.0 and lmi["last_vs_2k"] == 1.0
    assert (plain["passkey"], lmi["passkey"]) == (100.0, 0.0) and lmi["prefill_vs_plain"] == 2.5


def test_length_eval_report_titles_the_plot_with_the_records_model_and_refuses_no_records(tmp_path):
    rec = tmp_path / "r.jsonl"
    row = {"policy": "plain", "seed": 0, "length": 4096, "model": "/x/m.gguf", "nll": [1.0] * 4095, "found": False,
           "prefill_s": 1.0, "tokens": 4096}
    rec.write_text(json.dumps(row) + "\n")
    length_eval.main(["--report", str(rec), "--json", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text())["title"] == "m.gguf: 4096 tokens"
    assert (tmp_path / "out.png").exists()
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit):
        length_eval.main(["--report", str(tmp_path / "empty.jsonl")])


def test_length_eval_policies_are_documented_and_wrope_capped_differs_only_in_the_sink_distance():
    import dataclasses

    pol = length_eval.policies(8192)
    assert all(f"\n  {name} " in length_eval.__doc__ for name in pol)
    assert pol["wrope"].sink_distance is None and pol["wrope_capped"].sink_distance == pol["wrope"].distance
    assert dataclasses.replace(pol["wrope_capped"], sink_distance=None) == pol["wrope"]


def test_gold_moved_puts_the_gold_paragraphs_at_each_position_and_reports_by_position(tmp_path):
    item = {"id": "q", "paragraphs": ["a", "G1", "b", "G2", "c"], "gold": [1, 3], "answers": ["x"], "question": "?"}
    moved = rag_qa.gold_moved([item], [0, 3])
    assert [m["paragraphs"] for m in moved] == [["G1", "G2", "a", "b", "c"], ["a", "b", "c", "G1", "G2"]]
    assert [m["gold"] for m in moved] == [[0, 1], [3, 4]] and [m["id"] for m in moved] == ["q@0", "q@3"]
    with pytest.raises(ValueError, match=r"--gold-at: expected positions in \[0, 3\]"):
        rag_qa.gold_moved([item], [4])
    rows = [{**_rec(i, m, c, nll, 1, 1.0), "id": f"{i}@{p}", "gold": [p]}
            for i in range(3) for p in (0, 4) for m, c, nll in (("full", p == 4, 2.0 + p), ("sequential+pine", 1, 3.0))]
    out = rag_qa.report_by_position(rows, str(tmp_path / "litm.json"))
    assert out["positions"] == [0, 4]
    assert out["spread"]["full"]["nll_spread"] == 4.0 and out["spread"]["sequential+pine"]["nll_spread"] == 0.0
    assert out["spread"]["full"]["accuracy_spread"] == 100.0 and (tmp_path / "litm.png").exists()
    pine = out["spread"]["sequential+pine"]                # paired by question over positions: full is right at 4
    assert pine["questions"] == 3 and pine["d_acc"] == 50.0 and pine["d_nll"] == 3.0 - 4.0
    assert out["spread"]["full"]["d_acc"] == 0.0 and out["spread"]["full"]["d_nll_ci"] == [0.0, 0.0]


def test_reordered_items_keep_their_gold_and_order_sensitivity_counts_unchanged_answers():
    item = {"id": "q", "paragraphs": ["a", "b", "G", "c"], "gold": [2], "answers": ["x"], "question": "?"}
    got = rag_qa.reordered([item], 3, seed=1)
    assert [x["id"] for x in got] == ["q#0", "q#1", "q#2"] and got[0]["paragraphs"] == item["paragraphs"]
    assert all(x["paragraphs"][x["gold"][0]] == "G" and sorted(x["paragraphs"]) == sorted(item["paragraphs"])
               for x in got)
    rows = [{"id": f"q{i}#{j}", "method": m, "text": t, "first": 1, "correct": 1}
            for i in range(2) for j in range(3)
            for m, t in (("plain", f"answer {j if i == 0 else 0}"), ("pine", "same"))]
    out = {r["method"]: r for r in rag_qa.report_orders(rows, None)["methods"]}
    assert out["plain"]["same_answer"] == 50.0 and out["pine"]["same_answer"] == 100.0
    with pytest.raises(ValueError, match="--orders: expected an int >= 2"):
        rag_qa.reordered([item], 1, 0)


import order_eval  # noqa: E402


def test_order_eval_ranks_by_bm25_and_keeps_the_gold_when_trimming():
    ps = ["cats purr and sleep", "the capital of France is Paris", "Paris hosts the Louvre museum", "rain"]
    assert order_eval.bm25_rank("What is the capital of France?", ps)[:2] == [1, 2]
    item = {"id": "q", "question": "?", "paragraphs": ["a", "b", "G1", "c", "G2"], "gold": [2, 4]}
    (t,) = order_eval.trimmed([item], 3)
    assert t["paragraphs"] == ["a", "G1", "G2"] and t["gold"] == [1, 2]
    with pytest.raises(ValueError, match="--docs: expected at least 2"):
        order_eval.trimmed([item], 1)


import judge_eval  # noqa: E402


def test_judge_eval_counts_accuracy_swap_agreement_and_first_slot_picks():
    pick = lambda first, gold: {"picked_first": first, "picked_gold": gold, "logprobs": [0, 0]}   # noqa: E731
    rows = [{"id": "a", "method": "m", "gold_first": pick(True, True), "wrong_first": pick(True, False)},
            {"id": "b", "method": "m", "gold_first": pick(True, True), "wrong_first": pick(False, True)}]
    (s,) = judge_eval.summarize(rows)
    assert (s["accuracy"], s["swap_agreement"], s["first_slot_rate"]) == (75.0, 50.0, 75.0)


def test_squad_judge_items_pair_the_gold_answer_with_another_answer_of_the_same_paragraph():
    from kvpos.data import normalize_answer, squad_judge_items
    items = squad_judge_items(40, split="heldout")
    assert len(items) == 40 and len({x["id"] for x in items}) == 40
    for x in items:
        assert x["gold"] in x["paragraph"] and x["wrong"] in x["paragraph"]
        g, w = normalize_answer(x["gold"]), normalize_answer(x["wrong"])
        assert g not in w and w not in g
