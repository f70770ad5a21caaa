"""The RAG answer path: full and prefix are exact, prefix reuses the common prefix, query-aware repair works."""
import pytest
import torch

from kvpos.integrations.rag import FULL, PREFIX, ChatPromptBuilder, PromptParts, RagMethod, RagPipeline
from kvpos.integrations.hf.testing import tiny_model
from kvpos.integrations.hf import extend
from kvpos.integrations.repairs import chunks_read_most


class _Tok:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


class _Builder:
    def __init__(self, anchor):
        self.anchor_ids = anchor

    def chunk_ids(self, passage):
        return torch.tensor([int(x) for x in passage.split()], dtype=torch.long)


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
    with pytest.raises(ValueError, match="RagMethod p: expected no repairs, APE or lead with layout='prefix'"):
        RagMethod("p", layout="prefix", link_k=4)


@pytest.mark.parametrize("knobs", [{"last_chunks": 5}, {"probe_chunks": 5}, {"tail_k": 8},
                                   {"tail_k": 3, "last_chunks": 5}])
def test_reencoding_every_chunk_in_context_equals_full_prefill(knobs):
    """A repair that re-encodes every chunk token in full context is full prefill (logits within 1e-4); re-encoding
    fewer moves the logits toward it. Fails if a re-encoded slot does not read the slots before it."""
    model, parts, rag = _setup(2)
    full = rag.score(parts, FULL)
    seq = rag.score(parts, RagMethod("s"))
    every = rag.score(parts, RagMethod("every", **knobs))
    assert (every - full).abs().max() < 1e-4
    some = {k: max(1, v // 2) if k != "tail_k" else 3 for k, v in knobs.items()}
    part = rag.score(parts, RagMethod("some", **some))
    assert 0 < (part - full).abs().max() < (seq - full).abs().max()


def test_lead_passages_route_each_method_to_chunks_encoded_after_its_lead():
    model, parts, _ = _setup(4)
    lead = ["11 12 13 14 15 16", "21 22 23 24"]
    rag = RagPipeline(model, _Tok(), builder=_Builder(parts.anchor), lead=lead)
    assert rag.method.lead == 2 and rag.composer is rag.composer_for(2)
    assert rag.precompute(parts.chunks, [0, 1, 2]) == 3 * len(parts.chunks)
    assert rag.precompute(parts.chunks, [0, 1, 2]) == 0
    one = rag.composer_for(1)
    assert torch.equal(one.anchor.lead, torch.arange(11, 17))
    cache, _ = one.compose(parts.chunks)
    want = extend(model, cache, parts.question[None])
    got = rag.score(parts, RagMethod("l1", lead=1))
    assert torch.equal(got, want)
    plain = rag.score(parts, RagMethod("l0"))
    assert (got - plain).abs().max() > 1e-4
    ans = rag.answer_parts(parts, RagMethod("l2", lead=2), 4)
    assert ans.report["chunks_hit"] == len(parts.chunks) and ans.report["tokens_computed"] == parts.question.numel()
    with pytest.raises(ValueError, match=r"RagPipeline lead: expected an int in \[0, 2\]"):
        rag.score(parts, RagMethod("l3", lead=3))
    with pytest.raises(ValueError, match="RagMethod f: expected no repairs, APE or lead with layout='full'"):
        RagMethod("f", layout="full", lead=1)
    with pytest.raises(ValueError, match="RagMethod n lead: expected an int >= 0"):
        RagMethod("n", lead=-1)
    with pytest.raises(TypeError, match="RagPipeline lead: expected a sequence of passage strings"):
        RagPipeline(model, _Tok(), builder=_Builder(parts.anchor), lead="11 12")


def test_probe_chunks_reencodes_the_chunks_the_question_reads_most_and_reports_them():
    model, parts, rag = _setup(3)
    rag.composer.precompute(parts.chunks, progress=False)
    ans = rag.answer_parts(parts, RagMethod("p", probe_chunks=2), 4)
    picked = ans.report["reencoded_chunks"]
    assert len(picked) == 2 and picked == sorted(picked)
    assert ans.report["tokens_computed"] == 2 * 8 + parts.question.numel()
    last = rag.answer_parts(parts, RagMethod("l", last_chunks=2), 4)
    assert last.report["reencoded_chunks"] == [3, 4]
    for knob in ("tail_k", "last_chunks", "probe_chunks"):
        with pytest.raises(ValueError, match=f"RagMethod x {knob}: expected layout='sequential'"):
            RagMethod("x", layout="parallel", **{knob: 1})
        with pytest.raises(ValueError, match=f"RagMethod x {knob}: expected an int >= 0"):
            RagMethod("x", **{knob: -1})


def test_probe_chunks_pick_the_same_passages_in_any_order():
    """chunks_read_most scores every chunk at the same distance from the question (recency taken out), so the
    passages it picks do not depend on their order; the cache it probes is left as it was. Fails for a rule that
    scores at the composed positions, where the question reads the nearest chunk most."""
    model, parts, rag = _setup(5, n=6)
    parts = PromptParts(parts.anchor, [torch.cat([c, c[:4]]) for c in parts.chunks], parts.question)   # 12 tokens
    picks = []
    for order in ([0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2, 5, 0, 4, 1, 3]):
        chunks = [parts.chunks[i] for i in order]
        cache, info = rag.composer.compose(chunks)
        before = (cache.positions.clone(), cache.layers[0].keys.clone())
        got = chunks_read_most(model, cache, list(info.plan.slots), parts.question, 2)
        assert torch.equal(cache.positions, before[0]) and torch.equal(cache.layers[0].keys, before[1])
        picks.append(sorted(order[i] for i in got))
    assert picks[0] == picks[1] == picks[2], picks


@pytest.mark.parametrize("method", [FULL, RagMethod("s"), RagMethod("a", attn_ratio=0.5),
                                    RagMethod("p", layout="parallel"), RagMethod("fm", layout="full", position="ms_poe"),
                                    RagMethod("sm", position="ms_poe"), RagMethod("pl", position="pine_lite"),
                                    RagMethod("pf", layout="full", position="pine")])
def test_answer_scored_gives_answer_parts_tokens_and_the_teacher_forced_scores(method):
    """answer_scored = answer_parts' greedy tokens + score()'s first-token distribution and gold NLL, in one request."""
    model, parts, rag = _setup(4)
    gold = torch.tensor([7, 9, 11])
    got = rag.answer_scored(parts, method, gold, 6)
    assert got.token_ids == rag.answer_parts(parts, method, 6).token_ids
    ref = torch.log_softmax(rag.score(parts, method, gold)[0].float(), -1)
    Q = parts.question.numel()
    assert (got.first_logprobs - ref[Q - 1]).abs().max() < 1e-4
    want = float(-ref[Q - 1:Q - 1 + 3].gather(1, gold[:, None]).mean())
    assert abs(got.gold_nll - want) < 1e-4
    assert got.report["ttft_s"] > 0 and got.first_logprobs.shape == ref[0].shape
    with pytest.raises(ValueError, match="answer_scored gold: expected at least one token id"):
        rag.answer_scored(parts, method, [], 4)


def test_gemma3_turn_format_splits_into_pieces_that_rebuild_the_rendered_conversation(default_model):
    """load_model("gemma3") gives the base model's tokenizer Gemma 3's turn format: the builder's anchor + chunks +
    question are exactly the conversation that format renders (one user turn per passage, then the question)."""
    from kvpos.integrations.hf.models import GEMMA3_TURNS

    tok = default_model[1]

    class Gemma3Turns:                                      # the session tokenizer, with the template passed along
        def apply_chat_template(self, msgs, **kw):
            return tok.apply_chat_template(msgs, chat_template=GEMMA3_TURNS, **kw)

        def __call__(self, text, **kw):
            return tok(text, **kw)

    passages, q = ["Paris is the capital of France.", "The Loire is a river."], "What is the capital?"
    parts = ChatPromptBuilder(Gemma3Turns(), question_prefix="Question: ").parts(passages, q)
    msgs = [{"role": "user", "content": p} for p in passages] + [{"role": "user", "content": "Question: " + q}]
    text = tok.apply_chat_template(msgs, chat_template=GEMMA3_TURNS, tokenize=False, add_generation_prompt=True)
    assert text.startswith(tok.bos_token + "<start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
    assert parts.full_ids()[0].tolist() == tok(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("method", [RagMethod("pl", position="pine_lite"), RagMethod("pf", layout="full",
                                                                                    position="pine")])
def test_pine_requests_answer_alike_in_any_passage_order_and_bad_position_policies_are_named(method):
    model, parts, rag = _setup(6)
    first = [rag.answer_scored(PromptParts(parts.anchor, [parts.chunks[i] for i in order], parts.question), method,
                               torch.tensor([7, 9]), 4) for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1])]
    assert (first[0].first_logprobs - first[1].first_logprobs).abs().max() < 1e-5
    assert first[0].token_ids == first[1].token_ids and abs(first[0].gold_nll - first[1].gold_nll) < 1e-5
    with pytest.raises(ValueError, match="RagMethod x position: expected None or one of"):
        RagMethod("x", position="pine_full")
    with pytest.raises(ValueError, match="RagMethod x position: expected 'pine' without APE, with layout 'full'"):
        RagMethod("x", position="pine")
    with pytest.raises(ValueError, match="RagMethod x position: expected 'pine_lite' without APE, with chunk reuse"):
        RagMethod("x", layout="full", position="pine_lite")
    with pytest.raises(ValueError, match="RagMethod x position: expected 'ms_poe' without APE, with a layout other"):
        RagMethod("x", layout="prefix", position="ms_poe")
