"""Rotary position embedding (RoPE) as data: a spec per layer, and exact rotate/unrotate from int64 positions.

Letters: B batch · H kv heads · S tokens · D head_dim · R rotary_dim (R <= D, even).

Two layouts exist in the wild and both are the same rotation of 2-D pairs; they differ in which dims pair up:

    HALF        (rotate_half, "neox style")   pair i = (x[i], x[i + R/2])      Llama, Qwen, Mistral, Gemma, Phi-3, GPT-NeoX
    INTERLEAVED (rotate_every_two, "gptj")    pair i = (x[2i], x[2i + 1])      Cohere, GLM, GPT-J

Pair i turns by angle p * inv_freq[i]; dims R..D-1 pass through unchanged (partial rotary). transformers multiplies
cos/sin by `attention_scaling` (YaRN, LongRoPE), so a rotated key is `s * R_p k`; `unrotate` divides it back out.

Angles are computed from int64 positions: by default `float32(p) * inv_freq` exactly as transformers does (so a key
rotated here is bit-compatible with one rotated by the model), or in float64 with `angle_dtype=torch.float64`.
cos/sin are cast to the key dtype last; bf16/fp16 keys are rotated in float32 and rounded once.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import fail
from ._kernels import rope_apply_kernel

__all__ = ["RopeLayout", "RopeSpec", "rotate", "rotate_by", "unrotate", "cos_sin", "UnsupportedRopeError", "STATIC_ROPE_TYPES"]


class UnsupportedRopeError(ValueError):
    """The model's position encoding cannot be managed exactly (no RoPE, or frequencies that change with length)."""


class RopeLayout(str, enum.Enum):
    """Which dims form a rotation pair. HALF = transformers `rotate_half`; INTERLEAVED = adjacent pairs."""

    HALF = "half"
    INTERLEAVED = "interleaved"


# rope types whose frequencies do not depend on the sequence length: a key re-rotated anywhere is exact
STATIC_ROPE_TYPES = frozenset({"default", "linear", "yarn", "llama3", "proportional"})


