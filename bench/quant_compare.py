"""Pre-RoPE quantization (kvpos's store schemes) vs post-RoPE quantization (transformers' QuantizedCache with the HQQ
and quanto backends, installed as peers) on the same prompts, the same model, the same questions.

    pip install -e '.[quant-peers]'          # hqq, optimum-quanto: peers of this benchmark only
    python bench/quant_compare.py --json results/quant_compare.json [--n 40] [--seed 0]

Data: the needle items of bench/rag_eval.py (real essay passages, one planted access code, chat prompt with one user
turn per passage). Every method holds the CONTEXT (anchor + passages) quantized and runs the question and the answer
on top of it (question / answer tokens stay in full precision in every method), so that only the quantization of the
context differs; no chunk reuse is involved (positions are those of full prefill).

Methods (context KV):
  float            full prefill, DynamicCache (the reference)
  kvpos-int8       keys per channel BEFORE RoPE, values per token (the store's int8: one scale set per stored
                   segment: the anchor and each passage), dequantized and rotated back
  kvpos-int4       the store's int4 (asymmetric, groups of 64: keys per channel over 64 tokens before RoPE, values per
                   token over 64 channels)
  post-int8 / post-int4   the same quantizers applied AFTER RoPE (isolates where the quantizer sits)
  hqq-int8 / hqq-int4 / quanto-int4   QuantizedCache(backend, nbits) with transformers' defaults (group 64 on axis 0,
                   residual 128 tokens in full precision): the context is quantized at prefill, post-RoPE
  cache-int8       PositionedCache(storage="int8"): the in-cache scheme (keys per channel over 32-token groups BEFORE
                   RoPE, values per token, the newest <= 32 tokens unquantized); the whole prompt lives in it, so
                   question and answer tokens are sealed into groups too as decoding goes on (decode steps read it
                   through the fused int8 kernel)
  cache-int8-post  the same grouping applied to the context's keys AFTER RoPE (groups of 32 from the first token,
                   the last <= 32 context tokens unquantized; question and answer in full precision)

Columns: bytes_per_token (context KV as held: store entry bytes for kvpos, quantized tensors + metadata + residual for
QuantizedCache), bytes_vs_fp32 (vs an fp32 DynamicCache), kl (mean KL(float || method) of the first answer token),
accuracy (% answers containing the code), agree_float (% answers identical to float's). Look at: kvpos-int8 vs
hqq-int8 (and kvpos-int4 vs hqq-int4 / quanto-int4): KL and accuracy at their bytes.
"""
from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache

from _common import bench_parser, machine, markdown_table, parse_bench_args, write_outputs
from kvpos.data import needle_items
from kvpos.integrations.hf import PositionedCache, load_model
from kvpos.integrations.hf.models import rope_specs_from_config
from kvpos.integrations.rag import ChatPromptBuilder
from kvpos.rope import rotate, unrotate
from kvpos.quant import GROUP, dequantize_keys, dequantize_values, quantize_key_groups, quantize_values
from kvpos.store import ChunkKV, model_fingerprint, serialize
from baselines import quantized_round_trip

KVPOS = ("kvpos-int8", "kvpos-int4", "post-int8", "post-int4")
CACHE = ("cache-int8", "cache-int8-post")
PEERS = {"hqq-int8": ("hqq", 8), "hqq-int4": ("hqq", 4), "quanto-int4": ("quanto", 4)}


def quantized_context(ref: DynamicCache, specs, bounds: list[int], method: str, model) -> DynamicCache:
    """A DynamicCache holding `ref`'s context KV through `method`'s quantizer, segment by segment (`bounds`: token
    offsets of the anchor and each passage, as the store keeps them)."""
    bits = 8 if method.endswith("int8") else 4
    pre = method.startswith("kvpos")
    T = bounds[-1]
    pos = torch.arange(T)
    k = torch.stack([l.keys[0] for l in ref.layers]).float()       # [L, H, T, D] rotated
    v = torch.stack([l.values[0] for l in ref.layers]).float()
    if pre:
        k = torch.stack([unrotate(k[i, None], pos, s)[0] for i, s in enumerate(specs)])
    ks, vs = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qk, qv = quantized_round_trip(k[:, :, a:b], v[:, :, a:b], bits)
        ks.append(qk)
        vs.append(qv)
    k, v = torch.cat(ks, 2), torch.cat(vs, 2)
    if pre:
        k = torch.stack([rotate(k[i, None], pos, s)[0] for i, s in enumerate(specs)])
    out = DynamicCache(config=model.config)
    dt = ref.layers[0].keys.dtype
    for i in range(len(specs)):
        out.update(k[i, None].to(dt), v[i, None].to(dt), i)
    return out


