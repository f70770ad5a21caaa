"""Position operations: a property test against the float64 reference, atomicity, and every error message."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvpos import RopeLayout, RopeSpec
from kvpos.reference import rotate_ref
from kvpos.integrations.hf import PositionedCache, extend, generate
from kvpos.integrations.hf.testing import tiny_model

H, D, T0 = 2, 16, 24


def _specs(angle_dtype=torch.float32):
    inv = 1.0 / (10000.0 ** (torch.arange(0, 12, 2, dtype=torch.float32) / 12))
    a = RopeSpec(inv, 1.0, 12, D, RopeLayout.HALF, angle_dtype=angle_dtype)           # partial rotary
    b = RopeSpec(inv * 0.5, 1.1, 12, D, RopeLayout.INTERLEAVED, angle_dtype=angle_dtype)  # scaled, interleaved
    return [a, b, a]


def _cache(dtype=torch.float32, B=2, angle_dtype=torch.float32, seed=0, storage="rotated"):
    g = torch.Generator().manual_seed(seed)
    raws = [(torch.randn(B, H, T0, D, generator=g).to(dtype), torch.randn(B, H, T0, D, generator=g).to(dtype))
            for _ in range(3)]
    c = PositionedCache(_specs(angle_dtype), storage=storage)
    c.append_raw_(raws, torch.arange(T0))
    return c, raws


ops = st.one_of(
    st.tuples(st.just("shift"), st.integers(0, 30), st.integers(0, 30), st.integers(-40, 400)),
    st.tuples(st.just("set"), st.integers(0, 30), st.integers(0, 30), st.integers(0, 4000)),
    st.tuples(st.just("delete"), st.integers(0, 30), st.integers(0, 30), st.booleans()),
    st.tuples(st.just("keep"), st.integers(0, 10 ** 6), st.just(0), st.just(0)),
    st.tuples(st.just("hide"), st.integers(0, 30), st.integers(0, 30), st.just(0)),
)


def _apply_op(cache, ids, op):
    """Apply op to the cache and to a plain model of it (slot ids); return the model or None if invalid."""
    kind, a, b, c = op
    n = cache.num_slots
    a, b = min(a, b), max(a, b)
    try:
        if kind == "shift":
            cache.shift_(a, b, c)
        elif kind == "set":
            cache.set_positions_(a, b, torch.arange(c, c + b - a).flip(0))
        elif kind == "delete":
            cache.delete_(a, b, close_gap=c)
            ids = ids[:a] + ids[b:]
        elif kind == "keep":
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(a))[: max(1, n - 2)]
            cache.keep_(perm)
            ids = [ids[i] for i in perm.tolist()]
        else:
            cache.hide_(a, b)
    except ValueError:
        assert b > n or kind in ("shift", "delete"), f"unexpected refusal of {op} with T={n}"
    return ids


def _check(cache, raws, ids, tol_rel):
    pos = cache.positions
    assert cache.num_slots == len(ids)
    if not ids:
        return
    for li, (layer, (raw, _)) in enumerate(zip(cache.layers, raws)):
        want_raw = raw[:, :, ids]
        assert torch.equal(layer.raw_keys, want_raw), "raw keys must never change"
        ref = rotate_ref(want_raw, pos, layer.spec)
        err = (layer.keys.double() - ref).abs().max()
        assert err <= tol_rel * ref.abs().max() + 1e-6, f"layer {li}: {err}"


@settings(max_examples=40, deadline=None)
@given(st.lists(ops, min_size=1, max_size=8))
def test_random_operation_sequences_fp32(seq):
    cache, raws = _cache(angle_dtype=torch.float64)
    ids = list(range(T0))
    for op in seq:
        ids = _apply_op(cache, ids, op)
    _check(cache, raws, ids, tol_rel=2e-6)


@settings(max_examples=25, deadline=None)
@given(st.lists(ops, min_size=1, max_size=8))
def test_random_operation_sequences_fp32_angles_like_transformers(seq):
    cache, raws = _cache()
    ids = list(range(T0))
    for op in seq:
        ids = _apply_op(cache, ids, op)
    pmax = int(cache.positions.max()) if cache.num_slots else 0
    _check(cache, raws, ids, tol_rel=4 * (pmax + 1) * 2 ** -24 + 2e-6)  # float32 angle rounding grows with p


@settings(max_examples=25, deadline=None)
@given(st.lists(ops, min_size=1, max_size=8))
def test_random_operation_sequences_bf16_within_one_rounding(seq):
    cache, raws = _cache(dtype=torch.bfloat16, angle_dtype=torch.float64)
    ids = list(range(T0))
    for op in seq:
        ids = _apply_op(cache, ids, op)
    _check(cache, raws, ids, tol_rel=2 ** -8)


@settings(max_examples=30, deadline=None)
@given(st.lists(ops, min_size=1, max_size=8))
def test_random_operation_sequences_rotate_on_read(seq):
    """storage="raw": keys rotated at read time from the slot table equal the float64 reference after any ops."""
    cache, raws = _cache(angle_dtype=torch.float64, storage="raw")
    ids = list(range(T0))
    for op in seq:
        ids = _apply_op(cache, ids, op)
    _check(cache, raws, ids, tol_rel=2e-6)


def test_rotate_on_read_position_ops_write_no_key():
    """storage="raw": a position operation changes the slot table only; no key buffer is written or reallocated."""
    cache, _ = _cache(storage="raw")
    bufs = [[(b.data_ptr(), b._version) for b in l.buffers()] for l in cache.layers]
    cache.shift_(4, 20, 100)
    cache.set_positions_(0, 4, torch.arange(500, 504))
    assert [[(b.data_ptr(), b._version) for b in l.buffers()] for l in cache.layers] == bufs
    assert cache.positions[0, 4:8].tolist() == [104, 105, 106, 107]
    assert all(len(l.buffers()) == 2 for l in cache.layers)        # raw keys and values only


def test_many_moves_do_not_drift():
    cache, raws = _cache(dtype=torch.bfloat16, angle_dtype=torch.float64)
    for i in range(200):
        cache.shift_(0, T0, 7 if i % 2 == 0 else -3)
    _check(cache, raws, list(range(T0)), tol_rel=2 ** -8)
    assert int(cache.positions[0, 0]) == 400


def _snapshot(c):
    return (c.positions, c.visible, c.segments, [(l.keys.clone(), l.raw_keys.clone(), l.values.clone())
                                                 for l in c.layers])


def _same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    for x, y in zip(a[3], b[3]):
        assert all(torch.equal(p, q) for p, q in zip(x, y))


@pytest.mark.parametrize("call,exc,match", [
    (lambda c: c.shift_(5, 3, 1), ValueError, r"shift_: expected 0 <= start <= end <= T=24, got start=5, end=3"),
    (lambda c: c.shift_(0, 25, 1), ValueError, r"shift_: expected 0 <= start <= end <= T=24"),
    (lambda c: c.shift_(0, 4, -1), ValueError, r"shift_ \(delta=-1\): expected positions >= 0, got min -1"),
    (lambda c: c.shift_(0, 4, 1.5), TypeError, r"shift_ delta: expected an int"),
    (lambda c: c.shift_("a", 4, 1), TypeError, r"shift_ start: expected an int"),
    (lambda c: c.set_positions_(0, 4, [1, 2, 3]), ValueError, r"set_positions_ positions: expected 4 positions, shape \[S\]=4"),
    (lambda c: c.set_positions_(0, 2, torch.tensor([1.0, 2.0])), TypeError, r"expected integer positions"),
    (lambda c: c.set_positions_(0, 2, [-1, 2]), ValueError, r"expected positions >= 0, got min -1"),
    (lambda c: c.delete_(3, 30), ValueError, r"delete_: expected 0 <= start <= end <= T=24"),
    (lambda c: c.keep_([0, 0, 1]), ValueError, r"keep_ slots: expected distinct indices"),
    (lambda c: c.keep_([0, 99]), ValueError, r"keep_ slots: expected indices in \[0, 24\)"),
    (lambda c: c.keep_([[0]]), TypeError, r"keep_ slots\[0\]: expected an int slot index, got list"),
    (lambda c: c.keep_(torch.ones(2, 2, dtype=torch.long)), ValueError, r"keep_ slots: expected a 1-D index list"),
    (lambda c: c.hide_(0, 99), ValueError, r"hide_: expected 0 <= start <= end <= T=24"),
    (lambda c: c.set_segment_(0, 2, "x"), TypeError, r"set_segment_ label: expected an int"),
    (lambda c: c.append_raw_([], [0]), ValueError, r"append_raw_ kv: expected one \(raw_keys, values\) pair per layer"),
    (lambda c: c.append_raw_([(torch.zeros(2, H, 3, D), torch.zeros(2, H, 3, D))] * 3, [0, 1]), ValueError,
     r"append_raw_ positions: expected 3 positions, shape \[S\]=3"),
    (lambda c: c.append_raw_([(torch.zeros(2, H, 3, D), torch.zeros(2, H, 2, D))] * 3, [0, 1, 2]), ValueError,
     r"append_raw_ kv\[0\] values: expected \[2, H=2, S=3, Dv=16\], got \(2, 2, 2, 16\)"),
    (lambda c: c.append_raw_([(torch.zeros(2, 5, 3, D), torch.zeros(2, 5, 3, D))] * 3, [0, 1, 2]), ValueError,
     r"append_raw_ kv\[0\] raw_keys: expected \[B=2\|1, H=2, S=3, D=16\], got \(2, 5, 3, 16\)"),
    (lambda c: c.raw_kv(4, 2), ValueError, r"raw_kv: expected 0 <= start <= end"),
    (lambda c: c.crop(4), ValueError, r"crop tokens_to_remove: expected a negative count"),
])
def test_errors_name_the_argument_and_leave_the_cache_unchanged(call, exc, match):
    cache, _ = _cache()
    before = _snapshot(cache)
    with pytest.raises(exc, match=match):
        call(cache)
    _same(before, _snapshot(cache))


def test_position_ops_refused_in_the_middle_of_a_forward():
    cache, _ = _cache()
    cache.layers[1].n -= 1   # as if layer 1 had not yet received the current tokens
    with pytest.raises(ValueError, match="shift_: layer 1: expected 24 slots like the slot table, got 23"):
        cache.shift_(0, 2, 1)


def test_concat_refuses_other_rope():
    a, _ = _cache()
    inv = torch.ones(6)
    other = PositionedCache([RopeSpec(inv, 1.0, 12, D)] * 3)
    with pytest.raises(ValueError, match="concat caches\\[1\\] layer 0: expected the same RoPE spec"):
        PositionedCache.concat([a, other])


def test_positions_beyond_an_exact_range_are_refused_everywhere():
    model, _ = tiny_model("llama_dynamic")          # dynamic NTK: exact only below max_position_embeddings=64
    cache = PositionedCache.from_model(model)
    ids = torch.randint(3, 128, (1, 20))
    out = model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == 25
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=r"shift_ \(delta=60\): expected positions < 64 for rope_type='dynamic'"):
        cache.shift_(0, 10, 60)
    _same(before, _snapshot(cache))
    with pytest.raises(ValueError, match=r"positions < 64 for rope_type='dynamic'.*switches to other frequencies"):
        extend(model, cache, torch.randint(3, 128, (1, 3)), positions=torch.arange(62, 65))
    _same(before, _snapshot(cache))


def test_generate_and_extend_argument_errors():
    model, _ = tiny_model("llama")
    cache = PositionedCache.from_model(model)
    extend(model, cache, torch.randint(3, 128, (2, 5)))
    with pytest.raises(ValueError, match=r"generate new_ids: expected batch 2 \(the cache's\), got 1"):
        generate(model, cache, torch.randint(3, 128, (1, 2)))
    with pytest.raises(ValueError, match="generate position_ids: expected not given"):
        generate(model, cache, torch.randint(3, 128, (2, 2)), position_ids=torch.arange(2))
    with pytest.raises(TypeError, match="extend ids: expected a torch.Tensor"):
        extend(model, cache, [1, 2, 3])
    with pytest.raises(ValueError, match=r"extend ids: expected token ids \[B, S\]"):
        extend(model, cache, torch.ones(2, 3))
    with pytest.raises(ValueError, match="PositionedCache specs: expected a non-empty list with one RopeSpec per layer"):
        PositionedCache([])
    with pytest.raises(TypeError, match=r"PositionedCache specs\[0\]: expected a RopeSpec"):
        PositionedCache(["x"])


def test_adapter_error_paths():
    import transformers as T
    from transformers import DynamicCache

    from kvpos.integrations.hf import load_model

    with pytest.raises(ValueError, match="model: expected None, 'smollm2', 'gemma3', a .gguf path or a local model"):
        load_model("no/such/model")
    with pytest.raises(ValueError, match="model: expected an existing .gguf file"):
        load_model("/nonexistent/x.gguf")
    model, cfg = tiny_model("gemma3")  # sliding layer keeps only `sliding_window` keys in a DynamicCache
    dyn = DynamicCache(config=cfg)
    model(torch.randint(3, 128, (1, 12)), cache=dyn, use_cache=True)
    with pytest.raises(ValueError, match="from_dynamic layer 0: expected 12 cached keys"):
        PositionedCache.from_dynamic(model, dyn)
    model, cfg = tiny_model("llama")
    dyn = DynamicCache(config=cfg)
    model(torch.randint(3, 128, (1, 12)), cache=dyn, use_cache=True)
    conv = PositionedCache.from_dynamic(model, dyn)
    assert torch.equal(conv.layers[1].keys, dyn.layers[1].keys)
    from kvpos.integrations.hf import rope_specs_from_model
    cache = PositionedCache(rope_specs_from_model(model))    # no model bound: direct writes without a forward
    # a forward whose layers receive different numbers of tokens is refused, not silently mis-recorded
    cache.layers[0].update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), kwargs={"position_ids": torch.arange(3)[None]})
    with pytest.raises(ValueError, match="write layer 1: expected 3 new slots after 0 .what earlier layers of this forward wrote., got 4"):
        cache.layers[1].update(torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16),
                               kwargs={"position_ids": torch.arange(4)[None]})
    with pytest.raises(ValueError, match=r"cache.update layer 1: position_ids: expected \[B\|1, S\] = \[1\|1, 4\] for 4 new keys, got \(1, 3\)"):
        cache.layers[1].update(torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16),
                               kwargs={"position_ids": torch.arange(3)[None]})


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_extend_last_logits_equals_the_last_row_and_fills_the_same_cache(name):
    """last_logits=True runs the LM head on the last position only: its logits equal the last row of a plain extend,
    and the cache it fills equals the plain one (the head is not part of the KV)."""
    model, _ = tiny_model(name)
    ids = torch.randint(3, 128, (1, 9))
    plain, last = PositionedCache.from_model(model), PositionedCache.from_model(model)
    with torch.no_grad():
        a = extend(model, plain, ids)
        b = extend(model, last, ids, last_logits=True)
    assert a.shape[1] == 9 and b.shape[1] == 1
    torch.testing.assert_close(b[:, 0], a[:, -1])
    for la, lb in zip(plain.layers, last.layers):
        torch.testing.assert_close(la.raw_k[:, :, :9], lb.raw_k[:, :, :9])
        torch.testing.assert_close(la.v[:, :, :9], lb.v[:, :, :9])


def test_extend_last_logits_refuses_a_forward_without_logits_to_keep():
    from kvpos.integrations.hf.run import logits_kwargs

    def forward(input_ids, cache=None):
        return None

    assert logits_kwargs(forward, False) == {}
    with pytest.raises(ValueError, match="last_logits: expected a model whose forward takes logits_to_keep"):
        logits_kwargs(forward, True)


def _append_in_pieces(c, raws, cuts=(0, 5, 60, 130, 150)):
    """Append the slots of `raws` to `c` in pieces; returns the buffer addresses after the first piece."""
    first = None
    for s, e in zip(cuts, cuts[1:]):
        c.append_raw_([(k[:, :, s:e], v[:, :, s:e]) for k, v in raws], torch.arange(s, e))
        first = first or [l.value_store.data_ptr() for l in c.layers] + [c.table._pos.data_ptr()]
    return first


@pytest.mark.parametrize("storage", ["rotated", "raw", "int8"])
def test_reserve_before_the_first_slot_sizes_the_first_allocation(storage):
    """reserve_ on a cache with no slot yet (no buffer shapes known) is kept for the first allocation: appending up
    to the reserved count then never regrows (the buffers keep their address), and the slots read back as they do
    without the reserve."""
    g = torch.Generator().manual_seed(3)
    raws = [(torch.randn(2, H, 150, D, generator=g), torch.randn(2, H, 150, D, generator=g)) for _ in range(3)]
    ref = PositionedCache(_specs(), storage=storage)
    ref_first = _append_in_pieces(ref, raws)
    c = PositionedCache(_specs(), storage=storage)
    c.reserve_(150)
    first = _append_in_pieces(c, raws)
    assert all(l.capacity >= 150 for l in c.layers) and c.table.capacity >= 150
    assert [l.value_store.data_ptr() for l in c.layers] + [c.table._pos.data_ptr()] == first
    assert [l.value_store.data_ptr() for l in ref.layers] + [ref.table._pos.data_ptr()] != ref_first   # without it: regrown
    assert torch.equal(c.positions, ref.positions)
    for a, b in zip(c.layers, ref.layers):
        assert torch.equal(a.values, b.values) and torch.equal(a.raw_keys, b.raw_keys)


def test_reserve_on_an_empty_fixed_capacity_cache_refuses_more_than_it_holds():
    c = PositionedCache(_specs(), capacity=16)
    with pytest.raises(ValueError, match="at most 16 slots"):
        c.reserve_(17)
    assert all(l.room == 0 for l in c.layers) and c.table.room == 0
    c.reserve_(16)
    assert c.num_slots == 0
