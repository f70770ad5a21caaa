"""storage="raw" decode steps through the fused raw-key kernel (rotate on read in registers, never materialised).

The kernel is checked against the float64 oracle (explicit rotation matrices, softmax attention written from the
formula); the cache path against transformers' DynamicCache on every tiny architecture, and against the default
storage after position operations. Each test also checks which path served (`read_counts`), so a silent switch to
the buffer path fails."""
import pytest
import torch
from transformers import DynamicCache

import kvpos.cache.reads
from kvpos._kernels import decode_raw_kernel, rope_kernel_available
from kvpos.integrations.hf import PositionedCache
from kvpos.integrations.hf.testing import TINY_ARCHS, tiny_model
from kvpos.reference import decode_raw_ref
from kvpos.rope import RopeLayout, cos_sin

from kernel_cases import decode_case, spec_for

pytestmark = pytest.mark.skipif(not rope_kernel_available(), reason="no C compiler: the fused kernel is not built")


_spec = spec_for


@pytest.mark.parametrize("B,Hkv,G,N,D,R,layout,dtype,scaling", [
    (1, 3, 3, 300, 64, 64, RopeLayout.HALF, torch.float32, 1.0),        # SmolLM2's shape, AVX2 path
    (2, 2, 4, 1000, 64, 32, RopeLayout.INTERLEAVED, torch.float32, 1.3),  # plain-C path, partial rotary, yarn scale
    (2, 1, 1, 7, 32, 32, RopeLayout.HALF, torch.bfloat16, 1.0),          # fewer keys than one vector, bf16
    (1, 4, 2, 129, 128, 64, RopeLayout.HALF, torch.float32, 1.0),         # pass-through dims, chunk edge
    (1, 2, 2, 40, 16, 8, RopeLayout.HALF, torch.float32, 1.0),            # R/2 = 4: plain-C path
    (1, 2, 6, 200, 64, 64, RopeLayout.HALF, torch.float32, 1.0),          # G = 6: the run-time-G vector loops
    (1, 1, 16, 50, 32, 32, RopeLayout.HALF, torch.bfloat16, 1.0),         # G = 16, the most the kernel takes
])
@pytest.mark.parametrize("masked", [False, True])
def test_kernel_equals_the_float64_reference(B, Hkv, G, N, D, R, layout, dtype, scaling, masked):
    g = torch.Generator().manual_seed(N)
    spec = _spec(D, R, layout, scaling)
    k = torch.randn(B, Hkv, N + 3, D, generator=g).to(dtype)[:, :, :N]      # a view with capacity beyond N
    v = torch.randn(B, Hkv, N + 3, D, generator=g).to(dtype)[:, :, :N]
    q, pos, cos, sin, allowed, add = decode_case(g, B, Hkv, G, N, spec, masked)
    out = decode_raw_kernel(q, k, v, cos, sin, add, 0.125, R, layout is RopeLayout.INTERLEAVED)
    assert out is not None and out.shape == (B, Hkv * G, D)
    ref = decode_raw_ref(q, k, v, pos, spec, allowed, 0.125)
    assert (out.double() - ref).abs().max() < 2e-6


def test_kernel_gives_zero_for_a_row_that_sees_no_key_and_refuses_what_it_cannot_serve():
    spec = _spec(64, 64, RopeLayout.HALF, 1.0)
    k, v, q = torch.randn(1, 1, 20, 64), torch.randn(1, 1, 20, 64), torch.randn(1, 2, 64)
    cos, sin = cos_sin(torch.arange(20)[None], spec)
    out = decode_raw_kernel(q, k, v, cos, sin, torch.full((1, 20), float("-inf")), 0.125, 64, False)
    assert torch.equal(out, torch.zeros(1, 2, 64))
    assert decode_raw_kernel(q, k.half(), v.half(), cos, sin, None, 0.125, 64, False) is None     # fp16
    assert decode_raw_kernel(torch.randn(1, 17, 64), k, v, cos, sin, None, 0.125, 64, False) is None  # 17 % 1 ok,
    # but 17 query heads per kv head > 16


