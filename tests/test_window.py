"""Windowed-RoPE retrieval: reductions to full attention, the far score vs float64, index/store, decode kernel."""
import math

import pytest
import torch

from kvpos import RopeLayout, RopeSpec, rotate
from kvpos.reference import windowed_score_ref
from kvpos.window import (BlockIndex, FarStore, WindowConfig, far_query, index_recall, sparse_decode_attention,
                          windowed_attend)
from kvpos.integrations.hf import NAME, PositionedCache, current_binding, extend, generate
from kvpos.integrations.hf.testing import tiny_model
from kvpos.integrations.window import WindowBackend, use_window


def window_extend(model, cache, q, cfg):
    return extend(model, cache, q, attention=WindowBackend(cfg))


def window_generate(model, cache, q, cfg, **kw):
    with use_window(model, cache, cfg):
        return generate(model, cache, q, **kw)


def _prefilled(arch="llama", n=60, seed=0):
    model = tiny_model(arch, **({"sliding_window": 4096} if arch == "gemma3" else {}))[0]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (1, n), generator=g)
    cache = PositionedCache.from_model(model)
    extend(model, cache, ids)
    q = torch.randint(3, 128, (1, 3), generator=g)
    return model, cache, q


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "cohere", "gemma3"])
@pytest.mark.parametrize("far_scores", ["exact", "windowed"])
def test_all_far_slots_at_true_distance_equals_full_attention(arch, far_scores):
    model, cache, q = _prefilled(arch)
    ref = extend(model, cache.copy(), q)
    cfg = WindowConfig(sinks=4, window=8, selector="all", true_distance=True, far_scores=far_scores)
    got = window_extend(model, cache.copy(), q, cfg)
    assert (got - ref).abs().max() < 1e-4
    # selecting every far slot by its windowed score and attending with true positions is full attention too
    got2 = window_extend(model, cache.copy(), q, WindowConfig(sinks=4, window=8, selector="all"))
    assert (got2 - ref).abs().max() < 1e-4
    assert model.config._attn_implementation == NAME and current_binding() is None


@pytest.mark.parametrize("selector", ["exact", "index", "blocks", "none"])
def test_window_covering_everything_equals_full_attention(selector):
    model, cache, q = _prefilled("qwen2")
    ref = extend(model, cache.copy(), q)
    got = window_extend(model, cache.copy(), q, WindowConfig(sinks=0, window=10_000, selector=selector))
    assert (got - ref).abs().max() < 1e-4


def test_far_score_equals_float64_reference():
    for layout, R, s in ((RopeLayout.HALF, 16, 1.0), (RopeLayout.INTERLEAVED, 8, 1.3)):
        inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
        spec = RopeSpec(inv, s, R, 16, layout, angle_dtype=torch.float64)
        q_raw, k_raw = torch.randn(16), torch.randn(40, 16)
        for p, r in ((5000, 2048), (100, 64), (30, 2048)):
            q_h = rotate(q_raw.view(1, 1, 1, 16), torch.tensor([p]), spec)
            qf = far_query(q_h, torch.tensor([[p]]), spec, r)[0, 0, 0]
            got = k_raw @ qf
            ref = windowed_score_ref(q_raw, k_raw, r, spec)
            assert (got.double() - ref).abs().max() < 1e-4 * ref.abs().max()


def test_far_scores_do_not_depend_on_the_query_position():
    model, cache, q = _prefilled("llama", n=80)
    cfg = WindowConfig(sinks=2, window=4, selector="exact", budget=10, far_scores="windowed")
    a = window_extend(model, cache.copy(), q, cfg)
    moved = cache.copy()
    moved.shift_(0, moved.num_slots, 1000)       # everything 1000 positions later: far scores are unchanged,
    b = window_extend(model, moved, q, cfg)       # exact ones too (RoPE is relative)
    assert (a - b).abs().max() < 1e-3


def test_budget_selects_and_streaming_drops_far_slots():
    model, cache, q = _prefilled("llama", n=80)
    backend = WindowBackend(WindowConfig(sinks=4, window=8, budget=0.25, selector="exact"))
    extend(model, cache.copy(), q, attention=backend)
    stats = backend.stats
    assert stats["selected"] == math.ceil(0.25 * stats["far_slots"]) and stats["far_slots"] > 0
    none = window_extend(model, cache.copy(), q, WindowConfig(sinks=4, window=8, selector="none"))
    zero = window_extend(model, cache.copy(), q, WindowConfig(sinks=4, window=8, budget=0, selector="exact"))
    assert (none - zero).abs().max() < 1e-5


def test_generate_with_window():
    model, cache, q = _prefilled("llama")
    out = window_generate(model, cache, q, WindowConfig(sinks=4, window=8, budget=0.1), max_new_tokens=5,
                          do_sample=False)
    assert out.shape == (1, 8) and current_binding() is None