def _identity(key: tuple) -> str:
    """sha256 (hex, 16 characters) of a RopeSpec key: equal exactly when the keys are equal (floats by repr)."""
    import hashlib

    return hashlib.sha256(repr(key).encode()).hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """Everything needed to rotate one layer's keys.

    inv_freq: [R/2] float32 frequencies (already scaled: linear/yarn/llama3 are folded in by transformers).
    attention_scaling: factor transformers multiplies into cos/sin (1.0 except yarn/longrope).
    rotary_dim: R, the number of leading dims that rotate (== head_dim unless partial rotary).
    head_dim: D.
    layout: RopeLayout.HALF or RopeLayout.INTERLEAVED.
    rope_type: the transformers rope_type, for messages and fingerprints.
    max_exact_position: positions >= this are refused (dynamic / longrope switch frequency sets there); None = no limit.
    angle_dtype: torch.float32 (bit-compatible with transformers) or torch.float64.
    identity: the digest of key(), set at construction: two specs rotate identically iff their identities match.
    """

    inv_freq: torch.Tensor
    attention_scaling: float
    rotary_dim: int
    head_dim: int
    layout: RopeLayout = RopeLayout.HALF
    rope_type: str = "default"
    max_exact_position: int | None = None
    angle_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not isinstance(self.inv_freq, torch.Tensor) or self.inv_freq.dim() != 1:
            fail("RopeSpec.inv_freq", "a 1-D tensor [R/2]", type(self.inv_freq).__name__, exc=TypeError)
        if 2 * self.inv_freq.numel() != self.rotary_dim:
            fail("RopeSpec.rotary_dim", f"2 * len(inv_freq) = {2 * self.inv_freq.numel()}", self.rotary_dim)
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            fail("RopeSpec.rotary_dim", f"an even number in (0, head_dim={self.head_dim}]", self.rotary_dim)
        if not math.isfinite(self.attention_scaling) or self.attention_scaling <= 0:
            fail("RopeSpec.attention_scaling", "a finite positive float", self.attention_scaling)
        if self.angle_dtype not in (torch.float32, torch.float64):
            fail("RopeSpec.angle_dtype", "torch.float32 or torch.float64", self.angle_dtype)
        object.__setattr__(self, "inv_freq", self.inv_freq.detach().to(torch.float32).cpu().contiguous())
        object.__setattr__(self, "layout", RopeLayout(self.layout))
        object.__setattr__(self, "identity", _identity(self.key()))

    def key(self) -> tuple:
        """What the rotation depends on (two specs with equal keys rotate identically); `identity` is its digest,
        THE rule for "same spec" in the cache (layers sharing cos / sin, caches that may be concatenated), the
        transformers export and the vLLM worker."""
        return (
            tuple(self.inv_freq.tolist()),
            float(self.attention_scaling),
            self.rotary_dim,
            self.head_dim,
            self.layout.value,
            str(self.angle_dtype),
        )

    def describe(self) -> dict[str, Any]:
        """JSON-friendly summary, used in fingerprints and reports."""
        return {
            "rope_type": self.rope_type,
            "layout": self.layout.value,
            "rotary_dim": self.rotary_dim,
            "head_dim": self.head_dim,
            "attention_scaling": float(self.attention_scaling),
            "max_exact_position": self.max_exact_position,
            "inv_freq_sum": float(self.inv_freq.double().sum()),
        }

    def check_positions(self, pos: torch.Tensor, what: str = "positions") -> None:
        """Refuse positions the spec cannot represent exactly (see `max_exact_position`)."""
        if self.max_exact_position is not None and pos.numel() and int(pos.max()) >= self.max_exact_position:
            fail(
                what,
                f"positions < {self.max_exact_position} for rope_type={self.rope_type!r}",
                f"max position {int(pos.max())}",
                f"{self.rope_type} switches to other frequencies beyond that length, so keys rotated for one length are "
                "wrong for the other; keep the context shorter or use a model with static RoPE",
            )


