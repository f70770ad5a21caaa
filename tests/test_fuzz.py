"""Fuzz: random sequences of every position and structure operation (forwards included) on several architectures,
the C kernel and the torch path, fp32 and bf16, checked against RoPE applied once from the raw keys; random damage
over whole stored entries; random bad arguments; random names. The fast profile runs in `make test`;
KVPOS_FUZZ=long (`make fuzz`) runs many more cases and writes results/reliability.md from the outcome counts.

Outcomes per case: ok, clear error (ValueError/TypeError/store errors whose message names what was expected), silent
wrong (no error but an invariant broke), obscure error (any other exception or message), state corrupted (a failed
call changed the cache or store). Every test fails on the last three.
"""
import json
import os
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kvpos import PositionedKV, RopeSpec, rotate
from kvpos.store import (ChunkKV, ChunkStore, CorruptChunkError, DiskBackend, Fingerprint, FingerprintMismatch,
                         MemoryBackend, RedisBackend, StoreUnavailable, serialize)
from kvpos.integrations.hf import PositionedCache, extend, generate
from kvpos.integrations.hf.testing import tiny_model

LONG = os.environ.get("KVPOS_FUZZ") == "long"
EXAMPLES = 600 if LONG else 8
DAMAGE = 20000 if LONG else 150
CLEAR = (ValueError, TypeError, MemoryError, CorruptChunkError, FingerprintMismatch, StoreUnavailable)
_HOUSE = re.compile(r"^[^\n]*: expected .*, got ")
FP = Fingerprint(model="m" * 64, weights="w" * 64, dtype="float32", anchor="a" * 64, rope="r" * 64)


def classify(e: BaseException) -> str:
    if isinstance(e, CLEAR) and (_HOUSE.search(str(e)) or isinstance(e, (CorruptChunkError, StoreUnavailable))):
        return "clear error"
    return "obscure error"


# ---------------------------------------------------------------------------------------------------------------------
# model-driven sequences of operations
# ---------------------------------------------------------------------------------------------------------------------

class Shadow:
    """What the cache should hold: per slot its raw keys per layer (bit-exact) and its positions per row."""

    def __init__(self, cache):
        self.raw = [l.raw_keys.clone() for l in cache.layers] if cache.table.n else None
        self.pos = cache.table.pos.clone()
        self.vis = cache.table.visible.clone()

    def check(self, cache, tol: float):
        n = cache.table.n
        assert all(l.n == n for l in cache.layers), "layers disagree with the slot table"
        assert torch.equal(cache.table.pos, self.pos), "positions differ from the expected ones"
        assert torch.equal(cache.table.visible, self.vis), "visibility differs"
        if n == 0:
            return
        for i, l in enumerate(cache.layers):
            assert torch.equal(l.raw_keys, self.raw[i]), f"layer {i}: raw keys changed"
            want = rotate(l.raw_keys.float(), cache.table.pos, l.spec)
            err = (l.keys.float() - want).abs().max()
            assert err <= tol * (want.abs().max() + 1), f"layer {i}: rotated keys off by {float(err)}"


def _capture_new(shadow: Shadow, cache, n0: int, tol: float):
    """Slots [n0, n) were written by a forward: their rotated keys are the model's own; their raw keys must rotate
    back onto them (checked), then they are tracked bit-exactly like every other slot."""
    for i, l in enumerate(cache.layers):
        new = l.raw_keys[:, :, n0:]
        want = rotate(new.float(), cache.table.pos[:, n0:], l.spec)
        assert (l.keys[:, :, n0:].float() - want).abs().max() <= tol * (want.abs().max() + 1), "unrotation broke"
        shadow.raw[i] = new.clone() if shadow.raw is None or n0 == 0 else torch.cat([shadow.raw[i][:, :, :n0], new], 2)
    shadow.pos = cache.table.pos.clone()
    shadow.vis = cache.table.visible.clone()


def _expected_next(shadow: Shadow) -> torch.Tensor:
    if shadow.pos.numel() == 0:
        return torch.zeros(shadow.pos.shape[0] or 1, dtype=torch.long)
    return shadow.pos.masked_fill(~shadow.vis, -1).max(1).values + 1


