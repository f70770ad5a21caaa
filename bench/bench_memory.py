"""KV memory and decode speed of each cache storage, side by side in one run, on the default model.

    python bench/bench_memory.py --json results/bench_memory.json [--contexts 2048 8192 32768] [--steps 8]

For each model dtype (fp32, bf16) and context length, three caches hold the same number of tokens:
  dynamic   transformers' DynamicCache (rotated keys + values)
  rotated   PositionedCache storage="rotated" (raw keys + rotated keys + values; attention reads stored keys)
  raw       PositionedCache storage="raw" (raw keys + values; decode steps attended by the fused C kernel, which
            rotates each key on read in registers: read="auto", the default, on an SDPA model)
  raw-torch the same storage with read="torch": keys rotated on read into one per-forward scratch buffer, then SDPA
            (the reference path)
  int8      PositionedCache storage="int8" (raw keys int8 per channel over 32-token groups, values int8 per token,
            the newest <= 32 tokens unquantized; decode steps attended by the fused int8 kernel)
  int8-torch the same storage with read="torch": dequantized and rotated into per-forward buffers, then SDPA
There is no in-cache 4-bit mode (the store has int4 entries: see the store rows).
The caches are filled with random keys and values (bytes and decode time do not depend on the values; 32k tokens is
beyond what a CPU prefills in a benchmark's time), then each decodes `--steps` tokens with a plain forward loop,
modes alternating for `--reps` rounds (the order rotating); the median per-token time gives tokens/s, and
decode_ratio_vs_dynamic is the median over rounds of the ratio within a round (min and max beside it). cache_bytes = bytes allocated for
keys, values and positions between forwards (capacity, growth slack included); forward_scratch_bytes = what a
forward allocates on top while it runs (raw-torch: one layer's rotated keys plus cos/sin; int8-torch: one layer's
keys and values dequantized, with their float32 temporaries; raw / int8: cos/sin plus the kernel's split-K partials).
shift_ms = `shift_` of the first half of the slots (rotated: re-rotates every moved key; the others write the slot
table only).

Store rows: bytes per token of one 512-token chunk in the kvpos store format (every scheme: float, int8, int4),
and `ChunkStore.get` time (verified read, dequantized) from a DiskBackend and from a local redis-server
(`--store-only` for these rows alone).

Look at: ratio_vs_dynamic of raw (target <= 1.02) and decode_ratio_vs_dynamic (target >= 0.95 at 2k and 8k); of
int8 (targets: bytes <= 0.30x fp32 / 0.55x bf16 DynamicCache, decode >= 0.9x).
"""
from __future__ import annotations

import statistics
import tempfile
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache

from _common import bench_parser, machine, markdown_table, parse_bench_args, plot, write_outputs
from kvpos.integrations.hf import PositionedCache, load_model
from kvpos.integrations.hf.models import rope_specs_from_config
from kvpos.store import SCHEMES, ChunkKV, ChunkStore, DiskBackend, RedisBackend, model_fingerprint, serialize

MODES = ("dynamic", "rotated", "raw", "raw-torch", "int8", "int8-torch")


def _kv_dims(model) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder config."""
    c = model.config
    return c.num_hidden_layers, c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def random_kv(model, ctx: int, dtype: torch.dtype, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) [1, H, ctx, D] of `dtype`, normal(0, 1)."""
    L, H, D = _kv_dims(model)
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, H, ctx, D, generator=g).to(dtype), torch.randn(1, H, ctx, D, generator=g).to(dtype))
            for _ in range(L)]


def build(model, mode: str, kv) -> DynamicCache | PositionedCache:
    """A cache of `mode` holding `kv` at positions 0..T-1 (raw keys for PositionedCache, as-is for DynamicCache)."""
    if mode == "dynamic":
        c = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(kv):
            c.update(k.clone(), v.clone(), i)
        return c
    storage = {"rotated": "rotated", "raw": "raw", "raw-torch": "raw"}.get(mode, "int8")
    c = PositionedCache.from_model(model, storage=storage, read="torch" if mode.endswith("-torch") else "auto")
    c.append_raw_(kv, torch.arange(kv[0][0].shape[2]))
    return c


