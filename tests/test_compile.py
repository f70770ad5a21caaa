"""torch.compile: PositionedCache decodes without graph breaks and with no more graphs than DynamicCache; the
fixed-capacity cache compiles with fullgraph=True like StaticCache. Graphs and breaks are counted with dynamo's own
counters (a CompileCounter backend: dynamo's tracing, guards and graph splitting are the same as with inductor; the
backend only runs the captured graphs eagerly, which keeps the tests fast). Tokens are compared with the reference
cache under the same compiled forward.
"""
import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from transformers import DynamicCache, StaticCache

from kvpos.integrations.hf import PositionedCache, generate
from kvpos.integrations.hf.testing import TINY_ARCHS, tiny_model

STEPS = 64
PROMPT = 20
# GPT-NeoX and StableLM do not pass position_ids to the cache: their compiled forward is refused (test below)
NO_CACHE_POSITIONS = ("gpt_neox", "stablelm")
COMPILED_ARCHS = [a for a in TINY_ARCHS if a not in NO_CACHE_POSITIONS]


def _prefill(model, cache, ids):
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)


def _compiled_decode(model, cache, first, steps=STEPS, fullgraph=False, between=None):
    """Greedy decode `steps` tokens through torch.compile(model.forward); returns (tokens, graphs, breaks,
    graphs after the third step). between(i) runs eagerly before step i (position operations)."""
    dynamo.reset()
    counters.clear()
    cc = CompileCounter()
    fwd = torch.compile(model.forward, backend=cc, fullgraph=fullgraph)
    nxt, toks, early = first, [], None
    with torch.no_grad():
        for i in range(steps):
            if between is not None:
                between(i)
            nxt = fwd(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            toks.append(int(nxt))
            if i == 2:
                early = cc.frame_count
    breaks = sum(counters["graph_break"].values())
    if breaks:
        print("graph breaks:", *list(counters["graph_break"])[:3], sep="\n")
    return toks, cc.frame_count, breaks, early


def _eager_decode(model, cache, first, steps, between=None):
    """The same greedy loop as `_compiled_decode`, without torch.compile; returns the tokens."""
    nxt, toks = first, []
    with torch.no_grad():
        for i in range(steps):
            if between is not None:
                between(i)
            nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            toks.append(int(nxt))
    return toks


def _ids(model, n=PROMPT, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size - 3, (1, n), generator=g)


@pytest.mark.parametrize("arch", COMPILED_ARCHS)
def test_compiled_decode_has_no_breaks_and_no_more_graphs_than_dynamic_cache(arch):
    model, cfg = tiny_model(arch)
    ids = _ids(model)
    dyn = DynamicCache(config=cfg)
    ref, g_dyn, b_dyn, _ = _compiled_decode(model, dyn, _prefill(model, dyn, ids))
    for storage in ("rotated", "raw"):
        pos = PositionedCache.from_model(model, storage=storage)
        first = _prefill(model, pos, ids)
        pos.reserve_(PROMPT + STEPS)
        toks, g_pos, b_pos, early = _compiled_decode(model, pos, first)
        assert b_pos == 0 == b_dyn, (storage, b_pos, b_dyn)
        assert g_pos <= g_dyn, (storage, g_pos, g_dyn)
        assert g_pos == early, f"{storage}: recompiled after step 3 ({early} -> {g_pos} graphs)"
        assert toks == ref, storage
        assert pos.num_slots == PROMPT + STEPS


def test_growth_inside_compiled_decode_costs_one_graph_once():
    """Without reserve_, buffers regrow inside compiled forwards: one more graph for the growth branch, then the
    (symbolic) capacity reuses it at every later growth."""
    model, cfg = tiny_model("llama")
    ids = _ids(model)
    dyn = DynamicCache(config=cfg)
    ref, g_dyn, _, _ = _compiled_decode(model, dyn, _prefill(model, dyn, ids), steps=200)
    for storage in ("rotated", "raw"):     # raw grows in small steps: many growths, still one graph
        pos = PositionedCache.from_model(model, storage=storage)
        toks, g_pos, b_pos, _ = _compiled_decode(model, pos, _prefill(model, pos, ids), steps=200)
        assert b_pos == 0 and toks == ref
        assert g_pos <= g_dyn + 1, (storage, g_pos, g_dyn)


def test_position_operations_between_compiled_forwards_match_eager():
    model, _ = tiny_model("llama")
    ids = _ids(model)

    def run(compiled):
        pos = PositionedCache.from_model(model)
        first = _prefill(model, pos, ids)
        pos.reserve_(PROMPT + 40)

        def between(i):
            if i == 10:
                pos.shift_(0, 8, 100)

        if compiled:
            toks, _, breaks, _ = _compiled_decode(model, pos, first, steps=30, between=between)
            assert breaks == 0
            return toks, pos
        return _eager_decode(model, pos, first, 30, between), pos

    (a, ca), (b, cb) = run(True), run(False)
    assert a == b and torch.equal(ca.positions, cb.positions)
    assert torch.equal(ca.layers[1].keys, cb.layers[1].keys)


def test_fixed_capacity_compiles_with_fullgraph_and_matches_static_cache():
    model, cfg = tiny_model("llama")
    ids = _ids(model)
    st = StaticCache(config=cfg, max_cache_len=128)
    ref, g_st, b_st, _ = _compiled_decode(model, st, _prefill(model, st, ids), fullgraph=True)
    fixed = PositionedCache.from_model(model, capacity=128)
    first = _prefill(model, fixed, ids)
    assert fixed.layers[0].capacity == 128 and fixed.is_compileable
    bufs = [l.rot_k.data_ptr() for l in fixed.layers]
    toks, g_fx, b_fx, early = _compiled_decode(model, fixed, first, fullgraph=True)
    assert b_fx == 0 and toks == ref
    assert g_fx == early == 1 <= g_st, (g_fx, early, g_st)   # the slot count is a tensor: one graph, no recompile
    assert [l.rot_k.data_ptr() for l in fixed.layers] == bufs, "a fixed-capacity cache never reallocates"
    assert fixed.num_slots == PROMPT + STEPS


def test_fixed_capacity_position_operations_between_compiled_forwards():
    model, cfg = tiny_model("qwen2")
    ids = _ids(model)

    def run(compiled, capacity=96):
        c = PositionedCache.from_model(model, capacity=capacity)
        first = _prefill(model, c, ids)

        def between(i):
            if i == 5:
                c.shift_(0, 10, 50)
            if i == 15:
                c.delete_(3, 6)

        if compiled:
            toks, g, b, _ = _compiled_decode(model, c, first, steps=30, fullgraph=True, between=between)
            assert b == 0
            return toks, c
        return _eager_decode(model, c, first, 30, between), c

    (a, ca), (b, cb) = run(True), run(False)
    assert a == b
    assert torch.equal(ca.positions, cb.positions)
    # and the growing cache gives the same tokens eagerly (capacity changes nothing but shapes)
    assert run(False, capacity=None)[0] == a


def test_fixed_capacity_generate_and_logits_equal_dynamic_cache():
    model, cfg = tiny_model("llama")
    ids = _ids(model, 12)
    kw = dict(max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=None)
    ref = model.generate(ids, cache=DynamicCache(config=cfg), **kw)
    fixed = PositionedCache.from_model(model, capacity=64)
    got = model.generate(ids, cache=fixed, **kw)
    assert got.sequences.tolist() == ref.sequences.tolist()
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) < 1e-4
    fixed.shift_(0, 4, 30)
    more = generate(model, fixed, torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert more.shape == (1, 6) and fixed.num_slots == (12 + 19) + (2 + 3)   # the last token of each call is not cached


def test_fixed_capacity_compiles_inside_generate_the_transformers_way():
    """generate(compile_config=...) compiles the decode steps of a compileable cache (fullgraph, static shapes,
    dynamic=False): the fixed-capacity cache goes through it with DynamicCache's tokens, and the eager view of the
    cache afterwards (slot count, positions, keys) is what an eager generate leaves."""
    from transformers.generation.configuration_utils import CompileConfig

    model, cfg = tiny_model("qwen3")
    ids = _ids(model, 12)
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    ref = model.generate(ids, cache=DynamicCache(config=cfg), **kw)
    eager = PositionedCache.from_model(model, capacity=64)
    model.generate(ids, cache=eager, **kw)
    cc = CompileConfig(fullgraph=True, backend="eager", dynamic=False)
    cc._compile_all_devices = True                 # transformers compiles on accelerators only unless told
    fixed = PositionedCache.from_model(model, capacity=64)
    dynamo.reset()
    got = model.generate(ids, cache=fixed, compile_config=cc, **kw)
    assert got.tolist() == ref.tolist()
    assert getattr(model, "_compiled_call", None) is not None, "generate did not compile"
    assert fixed.num_slots == eager.num_slots == 12 + 23
    assert torch.equal(fixed.positions, eager.positions)
    assert torch.allclose(fixed.layers[1].keys, eager.layers[1].keys, atol=1e-5)   # a 4-D mask path: rounding
    # the raw keys of compiled slots are un-rotated on the first eager access: equal to the eager write path's
    assert torch.allclose(fixed.layers[1].raw_keys, eager.layers[1].raw_keys, atol=1e-5)
    fixed.shift_(0, 6, 9)                                 # position operations after compiled steps
    assert fixed.positions[0, :6].tolist() == list(range(9, 15))


def test_fixed_capacity_refusals_leave_the_cache_unchanged():
    model, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="capacity"):
        PositionedCache.from_model(model, capacity=0)
    with pytest.raises(ValueError, match="storage='raw'"):
        PositionedCache.from_model(model, capacity=64, storage="raw")
    with pytest.raises(TypeError, match="capacity"):
        PositionedCache.from_model(model, capacity=64.0)
    c = PositionedCache.from_model(model, capacity=24)
    _prefill(model, c, _ids(model, 20))
    before = c.positions.clone()
    with pytest.raises(ValueError, match="at most 24 slots"):
        with torch.no_grad():
            model(_ids(model, 5, seed=1), cache=c, use_cache=True)
    assert c.num_slots == 20 and torch.equal(c.positions, before)
    with pytest.raises(ValueError, match="at most 24 slots"):
        c.reserve_(25)
    cp = c.copy()
    assert cp.capacity == 24 and cp.layers[0].capacity == 24
    assert torch.equal(cp.layers[0].values, c.layers[0].values)


