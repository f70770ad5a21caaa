"""Code edits: edit API, strategies vs full recomputation (exact for 1-layer models), text-level diffing."""
import pytest
import torch

from kvpos.edits import Delete, Insert, Replace, Strategy, apply_edits, diff_tokens, normalize, pie_tokens, plan, \
    widen, with_tail
from kvpos.integrations.hf import PositionedCache, extend
from kvpos.integrations.pie import EditSession, attention_mass
from kvpos.integrations.hf.testing import TINY_ARCHS, tiny_model

EDIT_SETS = {
    "insert": [Insert(7, [11, 12, 13])],
    "delete": [Delete(4, 9)],
    "replace": [Replace(10, 12, [40, 41, 42, 43])],
    "multi": [Insert(3, [50]), Delete(8, 10), Replace(14, 15, [60, 61]), Insert(20, [70, 71])],
}


def _doc(seed=0, n=20):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))


def _probe(session):
    """Next-token logits after the document (same call for every strategy)."""
    cache = session.cache.copy()
    return extend(session.model, cache, torch.tensor([[5]]), positions=torch.tensor([session.length]))


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("kind", list(EDIT_SETS))
def test_pie_equals_full_for_a_one_layer_model(arch, kind):
    over = {"sliding_window": 4096, "layer_types": ["sliding_attention"]} if arch == "gemma3" else {}
    model = tiny_model(arch, num_hidden_layers=1, **over)[0]
    doc = _doc()
    full, pie = EditSession(model, doc), EditSession(model, doc)
    full.apply(EDIT_SETS[kind], "full")
    r = pie.apply(EDIT_SETS[kind], "pie")
    assert torch.equal(full.ids, pie.ids)
    assert (_probe(full) - _probe(pie)).abs().max() < 1e-4
    assert r.tokens_encoded == sum(len(e.ids) for e in EDIT_SETS[kind])
    assert pie.cache.positions.tolist() == [list(range(pie.length))]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "glm"])
def test_deeper_models_layer0_keys_equal_full_and_naive_is_worse(arch):
    model = tiny_model(arch, num_hidden_layers=3)[0]
    doc = _doc(1, 24)
    s = {m: EditSession(model, doc) for m in ("full", "pie", "naive", "pie+k")}
    for m, sess in s.items():
        sess.apply(EDIT_SETS["multi"], "pie+k100" if m == "pie+k" else m)
    f0 = s["full"].cache.layers[0]
    p0 = s["pie"].cache.layers[0]
    assert (f0.keys - p0.keys).abs().max() < 1e-4 and (f0.values - p0.values).abs().max() < 1e-4
    # pie+k with k covering everything after the first edit is a full recomputation of that suffix
    assert (_probe(s["full"]) - _probe(s["pie+k"])).abs().max() < 1e-4
    err = {m: (_probe(s["full"]) - _probe(s[m])).abs().max().item() for m in ("pie", "naive")}
    assert err["pie"] < err["naive"], err


