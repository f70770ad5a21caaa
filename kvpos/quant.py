"""In-cache int8 quantization of raw (pre-RoPE) keys and values: the pure functions of storage="int8".

Letters: B batch · H kv heads · S tokens · D head_dim · R scale rows.

Keys: int8 per channel over groups of GROUP (32) consecutive tokens (KIVI's layout: a key channel's outliers are fixed
before RoPE, so one scale per channel and group fits them), symmetric, round to nearest. A slot names its group's
scale row (`rows` [S] int32), so slots can be deleted or reordered without touching any scale. Values: int8 per
token. Scales are stored in the keys' own dtype (fp32 or bf16), the codes are computed against the stored (rounded)
scale, so dequantization is `code * scale` with nothing else. The float64 reference is `quantize_ref` below.
"""
from __future__ import annotations

import torch

__all__ = ["GROUP", "int8_codes", "quantize_key_groups", "quantize_values", "dequantize_keys", "dequantize_values",
           "quantize_ref"]

GROUP = 32          # tokens per key scale group (KIVI uses 32-128); also the most tokens the exact tail holds


def int8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(x / scale) clamped to [-127, 127] as int8 (0 where the scale is 0); x, scale broadcast, float32 math.
    The one symmetric int8 rounding core of kvpos: the cache (groups of GROUP tokens), the store's int8 scheme (per
    channel over a chunk) and the windowed far store (per token) differ only in how they take the scale."""
    s = scale.float()
    return torch.where(s > 0, x.float() / torch.where(s > 0, s, 1.0), 0.0).round_().clamp_(-127, 127).to(torch.int8)


def quantize_key_groups(raw: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """raw [B, H, S, D] keys -> (codes int8 [B, H, S, D], scales [B, H, ceil(S/group), D] in raw's dtype): token s
    belongs to group s // group (the last group may be shorter), one scale per channel and group = absmax / 127."""
    B, H, S, D = raw.shape
    n = -(-S // group)
    pad = n * group - S
    x = raw.float()
    xp = torch.cat([x, x.new_zeros(B, H, pad, D)], 2) if pad else x          # zeros never widen a group's absmax
    scale = (xp.reshape(B, H, n, group, D).abs().amax(3) / 127.0).to(raw.dtype)
    codes = int8_codes(x, scale.repeat_interleave(group, 2)[:, :, :S])
    return codes, scale


def quantize_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [B, H, S, Dv] -> (codes int8 [B, H, S, Dv], scales [B, H, S, 1] in v's dtype): one scale per token."""
    scale = (v.float().abs().amax(3, keepdim=True) / 127.0).to(v.dtype)
    return int8_codes(v, scale), scale


def dequantize_keys(codes: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """codes int8 [B, H, S, D], rows int [S] (each slot's scale row), scales [B, H, R, D] -> [B, H, S, D] `dtype`
    (code * scale in float32, rounded once)."""
    s = scales.index_select(2, rows.long().to(scales.device)).float()
    res = codes.float().mul_(s)
    if out is None:
        return res.to(dtype)
    out.copy_(res)
    return out


def dequantize_values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """codes int8 [B, H, S, Dv], scales [B, H, S, 1] -> [B, H, S, Dv] `dtype`."""
    res = codes.float().mul_(scales.float())
    if out is None:
        return res.to(dtype)
    out.copy_(res)
    return out


def quantize_ref(x: torch.Tensor, dim: int, group: int | None = None, scale_dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """Float64 reference of quantize-then-dequantize: x [B, H, S, D]; dim 2 = per channel over token groups of
    `group` (keys), dim 3 = per token (values); scales rounded to `scale_dtype` as stored. Returns float64."""
    x = x.double()
    out = torch.empty_like(x)
    S = x.shape[2]
    spans = [(a, min(a + group, S)) for a in range(0, S, group)] if dim == 2 else [(0, S)]
    for a, b in spans:
        blk = x[:, :, a:b]
        s = (blk.abs().amax(dim=dim, keepdim=True) / 127.0).to(scale_dtype).double()
        q = torch.where(s > 0, blk / torch.where(s > 0, s, 1.0), 0.0)
        q = torch.round(q).clamp(-127, 127)
        out[:, :, a:b] = q * s
    return out