def _prompt(cfg, seed=1):
    ids = torch.randint(5, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(seed))
    am = torch.ones_like(ids)
    am[1, :3] = 0                                           # left padding: the decode mask is a real 4-D mask
    return ids, am


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_generate_with_fused_reads_equals_dynamic_cache(arch):
    model, cfg = tiny_model(arch)
    ids, am = _prompt(cfg)
    out = {}
    for kind in ("dynamic", "raw"):
        cache = DynamicCache(config=cfg) if kind == "dynamic" else PositionedCache.from_model(model, storage="raw")
        with torch.no_grad():
            out[kind] = model.generate(ids, attention_mask=am, cache=cache, max_new_tokens=8, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out["raw"].sequences, out["dynamic"].sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out["raw"].logits, out["dynamic"].logits)) < 1e-4
    layers = cfg.num_hidden_layers
    assert cache.read_counts == {"fused": 7 * layers, "torch": 0}            # every decode step, every layer


@pytest.mark.parametrize("arch", ["llama", "gemma3", "glm"])
def test_decode_after_position_operations_equals_the_default_storage(arch):
    model, cfg = tiny_model(arch)
    ids = torch.randint(5, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    logits = {}
    for storage in ("rotated", "raw"):
        c = PositionedCache.from_model(model, storage=storage)
        with torch.no_grad():
            model(ids, cache=c, use_cache=True)
            c.shift_(10, 30, 7)
            c.delete_(2, 5, close_gap=True)
            c.set_positions_(0, 2, torch.tensor([300, 301]))
            steps = []
            nxt = torch.tensor([[7]])
            for _ in range(4):
                lg = model(nxt, cache=c, use_cache=True, position_ids=c.next_position().view(1, 1)).logits[:, -1]
                nxt = lg.argmax(-1, keepdim=True)
                steps.append(lg)
        logits[storage] = torch.stack(steps)
        if storage == "raw":
            assert c.read_counts["fused"] == 4 * cfg.num_hidden_layers and c.read_counts["torch"] == 0
    assert (logits["raw"] - logits["rotated"]).abs().max() < 1e-4


def test_read_torch_never_uses_the_kernel_and_gives_the_same_tokens():
    model, cfg = tiny_model("llama")
    ids, am = _prompt(cfg)
    seqs = {}
    for read in ("auto", "torch"):
        c = PositionedCache.from_model(model, storage="raw", read=read)
        with torch.no_grad():
            seqs[read] = model.generate(ids, attention_mask=am, cache=c, max_new_tokens=6, do_sample=False)
        assert (c.read_counts["fused"] > 0) == (read == "auto")
    assert torch.equal(seqs["auto"], seqs["torch"])


def test_bad_read_settings_are_refused():
    model, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="read"):
        PositionedCache.from_model(model, storage="raw", read="fast")
    with pytest.raises(ValueError, match="storage='raw'"):
        PositionedCache.from_model(model, read="fused")
    eager = tiny_model("llama")[0]
    eager.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="sdpa"):
        PositionedCache.from_model(eager, storage="raw", read="fused")


def _filled(read):
    model, cfg = tiny_model("llama")
    c = PositionedCache.from_model(model, storage="raw", read=read)
    with torch.no_grad():
        model(torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(3)), cache=c, use_cache=True)
    return model, c


def test_fused_refuses_a_model_switched_off_kvpos_attention_before_writing():
    model, c = _filled("fused")
    model.set_attn_implementation("sdpa")
    pos, raw = c.positions.clone(), c.layers[0].raw_keys.clone()
    with pytest.raises(ValueError, match="kvpos"):
        with torch.no_grad():
            model(torch.tensor([[9]]), cache=c, use_cache=True)
    assert c.num_slots == 12 and torch.equal(c.positions, pos) and torch.equal(c.layers[0].raw_keys, raw)


def test_auto_rotates_into_a_buffer_where_the_model_is_off_kvpos_attention():
    model, c = _filled("auto")
    ref = PositionedCache.from_model(model, storage="rotated")
    with torch.no_grad():
        model(torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(3)), cache=ref, use_cache=True)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        a = model(torch.tensor([[9]]), cache=c, use_cache=True).logits
        b = model(torch.tensor([[9]]), cache=ref, use_cache=True).logits
    assert c.read_counts == {"fused": 0, "torch": model.config.num_hidden_layers}
    assert (a - b).abs().max() < 1e-4


