"""Ms-PoE (per-head position scales, kvpos.posmap + kvpos.integrations.mspoe) against a float64 reference that
rotates every query head's query and keys with explicit matrices at position / ratio: tiny random models of several
architectures (grouped-query, partial rotary, interleaved pairs), prefill and decode."""
import pytest
import torch

from kvpos.posmap import HeadScales, assign_ratios, ms_poe_scales, position_awareness, scaled_attend
from kvpos.reference import scaled_attend_ref, unrotate_ref
from kvpos.rope import RopeLayout, RopeSpec
from kvpos.integrations.hf import AttentionCall, PositionedCache, extend
from kvpos.integrations.hf.testing import tiny_model
from kvpos.integrations.mspoe import MsPoEBackend, use_ms_poe


class ScaledReference:
    """Reference backend: queries unrotated and every head's scores from explicit float64 rotation matrices at
    position / ratio (kvpos.reference.scaled_attend_ref); ratios from a table or from a scored backend's choice."""

    needs_cache = True

    def __init__(self, ratios_of):
        self.ratios_of = ratios_of

    def __call__(self, call, binding):
        cache = binding.cache_layer_keys(call)
        layer = cache.layers[call.layer]
        B, Hq, Lq, _ = call.query.shape
        N = call.key.shape[2]
        pos = cache.table.pos[:, :N]
        q_raw = unrotate_ref(call.query, pos[:, N - Lq:], layer.spec)
        out = scaled_attend_ref(q_raw, layer.raw_keys, layer.values, pos[:, N - Lq:], pos,
                                self.ratios_of(call.layer), layer.spec, call.scaling, call.allowed())
        return AttentionCall.finish(out.to(call.query.dtype))


def _model(arch):
    return tiny_model(arch, **({"sliding_window": 4096} if arch == "gemma3" else {}))[0]


def _run(model, backend, ids, steps, read_time=False, storage="rotated"):
    """Prompt `ids` (under `backend`, or plainly but its last 4 tokens when read_time), then greedy decode steps
    under it: the logits of every call."""
    cache = PositionedCache.from_model(model, storage=storage)
    if read_time:
        extend(model, cache, ids[:, :-4])
        ids = ids[:, -4:]
    logits = [extend(model, cache, ids, attention=backend)[0]]
    for _ in range(steps):
        logits.append(extend(model, cache, logits[-1][-1].argmax()[None, None], attention=backend)[0])
    return logits


IDS = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "cohere", "gemma3"])
@pytest.mark.parametrize("read_time,storage", [(False, "rotated"), (True, "rotated"), (True, "raw")])
def test_ms_poe_equals_the_float64_per_head_reference_in_prefill_and_decode(arch, read_time, storage):
    """storage="raw": decode steps run the fused position-map kernel (read_counts says so)."""
    model = _model(arch)
    cfg = model.config
    scales = ms_poe_scales(cfg.num_hidden_layers, cfg.num_attention_heads, first_layer=1,
                           index=torch.tensor([2, 0, 3, 1]))
    backend = MsPoEBackend(scales)
    got = _run(model, backend, IDS, 3, read_time, storage)
    assert backend.read_counts["fused"] == (3 * (cfg.num_hidden_layers - 1) if storage == "raw" else 0)
    want = _run(model, ScaledReference(scales.for_layer), IDS, 3, read_time)
    plain = _run(model, None, IDS, 0, read_time)[0]
    assert (got[0] - plain).abs().max() > 1e-3                    # the scales change what the model computes
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 1e-4, float((g - w).abs().max())