@pytest.mark.parametrize("arch", NO_CACHE_POSITIONS)
def test_compiled_forward_of_a_model_without_cache_positions_is_refused_clearly(arch):
    """GPT-NeoX and StableLM do not hand position_ids to the cache; inside a compiled forward the cache cannot read
    them from the rotary module either: an error that says so, never a cache at wrong positions."""
    model, cfg = tiny_model(arch)
    pos = PositionedCache.from_model(model)
    first = _prefill(model, pos, _ids(model))
    with pytest.raises(ValueError, match="torch.compile"):
        _compiled_decode(model, pos, first, steps=2)
    assert pos.num_slots == PROMPT


def test_compiled_decode_on_the_real_model(default_model):
    """SmolLM2: graphs and breaks, PositionedCache against DynamicCache, and the fixed-capacity cache against
    StaticCache with fullgraph=True, same greedy tokens."""
    model, tok = default_model
    ids = tok("def fibonacci(n):\n    ", return_tensors="pt").input_ids
    T = ids.shape[1]
    dyn = DynamicCache(config=model.config)
    ref, g_dyn, b_dyn, _ = _compiled_decode(model, dyn, _prefill(model, dyn, ids))
    pos = PositionedCache.from_model(model)
    first = _prefill(model, pos, ids)
    pos.reserve_(T + STEPS)
    toks, g_pos, b_pos, early = _compiled_decode(model, pos, first)
    assert b_pos == 0 == b_dyn and g_pos <= g_dyn and g_pos == early and toks == ref
    fixed = PositionedCache.from_model(model, capacity=T + STEPS)
    toks, g_fx, b_fx, early = _compiled_decode(model, fixed, _prefill(model, fixed, ids), fullgraph=True)
    assert b_fx == 0 and g_fx == early and toks == ref


