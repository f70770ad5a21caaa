"""Reliability: failed forwards and allocations leave the cache as it was, stores verify every byte and never leave
their root, fingerprints see every weight, Redis faults honour the fallback and the timeout, models are not mixed."""
import os
import sys
import time

import pytest
import torch

from kvpos import PositionedKV, RopeSpec, UnsupportedRopeError
from kvpos.integrations.hf import rope_specs_from_model
from kvpos.store import (ChunkKV, ChunkStore, CorruptChunkError, DiskBackend, Fingerprint, FingerprintMismatch,
                         MemoryBackend, RedisBackend, StoreServerError, StoreUnavailable, WeightsDigest, deserialize,
                         serialize)
from kvpos.integrations.compose import ChunkComposer
from kvpos.integrations.hf import PositionedCache, extend, generate
from kvpos.integrations.hf.testing import tiny_model
from kvpos.integrations.rag import RagPipeline

FP = Fingerprint(model="m" * 64, weights="w" * 64, dtype="float32", anchor="a" * 64, rope="r" * 64)


def snapshot(cache: PositionedKV) -> dict:
    """Everything observable about a cache: slots, positions, visibility, labels, every layer's valid bytes."""
    n = cache.table.n
    return {"n": n, "layers": [l.n for l in cache.layers], "pos": cache.table.pos.clone(),
            "vis": cache.table.visible.clone(), "seg": cache.table.segment.clone(),
            "kv": [tuple(t[:, :, :n].clone() for t in (l.rot_k, l.raw_k, l.v)) if l.rot_k is not None else None
                   for l in cache.layers]}


def same(a: dict, b: dict) -> None:
    assert a["n"] == b["n"] and a["layers"] == b["layers"]
    for k in ("pos", "vis", "seg"):
        assert torch.equal(a[k], b[k]), k
    for x, y in zip(a["kv"], b["kv"]):
        assert (x is None) == (y is None)
        if x is not None:
            assert all(torch.equal(p, q) for p, q in zip(x, y))


class Boom(RuntimeError):
    pass


