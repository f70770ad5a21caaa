"""The CUDA backend's read path (integrations/vllm/rows.py + flash_layout.py, no vLLM) on CUDA tensors against a
float64 reference built from the definition: keys written raw into a FlashAttention-layout paged cache (un-rotated
at vLLM's positions, as do_kv_cache_update does), one request in the parallel layout (three passages at
overlapping positions after an anchor, then a question), every token a query; the reference rotates keys and
queries to the logical positions in float64 and runs a masked softmax with grouped query heads.

    PYTHONPATH=. python3 experiments/cuda_rows_check.py --device cuda --json OUT.json     (a GPU; kvpos from the
                                                                                          checkout, not installed)

Also times row_attention for 80 queries over 8k keys (sequential) on the device, median of 20 after 3 warm-ups.
"""
import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time

import torch

from kvpos.rope import RopeSpec, rotate, unrotate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    """integrations/vllm/<name>.py by file (a GPU machine without kvpos installed has no kvpos.integrations; the
    two modules import only torch and kvpos)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "integrations", "vllm", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _reference(q_raw, k_raw, v, logical, allowed, spec64, scale):
    """float64: q_raw [Hq, s, D], k_raw, v [H, s, D] -> [s, Hq, D]."""
    q = rotate(q_raw[None], logical, spec64)[0]
    k = rotate(k_raw[None], logical, spec64)[0]
    G = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
    sc = (q @ k.transpose(1, 2)) * scale
    sc = sc.masked_fill(~allowed[None], float("-inf"))
    return (torch.softmax(sc, -1) @ v).transpose(0, 1)


def check(rows, flash, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, Hq, D, bs, nb = 3, 9, 64, 16, 40
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    spec = RopeSpec(inv, 1.0, D, D)
    spec64 = RopeSpec(inv.double(), 1.0, D, D, angle_dtype=torch.float64)
    anchor, lengths, nq = 20, [50, 40, 30], 12
    s = anchor + sum(lengths) + nq
    logical, allowed = rows.layout_positions(anchor, lengths, "parallel", s, s)
    k_raw = torch.randn(H, s, D, generator=g, dtype=torch.float64)
    v = torch.randn(H, s, D, generator=g, dtype=torch.float64)
    q_raw = torch.randn(Hq, s, D, generator=g, dtype=torch.float64)
    vpos = torch.arange(s)
    # what the engine holds: keys rotated at vLLM's positions, un-rotated before the write; queries at vLLM's
    k_vllm = rotate(k_raw.to(dtype).to(device)[None], vpos.to(device), spec)[0]
    k_store = unrotate(k_vllm[None], vpos.to(device), spec)[0]
    q_vllm = rotate(q_raw.to(dtype).to(device)[None], vpos.to(device), spec)[0].transpose(0, 1)   # [s, Hq, D]
    kv = torch.zeros(nb, H, bs, 2 * D, dtype=dtype, device=device)
    block_ids = torch.tensor([7, 3, 12, 0, 25, 9, 31, 14, 2, 19])[: -(-s // bs)]
    t = torch.arange(s)
    lay = flash.FlashLayout(dtype)
    lay.write(kv, k_store.transpose(0, 1), v.to(dtype).to(device).transpose(0, 1), block_ids[t // bs] * bs + t % bs)
    view = rows.RowView(0, s, s, block_ids.to(device), 0, logical, allowed)
    raw, val = lay.gather_blocks(kv, view.block_ids, s)
    got = rows.row_attention(q_vllm, vpos.to(device), view, spec, 1 / math.sqrt(D), raw, val, 0, s)
    want = _reference(q_raw, k_raw, v, logical, allowed, spec64, 1 / math.sqrt(D))
    err = (got.double().cpu() - want).abs().max().item()
    return {"device": str(device), "dtype": str(dtype), "tokens": s, "max_abs_err": err}


def timing(rows, flash, device, s=8016, n=80, reps=20):
    H, Hq, D, bs = 3, 9, 64, 16
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    spec = RopeSpec(inv, 1.0, D, D)
    nblk = -(-s // bs)
    kv = torch.randn(nblk, H, bs, 2 * D, device=device)
    q = torch.randn(n, Hq, D, device=device)
    view = rows.RowView(0, n, s, torch.arange(nblk, device=device), 0)
    lay = flash.FlashLayout(torch.float32)
    vpos = torch.arange(s - n, s, device=device)

    def once():
        raw, val = lay.gather_blocks(kv, view.block_ids, s)
        out = rows.row_attention(q, vpos, view, spec, 0.125, raw, val, 0, n)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    for _ in range(3):
        once()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        ts.append(time.perf_counter() - t0)
    return {"device": str(device), "keys": s, "queries": n, "median_ms": 1e3 * statistics.median(ts)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows, flash = _load("rows"), _load("flash_layout")
    dev = torch.device(a.device)
    res = {"checks": [check(rows, flash, dev, torch.float32), check(rows, flash, dev, torch.bfloat16, 1)],
           "timing": timing(rows, flash, dev), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
