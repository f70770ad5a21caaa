"""PINE's importance pass in C (kvpos._kernels.segment_mass_kernel): per query head, the softmax of raw q.k over the
slots of documents, summed per document. Checked against the float64 oracle (kvpos.reference.segment_mass_ref) on
the AVX2 and plain-C paths, fp32 and bf16 keys, with one mask row for all heads or one per query head; bad document
indices are refused by name."""
import pytest
import torch

from kvpos._kernels import rope_kernel_available, segment_mass_kernel
from kvpos.posmap import segment_importance
from kvpos.reference import segment_mass_ref

pytestmark = pytest.mark.skipif(not rope_kernel_available(), reason="no C compiler: the fused kernel is not built")


def _case(B, Hkv, G, N, D, n, dtype, mask, seed):
    """q [B, Hq, D], strided raw keys [B, Hkv, N, D], doc [B, N] in [-1, n) (runs of slots, as documents are laid
    out), allowed bool (None, [B, N] or [B, Hq, N]) and its additive mask."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, D, generator=g) * 2
    k = torch.randn(B, Hkv, N + 5, D, generator=g).to(dtype)[:, :, :N]
    cuts = torch.sort(torch.randint(0, N, (2 * n,), generator=g)).values.tolist()
    doc = torch.full((B, N), -1, dtype=torch.long)
    for b in range(B):
        for d in range(n):
            doc[b, cuts[2 * d]: cuts[2 * d + 1] + 1] = d
    allowed = None
    if mask == "row":
        allowed = torch.rand(B, N, generator=g) > 0.3
    elif mask == "head":
        allowed = torch.rand(B, Hkv * G, N, generator=g) > 0.4
        allowed[0, 1] = False                                # a head that sees nothing: zeros
        allowed[-1, 0, :200] = False                         # a head that sees nothing in whole chunks
    add = None if allowed is None else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    return q, k, doc, allowed, add


@pytest.mark.parametrize("B,Hkv,G,N,D,dtype", [
    (1, 3, 3, 700, 64, torch.float32),          # SmolLM2's shape, AVX2 path, several chunks
    (2, 1, 4, 300, 256, torch.bfloat16),        # Gemma 3's: 4 query heads on one key head, width 256
    (2, 2, 2, 257, 24, torch.float32),          # D not a multiple of 8: plain-C path
    (1, 2, 5, 9, 32, torch.bfloat16),           # G = 5 (run-time G); fewer keys than a chunk
])
@pytest.mark.parametrize("mask", [None, "row", "head"])
def test_the_importance_kernel_equals_the_float64_reference(B, Hkv, G, N, D, dtype, mask):
    n = 4
    q, k, doc, allowed, add = _case(B, Hkv, G, N, D, n, dtype, mask, N + D)
    got = segment_mass_kernel(q, k, doc, n, add, D ** -0.5)
    want = segment_mass_ref(q, k.float(), doc, n, allowed, D ** -0.5)
    assert got is not None and got.shape == (B, Hkv * G, n)
    assert (got.double() - want).abs().max() < 1e-5, float((got.double() - want).abs().max())
    if mask == "head":
        assert bool((got[0, 1] == 0).all())                 # no visible document slot: zeros, not NaN
    seen = want.sum(-1) > 0
    assert torch.allclose(got.sum(-1)[seen].double(), torch.ones(int(seen.sum()), dtype=torch.float64), atol=1e-5)


def test_the_kernel_and_the_torch_importance_agree_after_the_division_by_sizes():
    """segment_importance (torch, the prefill path) divides the same mass by each document's slot count."""
    q, k, doc, allowed, add = _case(1, 3, 3, 500, 64, 6, torch.float32, "row", 3)
    size = torch.nn.functional.one_hot(doc.clamp_min(0), 6).mul((doc >= 0)[..., None]).sum(1)      # [B, n]
    got = segment_mass_kernel(q, k, doc, 6, add, 0.125) / size[:, None, :]
    want = segment_importance(q[:, :, None], k, doc, 6, 0.125, allowed[:, None, None])[:, :, 0]
    assert (got - want).abs().max() < 1e-6


def test_bad_inputs_are_refused_by_name():
    q, k, doc, _, _ = _case(1, 2, 2, 50, 32, 3, torch.float32, None, 0)
    bad = doc.clone()
    bad[0, 7] = 3                                            # outside [-1, n)
    with pytest.raises(ValueError, match="segment_mass_kernel doc"):
        segment_mass_kernel(q, k, bad, 3, None, 1.0)
    bad[0, 7] = -2
    with pytest.raises(ValueError, match="segment_mass_kernel doc"):
        segment_mass_kernel(q, k, bad, 3, None, 1.0)
    with pytest.raises(ValueError, match="segment_mass_kernel doc"):
        segment_mass_kernel(q, k, doc[:, :40], 3, None, 1.0)
    with pytest.raises(ValueError, match="segment_mass_kernel mask"):
        segment_mass_kernel(q, k, doc, 3, torch.zeros(1, 3, 50), 1.0)
    with pytest.raises(ValueError, match="segment_mass_kernel n"):
        segment_mass_kernel(q, k, doc, 0, None, 1.0)
