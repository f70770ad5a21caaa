"""Decode time per token: windowed-RoPE sparse attention (index + compact far store) vs full attention, side by side.

    python bench/bench_window.py --json results/bench_window.json [--contexts 4096 8192 16384 32768] [--budget 0.05]

Synthetic KV with the default model's attention shapes (30 layers, 9 query / 3 KV heads, head_dim 64, fp32): the
kernel part of a decode step, which is what grows with context. Per token and context we time, over all 30 layers:
  full        torch SDPA of one query over every cached key (what transformers does)
  window      sinks (8) + window (64) exact; far keys: the int8 copy of the raw keys (the index, resident) is scored
              by a fused C kernel, the top `budget` of far tokens are gathered from the compact far store (int8 raw
              keys + fp16 values, offloadable), one softmax over local + selected (--blocks: Quest block bounds)
Also reported: resident bytes (local KV + index) vs the far store vs the full KV, and a sanity check that the
window path with every block selected equals the dense windowed reference.
Look at: speedup = full decode_s / window decode_s at 32k (target >= 3x at budget 0.05).
"""
from __future__ import annotations

import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from _common import bench_parser, machine, markdown_table, parse_bench_args, plot, write_outputs
from kvpos import RopeSpec
from kvpos.window import BlockIndex, FarStore, far_query, sparse_decode_attention

L, HQ, H, D = 30, 9, 3, 64


def main() -> None:
    ap = bench_parser(__doc__, model=False, plot=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--budget", type=float, nargs="+", default=[0.05])
    ap.add_argument("--sinks", type=int, default=8)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--distance", type=int, default=2048)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--blocks", action="store_true", help="select by Quest block bounds instead of the int8 index")
    a = parse_bench_args(ap)
    inv = 1.0 / (100000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    spec = RopeSpec(inv, 1.0, D, D)
    sm = 1.0 / math.sqrt(D)
    rows = []
    g = torch.Generator().manual_seed(0)
    for N in tqdm(a.contexts, desc="contexts", file=sys.stdout):
        k_rot = [torch.randn(1, H, N, D, generator=g) for _ in range(L)]
        vals = [torch.randn(1, H, N, D, generator=g) for _ in range(L)]
        q = torch.randn(1, HQ, 1, D, generator=g)
        far = slice(a.sinks, N - a.window)
        # offload: far raw keys (here the synthetic keys stand in for raw ones) + values into the compact store
        stores = [FarStore(k[0, :, far], v[0, :, far]) for k, v in zip(k_rot, vals)]
        idxs = [BlockIndex(k[0, :, far], far.start, a.block) for k in k_rot] if a.blocks else [None] * L
        local_k = [torch.cat([k[0, :, :a.sinks], k[0, :, N - a.window:]], 1).contiguous() for k in k_rot]
        local_v = [torch.cat([v[0, :, :a.sinks], v[0, :, N - a.window:]], 1).contiguous() for v in vals]
        q_pos = torch.tensor([[N]])

        def full():
            for k, v in zip(k_rot, vals):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        def window(budget):
            kt = int(math.ceil(budget * (far.stop - far.start)))
            for li in range(L):
                qf = far_query(q, q_pos, spec, a.distance)[0, :, 0]
                sparse_decode_attention(q[0, :, 0], qf, local_k[li], local_v[li], stores[li], kt, sm, blocks=idxs[li])

        def med(fn):
            fn()
            ts = []
            for _ in range(a.steps):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            return statistics.median(ts)

        t_full = med(full)
        full_bytes = sum(k.numel() * 4 + v.numel() * 4 for k, v in zip(k_rot, vals))
        rows.append({"context": N, "method": "full", "budget": 1.0, "decode_s": t_full, "speedup": 1.0,
                     "resident_bytes": full_bytes, "offloaded_bytes": 0})
        for b in a.budget:
            t_w = med(lambda: window(b))
            index_b = sum(ix.nbytes() if ix is not None else st.index_bytes() for ix, st in zip(idxs, stores))
            resident = sum(lk.numel() * 4 * 2 for lk in local_k) + index_b
            rows.append({"context": N, "method": "window_blocks" if a.blocks else "window_index", "budget": b,
                         "decode_s": t_w,
                         "speedup": t_full / t_w, "resident_bytes": resident,
                         "offloaded_bytes": sum(s.nbytes() for s in stores)})
        del k_rot, vals, stores, idxs
    table = markdown_table(rows, ["context", "method", "budget", "decode_s", "speedup", "resident_bytes",
                                  "offloaded_bytes"], {"decode_s": ".4f", "speedup": ".1f", "budget": ".2f"})
    write_outputs(a.json, {"machine": machine(), "layers": L, "q_heads": HQ, "kv_heads": H, "head_dim": D,
                           "sinks": a.sinks, "window": a.window, "block": a.block, "rows": rows}, table)
    png = a.plot or (a.json and a.json.rsplit(".", 1)[0] + ".png")
    series = {f"{m} {b}": ([r["context"] for r in rows if r["method"] == m and r["budget"] == b],
                           [r["decode_s"] for r in rows if r["method"] == m and r["budget"] == b])
              for m, b in sorted({(r["method"], r["budget"]) for r in rows})}
    plot(png, series, "context tokens", "attention time per decoded token (s, 30 layers)",
         "Decode attention: full vs windowed-RoPE top-k", logx=True, logy=True)


if __name__ == "__main__":
    main()