def test_ms_poe_decode_with_hidden_slots_equals_the_reference_and_sees_each_steps_mask():
    """The fused decode takes the step's mask once per forward (StepMemo): slots hidden before a step are hidden
    from every layer of that step, and a slot hidden between two steps is seen by the next one."""
    model = _model("llama")
    cfg = model.config
    scales = ms_poe_scales(cfg.num_hidden_layers, cfg.num_attention_heads, first_layer=0)
    runs, fused = {}, MsPoEBackend(scales)
    for name, backend in (("fused", fused), ("reference", ScaledReference(scales.for_layer))):
        cache = PositionedCache.from_model(model, storage="raw")
        extend(model, cache, IDS)
        cache.hide_(3, 6)
        tok = torch.tensor([[5]])
        out = [extend(model, cache, tok, attention=backend)[0]]
        cache.hide_(10, 12)
        out.append(extend(model, cache, tok, attention=backend)[0])
        runs[name] = out
    assert fused.read_counts == {"fused": 2 * cfg.num_hidden_layers, "torch": 0}
    for g, w in zip(runs["fused"], runs["reference"]):
        assert (g - w).abs().max() < 1e-4, float((g - w).abs().max())
    assert (runs["fused"][1] - runs["fused"][0]).abs().max() > 1e-4      # the second step saw the new hidden slots


def test_ratios_of_one_are_bit_identical_to_plain_attention():
    """use_ms_poe with every ratio 1 binds nothing (plain reads, the fused decode kernel included); the backend
    itself at ratio 1 is transformers' attention over the rotated keys (equal up to the kernel's rounding)."""
    model = _model("llama")
    ones = HeadScales(torch.ones(2, 4))
    plain = _run(model, None, IDS, 3)
    cache = PositionedCache.from_model(model)
    with use_ms_poe(model, cache, ones):
        got = [extend(model, cache, IDS)[0]]
        for _ in range(3):
            got.append(extend(model, cache, got[-1][-1].argmax()[None, None])[0])
    for g, w in zip(got, plain):
        assert torch.equal(g, w)
    for g, w in zip(_run(model, MsPoEBackend(ones), IDS, 3), plain):
        assert (g - w).abs().max() < 1e-5


def test_every_query_head_of_a_group_reads_the_shared_key_at_its_own_ratio():
    """Grouped-query attention, exact: two query heads sharing a key head at different ratios score the key at
    their own fractional distances (the released code rotates the shared key with one head's ratio)."""
    R = 8
    inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    spec = RopeSpec(inv, 1.0, R, R, RopeLayout.HALF, angle_dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, R, generator=g).expand(1, 2, 1, R).clone()       # the same query in both heads
    k, v = torch.randn(1, 1, 6, R, generator=g), torch.eye(6, R)[None, None]
    ratios = torch.tensor([1.0, 1.7], dtype=torch.float64)
    out = scaled_attend(q, k, v, torch.tensor([[9]]), torch.arange(6)[None], ratios, spec, 0.5)
    ref = scaled_attend_ref(q, k, v, torch.tensor([[9]]), torch.arange(6)[None], ratios, spec, 0.5)
    assert (out.double() - ref).abs().max() < 1e-6
    assert (out[0, 0] - out[0, 1]).abs().max() > 1e-3             # same query, same key head: different reads


def test_position_awareness_counts_keys_read_more_than_three_times_the_mean():
    q = torch.zeros(1, 2, 4)
    q[0, 0, 0] = 10.0                                             # head 0 reads key 0 strongly; head 1 uniformly
    k = torch.zeros(1, 1, 8, 4)
    k[0, 0, 0, 0] = 1.0
    score = position_awareness(q, k, sm_scale=1.0)
    assert score[0, 0] == pytest.approx(1 / 8) and score[0, 1] == 0.0
    assert assign_ratios(torch.tensor([0.1, 0.5, 0.3])).tolist() == [2, 0, 1]           # highest score: index 0
    assert assign_ratios(torch.tensor([0.1, 0.5, 0.3]), "released").tolist() == [1, 2, 0]


def test_scored_backend_fixes_each_layers_head_order_at_its_first_call_and_matches_the_reference():
    model = _model("qwen2")
    backend = MsPoEBackend.scored(2, 4, first_layer=0)
    got = _run(model, backend, IDS, 2)
    chosen = {i: backend.ratios(i) for i in range(2)}
    assert all(sorted(backend.head_index[i].tolist()) == [0, 1, 2, 3] for i in range(2))
    want = _run(model, ScaledReference(lambda i: chosen[i]), IDS, 2)
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 1e-4
    backend.reset()
    assert backend.head_index == {} and backend.ratios(1) is None


