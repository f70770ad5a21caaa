"""storage="raw" (rotate-on-read) through the attention backends and position operations: the same numbers as the
default storage, whose exactness the other modules test against engine references."""
import pytest
import torch

from kvpos.integrations.hf import PositionedCache, extend
from kvpos.integrations.hf.testing import tiny_model
from kvpos.integrations.window import WindowConfig, use_window


def _pair(arch, n=48, seed=0):
    model = tiny_model(arch)[0]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (1, n), generator=g)
    caches = {s: PositionedCache.from_model(model, storage=s) for s in ("rotated", "raw")}
    for c in caches.values():
        extend(model, c, ids)
    return model, caches, torch.randint(3, 128, (1, 3), generator=g)


@pytest.mark.parametrize("arch", ["llama", "phi3", "cohere"])
def test_position_operations_then_a_forward_equal_the_default_storage(arch):
    model, caches, q = _pair(arch)
    out = {}
    for s, c in caches.items():
        c.shift_(10, 30, 7)
        c.delete_(2, 5, close_gap=True)
        c.set_positions_(0, 2, torch.tensor([300, 301]))
        out[s] = extend(model, c, q)
        assert c.positions.tolist() == caches["rotated"].positions.tolist()
    assert (out["raw"] - out["rotated"]).abs().max() < 1e-4


@pytest.mark.parametrize("far_scores", ["exact", "windowed"])
def test_windowed_attention_reads_rotate_on_read_keys(far_scores):
    model, caches, q = _pair("llama", n=60)
    cfg = WindowConfig(sinks=4, window=8, selector="exact", budget=16, far_scores=far_scores)
    out = {}
    for s, c in caches.items():
        with use_window(model, c, cfg):
            out[s] = extend(model, c, q)
    assert (out["raw"] - out["rotated"]).abs().max() < 1e-4
