"""The explicit forward protocol of the core (PositionedKV.begin_forward -> ForwardWriter.write per layer ->
commit / abort), checked against float64 rotations (kvpos.reference), never against the cache's own reads."""
import pytest
import torch

from kvpos import PositionedKV, RopeLayout, RopeSpec
from kvpos.reference import rotate_ref

H, D, B = 2, 16, 2


def _specs():
    inv = 1.0 / (10000.0 ** (torch.arange(0, 12, 2, dtype=torch.float32) / 12))
    a = RopeSpec(inv, 1.0, 12, D, RopeLayout.HALF)
    b = RopeSpec(inv * 0.5, 1.1, 12, D, RopeLayout.INTERLEAVED)
    return [a, b, a]


def _forward(specs, pos, seed):
    """Per layer (raw keys, keys rotated at pos by the float64 reference, values), float32 [B, H, S, D]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in specs:
        raw = torch.randn(B, H, pos.shape[1], D, generator=g)
        out.append((raw, rotate_ref(raw, pos, s).float(), torch.randn(B, H, pos.shape[1], D, generator=g)))
    return out


def _state(kv):
    return kv.num_slots, [(k.clone(), v.clone()) for k, v in kv.raw_kv()] if kv.num_slots else []


def _same(a, b):
    assert a[0] == b[0]
    for (k1, v1), (k2, v2) in zip(a[1], b[1]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("storage", ["rotated", "raw"])
def test_a_forward_written_through_the_writer_holds_the_engines_keys_at_its_positions(storage):
    specs = _specs()
    kv = PositionedKV(specs, storage=storage)
    for step, (lo, S) in enumerate([(0, 5), (5, 1), (40, 3)]):      # a prefill, a decode step, a jump
        pos = (torch.arange(S) + lo).expand(B, S).contiguous()
        layers = _forward(specs, pos, step)
        with kv.begin_forward(pos) as writer:
            for i, (_, k_rot, v) in enumerate(layers):
                keys, values = writer.write(i, k_rot, v)
                assert torch.equal(keys[:, :, -S:], k_rot) and torch.equal(values[:, :, -S:], v)
        assert writer.state == "committed"
        for i, ((raw, _, v), (got_raw, got_v)) in enumerate(zip(layers, kv.raw_kv(kv.num_slots - S))):
            torch.testing.assert_close(got_raw, raw, atol=1e-5, rtol=1e-5)      # un-rotated back to the raw keys
            assert torch.equal(got_v, v)
    assert kv.positions[0].tolist() == [0, 1, 2, 3, 4, 5, 40, 41, 42]


@pytest.mark.parametrize("written", [0, 1, 2, 3])
def test_abort_after_any_number_of_layers_leaves_the_cache_as_it_was(written):
    specs = _specs()
    kv = PositionedKV(specs, storage="raw")
    pos0 = torch.arange(4).expand(B, 4).contiguous()
    with kv.begin_forward(pos0) as w:
        for i, (_, k, v) in enumerate(_forward(specs, pos0, 0)):
            w.write(i, k, v)
    before = _state(kv)
    pos = torch.tensor([[4], [9]])
    w = kv.begin_forward(pos)
    for i, (_, k, v) in enumerate(_forward(specs, pos, 1)[:written]):
        w.write(i, k, v)
    w.abort()
    _same(_state(kv), before)
    assert kv.positions.tolist() == pos0.tolist()
    with pytest.raises(ValueError, match="ForwardWriter.write: expected an open forward"):
        w.write(0, *_forward(specs, pos, 1)[0][1:])


def test_an_exception_inside_the_block_and_a_commit_before_every_layer_roll_back():
    specs = _specs()
    kv = PositionedKV(specs)
    pos = torch.arange(3).expand(B, 3).contiguous()
    layers = _forward(specs, pos, 2)
    with pytest.raises(KeyboardInterrupt):
        with kv.begin_forward(pos) as w:
            w.write(0, *layers[0][1:])
            raise KeyboardInterrupt
    assert kv.num_slots == 0 and w.state == "aborted"
    w = kv.begin_forward(pos)
    w.write(0, *layers[0][1:])
    w.write(1, *layers[1][1:])
    with pytest.raises(ValueError, match="ForwardWriter.commit: expected all 3 layers written, got 2 written"):
        w.commit()
    assert kv.num_slots == 0


@pytest.mark.parametrize("pos, match", [
    (torch.arange(3), "int64 \\[B, S\\]"),
    (torch.zeros(2, 3, dtype=torch.int32), "int64 \\[B, S\\]"),
    (torch.zeros(2, 0, dtype=torch.long), "S >= 1"),
    (torch.full((2, 1), -1), "positions >= 0"),
])
def test_begin_forward_refuses_bad_positions_naming_them(pos, match):
    kv = PositionedKV(_specs())
    with pytest.raises(ValueError, match=match):
        kv.begin_forward(pos)
    assert kv.num_slots == 0