def post_rope_cache_int8(ref: DynamicCache, model) -> DynamicCache:
    """`ref`'s context with the in-cache int8 grouping applied to the ROTATED keys: keys per channel over groups of
    GROUP tokens from the first, values per token, the last <= GROUP tokens unquantized."""
    T = ref.layers[0].keys.shape[2]
    q = GROUP * ((T - 1) // GROUP)
    out = DynamicCache(config=model.config)
    for i, l in enumerate(ref.layers):
        k, v = l.keys.clone(), l.values.clone()
        codes, scales = quantize_key_groups(k[:, :, :q], GROUP)
        k[:, :, :q] = dequantize_keys(codes, (torch.arange(q) // GROUP).int(), scales, k.dtype)
        v[:, :, :q] = dequantize_values(*quantize_values(v[:, :, :q]), v.dtype)
        out.update(k, v, i)
    return out


def _tensor_bytes(obj, seen: set) -> int:
    """Bytes of every distinct tensor storage reachable from obj (tensors, tuples, lists, dicts, objects)."""
    if isinstance(obj, torch.Tensor):
        if obj.__class__ is not torch.Tensor:                      # quanto's QTensor subclasses hold inner tensors
            return sum(_tensor_bytes(getattr(obj, n), seen) for n in obj.__tensor_flatten__()[0])
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x, seen) for x in obj.values())
    return 0


def peer_bytes(cache) -> int:
    seen: set = set()
    return sum(_tensor_bytes([l._quantized_keys, l._quantized_values, l.keys, l.values], seen) for l in cache.layers)


def kvpos_bytes(ref: DynamicCache, specs, bounds, ids, method: str, fp) -> int:
    """Store entry bytes of the context segments in `method`'s scheme (post-RoPE variants: the same sizes)."""
    scheme = "int8" if method.endswith("int8") else "int4"
    k = torch.stack([l.keys[0] for l in ref.layers])
    v = torch.stack([l.values[0] for l in ref.layers])
    return sum(len(serialize(ChunkKV(ids[a:b], k[:, :, a:b], v[:, :, a:b], a, fp), scheme))
               for a, b in zip(bounds[:-1], bounds[1:]))


@torch.no_grad()
def answer(model, cache, question: torch.Tensor, max_new: int, eos: int | None) -> tuple[torch.Tensor, list[int]]:
    """(first-token log-probs, greedy answer ids) of `question` [Q] on top of `cache` (modified)."""
    logits = model(question[None], cache=cache, use_cache=True).logits[0, -1]
    first = F.log_softmax(logits.float(), -1)
    out = [int(logits.argmax())]
    while len(out) < max_new and out[-1] != eos:
        logits = model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1]
        out.append(int(logits.argmax()))
    return first, out


def _peer_cache(model, backend: str, nbits: int):
    from transformers import QuantizedCache

    try:
        return QuantizedCache(backend=backend, config=model.config, nbits=nbits)
    except ImportError as e:
        raise SystemExit(f"{backend}: {e}\nThis benchmark compares against transformers' QuantizedCache: "
                         "pip install -e '.[quant-peers]' (hqq, optimum-quanto)") from e


