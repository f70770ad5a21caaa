"""PositionedCache through model.generate equals DynamicCache, on every supported RoPE variant."""
import pytest
import torch
from transformers import DynamicCache

from kvpos.integrations.hf import PositionedCache
from kvpos.integrations.hf.testing import TINY_ARCHS, tiny_model


def _ids(B=1, S=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (B, S), generator=g)


@pytest.mark.parametrize("storage", ["rotated", "raw"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_generate_matches_dynamic_cache(arch, storage):
    model, cfg = tiny_model(arch)
    ids = _ids()
    kw = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, cache=DynamicCache(config=cfg), **kw)
    cache = PositionedCache.from_model(model, storage=storage)
    got = model.generate(ids, cache=cache, **kw)
    assert got.sequences.tolist() == ref.sequences.tolist()
    assert (got.logits[0] - ref.logits[0]).abs().max() < 1e-4
    for a, b in zip(got.logits, ref.logits):
        assert (a - b).abs().max() < 1e-4
    # the cache holds every token once, at positions 0..T-1, raw keys re-rotate to the stored rotated keys
    T = got.sequences.shape[1] - 1
    assert cache.num_slots == T
    assert cache.positions.tolist() == [list(range(T))]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt_neox"])
def test_past_key_values_alias_still_works(arch):
    model, cfg = tiny_model(arch)
    ids = _ids()
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    got = model.generate(ids, past_key_values=PositionedCache.from_model(model), max_new_tokens=6, do_sample=False)
    assert got.tolist() == ref.tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_left_padded_batch(arch):
    model, cfg = tiny_model(arch)
    ids = _ids(B=3, S=10)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    ids = ids.masked_fill(mask == 0, cfg.pad_token_id)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=cfg.pad_token_id)
    ref = model.generate(ids, cache=DynamicCache(config=cfg), **kw)
    cache = PositionedCache.from_model(model)
    got = model.generate(ids, cache=cache, **kw)
    assert got.tolist() == ref.tolist()
    # per-row positions: row 2 starts counting after its 7 pads
    assert int(cache.positions[2, 7]) == 0 and int(cache.positions[0, 7]) == 7


def test_sampling_same_seed_same_tokens():
    model, cfg = tiny_model("llama")
    ids = _ids(B=2)
    kw = dict(max_new_tokens=10, do_sample=True, top_k=20, temperature=1.3)
    torch.manual_seed(123)
    ref = model.generate(ids, cache=DynamicCache(config=cfg), **kw)
    torch.manual_seed(123)
    got = model.generate(ids, cache=PositionedCache.from_model(model), **kw)
    assert got.tolist() == ref.tolist()


@pytest.mark.parametrize("arch", ["llama", "cohere"])
def test_beam_search_reorders(arch):
    model, cfg = tiny_model(arch)
    ids = _ids(B=2)
    kw = dict(max_new_tokens=8, do_sample=False, num_beams=3, num_return_sequences=2, early_stopping=True)
    ref = model.generate(ids, cache=DynamicCache(config=cfg), **kw)
    cache = PositionedCache.from_model(model)
    got = model.generate(ids, cache=cache, **kw)
    assert got.tolist() == ref.tolist()
    assert cache.table.batch_size == 6


def test_assisted_decoding_crops():
    """Prompt-lookup decoding drafts tokens and crops the rejected ones: crop(-k) must keep the cache consistent."""
    model, cfg = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    kw = dict(max_new_tokens=16, do_sample=False)
    ref = model.generate(ids, cache=DynamicCache(config=cfg), **kw)
    cache = PositionedCache.from_model(model)
    calls = []
    orig = cache.crop
    cache.crop = lambda n: (calls.append(n), orig(n))[1]
    got = model.generate(ids, cache=cache, prompt_lookup_num_tokens=4, **kw)
    assert got.tolist() == ref.tolist()
    assert calls, "prompt lookup decoding never cropped the cache: the test exercises nothing"
    assert cache.num_slots == got.shape[1] - 1
    assert cache.positions.tolist() == [list(range(got.shape[1] - 1))]


def test_storage_grows_geometrically_without_reallocating_each_step():
    model, _ = tiny_model("llama")
    cache = PositionedCache.from_model(model)
    model.generate(_ids(S=5), cache=cache, max_new_tokens=200, min_new_tokens=200, do_sample=False)
    caps = cache.layers[0].capacity
    assert cache.num_slots == 204 and 204 <= caps <= 2 * 204


def test_reusing_one_position_tensor_modified_in_place_is_not_served_stale():
    """The per-forward memo of positions must notice an in-place change of the caller's position tensor."""
    from kvpos.integrations.hf import PositionedCache

    model, _ = tiny_model("llama")
    cache = PositionedCache.from_model(model)
    pos = torch.arange(0, 4)[None]
    model(torch.randint(3, 128, (1, 4)), position_ids=pos, cache=cache, use_cache=True)
    pos += 4
    model(torch.randint(3, 128, (1, 4)), position_ids=pos, cache=cache, use_cache=True)
    assert cache.positions.tolist() == [list(range(8))]
    for l in cache.layers:   # rotated keys of the second forward correspond to positions 4..7
        from kvpos import rotate
        assert (rotate(l.raw_keys, cache.positions, l.spec) - l.keys).abs().max() < 1e-5


def test_a_dropped_cache_frees_its_buffers_at_once_without_the_cycle_collector():
    """No reference cycle between a cache and its layers: evaluation loops that build many caches must not wait
    for the cycle collector (an earlier version accumulated gigabytes)."""
    import gc
    import weakref

    model, _ = tiny_model("llama")
    cache = PositionedCache.from_model(model)
    model(_ids(), cache=cache, use_cache=True)
    buf = weakref.ref(cache.layers[0].rot_k)
    gc.disable()
    try:
        del cache
        assert buf() is None
    finally:
        gc.enable()