ops = st.one_of(
    st.tuples(st.just("extend"), st.integers(1, 5), st.sampled_from(["next", "explicit"]), st.integers(0, 40)),
    st.tuples(st.just("generate"), st.integers(1, 3), st.just(0), st.just(0)),
    st.tuples(st.just("append_raw"), st.integers(1, 4), st.integers(0, 60), st.integers(0, 10 ** 6)),
    st.tuples(st.just("concat"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("crop"), st.integers(-6, 2), st.just(0), st.just(0)),
    st.tuples(st.just("copy"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("reorder"), st.integers(0, 10 ** 6), st.just(0), st.just(0)),
    st.tuples(st.just("shift"), st.integers(0, 30), st.integers(0, 30), st.integers(-30, 300)),
    st.tuples(st.just("set"), st.integers(0, 30), st.integers(0, 30), st.integers(-2, 400)),
    st.tuples(st.just("delete"), st.integers(0, 30), st.integers(0, 30), st.booleans()),
    st.tuples(st.just("keep"), st.integers(0, 10 ** 6), st.just(0), st.just(0)),
    st.tuples(st.just("hide"), st.integers(0, 30), st.integers(0, 30), st.booleans()),
)


def _snap(cache):
    return (cache.table.n, cache.table.pos.clone(), cache.table.visible.clone(),
            [(l.n, None if l.rot_k is None else l.rot_k[:, :, :l.n].clone(),
              None if l.raw_k is None else l.raw_k[:, :, :l.n].clone()) for l in cache.layers])


def _same_snap(a, b) -> bool:
    if a[0] != b[0] or not torch.equal(a[1], b[1]) or not torch.equal(a[2], b[2]):
        return False
    return all(x[0] == y[0] and (x[1] is None) == (y[1] is None) and (x[1] is None or (
        torch.equal(x[1], y[1]) and torch.equal(x[2], y[2]))) for x, y in zip(a[3], b[3]))


def _run_op(model, cache, shadow, op, tol, g):
    """Apply op; returns the (possibly new) cache. Updates the shadow for what the op should do."""
    kind, a, b, c = op
    n, B = cache.table.n, max(cache.table.batch_size, 1)
    if kind == "extend":
        ids = torch.randint(3, 128, (B, a), generator=g)
        pos = None if b == "next" else torch.arange(c, c + a)
        expect = (_expected_next(shadow)[:, None] + torch.arange(a)) if pos is None else pos.expand(B, a)
        extend(model, cache, ids, positions=pos)
        assert torch.equal(cache.table.pos[:, n:], expect.expand(B, a)), "extend put slots at other positions"
        _capture_new(shadow, cache, n, tol)
    elif kind == "generate":
        if n == 0:
            return cache
        expect0 = _expected_next(shadow)
        generate(model, cache, torch.randint(3, 128, (B, 1), generator=g), max_new_tokens=a, do_sample=False,
                 pad_token_id=0)
        m = cache.table.n - n
        assert m == a, f"generate of {a} tokens wrote {m} slots"
        assert torch.equal(cache.table.pos[:, n:], expect0[:, None] + torch.arange(m)), "generate positions"
        _capture_new(shadow, cache, n, tol)
    elif kind == "append_raw":
        if n == 0:
            return cache
        gg = torch.Generator().manual_seed(c)
        dtype = cache.layers[0].rot_k.dtype
        kv = [(torch.randn(B, l.rot_k.shape[1], a, l.spec.head_dim, generator=gg).to(dtype),
               torch.randn(B, l.v.shape[1], a, l.v.shape[3], generator=gg).to(dtype)) for l in cache.layers]
        cache.append_raw_(kv, torch.arange(b, b + a))
        shadow.raw = [torch.cat([r, k], 2) for r, (k, _) in zip(shadow.raw, kv)]
        shadow.pos = torch.cat([shadow.pos, torch.arange(b, b + a).expand(B, a)], 1)
        shadow.vis = torch.cat([shadow.vis, torch.ones(B, a, dtype=torch.bool)], 1)
    elif kind == "concat":
        if n == 0:
            return cache
        cache = PositionedCache.concat([cache, cache.copy()])
        shadow.raw = [torch.cat([r, r], 2) for r in shadow.raw]
        shadow.pos, shadow.vis = torch.cat([shadow.pos] * 2, 1), torch.cat([shadow.vis] * 2, 1)
    elif kind == "crop":
        cache.crop(a)
        keep = max(0, n + a) if a <= 0 else n
        if shadow.raw is not None:
            shadow.raw = [r[:, :, :keep] for r in shadow.raw]
        shadow.pos, shadow.vis = shadow.pos[:, :keep], shadow.vis[:, :keep]
    elif kind == "copy":
        cache = cache.copy()
    elif kind == "reorder":
        if n == 0:
            return cache
        rows = torch.tensor(random.Random(a).choices(range(B), k=2))
        cache.reorder_cache(rows)
        shadow.raw = [r[rows] for r in shadow.raw]
        shadow.pos, shadow.vis = shadow.pos[rows], shadow.vis[rows]
    else:
        lo, hi = min(a, b), max(a, b)
        if kind == "shift":
            cache.shift_(lo, hi, c)
            shadow.pos = shadow.pos.clone()
            shadow.pos[:, lo:hi] += c
        elif kind == "set":
            p = torch.arange(c, c + hi - lo).flip(0)
            cache.set_positions_(lo, hi, p)
            shadow.pos = shadow.pos.clone()
            shadow.pos[:, lo:hi] = p
        elif kind == "delete":
            cache.delete_(lo, hi, close_gap=c)
            idx = torch.cat([torch.arange(0, lo), torch.arange(hi, n)])
            pos = shadow.pos[:, idx]
            if c:
                pos[:, lo:] -= hi - lo
            shadow.pos, shadow.vis = pos, shadow.vis[:, idx]
            shadow.raw = [r[:, :, idx] for r in shadow.raw] if shadow.raw is not None else None
        elif kind == "keep":
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(a))[: max(1, n - 2)] if n else \
                torch.zeros(0, dtype=torch.long)
            cache.keep_(perm)
            shadow.pos, shadow.vis = shadow.pos[:, perm], shadow.vis[:, perm]
            shadow.raw = [r[:, :, perm] for r in shadow.raw] if shadow.raw is not None else None
        elif kind == "hide":
            (cache.hide_ if c else cache.unhide_)(lo, hi)
            shadow.vis = shadow.vis.clone()
            shadow.vis[:, lo:hi] = not c
    return cache


ARCHS = ["llama", "phi3", "cohere", "qwen3"]


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(ARCHS), seq=st.lists(ops, min_size=1, max_size=14), seed=st.integers(0, 2 ** 16))
def test_random_operation_sequences_against_one_rotation_from_raw(fuzz_record, monkeypatch, path, dtype, arch, seq,
                                                                   seed):
    if path == "torch":
        monkeypatch.setattr("kvpos.rope.rope_apply_kernel", lambda *a, **k: False)
    tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
    model = tiny_model(arch, dtype=dtype, num_hidden_layers=2)[0]
    g = torch.Generator().manual_seed(seed)
    cache = PositionedCache.from_model(model)
    extend(model, cache, torch.randint(3, 128, (2, 6), generator=g))
    shadow = Shadow(cache)
    for op in seq:
        before = _snap(cache)
        try:
            cache = _run_op(model, cache, shadow, op, tol, g)
        except AssertionError:
            fuzz_record("position operations", "silent wrong")
            raise
        except BaseException as e:  # noqa: BLE001 - classified below
            kind = classify(e)
            corrupted = not _same_snap(before, _snap(cache))
            fuzz_record("position operations", "state corrupted" if corrupted else kind)
            assert kind == "clear error", f"{op}: {type(e).__name__}: {e}"
            assert not corrupted, f"{op} failed and changed the cache"
            continue
        try:
            shadow.check(cache, tol)
        except AssertionError:
            fuzz_record("position operations", "silent wrong")
            raise
        fuzz_record("position operations", "ok")