def main() -> None:
    ap = bench_parser(__doc__, seed=0)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--passages", type=int, default=8)
    ap.add_argument("--passage-tokens", type=int, default=100)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--methods", nargs="*", default=list(KVPOS) + list(PEERS) + list(CACHE),
                    choices=list(KVPOS) + list(PEERS) + list(CACHE))
    a = parse_bench_args(ap)
    if a.n < 1 or a.max_new < 1:
        raise SystemExit(f"expected --n >= 1 and --max-new >= 1, got {a.n}, {a.max_new}")
    model, tok = load_model(a.model)
    specs = rope_specs_from_config(model.config)
    fp = model_fingerprint(model, torch.arange(4), specs)
    builder = ChatPromptBuilder(tok)
    items = needle_items(tok, a.n, a.passages, a.passage_tokens, a.seed)
    names = ["float", *a.methods]
    per = {m: {"kl": [], "acc": [], "agree": [], "bytes": []} for m in names}
    for item in tqdm(items, desc="quant_compare items", file=sys.stdout):
        parts = builder.parts(item["passages"], item["question"])
        segs = [parts.anchor, *parts.chunks]
        ids = torch.cat(segs)
        bounds = [0]
        for s in segs:
            bounds.append(bounds[-1] + s.numel())
        ref = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[None], cache=ref, use_cache=True)
        T = ids.numel()
        fp32_bytes = sum(l.keys.numel() + l.values.numel() for l in ref.layers) * 4
        results = {}
        for m in names:
            if m == "float":
                cache, nbytes = _copy(ref, model), fp32_bytes * ref.layers[0].keys.element_size() // 4
            elif m == "cache-int8":
                cache = PositionedCache.from_model(model, storage="int8")
                with torch.no_grad():
                    model(ids[None], cache=cache, use_cache=True)
                nbytes = cache.nbytes()
            elif m == "cache-int8-post":
                cache = post_rope_cache_int8(ref, model)
                q = GROUP * ((T - 1) // GROUP)           # what the same layout holds: int8 codes + scales + tail
                L, H, D = len(specs), ref.layers[0].keys.shape[1], specs[0].head_dim
                el = ref.layers[0].keys.element_size()
                nbytes = L * H * (2 * q * D + (q // GROUP) * D * el + q * el + 2 * (T - q) * D * el)
            elif m in PEERS:
                cache = _peer_cache(model, *PEERS[m])
                with torch.no_grad():
                    model(ids[None], cache=cache, use_cache=True)
                nbytes = peer_bytes(cache)
            else:
                cache = quantized_context(ref, specs, bounds, m, model)
                nbytes = kvpos_bytes(ref, specs, bounds, ids, m, fp)
            results[m] = answer(model, cache, parts.question, a.max_new, tok.eos_token_id)
            per[m]["bytes"].append(nbytes / T / (fp32_bytes / T))
        gold = item["answer"].lower()
        p_ref, ans_ref = results["float"]
        for m, (p, ans) in results.items():
            text = tok.decode(ans, skip_special_tokens=True)
            per[m]["kl"].append(float((p_ref.exp() * (p_ref - p)).sum()))
            per[m]["acc"].append(gold in text.lower())
            per[m]["agree"].append(ans == ans_ref)
    rows = []
    fp32_per_token = 2 * sum(1 for _ in specs) * model.config.num_key_value_heads * specs[0].head_dim * 4
    for m in names:
        d = per[m]
        ratio = statistics.fmean(d["bytes"])
        rows.append({"method": m, "bytes_per_token": ratio * fp32_per_token, "bytes_vs_fp32": ratio,
                     "kl": statistics.fmean(d["kl"]), "accuracy": 100.0 * statistics.fmean(d["acc"]),
                     "agree_float": 100.0 * statistics.fmean(d["agree"])})
    table = markdown_table(rows, ["method", "bytes_per_token", "bytes_vs_fp32", "kl", "accuracy", "agree_float"],
                           {"bytes_per_token": ".0f", "bytes_vs_fp32": ".3f", "kl": ".4f", "accuracy": ".1f",
                            "agree_float": ".1f"})
    payload = {"model": getattr(model, "name_or_path", "?"), "n": len(items), "args": vars(a), "machine": machine(),
               "rows": rows}
    write_outputs(a.json, payload, table)


def _copy(cache: DynamicCache, model) -> DynamicCache:
    out = DynamicCache(config=model.config)
    for i, l in enumerate(cache.layers):
        out.update(l.keys.clone(), l.values.clone(), i)
    return out


if __name__ == "__main__":
    main()