def _raise_in_layer(model, layer: int, after_calls: int = 0, exc=Boom):
    """A forward pre-hook on decoder layer `layer` that raises on its (after_calls+1)-th call: earlier layers of
    that forward have written their slots, this one and later ones have not."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] > after_calls:
            raise exc(f"injected in layer {layer}")

    return model.model.layers[layer].register_forward_pre_hook(hook)


# ---------------------------------------------------------------------------------------------------------------------
# 1. a failed forward leaves the cache exactly as it was
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gemma3"])
def test_an_exception_at_each_layer_of_extend_leaves_the_cache_as_before(arch, fuzz_record):
    over = {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]} if arch == "gemma3" else {}
    model = tiny_model(arch, num_hidden_layers=3, **over)[0]
    layers = model.gpt_neox.layers if arch == "gpt_neox" else model.model.layers
    cache = PositionedCache.from_model(model)
    extend(model, cache, torch.randint(3, 128, (1, 7)))
    cache.shift_(2, 5, 40)
    before = snapshot(cache)
    for i in range(3):
        h = layers[i].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(Boom("x")))
        try:
            with pytest.raises(Boom):
                extend(model, cache, torch.randint(3, 128, (1, 4)))
        finally:
            h.remove()
        same(before, snapshot(cache))
        fuzz_record("forward faults (exception in layer i)", "clear error")
    ref = cache.copy()
    q = torch.randint(3, 128, (1, 3))
    assert torch.equal(extend(model, cache, q), extend(model, ref, q))      # usable, and as it was


def test_a_wrong_attention_mask_is_refused_before_touching_the_cache():
    model = tiny_model("llama")[0]
    cache = PositionedCache.from_model(model)
    extend(model, cache, torch.randint(3, 128, (1, 6)))
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"extend attention_mask: expected a 4-D \[B\|1, 1, S, T\+S\]"):
        extend(model, cache, torch.randint(3, 128, (1, 3)), attention_mask=torch.ones(1, 1, 3, 5, dtype=torch.bool))
    same(before, snapshot(cache))
    cache.shift_(0, 2, 3)                                                    # operations still work


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_generate_that_raises_mid_decoding_leaves_the_cache_as_before(exc):
    model = tiny_model("llama")[0]
    cache = PositionedCache.from_model(model)
    extend(model, cache, torch.randint(3, 128, (1, 6)))
    before = snapshot(cache)
    h = _raise_in_layer(model, 1, after_calls=3, exc=exc)                   # prompt + 2 decode steps succeed
    try:
        with pytest.raises(exc):
            generate(model, cache, torch.randint(3, 128, (1, 2)), max_new_tokens=8, do_sample=False)
    finally:
        h.remove()
    same(before, snapshot(cache))


def test_plain_model_generate_that_raises_rolls_back_the_failed_forward_only():
    """Through transformers' own generate (no kvpos wrapper) the steps that finished stay, like a DynamicCache;
    the forward that raised part way is undone before the cache is used again."""
    model = tiny_model("llama", num_hidden_layers=3)[0]
    cache = PositionedCache.from_model(model)
    ids = torch.randint(3, 128, (1, 6))
    h = _raise_in_layer(model, 2, after_calls=3)                            # forwards 1-3 finish, the 4th fails in layer 2
    try:
        with pytest.raises(Boom):
            model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False)
    finally:
        h.remove()
    assert cache.num_slots == 6 + 2 and [l.n for l in cache.layers] == [8, 8, 8]
    ref = PositionedCache.from_model(model)
    out = model.generate(ids, cache=ref, max_new_tokens=3, do_sample=False)   # 3 forwards: 6 + 2 slots
    same(snapshot(ref), snapshot(cache))
    cont = generate(model, cache, out[:, -1:], max_new_tokens=3, do_sample=False)
    assert cont.shape == (1, 4)


def test_a_failed_overwrite_restores_the_overwritten_slots():
    model = tiny_model("llama", num_hidden_layers=3)[0]
    g = torch.Generator().manual_seed(0)
    composer = ChunkComposer(model, torch.randint(3, 128, (4,), generator=g))
    chunks = [torch.randint(3, 128, (6,), generator=g) for _ in range(3)]
    cache, _ = composer.compose(chunks)
    before = snapshot(cache)
    from kvpos.integrations.compose import recompute_slots
    slots = torch.tensor([10, 11, 16])
    h = _raise_in_layer(model, 2)
    try:
        with pytest.raises(Boom):
            recompute_slots(model, cache, slots, torch.randint(3, 128, (3,)), torch.ones(3, cache.num_slots,
                                                                                            dtype=torch.bool))
    finally:
        h.remove()
    same(before, snapshot(cache))


# ---------------------------------------------------------------------------------------------------------------------
# 2. growth is all-or-nothing
# ---------------------------------------------------------------------------------------------------------------------

def _spec_cache(B=1, H=2, D=8, T=60, L=3):
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    c = PositionedKV([RopeSpec(inv, 1.0, D, D)] * L)
    kv = [(torch.randn(B, H, T, D), torch.randn(B, H, T, D)) for _ in range(L)]
    c.append_raw_(kv, torch.arange(T))
    return c


def _failing_allocations(monkeypatch, fail_at: int) -> list:
    """Make the fail_at-th allocation made by the kvpos/cache/ package raise (torch.empty / zeros / ones)."""
    count = [0]
    for name in ("empty", "zeros", "ones"):
        real = getattr(torch, name)

        def fake(*a, _real=real, **k):
            if os.path.join("kvpos", "cache", "") in sys._getframe(1).f_code.co_filename:
                count[0] += 1
                if count[0] == fail_at:
                    raise MemoryError(f"injected allocation failure #{fail_at}")
            return _real(*a, **k)

        monkeypatch.setattr(torch, name, fake)
    return count


def test_an_allocation_failure_at_each_buffer_leaves_the_cache_unchanged_and_usable(monkeypatch, fuzz_record):
    extra = [(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)) for _ in range(3)]   # 60 + 10 > 64: growth
    probe = _spec_cache()
    with monkeypatch.context() as m:
        count = _failing_allocations(m, fail_at=10 ** 9)
        probe.append_raw_(extra, torch.arange(100, 110))
        n_alloc = count[0]
    assert n_alloc >= 4, "the growth path allocates one buffer per layer buffer and the table"
    for k in range(1, n_alloc + 1):
        cache = _spec_cache()
        before = snapshot(cache)
        with monkeypatch.context() as m:
            _failing_allocations(m, fail_at=k)
            with pytest.raises(MemoryError):
                cache.append_raw_(extra, torch.arange(100, 110))
        same(before, snapshot(cache))
        fuzz_record("allocation faults (each buffer)", "clear error")
        cache.append_raw_(extra, torch.arange(100, 110))                      # the next append is correct
        for l, (raw, _) in zip(cache.layers, extra):
            assert torch.equal(l.raw_keys[:, :, 60:], raw)


def test_an_allocation_failure_inside_a_forward_leaves_the_cache_unchanged(monkeypatch):
    model = tiny_model("llama")[0]
    cache = PositionedCache.from_model(model)
    extend(model, cache, torch.randint(3, 128, (1, 62)))
    before = snapshot(cache)
    for k in (1, 2, 3, 4):
        with monkeypatch.context() as m:
            _failing_allocations(m, fail_at=k)
            with pytest.raises(MemoryError):
                extend(model, cache, torch.randint(3, 128, (1, 5)))          # 62 + 5 > 64: growth in every layer
        same(before, snapshot(cache))


# ---------------------------------------------------------------------------------------------------------------------
# 3. an empty MemoryBackend is a backend
# ---------------------------------------------------------------------------------------------------------------------

def test_an_empty_memory_backend_given_by_the_caller_is_used():
    model = tiny_model("llama")[0]
    mb = MemoryBackend(1 << 16)
    composer = ChunkComposer(model, torch.tensor([1, 4, 5]), backend=mb)
    assert composer.store.backend is mb
    composer.precompute([torch.tensor([7, 8, 9])], progress=False)
    assert len(mb) == 1 and mb.max_bytes == 1 << 16

    class Tok:
        eos_token_id = 2

        def __call__(self, text, add_special_tokens=False):
            return type("E", (), {"input_ids": [3 + (ord(c) % 100) for c in text]})()

    class Builder:
        anchor_ids = torch.tensor([1, 4, 5])

    mb2 = MemoryBackend(1 << 16)
    assert RagPipeline(model, Tok(), builder=Builder(), backend=mb2).composer.store.backend is mb2


# ---------------------------------------------------------------------------------------------------------------------
# 4. every byte of an entry is verified
# ---------------------------------------------------------------------------------------------------------------------

def _chunk(seed=0, S=7):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randint(0, 1000, (S,), generator=g), torch.randn(2, 2, S, 8, generator=g),
                   torch.randn(2, 2, S, 8, generator=g), 5, FP, {"src": "test"})


def _rewrite_header(blob: bytes, edit) -> bytes:
    """A blob whose JSON header went through edit(dict) -> dict (tensor bytes untouched; offsets kept valid)."""
    import json
    import struct
    n = struct.unpack("<Q", blob[:8])[0]
    head = edit(json.loads(blob[8:8 + n]))
    raw = json.dumps(head).encode() if not isinstance(head, bytes) else head
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + blob[8 + n:]


def _meta_edit(key, value):
    def edit(h):
        h["__metadata__"][key] = value
        return h
    return edit


@pytest.mark.parametrize("edit,match", [
    (_meta_edit("start", "4"), "checksum mismatch"),                                   # one flipped digit
    (_meta_edit("meta", '{"src": "tampered"}'), "checksum mismatch"),
    (_meta_edit("fingerprint", FP.to_json().replace("float32", "bfloat16")), "checksum mismatch"),
    (lambda h: [1, 2], "header object"),                                              # valid JSON, not an object
    (lambda h: b"{not json", "unreadable safetensors header"),
    (lambda h: {k: v for k, v in h.items() if k != "__metadata__"}, "header object with __metadata__"),
    (lambda h: {**h, "__metadata__": {k: v for k, v in h["__metadata__"].items() if k != "start"}},
     "expected metadata"),
    (lambda h: {**h, "__metadata__": {**h["__metadata__"], "start": 5}}, "expected metadata"),  # wrong type
    (lambda h: {**h, "__metadata__": {**h["__metadata__"], "format": "1"}}, "format 2, got '1' .its checksum"),
])
def test_damaged_or_crafted_headers_are_corrupt_entries(edit, match):
    blob = serialize(_chunk())
    with pytest.raises(CorruptChunkError, match=match):
        deserialize(_rewrite_header(blob, edit))


def test_a_crafted_entry_with_a_valid_checksum_but_bad_fields_is_corrupt():
    """Re-signing is possible (the checksum is not a secret): a crafted entry must still parse into exactly the
    expected fields and types, or be refused as corrupt (never a KeyError / AttributeError / JSONDecodeError)."""
    from safetensors.torch import save

    from kvpos.store import _checksum
    c = _chunk()
    tensors = {"ids": c.ids, "keys": c.raw_keys, "values": c.values}
    good = {"format": "2", "start": "5", "fingerprint": FP.to_json(), "meta": "{}"}
    for bad in ({"start": "-3"}, {"start": "5.0"}, {"meta": "[1]"}, {"fingerprint": "{}"},
                {"fingerprint": '{"model": 1, "weights": "w", "dtype": "d", "anchor": "a", "rope": "r", "format": 2}'},
                {"fingerprint": "[]"}):
        meta = {**good, **bad}
        meta["checksum"] = _checksum(tensors, meta)
        with pytest.raises(CorruptChunkError):
            deserialize(save(tensors, metadata=meta))
    for t in ({**tensors, "ids": c.ids.float()}, {**tensors, "values": c.values[:, :, :3].contiguous()},
              {**tensors, "keys": c.raw_keys.to(torch.int32)}):
        meta = dict(good)
        meta["checksum"] = _checksum(t, meta)
        with pytest.raises(CorruptChunkError):
            deserialize(save(t, metadata=meta))


@pytest.mark.parametrize("scheme,edit", [
    ("int8", "huge_scale"), ("int8", "nan_scale"), ("int4", "huge_scale"), ("float", "nan_key"),
    ("float", "inf_value"), ("bfloat16", "nan_key")])
def test_a_resigned_entry_with_non_finite_content_is_corrupt(scheme, edit):
    """Scales that are finite but huge (3e38) dequantize to inf; float entries may carry NaN / inf outright. Both
    are refused as corrupt once re-signed (the checksum alone cannot tell), and a ChunkStore drops them."""
    from safetensors.torch import load, save

    from kvpos.store import _checksum
    c = _chunk()
    if scheme == "bfloat16":
        c = ChunkKV(c.ids, c.raw_keys.bfloat16(), c.values.bfloat16(), c.start, c.fingerprint)
    blob = serialize(c, "float" if scheme == "bfloat16" else scheme)
    n = int.from_bytes(blob[:8], "little")
    import json as _json
    meta = _json.loads(blob[8:8 + n])["__metadata__"]
    t = dict(load(blob))
    if edit == "huge_scale":
        t["keys_scale"] = torch.full_like(t["keys_scale"], 3e38)
    elif edit == "nan_scale":
        t["values_scale"] = t["values_scale"].clone()
        t["values_scale"].view(-1)[0] = float("nan")
    elif edit == "nan_key":
        t["keys"] = t["keys"].clone()
        t["keys"].view(-1)[3] = float("nan")
    else:
        t["values"] = t["values"].clone()
        t["values"].view(-1)[-1] = float("inf")
    meta["checksum"] = _checksum(t, meta)
    crafted = save(t, metadata=meta)
    with pytest.raises(CorruptChunkError, match="finite"):
        deserialize(crafted)
    mem = {}

    class Raw(MemoryBackend):
        def get(self, key):
            return deserialize(mem[key]) if key in mem else None

        def delete(self, key):
            mem.pop(key, None)

    store = ChunkStore(Raw(), FP)
    mem[store.key(c.ids)] = crafted
    assert store.get(c.ids) is None and store.stats.corrupt == 1 and not mem


def test_a_damaged_entry_is_dropped_and_recomputed_not_a_permanent_failure(tmp_path):
    model = tiny_model("llama")[0]
    backend = DiskBackend(tmp_path)
    composer = ChunkComposer(model, torch.tensor([1, 4, 5]), backend=backend)
    ids = torch.tensor([7, 8, 9, 10])
    first, _ = composer.get_or_compute(ids)
    path = backend.path(composer.store.key(ids))
    blob = open(path, "rb").read()
    open(path, "wb").write(_rewrite_header(blob, _meta_edit("start", "4")))
    for _ in range(2):
        chunk, hit = composer.get_or_compute(ids)                # dropped, recomputed, stored again
        assert torch.equal(chunk.raw_keys, first.raw_keys) and chunk.start == 3
    assert hit and composer.store.stats.corrupt == 1


# ---------------------------------------------------------------------------------------------------------------------
# 5. nothing outside the store's root
# ---------------------------------------------------------------------------------------------------------------------

def test_no_key_or_namespace_reaches_outside_the_root(tmp_path):
    root, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.safetensors"
    victim.write_bytes(b"keep me")
    backend = DiskBackend(root)
    for ns in ("../../escaped", "/abs/path", "..", "a/b", "", ".hidden", "x" * 65, None):
        with pytest.raises((ValueError, TypeError), match="namespace: expected 1-64 characters"):
            ChunkStore(backend, FP, namespace=ns)
    for key in ("../../../outside/victim", "/etc/passwd", "../outside/victim", "a/../../b", "", "ok\\..\\x"):
        for op in (backend.delete, backend.get, lambda k: backend.put(k, _chunk())):
            with pytest.raises(ValueError, match="store key: expected"):
                op(key)
    assert victim.read_bytes() == b"keep me"
    # a link inside the root that points out is not followed
    (root / "ns").parent.mkdir(exist_ok=True)
    os.symlink(outside, root / "li")
    with pytest.raises(ValueError, match="store key: expected a path inside"):
        backend.put("link-entry", _chunk())
    assert sorted(os.listdir(outside)) == ["victim.safetensors"]
    assert not any(p.name.startswith("..") for p in tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------------------
# 6. the fingerprint sees every weight and notices changes
# ---------------------------------------------------------------------------------------------------------------------

def test_the_weights_digest_covers_every_weight_and_is_recomputed_only_on_change():
    model = tiny_model("llama")[0]
    w = WeightsDigest(model)
    d0 = w.digest()
    assert w.digest() == d0 and w.computations == 1                        # reused
    with torch.no_grad():
        model.model.embed_tokens.weight[17, 3] += 1e-3                      # one entry of one token's row
    assert w.changed() and w.digest() != d0 and w.computations == 2
    with torch.no_grad():
        model.model.embed_tokens.weight[17, 3] -= 1e-3
    assert w.digest() == d0                                                 # content, not history
    model.model.layers[0].mlp.up_proj.weight.data[0, 0] += 1.0              # .data bypasses version counters
    assert w.digest() == d0 and w.refresh() != d0                           # refresh() sees it (documented)


def test_a_chunk_computed_before_an_in_place_weight_update_is_never_served(tmp_path):
    model = tiny_model("llama")[0]
    backend = DiskBackend(tmp_path)
    composer = ChunkComposer(model, torch.tensor([1, 4, 5]), backend=backend)
    ids = torch.tensor([7, 8, 9, 10])
    old, _ = composer.get_or_compute(ids)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.1)
    with pytest.raises(FingerprintMismatch, match="weights="):
        composer.get_or_compute(ids)
    lenient = ChunkComposer(model, torch.tensor([1, 4, 5]), backend=backend, on_mismatch="recompute")
    new, hit = lenient.get_or_compute(ids)
    fresh = ChunkComposer(model, torch.tensor([1, 4, 5]))                  # independent: a fresh encode
    want, _ = fresh.get_or_compute(ids)
    assert not hit and torch.equal(new.raw_keys, want.raw_keys) and not torch.equal(new.raw_keys, old.raw_keys)


# ---------------------------------------------------------------------------------------------------------------------
# 7. Redis faults: mapped, fallback honoured, timeout honoured
# ---------------------------------------------------------------------------------------------------------------------

@pytest.fixture
def redis_port(tmp_path):
    """A redis-server of this test alone (the tests reconfigure and pause it)."""
    from redis_server import start_redis
    proc, port = start_redis(tmp_path)
    yield port
    proc.terminate()
    proc.wait(5)


def test_redis_server_errors_are_store_unavailable_and_honour_the_fallback(redis_port):
    rb = RedisBackend(port=redis_port, prefix="f:")
    rb.client.set("f:filler", b"x" * (2 << 20))
    rb.client.config_set("maxmemory-policy", "noeviction")
    rb.client.config_set("maxmemory", "1mb")                               # over the limit: writes now fail
    big = _chunk(S=64)
    with pytest.raises(StoreServerError, match="the server answered OutOfMemoryError"):
        ChunkStore(rb, FP).put(big)
    lenient = ChunkStore(rb, FP, on_unavailable="recompute")
    assert lenient.put(big) is False and lenient.stats.unavailable == 1
    rb.client.config_set("maxmemory", "0")
    # a key holding another Redis type: a corrupt entry, dropped, then the slot works again
    store = ChunkStore(rb, FP)
    c = _chunk(4)
    rb.client.rpush("f:" + store.key(c.ids), "x")
    assert store.get(c.ids) is None and store.stats.corrupt == 1
    store.put(c)
    assert torch.equal(store.get(c.ids).raw_keys, c.raw_keys)


def test_redis_timeout_is_honoured_while_the_server_is_paused(redis_port):
    admin = RedisBackend(port=redis_port, prefix="t:")
    slow = RedisBackend(port=redis_port, prefix="t:", timeout_s=0.5)
    slow.ping()
    admin.client.execute_command("CLIENT", "PAUSE", 4000, "ALL")
    t = time.perf_counter()
    with pytest.raises(StoreUnavailable, match="answering within 0.5s"):
        ChunkStore(slow, FP).get(_chunk().ids)
    took = time.perf_counter() - t
    assert took < 2.0, took
    lenient = ChunkStore(slow, FP, on_unavailable="recompute")
    t = time.perf_counter()
    assert lenient.get(_chunk().ids) is None and time.perf_counter() - t < 2.0


def test_redis_backend_arguments_are_checked_at_construction():
    for bad in (-5, 1.5, 0, True):
        with pytest.raises(ValueError, match="RedisBackend ttl_s: expected None or an int number of seconds > 0"):
            RedisBackend(ttl_s=bad)
    for bad in (0, -1, float("inf"), "5"):
        with pytest.raises(ValueError, match="RedisBackend timeout_s"):
            RedisBackend(timeout_s=bad)


# ---------------------------------------------------------------------------------------------------------------------
# 8. longrope past its switch length through model.generate
# ---------------------------------------------------------------------------------------------------------------------

def test_phi3_longrope_past_the_switch_length_raises_through_model_generate():
    model, _ = tiny_model("phi3_longrope")                                  # switch at 64
    cache = PositionedCache.from_model(model)
    with pytest.raises(ValueError, match=r"positions < 64 for rope_type='longrope'"):
        model.generate(torch.randint(3, 128, (1, 50)), cache=cache, max_new_tokens=30, do_sample=False)
    assert cache.num_slots == 64                                            # everything up to the limit, intact
    below = PositionedCache.from_model(model)
    out = model.generate(torch.randint(3, 128, (1, 40)), cache=below, max_new_tokens=10, do_sample=False)
    assert out.shape[1] == 50 and below.num_slots == 49


def test_a_direct_update_names_the_missing_positions_and_works_with_cache_kwargs():
    """transformers' own cache tests call cache.update(k, v, layer) directly: with no positions the error says what
    to pass; with cache_kwargs={"position_ids": ...} the update stores and returns what DynamicCache does."""
    from transformers import DynamicCache
    model = tiny_model("llama")[0]
    cfg = model.config
    B, H, S, D = 1, cfg.num_key_value_heads, 5, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    cache = PositionedCache.from_model(model)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"position_ids: expected the positions the new keys were rotated at.*"
                                         r"cache_kwargs=\{'position_ids': pos\}"):
        cache.update(k, v, 0)
    same(before, snapshot(cache))
    pos = torch.arange(3, 3 + S)[None]
    ref = DynamicCache(config=cfg)
    want = [ref.update(k, v, i) for i in range(cfg.num_hidden_layers)]
    for i in range(cfg.num_hidden_layers):
        got = cache.update(k, v, i, cache_kwargs={"position_ids": pos})
        torch.testing.assert_close(got[0], want[i][0], rtol=0, atol=1e-5)
        assert torch.equal(got[1], want[i][1])
    assert torch.equal(cache.positions, pos)
    got = cache.update(k[:, :, :1], v[:, :, :1], 0, {"position_ids": pos[:, :1] + S})   # the dict positionally
    assert got[0].shape[2] == S + 1 and cache.layers[0].n == S + 1

# ---------------------------------------------------------------------------------------------------------------------
# 9. a cache belongs to one model
# ---------------------------------------------------------------------------------------------------------------------

def test_a_cache_refuses_a_forward_of_another_model_and_concat_across_models():
    a = tiny_model("llama")[0]
    b = tiny_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 1e6})[0]
    ids = torch.randint(3, 128, (1, 6))
    cache = PositionedCache.from_model(a)
    extend(a, cache, ids)
    before = snapshot(cache)
    PositionedCache.from_model(b)                                           # b is hooked too
    with pytest.raises(ValueError, match="cache.update layer 0: expected a forward of the model this cache was"):
        b(ids[:, :2], cache=cache, use_cache=True)
    c = tiny_model("llama", seed=5)[0]                                      # never hooked
    with pytest.raises(ValueError, match="got a forward of a model without kvpos's hook"):
        c(ids[:, :2], cache=cache, use_cache=True)
    same(before, snapshot(cache))
    other = PositionedCache.from_model(c)
    extend(c, other, ids)
    with pytest.raises(ValueError, match=r"concat caches\[1\]: expected a cache of the same model as caches\[0\]"):
        PositionedCache.concat([cache, other])


# ---------------------------------------------------------------------------------------------------------------------
# smaller ones
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,exc,match", [
    (lambda c: c.keep_([0.9, 2.7, 5.5]), TypeError, r"keep_ slots\[0\]: expected an int slot index, got float"),
    (lambda c: c.keep_(torch.tensor([True, False] * 30)), TypeError, "keep_ slots: expected integer slot indices, "
     "got a bool mask; pass mask.nonzero"),
    (lambda c: c.append_raw_([(torch.ones(1, 2, 3, 8, dtype=torch.long),) * 2] * 3, [0, 1, 2]), TypeError,
     r"append_raw_ kv\[0\]: expected floating keys and values"),
    (lambda c: c.append_raw_([(torch.ones(1, 2, 3, 8, dtype=torch.bool),) * 2] * 3, [0, 1, 2]), TypeError,
     "floating keys"),
    (lambda c: c.append_raw_([(torch.ones(1, 2, 3, 8, dtype=torch.complex64),) * 2] * 3, [0, 1, 2]), TypeError,
     "floating keys"),
    (lambda c: c.append_raw_([(torch.ones(1, 2, 3, 8), torch.ones(1, 3, 3, 8))] * 3, [0, 1, 2]), ValueError,
     r"append_raw_ kv\[0\] values: expected \[1, H=2, S=3, Dv=8\]"),
    (lambda c: c.append_raw_([(torch.ones(1, 2, 3, 8), torch.ones(2, 2, 3, 8))] * 3, [0, 1, 2]), ValueError,
     r"append_raw_ kv\[0\] values"),
    (lambda c: c.append_raw_([(torch.ones(1, 2, 3, 8).bfloat16(),) * 2] * 3, [0, 1, 2]), ValueError,
     "keys and values in torch.float32 .the cache's dtype."),
    (lambda c: c.set_positions_(0, 2, [2 ** 62, 1]), ValueError, r"positions < 2\*\*40"),
    (lambda c: c.shift_(0, 2, 2 ** 62), ValueError, r"shift_ delta: expected \|delta\| < 2\*\*40"),
    (lambda c: c.set_segment_(0, 2, 2 ** 31), ValueError, "set_segment_ label: expected an int32 label"),
    (lambda c: c.set_positions_(0, 2, []), ValueError, r"expected 2 positions, shape \[S\]=2"),
])
def test_small_argument_defects_give_clear_errors_and_change_nothing(call, exc, match):
    cache = _spec_cache()
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        call(cache)
    same(before, snapshot(cache))


def test_concat_refuses_mixed_dtypes_and_capacity_shrinks_after_deletions():
    a, b = _spec_cache(), _spec_cache()
    b16 = PositionedKV(b.specs)
    b16.append_raw_([(k.bfloat16(), v.bfloat16()) for k, v in b.raw_kv()], torch.arange(60))
    with pytest.raises(ValueError, match=r"concat caches\[1\]: expected keys in torch.float32 like caches\[0\], got "
                                         "torch.bfloat16"):
        PositionedKV.concat([a, b16])
    big = _spec_cache(T=12800)
    full_bytes = big.nbytes()
    big.delete_(10, 12800)
    assert big.num_slots == 10 and big.nbytes() < full_bytes / 50
    assert big.copy().nbytes() <= big.nbytes()
    c = _spec_cache(T=200)
    assert c.copy().layers[0].capacity == 200                               # a copy holds the slots, not the capacity


def test_gpt_j_is_refused_clearly():
    import transformers as T
    cfg = T.GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=128,
                       bos_token_id=1, eos_token_id=2)
    model = T.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UnsupportedRopeError, match="expected a rotary module with an `inv_freq` buffer"):
        PositionedCache.from_model(model)
    with pytest.raises(UnsupportedRopeError):
        rope_specs_from_model(model)


# ---------------------------------------------------------------------------------------------------------------------
# appending(): a crop below the entry length, appends over the cropped slots, then an exception
# ---------------------------------------------------------------------------------------------------------------------

def _observed(cache) -> tuple:
    """Slot count, positions, visibility, labels and every layer's (raw keys, values), read through public names."""
    return (cache.num_slots, cache.positions, cache.visible, cache.segments, cache.raw_kv())