# ---------------------------------------------------------------------------------------------------------------------
# bad arguments to every public operation
# ---------------------------------------------------------------------------------------------------------------------

junk = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 12, 10 ** 12), st.floats(allow_nan=True),
                 st.text(max_size=4), st.lists(st.integers(-5, 40), max_size=5),
                 st.lists(st.floats(-3, 3, allow_nan=False), max_size=3),
                 st.sampled_from([torch.tensor([1.5]), torch.tensor([True, False]), torch.zeros(2, 2, dtype=torch.long),
                                  torch.tensor([], dtype=torch.long), torch.tensor([2 ** 62, 1])]))

CALLS = {
    "shift_": lambda c, a, b, d: c.shift_(a, b, d),
    "set_positions_": lambda c, a, b, d: c.set_positions_(a, b, d),
    "delete_": lambda c, a, b, d: c.delete_(a, b, close_gap=d),
    "keep_": lambda c, a, b, d: c.keep_(a),
    "hide_": lambda c, a, b, d: c.hide_(a, b),
    "set_segment_": lambda c, a, b, d: c.set_segment_(a, b, d),
    "append_raw_": lambda c, a, b, d: c.append_raw_(a, b),
    "raw_kv": lambda c, a, b, d: c.raw_kv(a, b),
    "crop": lambda c, a, b, d: c.crop(a),
    "reserve_": lambda c, a, b, d: c.reserve_(a),
    "reorder_rows_": lambda c, a, b, d: c.reorder_rows_(a),
}


