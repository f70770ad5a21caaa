"""Every causal-LM architecture transformers ships, built small from its default config: PositionedCache either
refuses it at construction with a clear error or is exact, on every storage and read path.

The decision whether decode steps may hand raw keys to the model's attention (storage "raw" / "int8") is made by
`from_model` trying it on the model (kvpos.integrations.hf.cache.check_raw_handoff), not by a list: this sweep is
the test that the decision is right for every architecture. Exact means: decode logits within 1e-4 of the model's
own forward over the whole sequence without a cache (rotated and raw storage), and of the int8 cache's own
rotate-into-buffer reference path (int8, whose quantization is the approximation)."""
import pytest
import torch

from kvpos import UnsupportedRopeError
from kvpos.integrations.hf import PositionedCache, extend
from kvpos.integrations.hf.testing import causal_lm_types, sweep_model

TYPES = list(causal_lm_types())
# far larger than a tiny model even with the generic overrides (a vision tower, audio codecs): minutes each
HEAVY = {"blt", "gemma3", "gemma4", "gemma4_unified", "gemma4_unified_assistant", "mllama", "got_ocr2",
         "moss_transcribe_diarize", "phi4_multimodal"}
PROMPT = 40                                     # int8: one sealed group of 32 and a tail
CLEAR = (ValueError, TypeError, UnsupportedRopeError)


def _ids(n, seed=1):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _decode(model, cache, ids):
    """Last-position logits of a prefill of ids[:, :-2] and two decode steps, [3, V]."""
    with torch.no_grad():
        rows = [extend(model, cache, ids[:, :-2])[:, -1]]
        rows += [extend(model, cache, ids[:, i:i + 1])[:, -1] for i in (PROMPT - 2, PROMPT - 1)]
    return torch.cat(rows).float()


def _try(model, ids, **kw):
    """(logits, None) or (None, the exception) of a cache built with `kw`; only clear errors are returned."""
    try:
        return _decode(model, PositionedCache.from_model(model, **kw), ids), None
    except CLEAR as e:
        return None, e


def _built(model_type):
    try:
        return sweep_model(model_type)
    except Exception as e:  # noqa: BLE001 - the generic overrides do not fit this architecture's config
        return e


@pytest.mark.parametrize("model_type", [t for t in TYPES if t not in HEAVY])
def test_each_architecture_is_refused_clearly_or_exact_on_every_storage(model_type, fuzz_record):
    model = _built(model_type)
    if isinstance(model, Exception):
        return                                   # counted by the coverage test below (not a case tried)
    ids = _ids(PROMPT)
    got, err = _try(model, ids)
    if err is not None:                          # refused: every storage refuses
        for st in ("raw", "int8"):
            with pytest.raises(CLEAR):
                _decode(model, PositionedCache.from_model(model, storage=st), ids)
        fuzz_record("architecture sweep (storage x read)", "clear error")
        return
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0, -3:].float()
    scale = max(1.0, float(ref.abs().max()))
    assert float((got - ref).abs().max()) <= 1e-4 * scale, f"{model_type}: rotated storage vs the model's forward"
    q8_ref, e = _try(model, ids, storage="int8", read="torch")
    assert e is None, f"{model_type}: int8 reference path raised {e}"
    for storage, want in (("raw", ref), ("int8", q8_ref)):
        for read in ("auto", "fused"):
            out, e = _try(model, ids, storage=storage, read=read)
            if e is not None:
                assert read == "fused" and "read='fused'" in str(e), f"{model_type} {storage}/{read}: {e}"
                fuzz_record("architecture sweep (storage x read)", "clear error")
                continue
            diff = float((out - want).abs().max())
            fuzz_record("architecture sweep (storage x read)", "ok" if diff <= 1e-4 * scale else "silent wrong")
            assert diff <= 1e-4 * scale, f"{model_type} storage={storage} read={read}: logits off by {diff:.3g}"


def test_the_sweep_covers_most_architectures_and_every_tiny_family():
    """Guard against the generic config silently building nothing: most architectures build, and the families of
    the exactness suite (testing.TINY_ARCHS) are among them."""
    built = [t for t in TYPES if t not in HEAVY and not isinstance(_built(t), Exception)]
    assert len(built) >= 100, f"only {len(built)} of {len(TYPES)} architectures built: {built}"
    for family in ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "gpt_neox", "cohere", "glm", "stablelm"):
        assert family in built, family
