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

__all__ = ["RopeLayout", "RopeSpec", "rotate", "unrotate", "cos_sin", "rope_specs_from_model", "UnsupportedRopeError"]


class UnsupportedRopeError(ValueError):
    """The model's position encoding cannot be managed exactly (no RoPE, or frequencies that change with length)."""


class RopeLayout(str, enum.Enum):
    """Which dims form a rotation pair. HALF = transformers `rotate_half`; INTERLEAVED = adjacent pairs."""

    HALF = "half"
    INTERLEAVED = "interleaved"


# transformers model types whose rotate_half pairs adjacent dims (x[..., ::2], x[..., 1::2])
_INTERLEAVED_MODEL_TYPES = frozenset({"cohere", "cohere2", "glm", "glm4", "glm4_moe", "gptj", "codegen"})
# rope types whose frequencies do not depend on the sequence length: a key re-rotated anywhere is exact
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "yarn", "llama3", "proportional"})


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

    def key(self) -> tuple:
        """A hashable identity of the rotation (two specs with equal keys rotate identically)."""
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


def unrotate(x: torch.Tensor, pos: torch.Tensor, spec: RopeSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact inverse of `rotate`: the conjugate rotation, divided by attention_scaling."""
    cos, sin = _cos_sin_for(x, pos, spec)
    return _apply(x, cos, -sin, spec, 1.0 / spec.attention_scaling, out)


# ---------------------------------------------------------------------------------------------------------------------
# Extraction from a loaded transformers model (duck-typed: no transformers import here)
# ---------------------------------------------------------------------------------------------------------------------

def _find_rotary(model: Any) -> Any:
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls.endswith("RotaryEmbedding") or name.endswith("rotary_emb"):
            return mod
    return None


def _head_dim(config: Any) -> int:
    hd = getattr(config, "head_dim", None)
    if hd:
        return int(hd)
    return int(config.hidden_size // config.num_attention_heads)


def _rope_param(config: Any, layer_type: str | None, key: str, default: Any = None) -> Any:
    rp = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]
    return rp.get(key, default)


def _limit_for(config: Any, rope_type: str, layer_type: str | None, rotary: Any) -> int | None:
    if rope_type in _STATIC_ROPE_TYPES:
        return None
    if rope_type == "dynamic":
        return int(getattr(rotary, "original_max_seq_len", None) or config.max_position_embeddings)
    if rope_type == "longrope":
        omp = getattr(config, "original_max_position_embeddings", None) or _rope_param(
            config, layer_type, "original_max_position_embeddings")
        return int(omp)
    raise UnsupportedRopeError(
        f"rope_type: expected one of {sorted(_STATIC_ROPE_TYPES | {'dynamic', 'longrope'})}, got {rope_type!r}; "
        "kvpos cannot re-position keys for an encoding it does not know exactly")


# decoder layer types whose state is keys and values at positions (what a PositionedKV holds)
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def rope_specs_from_model(model: Any, angle_dtype: torch.dtype = torch.float32) -> list[RopeSpec]:
    """Build one RopeSpec per decoder layer from a loaded transformers causal LM.

    Reads `inv_freq` / `attention_scaling` from the model's rotary module (per layer type for models such as Gemma3),
    so every scaled rope_type is handled by transformers' own init functions. Raises UnsupportedRopeError for models
    without RoPE (ALiBi, learned absolute positions), M-RoPE, and unknown rope types.
    """
    config = getattr(model, "config", None)
    if config is None:
        fail("model", "a transformers model with .config", type(model).__name__, exc=TypeError)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", "?")
    rotary = _find_rotary(model)
    if rotary is None:
        raise UnsupportedRopeError(
            f"model: expected a RoPE model (a *RotaryEmbedding module), got {type(model).__name__} "
            f"(model_type={model_type!r}) without one; ALiBi and learned absolute positions cannot be re-positioned")
    if getattr(config, "rope_parameters", None) and _rope_param(config, None, "mrope_section"):
        raise UnsupportedRopeError(f"model_type={model_type!r}: M-RoPE (3-D positions) is not supported")
    if getattr(config, "kv_lora_rank", None):
        raise UnsupportedRopeError(
            f"model_type={model_type!r}: multi-head latent attention (kv_lora_rank={config.kv_lora_rank}) rotates only "
            f"a {getattr(config, 'qk_rope_head_dim', '?')}-dim part of keys built from a compressed latent; kvpos's "
            "per-layer RoPE specs do not describe that layout")
    n_layers = int(config.num_hidden_layers)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)
    other = sorted(set(layer_types) - _ATTENTION_LAYER_TYPES)
    if other:
        raise UnsupportedRopeError(
            f"model_type={model_type!r}: layer types {other} keep state other than positioned keys and values "
            "(recurrent, linear or indexed attention); run such hybrid models with transformers' own cache")
    try:
        head_dim = _head_dim(config)
    except RuntimeError as e:       # transformers' AmbiguousGlobalPerLayerAttributeError: head sizes vary by layer
        if "per-layer" not in str(e):
            raise
        raise UnsupportedRopeError(f"model_type={model_type!r}: a heterogeneous config (head sizes that vary by "
                                   "layer) is not supported") from e
    layout = RopeLayout.INTERLEAVED if model_type in _INTERLEAVED_MODEL_TYPES else RopeLayout.HALF
    per_type: dict[str | None, RopeSpec] = {}
    specs = []
    for lt in layer_types:
        key = lt if hasattr(rotary, f"{lt}_inv_freq") else None
        if key not in per_type:
            per_type[key] = _spec_for(rotary, config, key, head_dim, layout, angle_dtype)
        specs.append(per_type[key])
    return specs


def _spec_for(rotary: Any, config: Any, layer_type: str | None, head_dim: int, layout: RopeLayout,
              angle_dtype: torch.dtype) -> RopeSpec:
    prefix = "" if layer_type is None else f"{layer_type}_"
    rope_type = getattr(rotary, "rope_type", "default")
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type, "default")
    rope_type = str(rope_type)
    # dynamic/longrope rewrite inv_freq in forward; the original (short) set is the one valid below the limit
    inv = getattr(rotary, f"{prefix}original_inv_freq", None)
    if inv is None or rope_type in _STATIC_ROPE_TYPES:
        inv = getattr(rotary, f"{prefix}inv_freq", None)
    if not isinstance(inv, torch.Tensor):
        raise UnsupportedRopeError(
            f"model_type={getattr(config, 'model_type', '?')!r}: expected a rotary module with an `inv_freq` buffer, got "
            f"{type(rotary).__name__} without one (e.g. GPT-J's table of sinusoids); kvpos cannot read its frequencies")
    scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
    limit = _limit_for(config, rope_type, layer_type, rotary)
    return RopeSpec(inv_freq=inv.detach().float().cpu(), attention_scaling=scaling, rotary_dim=2 * inv.numel(),
                    head_dim=head_dim, layout=layout, rope_type=rope_type, max_exact_position=limit,
                    angle_dtype=angle_dtype)