def test_full_equals_fresh_prefill():
    model = tiny_model("llama")[0]
    doc = _doc()
    sess = EditSession(model, doc)
    sess.apply(EDIT_SETS["multi"], "full")
    fresh = PositionedCache.from_model(model)
    extend(model, fresh, sess.ids[None])
    for a, b in zip(sess.cache.layers, fresh.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_naive_keeps_stale_positions():
    model = tiny_model("llama")[0]
    sess = EditSession(model, _doc())
    sess.apply([Insert(5, [9, 9, 9])], "naive")
    pos = sess.cache.positions[0].tolist()
    assert pos[5:8] == [5, 6, 7] and pos[8] == 5     # the suffix still starts at its old position: duplicates


def test_failed_edits_leave_the_session_untouched():
    model = tiny_model("llama")[0]
    sess = EditSession(model, _doc())
    ids, cache = sess.ids.clone(), sess.cache
    with pytest.raises(ValueError, match=r"edits\[0\]: expected 0 <= start <= end <= len\(doc\)=20, got start=5, end=25"):
        sess.apply([Delete(5, 25)])
    with pytest.raises(ValueError, match=r"edits: expected non-overlapping edits, got \[3, 6\) and \[5, 8\)"):
        sess.apply([Delete(3, 6), Replace(5, 8, [1])])
    with pytest.raises(ValueError, match="edits: expected non-overlapping edits"):
        sess.apply([Insert(4, [1]), Insert(4, [2])])
    with pytest.raises(ValueError, match=r"strategy: expected full \| prefix \| naive"):
        sess.apply([Insert(4, [1])], "fast")
    with pytest.raises(ValueError, match="edit: expected start <= end, got start=5, end=3"):
        Replace(5, 3, [1])
    with pytest.raises(TypeError, match=r"edit ids\[0\]: expected an int, got str"):
        Insert(2, ["a"])
    with pytest.raises(ValueError, match="generate cursor: expected 1 <= cursor <= len"):
        sess.generate(cursor=0)
    assert torch.equal(sess.ids, ids) and sess.cache is cache


def test_generate_from_a_cursor_matches_a_fresh_prefix():
    model = tiny_model("qwen2")[0]
    doc = _doc(4, 30)
    sess = EditSession(model, doc)
    got = sess.generate(max_new_tokens=5, cursor=18)
    want = model.generate(doc[None, :18], max_new_tokens=5, do_sample=False)[0, 18:]
    assert got.tolist() == want.tolist()
    assert sess.length == 30 and sess.cache.num_slots == 30


def test_edit_helpers():
    ids = list(range(10))
    e = [Insert(2, [100]), Delete(5, 7)]
    assert apply_edits(ids, e) == [0, 1, 100, 2, 3, 4, 7, 8, 9]
    assert apply_edits(ids, diff_tokens(ids, [0, 1, 100, 2, 3, 4, 7, 8, 9])) == [0, 1, 100, 2, 3, 4, 7, 8, 9]
    assert widen(ids, [Insert(2, [100])], 3) == [Replace(2, 5, (100, 2, 3, 4))]
    # widening stops at the next edit, which widens on its own
    assert widen(ids, [Insert(2, [100]), Delete(4, 5)], 3) == [Replace(2, 4, (100, 2, 3)), Replace(4, 8, (5, 6, 7))]
    for k in (0, 1, 2, 5, 50):
        es = [Insert(3, [50]), Delete(8, 10), Replace(14, 15, [60, 61])]
        assert apply_edits(range(20), widen(range(20), es, k)) == apply_edits(range(20), es)
    p = plan(10, normalize(e, 10))
    assert [(x.kind, x.new_start, x.length) for x in p] == [("keep", 0, 2), ("new", 2, 1), ("keep", 3, 3),
                                                             ("keep", 6, 3)][:2] + [("keep", 3, 3), ("keep", 6, 3)]
    assert p[-1].shift == -1


def test_with_tail_merges_edits_reaching_the_tail():
    ids = list(range(10))
    assert with_tail(ids, [Insert(2, [100])], 3) == [Insert(2, [100]), Replace(7, 10, (7, 8, 9))]
    # an edit inside the tail region merges with it into one replace up to the end
    assert with_tail(ids, [Delete(8, 9)], 4) == [Replace(6, 10, (6, 7, 9))]
    assert with_tail(ids, [Replace(5, 7, [50])], 4) == [Replace(5, 10, (50, 7, 8, 9))]
    assert with_tail(ids, [Insert(10, [99])], 2) == [Replace(8, 10, (8, 9, 99))]
    for t in (0, 1, 3, 9, 10, 50):
        es = [Insert(3, [50]), Delete(8, 10), Replace(14, 15, [60, 61])]
        assert apply_edits(range(20), with_tail(range(20), es, t)) == apply_edits(range(20), es)
    with pytest.raises(ValueError, match="with_tail t"):
        with_tail(ids, [], -1)


def test_tail_covering_the_document_equals_full_on_a_deeper_model():
    model = tiny_model("llama", num_hidden_layers=3)[0]
    doc = _doc(2, 24)
    full, tail, pie = EditSession(model, doc), EditSession(model, doc), EditSession(model, doc)
    full.apply(EDIT_SETS["multi"], "full")
    tail.apply(EDIT_SETS["multi"], "pie", tail=100)
    pie.apply(EDIT_SETS["multi"], "pie")
    assert (_probe(full) - _probe(tail)).abs().max() < 1e-4
    assert (_probe(full) - _probe(pie)).abs().max() > 1e-4      # plain PIE is not exact here: the test can tell
    with pytest.raises(ValueError, match="strategy tail: expected an int >= 0, got -2"):
        pie.apply([Insert(0, [3])], "pie", tail=-2)


@pytest.mark.parametrize("old,new", [
    ("def f(x):\n    return x+1\n", "def f(x):\n    return x + 1\n"),         # operator spacing retokenizes
    ("total = price * qty\n", "total = price * quantity\n"),               # identifier grows: token merge changes
    ("items = []\nfor i in range(3):\n    items.append(i)\n", "items = []\nfor i in range(30):\n    items.append(i)\n"),
    ("print('hello')\n", "print('hello world')\n"),
])
def test_text_level_diff_handles_tokenization_changes(default_model, old, new):
    model, tok = default_model
    sess = EditSession(model, tok(old).input_ids)
    r = sess.apply_text(tok, new, "pie")
    assert sess.ids.tolist() == tok(new).input_ids            # the document is exactly the new tokenization
    assert tok.decode(sess.ids) == new
    assert 0 < r.tokens_encoded < len(tok(new).input_ids)      # only the changed tokens were encoded
    full = EditSession(model, tok(new).input_ids)
    assert (_probe(full) - _probe(sess)).abs().max() < 50      # sanity: same document, finite logits


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("kind", list(EDIT_SETS))
@pytest.mark.parametrize("strategy", ["pie+blend", "pie+attn"])
def test_selective_repairs_with_ratio_one_equal_full(arch, kind, strategy):
    model = tiny_model(arch, num_hidden_layers=4)[0]
    doc = _doc(3, 24)
    full, rep = EditSession(model, doc), EditSession(model, doc)
    full.apply(EDIT_SETS[kind], "full")
    rep.apply(EDIT_SETS[kind], strategy, ratio=1.0, probe=3)
    assert (_probe(full) - _probe(rep)).abs().max() < 1e-4
    assert rep.cache.positions.tolist() == [list(range(rep.length))]


@pytest.mark.parametrize("strategy", ["pie+blend", "pie+attn"])
def test_selective_repairs_compose_with_a_tail(strategy):
    model = tiny_model("qwen3", num_hidden_layers=4)[0]
    doc = _doc(3, 24)
    full, rep, part = EditSession(model, doc), EditSession(model, doc), EditSession(model, doc)
    full.apply(EDIT_SETS["multi"], "full")
    rep.apply(EDIT_SETS["multi"], strategy, ratio=1.0, probe=3, tail=5)
    r = part.apply(EDIT_SETS["multi"], strategy, ratio=0.25, probe=3, tail=5)
    assert (_probe(full) - _probe(rep)).abs().max() < 1e-4
    assert (_probe(full) - _probe(part)).abs().max() > 1e-4     # a partial repair is not exact: the test can tell
    assert r.tokens_encoded > EditSession(model, doc).apply(EDIT_SETS["multi"], "pie", tail=5).tokens_encoded


def test_pie_blend_partial_ratio_lies_between_pie_and_full():
    model = tiny_model("llama", num_hidden_layers=4)[0]
    doc = _doc(4, 40)
    s = {m: EditSession(model, doc) for m in ("full", "pie", "pie+blend")}
    for m, sess in s.items():
        r = sess.apply(EDIT_SETS["multi"], m, ratio=0.5)
    # new doc: 42 tokens; stale = slots 4..41 (from the first kept token after Insert(3)) = 38; half carried + 5 new
    assert r.tokens_encoded == 5 + 19
    err = {m: (_probe(s["full"]) - _probe(s[m])).abs().max().item() for m in ("pie", "pie+blend")}
    assert err["pie+blend"] < err["pie"], err
    # layers 0-1 are refreshed for every stale token: they equal full's
    for i in (0, 1):
        f, b = s["full"].cache.layers[i], s["pie+blend"].cache.layers[i]
        assert (f.keys - b.keys).abs().max() < 1e-4 and (f.values - b.values).abs().max() < 1e-4


def test_pie_attn_ratio_zero_is_pie_with_the_probe_as_tail_and_more_ratio_gets_closer():
    model = tiny_model("llama", num_hidden_layers=4)[0]
    doc = _doc(6, 40)
    s = {m: EditSession(model, doc) for m in ("full", "tail", "a0", "a5", "pie")}
    s["full"].apply(EDIT_SETS["multi"], "full")
    s["pie"].apply(EDIT_SETS["multi"], "pie")
    s["tail"].apply(EDIT_SETS["multi"], "pie", tail=4)
    r0 = s["a0"].apply(EDIT_SETS["multi"], "pie+attn", ratio=0.0, probe=4)
    r5 = s["a5"].apply(EDIT_SETS["multi"], "pie+attn", ratio=0.5, probe=4)
    assert (_probe(s["tail"]) - _probe(s["a0"])).abs().max() < 1e-4
    # new doc: 42 tokens; stale = slots 4..41 (38); the last 4 are the probe; half of the other 34 are picked
    assert r0.tokens_encoded == 5 + 4 and r5.tokens_encoded == 5 + 4 + 17
    err = {m: (_probe(s["full"]) - _probe(s[m])).abs().max().item() for m in ("pie", "a5")}
    assert err["a5"] < err["pie"], err


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_attention_mass_matches_a_plain_eager_forward(arch):
    model = tiny_model(arch, num_hidden_layers=3)[0]
    doc = _doc(7, 30)
    sess = EditSession(model, doc)
    mass = attention_mass(model, sess.cache, 5, doc)
    prev = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        att = model(input_ids=doc[None].long(), output_attentions=True, use_cache=False).attentions
    finally:
        model.set_attn_implementation(prev)
    ref = torch.stack([a[0, :, 25:, :25].double().mean(dim=(0, 1)) for a in att]).mean(0)
    assert mass.shape == (25,)
    assert (mass.double() - ref).abs().max() < 1e-5
    assert sess.cache.num_slots == 30                         # the probe forward left the cache alone
    with pytest.raises(ValueError, match="attention_mass"):
        attention_mass(model, sess.cache, 0, doc)


def test_pie_attn_rejects_bad_probe_and_sliding_models():
    model = tiny_model("llama", num_hidden_layers=2)[0]
    sess = EditSession(model, _doc())
    before = sess.ids.clone()
    with pytest.raises(ValueError, match="strategy probe: expected an int >= 1, got 0"):
        sess.apply([Insert(3, [5])], "pie+attn", probe=0)
    assert torch.equal(sess.ids, before)
    gemma = tiny_model("gemma3", num_hidden_layers=2)[0]
    with pytest.raises(ValueError, match="strategy pie\\+attn10: expected a model with full-attention layers only"):
        EditSession(gemma, _doc()).apply([Insert(3, [5])], "pie+attn")


def test_pie_blend_rejects_bad_ratio_and_sliding_models():
    model = tiny_model("llama", num_hidden_layers=2)[0]
    sess = EditSession(model, _doc())
    before = sess.ids.clone()
    with pytest.raises(ValueError, match=r"strategy ratio: expected a fraction in \[0, 1\], got 1.5"):
        sess.apply([Insert(2, [3])], "pie+blend", ratio=1.5)
    assert torch.equal(sess.ids, before)
    g = EditSession(tiny_model("gemma3", num_hidden_layers=2)[0], _doc())
    with pytest.raises(ValueError, match="strategy pie\\+blend10: expected a model with full-attention layers only"):
        g.apply([Insert(2, [3])], "pie+blend")
    gemma1 = EditSession(tiny_model("gemma", num_hidden_layers=2)[0], _doc())      # full attention, scaled embeddings
    with pytest.raises(ValueError, match="selective recompute .CacheBlend. model: expected no embedding scaling"):
        gemma1.apply([Insert(2, [3])], "pie+blend")
    assert gemma1.length == 20
    assert g.length == 20


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
@pytest.mark.parametrize("kind", list(EDIT_SETS))
def test_prefix_strategy_is_exact_and_encodes_only_what_follows_the_first_edit(arch, kind):
    over = {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]} \
        if arch == "gemma3" else {}
    model = tiny_model(arch, num_hidden_layers=3, **over)[0]
    doc = _doc(5, 24)
    full, pre = EditSession(model, doc), EditSession(model, doc)
    full.apply(EDIT_SETS[kind], "full")
    r = pre.apply(EDIT_SETS[kind], "prefix")
    assert (_probe(full) - _probe(pre)).abs().max() < 1e-4
    first = min(e.start for e in EDIT_SETS[kind])
    assert r.tokens_encoded == pre.length - first and r.tokens_reused == first
    assert pre.cache.positions.tolist() == [list(range(pre.length))]