def test_pytree_round_trip_and_torch_export_with_the_cache_as_input():
    """register_pytree makes a PositionedCache a torch pytree node: flatten / unflatten keep every slot, and
    torch.export takes the cache as an input; the exported program's logits and returned cache equal eager ones."""
    import torch.utils._pytree as pytree

    from kvpos.integrations.hf import register_pytree

    register_pytree()
    register_pytree()                                   # idempotent
    model, _ = tiny_model("llama")
    c = PositionedCache.from_model(model)
    _prefill(model, c, _ids(model))
    c.shift_(0, 5, 40)
    c.hide_(6, 8)
    leaves, spec = pytree.tree_flatten({"cache": c})
    back = pytree.tree_unflatten(leaves, spec)["cache"]
    assert back.num_slots == c.num_slots and torch.equal(back.positions, c.positions)
    assert torch.equal(back.visible, c.visible) and torch.equal(back.layers[1].keys, c.layers[1].keys)
    assert torch.equal(back.layers[1].raw_keys, c.layers[1].raw_keys)

    nxt = torch.tensor([[7]])
    mask = c.attention_mask(1)
    ep = torch.export.export(model, (), {"input_ids": nxt, "cache": c.copy(), "attention_mask": mask,
                                          "use_cache": True}, strict=False)
    eager = c.copy()
    with torch.no_grad():
        ref = model(input_ids=nxt, cache=eager, attention_mask=mask, use_cache=True)
        got = ep.module()(input_ids=nxt, cache=c.copy(), attention_mask=mask, use_cache=True)
    assert (got.logits - ref.logits).abs().max().item() < 1e-5
    out = got.cache
    assert isinstance(out, PositionedCache) and out.num_slots == eager.num_slots == c.num_slots + 1
    assert torch.equal(out.positions, eager.positions) and torch.equal(out.visible, eager.visible)
    assert torch.allclose(out.layers[0].keys, eager.layers[0].keys, atol=1e-6)
    out.shift_(0, 3, 7)                                 # the returned cache is a working cache
    with pytest.raises(ValueError, match="capacity"):
        pytree.tree_flatten(PositionedCache.from_model(model, capacity=32))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_compiled_decode_past_the_fixed_capacity_raises_naming_it_and_changes_nothing(fullgraph):
    """Past its capacity a compiled forward writes only into the overflow slot and raises a RuntimeError that names
    the capacity (not an out-of-bounds index from generated C++); the cache keeps its C slots."""
    model, _ = tiny_model("llama")
    c = PositionedCache.from_model(model, capacity=PROMPT + 2)
    first = _prefill(model, c, _ids(model))
    fwd = torch.compile(model.forward, fullgraph=fullgraph)
    nxt = first
    with torch.no_grad():
        for _ in range(2):
            nxt = fwd(input_ids=nxt, cache=c, use_cache=True).logits[:, -1:].argmax(-1)
        before = (c.num_slots, c.positions.clone(), c.layers[0].keys.clone(), c.layers[1].values.clone())
        # RuntimeError from the compiled graph; ValueError where dynamo runs the step eagerly (a recompile limit)
        with pytest.raises((RuntimeError, ValueError), match=f"at most {PROMPT + 2} slots \\(its capacity\\)"):
            fwd(input_ids=nxt, cache=c, use_cache=True)
    assert c.num_slots == before[0] == PROMPT + 2 and torch.equal(c.positions, before[1])
    assert torch.equal(c.layers[0].keys, before[2]) and torch.equal(c.layers[1].values, before[3])
