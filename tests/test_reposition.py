"""Re-positioning is exact against an independent reference: one plain forward with explicit position_ids + 4-D mask."""
import pytest
import torch

from kvpos.integrations.hf import PositionedCache, extend, forward_reference, generate
from kvpos.integrations.hf.testing import TINY_ARCHS, tiny_model


def _model(arch):
    over = {"sliding_window": 4096} if arch == "gemma3" else {}  # a 4-D reference mask bypasses sliding windows
    return tiny_model(arch, **over)[0]


def _block_mask(lengths, n_query):
    """allowed [1, 1, N, N]: each segment causal within itself only; the query sees everything before it."""
    N = sum(lengths) + n_query
    allowed = torch.zeros(N, N, dtype=torch.bool)
    s = 0
    for L in lengths:
        allowed[s:s + L, s:s + L] = torch.tril(torch.ones(L, L, dtype=torch.bool))
        s += L
    allowed[s:, :s] = True
    allowed[s:, s:] = torch.tril(torch.ones(n_query, n_query, dtype=torch.bool))
    return allowed[None, None]


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("seed", [0, 1])
def test_segments_placed_anywhere_equal_reference(arch, seed):
    model = _model(arch)
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(3, 12, (3,), generator=g)]
    segs = [torch.randint(3, 128, (1, L), generator=g) for L in lengths]
    # each segment encoded alone at its own arbitrary start position
    parts = []
    for ids in segs:
        c = PositionedCache.from_model(model)
        start = int(torch.randint(0, 50, (1,), generator=g))
        extend(model, c, ids, positions=torch.arange(start, start + ids.shape[1]))
        parts.append(c)
    order = torch.randperm(3, generator=g).tolist()
    cache = PositionedCache.concat([parts[i] for i in order])
    # move each segment rigidly to an arbitrary offset (overlaps and gaps allowed)
    final_pos, s = [], 0
    for i in order:
        L = lengths[i]
        off = int(torch.randint(0, 300, (1,), generator=g))
        cache.shift_(s, s + L, off - int(cache.positions[0, s]))
        final_pos.append(torch.arange(off, off + L))
        s += L
    q = torch.randint(3, 128, (1, 4), generator=g)
    qpos = torch.arange(400, 404)
    got = extend(model, cache, q, positions=qpos)
    ids = torch.cat([segs[i] for i in order] + [q], 1)
    pos = torch.cat(final_pos + [qpos])[None]
    ref = forward_reference(model, ids, pos, _block_mask([lengths[i] for i in order], 4))
    err = (got - ref[:, -4:]).abs().max().item()
    assert err < 1e-4, f"{arch}: max |logit diff| {err}"


@pytest.mark.parametrize("arch", ["llama", "gemma3", "glm", "gpt_neox"])
def test_hidden_and_deleted_slots_equal_reference(arch):
    model = _model(arch)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (1, 20), generator=g)
    cache = PositionedCache.from_model(model)
    extend(model, cache, ids)
    cache.hide_(4, 8)            # tokens 4..7 stay in memory but out of attention for what comes next
    cache.delete_(12, 15)        # tokens 12..14 gone, no gap closing: positions keep a hole
    q = torch.randint(3, 128, (1, 3), generator=g)
    got = extend(model, cache, q)                      # default positions: after the largest visible one
    assert cache.positions[0, -3:].tolist() == [20, 21, 22]
    # reference: all 20 tokens computed as before; only the query is blind to the hidden and the deleted ones
    full = torch.cat([ids, q], 1)
    pos = torch.arange(23)[None]
    allowed = torch.tril(torch.ones(23, 23, dtype=torch.bool))
    allowed[20:, 4:8] = False
    allowed[20:, 12:15] = False
    ref = forward_reference(model, full, pos, allowed[None, None])
    assert (got - ref[:, 20:]).abs().max() < 1e-4


def test_generate_after_move_equals_fresh_computation_at_those_positions():
    model = _model("qwen2")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (1, 16), generator=g)
    cache = PositionedCache.from_model(model)
    extend(model, cache, ids)
    cache.shift_(0, 16, 100)   # the whole context now sits at 100..115
    q = torch.randint(3, 128, (1, 2), generator=g)
    out = generate(model, cache, q, max_new_tokens=8, do_sample=False)
    fresh = model.generate(torch.cat([ids, q], 1), position_ids=torch.arange(100, 118)[None], max_new_tokens=8,
                           do_sample=False)
    assert out[:, 2:].tolist() == fresh[:, 18:].tolist()
