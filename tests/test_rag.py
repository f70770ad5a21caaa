"""The RAG answer path: full and prefix are exact, prefix reuses the common prefix, query-aware repair works."""
import pytest
import torch

from kvpos.integrations.rag import FULL, PREFIX, PromptParts, RagMethod, RagPipeline
from kvpos.integrations.hf.testing import tiny_model


class _Tok:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


class _Builder:
    def __init__(self, anchor):
        self.anchor_ids = anchor


def _setup(seed=0, n=5):
    model = tiny_model("llama", num_hidden_layers=3)[0]
    g = torch.Generator().manual_seed(seed)
    anchor = torch.randint(3, 128, (5,), generator=g)
    parts = PromptParts(anchor, [torch.randint(3, 128, (8,), generator=g) for _ in range(n)],
                        torch.randint(3, 128, (4,), generator=g))
    return model, parts, RagPipeline(model, _Tok(), builder=_Builder(anchor))


def test_full_and_prefix_answers_equal_plain_generate_and_prefix_reuses_the_common_prefix():
    model, parts, rag = _setup()
    want = model.generate(parts.full_ids(), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, -8:].tolist()
    assert rag.answer_parts(parts, FULL, 8).token_ids == want
    prev = PromptParts(parts.anchor, [parts.chunks[i] for i in (0, 1, 3, 2, 4)], parts.question)
    rag.prime_prefix(prev)
    ans = rag.answer_parts(parts, PREFIX, 8)
    assert ans.token_ids == want
    assert ans.report["tokens_reused"] == 5 + 8 + 8                       # anchor + the first two chunks
    again = rag.answer_parts(parts, PREFIX, 8)                            # the same request again: all but one token
    assert again.token_ids == want and again.report["tokens_reused"] == parts.full_ids().shape[1] - 1


def test_query_aware_repair_of_every_chunk_token_equals_full_and_partial_moves_toward_it():
    model, parts, rag = _setup(1)
    full = rag.score(parts, FULL)
    seq = rag.score(parts, RagMethod("s"))
    every = rag.score(parts, RagMethod("a", attn_ratio=1.0))
    half = rag.score(parts, RagMethod("h", attn_ratio=0.5))
    assert (every - full).abs().max() < 1e-4
    e_seq, e_half = (seq - full).abs().max(), (half - full).abs().max()
    assert e_half < e_seq, (float(e_half), float(e_seq))
    with pytest.raises(ValueError, match="RagMethod x attn_ratio: expected layout='sequential'"):
        RagMethod("x", layout="parallel", attn_ratio=0.1)
    with pytest.raises(ValueError, match="RagMethod p: expected no repairs or APE with layout='prefix'"):
        RagMethod("p", layout="prefix", link_k=4)
