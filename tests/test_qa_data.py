"""The offline QA loaders read the bundled HotpotQA / SQuAD 2.0 dev sets as the datasets define them."""
import pytest

from kvpos.qa_data import hotpotqa_items, split_of, squad_items


def test_hotpotqa_items_have_ten_titled_paragraphs_with_the_supporting_ones_marked_gold():
    items = hotpotqa_items(None, split=None)
    assert len(items) == 7345                                   # dev questions with 10 paragraphs
    first = items[0]
    assert first["question"].startswith("Were Scott Derrickson and Ed Wood")
    assert first["answers"] == ["yes"] and len(first["paragraphs"]) == 10
    titles = [p.split(":")[0] for i, p in enumerate(first["paragraphs"]) if i in first["gold"]]
    assert sorted(titles) == ["Ed Wood", "Scott Derrickson"]
    assert all(len(x["gold"]) == 2 for x in items[:200])


def test_hotpotqa_items_with_borrowed_distractors_keep_their_own_paragraphs_in_order_and_gold_marked():
    plain = hotpotqa_items(50, split="heldout")
    more = hotpotqa_items(50, split="heldout", borrowed=12, seed=2)
    assert [x["id"] for x in more] == [x["id"] for x in plain]
    for p, m in zip(plain, more):
        assert len(m["paragraphs"]) == 22 and len(set(m["paragraphs"])) == 22
        assert [q for q in m["paragraphs"] if q in p["paragraphs"]] == p["paragraphs"]
        assert [m["paragraphs"][i] for i in m["gold"]] == [p["paragraphs"][i] for i in p["gold"]]
    assert {x["gold"][0] for x in more} != {x["gold"][0] for x in plain}     # the gold pair moves too
    assert hotpotqa_items(50, split="heldout", borrowed=0, seed=2) == plain


@pytest.mark.parametrize("hard", [False, True])
def test_squad_items_hold_the_gold_paragraph_among_k_distractors(hard):
    items = squad_items(300, k=9, hard=hard, split=None, seed=1)
    for x in items:
        assert len(x["paragraphs"]) == 10 and len(set(x["paragraphs"])) == 10
        gold = x["paragraphs"][x["gold"][0]]
        assert any(a in gold for a in x["answers"]), x["id"]
    titles = [[p.split(":")[0] for p in x["paragraphs"]] for x in items]
    own = [t[x["gold"][0]] for t, x in zip(titles, items)]
    same = sum(t.count(o) - 1 for t, o in zip(titles, own))
    assert (same == 9 * len(items)) if hard else same == 0     # hard: same-article distractors; easy: none


def test_splits_are_fixed_by_id_disjoint_and_about_a_fifth_calibration():
    cal, held = squad_items(None, split="calibration"), squad_items(None, split="heldout")
    assert not {x["id"] for x in cal} & {x["id"] for x in held}
    assert len(cal) + len(held) == 5928 and 0.15 < len(cal) / 5928 < 0.25
    assert all(split_of(x["id"]) == "calibration" for x in cal)
    assert [x["id"] for x in squad_items(5, seed=3)] == [x["id"] for x in squad_items(5, seed=4)]


@pytest.mark.parametrize("call, match", [
    (lambda: squad_items(split="test"), "squad_items split: expected 'calibration' or 'heldout'"),
    (lambda: squad_items(k=-1), "squad_items k: expected an int >= 0"),
    (lambda: hotpotqa_items(n=-2), "hotpotqa_items n: expected an int >= 0"),
    (lambda: hotpotqa_items(borrowed=-1), "hotpotqa_items borrowed: expected an int >= 0"),
])
def test_bad_requests_are_refused_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_answers_are_scored_as_squads_normalization_does():
    from kvpos.data import answer_correct, normalize_answer
    assert normalize_answer("The  Eiffel Tower, in Paris!") == "eiffel tower in paris"
    assert answer_correct("It is the Eiffel Tower.", ["Eiffel Tower"])
    assert answer_correct("1889", ["in 1887", "1889"]) and not answer_correct("1888", ["1889"])
    assert not answer_correct("anything", ["the", ""])              # a gold that normalizes to nothing never counts
    with pytest.raises(TypeError, match="answer_correct answers: expected a list"):
        answer_correct("x", "x")