def _same_observed(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:4], b[1:4])) and all(
        torch.equal(k1, k2) and torch.equal(v1, v2) for (k1, v1), (k2, v2) in zip(a[4], b[4]))


@pytest.mark.parametrize("storage", ["rotated", "raw", "int8"])
@pytest.mark.parametrize("then", ["append", "shift", "delete", "hide", "label"])
def test_appending_restores_every_slot_after_a_crop_below_entry_and_a_rewrite(storage, then):
    """transformers crops above the entry length; a caller may crop below it and then write over the cropped
    slots (or re-position, delete, hide, relabel slots that existed at entry): the block's rollback must still
    restore the keys, values and positions of entry, on every storage."""
    model = tiny_model("llama")[0]
    cache = PositionedCache.from_model(model, storage=storage)
    extend(model, cache, torch.randint(3, 128, (1, 70)))            # int8: two sealed groups and a tail
    before = _observed(cache)
    with pytest.raises(Boom), cache.appending():
        cache.crop(-40)
        if then == "append":
            extend(model, cache, torch.randint(3, 128, (1, 45)))      # over slots 30..69, beyond entry too
        elif then == "shift":
            cache.shift_(0, 10, 7)
        elif then == "delete":
            cache.delete_(2, 5)
        elif then == "hide":
            cache.hide_(0, 3)
        else:
            cache.set_segment_(0, 3, 5)
        raise Boom("after the rewrite")
    assert _same_observed(before, _observed(cache))
    twin = PositionedCache.from_model(model, storage=storage)
    twin.append_raw_(cache.raw_kv(), cache.positions)
    ids = torch.randint(3, 128, (1, 3))                               # works on, as if nothing happened
    assert torch.allclose(extend(model, cache, ids), extend(model, twin, ids), atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# obscure errors: autograd through the cache, compile with autograd, int8 under compile, out-of-vocabulary ids
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("storage", ["rotated", "raw", "int8"])
def test_backward_through_forwards_on_a_positioned_cache_gives_dynamic_cache_gradients(storage):
    """A forward with autograd on (no torch.no_grad) and its backward work on every storage, again and again (the
    cache keeps no graph: a DynamicCache refuses the second backward), and the gradients of a step equal those
    through a DynamicCache holding the same (gradient-free) prefix."""
    from transformers import DynamicCache

    model, cfg = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(3))

    def step_grads(cache, step):
        model.zero_grad()
        model(input_ids=ids[:, step:step + 1], cache=cache, use_cache=True).logits.float().pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    cache = PositionedCache.from_model(model, storage=storage)
    with torch.no_grad():
        model(input_ids=ids[:, :6], cache=cache, use_cache=True)
    for step in (6, 7):
        step_grads(cache, step)
    ref = DynamicCache(config=cfg)
    with torch.no_grad():
        model(input_ids=ids[:, :8], cache=ref, use_cache=True)
    want, got = step_grads(ref, 8), step_grads(cache, 8)
    assert len(want) == len(got) > 0
    tol = 1e-4 if storage != "int8" else 1e-3          # int8: 8 slots stay in the unquantized tail, rounding only
    for a, b in zip(want, got):
        assert torch.allclose(a, b, atol=tol, rtol=tol)