@settings(max_examples=EXAMPLES * 20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(CALLS)), a=junk, b=junk, d=junk)
def test_bad_arguments_give_clear_errors_and_change_nothing(fuzz_record, name, a, b, d):
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    cache = PositionedKV([RopeSpec(inv, 1.0, 8, 8)] * 2)
    cache.append_raw_([(torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8))] * 2, torch.arange(20))
    before = _snap(cache)
    try:
        CALLS[name](cache, a, b, d)
    except BaseException as e:  # noqa: BLE001 - classified below
        kind = classify(e)
        corrupted = not _same_snap(before, _snap(cache))
        fuzz_record("bad arguments", "state corrupted" if corrupted else kind)
        assert kind == "clear error", f"{name}({a!r}, {b!r}, {d!r}): {type(e).__name__}: {e}"
        assert not corrupted
        return
    fuzz_record("bad arguments", "ok")
    for i, l in enumerate(cache.layers):            # whatever was accepted left a consistent cache
        assert l.n == cache.table.n
        if cache.table.n:
            want = rotate(l.raw_keys, cache.table.pos, l.spec)
            assert (l.keys - want).abs().max() < 1e-4, f"{name} accepted ({a!r}, {b!r}, {d!r}) and broke layer {i}"


# ---------------------------------------------------------------------------------------------------------------------
# damage over whole stored entries (header included): corrupt and dropped, or byte-identical
# ---------------------------------------------------------------------------------------------------------------------

def _damaged(blob: bytes, rng: random.Random) -> bytes:
    kind = rng.choice(["flip", "flip", "flip_header", "truncate", "insert", "overwrite"])
    b = bytearray(blob)
    if kind == "flip":
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif kind == "flip_header":
        i = rng.randrange(min(len(b), 8 + int.from_bytes(blob[:8], "little")))
        b[i] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        b = b[:rng.randrange(len(b))]
    elif kind == "insert":
        i = rng.randrange(len(b))
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
    else:
        i = rng.randrange(len(b))
        for j in range(i, min(len(b), i + rng.randint(1, 16))):
            b[j] = rng.randrange(256)
    return bytes(b)


def _chunk(seed=0, S=5):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randint(0, 1000, (S,), generator=g), torch.randn(2, 2, S, 4, generator=g),
                   torch.randn(2, 2, S, 4, generator=g), 3, FP, {"k": seed})


