"""transformers conformance: every Cache behaviour of DynamicCache and every generate mode, on tiny models of every
supported architecture, run with DynamicCache and with PositionedCache and compared."""
import pytest
import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from kvpos.integrations.hf import PositionedCache
from kvpos.integrations.hf.testing import TINY_ARCHS, tiny_model

CACHES = {
    "dynamic": lambda model, cfg: DynamicCache(config=cfg),
    "positioned": lambda model, cfg: PositionedCache.from_model(model),
    "positioned_raw": lambda model, cfg: PositionedCache.from_model(model, storage="raw"),   # rotate-on-read
}
POSITIONED = [k for k in CACHES if k != "dynamic"]


def _ids(B=1, S=10, seed=1):
    return torch.randint(3, 128, (B, S), generator=torch.Generator().manual_seed(seed))


def _filled(kind, arch="llama", S=10):
    model, cfg = tiny_model(arch)
    cache = CACHES[kind](model, cfg)
    model(_ids(S=S), cache=cache, use_cache=True)
    return model, cfg, cache


# ---------------------------------------------------------------------------------------------------------------------
# Cache behaviours
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(CACHES))
def test_iteration_and_the_ddp_round_trip(kind):
    model, cfg, cache = _filled(kind)
    rebuilt = DynamicCache(ddp_cache_data=iter(cache))
    assert rebuilt.get_seq_length() == 10
    for (k, v, _), l in zip(cache, rebuilt.layers):
        assert torch.equal(k, l.keys) and torch.equal(v, l.values)


@pytest.mark.parametrize("kind", list(CACHES))
def test_is_initialized_seq_length_and_mask_sizes(kind):
    model, cfg = tiny_model("llama")
    cache = CACHES[kind](model, cfg)
    assert not cache.is_initialized and cache.get_seq_length() == 0
    model(_ids(), cache=cache, use_cache=True)
    assert cache.is_initialized and cache.get_seq_length() == 10
    assert cache.get_mask_sizes(3, 0) == (13, 0)


@pytest.mark.parametrize("kind", list(CACHES))
def test_crop_semantics_and_errors(kind):
    model, cfg, cache = _filled(kind)
    with pytest.raises(ValueError):
        cache.crop(4)                                            # a positive length is refused by both
    assert cache.get_seq_length() == 10
    cache.crop(0)
    assert cache.get_seq_length() == 10
    cache.crop(-3)
    assert cache.get_seq_length() == 7
    cache.crop(-50)                                              # more than held: empty, no error
    assert cache.get_seq_length() == 0


def test_crop_and_batch_operations_give_the_same_tensors_on_both():
    out = {}
    for kind in CACHES:
        model, cfg = tiny_model("qwen2")
        cache = CACHES[kind](model, cfg)
        model(_ids(B=2), cache=cache, use_cache=True)
        cache.batch_repeat_interleave(2)
        cache.batch_select_indices(torch.tensor([3, 0, 1]))
        cache.reorder_cache(torch.tensor([2, 2, 0]))
        cache.crop(-2)
        out[kind] = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
    for (a, b), (c, d) in zip(out["dynamic"], out["positioned"]):
        assert torch.equal(a, c) and torch.equal(b, d)
    for (a, b), (c, d) in zip(out["dynamic"], out["positioned_raw"]):   # keys rotated from raw: rounding only
        assert torch.allclose(a, c, rtol=0, atol=1e-5) and torch.equal(b, d)


@pytest.mark.parametrize("kind", list(CACHES))
def test_layer_offload_and_prefetch(kind):
    model, cfg, cache = _filled(kind)
    ref = model.generate(_ids(), max_new_tokens=5, do_sample=False)
    for l in cache.layers:
        l.offload()
        assert l.keys.device.type == "cpu"
        l.prefetch()
    got = model.generate(ref[:, :11], cache=cache, max_new_tokens=4, do_sample=False)
    assert got.tolist() == ref.tolist()


def test_positioned_offloading_mode_generates_the_same_tokens():
    model, cfg = tiny_model("llama")
    ref = model.generate(_ids(), max_new_tokens=6, do_sample=False)
    cache = PositionedCache(PositionedCache.from_model(model).specs, origin=None, offloading=True)
    assert model.generate(_ids(), cache=cache, max_new_tokens=6, do_sample=False).tolist() == ref.tolist()