def test_block_index_bounds_store_and_recall():
    g = torch.Generator().manual_seed(0)
    H, F, D, g_ = 2, 256, 16, 3
    raw = torch.randn(H, F, D, generator=g)
    idx = BlockIndex(raw, start=0, block=16)
    qf = torch.randn(H * g_, D, generator=g)
    ub = idx.upper_bounds(qf.view(H, g_, D))                                    # [H, nb]
    true = (qf.view(H, g_, D) @ raw.transpose(-1, -2)).amax(1).view(H, 16, 16).amax(-1)
    assert (ub >= true - 1e-5).all()                                            # a bound, never below the max
    assert index_recall(qf, raw, idx, F) == 1.0                                 # every block selected
    r = index_recall(qf, raw, idx, 32)
    assert 0.0 < r <= 1.0
    st = FarStore(raw, raw, key_bits=8)
    k, v = st.gather(torch.arange(10).repeat(H, 1))
    assert (k - raw[:, :10]).abs().max() <= raw.abs().max() / 127 + 1e-3
    assert st.nbytes() < raw.numel() * 4 * 2 / 2.4   # int8 keys + fp16 values + one fp32 scale per 16-dim key


def test_sparse_decode_equals_dense_when_everything_is_selected():
    model, cache, _ = _prefilled("llama", n=100)
    layer = cache.layers[1]
    sinks, window, r = 4, 16, 2048
    N = cache.num_slots
    q_h = torch.randn(1, 4, 1, 16)
    q_pos = torch.tensor([[N - 1]])
    # dense reference: all far slots at distance r (query = slot N-1)
    cfg = WindowConfig(sinks=sinks, window=window, distance=r, selector="all", far_scores="windowed")
    dense = windowed_attend(q_h, layer.keys, layer.raw_keys, layer.values, layer.spec, q_pos, cfg, 0.25)[0, :, 0]
    qf = far_query(q_h, q_pos, layer.spec, r)[0, :, 0]
    far = slice(sinks, N - window)
    F = far.stop - far.start
    idx = BlockIndex(layer.raw_keys[0, :, far], far.start, block=F)            # one block = all far slots
    store = FarStore(layer.raw_keys[0, :, far], layer.values[0, :, far], key_bits=16)
    lk = torch.cat([layer.keys[0, :, :sinks], layer.keys[0, :, N - window:]], 1)
    lv = torch.cat([layer.values[0, :, :sinks], layer.values[0, :, N - window:]], 1)
    got = sparse_decode_attention(q_h[0, :, 0], qf, lk, lv, store, F, 0.25, blocks=idx)
    assert (got - dense).abs().max() < 5e-3       # fp16 store
    store8 = FarStore(layer.raw_keys[0, :, far], layer.values[0, :, far], key_bits=8)
    got8 = sparse_decode_attention(q_h[0, :, 0], qf, lk, lv, store8, F, 0.25)   # int8 index, all far slots
    assert (got8 - dense).abs().max() < 5e-2


def test_int8_scoring_kernel_equals_torch(monkeypatch):
    import kvpos.window as W

    g = torch.Generator().manual_seed(1)
    raw = torch.randn(3, 500, 64, generator=g)
    st = FarStore(raw, raw)
    qf = torch.randn(3, 3, 64, generator=g)
    fast = st.scores(qf)
    monkeypatch.setattr(W, "score_int8_kernel", lambda *a: None)
    slow = st.scores(qf)
    assert (fast - slow).abs().max() < 1e-3
    exact = (qf @ raw.transpose(-1, -2)).amax(1)
    top = exact.topk(25, -1).indices
    rec = slow.topk(25, -1).indices
    assert sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top, rec)) / 75 > 0.8


def test_window_config_errors():
    with pytest.raises(ValueError, match="WindowConfig.selector: expected one of"):
        WindowConfig(selector="random")
    with pytest.raises(ValueError, match=r"WindowConfig.budget: expected a fraction in \[0, 1\] or an int count"):
        WindowConfig(budget=1.5)
    with pytest.raises(ValueError, match="WindowConfig.far_scores: expected 'exact', 'windowed' or 'shifted'"):
        WindowConfig(far_scores="rope")
    with pytest.raises(ValueError, match="WindowConfig.window: expected an int >= 0, got -1"):
        WindowConfig(window=-1)
    with pytest.raises(ValueError, match="FarStore key_bits: expected 8 or 16, got 4"):
        FarStore(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), key_bits=4)


def test_topk_indices_matches_torch_topk():
    from kvpos._kernels import topk_indices

    g = torch.Generator().manual_seed(3)
    s = torch.randn(3, 5000, generator=g)
    for k in (1, 17, 250, 5000):
        got = topk_indices(s, k)
        want = s.topk(k, -1).indices
        assert all(set(a.tolist()) == set(b.tolist()) for a, b in zip(got, want))
    ties = torch.zeros(2, 100)
    ties[:, 10:30] = 1.0
    assert all(set(range(10, 30)) <= set(r.tolist()) for r in topk_indices(ties, 25))


def test_dense_layers_attend_densely_and_the_rest_sparsely():
    model, cache, q = _prefilled("llama")
    ref = extend(model, cache.copy(), q)
    n_layers = model.config.num_hidden_layers
    sparse = WindowConfig(sinks=2, window=4, selector="none")
    all_dense = window_extend(model, cache.copy(), q, WindowConfig(sinks=2, window=4, selector="none",
                                                                   dense_layers=n_layers))
    assert (all_dense - ref).abs().max() < 1e-4
    one_dense = window_extend(model, cache.copy(), q, WindowConfig(sinks=2, window=4, selector="none",
                                                                   dense_layers=1))
    none_dense = window_extend(model, cache.copy(), q, sparse)
    assert (one_dense - none_dense).abs().max() > 1e-4       # the dense first layer changes the result
    with pytest.raises(ValueError, match="WindowConfig.dense_layers"):
        WindowConfig(dense_layers=-1)
