"""vLLM's paged KV cache on the CPU backend, as kvpos reads and writes it: one place for the block layout.

Per layer one tensor [blocks, kv heads, block size, 2 x head dim]; each head's block interior holds the block's keys
and values in a layout of the attention kernel's instruction set. Writes go through vLLM's own
`cpu_attn_reshape_and_cache`; reads use the element map that op produces on a scratch block, found once.
"""
from __future__ import annotations

import torch
import vllm._custom_ops as vllm_ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvpos._checks import fail

__all__ = ["PagedLayout", "halves"]


def halves(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache) views of one layer's paged tensor, as the CPU attention backend makes them."""
    nb, H, bs, d2 = kv.shape
    return kv.view(nb, H, 2 * bs, d2 // 2).chunk(2, dim=2)


class PagedLayout:
    """The block interior of one engine's paged cache (block size, kv heads, head dim and dtype fixed at the first
    call): `write` keys and values into slots, `gather` them back by (block, offset)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.isa: str | None = None
        self.maps: tuple[torch.Tensor, torch.Tensor] | None = None
        self.map_strides: tuple | None = None

    def element_maps(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where vLLM's cache op puts key / value element (offset o, dim d) inside one head's block: two [bs, D]
        int64 maps into the block interior flattened, found by writing coded values into a scratch block."""
        if self.maps is None:
            _, H, bs, d2 = kv.shape
            D = d2 // 2
            self.isa = _get_attn_isa(self.dtype, bs, D, "auto")
            scratch = torch.zeros(1, H, bs, d2, dtype=torch.float32)
            code = (torch.arange(bs * D, dtype=torch.float32) + 1).view(bs, 1, D).expand(bs, H, D).contiguous()
            kc, vc = halves(scratch)
            vllm_ops.cpu_attn_reshape_and_cache(code, -code, kc, vc, torch.arange(bs), self.isa)
            flat = scratch[0, 0].reshape(-1)
            kmap, vmap = torch.full((bs * D,), -1, dtype=torch.long), torch.full((bs * D,), -1, dtype=torch.long)
            kmap[(flat[flat > 0] - 1).long()] = (flat > 0).nonzero().flatten()
            vmap[(-flat[flat < 0] - 1).long()] = (flat < 0).nonzero().flatten()
            if bool((kmap < 0).any()) or bool((vmap < 0).any()):
                fail("kvpos paged layout", "every key and value element found in the block", "missing elements")
            self.maps = (kmap.view(bs, D), vmap.view(bs, D))
        return self.maps

    def write(self, kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [s, H, D] (any strides) into slots [s] int64 (block * block size + offset) of the layer tensor
        `kv`: where both element maps are strided views, one indexed copy through each view (what vLLM's cache op
        writes, element for element; tested against it), else vLLM's own `cpu_attn_reshape_and_cache`."""
        self.element_maps(kv)
        kst, vst = self._map_strides(kv)
        if kst is not None and vst is not None:
            bs = kv.shape[2]
            b, o = slots // bs, slots % bs
            _block_view(kv, kst)[b, :, o] = k.to(kv.dtype)
            _block_view(kv, vst)[b, :, o] = v.to(kv.dtype)
            return
        kc, vc = halves(kv)
        vllm_ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), kc, vc, slots, self.isa)

    def gather(self, kv: torch.Tensor, blocks: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [H, s, D] of the tokens at (blocks [s], offs [s]) of the layer tensor `kv`."""
        kmap, vmap = self.element_maps(kv)
        nb, H = kv.shape[:2]
        flat = kv.view(nb, H, -1)
        k = flat[blocks[:, None], :, kmap[offs]].permute(2, 0, 1)
        v = flat[blocks[:, None], :, vmap[offs]].permute(2, 0, 1)
        return k, v

    def gather_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [H, s, D] of the first s tokens held in the blocks block_ids [n] int64 (in order, n *
        block size >= s). Equals `gather` with blocks = block_ids[t // bs], offs = t % bs (the attention read):
        where the element map is a strided view (vLLM's "vec" layout: keys [D, bs], values [bs, D]) the blocks are
        read through that view, else through the map."""
        nb, H, bs, d2 = kv.shape
        if block_ids.numel() * bs < s:
            fail("kvpos paged gather", f"at least {s} slots in the blocks", f"{block_ids.numel()} blocks of {bs}")
        return tuple(_in_token_order(kv, m, st, block_ids, s) for m, st in zip(self.element_maps(kv),
                                                                                self._map_strides(kv)))

    def _map_strides(self, kv: torch.Tensor) -> tuple:
        """(_strides of the key map, of the value map), found with the maps (once per engine)."""
        if self.map_strides is None:
            self.map_strides = tuple(_strides(m) for m in self.element_maps(kv))
        return self.map_strides

    def affine(self, kv: torch.Tensor) -> bool:
        """Whether both element maps are strided views (what `key_blocks` needs)."""
        return None not in self._map_strides(kv)

    def strides(self, kv: torch.Tensor) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """((base, slot stride, dim stride) of keys, the same of values) inside one head's block run of bs * 2D
        elements; ValueError where a map is not affine."""
        st = self._map_strides(kv)
        if None in st:
            fail("kvpos paged strides", "an affine block layout", "a permuted element map")
        return st

    def copy_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor, dst: torch.Tensor, first: int) -> None:
        """Blocks block_ids [n] of kv, as they are (keys and values), into blocks first .. first + n - 1 of dst (a
        tensor of kv's block shape)."""
        n = block_ids.numel()
        if dst.shape[1:] != kv.shape[1:] or dst.dtype != kv.dtype or not 0 <= first <= dst.shape[0] - n:
            fail("kvpos paged copy_blocks", f"{n} blocks of {list(kv.shape[1:])} {kv.dtype} from block {first}",
                 f"a destination of {list(dst.shape)} {dst.dtype}")
        torch.index_select(kv, 0, block_ids, out=dst[first:first + n])

    def key_blocks(self, kv: torch.Tensor) -> torch.Tensor:
        """Every block's keys as a strided view [blocks, H, bs, D] of kv (write through it); ValueError where the
        key map is not affine."""
        view = _block_view(kv, self._map_strides(kv)[0])
        if view is None:
            fail("kvpos paged key_blocks", "an affine block layout", "a permuted element map",
                 "use gather_blocks and attention in torch for this layout")
        return view