def cache_bytes(cache) -> int:
    """Bytes allocated for keys, values (and positions) between forwards."""
    if isinstance(cache, PositionedCache):
        n = sum(b.numel() * b.element_size() for l in cache.layers for b in l.buffers())
        return n + cache.positions.numel() * 8
    return sum(t.numel() * t.element_size() for l in cache.layers for t in (l.keys, l.values))


def scratch_bytes(cache) -> int:
    """What a forward allocates on top of the resident cache: cos/sin per spec, plus one layer of rotated keys
    (read="torch") or the fused kernel's split-K partials and output (read="auto" / "fused")."""
    if not isinstance(cache, PositionedCache) or cache.storage == "rotated":
        return 0
    raw = cache.layers[0].key_store
    B, H, _, D = raw.shape
    n = cache.num_slots
    specs = {id(x.spec): x.spec for x in cache.layers}
    cos_sin = sum(2 * B * n * (s.rotary_dim // 2) * 4 for s in specs.values())
    if cache.read == "torch":
        el = torch.empty(0, dtype=cache.dtype).element_size()
        # raw: one layer's rotated keys; int8: its keys and values dequantized, plus the float32 temporaries
        return B * H * n * D * (el if cache.storage == "raw" else 2 * el + 2 * 4) + cos_sin
    Hq = cache_query_heads(cache)
    return cos_sin + 4 * (B * H * ((n + 127) // 128) * (Hq // H) * (D + 2) + B * Hq * D)


def cache_query_heads(cache) -> int:
    model = cache.origin()
    return model.config.num_attention_heads


@torch.no_grad()
def decode_times(model, cache, steps: int, seed: int) -> list[float]:
    """Per-token seconds of `steps` greedy forwards of one token each (the first, which warms, dropped)."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(100, model.config.vocab_size - 100, (1, 1), generator=g)
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        ts.append(time.perf_counter() - t)
    return ts[1:]


def shift_ms(cache, reps: int = 5) -> float | None:
    """Median ms of shift_(0, T/2, +1) then back (two calls, halved)."""
    if not isinstance(cache, PositionedCache):
        return None
    half, ts = cache.num_slots // 2, []
    for _ in range(reps):
        t = time.perf_counter()
        cache.shift_(0, half, 1)
        cache.shift_(0, half, -1)
        ts.append((time.perf_counter() - t) / 2)
    return 1e3 * statistics.median(ts)


def memory_rows(model, dtype_name: str, contexts, steps: int, reps: int) -> list[dict]:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model.to(dtype)
    rows = []
    for ctx in tqdm(contexts, desc=f"contexts ({dtype_name})"):
        kv = random_kv(model, ctx, dtype)
        caches = {m: build(model, m, kv) for m in MODES}
        del kv
        size = {m: cache_bytes(c) for m, c in caches.items()}
        times = {m: [] for m in MODES}
        rounds = {m: [] for m in MODES}                         # per-round median seconds per token
        for r in range(reps):               # every mode once per round, the order rotating: drift hits all alike
            for m in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                ts = decode_times(model, caches[m], steps, seed=r)
                times[m].extend(ts)
                rounds[m].append(statistics.median(ts))
        for m in MODES:
            paired = [d / t for t, d in zip(rounds[m], rounds["dynamic"])]   # same round, side by side
            rows.append({"context": ctx, "mode": m, "dtype": dtype_name, "cache_bytes": size[m],
                         "ratio_vs_dynamic": size[m] / size["dynamic"],
                         "forward_scratch_bytes": scratch_bytes(caches[m]),
                         "decode_tokens_per_s": 1.0 / statistics.median(times[m]),
                         "decode_ratio_vs_dynamic": statistics.median(paired),
                         "decode_ratio_min": min(paired), "decode_ratio_max": max(paired),
                         "shift_ms": shift_ms(caches[m])})
        del caches
    return rows


def store_rows(model, reps: int) -> list[dict]:
    """Bytes per token of one 512-token chunk and its verified read time from disk and Redis, fp32 and bf16."""
    from kvpos.integrations.servers import start_redis

    L, H, D = _kv_dims(model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_redis(tmp)
        try:
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                model.to(dtype)
                fp = model_fingerprint(model, torch.arange(4), rope_specs_from_config(model.config))
                g = torch.Generator().manual_seed(1)
                S = 512
                chunk = ChunkKV(torch.randint(0, 1000, (S,), generator=g), torch.randn(L, H, S, D, generator=g).to(dtype),
                                torch.randn(L, H, S, D, generator=g).to(dtype), 0, fp)
                for scheme in SCHEMES:
                    per_tok = len(serialize(chunk, scheme)) / S
                    for backend_name, backend in (
                            ("disk", DiskBackend(f"{tmp}/store-{scheme}", scheme=scheme)),
                            ("redis", RedisBackend(port=port, prefix=f"bench-{name}-{scheme}:", scheme=scheme))):
                        store = ChunkStore(backend, fp)
                        store.put(chunk)
                        ts = []
                        for _ in range(reps):
                            t = time.perf_counter()
                            got = store.get(chunk.ids)
                            ts.append(time.perf_counter() - t)
                            assert got is not None and got.values.shape == chunk.values.shape
                        rows.append({"dtype": name, "scheme": scheme, "backend": backend_name, "chunk_tokens": S,
                                     "bytes_per_token": per_tok, "fetch_ms": 1e3 * statistics.median(ts),
                                     "fetch_ms_per_1k_tokens": 1e3 * statistics.median(ts) * 1000 / S})
                base = next(r["bytes_per_token"] for r in rows if r["dtype"] == "fp32" and r["scheme"] == "float")
                for r in rows:
                    r["bytes_vs_fp32_float"] = r["bytes_per_token"] / base
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return rows


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=9, help="forwards per round (the first of each warms, dropped)")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--no-store", action="store_true", help="skip the store rows (they start a redis-server)")
    ap.add_argument("--store-only", action="store_true", help="only the store rows (every scheme, disk and Redis)")
    a = parse_bench_args(ap)
    if any(c < 16 for c in a.contexts) or a.steps < 2 or a.reps < 1:
        raise SystemExit(f"expected contexts >= 16, steps >= 2, reps >= 1; got {a.contexts}, {a.steps}, {a.reps}")
    model, _ = load_model(a.model)
    if a.store_only and a.no_store:
        raise SystemExit("expected at most one of --store-only and --no-store")
    rows = [] if a.store_only else [r for d in a.dtypes for r in memory_rows(model, d, a.contexts, a.steps, a.reps)]
    store = [] if a.no_store else store_rows(model, reps=7)
    cols = ["context", "mode", "dtype", "cache_bytes", "ratio_vs_dynamic", "forward_scratch_bytes",
            "decode_tokens_per_s", "decode_ratio_vs_dynamic", "decode_ratio_min", "decode_ratio_max", "shift_ms"]
    table = markdown_table(rows, cols, {"ratio_vs_dynamic": ".3f", "decode_tokens_per_s": ".2f",
                                        "decode_ratio_vs_dynamic": ".3f", "decode_ratio_min": ".3f",
                                        "decode_ratio_max": ".3f", "shift_ms": ".2f"}) if rows else ""
    if store:
        table += ("\n\n" if table else "") + markdown_table(store, ["dtype", "scheme", "backend", "chunk_tokens", "bytes_per_token",
                                                 "bytes_vs_fp32_float", "fetch_ms", "fetch_ms_per_1k_tokens"],
                                         {"bytes_per_token": ".0f", "bytes_vs_fp32_float": ".3f", "fetch_ms": ".2f",
                                          "fetch_ms_per_1k_tokens": ".2f"})
    payload = {"model": getattr(model, "name_or_path", "?"), "steps": a.steps, "reps": a.reps, "machine": machine(),
               "rows": rows, "store": store}
    write_outputs(a.json, payload, table)
    if not rows:
        return
    png = a.json and a.json.rsplit(".", 1)[0] + ".png"
    series = {f"{m} {d} (x: context, y: decode ratio)": ([r["context"] for r in rows if r["mode"] == m and r["dtype"] == d],
                                                          [r["decode_ratio_vs_dynamic"] for r in rows
                                                           if r["mode"] == m and r["dtype"] == d])
              for m in MODES[1:] for d in a.dtypes if not m.endswith("-torch")}
    plot(png, series, "context tokens", "decode tokens/s / DynamicCache", "Decode speed by cache storage, CPU",
         logx=True)


if __name__ == "__main__":
    main()
