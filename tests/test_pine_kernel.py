"""PINE-lite's decode step in C. The importance pass (kvpos._posmap_kernels.segment_mass_kernel: per query head, the
softmax of raw q.k over the slots of documents, summed per document) against the float64 oracle
(kvpos.reference.segment_mass_ref) on the AVX2 and plain-C paths, fp32 and bf16 keys, one mask row for all heads or
one per query head; the whole step in one call (pine_decode_kernel) against a float64 composition written another
way: the oracle's importance, pine_shifts, and each head's keys rotated to their shifted positions
(kvpos.reference.decode_heads_ref, one table per head) where the kernel turns the query back per document. Bad
inputs are refused by name."""
import pytest
import torch

from kvpos._kernels import rope_kernel_available
from kvpos._posmap_kernels import pine_decode_kernel, segment_mass_kernel
from kvpos.posmap import pine_shifts, segment_importance
from kvpos.reference import decode_heads_ref, rotate_ref, segment_mass_ref, unrotate_ref
from kvpos.rope import RopeLayout, cos_sin

from kernel_cases import spec_for

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


def _pine_case(B, Hkv, G, D, R, layout, dtype, scaling, seed):
    """A composed sequential layout: 6 anchor slots, 4 documents of 30 / 17 / 45 / 22 slots, 3 question slots, the
    query the last; positions 0..N-1; some slots hidden. Returns the kernel's inputs and the oracle's."""
    g = torch.Generator().manual_seed(seed)
    spec = spec_for(D, R, layout, scaling)
    sizes = [30, 17, 45, 22]
    N = 6 + sum(sizes) + 3
    doc = torch.full((1, N), -1, dtype=torch.long)
    start, at = [], 6
    for d, n in enumerate(sizes):
        doc[0, at: at + n] = d
        start.append(at)
        at += n
    pos = torch.arange(N)[None].expand(B, N)
    q_raw = torch.randn(B, Hkv * G, D, generator=g) * 2
    q = rotate_ref(q_raw[:, :, None], pos[:, -1:], spec)[:, :, 0].float()     # the model's rotated query
    k = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    allowed = torch.rand(B, N, generator=g) > 0.2
    allowed[:, -1] = True
    cos, sin = cos_sin(pos, spec)
    return dict(spec=spec, q=q, k=k, v=v, pos=pos, doc=doc, allowed=allowed, cos=cos * scaling,
                sin=sin * scaling, start=torch.tensor([start] * B), size=torch.tensor([sizes] * B),
                end=torch.full((B,), at))


@pytest.mark.parametrize("B,Hkv,G,D,R,layout,dtype,window,scaling", [
    (1, 3, 3, 64, 64, RopeLayout.HALF, torch.float32, None, 1.0),         # SmolLM2's shape: AVX2 path
    (2, 1, 4, 64, 32, RopeLayout.INTERLEAVED, torch.bfloat16, 40, 1.0),   # Gemma 3's grouping, a window narrower
                                                                          # than the documents; plain-C path
    (2, 2, 2, 32, 32, RopeLayout.HALF, torch.float32, 25, 1.3),           # an attention scaling (yarn-like)
])
def test_the_one_call_pine_decode_equals_a_float64_composition(B, Hkv, G, D, R, layout, dtype, window, scaling):
    c = _pine_case(B, Hkv, G, D, R, layout, dtype, scaling, D + (window or 0))
    spec, pos, doc, allowed = c["spec"], c["pos"], c["doc"], c["allowed"]
    add = torch.zeros(B, pos.shape[1]).masked_fill(~allowed, float("-inf"))
    scale = D ** -0.5
    got = pine_decode_kernel(c["q"], c["k"], c["v"], c["cos"], c["sin"], spec.inv_freq, doc, c["start"], c["size"],
                             c["end"], pos, pos[:, -1], add, scale, scaling, R, layout is RopeLayout.INTERLEAVED,
                             window, angle_f32=False)
    assert got is not None
    out, shift = got
    q_raw = unrotate_ref(c["q"][:, :, None].double(), pos[:, -1:], spec)[:, :, 0]
    mass = segment_mass_ref(q_raw, c["k"].float(), doc, 4, allowed, scale)
    want_shift = pine_shifts((mass / c["size"][:, None, :])[:, :, None], c["start"], c["size"], c["end"])[:, :, 0]
    assert torch.equal(shift, want_shift)
    Hq = Hkv * G
    moved = torch.where(doc >= 0, want_shift.gather(-1, doc.clamp_min(0).expand(B, Hq, -1)), 0)   # [B, Hq, N]
    read_at = pos[:, None, :] + moved
    ok = allowed[:, None, :].expand(B, Hq, -1)
    if window is not None:
        ok = ok & (pos[:, -1:, None] - read_at < window)
    want = decode_heads_ref(c["q"][:, :, None], c["k"].float(), c["v"].float(), read_at.transpose(0, 1).double(),
                            torch.arange(Hq), None, spec, ok, scale)
    assert (out.double() - want).abs().max() < 1e-4, float((out.double() - want).abs().max())
    assert len(set(map(tuple, shift.reshape(-1, 4).tolist()))) > 1      # the heads do move the documents apart


def test_the_one_call_pine_decode_refuses_bad_inputs_by_name():
    c = _pine_case(1, 1, 2, 32, 32, RopeLayout.HALF, torch.float32, 1.0, 0)
    pos, doc = c["pos"], c["doc"]
    args = lambda **kw: dict(dict(q=c["q"], k=c["k"], v=c["v"], cos=c["cos"], sin=c["sin"],   # noqa: E731
                                  inv_freq=c["spec"].inv_freq, doc=doc, start=c["start"], size=c["size"],
                                  end=c["end"], kpos=pos, qpos=pos[:, -1], mask=None, scale=1.0,
                                  attention_scaling=1.0, rotary_dim=32, interleaved=False), **kw)
    bad = doc.clone()
    bad[0, 10] = 4
    with pytest.raises(ValueError, match="pine_decode_kernel doc"):
        pine_decode_kernel(**args(doc=bad))
    with pytest.raises(ValueError, match="pine_decode_kernel size"):
        pine_decode_kernel(**args(size=c["size"] * 0))
    with pytest.raises(ValueError, match="pine_decode_kernel start"):
        pine_decode_kernel(**args(start=c["start"][:, :3]))
    with pytest.raises(ValueError, match="pine_decode_kernel window"):
        pine_decode_kernel(**args(window=0))
    with pytest.raises(ValueError, match="pine_decode_kernel mask"):
        pine_decode_kernel(**args(mask=torch.zeros(1, 2, pos.shape[1])))