def test_a_compiled_raw_storage_forward_with_autograd_on_runs():
    """The README's compile snippet without torch.no_grad: the traced update writes detached keys, so the
    compiler's autograd sees no in-place write to a tensor it saved."""
    model = tiny_model("llama")[0]
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(4))
    outs = {}
    for compiled in (False, True):
        cache = PositionedCache.from_model(model, storage="raw")
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
        cache.reserve_(cache.num_slots + 4)
        fwd = torch.compile(model.forward, backend="aot_eager") if compiled else model.forward
        outs[compiled] = fwd(input_ids=ids[:, -1:], cache=cache).logits
    assert torch.allclose(outs[False], outs[True], atol=1e-5)


def test_int8_storage_under_torch_compile_is_refused_for_what_it_is():
    model = tiny_model("llama")[0]
    cache = PositionedCache.from_model(model, storage="int8")
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (1, 8)), cache=cache, use_cache=True)
        fwd = torch.compile(model.forward, backend="eager")
        with pytest.raises(ValueError, match="storage='int8' is not compiled"):
            fwd(input_ids=torch.tensor([[5]]), cache=cache)
    assert cache.num_slots == 8


def test_out_of_vocabulary_ids_are_refused_before_the_embedding_and_change_nothing():
    from kvpos.edits import Insert
    from kvpos.integrations.pie import EditSession

    model = tiny_model("llama")[0]
    session = EditSession(model, torch.randint(3, 120, (30,)))
    before = snapshot(session.cache)
    with pytest.raises(ValueError, match=r"edits: inserted token ids: expected token ids in \[0, 128\)"):
        session.apply([Insert(5, [500])])
    assert session.length == 30
    same(before, snapshot(session.cache))
    with pytest.raises(ValueError, match=r"extend ids: expected token ids in \[0, 128\).*got min -1"):
        extend(model, session.cache, torch.tensor([[3, -1]]))
    same(before, snapshot(session.cache))
