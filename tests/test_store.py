"""ChunkStore backends: bit-exact round trips, fingerprints, damage detection, concurrency, budgets, real Redis."""
import json
import multiprocessing as mp
import struct
import os
import time

from pathlib import Path
from dataclasses import replace

import pytest
import torch
from redis_server import free_port

from kvpos.store import (ChunkKV, ChunkStore, CorruptChunkError, DiskBackend, Fingerprint, FingerprintMismatch,
                         MemoryBackend, RedisBackend, StoreUnavailable, TieredBackend, content_key, deserialize,
                         serialize)

FP = Fingerprint(model="m" * 64, weights="w" * 64, dtype="float32", anchor="a" * 64, rope="r" * 64)


def _chunk(seed=0, S=7, dtype=torch.float32, fp=FP):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (S,), generator=g)
    return ChunkKV(ids, torch.randn(3, 2, S, 8, generator=g).to(dtype), torch.randn(3, 2, S, 8, generator=g).to(dtype),
                   5, fp)


@pytest.fixture(scope="module")
def redis_server(redis_server_port):
    return redis_server_port


def _backends(tmp_path, port):
    return {"memory": MemoryBackend(1 << 20), "disk": DiskBackend(tmp_path / "store"),
            "redis": RedisBackend(port=port, prefix=f"t{os.getpid()}:"),
            "tiered": TieredBackend(MemoryBackend(1 << 20), DiskBackend(tmp_path / "far"))}


