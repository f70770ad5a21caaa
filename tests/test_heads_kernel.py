"""The fused decode kernel under read-time position maps (kvpos._posmap_kernels.decode_heads_kernel): every query head rotates
the raw keys with its own table (per-head position scales, Ms-PoE) and scores each key with the query variant of the
key's segment (per-(head, segment) offsets, PINE). Checked against the float64 oracle that builds one rotation
matrix per (head, key) from the mapped positions; identity maps are bit-identical to the plain raw-key kernel."""
import pytest
import torch

from kvpos._kernels import decode_raw_kernel, rope_kernel_available
from kvpos._posmap_kernels import decode_heads_kernel
from kvpos.posmap import factor_bits, factored_tables
from kvpos.reference import decode_heads_ref
from kvpos.rope import RopeLayout

from kernel_cases import decode_case, spec_for

pytestmark = pytest.mark.skipif(not rope_kernel_available(), reason="no C compiler: the fused kernel is not built")


def _tables(kpos, spec):
    """cos / sin [Rt, Bc, N, R/2] float32 of mapped (fractional) positions kpos [Rt, Bc, N], times the scaling."""
    ang = kpos.double()[..., None] * spec.inv_freq.double()
    s = spec.attention_scaling
    return (ang.cos() * s).float(), (ang.sin() * s).float()


@pytest.mark.parametrize("B,Hkv,G,N,D,R,layout,dtype", [
    (1, 3, 3, 300, 64, 64, RopeLayout.HALF, torch.float32),           # SmolLM2's shape, AVX2 path
    (2, 2, 4, 260, 64, 32, RopeLayout.INTERLEAVED, torch.float32),    # plain-C path, partial rotary
    (2, 1, 2, 7, 32, 32, RopeLayout.HALF, torch.bfloat16),            # fewer keys than one vector, bf16
    (1, 2, 5, 200, 64, 48, RopeLayout.HALF, torch.float32),           # G = 5: run-time G; pass-through dims
])
@pytest.mark.parametrize("V,masked", [(1, False), (3, True)])
def test_per_head_tables_and_per_key_query_variants_equal_the_float64_reference(B, Hkv, G, N, D, R, layout, dtype,
                                                                               V, masked):
    g = torch.Generator().manual_seed(N + V)
    spec = spec_for(D, R, layout, 1.0)
    Hq = Hkv * G
    k = torch.randn(B, Hkv, N + 3, D, generator=g).to(dtype)[:, :, :N]
    v = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    _, pos, _, _, allowed, add = decode_case(g, B, Hkv, G, N, spec, masked)
    ratios = torch.tensor([1.0, 1.2, 1.45, 1.8])
    kpos = pos.double()[None] / ratios.double()[:, None, None]                      # [Rt=4, B, N]
    cos, sin = _tables(kpos, spec)
    head_table = torch.randint(0, 4, (Hq,), generator=g)
    q = torch.randn(B, Hq, V, D, generator=g)
    seg = None if V == 1 else torch.randint(0, V, (B, N), generator=g)
    out = decode_heads_kernel(q, k, v, cos, sin, head_table, seg, add, 0.125, R, layout is RopeLayout.INTERLEAVED)
    assert out is not None and out.shape == (B, Hq, D)
    ref = decode_heads_ref(q, k, v, kpos, head_table, seg, spec, allowed, 0.125)
    assert (out.double() - ref).abs().max() < 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_maps_are_bit_identical_to_the_plain_raw_key_kernel(dtype):
    g = torch.Generator().manual_seed(5)
    spec = spec_for(64, 64, RopeLayout.HALF, 1.0)
    k, v = torch.randn(1, 3, 700, 64, generator=g).to(dtype), torch.randn(1, 3, 700, 64, generator=g).to(dtype)
    q, pos, cos, sin, _, add = decode_case(g, 1, 3, 3, 700, spec, True)
    plain = decode_raw_kernel(q, k, v, cos, sin, add, 0.125, 64, False)
    heads = decode_heads_kernel(q[:, :, None], k, v, cos[None], sin[None], torch.zeros(9, dtype=torch.long),
                                torch.zeros(1, 700, dtype=torch.long), add, 0.125, 64, False)
    assert torch.equal(plain, heads)


