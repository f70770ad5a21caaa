"""storage="int8": keys per channel over 64-token groups and values per token in int8, the newest tokens exact.

References, independent of the code under test: `kvpos.quant.quantize_ref` (float64 quantize-dequantize), the
float64 decode oracle `decode_q8_ref`, storage="raw" (exact, tested against DynamicCache elsewhere) for the raw keys
an int8 cache must have quantized, and transformers' own forward over a DynamicCache holding the reference
quantization rotated by explicit matrices (`rotate_ref`)."""
import contextlib

import pytest
import torch

import kvpos.cache.reads
from transformers import DynamicCache

from kvpos import PositionedKV
from kvpos._kernels import decode_q8_kernel
from kvpos.integrations.hf import PositionedCache, extend
from kvpos.integrations.hf.pytree import register_pytree
from kvpos.integrations.hf.testing import TINY_ARCHS, tiny_model
from kvpos.edits import Delete, Insert
from kvpos.quant import GROUP, dequantize_keys, dequantize_values, quantize_key_groups, quantize_ref, quantize_values
from kvpos.reference import decode_q8_ref, dequant_q8_ref, rotate_ref
from kvpos.rope import RopeLayout, cos_sin

from kernel_cases import decode_case, spec_for


_spec = spec_for


# -- the kernel against its float64 oracle ---------------------------------------------------------------------------
@pytest.mark.parametrize("B,Hkv,G,N,nq,D,R,layout,dtype,scaling", [
    (1, 3, 3, 300, 256, 64, 64, RopeLayout.HALF, torch.float32, 1.0),        # SmolLM2's shape, AVX2 paths
    (2, 2, 4, 1000, 960, 64, 32, RopeLayout.INTERLEAVED, torch.float32, 1.3),  # plain C, partial rotary, yarn
    (2, 1, 1, 7, 0, 32, 32, RopeLayout.HALF, torch.bfloat16, 1.0),            # tail only, bf16 scales
    (1, 4, 2, 129, 128, 128, 64, RopeLayout.HALF, torch.float32, 1.0),        # pass-through dims, chunk edge
    (1, 2, 6, 200, 140, 64, 64, RopeLayout.HALF, torch.bfloat16, 1.0),        # run-time G, tail of 60
    (1, 2, 2, 40, 40, 16, 8, RopeLayout.HALF, torch.float32, 1.0),            # no tail, scalar paths
])
@pytest.mark.parametrize("masked", [False, True])
def test_q8_kernel_equals_the_float64_reference(B, Hkv, G, N, nq, D, R, layout, dtype, scaling, masked):
    g = torch.Generator().manual_seed(N)
    spec = _spec(D, R, layout, scaling)
    codes, ks = quantize_key_groups(torch.randn(B, Hkv, nq, D, generator=g).to(dtype))
    perm = torch.randperm(nq, generator=g)                  # slots name their rows in any order (after keep_)
    codes = torch.cat([codes[:, :, perm], torch.zeros(B, Hkv, N - nq, D, dtype=torch.int8)], 2)
    rows = torch.cat([(torch.arange(nq) // GROUP).int()[perm], torch.zeros(N - nq, dtype=torch.int32)])
    kt, vt = (torch.randn(B, Hkv, 64, D, generator=g).to(dtype) for _ in range(2))     # a tail of up to 64
    vc, vs = quantize_values(torch.randn(B, Hkv, N, D, generator=g).to(dtype))
    q, pos, cos, sin, allowed, add = decode_case(g, B, Hkv, G, N, spec, masked)
    out = decode_q8_kernel(q, codes, rows, ks, kt, nq, vc, vs, vt, cos, sin, add, 0.125, R,
                           layout is RopeLayout.INTERLEAVED)
    assert out is not None and out.shape == (B, Hkv * G, D)
    ref = decode_q8_ref(q, codes, rows, ks, kt, nq, vc, vs, vt, pos, spec, allowed, 0.125)
    assert (out.double() - ref).abs().max() < 2e-6


def test_q8_kernel_declines_what_it_cannot_serve():
    codes, ks = quantize_key_groups(torch.randn(1, 1, 64, 64))
    vc, vs = quantize_values(torch.randn(1, 1, 64, 64))
    kt = vt = torch.zeros(1, 1, GROUP, 64)
    cos, sin = cos_sin(torch.arange(64)[None], _spec(64, 64, RopeLayout.HALF, 1.0))
    rows = torch.zeros(64, dtype=torch.int32)
    q = torch.randn(1, 2, 64)
    assert decode_q8_kernel(q, codes, rows, ks, kt, 64, vc, vs, vt, cos, sin, None, 0.1, 64, False) is not None
    assert decode_q8_kernel(q, codes, rows.long(), ks, kt, 64, vc, vs, vt, cos, sin, None, 0.1, 64, False) is None
    assert decode_q8_kernel(q, codes, rows, ks.half(), kt.half(), 64, vc, vs.half(), vt.half(), cos, sin, None, 0.1,
                            64, False) is None                                       # fp16 scales
    assert decode_q8_kernel(q, codes, rows, ks, kt, 64, vc.float(), vs, vt, cos, sin, None, 0.1, 64, False) is None


# -- quantization against float64 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S", [1, 64, 150])
def test_quantizers_equal_the_float64_reference(dtype, S):
    g = torch.Generator().manual_seed(S)
    k = torch.randn(2, 3, S, 64, generator=g)
    k[:, :, :, 5] *= 40                                    # an outlier channel (its own scale per group)
    k[:, :, :, 7] = 0                                      # an all-zero channel (scale 0, exact zeros)
    v = torch.randn(2, 3, S, 64, generator=g)
    v[:, :, 0] = 0                                         # an all-zero token
    k, v = k.to(dtype), v.to(dtype)
    codes, ks = quantize_key_groups(k)
    assert codes.dtype == torch.int8 and ks.shape == (2, 3, -(-S // GROUP), 64) and ks.dtype == dtype
    got_k = dequantize_keys(codes, (torch.arange(S) // GROUP).int(), ks, torch.float32).double()
    got_v = dequantize_values(*quantize_values(v), torch.float32).double()
    for got, ref in ((got_k, quantize_ref(k, 2, GROUP, dtype)), (got_v, quantize_ref(v, 3, None, dtype))):
        assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert torch.equal(got_k[..., 7], torch.zeros_like(got_k[..., 7])) and torch.equal(got_v[:, :, 0],
                                                                                        torch.zeros_like(got_v[:, :, 0]))
    rel = (got_k - k.double()).abs().amax((0, 1, 2)) / k.double().abs().amax((0, 1, 2)).clamp_min(1e-9)
    assert rel.max() <= 0.5 / 127 + 1e-3                   # at most half a step of the channel's range


# -- the cache against storage="raw" and the reference quantization ----------------------------------------------------
def _filled(arch, n=150, seed=0):
    """A raw and an int8 cache after one prefill of the same n tokens: the int8 cache quantized exactly the raw
    keys and values the raw cache holds (later forwards would attend over different histories)."""
    model, cfg = tiny_model(arch)
    ids = torch.randint(3, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    caches = {s: PositionedCache.from_model(model, storage=s) for s in ("raw", "int8")}
    with torch.no_grad():
        for c in caches.values():
            extend(model, c, ids)
    return model, cfg, caches


def _reference_quantized(raw_kv, q, dtype=torch.float32):
    """Per layer (keys, values, key steps, value steps) float64: slots [0, q) quantized by the float64 reference in
    groups of GROUP from slot 0, the rest exact; steps: the quantization step of every element (0 in the tail)."""
    out = []
    for k, v in raw_kv:
        k, v = k.double().clone(), v.double().clone()
        ks, vs = torch.zeros_like(k), torch.zeros_like(v)
        for a in range(0, q, GROUP):
            ks[:, :, a: a + GROUP] = k[:, :, a: a + GROUP].abs().amax(2, keepdim=True) / 127
        vs[:, :, :q] = v[:, :, :q].abs().amax(3, keepdim=True) / 127
        k[:, :, :q] = quantize_ref(k[:, :, :q], 2, GROUP, dtype)
        v[:, :, :q] = quantize_ref(v[:, :, :q], 3, None, dtype)
        out.append((k, v, ks, vs))
    return out


def _assert_holds(kv, ref, q):
    """Every element within float rounding of the reference, except near-ties of round(x / scale) (the float32
    quotient of the cache and the float64 one of the reference can round apart): at most one step, at most 0.1%."""
    for (k, v), (rk, rv, sk, sv) in zip(kv, ref):
        for got, want, step in ((k, rk, sk), (v, rv, sv)):
            d = (got.double() - want).abs()
            off = d > 1e-6 * want.abs().max()
            assert bool((d <= step * (1 + 1e-5) + 1e-6 * want.abs().max()).all()) and off.double().mean() < 1e-3
        assert torch.equal(k[:, :, q:].double(), rk[:, :, q:]) and torch.equal(v[:, :, q:].double(), rv[:, :, q:])


@pytest.mark.parametrize("arch,n", [("llama", 150), ("phi3", 32), ("gpt_neox", 33)])
def test_a_prefill_stores_the_reference_quantization_of_the_raw_keys(arch, n):
    _, _, caches = _filled(arch, n)
    raw, q8 = caches["raw"], caches["int8"]
    q = q8.layers[0].q
    assert q == GROUP * ((n - 1) // GROUP) and 0 < n - q <= GROUP          # whole groups from slot 0, a tail
    _assert_holds(q8.raw_kv(), _reference_quantized(raw.raw_kv(), q), q)
    assert q8.positions.tolist() == raw.positions.tolist()


@pytest.mark.parametrize("sizes", [[150, 1, 1, 1, 40, 1, 1], [1] * 70, [32, 32, 1, 200]])
def test_appends_seal_whole_groups_from_the_tail(sizes):
    g = torch.Generator().manual_seed(len(sizes))
    T = sum(sizes)
    kv = [(torch.randn(2, 3, T, 64, generator=g), torch.randn(2, 3, T, 64, generator=g)) for _ in range(2)]
    spec = _spec(64, 64, RopeLayout.HALF, 1.0)
    c = PositionedKV([spec, spec], storage="int8")
    a = 0
    for S in sizes:
        c.append_raw_([(k[:, :, a: a + S], v[:, :, a: a + S]) for k, v in kv], torch.arange(a, a + S))
        a += S
        q = c.layers[0].q
        assert q == GROUP * ((a - 1) // GROUP) and 0 < a - q <= GROUP
    _assert_holds(c.raw_kv(), _reference_quantized(kv, q), q)


def _stored(cache):
    """Per layer (keys, values) float64 from the int8 cache's codes, scales and tail, by the float64 oracle."""
    return [dequant_q8_ref(l.k_codes[:, :, : l.n], l.rows[: l.n], l.ks, l.kt, l.q, l.v_codes[:, :, : l.n], l.vs[:, :, : l.n],
                           l.vt) for l in cache.layers]


def _dynamic_reference(model, cfg, cache, kv):
    """A DynamicCache holding float64 keys `kv` rotated to `cache`'s positions by explicit matrices (fp32)."""
    dc = DynamicCache(config=cfg)
    pos = cache.positions
    for i, ((k, v), spec) in enumerate(zip(kv, cache.specs)):
        dc.update(rotate_ref(k, pos, spec).float(), v.float(), i)
    return dc


def _decode_steps(model, tokens, pos0, **kw):
    out = []
    with torch.no_grad():
        for j, t in enumerate(tokens):
            out.append(model(torch.tensor([[t]]), position_ids=torch.tensor([[pos0 + j]]), use_cache=True,
                             **kw).logits[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_decode_equals_transformers_over_the_reference_quantization(arch):
    model, cfg, caches = _filled(arch, 150)
    q8 = caches["int8"]
    _assert_holds(q8.raw_kv(), _reference_quantized(caches["raw"].raw_kv(), q8.layers[0].q), q8.layers[0].q)
    dc = _dynamic_reference(model, cfg, q8, _stored(q8))      # what the cache stores (the quantizer checked above)
    tokens, pos0 = [5, 9, 11], int(q8.next_position()[0])
    want = _decode_steps(model, tokens, pos0, cache=dc)
    got = _decode_steps(model, tokens, pos0, cache=q8)
    assert (got - want).abs().max() < 1e-4
    assert q8.read_counts == {"fused": 3 * cfg.num_hidden_layers, "torch": 0}


@pytest.mark.parametrize("arch", ["llama", "gemma3", "glm"])
def test_the_torch_read_path_computes_what_the_fused_kernel_computes(arch):
    model, cfg, caches = _filled(arch, 190)
    n_layers = cfg.num_hidden_layers
    fused = caches["int8"]
    ref = fused.copy()
    ref.read = "torch"
    pos0 = int(fused.next_position()[0])
    a = _decode_steps(model, [4, 6, 8, 10], pos0, cache=fused)          # 190 = 5 groups + 30: seals at the 3rd
    b = _decode_steps(model, [4, 6, 8, 10], pos0, cache=ref)
    assert (a - b).abs().max() < 1e-4
    assert fused.layers[0].q == 192 and ref.layers[0].q == 192
    assert fused.read_counts["fused"] == 4 * n_layers and ref.read_counts["fused"] == 0


def _same(kv_a, kv_b, keep=None):
    return all(torch.equal(a, b if keep is None else b[:, :, keep])
               for pa, pb in zip(kv_a, kv_b) for a, b in zip(pa, pb))


def _check_decode(model, cfg, c, tokens=(5, 9)):
    """Decode steps on `c` equal transformers' forward over a DynamicCache of what `c` stores."""
    dc = _dynamic_reference(model, cfg, c, _stored(c))
    pos0 = int(c.next_position()[0])
    got = _decode_steps(model, list(tokens), pos0, cache=c)
    assert (got - _decode_steps(model, list(tokens), pos0, cache=dc)).abs().max() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma3", "glm"])
def test_position_operations_move_codes_only_and_decode_reads_them(arch):
    model, cfg, caches = _filled(arch, 150)
    c = caches["int8"]
    before, l0 = c.raw_kv(), c.layers[0]
    state = [(b.data_ptr(), b._version) for b in l0.buffers()]
    c.shift_(10, 30, 7)
    c.set_positions_(0, 2, torch.tensor([300, 301]))
    c.hide_(40, 45)
    c.unhide_(40, 45)
    assert [(b.data_ptr(), b._version) for b in l0.buffers()] == state and _same(c.raw_kv(), before)
    c.delete_(2, 5, close_gap=True)                    # among sealed slots
    c.delete_(140, 142)                                # in the tail: it stays the tail
    keep = [i for i in range(150) if not (2 <= i < 5 or 143 <= i < 145)]        # 140, 141 after the first delete
    assert _same(c.raw_kv(), before, keep) and (l0.q, l0.n) == (125, 145)
    assert l0.nrows == 4 and int(l0.rows[: l0.q].max()) == 3
    _check_decode(model, cfg, c)


def test_delete_of_a_whole_group_drops_its_scale_rows():
    model, cfg, caches = _filled("llama", 200)          # 6 groups of 32, tail 8
    c = caches["int8"]
    before = c.raw_kv()
    c.delete_(64, 128)
    assert _same(c.raw_kv(), before, list(range(64)) + list(range(128, 200)))
    l0 = c.layers[0]
    assert (l0.q, l0.nrows, sorted(set(l0.rows[: l0.q].tolist()))) == (128, 4, [0, 1, 2, 3])
    _check_decode(model, cfg, c)


def test_reordering_the_tail_among_sealed_slots_seals_it_as_one_group():
    model, cfg, caches = _filled("llama", 150)          # q = 128, tail 22
    c = caches["int8"]
    before = c.raw_kv()
    order = list(range(128, 150)) + list(range(128))    # the tail first
    c.keep_(order)
    l0 = c.layers[0]
    assert (l0.q, l0.n) == (150, 150)
    assert _same([(k[:, :, 22:], v[:, :, 22:]) for k, v in c.raw_kv()], before, list(range(128)))
    tail = [(k[:, :, 128:], v[:, :, 128:]) for k, v in caches["raw"].raw_kv()]
    _assert_holds([(k[:, :, :22], v[:, :, :22]) for k, v in c.raw_kv()], _reference_quantized(tail, 22), 22)
    _check_decode(model, cfg, c)


@pytest.mark.parametrize("drop", [10, 30])             # inside the tail / into the sealed slots
def test_crop_then_decode(drop):
    model, cfg, caches = _filled("llama", 150)
    c = caches["int8"]
    before = c.raw_kv()
    c.crop(-drop)
    assert _same(c.raw_kv(), before, list(range(150 - drop)))
    assert c.layers[0].q == min(128, 150 - drop)
    _check_decode(model, cfg, c, tokens=(5, 9, 11))


def test_reorder_rows_and_copy_keep_what_each_row_stores():
    model, cfg = tiny_model("llama")
    ids = torch.randint(3, cfg.vocab_size, (2, 100), generator=torch.Generator().manual_seed(3))
    c = PositionedCache.from_model(model, storage="int8")
    with torch.no_grad():
        extend(model, c, ids)
    before = c.raw_kv()
    dup = c.copy()
    c.reorder_rows_([1, 1, 0])
    for (k, v), (k0, v0) in zip(c.raw_kv(), before):
        assert torch.equal(k, k0[[1, 1, 0]]) and torch.equal(v, v0[[1, 1, 0]])
    assert _same(dup.raw_kv(), before) and dup.layers[0].q == c.layers[0].q == 96


def _raising_layer(model, index):
    def boom(*a, **k):
        raise RuntimeError("boom in layer")
    return model.model.layers[index].self_attn.register_forward_pre_hook(boom)


def test_a_forward_failing_part_way_is_rolled_back_even_after_a_layer_sealed_a_group():
    model, cfg, caches = _filled("llama", 128)          # q = 96, a full tail of 32: the next token seals a group
    c = caches["int8"]
    before, l0, twin = c.raw_kv(), c.layers[0], c.copy()
    state = (l0.q, l0.n, l0.nrows)
    h = _raising_layer(model, 1)
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        model(torch.tensor([[7]]), position_ids=torch.tensor([[128]]), cache=c, use_cache=True)
    h.remove()
    assert _same(c.raw_kv(), before) and (l0.q, l0.n, l0.nrows) == state and c.num_slots == 128
    a, b = (_decode_steps(model, [7, 3], 128, cache=x) for x in (c, twin))    # works on, as if nothing happened
    assert torch.equal(a, b) and l0.q == 128


def test_appending_block_restores_after_whole_steps():
    model, cfg, caches = _filled("llama", 120)
    c = caches["int8"]
    before = c.raw_kv()
    with pytest.raises(KeyError), c.appending():
        _decode_steps(model, [4, 5, 6, 7, 8, 9, 10, 11, 12], 120, cache=c)      # seals [96, 128)
        assert c.layers[0].q == 128
        raise KeyError("stop")
    assert _same(c.raw_kv(), before) and c.layers[0].q == 96 and c.num_slots == 120
    _check_decode(model, cfg, c)


def test_fused_refusal_and_auto_fallback(monkeypatch):
    model, cfg, caches = _filled("llama", 100)
    c = caches["int8"]
    strict = c.copy()
    strict.read = "fused"
    before = strict.raw_kv()
    monkeypatch.setattr(kvpos.cache.reads, "decode_q8_kernel", lambda *a, **k: None)
    with pytest.raises(ValueError, match="fused"), torch.no_grad():
        model(torch.tensor([[9]]), position_ids=torch.tensor([[100]]), cache=strict, use_cache=True)
    assert _same(strict.raw_kv(), before) and strict.num_slots == 100
    ref = c.copy()
    with torch.no_grad():
        a = model(torch.tensor([[9]]), position_ids=torch.tensor([[100]]), cache=c, use_cache=True).logits
    monkeypatch.undo()
    with torch.no_grad():
        b = model(torch.tensor([[9]]), position_ids=torch.tensor([[100]]), cache=ref, use_cache=True).logits
    assert c.read_counts["torch"] == cfg.num_hidden_layers and ref.read_counts["fused"] == cfg.num_hidden_layers
    assert (a - b).abs().max() < 1e-4


def test_what_int8_storage_refuses():
    model, cfg, caches = _filled("llama", 20)
    c = caches["int8"]
    with pytest.raises(ValueError, match="storage='int8'"):
        with c.overwriting(torch.tensor([3, 4])):
            pass
    spec = c.specs
    with pytest.raises(ValueError, match="capacity"):
        PositionedKV(spec, storage="int8", capacity=64)
    with pytest.raises(ValueError, match="raw_dtype"):
        PositionedKV(spec, raw_dtype=torch.float32, storage="int8")
    register_pytree()
    with pytest.raises(ValueError, match="int8"):
        torch.utils._pytree.tree_flatten(c)
    with pytest.raises(ValueError, match="compile"):
        with torch.no_grad(), pytest.MonkeyPatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            c.layers[0].append(None, torch.zeros(1, 3, 1, 16), torch.zeros(1, 3, 1, 16))
    assert c.num_slots == 20 and c.layers[0].n == 20


@pytest.mark.parametrize("dtype,limit", [(torch.float32, 0.30), (torch.bfloat16, 0.55)])
@pytest.mark.parametrize("T", [2048, 2000 + GROUP - 1])          # worst case: a full tail
def test_bytes_against_a_plain_cache(dtype, limit, T):
    """The issue's memory bar in SmolLM2's shape (30 layers, 3 kv heads, head_dim 64); a plain cache holds
    2 * L * H * T * D elements of `dtype`."""
    spec = _spec(64, 64, RopeLayout.HALF, 1.0)
    c = PositionedKV([spec] * 30, storage="int8")
    kv = [(torch.randn(1, 3, T, 64).to(dtype), torch.randn(1, 3, T, 64).to(dtype))] * 30
    c.append_raw_(kv, torch.arange(T))
    plain = 2 * 30 * 3 * T * 64 * torch.empty(0, dtype=dtype).element_size()
    assert c.nbytes() / plain <= limit


# -- chunk reuse into int8 storage ---------------------------------------------------------------------------------------
def test_compose_into_int8_storage_is_exact_while_everything_fits_the_tail():
    from kvpos.integrations.compose import ChunkComposer
    from test_compose import _reference, _setup

    model, anchor, chunks, q = _setup()                   # 5 + ~20 tokens: all in the unquantized tail
    cache, _ = ChunkComposer(model, anchor).compose([chunks[2], chunks[0], chunks[1]], storage="int8")
    assert cache.storage == "int8" and cache.layers[0].q == 0
    got = extend(model, cache, q)
    ref = _reference(model, anchor, [chunks[2], chunks[0], chunks[1]], q, "sequential")
    assert (got - ref[:, -4:]).abs().max() < 1e-4


def test_compose_into_int8_storage_quantizes_what_the_float_cache_holds():
    from kvpos.integrations.compose import ChunkComposer

    model, cfg = tiny_model("llama")
    g = torch.Generator().manual_seed(5)
    anchor = torch.randint(3, 128, (5,), generator=g)
    chunks = [torch.randint(3, 128, (40,), generator=g) for _ in range(3)]
    cc = ChunkComposer(model, anchor)
    float_cache, _ = cc.compose(chunks)
    q8, _ = cc.compose(chunks, storage="int8")
    q = q8.layers[0].q
    assert q == 96 and q8.num_slots == 125 and q8.positions.tolist() == float_cache.positions.tolist()
    _assert_holds(q8.raw_kv(), _reference_quantized(float_cache.raw_kv(), q), q)
    with pytest.raises(ValueError, match="storage='int8'"):
        cc.compose(chunks, link_k=4, storage="int8")


def test_rag_methods_refuse_int8_with_repairs():
    from kvpos.ape import ApeParams
    from kvpos.integrations.rag import RagMethod

    assert RagMethod("x", storage="int8").storage == "int8"
    for kw in ({"link_k": 4}, {"recompute_ratio": 0.1}, {"attn_ratio": 0.1}, {"ape": ApeParams(0.9, 1.0)}):
        with pytest.raises(ValueError, match="storage='int8'"):
            RagMethod("x", storage="int8", **kw)
    with pytest.raises(ValueError, match="storage"):
        RagMethod("x", storage="int4")
    with pytest.raises(ValueError, match="prefix"):
        RagMethod("x", layout="prefix", storage="int8")


# -- code edits on int8 storage ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["full", "prefix", "pie", "naive", "pie+k2+tail4"])
@pytest.mark.parametrize("kind", ["insert", "delete", "multi"])
def test_edits_on_int8_storage_equal_the_float_session_while_the_document_fits_the_tail(strategy, kind):
    """A 20-token document lives in the unquantized tail, so every strategy must give the float session's numbers:
    this checks the int8 edit path (pieces encoded one after another, kept pieces appended) exactly."""
    from kvpos.integrations.pie import EditSession
    from test_pie import EDIT_SETS, _doc, _probe

    model = tiny_model("llama", num_hidden_layers=3)[0]
    doc = _doc(1, 20)
    f, q = EditSession(model, doc), EditSession(model, doc, storage="int8")
    rf, rq = f.apply(EDIT_SETS[kind], strategy), q.apply(EDIT_SETS[kind], strategy)
    assert q.cache.storage == "int8" and q.cache.layers[0].q == 0
    assert torch.equal(f.ids, q.ids) and rf.tokens_encoded == rq.tokens_encoded
    assert (_probe(f) - _probe(q)).abs().max() < 1e-4
    assert torch.equal(f.generate(6), q.generate(6))


def test_edits_on_int8_storage_beyond_the_tail_and_refused_repairs():
    from kvpos.integrations.pie import EditSession

    model = tiny_model("llama", num_hidden_layers=2)[0]
    doc = torch.randint(3, 128, (150,), generator=torch.Generator().manual_seed(4))
    q = EditSession(model, doc, storage="int8")
    q.apply([Insert(60, [5, 6, 7]), Delete(100, 104)], "pie")
    assert q.length == 149 and q.cache.num_slots == 149 and q.cache.positions.tolist() == [list(range(149))]
    assert q.cache.layers[0].q > 0 and q.generate(4).numel() == 4
    before = q.cache.raw_kv()
    with pytest.raises(ValueError, match="storage='int8'"):
        q.apply([Insert(10, [9])], "pie+blend10")
    assert _same(q.cache.raw_kv(), before) and q.length == 149


def test_appending_block_restores_after_a_crop_into_sealed_slots_and_new_seals():
    """A crop below the sealed slots followed by appends that seal again must not write into what the rollback
    point reads (transformers' assisted decoding crops inside generate)."""
    model, cfg, caches = _filled("llama", 150)          # q = 128
    c = caches["int8"]
    before = c.raw_kv()
    with pytest.raises(KeyError), c.appending():
        c.crop(-30)                                     # q = 120
        _decode_steps(model, list(range(4, 44)), 120, cache=c)        # 40 tokens: seals [120, 152)
        assert c.layers[0].q == 152
        raise KeyError("stop")
    assert _same(c.raw_kv(), before) and c.layers[0].q == 128 and c.num_slots == 150
    _check_decode(model, cfg, c)


# -- random sequences: layer 0 against a raw-storage twin ----------------------------------------------------------------
def _layer0_within_half_a_step(q8, raw, kmax):
    """Layer 0's keys and values depend on the token and its position only, so the int8 cache and a raw twin fed
    the same operations hold the same layer-0 raw KV up to quantization: every element within half a step of its
    group (a key group's step is at most kmax / 127, kmax [B, H, 1, D] the channel's absmax over every token the
    cache ever held; a value's, its token's absmax / 127), tail slots exactly."""
    (k, v), (rk, rv) = q8.raw_kv()[0], raw.raw_kv()[0]
    bound_k = kmax / 127 * 0.5 * (1 + 1e-3) + 1e-6
    bound_v = rv.abs().amax(3, keepdim=True) / 127 * 0.5 * (1 + 1e-3) + 1e-6
    assert bool(((k - rk).abs() <= bound_k).all()) and bool(((v - rv).abs() <= bound_v).all())
    l0 = q8.layers[0]
    assert torch.equal(k[:, :, l0.q:], rk[:, :, l0.q:]) and torch.equal(v[:, :, l0.q:], rv[:, :, l0.q:])


@contextlib.contextmanager
def _refusal(log):
    try:
        yield
    except ValueError:
        log.append(True)


@pytest.mark.parametrize("seed", range(int(__import__("os").environ.get("KVPOS_INT8_SEEDS", "3"))))
def test_random_operation_sequences_keep_layer0_within_quantization_of_a_raw_twin(seed):
    import random

    model, cfg = tiny_model("llama")
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    caches = {s: PositionedCache.from_model(model, storage=s) for s in ("raw", "int8")}
    ids = torch.randint(3, 128, (2, 45), generator=g)
    for c in caches.values():
        extend(model, c, ids)
    kmax = caches["raw"].raw_kv()[0][0].abs().amax(2, keepdim=True)
    for step in range(25):
        n = caches["raw"].num_slots
        op = rnd.choice(["extend", "extend", "decode", "delete", "keep", "shift", "hide", "crop", "rows"])
        a, b = sorted(rnd.sample(range(n + 1), 2))
        b = min(b, a + n - 1)                                           # never delete every slot
        new = torch.randint(3, 128, (2, rnd.choice([1, 2, 5, 40])), generator=g)
        perm = sorted(rnd.sample(range(n), max(1, n - 5)))
        if op == "keep" and rnd.random() < 0.5:
            rnd.shuffle(perm)
        close = rnd.random() < 0.5
        refused = []
        for c in caches.values():
            with torch.no_grad(), _refusal(refused):
                if op in ("extend", "decode"):
                    extend(model, c, new if op == "extend" else new[:, :1])
                elif op == "delete":
                    c.delete_(a, b, close_gap=close)
                elif op == "keep":
                    c.keep_(perm)
                elif op == "shift":
                    c.shift_(a, b, 3)
                elif op == "hide":
                    c.hide_(a, b)
                elif op == "crop":
                    c.crop(-min(b - a, n - 1))
                else:
                    c.reorder_rows_([1, 0])
        assert refused in ([], [True, True]), refused                   # both refuse, or neither
        kmax = kmax[[1, 0]] if op == "rows" and not refused else kmax
        kmax = torch.maximum(kmax, caches["raw"].raw_kv()[0][0].abs().amax(2, keepdim=True))
        assert caches["int8"].positions.tolist() == caches["raw"].positions.tolist()
        assert caches["int8"].visible.tolist() == caches["raw"].visible.tolist()
        _layer0_within_half_a_step(caches["int8"], caches["raw"], kmax)
    q8 = caches["int8"]
    ref = q8.copy()
    ref.read = "torch"
    nxt = q8.next_position()
    x = extend(model, q8, torch.tensor([[7], [8]]))
    y = extend(model, ref, torch.tensor([[7], [8]]))
    assert (x - y).abs().max() < 1e-4 and int(q8.next_position()[0]) == int(nxt[0]) + 1
