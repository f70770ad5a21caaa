"""Wire kvpos chunk reuse to a retriever's output: passages in, answer + per-request report out (SmolLM2, CPU).

The "retriever" is a keyword-overlap ranker over real essay passages (any retriever returning strings works).
Chunks live in a disk store (safetensors, checksummed), so a second process or run reuses them too. Every chunk is
stored encoded after a lead passage it never sees in a request (`lead=`: closer to full prefill at no cost per
request, docs/evaluation.md). Look at: request 1 misses every chunk; request 2 (another question, overlapping passages in another order) hits
them, and its TTFT drops accordingly.
"""
import re
import tempfile

import torch

from kvpos.data import passages
from kvpos.integrations.hf import load_default_model
from kvpos.integrations.rag import RagPipeline
from kvpos.store import DiskBackend

torch.set_num_threads(2)
model, tok = load_default_model()
stream = passages(tok, 120, seed=3)
corpus = [next(stream) for _ in range(12)]
corpus[4] += " The access code for the east gate is 4417."
corpus[9] += " The east gate is painted blue and faces the river."


def retrieve(query: str, k: int = 5) -> list[str]:
    words = set(re.findall(r"[a-z]+", query.lower()))
    return sorted(corpus, key=lambda p: -len(words & set(re.findall(r"[a-z]+", p.lower()))))[:k]


store_dir = tempfile.mkdtemp(prefix="kvpos-chunks-")
lead = [next(stream)]                                   # a typical passage of the corpus, in no request
rag = RagPipeline(model, tok, backend=DiskBackend(store_dir), lead=lead)
for q in ("What is the access code for the east gate?", "What colour is the east gate painted?"):
    ans = rag.answer(retrieve(q), q, max_new_tokens=20)
    rep = ans.report
    print(f"\nQ: {q}\nA: {ans.text!r}")
    print(f"   chunks hit {rep['chunks_hit']}, missed {rep['chunks_missed']}; tokens computed {rep['tokens_computed']}, "
          f"reused {rep['tokens_reused']}; TTFT {rep['ttft_s']:.2f}s")
print(f"\nchunk store: {store_dir}")
