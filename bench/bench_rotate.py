"""Re-positioning throughput: shift_ of a whole cache (all layers) in GB/s vs a memcpy of the same bytes, same run.

    python bench/bench_rotate.py --json results/bench_rotate.json [--tokens 512 2048 8192] [--dtype float32 bfloat16]

Shapes are the default model's (30 layers, 3 KV heads, head_dim 64), synthetic data. A shift reads every raw key and
writes every rotated key: bytes = 2 x key bytes. The baseline copies the raw keys into the rotated buffer (the same
reads and writes). Look at: ratio = shift GB/s / memcpy GB/s (target >= 0.5).
"""
from __future__ import annotations


import torch
from tqdm import tqdm

from _common import bench_parser, machine, markdown_table, median_time, parse_bench_args, plot, write_outputs
from kvpos import RopeSpec
from kvpos.reference import rotate_ref
from kvpos.integrations.hf import PositionedCache


def build(T: int, dtype: torch.dtype, layers: int = 30, heads: int = 3, head_dim: int = 64) -> PositionedCache:
    inv = 1.0 / (100000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cache = PositionedCache([RopeSpec(inv, 1.0, head_dim, head_dim)] * layers)
    kv = [(torch.randn(1, heads, T, head_dim).to(dtype), torch.randn(1, heads, T, head_dim).to(dtype))
          for _ in range(layers)]
    cache.append_raw_(kv, torch.arange(T))
    return cache


def main() -> None:
    ap = bench_parser(__doc__, model=False, plot=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=7)
    a = parse_bench_args(ap)
    rows = []
    for dname in a.dtype:
        dtype = getattr(torch, dname)
        for T in tqdm(a.tokens, desc=f"rotate {dname}"):
            cache = build(T, dtype)
            # correctness once: the shifted keys equal the float64 reference rotation of the raw keys
            cache.shift_(0, T, 1000)
            l0 = cache.layers[0]
            ref = rotate_ref(l0.raw_keys[:, :, :64], cache.positions[:, :64], l0.spec)
            tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-3
            assert (l0.keys[:, :, :64].double() - ref).abs().max() <= tol * ref.abs().max(), "rotation is wrong"
            key_bytes = sum(l.raw_keys.numel() * l.raw_keys.element_size() for l in cache.layers)
            moved = 2 * key_bytes
            flip = [1]

            def shift():
                flip[0] = -flip[0]
                cache.shift_(0, T, 7 * flip[0])

            def memcpy():
                for l in cache.layers:
                    l.rot_k[:, :, :T].copy_(l.raw_k[:, :, :T])

            t_shift = median_time(shift, a.reps)
            t_copy = median_time(memcpy, a.reps)
            rows.append({"tokens": T, "dtype": dname, "bytes": moved, "shift_ms": 1e3 * t_shift,
                         "memcpy_ms": 1e3 * t_copy, "shift_GBps": moved / t_shift / 1e9,
                         "memcpy_GBps": moved / t_copy / 1e9, "ratio": t_copy / t_shift})
    table = markdown_table(rows, ["tokens", "dtype", "shift_ms", "memcpy_ms", "shift_GBps", "memcpy_GBps", "ratio"],
                           {"shift_ms": ".2f", "memcpy_ms": ".2f", "shift_GBps": ".2f", "memcpy_GBps": ".2f",
                            "ratio": ".2f"})
    write_outputs(a.json, {"machine": machine(), "layers": 30, "kv_heads": 3, "head_dim": 64, "rows": rows}, table)
    png = a.plot or (a.json and a.json.rsplit(".", 1)[0] + ".png")
    series = {f"{kind} {d}": ([r["tokens"] for r in rows if r["dtype"] == d],
                              [r[f"{kind}_GBps"] for r in rows if r["dtype"] == d])
              for d in a.dtype for kind in ("shift", "memcpy")}
    plot(png, series, "cached tokens", "GB/s", "Re-positioning throughput vs memcpy (30 layers)", logx=True)


if __name__ == "__main__":
    main()
