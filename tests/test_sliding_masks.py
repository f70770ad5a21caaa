"""Custom 4-D masks on models with sliding-window layers: transformers hands such a mask unchanged to every layer,
so every kvpos path that builds one (explicit extend masks, re-encoding slots in place, the attention probe) must
give the sliding layers their window. Reference: the model's own forward (transformers builds the window itself)."""
import pytest
import torch

from kvpos.integrations.hf import PositionedCache, extend, layer_masks
from kvpos.integrations.hf.testing import tiny_model
from kvpos.integrations.repairs import attention_mass, recompute_slots

WINDOWED = [("gemma3", {"sliding_window": 8}), ("mistral", {"sliding_window": 8})]


def _ids(n: int = 40) -> torch.Tensor:
    return torch.randint(5, 100, (1, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch,over", WINDOWED, ids=[a for a, _ in WINDOWED])
def test_extend_with_an_explicit_causal_mask_keeps_the_sliding_window(arch, over):
    model = tiny_model(arch, **over)[0]
    ids = _ids()
    ref = model(ids).logits
    cache = PositionedCache.from_model(model)
    extend(model, cache, ids[:, :10])
    S, T = 30, 10
    allowed = torch.ones(S, T + S, dtype=torch.bool).tril(T)[None, None]
    got = extend(model, cache, ids[:, 10:], attention_mask=allowed)
    assert (got - ref[:, 10:]).abs().max() < 1e-4


@pytest.mark.parametrize("arch,over", WINDOWED, ids=[a for a, _ in WINDOWED])
def test_re_encoding_slots_in_full_context_reproduces_full_prefill(arch, over):
    """recompute_slots (query-aware re-encode, selective recompute) on a sliding-window model: re-encoding slots
    10..29 causally must give the KV full prefill gave them (it ignored the window before: logits off by ~1)."""
    model = tiny_model(arch, **over)[0]
    ids = _ids()
    ref = model(ids).logits
    cache = PositionedCache.from_model(model)
    extend(model, cache, ids[:, :30])
    allowed = torch.ones(20, 30, dtype=torch.bool).tril(10)
    recompute_slots(model, cache, torch.arange(10, 30), ids[0, 10:30], allowed)
    got = extend(model, cache, ids[:, 30:])
    assert (got - ref[:, 30:]).abs().max() < 1e-4


def test_the_attention_probe_sees_no_key_outside_a_sliding_window():
    """attention_mass on a model whose layers all slide (Mistral, window 8): the last probe rows put no mass on
    slots more than the window behind them."""
    model = tiny_model("mistral", sliding_window=8)[0]
    ids = _ids(30)
    cache = PositionedCache.from_model(model)
    extend(model, cache, ids)
    mass = attention_mass(model, cache, 1, ids[0])            # the last slot probes the other 29
    assert mass.shape == (29,) and float(mass[:29 - 7].abs().max()) == 0.0 and float(mass[29 - 7:].sum()) > 0


def test_layer_masks_leaves_full_attention_models_alone_and_splits_mixed_ones():
    mask = torch.zeros(1, 1, 3, 20)
    llama = tiny_model("llama")[0]
    assert layer_masks(llama, mask, torch.arange(17, 20)) is mask
    gemma = tiny_model("gemma3", sliding_window=8)[0]
    got = layer_masks(gemma, mask, torch.arange(17, 20))
    assert set(got) == set(gemma.config.layer_types) and got["full_attention"] is mask
    hidden = got["sliding_attention"][0, 0] < 0
    assert hidden[0, :10].all() and not hidden[0, 10:].any() and hidden[2, :12].all() and not hidden[2, 12:].any()