def _strides(m: torch.Tensor) -> tuple[int, int, int] | None:
    """(offset, stride of o, stride of d) when the element map m [bs, D] is affine, else None."""
    bs, D = m.shape
    base = int(m[0, 0])
    so = int(m[1, 0]) - base if bs > 1 else 0
    sd = int(m[0, 1]) - base if D > 1 else 0
    want = base + torch.arange(bs)[:, None] * so + torch.arange(D)[None] * sd
    return (base, so, sd) if torch.equal(m, want) else None


def _block_view(kv: torch.Tensor, st: tuple[int, int, int] | None) -> torch.Tensor | None:
    """The elements of a map with strides st (_strides) of every block as a strided view [blocks, H, bs, D] of kv,
    or None when the map is not affine (st None)."""
    nb, H, bs, d2 = kv.shape
    if st is None:
        return None
    base, so, sd = st
    flat = kv.view(nb, H, bs * d2)
    return flat.as_strided((nb, H, bs, d2 // 2), (H * bs * d2, bs * d2, so, sd), flat.storage_offset() + base)


def _in_token_order(kv: torch.Tensor, m: torch.Tensor, st: tuple[int, int, int] | None, block_ids: torch.Tensor,
                    s: int) -> torch.Tensor:
    """The elements of map m [bs, D] (strides st, _strides) of blocks block_ids [n], as [H, s, D] in token order."""
    nb, H, bs, d2 = kv.shape
    D, n = d2 // 2, block_ids.numel()
    view = _block_view(kv, st)
    if view is None:
        x = kv.view(nb, H, bs * d2).index_select(0, block_ids).index_select(2, m.reshape(-1)).view(n, H, bs, D)
    else:
        x = view.index_select(0, block_ids)
    return x.permute(1, 0, 2, 3).reshape(H, n * bs, D)[:, :s]