def test_auto_picks_prefix_when_little_follows_the_first_edit_and_pie_otherwise():
    model = tiny_model("llama", num_hidden_layers=2)[0]
    doc = _doc(6, 40)
    near = EditSession(model, doc).apply([Insert(36, [5, 6])], "auto+r8+k2+tail3+c0")
    far = EditSession(model, doc).apply([Insert(3, [5, 6])], "auto+r8+k2+tail3+c0")
    assert near.strategy == "auto+r8+k2+tail3->prefix" and near.tokens_encoded == 42 - 36
    assert far.strategy == "auto+r8+k2+tail3->pie+k2+tail3"
    full, auto = EditSession(model, doc), EditSession(model, doc)
    full.apply([Insert(36, [5, 6])], "full")
    auto.apply([Insert(36, [5, 6])], "auto+r8")
    assert (_probe(full) - _probe(auto)).abs().max() < 1e-4          # the prefix branch is exact


def test_auto_cover_recomputes_everything_after_the_last_edit():
    model = tiny_model("llama", num_hidden_layers=3)[0]
    doc = _doc(8, 40)
    edits = [Insert(4, [7, 8]), Replace(30, 32, [9])]
    full, auto = EditSession(model, doc), EditSession(model, doc)
    full.apply(edits, "full")
    r = auto.apply(edits, "auto+r0+k0+tail2+c12")
    assert r.strategy == "auto+r0+k0+tail2+c12->pie+tail10"      # 40 - 30 tokens from the last edit on
    ref = EditSession(model, doc)
    ref.apply(edits, "pie+tail10")
    assert (_probe(ref) - _probe(auto)).abs().max() == 0