def cos_sin(pos: torch.Tensor, spec: RopeSpec, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return unscaled (cos, sin) of the angles pos * inv_freq, float32, shape [*pos.shape, R/2].

    pos: int64 positions of any shape. Angles follow spec.angle_dtype; the result is float32.
    """
    device = pos.device if device is None else device
    inv = spec.inv_freq.to(device=device, dtype=spec.angle_dtype)
    ang = pos.to(device=device, dtype=spec.angle_dtype)[..., None] * inv
    if spec.angle_dtype == torch.float32:
        return ang.cos(), ang.sin()
    return ang.cos().float(), ang.sin().float()


def _pairs(x: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the rotary dims of x [..., D] into the two members of each pair, each [..., R/2] (views)."""
    r, h = spec.rotary_dim, spec.rotary_dim // 2
    if spec.layout is RopeLayout.HALF:
        return x[..., :h], x[..., h:r]
    return x[..., 0:r:2], x[..., 1:r:2]


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec, scale: float,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Turn every pair of x by (cos, sin) and multiply the rotary dims by `scale`; pass-through dims are copied.

    x: [B, H, S, D]; cos/sin: [B|1, 1, S, R/2] float32. Computes in float32 and rounds once to x.dtype; writes
    into `out` when given (out may be x itself). Uses the fused C kernel when it can (kvpos._kernels), else torch.
    """
    if x.shape[-1] != spec.head_dim:
        fail("rotate: x", f"last dim head_dim={spec.head_dim}", tuple(x.shape))
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    if out is None and not (x.requires_grad and torch.is_grad_enabled()):
        out = torch.empty_like(x)
    interleaved = spec.layout is RopeLayout.INTERLEAVED
    if out is not None and rope_apply_kernel([x], cos, sin, spec.rotary_dim, interleaved, [out]):
        return out
    xf = x if x.dtype == torch.float32 else x.float()
    a, b = _pairs(xf, spec)
    ra = a * cos - b * sin
    rb = b * cos + a * sin
    if x.requires_grad and torch.is_grad_enabled():  # functional form: in-place writes would break autograd
        if spec.layout is RopeLayout.HALF:
            rot = torch.cat([ra, rb], -1)
        else:
            rot = torch.stack([ra, rb], -1).flatten(-2)
        res = torch.cat([rot.to(x.dtype), x[..., spec.rotary_dim:]], -1)
        return res if out is None else out.copy_(res)
    oa, ob = _pairs(out, spec)
    oa.copy_(ra)
    ob.copy_(rb)
    if spec.rotary_dim < spec.head_dim:
        out[..., spec.rotary_dim:].copy_(x[..., spec.rotary_dim:])
    return out


def _apply_many(xs: list[torch.Tensor], outs: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                spec: RopeSpec) -> None:
    """outs[l] = s * R xs[l] for layers sharing `spec` and shape; one fused kernel call when possible."""
    s = spec.attention_scaling
    c, n = (cos * s, sin * s) if s != 1.0 else (cos, sin)
    if rope_apply_kernel(xs, c, n, spec.rotary_dim, spec.layout is RopeLayout.INTERLEAVED, outs):
        return
    for x, o in zip(xs, outs):
        _apply(x, cos, sin, spec, s, out=o)


def _cos_sin_for(x: torch.Tensor, pos: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate pos against x [B, H, S, D] and return cos/sin shaped [B|1, 1, S, R/2]."""
    if x.dim() != 4:
        fail("rotate: x", "a 4-D tensor [B, H, S, D]", tuple(x.shape))
    if not isinstance(pos, torch.Tensor) or pos.is_floating_point():
        fail("rotate: pos", "an int64 tensor", getattr(pos, "dtype", type(pos).__name__), exc=TypeError)
    B, _, S, _ = x.shape
    if pos.dim() == 1:
        pos = pos[None]
    if pos.dim() != 2 or pos.shape[-1] != S or pos.shape[0] not in (1, B):
        fail("rotate: pos", f"shape [S]={S} or [B, S]={(B, S)}", tuple(pos.shape))
    spec.check_positions(pos, "rotate: pos")
    cos, sin = cos_sin(pos, spec, device=x.device)
    return cos[:, None], sin[:, None]


def rotate(x: torch.Tensor, pos: torch.Tensor, spec: RopeSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate unrotated keys/queries x [B, H, S, D] to positions pos ([S] or [B, S] int64); includes attention_scaling.

    Equals what the model's own apply_rotary_pos_emb produces for the same positions.
    """
    cos, sin = _cos_sin_for(x, pos, spec)
    return _apply(x, cos, sin, spec, spec.attention_scaling, out)


def rotate_by(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """`rotate(x, pos, spec, out)` with (cos, sin) = cos_sin(pos, spec) made once by the caller and shared by many
    calls (e.g. every layer of one step): x [B, H, S, D]; cos, sin [B|1, S, R/2] float32 (unscaled, as cos_sin
    returns them). The caller checks pos (spec.check_positions) when it makes them."""
    if x.dim() != 4:
        fail("rotate_by: x", "a 4-D tensor [B, H, S, D]", tuple(x.shape))
    want = (x.shape[2], spec.rotary_dim // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if (t.dim() != 3 or tuple(t.shape[1:]) != want or t.shape[0] not in (1, x.shape[0])
                or t.dtype != torch.float32):
            fail(f"rotate_by: {name}", f"float32 [1 or {x.shape[0]}, {want[0]}, {want[1]}] (cos_sin of the positions)",
                 f"{t.dtype} {tuple(t.shape)}")
    return _apply(x, cos[:, None], sin[:, None], spec, spec.attention_scaling, out)


def unrotate(x: torch.Tensor, pos: torch.Tensor, spec: RopeSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact inverse of `rotate`: the conjugate rotation, divided by attention_scaling."""
    cos, sin = _cos_sin_for(x, pos, spec)
    return _apply(x, cos, -sin, spec, 1.0 / spec.attention_scaling, out)
