"""The entry schemes' codecs: int8 (keys per channel over the chunk, values per token) and int4 (asymmetric,
per group of INT4_GROUP). The FORMAT.md page beside this file specifies them."""
from __future__ import annotations

from typing import Any

import torch

from .._checks import fail
from ..quant import int8_codes


# How an entry holds its keys and values. "float": as computed (entries without a scheme field are "float").
# "int8": keys int8 per channel (one scale per layer, head and channel over the chunk's tokens, taken BEFORE RoPE
# where a channel's outliers stay in that channel), values int8 per token (one scale per layer, head and token);
# read back as the dtype they were computed in (bytes per token: results/bench_memory_store.md).
# "int4": 4-bit codes, asymmetric (a scale and a minimum per group), two per byte: keys per channel over groups of
# INT4_GROUP tokens (before RoPE, as int8), values per token over groups of INT4_GROUP channels.
SCHEMES = ("float", "int8", "int4")
INT4_GROUP = 64


def check_scheme(scheme: Any, what: str = "scheme") -> str:
    if scheme not in SCHEMES:
        fail(what, " or ".join(repr(x) for x in SCHEMES), repr(scheme))
    return scheme


def quantize_int8(raw_keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """raw_keys [L, H, S, D], values [L, H, S, Dv] -> int8 keys with keys_scale [L, H, 1, D] (per channel over the
    tokens) and int8 values with values_scale [L, H, S, 1] (per token); symmetric, round to nearest, float32 scales.
    A zero channel / token gets scale 0 (dequantizes to exact zeros)."""
    out = {}
    for name, x, dim in (("keys", raw_keys, 2), ("values", values, 3)):
        xf = x.float()
        scale = xf.abs().amax(dim=dim, keepdim=True) / 127.0
        out[name], out[f"{name}_scale"] = int8_codes(xf, scale).contiguous(), scale.contiguous()
    return out


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [..] * scale (broadcast, float32), rounded once to `dtype`."""
    return (q.float() * scale).to(dtype)


def _groups(x: torch.Tensor, dim: int, g: int) -> torch.Tensor:
    """x [L, H, S, D] float32 -> groups of `g` along `dim` (2: tokens, 3: channels), the last group padded with
    copies of the last entry (padding never widens a group's range): dim 2: [L, H, S/g, g, D]; dim 3: [L, H, S, D/g, g]."""
    n = x.shape[dim]
    pad = (-n) % g
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.narrow(dim, n - 1, 1).expand(shape)], dim)
    L, H = x.shape[:2]
    if dim == 2:
        return x.reshape(L, H, -1, g, x.shape[3])
    return x.reshape(L, H, x.shape[2], -1, g)


def quantize_int4(raw_keys: torch.Tensor, values: torch.Tensor, group: int = INT4_GROUP) -> dict[str, torch.Tensor]:
    """raw_keys [L, H, S, D], values [L, H, S, Dv] (D, Dv even) -> 4-bit codes packed two per byte, uint8
    [L, H, S, D/2]; keys per channel over groups of `group` tokens (keys_scale / keys_min [L, H, ceil(S/g), D]),
    values per token over groups of `group` channels (values_scale / values_min [L, H, S, ceil(Dv/g)]). Asymmetric:
    x ~ min + code * scale with code in 0..15, round to nearest; float32 scales and minimums."""
    out = {}
    for name, x, dim in (("keys", raw_keys, 2), ("values", values, 3)):
        if x.shape[-1] % 2:
            fail(f"quantize_int4 {name}", "an even last dimension (two codes per byte)", tuple(x.shape))
        n = x.shape[dim]
        xg = _groups(x.float(), dim, group)
        red = dim + 1                                            # the within-group axis of either layout
        lo, hi = xg.amin(dim=red, keepdim=True), xg.amax(dim=red, keepdim=True)
        scale = (hi - lo) / 15.0
        code = torch.where(scale > 0, (xg - lo) / torch.where(scale > 0, scale, 1.0), 0.0).round_().clamp_(0, 15)
        L, H = x.shape[:2]
        if dim == 2:
            code = code.reshape(L, H, -1, x.shape[3])[:, :, :n]
            out[f"{name}_scale"], out[f"{name}_min"] = scale[:, :, :, 0].contiguous(), lo[:, :, :, 0].contiguous()
        else:
            code = code.reshape(L, H, x.shape[2], -1)[..., :n]
            out[f"{name}_scale"], out[f"{name}_min"] = scale[..., 0].contiguous(), lo[..., 0].contiguous()
        c = code.to(torch.uint8)
        out[name] = (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()
    return out


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dim: int, dtype: torch.dtype,
                    group: int = INT4_GROUP) -> torch.Tensor:
    """Packed codes q uint8 [L, H, S, D/2] with per-group scale / min (see quantize_int4; dim 2 = keys' token
    groups, 3 = values' channel groups) -> [L, H, S, D] of `dtype` (computed in float32, rounded once)."""
    code = torch.stack([q & 15, q >> 4], -1).flatten(-2).float()      # [L, H, S, D]
    n = code.shape[dim]
    reps = torch.arange(n, device=q.device) // group
    s, m = scale.index_select(dim, reps), lo.index_select(dim, reps)
    return (m + code * s).to(dtype)