def test_pie_tokens_counts_what_the_session_encodes():
    """pie_tokens (positions only) equals the tokens a pie+k+tail update re-encodes, edits inside the tail merged."""
    model = tiny_model("llama", num_hidden_layers=2)[0]
    doc = _doc(9, 60)
    for edits in ([Insert(5, [1, 2, 3])], [Delete(10, 14), Insert(40, [7])], [Replace(50, 52, [4]), Insert(8, [5])]):
        for k, tail in ((0, 0), (4, 0), (0, 9), (6, 25), (3, 60)):
            r = EditSession(model, doc).apply(edits, f"pie+k{k}+tail{tail}" if k else f"pie+tail{tail}")
            assert pie_tokens(60, normalize(edits, 60), k, tail) == r.tokens_encoded, (edits, k, tail)


def test_auto_budget_takes_the_longest_tail_that_fits_or_prefix():
    """auto+b<B>: the longest tail whose PIE tokens stay within B% of prefix's; prefix when the shortest tail does
    not fit; the choice is exact arithmetic on positions, checked against pie_tokens by brute force."""
    n = 1000
    far, near = [Insert(100, [1] * 10)], [Insert(900, [1] * 10)]
    s = Strategy.parse("auto+k8+tail16+b30")
    assert (s.prefix_max, s.k, s.tail, s.cover, s.budget) == (0, 8, 16, 0, 0.3)
    assert str(s) == "auto+r0+k8+tail16+b30"
    got = s.resolve(n, far)
    cap = 0.3 * (n + 10 - 100)
    best = max(t for t in range(16, n + 1) if pie_tokens(n, far, 8, t) <= cap)
    assert got == Strategy("pie", k=8, tail=best) and pie_tokens(n, far, 8, best + 1) > cap
    assert s.resolve(n, near) == Strategy("prefix")                   # 10 + 8 + 16 > 0.3 x 110
    assert Strategy.parse("auto+b35").tail == 128 and Strategy.parse("auto+r64+b35").prefix_max == 64
    model = tiny_model("llama", num_hidden_layers=2)[0]
    doc = _doc(6, 40)
    r = EditSession(model, doc).apply([Insert(3, [5, 6])], "auto+k2+tail3+b50")
    assert r.strategy.startswith("auto+r0+k2+tail3+b50->pie+k2+tail") and r.tokens_encoded <= 0.5 * (42 - 3)