@pytest.mark.parametrize("B,Hkv,G,N,R,layout,dtype,Bm", [
    (1, 1, 4, 300, 64, RopeLayout.HALF, torch.float32, 1),           # Gemma 3's grouping (4 heads on 1), AVX2 path
    (2, 2, 3, 260, 32, RopeLayout.INTERLEAVED, torch.float32, 2),    # plain-C path
    (2, 1, 2, 150, 64, RopeLayout.HALF, torch.bfloat16, 2),
])
def test_a_mask_per_query_head_equals_the_float64_reference(B, Hkv, G, N, R, layout, dtype, Bm):
    """One visibility row per query head (PINE's window at each head's own read distances): heads of one group see
    different keys, one head sees none (its output is 0) and one head sees nothing in a whole chunk of keys."""
    g = torch.Generator().manual_seed(N)
    spec = spec_for(64, R, layout, 1.0)
    Hq = Hkv * G
    k, v = torch.randn(B, Hkv, N, 64, generator=g).to(dtype), torch.randn(B, Hkv, N, 64, generator=g).to(dtype)
    pos = torch.randint(0, 6000, (B, N), generator=g)
    ratios = torch.tensor([1.0, 1.5])
    kpos = pos.double()[None] / ratios.double()[:, None, None]
    cos, sin = _tables(kpos, spec)
    head_table = torch.randint(0, 2, (Hq,), generator=g)
    q = torch.randn(B, Hq, 3, 64, generator=g)
    seg = torch.randint(0, 3, (B, N), generator=g)
    allowed = torch.rand(Bm, Hq, N, generator=g) > 0.5
    allowed[:, 0, :130] = False                             # a whole chunk of keys hidden from head 0 only
    allowed[:, Hq - 1] = False                              # the last head sees no key at all
    add = torch.zeros(Bm, Hq, N).masked_fill(~allowed, float("-inf"))
    out = decode_heads_kernel(q, k, v, cos, sin, head_table, seg, add, 0.125, R, layout is RopeLayout.INTERLEAVED)
    ref = decode_heads_ref(q, k, v, kpos, head_table, seg, spec, allowed.expand(B, Hq, N), 0.125)
    assert out is not None and (out.double() - ref).abs().max() < 3e-6
    assert bool((out[:, Hq - 1] == 0).all())
    shared = decode_heads_kernel(q, k, v, cos, sin, head_table, seg, add[:, :1], 0.125, R,
                                 layout is RopeLayout.INTERLEAVED)                  # one row for all heads, as before
    ref1 = decode_heads_ref(q, k, v, kpos, head_table, seg, spec, allowed[:, 0].expand(B, N), 0.125)
    assert (shared.double() - ref1).abs().max() < 3e-6
    with pytest.raises(ValueError, match=r"decode_heads_kernel mask: expected additive float"):
        decode_heads_kernel(q, k, v, cos, sin, head_table, seg, add[:, :2] if Hq > 2 else add[:, :1].expand(
            Bm, Hq + 1, N), 0.125, R, False)


def test_indices_out_of_range_are_refused_before_the_kernel_reads_them():
    spec = spec_for(64, 64, RopeLayout.HALF, 1.0)
    k = v = torch.randn(1, 1, 20, 64)
    cos, sin = _tables(torch.arange(20.0)[None, None].expand(2, 1, 20), spec)
    q = torch.randn(1, 2, 2, 64)
    with pytest.raises(ValueError, match="head_table"):
        decode_heads_kernel(q, k, v, cos, sin, torch.tensor([0, 2]), None, None, 0.125, 64, False)
    with pytest.raises(ValueError, match="seg"):
        decode_heads_kernel(q, k, v, cos, sin, torch.tensor([0, 1]), torch.full((1, 20), 2), None, 0.125, 64, False)
    with pytest.raises(ValueError, match="cos/sin"):
        decode_heads_kernel(q, k, v, cos[:, :, :10], sin[:, :, :10], torch.tensor([0, 1]), None, None, 0.125, 64,
                            False)


@pytest.mark.parametrize("layout,R,scaling", [(RopeLayout.HALF, 64, 1.0), (RopeLayout.INTERLEAVED, 32, 1.3),
                                              (RopeLayout.HALF, 32, 1.0), (RopeLayout.HALF, 128, 1.0)])
@pytest.mark.parametrize("variants", [2, 1])   # 1: no segments (Ms-PoE's own loop in the kernel)
def test_factored_tables_give_per_head_scales_equal_to_the_float64_reference(layout, R, scaling, variants):
    g = torch.Generator().manual_seed(3)
    D = max(64, R)                                 # R = 128: the wider tables' row count (factor_bits)
    spec = spec_for(D, R, layout, scaling)
    B, Hkv, G, N = 2, 3, 3, 333
    k, v = torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g)
    pos = torch.randint(0, 9000, (B, N), generator=g)
    ratios = torch.tensor([1.0, 1.2, 1.5, 1.8])
    cos, sin = factored_tables(ratios, 9000, spec)
    F = 1 << factor_bits(R)
    assert cos.shape == (4, F + -(-9000 // F), R // 2)
    head_table = torch.randint(0, 4, (Hkv * G,), generator=g)
    q = torch.randn(B, Hkv * G, variants, D, generator=g)
    seg = torch.randint(0, 2, (B, N), generator=g) if variants > 1 else None
    out = decode_heads_kernel(q, k, v, cos, sin, head_table, seg, None, 0.125, R, layout is RopeLayout.INTERLEAVED,
                              fpos=pos)
    ref = decode_heads_ref(q, k, v, pos.double()[None] / ratios.double()[:, None, None], head_table, seg, spec,
                           None, 0.125)
    assert (out.double() - ref).abs().max() < 3e-6
    with pytest.raises(ValueError, match="fpos"):
        decode_heads_kernel(q, k, v, cos, sin, head_table, seg, None, 0.125, R, False, fpos=pos + 100)