def test_fused_refusal_inside_attention_drops_the_step(monkeypatch):
    """The kernel declining a call (here forced) in read='fused': ValueError, and the cache holds what it held
    before the step (the layers already written are rolled back)."""
    model, c = _filled("fused")
    monkeypatch.setattr(kvpos.cache.reads, "decode_raw_kernel", lambda *a, **k: None)
    pos = c.positions.clone()
    with pytest.raises(ValueError, match="fused"):
        with torch.no_grad():
            model(torch.tensor([[9]]), cache=c, use_cache=True)
    monkeypatch.undo()
    assert c.num_slots == 12 and torch.equal(c.positions, pos)
    with torch.no_grad():                                  # and the cache keeps working
        model(torch.tensor([[9]]), cache=c, use_cache=True)
    assert c.num_slots == 13


def test_auto_where_the_kernel_declines_uses_the_buffer_path(monkeypatch):
    model, c = _filled("auto")
    ref = c.copy()
    monkeypatch.setattr(kvpos.cache.reads, "decode_raw_kernel", lambda *a, **k: None)
    with torch.no_grad():
        a = model(torch.tensor([[9]]), cache=c, use_cache=True).logits
    monkeypatch.undo()
    with torch.no_grad():
        b = model(torch.tensor([[9]]), cache=ref, use_cache=True).logits
    assert c.read_counts["torch"] == model.config.num_hidden_layers and ref.read_counts["fused"] > 0
    assert (a - b).abs().max() < 1e-4


# random sequences: the fused reader against the default storage after any mix of position operations and forwards
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_OPS = st.one_of(
    st.tuples(st.just("shift"), st.integers(0, 30), st.integers(0, 30), st.integers(-20, 200)),
    st.tuples(st.just("delete"), st.integers(0, 30), st.integers(0, 30), st.booleans()),
    st.tuples(st.just("hide"), st.integers(0, 30), st.integers(0, 30), st.booleans()),
    st.tuples(st.just("set"), st.integers(0, 30), st.integers(1, 4), st.integers(0, 500)),
    st.tuples(st.just("decode"), st.integers(0, 10 ** 6), st.just(0), st.just(0)),
    st.tuples(st.just("extend"), st.integers(0, 10 ** 6), st.integers(2, 3), st.just(0)),
)


def _apply(cache, op, model, ids_seed):
    """One step of a random sequence on `cache`; a forward returns the last logits [B, V], else None."""
    from kvpos.integrations.hf import extend

    name, a, b, c = op
    if name == "shift":
        cache.shift_(min(a, b), max(a, b), c)
    elif name == "delete":
        cache.delete_(min(a, b), max(a, b), close_gap=c)
    elif name == "hide":
        (cache.hide_ if c else cache.unhide_)(min(a, b), max(a, b))
    elif name == "set":
        cache.set_positions_(a, a + b, torch.arange(c, c + b))
    else:
        S = 1 if name == "decode" else b
        ids = torch.randint(3, 120, (2, S), generator=torch.Generator().manual_seed(ids_seed))
        with torch.no_grad():
            return extend(model, cache, ids)[:, -1]
    return None


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(["llama", "gemma3", "glm"]), seq=st.lists(_OPS, min_size=1, max_size=10),
       seed=st.integers(0, 2 ** 16))