@pytest.mark.parametrize("spec, match", [("auto+c8+b30", "without \\+c"), ("pie+b30", "expected"),
                                         ("auto+b0", "1..99"), ("auto+b100", "1..99")])
def test_auto_budget_refusals(spec, match):
    with pytest.raises(ValueError, match=match):
        Strategy.parse(spec)
    with pytest.raises(ValueError, match="strategy budget: expected a fraction in \\[0, 1\\)"):
        Strategy("auto", budget=1.5)


def _plain_margins(model, ids, gen):
    """Each greedy step's log p top-1 - log p top-2 from transformers' own forward over the whole sequence."""
    seq = torch.cat([ids, gen])
    with torch.no_grad():
        logits = model(seq[None]).logits[0].double()
    out = []
    for j in range(len(gen)):
        top = torch.log_softmax(logits[len(ids) - 1 + j], -1).topk(2).values
        out.append(float(top[0] - top[1]))
    return out


def test_margin_watch_records_the_greedy_gap_and_stops_below_its_floor():
    from kvpos.integrations.hf import MarginWatch
    model = tiny_model("llama", num_hidden_layers=2)[0]
    doc = _doc(11, 30)
    sess = EditSession(model, doc)
    watch = MarginWatch()
    gen = sess.generate(max_new_tokens=8, **watch.gen_kwargs({}))
    want = _plain_margins(model, doc, gen)
    assert len(watch.margins) == len(gen) == 8 and not watch.low
    assert max(abs(a - b) for a, b in zip(watch.margins, want)) < 1e-4
    floor = sorted(want)[len(want) // 2] + 1e-6          # about half the steps fall below it
    first_low = next(j for j, m in enumerate(want) if m < floor)
    stopped = MarginWatch(floor)
    short = sess.generate(max_new_tokens=8, **stopped.gen_kwargs({}))
    assert stopped.low and short.tolist() == gen[:first_low + 1].tolist()
    with pytest.raises(ValueError, match="MarginWatch floor: expected a finite number of nats >= 0"):
        MarginWatch(-1.0)


def test_complete_trusts_pie_above_the_floor_and_recomputes_exactly_below_it():
    model = tiny_model("llama", num_hidden_layers=3)[0]
    doc = _doc(12, 40)
    edits = [Insert(3, [5, 6]), Delete(10, 12)]
    ref = EditSession(model, doc)
    ref.apply(edits, "full")
    exact = ref.generate(max_new_tokens=6)
    pie = EditSession(model, doc)
    pie.apply(edits, "pie")
    approx = pie.generate(max_new_tokens=6)

    never = EditSession(model, doc).complete(edits, "pie", min_margin=0.0, max_new_tokens=6)
    assert not never.fell_back and never.ids.tolist() == approx.tolist() and never.first is None
    sess = EditSession(model, doc)
    always = sess.complete(edits, "pie", min_margin=1e6, max_new_tokens=6)
    assert always.fell_back and always.update.strategy == "prefix" and always.first.strategy == "pie"
    assert always.ids.tolist() == exact.tolist()
    assert torch.equal(sess.ids, ref.ids) and sess.cache.num_slots == ref.length
    assert always.cost_s >= always.first.update_s + always.update.update_s
    assert always.tokens_encoded == always.first.tokens_encoded + always.update.tokens_encoded
    assert len(always.margins) == 6
    # exact updates are never gated, whatever the floor
    pre = EditSession(model, doc).complete(edits, "prefix", min_margin=1e6, max_new_tokens=6)
    assert not pre.fell_back and pre.ids.tolist() == exact.tolist()


def test_complete_refuses_bad_arguments_and_leaves_the_session_as_it_was():
    model = tiny_model("llama", num_hidden_layers=2)[0]
    sess = EditSession(model, _doc(13, 30))
    ids, cache = sess.ids.clone(), sess.cache
    edits = [Insert(3, [5, 6])]
    with pytest.raises(ValueError, match="complete min_margin: expected a number of nats >= 0"):
        sess.complete(edits, "pie", min_margin=-1)
    with pytest.raises(ValueError, match="complete do_sample: expected greedy decoding"):
        sess.complete(edits, "pie", min_margin=0.1, do_sample=True)
    with pytest.raises(ValueError, match="strategy: expected full"):
        sess.complete(edits, "pie", min_margin=0.1, fallback="exact")
    with pytest.raises(TypeError):                               # generate fails after the update: rolled back
        sess.complete(edits, "pie", min_margin=0.0, stopping_criteria=[object()])
    assert torch.equal(sess.ids, ids) and sess.cache is cache
