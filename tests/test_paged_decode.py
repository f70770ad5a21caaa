"""The paged raw-key decode kernel (kvpos._kernels.decode_paged_kernel: what the vLLM backend decodes with) against
the float64 reference (explicit rotation matrices, softmax from the formula): rows of different lengths whose raw
keys sit in scattered blocks of a pool, in vLLM's CPU block layout (keys [D, bs], values [bs, D] per head) and in a
slot-major one, positions that are not token indices (a parallel layout's); refusals where it cannot serve."""
import pytest
import torch

from kvpos._kernels import decode_paged_kernel, rope_kernel_available
from kvpos.reference import decode_rows_ref
from kvpos.rope import RopeLayout, cos_sin

from kernel_cases import spec_for

pytestmark = pytest.mark.skipif(not rope_kernel_available(), reason="no C compiler: the fused kernel is not built")


def _pool(rows_k, rows_v, bs, D, layout, g):
    """A block pool [nb, H, bs * 2D] holding each row's keys / values in scattered blocks; (pool, table, kmap,
    vmap). The element maps are written here from the layout's definition, not by the code under test."""
    H = rows_k[0].shape[0]
    need = [-(-k.shape[1] // bs) for k in rows_k]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=g)
    pool = torch.full((nb, H, bs * 2 * D), float("nan"))
    if layout == "vllm":                     # keys [D, bs], values [bs, D] after them
        kmap, vmap = (0, 1, bs), (bs * D, D, 1)
    else:                                    # slot-major: [bs, 2D], key then value per slot
        kmap, vmap = (0, 2 * D, 1), (D, 2 * D, 1)
    table = torch.zeros(len(rows_k), max(need), dtype=torch.long)
    used = 0
    for b, (k, v) in enumerate(zip(rows_k, rows_v)):
        for j in range(need[b]):
            blk = int(perm[used])
            used += 1
            table[b, j] = blk
            d = torch.arange(D)
            for o in range(min(bs, k.shape[1] - j * bs)):
                t = j * bs + o
                pool[blk, :, kmap[0] + o * kmap[1] + d * kmap[2]] = k[:, t]
                pool[blk, :, vmap[0] + o * vmap[1] + d * vmap[2]] = v[:, t]
    return pool, table, kmap, vmap


@pytest.mark.parametrize("layout", ["vllm", "slot-major"])
@pytest.mark.parametrize("H,G,D,bs,scaling", [(3, 3, 64, 16, 1.0), (2, 4, 32, 8, 1.2)])
def test_paged_decode_equals_the_float64_reference(layout, H, G, D, bs, scaling):
    g = torch.Generator().manual_seed(D + bs)
    spec = spec_for(D, D, RopeLayout.HALF, scaling)
    lens = [37, 1, 16, 50]
    rows_k = [torch.randn(H, n, D, generator=g) for n in lens]
    rows_v = [torch.randn(H, n, D, generator=g) for n in lens]
    poss = [torch.cat([torch.arange(5), torch.arange(5, 5 + n - 5) % 17 + 5]) if n > 5 else torch.arange(n)
            for n in lens]                                         # overlapping positions, as passages in parallel
    q = torch.randn(len(lens), H * G, D, generator=g)
    pool, table, kmap, vmap = _pool(rows_k, rows_v, bs, D, layout, g)
    smax = max(lens)
    cos = torch.zeros(len(lens), D // 2, smax)
    sin = torch.zeros(len(lens), D // 2, smax)
    for b, p in enumerate(poss):
        c, s = cos_sin(p[None], spec)
        cos[b, :, :p.numel()] = c[0].T * spec.attention_scaling
        sin[b, :, :p.numel()] = s[0].T * spec.attention_scaling
    got = decode_paged_kernel(q, pool, table, torch.tensor(lens), cos, sin, 0.125, kmap, vmap)
    want = decode_rows_ref(q.double(), [k.double() for k in rows_k], [v.double() for v in rows_v], poss, spec, 0.125)
    assert got is not None and (got.double() - want).abs().max() < 1e-4


def test_paged_decode_refuses_what_it_cannot_serve():
    q, pool = torch.randn(1, 9, 64), torch.zeros(4, 3, 16 * 128)
    table, lens = torch.zeros(1, 2, dtype=torch.long), torch.tensor([20])
    cs = torch.zeros(1, 32, 32)
    args = (0.125, (0, 1, 16), (16 * 64, 64, 1))
    assert decode_paged_kernel(q, pool, table, lens, cs, cs, *args) is not None
    assert decode_paged_kernel(q, pool.bfloat16(), table, lens, cs, cs, *args) is None          # float32 only
    assert decode_paged_kernel(q, pool, table, torch.tensor([40]), cs, cs, *args) is None      # beyond its blocks
    assert decode_paged_kernel(q, pool, table.int(), lens, cs, cs, *args) is None                # int64 tables
    assert decode_paged_kernel(torch.randn(1, 8, 64), pool, table, lens, cs, cs, *args) is None  # 8 % 3 heads