def test_use_ms_poe_scopes_the_backend_and_bad_inputs_are_named():
    model = _model("llama")
    cache = PositionedCache.from_model(model)
    with use_ms_poe(model, cache, first_layer=0) as backend:
        extend(model, cache, IDS)
    assert len(backend.head_index) == 2
    with pytest.raises(ValueError, match="HeadScales ratios: expected finite entries > 0"):
        HeadScales(torch.tensor([[1.0, 0.0]]))
    with pytest.raises(TypeError, match="HeadScales ratios: expected a float tensor"):
        HeadScales(torch.ones(4))
    with pytest.raises(ValueError, match="ms_poe_scales index: expected a permutation of 0..3"):
        ms_poe_scales(2, 4, index=torch.tensor([0, 0, 1, 2]))
    with pytest.raises(ValueError, match="assign_ratios rule: expected 'rank' or 'released'"):
        MsPoEBackend.scored(2, 4, rule="best")
    with pytest.raises(ValueError, match=r"MsPoEBackend scales: expected \[L, Hq=4\]"):
        _run(model, MsPoEBackend(HeadScales(torch.full((2, 3), 1.5))), IDS, 0)


@pytest.mark.parametrize("storage", ["raw", "int8"])
def test_ms_poe_reads_the_raw_keys_of_every_storage(storage):
    """The backend reads layer.raw_keys: the rotated storage unrotates them, raw stores them, int8 dequantizes."""
    model = _model("llama")
    scales = ms_poe_scales(2, 4, first_layer=0)
    runs = {}
    for st in ("rotated", storage):
        cache = PositionedCache.from_model(model, storage=st)
        runs[st] = extend(model, cache, IDS, attention=MsPoEBackend(scales))[0]
    tol = 1e-5 if storage == "raw" else 0.1                         # int8 keys and values: an approximation
    assert (runs["rotated"] - runs[storage]).abs().max() < tol


@pytest.mark.parametrize("layout,angle", [(RopeLayout.HALF, torch.float32), (RopeLayout.INTERLEAVED, torch.float64)])
def test_one_turn_takes_the_models_query_to_the_scaled_positions(layout, angle):
    """kvpos.posmap.turned_cos_sin: the query as the model rotated it (angles in the spec's dtype, times the
    attention scaling), turned once, equals the raw query rotated at p / r_h by the float64 reference (partial
    rotary, attention scaling 1.3, positions to 6000)."""
    from kvpos.posmap import rotate_heads, turned_cos_sin
    from kvpos.reference import rotation_matrix_ref
    from kvpos.rope import rotate

    g = torch.Generator().manual_seed(5)
    inv = 1.0 / (10000 ** (torch.arange(0, 12, 2, dtype=torch.float32) / 12))
    spec = RopeSpec(inv, 1.3, 12, 16, layout, angle_dtype=angle)
    Hq, S = 4, 3
    q0 = torch.randn(2, Hq, S, 16, generator=g)
    pos = torch.randint(0, 6000, (2, S), generator=g)
    r = torch.tensor([1.0, 1.25, 1.6, 1.8], dtype=torch.float64)
    q_model = rotate(q0, pos, spec)                                         # what the model's attention receives
    got = rotate_heads(q_model, *turned_cos_sin(pos, r, spec), spec, 1.0).double()
    for b in range(2):
        for h in range(Hq):
            for j in range(S):      # the reference: the explicit float64 matrix at the fractional position p / r_h
                want = rotation_matrix_ref(int(pos[b, j]) / float(r[h]), spec) @ q0[b, h, j].double()
                assert torch.allclose(got[b, h, j], want, atol=2e-5), (b, h, j, (got[b, h, j] - want).abs().max())
