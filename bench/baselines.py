"""Baselines the benchmarks share (comparison only, never product code): the post-RoPE quantization that
rag_eval.py --store-scheme *-post-rope, --cache-int8 and quant_compare.py measure kvpos's pre-RoPE storage against.
Public within bench/: benches import these names, never each other's private functions."""
from __future__ import annotations

import torch

from kvpos.integrations.hf.models import rope_specs_from_config
from kvpos.integrations.rag import RagPipeline
from kvpos.quant import GROUP, dequantize_keys, dequantize_values, quantize_key_groups, quantize_values
from kvpos.rope import rotate, unrotate
from kvpos.store import (ChunkKV, DiskBackend, MemoryBackend, dequantize_int4, dequantize_int8, quantize_int4,
                         quantize_int8)

__all__ = ["quantized_round_trip", "PostRopeBackend", "store_backend", "PostRopeInt8Pipeline"]


def quantized_round_trip(keys: torch.Tensor, values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values [L, H, S, D] through the store's int8 / int4 scheme and back (float32)."""
    if bits == 8:
        q = quantize_int8(keys, values)
        return (dequantize_int8(q["keys"], q["keys_scale"], torch.float32),
                dequantize_int8(q["values"], q["values_scale"], torch.float32))
    q = quantize_int4(keys, values)
    return (dequantize_int4(q["keys"], q["keys_scale"], q["keys_min"], 2, torch.float32),
            dequantize_int4(q["values"], q["values_scale"], q["values_min"], 3, torch.float32))


class PostRopeBackend(MemoryBackend):
    """Comparison only: what storing keys int8 / int4 AFTER RoPE would give at equal bytes. Each chunk's raw keys are
    rotated to the positions they were encoded at, quantized with the same scheme (keys per channel, values per
    token), dequantized and un-rotated before they are kept; reads then serve them like any entry."""

    def __init__(self, model, bits: int) -> None:
        super().__init__()
        self.specs = rope_specs_from_config(model.config)
        self.bits = bits

    def put(self, key: str, chunk: ChunkKV) -> bool:
        pos = torch.arange(chunk.start, chunk.start + chunk.num_tokens)
        rot = torch.stack([rotate(chunk.raw_keys[i, None].float(), pos, s)[0] for i, s in enumerate(self.specs)])
        deq, vals = quantized_round_trip(rot, chunk.values, self.bits)
        raw = torch.stack([unrotate(deq[i, None], pos, s)[0] for i, s in enumerate(self.specs)])
        return super().put(key, ChunkKV(chunk.ids, raw.to(chunk.raw_keys.dtype), vals.to(chunk.values.dtype),
                                        chunk.start, chunk.fingerprint, chunk.meta))


def store_backend(scheme: str, model, tmp: str):
    """The chunk store's backend for --store-scheme: None (memory, float), a DiskBackend writing int8 / int4
    entries, or the post-RoPE comparison at the same bit width."""
    if scheme == "float":
        return None
    if scheme in ("int8", "int4"):
        return DiskBackend(tmp, scheme=scheme)
    return PostRopeBackend(model, 8 if scheme.startswith("int8") else 4)


class PostRopeInt8Pipeline(RagPipeline):
    """Comparison only: methods named "*_int8_post" get their composed cache's keys quantized AFTER RoPE with the
    in-cache grouping (kvpos.quant: keys per channel over GROUP-token groups from the first slot, values per token,
    the last <= GROUP slots unquantized), dequantized in place; everything else as RagPipeline."""

    def _request(self, parts, method):
        cache, info = super()._request(parts, method)
        if method.name.endswith("_int8_post"):
            T = cache.num_slots
            q = GROUP * ((T - 1) // GROUP)
            for l in cache.layers:
                k, v = l.rot_k[:, :, :q], l.v[:, :, :q]
                codes, scales = quantize_key_groups(k, GROUP)
                k.copy_(dequantize_keys(codes, (torch.arange(q) // GROUP).int(), scales, k.dtype))
                v.copy_(dequantize_values(*quantize_values(v), v.dtype))
        return cache, info
