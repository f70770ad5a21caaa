"""Random inputs shared by the decode-kernel tests (fused raw keys, int8 storage)."""
import torch

from kvpos.rope import RopeSpec, cos_sin


def spec_for(D, R, layout, scaling):
    """A RopeSpec of head_dim D, rotary dim R, float64 angles (as exact as the float64 oracles)."""
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    return RopeSpec(inv, scaling, R, D, layout, angle_dtype=torch.float64)


def decode_case(g, B, Hkv, G, N, spec, masked):
    """(q [B, Hkv*G, D], pos [B, N], cos, sin scaled by the spec's attention scaling, allowed [B, N] bool or None,
    additive mask or None): one decode query per row over N random positions; a mask keeps slot 0 visible."""
    q = torch.randn(B, Hkv * G, spec.head_dim, generator=g)
    pos = torch.randint(0, 6000, (B, N), generator=g)
    cos, sin = cos_sin(pos, spec)
    s = spec.attention_scaling
    allowed = torch.rand(B, N, generator=g) > 0.4 if masked else None
    if masked:
        allowed[:, 0] = True
    add = None if allowed is None else torch.zeros(B, N).masked_fill(~allowed, float("-inf"))
    return q, pos, cos * s, sin * s, allowed, add