def test_random_sequences_fused_reads_equal_the_default_storage(arch, seq, seed):
    from kvpos.integrations.hf import extend

    model = tiny_model(arch, num_hidden_layers=2)[0]
    prompt = torch.randint(3, 120, (2, 20), generator=torch.Generator().manual_seed(seed))
    caches = {s: PositionedCache.from_model(model, storage=s) for s in ("rotated", "raw")}
    for c in caches.values():
        with torch.no_grad():
            extend(model, c, prompt)
    decodes = 0
    for i, op in enumerate(seq):
        for step in (op, ("decode", seed + 7 * i, 0, 0)):        # every operation is followed by a decode step
            out, errs = {}, {}
            for s, c in caches.items():
                try:
                    out[s] = _apply(c, step, model, step[1] if step[0] in ("decode", "extend") else 0)
                except ValueError as e:
                    errs[s] = str(e)
            assert set(errs) in ({"rotated", "raw"}, set()), (step, errs)      # both refuse, or neither
            if errs or out["raw"] is None:
                continue
            decodes += step[0] == "decode"
            assert (out["raw"] - out["rotated"]).abs().max() < 1e-4, (op, step)
            assert torch.equal(caches["raw"].positions, caches["rotated"].positions)
    assert decodes >= 1 and caches["raw"].read_counts["fused"] == 2 * decodes


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_bf16_decode_step_is_as_close_to_dynamic_cache_as_the_buffer_path(arch):
    """bf16: raw keys are rounded once more than DynamicCache's rotated ones (either read path), so logits differ at
    bf16 rounding; the fused reader (float32 inside) must be no farther from DynamicCache than the buffer path."""
    model, cfg = tiny_model(arch, dtype=torch.bfloat16)
    worst = {"auto": 0.0, "torch": 0.0}
    for seed in range(4):
        ids = torch.randint(5, cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            d = DynamicCache(config=cfg)
            model(ids, cache=d, use_cache=True)
            ref = model(torch.tensor([[7]]), cache=d, use_cache=True).logits[0, -1].float()
            for read in worst:
                c = PositionedCache.from_model(model, storage="raw", read=read)
                model(ids, cache=c, use_cache=True)
                got = model(torch.tensor([[7]]), cache=c, use_cache=True).logits[0, -1].float()
                worst[read] = max(worst[read], float((got - ref).abs().max()))
                assert c.read_counts["fused"] == (cfg.num_hidden_layers if read == "auto" else 0)
    assert worst["auto"] <= 0.1 and worst["auto"] <= worst["torch"] + 0.01, worst


def test_fused_decode_with_offloading_keeps_offloading_layers():
    """offloading=True: a fused decode step still hands each finished layer to `offload()` (the update's raw path
    must not skip it), and the tokens equal DynamicCache's."""
    model, cfg = tiny_model("llama")
    ids, am = _prompt(cfg)
    c = PositionedCache.from_model(model, storage="raw")
    c.offloading = True
    calls = []
    for l in c.layers:
        l.offload = (lambda f, i: (lambda: (calls.append(i), f())[1]))(l.offload, l.index)
    with torch.no_grad():
        got = model.generate(ids, attention_mask=am, cache=c, max_new_tokens=4, do_sample=False)
        ref = model.generate(ids, attention_mask=am, cache=DynamicCache(config=cfg), max_new_tokens=4,
                             do_sample=False)
    assert torch.equal(got, ref)
    assert c.read_counts["fused"] == 3 * cfg.num_hidden_layers
    assert calls.count(0) == 4                     # layer 0 offloaded after layer 1 wrote, in each of the 4 forwards


@pytest.mark.parametrize("storage", ["raw", "int8"])
def test_a_stale_hand_off_is_inert_when_a_later_call_reuses_its_keys_address(storage):
    """A taken hand-off stays in the scope after its step. Once the cache has moved on, an attention call whose keys
    sit at the hand-off's address (a freed buffer reused, or the same buffer after later writes) must not be judged
    by it: before, it raised 'a second attention call' and dropped the cache's slots from the old step on."""
    from kvpos.integrations.hf import extend
    from kvpos.integrations.hf.scope import pending_handoff

    model = tiny_model("llama")[0]
    cache = PositionedCache.from_model(model, storage=storage)
    cache.reserve_(64)                                      # no regrowth: the key buffer keeps its address
    extend(model, cache, torch.randint(3, 128, (1, 10)))
    extend(model, cache, torch.randint(3, 128, (1, 1)))    # a decode step: hands raw keys to attention
    h = pending_handoff()
    assert h is not None and h.calls == 1 and h.cache_ref() is cache
    extend(model, cache, torch.randint(3, 128, (1, 5)))    # the cache moves on (16 slots)
    before = cache.positions.clone()
    layer = cache.layers[h.layer]
    module = next(m for m in model.modules() if getattr(m, "layer_idx", None) == h.layer and id(m) in h.modules)
    keys = layer.key_store[:, :, : layer.n]                 # keys at the stale hand-off's address
    assert keys.data_ptr() == h.ptr
    assert h.check_call(module, keys, keys) is False
    assert torch.equal(cache.positions, before) and cache.num_slots == 16