def _check_damage(store, write_raw, exists, category, fuzz_record, n):
    rng = random.Random(1234)
    c = _chunk()
    blob = serialize(c)
    key = store.key(c.ids)
    for _ in range(n):
        bad = _damaged(blob, rng)
        write_raw(key, bad)
        try:
            got = store.get(c.ids)
        except BaseException as e:  # noqa: BLE001
            fuzz_record(category, classify(e) if not isinstance(e, CorruptChunkError) else "obscure error")
            raise AssertionError(f"damaged entry raised {type(e).__name__}: {e}") from e
        if got is None:
            dropped = not exists(key)
            fuzz_record(category, "clear error" if dropped else "state corrupted")
            assert dropped, "a corrupt entry was not dropped"
            assert store.stats.events[-1]["kind"] == "corrupt"
        else:
            identical = serialize(got) == blob
            fuzz_record(category, "ok" if identical else "silent wrong")
            assert identical, "a damaged entry was served with other contents"


def test_damage_anywhere_on_disk_is_detected_and_dropped(tmp_path, fuzz_record):
    backend = DiskBackend(tmp_path)
    store = ChunkStore(backend, FP)

    def write_raw(key, blob):
        p = backend.path(key)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(blob)

    _check_damage(store, write_raw, lambda k: os.path.exists(backend.path(k)), "store damage (disk)", fuzz_record,
                  DAMAGE)


def test_damage_anywhere_in_redis_is_detected_and_dropped(redis_server_port, fuzz_record):
    backend = RedisBackend(port=redis_server_port, prefix="dmg:")
    store = ChunkStore(backend, FP)
    _check_damage(store, lambda k, b: backend.client.set("dmg:" + k, b), lambda k: backend.client.exists("dmg:" + k),
                  "store damage (redis)", fuzz_record, DAMAGE // 3)


# ---------------------------------------------------------------------------------------------------------------------
# names: random namespaces and keys never reach outside the root
# ---------------------------------------------------------------------------------------------------------------------

@settings(max_examples=EXAMPLES * 25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.one_of(st.text(max_size=30), st.sampled_from(["..", "../x", "/etc", "a/../..", "~root", ".", "a\x00b",
                                                              "C:\\x", "x" * 300])))
def test_random_names_never_leave_the_store_root(tmp_path_factory, fuzz_record, name):
    root = tmp_path_factory.mktemp("root")
    backend = DiskBackend(root / "store")
    before = set(os.listdir(root))
    try:
        store = ChunkStore(backend, FP, namespace=name)
        store.put(_chunk())
        backend.put(name, _chunk())
        backend.delete(name)
        outcome = "ok"
    except BaseException as e:  # noqa: BLE001
        outcome = classify(e)
    escaped = set(os.listdir(root)) != before
    for dirpath, _, files in os.walk(root):
        assert os.path.realpath(dirpath).startswith(os.path.realpath(root)), dirpath
    fuzz_record("path tricks", "state corrupted" if escaped else outcome)
    assert not escaped and outcome in ("ok", "clear error"), (name, outcome)


def test_memory_backend_budget_holds_under_random_puts(fuzz_record):
    rng = random.Random(5)
    mb = MemoryBackend(6000)
    store = ChunkStore(mb, FP)
    for i in range(EXAMPLES * 10):
        store.put(_chunk(rng.randrange(50), S=rng.randint(1, 20)))
        ok = mb.bytes <= mb.max_bytes and mb.bytes == sum(c.nbytes() for c in mb._d.values())
        fuzz_record("memory budget", "ok" if ok else "silent wrong")
        assert ok


# ---------------------------------------------------------------------------------------------------------------------
# crafted entries: re-signed (the checksum is no secret) with random field values
# ---------------------------------------------------------------------------------------------------------------------

field_text = st.one_of(st.text(max_size=12), st.sampled_from(["5", "-1", "5.0", "1e3", "99999999999999999999", "{}",
                                                              "[]", "null", '{"a": 1}', FP.to_json(), "2", "1"]))


@settings(max_examples=EXAMPLES * 10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=field_text, meta=field_text, fingerprint=field_text, fmt=st.sampled_from(["2", "1", "3", "x"]),
       shape=st.sampled_from(["ok", "ids_float", "values_short", "keys_int", "extra_tensor", "nan_keys",
                              "inf_values"]))
def test_crafted_resigned_entries_are_verified_field_by_field(fuzz_record, start, meta, fingerprint, fmt, shape):
    from safetensors.torch import save

    from kvpos.store import _checksum, deserialize
    c = _chunk(1)
    t = {"ids": c.ids, "keys": c.raw_keys, "values": c.values}
    if shape == "ids_float":
        t["ids"] = c.ids.float()
    elif shape == "values_short":
        t["values"] = c.values[:, :, :2].contiguous()
    elif shape == "keys_int":
        t["keys"] = c.raw_keys.to(torch.int32)
    elif shape == "extra_tensor":
        t["extra"] = torch.zeros(1)
    elif shape == "nan_keys":
        t["keys"] = c.raw_keys.clone().index_fill_(2, torch.tensor([1]), float("nan"))
    elif shape == "inf_values":
        t["values"] = c.values.clone().index_fill_(3, torch.tensor([0]), float("-inf"))
    m = {"format": fmt, "start": start, "fingerprint": fingerprint, "meta": meta}
    m["checksum"] = _checksum(t, m)
    try:
        got = deserialize(save(t, metadata=m))
    except CorruptChunkError:
        fuzz_record("crafted entries (re-signed)", "clear error")
        return
    except BaseException as e:  # noqa: BLE001
        fuzz_record("crafted entries (re-signed)", "obscure error")
        raise AssertionError(f"crafted entry raised {type(e).__name__}: {e}") from e
    valid = (fmt == "2" and shape == "ok" and got.start == int(start)
             and got.fingerprint == Fingerprint.from_json(fingerprint) and got.meta == json.loads(meta))
    fuzz_record("crafted entries (re-signed)", "ok" if valid else "silent wrong")
    assert valid and isinstance(got.meta, dict)


# ---------------------------------------------------------------------------------------------------------------------
# appending() blocks: random writes inside (crops below the entry length included), then an exception
# ---------------------------------------------------------------------------------------------------------------------

block_ops = st.lists(st.tuples(st.sampled_from(["crop", "extend", "shift", "delete", "hide", "label", "append_raw"]),
                               st.integers(0, 40), st.integers(0, 40), st.integers(-30, 30)), min_size=1, max_size=8)


def _public_state(cache):
    return (cache.num_slots, cache.positions, cache.visible, cache.segments, cache.raw_kv())


def _same_public(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:4], b[1:4])) and all(
        torch.equal(k1, k2) and torch.equal(v1, v2) for (k1, v1), (k2, v2) in zip(a[4], b[4]))


