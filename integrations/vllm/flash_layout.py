"""vLLM's paged KV cache in the FlashAttention layout (CUDA builds), as kvpos reads and writes it; no vLLM import.

Per layer one tensor [blocks, kv heads, block size, 2 x head dim]: token o of block b, head h holds its key in
[b, h, o, :D] and its value in [b, h, o, D:] (FlashAttentionImpl splits `kv_cache.transpose(1, 2)` at D). Indexing
is logical, so any physical stride order vLLM picks reads the same. The same methods as paged.PagedLayout (the CPU
layout), so the connector's worker and the attention backends take either.
"""
from __future__ import annotations

import torch

from kvpos._checks import fail

__all__ = ["FlashLayout"]


class FlashLayout:
    """Reads and writes of the FlashAttention paged layout (dtype: the cache's)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    @staticmethod
    def _check(kv: torch.Tensor) -> tuple[int, int, int, int]:
        if kv.dim() != 4 or kv.shape[3] % 2:
            fail("kvpos flash layout", "a layer tensor [blocks, kv heads, block size, 2 x head dim]", list(kv.shape))
        return tuple(kv.shape)

    def write(self, kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [s, H, D] into slots [s] int64 (block * block size + offset) of the layer tensor `kv`."""
        nb, H, bs, d2 = self._check(kv)
        D = d2 // 2
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (H, D) or slots.shape != (k.shape[0],):
            fail("kvpos flash write", f"k, v [s, H={H}, D={D}] and slots [s]",
                 f"{list(k.shape)}, {list(v.shape)}, {list(slots.shape)}")
        slots = slots.to(kv.device, torch.long)
        b, o = slots // bs, slots % bs
        kv[b, :, o, :D] = k.to(kv.device, kv.dtype)
        kv[b, :, o, D:] = v.to(kv.device, kv.dtype)

    def gather(self, kv: torch.Tensor, blocks: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [H, s, D] of the tokens at (blocks [s], offs [s]) of the layer tensor `kv`."""
        nb, H, bs, d2 = self._check(kv)
        x = kv[blocks.to(kv.device, torch.long), :, offs.to(kv.device, torch.long)]        # [s, H, 2D]
        return x[..., :d2 // 2].transpose(0, 1), x[..., d2 // 2:].transpose(0, 1)

    def gather_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [H, s, D] of the first s tokens held in the blocks block_ids [n] int64 (in order, n *
        block size >= s)."""
        nb, H, bs, d2 = self._check(kv)
        n = block_ids.numel()
        if n * bs < s:
            fail("kvpos flash gather", f"at least {s} slots in the blocks", f"{n} blocks of {bs}")
        x = kv.index_select(0, block_ids.to(kv.device, torch.long))                         # [n, H, bs, 2D]
        x = x.transpose(0, 1).reshape(H, n * bs, d2)[:, :s]
        return x[..., :d2 // 2], x[..., d2 // 2:]