# ---------------------------------------------------------------------------------------------------------------------
# generate modes, every architecture
# ---------------------------------------------------------------------------------------------------------------------

class _Collect(BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens += value.flatten().tolist()

    def end(self):
        self.tokens.append(-1)


def _mode(name, arch, model, cfg, cache):
    """Run generate mode `name` with `cache`; returns something comparable."""
    ids = _ids()
    kw = dict(max_new_tokens=6, cache=cache, pad_token_id=cfg.pad_token_id)
    if name == "sampling":
        torch.manual_seed(7)
        return model.generate(ids, do_sample=True, top_k=20, temperature=1.3, **kw).tolist()
    if name == "beams":
        return model.generate(ids, num_beams=3, num_return_sequences=2, do_sample=False, **kw).tolist()
    if name == "beam_sampling":
        torch.manual_seed(3)
        return model.generate(ids, num_beams=2, do_sample=True, **kw).tolist()
    if name == "left_padded":
        ids = _ids(B=3)
        mask = torch.ones_like(ids)
        mask[1, :3], mask[2, :6] = 0, 0
        return model.generate(ids.masked_fill(mask == 0, cfg.pad_token_id), attention_mask=mask, do_sample=False,
                              **kw).tolist()
    if name == "prompt_lookup":
        ids = torch.tensor([[5, 6, 7, 8] * 4])
        return model.generate(ids, prompt_lookup_num_tokens=3, do_sample=False, **{**kw, "max_new_tokens": 10}).tolist()
    if name == "assisted":
        assistant = tiny_model(arch, seed=1)[0]
        return model.generate(ids, assistant_model=assistant, do_sample=False, **kw).tolist()
    if name == "penalties":
        return model.generate(ids, repetition_penalty=1.5, no_repeat_ngram_size=2, do_sample=False, **kw).tolist()
    if name == "streamer":
        s = _Collect()
        model.generate(ids, streamer=s, do_sample=False, **kw)
        return s.tokens
    if name == "continue":
        first = model.generate(ids, do_sample=False, return_dict_in_generate=True, **kw)
        return model.generate(first.sequences, cache=first.cache, max_new_tokens=4, do_sample=False,
                              pad_token_id=cfg.pad_token_id).tolist()
    if name == "inputs_embeds":
        emb = model.get_input_embeddings()(ids)
        return model.generate(inputs_embeds=emb, do_sample=False, **kw).tolist()
    if name == "logits_to_keep":
        out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        return [out.logits.shape[1], out.logits[0, -1].argmax().item()]
    raise ValueError(name)


MODES = ["sampling", "beams", "beam_sampling", "left_padded", "prompt_lookup", "assisted", "penalties", "streamer",
         "continue", "inputs_embeds", "logits_to_keep"]


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("mode", MODES)
def test_generate_mode_gives_the_same_output_with_both_caches(arch, mode):
    model, cfg = tiny_model(arch)
    got = {kind: _mode(mode, arch, model, cfg, CACHES[kind](model, cfg)) for kind in CACHES}
    for kind in POSITIONED:
        assert got[kind] == got["dynamic"], f"{arch} {mode} {kind}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "cohere"])
def test_bf16_generate_is_identical(arch):
    model, cfg = tiny_model(arch, dtype=torch.bfloat16)
    kw = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    a = model.generate(_ids(), cache=DynamicCache(config=cfg), **kw)
    b = model.generate(_ids(), cache=PositionedCache.from_model(model), **kw)
    assert a.sequences.tolist() == b.sequences.tolist()
    err = max((x.float() - y.float()).abs().max().item() for x, y in zip(a.logits, b.logits))
    # bit-identical, except Gemma3's sliding layers: DynamicCache drops keys beyond the window, PositionedCache keeps
    # them and masks them, so bf16 sums differ in the last bit
    assert err == 0.0 if arch != "gemma3" else err <= 2 ** -5


def test_pipeline_with_a_positioned_cache():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    vocab = {f"w{i}": i for i in range(128)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", pad_token="w0", eos_token="w2")
    model, cfg = tiny_model("llama")
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    prompt = " ".join(f"w{i}" for i in (5, 9, 17, 33, 64))
    want = pipe(prompt, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    got = pipe(prompt, max_new_tokens=6, do_sample=False, cache=PositionedCache.from_model(model))[0]["generated_text"]
    assert got == want and len(got.split()) > 5