class _Stop(Exception):
    pass


@settings(max_examples=EXAMPLES * 4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(storage=st.sampled_from(["rotated", "raw", "int8"]), seq=block_ops, seed=st.integers(0, 2 ** 16))
def test_an_exception_in_an_appending_block_restores_the_cache_whatever_ran_inside(fuzz_record, storage, seq, seed):
    model = tiny_model("llama")[0]
    g = torch.Generator().manual_seed(seed)
    cache = PositionedCache.from_model(model, storage=storage)
    extend(model, cache, torch.randint(3, 128, (1, 40), generator=g))
    before = _public_state(cache)
    try:
        with cache.appending():
            for kind, a, b, c in seq:
                n = cache.num_slots
                lo, hi = sorted((min(a, n), min(b, n)))
                try:
                    if kind == "crop":
                        cache.crop(-a)
                    elif kind == "extend":
                        extend(model, cache, torch.randint(3, 128, (1, 1 + a % 12), generator=g))
                    elif kind == "shift":
                        cache.shift_(lo, hi, c)
                    elif kind == "delete":
                        cache.delete_(lo, hi)
                    elif kind == "hide":
                        cache.hide_(lo, hi)
                    elif kind == "label":
                        cache.set_segment_(lo, hi, c)
                    elif n:
                        kv = [(torch.randn(1, 2, 1 + a % 5, 16, generator=g), torch.randn(1, 2, 1 + a % 5, 16,
                                                                                           generator=g))
                              for _ in cache.layers]
                        cache.append_raw_(kv, torch.arange(b, b + 1 + a % 5))
                except (ValueError, TypeError):
                    pass                                  # a refused step (e.g. negative positions) inside the block
            raise _Stop()
    except _Stop:
        pass
    ok = _same_public(before, _public_state(cache))
    fuzz_record("appending() rollback (crops, rewrites)", "ok" if ok else "state corrupted")
    assert ok, seq