@pytest.mark.parametrize("name", ["memory", "disk", "redis", "tiered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(tmp_path, redis_server, name, dtype):
    store = ChunkStore(_backends(tmp_path, redis_server)[name], FP, namespace=f"rt-{dtype}")
    c = _chunk(dtype=dtype)
    assert store.get(c.ids) is None
    store.put(c)
    got = store.get(c.ids)
    assert torch.equal(got.ids, c.ids) and torch.equal(got.raw_keys, c.raw_keys) and torch.equal(got.values, c.values)
    assert got.raw_keys.dtype == dtype and got.start == 5 and got.fingerprint == FP
    assert store.stats.hits == 1 and store.stats.misses == 1


@pytest.mark.parametrize("name", ["memory", "disk", "redis"])
def test_the_same_passage_under_two_anchors_is_two_entries(tmp_path, redis_server, name):
    """The key holds the anchor: a passage encoded after another system prompt is a miss, never a mismatch, and
    saving it does not overwrite the first anchor's entry."""
    backend = _backends(tmp_path, redis_server)[name]
    a, b = ChunkStore(backend, FP, namespace="an"), ChunkStore(backend, replace(FP, anchor="b" * 64), namespace="an")
    c = _chunk()
    a.put(c)
    assert a.key(c.ids) != b.key(c.ids) and a.contains(c.ids) and not b.contains(c.ids)
    assert b.get(c.ids) is None and b.stats.misses == 1 and b.stats.mismatches == 0
    cb = ChunkKV(c.ids, c.raw_keys + 1, c.values, c.start, b.fingerprint)
    b.put(cb)
    assert torch.equal(a.get(c.ids).raw_keys, c.raw_keys) and torch.equal(b.get(c.ids).raw_keys, cb.raw_keys)


@pytest.mark.parametrize("name", ["memory", "disk", "redis"])
@pytest.mark.parametrize("field", ["model", "dtype", "format"])
def test_chunk_from_another_model_or_dtype_is_refused_naming_both(tmp_path, redis_server, name, field):
    backend = _backends(tmp_path, redis_server)[name]
    ChunkStore(backend, FP, namespace="fp").put(_chunk())
    other = Fingerprint(**{**FP.__dict__, field: ("b" * 64 if field != "format" else 3)
                           if field not in ("dtype",) else "bfloat16"})
    store = ChunkStore(backend, other, namespace="fp")
    with pytest.raises(FingerprintMismatch, match=r"computed with \[model=mmmmmmmmmm.*\], this store serves \[") as e:
        store.get(_chunk().ids)
    assert FP.short() in str(e.value) and other.short() in str(e.value)
    lenient = ChunkStore(backend, other, namespace="fp", on_mismatch="recompute")
    assert lenient.get(_chunk().ids) is None and lenient.stats.mismatches == 1
    assert not store.contains(_chunk().ids)          # the header says whose it is: contains agrees with get


def test_truncated_or_altered_file_is_detected_reported_and_not_used(tmp_path):
    backend = DiskBackend(tmp_path)
    store = ChunkStore(backend, FP)
    c = _chunk()
    for damage in ("truncate", "flip", "garbage"):
        store.put(c)
        path = backend.path(store.key(c.ids))
        blob = open(path, "rb").read()
        if damage == "truncate":
            blob = blob[: len(blob) // 2]
        elif damage == "flip":
            blob = blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:]
        else:
            blob = b"not a safetensors file at all"
        open(path, "wb").write(blob)
        with pytest.raises(CorruptChunkError):
            ChunkStore(backend, FP, strict=True).get(c.ids)
        assert store.get(c.ids) is None, damage               # not used
        assert store.stats.events[-1]["kind"] == "corrupt"    # reported
        assert not os.path.exists(path)                       # removed, so the next put repairs it
    assert store.stats.corrupt == 3


def test_altered_redis_value_is_detected(redis_server):
    backend = RedisBackend(port=redis_server, prefix="alter:")
    store = ChunkStore(backend, FP)
    c = _chunk(3)
    store.put(c)
    key = backend.prefix + store.key(c.ids)
    blob = backend.client.get(key)
    backend.client.set(key, blob[:-4] + b"\x00\x00\x00\x00")
    assert store.get(c.ids) is None and store.stats.corrupt == 1


def _writer(kind, where, seed, n):
    backend = DiskBackend(where) if kind == "disk" else RedisBackend(port=where, prefix="race:")
    store = ChunkStore(backend, FP, namespace="race")
    c = _chunk(seed=0, S=256)
    for _ in range(n):
        store.put(c)


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_two_processes_writing_the_same_chunk_leave_one_valid_entry(tmp_path, redis_server, kind):
    where = str(tmp_path / "race") if kind == "disk" else redis_server
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(kind, where, i, 15)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    backend = DiskBackend(where) if kind == "disk" else RedisBackend(port=where, prefix="race:")
    got = ChunkStore(backend, FP, namespace="race", strict=True).get(_chunk(S=256).ids)
    assert got is not None and torch.equal(got.raw_keys, _chunk(S=256).raw_keys)
    if kind == "disk":
        files = [f for _, _, fs in os.walk(where) for f in fs]
        assert len(files) == 1 and files[0].endswith(".safetensors"), files


def test_memory_budget_is_never_exceeded():
    one = _chunk(S=64).nbytes()
    backend = MemoryBackend(max_bytes=int(one * 3.5))
    store = ChunkStore(backend, FP)
    for i in range(20):
        store.put(_chunk(seed=i, S=64))
        assert backend.bytes <= backend.max_bytes
    assert len(backend) == 3 and backend.evictions == 17
    assert store.get(_chunk(seed=19, S=64).ids) is not None       # most recent kept
    assert store.get(_chunk(seed=0, S=64).ids) is None            # oldest evicted
    assert not backend.put("big", _chunk(S=1024))                   # larger than the budget: refused, not stored
    assert backend.bytes <= backend.max_bytes


def test_redis_unreachable_gives_a_clear_error_or_a_reported_recompute():
    port = free_port()   # nothing listens here
    store = ChunkStore(RedisBackend(port=port, timeout_s=0.5), FP)
    with pytest.raises(StoreUnavailable, match=rf"redis get: expected a redis-server at 127.0.0.1:{port}/0.*"
                                               r"on_unavailable='recompute'"):
        store.get(_chunk().ids)
    lenient = ChunkStore(RedisBackend(port=port, timeout_s=0.5), FP, on_unavailable="recompute")
    assert lenient.get(_chunk().ids) is None
    assert lenient.put(_chunk()) is False
    assert lenient.stats.unavailable == 2


def test_store_argument_errors():
    with pytest.raises(ValueError, match="ChunkStore on_mismatch: expected 'error' or 'recompute', got 'ignore'"):
        ChunkStore(MemoryBackend(), FP, on_mismatch="ignore")
    with pytest.raises(TypeError, match="ChunkStore fingerprint: expected a Fingerprint"):
        ChunkStore(MemoryBackend(), "fp")
    with pytest.raises(ValueError, match="MemoryBackend max_bytes: expected a positive int"):
        MemoryBackend(0)
    with pytest.raises(ValueError, match=r"ChunkStore.put chunk: expected fingerprint"):
        ChunkStore(MemoryBackend(), FP).put(_chunk(fp=Fingerprint("x", "y", "z", "a", "r")))
    with pytest.raises(CorruptChunkError, match="expected kvpos format 2, got '9'"):
        from safetensors.torch import save
        deserialize(save({"ids": torch.zeros(1)}, metadata={"format": "9"}))
    with pytest.raises(ValueError, match=r"ChunkKV.values: expected \[L, H, S, Dv\]"):
        ChunkKV(torch.zeros(2, dtype=torch.long), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 3, 4), 0, FP)
    assert content_key(torch.tensor([1, 2]), "ns").startswith("ns-")
    assert deserialize(serialize(_chunk())).fingerprint == FP


def test_chunk_store_with_a_real_model_fingerprint(tmp_path):
    """A chunk made with another anchor is another entry (computed, not refused); one made by the same model in
    another dtype is refused by a ChunkComposer sharing the disk store's namespace."""
    from kvpos.integrations.compose import ChunkComposer
    from kvpos.integrations.hf.testing import tiny_model

    model = tiny_model("llama")[0]
    backend = DiskBackend(tmp_path)
    a = ChunkComposer(model, torch.tensor([1, 5, 6]), backend=backend)
    ids = torch.tensor([7, 8, 9, 10])
    a.precompute([ids], progress=False)
    b = ChunkComposer(model, torch.tensor([1, 5, 7]), backend=backend)
    b.get_or_compute(ids)
    assert b.store.stats.misses == 1 and b.store.stats.mismatches == 0 and a.store.contains(ids)
    c = ChunkComposer(model.to(torch.bfloat16), torch.tensor([1, 5, 6]), backend=backend)
    with pytest.raises(FingerprintMismatch, match="dtype=bfloat16"):
        c.get_or_compute(ids)


@pytest.mark.parametrize("name", ["memory", "disk", "redis"])
def test_contains_answers_without_loading(tmp_path, redis_server, name):
    store = ChunkStore(_backends(tmp_path, redis_server)[name], FP, namespace=f"has-{name}")
    c = _chunk(11)
    assert not store.contains(c.ids)
    store.put(c)
    assert store.contains(c.ids) and not store.contains(c.ids[:-1])


def test_weights_digest_is_by_content_and_equals_the_checkpoint_on_disk(tmp_path):
    """A model in memory and its save_pretrained folder (tied weights dropped, names kept or not) digest the same,
    so that every engine loading the same weights shares chunks; one changed weight changes it."""
    from kvpos.store import WeightsDigest, checkpoint_digest, tensors_digest
    from kvpos.integrations.hf.testing import tiny_model

    model = tiny_model("llama", tie_word_embeddings=True)[0]
    model.save_pretrained(tmp_path)
    assert WeightsDigest(model).digest() == checkpoint_digest(str(tmp_path))
    t = [torch.ones(3), torch.zeros(2, 2)]
    assert tensors_digest(t) == tensors_digest(t[::-1] + [torch.ones(3)])            # order and duplicates
    assert tensors_digest(t) != tensors_digest([torch.ones(3), torch.zeros(4)])        # shape
    assert tensors_digest(t) != tensors_digest([torch.ones(3, dtype=torch.float64), torch.zeros(2, 2)])


def test_tiered_backend_reads_near_first_and_fails_without_changing_either_tier(tmp_path):
    far = DiskBackend(tmp_path / "far")
    tb = TieredBackend(MemoryBackend(1 << 20), far)
    c = _chunk(3)
    key = content_key(c.ids)
    far.put(key, c)                                       # written by another process: only the far tier has it
    assert tb.near.get(key) is None and tb.contains(key)
    got = tb.get(key)
    assert torch.equal(got.raw_keys, c.raw_keys) and tb.near.get(key) is not None     # copied near on a far hit
    down = TieredBackend(MemoryBackend(1 << 20), RedisBackend(port=free_port(), timeout_s=0.2))
    c2 = _chunk(4)
    with pytest.raises(StoreUnavailable):                  # far tier down: the put raises, near is unchanged
        down.put(content_key(c2.ids), c2)
    assert len(down.near) == 0
    tb.delete(key)
    assert tb.near.get(key) is None and far.get(key) is None
    with pytest.raises(TypeError, match="TieredBackend near: expected a MemoryBackend"):
        TieredBackend(far, far)


# -- int8 entries ------------------------------------------------------------------------------------------------------

def _int8_ref(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference of symmetric int8 quantization along `dim` (one scale per slice): (dequantized, scale)."""
    xd = x.double()
    scale = xd.abs().amax(dim=dim, keepdim=True) / 127.0
    q = torch.where(scale > 0, (xd / torch.where(scale > 0, scale, 1.0)).round().clamp(-127, 127), 0.0)
    return q * scale, scale.expand_as(xd)


@pytest.mark.parametrize("name", ["disk", "redis"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_entries_are_keys_per_channel_values_per_token_and_a_quarter_of_the_bytes(tmp_path, redis_server, name,
                                                                                       dtype):
    backend = {"disk": DiskBackend(tmp_path / "q", scheme="int8"),
               "redis": RedisBackend(port=redis_server, prefix=f"q{os.getpid()}:", scheme="int8")}[name]
    store = ChunkStore(backend, FP, namespace=f"q-{dtype}")
    c = _chunk(S=64, dtype=dtype)
    c.raw_keys[:, :, :, 3] *= 40                                    # an outlier channel stays in its own scale
    c.values[1, 0, 5] = 0                                           # an all-zero token dequantizes to zeros
    store.put(c)
    got = store.get(c.ids)
    assert got.raw_keys.dtype == dtype and got.values.dtype == dtype and torch.equal(got.ids, c.ids)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    for gotx, x, dim in ((got.raw_keys, c.raw_keys, 2), (got.values, c.values, 3)):
        ref, scale = _int8_ref(x, dim)
        err = (gotx.double() - ref).abs()
        exact = err <= tol * ref.abs() + 1e-6                       # the reference's integer, rounded to dtype
        tie = (err - scale).abs() <= tol * ref.abs() + 1e-6         # one step off: float32 vs float64 at a .5 tie
        assert (exact | tie).all() and exact.float().mean() > 0.99
        assert (gotx.double() - x.double()).abs().le(scale / 2 + tol * x.double().abs() + 1e-6).float().mean() > 0.99
    assert torch.equal(got.values[1, 0, 5], torch.zeros(8, dtype=dtype))
    g = torch.Generator().manual_seed(3)                            # head_dim 64 (SmolLM2's): scales weigh 1/64
    big = ChunkKV(torch.arange(512), torch.randn(2, 3, 512, 64, generator=g), torch.randn(2, 3, 512, 64, generator=g),
                  0, FP)
    ratio = len(serialize(big, "int8")) / len(serialize(big))
    assert ratio < 0.3, ratio


def test_a_float_store_reads_int8_entries_and_an_int8_store_reads_float_entries(tmp_path):
    c = _chunk(S=16)
    ChunkStore(DiskBackend(tmp_path / "s"), FP, namespace="mix").put(c)
    got = ChunkStore(DiskBackend(tmp_path / "s", scheme="int8"), FP, namespace="mix").get(c.ids)
    assert torch.equal(got.raw_keys, c.raw_keys)                     # old float entries load as they were
    ChunkStore(DiskBackend(tmp_path / "s", scheme="int8"), FP, namespace="mix2").put(c)
    got = ChunkStore(DiskBackend(tmp_path / "s"), FP, namespace="mix2").get(c.ids)
    assert (got.raw_keys - c.raw_keys).abs().max() < 0.05 and not torch.equal(got.raw_keys, c.raw_keys)


def _resigned(blob: bytes, edit) -> bytes:
    """A re-signed entry: parse, let `edit` change tensors / metadata, recompute the checksum, save."""
    from safetensors import safe_open
    from safetensors.torch import load, save
    from kvpos.store import _checksum
    import tempfile
    tensors = load(blob)
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(blob)
        f.flush()
        with safe_open(f.name, "pt") as h:
            meta = dict(h.metadata())
    edit(tensors, meta)
    meta["checksum"] = _checksum(tensors, meta)
    return save(tensors, metadata=meta)


@pytest.mark.parametrize("edit", [
    lambda t, m: t.update(keys_scale=t["keys_scale"][:, :, :, :4].contiguous()),        # scale shape
    lambda t, m: t.update(values_scale=-t["values_scale"]),                               # negative scale
    lambda t, m: t.update(keys_scale=t["keys_scale"] * float("nan")),                     # NaN scale
    lambda t, m: t.update(keys=t["keys"].float()),                                        # not int8
    lambda t, m: t.pop("values_scale"),                                                   # missing tensor
    lambda t, m: m.update(scheme="int3/float32"),                                         # unknown scheme
    lambda t, m: m.update(scheme="int4/float32"),                                         # int8 tensors as int4
    lambda t, m: m.pop("scheme"),                                                         # int8 tensors, no scheme
    lambda t, m: m.update(scheme="int8/float64"),                                         # dtype outside the list
])
def test_crafted_int8_entries_are_corrupt_not_served(edit):
    blob = _resigned(serialize(_chunk(S=16), "int8"), edit)
    with pytest.raises(CorruptChunkError):
        deserialize(blob)


def test_scheme_argument_errors(tmp_path):
    with pytest.raises(ValueError, match=r"DiskBackend scheme: expected 'float' or 'int8' or 'int4', got 'int3'"):
        DiskBackend(tmp_path / "x", scheme="int3")
    with pytest.raises(ValueError, match=r"serialize scheme"):
        serialize(_chunk(), "fp8")


# -- int4 entries ------------------------------------------------------------------------------------------------------

def _int4_ref(x: torch.Tensor, dim: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference of asymmetric 4-bit quantization in groups of `g` along `dim` (keys: tokens, 2; values:
    channels, 3), written independently of kvpos.store: (dequantized, step of each element's group)."""
    xd = x.double()
    out, step = torch.empty_like(xd), torch.empty_like(xd)
    for a in range(0, xd.shape[dim], g):
        blk = xd.narrow(dim, a, min(g, xd.shape[dim] - a))       # one group: min / max over `dim` within it
        lo, hi = blk.amin(dim=dim, keepdim=True), blk.amax(dim=dim, keepdim=True)
        sc = (hi - lo) / 15
        q = torch.where(sc > 0, ((blk - lo) / torch.where(sc > 0, sc, 1.0)).round().clamp(0, 15), 0.0)
        out.narrow(dim, a, blk.shape[dim]).copy_(lo + q * sc)
        step.narrow(dim, a, blk.shape[dim]).copy_(sc.expand_as(blk))
    return out, step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_entries_are_grouped_per_channel_keys_per_token_values_and_a_sixth_of_the_bytes(tmp_path, dtype):
    from kvpos.store import INT4_GROUP

    store = ChunkStore(DiskBackend(tmp_path / "q4", scheme="int4"), FP, namespace=f"q4-{dtype}")
    g = torch.Generator().manual_seed(5)
    S = 2 * INT4_GROUP + 9                                          # a partial last group
    c = ChunkKV(torch.arange(S), torch.randn(2, 3, S, 8, generator=g).to(dtype),
                torch.randn(2, 3, S, 8, generator=g).to(dtype), 4, FP)
    c.raw_keys[:, :, :, 3] *= 40                                    # an outlier channel stays in its own groups
    c.raw_keys[0, 1, :, 5] = 1.5                                    # a constant channel comes back exactly
    store.put(c)
    got = store.get(c.ids)
    assert got.raw_keys.dtype == dtype and got.values.dtype == dtype and got.start == 4
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    for gotx, x, dim in ((got.raw_keys, c.raw_keys, 2), (got.values, c.values, 3)):
        ref, step = _int4_ref(x, dim, INT4_GROUP)
        err = (gotx.double() - ref).abs()
        slack = tol * (ref.abs() + step) + 1e-5                     # rounding to dtype (of ref, or of ref +- step)
        exact = err <= slack
        tie = (err - step).abs() <= slack                           # one step off at a .5 tie (float32 vs float64)
        assert (exact | tie).all() and exact.float().mean() > 0.99
        assert (gotx.double() - x.double()).abs().le(step / 2 + tol * x.double().abs() + 1e-5).float().mean() > 0.99
    assert torch.equal(got.raw_keys[0, 1, :, 5], torch.full((S,), 1.5, dtype=dtype))
    big = ChunkKV(torch.arange(512), torch.randn(2, 3, 512, 64, generator=g), torch.randn(2, 3, 512, 64, generator=g),
                  0, FP)
    r4, r8 = len(serialize(big, "int4")) / len(serialize(big)), len(serialize(big, "int8")) / len(serialize(big))
    assert r4 < 0.17 and r4 < 0.62 * r8, (r4, r8)
    # a float store reads int4 entries, an int4 store reads float ones
    ChunkStore(DiskBackend(tmp_path / "q4"), FP, namespace=f"q4-{dtype}").get(c.ids)


@pytest.mark.parametrize("edit", [
    lambda t, m: t.update(keys_scale=t["keys_scale"][:, :, :1].contiguous()),            # scale shape
    lambda t, m: t.update(values_scale=-t["values_scale"]),                               # negative scale
    lambda t, m: t.update(keys_min=t["keys_min"] * float("nan")),                         # NaN minimum
    lambda t, m: t.update(values=t["values"].to(torch.int8)),                             # not uint8
    lambda t, m: t.pop("keys_min"),                                                       # missing tensor
    lambda t, m: t.update(values=t["values"][:, :, :3].contiguous()),                     # values shorter than keys
])
def test_crafted_int4_entries_are_corrupt_not_served(edit):
    blob = _resigned(serialize(_chunk(S=80), "int4"), edit)
    with pytest.raises(CorruptChunkError):
        deserialize(blob)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_tiered_store_serves_from_memory_what_its_far_store_serves(tmp_path, scheme):
    """Engines sharing a quantized far store must serve one passage the same way, whether the chunk comes from
    the memory tier of the engine that computed it or from the far store."""
    far = DiskBackend(tmp_path / "far", scheme=scheme)
    tiered = ChunkStore(TieredBackend(MemoryBackend(1 << 22), far), FP)
    c = _chunk()
    tiered.put(c)
    near, from_far = tiered.get(c.ids), ChunkStore(far, FP).get(c.ids)
    assert torch.equal(near.raw_keys, from_far.raw_keys) and torch.equal(near.values, from_far.values)
    assert not torch.equal(near.raw_keys, c.raw_keys)            # quantized: the far scheme, not the float chunk


@pytest.mark.parametrize("scheme", ["float", "int8", "int4"])
def test_an_entry_written_by_the_single_module_store_loads_and_is_written_the_same_way(scheme):
    """tests/data/entry_v2_<scheme>.safetensors were written by kvpos 0.2.0's single-file store (before the store
    became a package): they load, and today's serialize writes the same entry for the same chunk (same metadata,
    checksum and tensor bytes; safetensors orders header fields arbitrarily, so whole blobs are not compared)."""
    from kvpos.store import SCHEMES, deserialize, serialize
    assert scheme in SCHEMES
    g = torch.Generator().manual_seed(7)
    L, H, S, D = 2, 1, 5, 8
    fp = Fingerprint(model="m" * 64, weights="w" * 64, dtype="float32", anchor="a" * 64, rope="r" * 64)
    chunk = ChunkKV(torch.arange(10, 10 + S), torch.randn(L, H, S, D, generator=g),
                    torch.randn(L, H, S, D, generator=g), 7, fp, {"note": "golden"})
    blob = (Path(__file__).parent / "data" / f"entry_v2_{scheme}.safetensors").read_bytes()
    got = deserialize(blob)
    assert torch.equal(got.ids, chunk.ids) and got.start == 7 and got.meta == {"note": "golden"}
    assert got.fingerprint == fp
    tol = {"float": 0.0, "int8": 0.05, "int4": 0.5}[scheme]
    torch.testing.assert_close(got.raw_keys, chunk.raw_keys, rtol=0, atol=tol)
    torch.testing.assert_close(got.values, chunk.values, rtol=0, atol=tol)
    from safetensors.torch import load
    new = serialize(chunk, scheme)
    head = [json.loads(b[8:8 + struct.unpack("<Q", b[:8])[0]])["__metadata__"] for b in (blob, new)]
    assert head[0] == head[1]
    old_t, new_t = load(blob), load(new)
    assert old_t.keys() == new_t.keys() and all(torch.equal(old_t[k], new_t[k]) for k in old_t)
