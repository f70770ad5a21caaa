"""AttnRank: the attention-basin profile and the document orders (kvpos.ordering), and the question's attention mass
per document (integrations/attnrank.py) against transformers' own eager attention weights."""
import copy

import pytest
import torch

from kvpos.ordering import AttentionBasin, lim_order, order_for, place
from kvpos.integrations.attnrank import segment_mass
from kvpos.integrations.hf import PositionedCache, extend
from kvpos.integrations.hf.testing import tiny_model


def test_the_basin_is_the_shallowest_layer_whose_edges_draw_tau_times_the_interior():
    flat = torch.ones(5)
    u = torch.tensor([4.0, 1.0, 1.0, 1.0, 2.0])              # edges 4 and 2, interior 1: edge ratio 2
    basin = AttentionBasin(5)
    for _ in range(3):
        basin.add(torch.stack([flat, u, u * torch.tensor([1, 1, 1, 1, 2.0])]))
    assert torch.allclose(basin.edge_ratio(), torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64))
    assert basin.basin_layer(1.5) == 1 and basin.basin_layer(3.0) == 2
    assert basin.slot_order() == [0, 4, 1, 2, 3]             # most read slot first (ties by slot)
    assert torch.allclose(basin.profile().sum(1), torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"AttentionBasin.add mass: expected \[L, n=5\]"):
        basin.add(torch.ones(3, 4))


def test_orders_place_the_ranked_documents_where_each_rule_says():
    docs = ["best", "2nd", "3rd", "4th", "5th"]
    assert place(docs, order_for("descending", 5)) == docs
    assert place(docs, order_for("ascending", 5)) == docs[::-1]
    assert place(docs, lim_order(5)) == ["best", "3rd", "5th", "4th", "2nd"]      # LangChain's LongContextReorder
    assert sorted(place(docs, order_for("random", 5, seed=3))) == sorted(docs)
    basin = AttentionBasin(5)
    basin.add(torch.tensor([[1.0, 3.0, 0.5, 0.2, 2.0]]))
    assert place(docs, order_for("attnrank", 5, basin, tau=99)) == ["3rd", "best", "4th", "5th", "2nd"]
    with pytest.raises(ValueError, match="place slot_order: expected a permutation of 0..4"):
        place(docs, [0, 0, 1, 2, 3])
    with pytest.raises(ValueError, match="order_for name: expected one of"):
        order_for("best", 5)


def test_segment_mass_equals_eager_attention_weights_of_the_question_rows():
    model = tiny_model("qwen2")[0]
    g = torch.Generator().manual_seed(4)
    anchor = torch.randint(3, 128, (4,), generator=g)
    docs = [torch.randint(3, 128, (n,), generator=g) for n in (6, 9, 5)]
    q = torch.randint(3, 128, (3,), generator=g)
    cache = PositionedCache.from_model(model)
    ctx = torch.cat([anchor, *docs])
    extend(model, cache, ctx[None])
    slots, s = [], anchor.numel()
    for d in docs:
        slots.append((s, s + d.numel()))
        s += d.numel()
    got = segment_mass(model, cache, slots, q)
    assert cache.num_slots == ctx.numel()                    # left as it was
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    att = eager(torch.cat([ctx, q])[None], output_attentions=True).attentions        # L x [1, Hq, T, T]
    want = torch.stack([torch.stack([a[0, :, -3:, s:e].sum(-1).mean() for s, e in slots]) for a in att])
    assert (got - want).abs().max() < 1e-5, (got, want)
