"""Adaptive Parallel Encoding (APE, ICLR 2025) as pure functions of queries, keys, values and masks.

Letters: B batch · H kv heads · Hq query heads · G = Hq / H · q queries · N keys · D head_dim · L layers.

Chunks are encoded in parallel (they share the positions after a shared anchor prefix). For the question and the
generated tokens, attention is split by slot label (context slots are those with segment >= SEG_CHUNK0):

    context slots C:               scores / tau        -> O_C, LSE_C
    other slots O (anchor, query): plain scores        -> O_O, LSE_O
    [w_C, w_O] = softmax([s * tau * LSE_C, LSE_O]);   out = w_C * O_C + w_O * O_O

tau (temperature) = s (scale) = 1 is exactly plain attention over the same slots. Query rows that are themselves
context slots (chunk encoding) always get plain attention. A float64 oracle of the formula is
kvpos.reference.ape_merge_ref; the engine glue (which cache, which slots) is kvpos.integrations.ape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import fail

__all__ = ["ApeParams", "ape_attend", "ape_attend_xformers", "xformers_available", "ApeStats", "context_stats",
           "DEFAULT_TEMPERATURE", "DEFAULT_SCALE", "GRID_T", "GRID_S"]

# defaults chosen by the sweep recorded in results/ape_sweep_32.md (the APE paper's own default is 0.9 / 0.9)
DEFAULT_TEMPERATURE = 0.7
DEFAULT_SCALE = 1.0
GRID_T = tuple(round(0.30 + 0.05 * i, 2) for i in range(27))       # 0.30 .. 1.60, calibration grid
GRID_S = tuple(round(0.50 + 0.05 * i, 2) for i in range(21))       # 0.50 .. 1.50


def _check_knob(what: str, v: Any, shape: tuple[int, int] | None) -> float | torch.Tensor:
    if isinstance(v, torch.Tensor):
        if not v.is_floating_point() or v.dim() != 2 or (shape is not None and tuple(v.shape) != tuple(shape)):
            fail(f"APE {what}", f"a float or a float tensor of shape {list(shape) if shape else '[L, Hq]'} "
                 "(per layer and query head)", f"{v.dtype} tensor of shape {list(v.shape)}")
        if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
            fail(f"APE {what}", "finite entries > 0", f"min {float(v.min()):.3g}, max {float(v.max()):.3g}")
        return v.detach().float().clone()
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        fail(f"APE {what}", "a finite float > 0", v)
    return float(v)


@dataclass(frozen=True)
class ApeParams:
    """APE's two knobs: each one float, or a [L, Hq] float tensor (one value per layer and query head).

    `check(L, Hq)` validates tensor shapes against a model; `for_layer(i)` gives the layer's (tau, s), each a float
    or a [Hq] tensor."""

    temperature: float | torch.Tensor = DEFAULT_TEMPERATURE
    scale: float | torch.Tensor = DEFAULT_SCALE

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", _check_knob("temperature", self.temperature, None))
        object.__setattr__(self, "scale", _check_knob("scale", self.scale, None))

    def check(self, layers: int, q_heads: int) -> "ApeParams":
        """Refuse per-head tensors that do not match a model of `layers` x `q_heads`; returns self."""
        for what in ("temperature", "scale"):
            _check_knob(what, getattr(self, what), (layers, q_heads))
        return self

    def for_layer(self, i: int) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        return tuple(x[i] if isinstance(x, torch.Tensor) else x for x in (self.temperature, self.scale))

    @property
    def is_identity(self) -> bool:
        return not isinstance(self.temperature, torch.Tensor) and not isinstance(self.scale, torch.Tensor) \
            and self.temperature == 1.0 and self.scale == 1.0


def _per_row(x: float | torch.Tensor, H: int, g: int, Lq: int, q_is_ctx: torch.Tensor | None,
             device: torch.device) -> torch.Tensor:
    """A knob (float, or [Hq] per query head) as [B|1, H, G, q, 1] float; rows that are context slots get 1."""
    if isinstance(x, torch.Tensor):
        t = x.to(device=device, dtype=torch.float32).view(1, H, g, 1, 1).expand(1, H, g, Lq, 1)
    else:
        t = torch.full((1, 1, 1, Lq, 1), float(x), device=device)
    if q_is_ctx is not None:
        t = torch.where(q_is_ctx.to(device).view(q_is_ctx.shape[0], 1, 1, Lq, 1), 1.0, t)
    return t


def ape_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, is_ctx: torch.Tensor,
               sm_scale: float, temperature: float | torch.Tensor, scale: float | torch.Tensor,
               q_is_ctx: torch.Tensor | None = None) -> torch.Tensor:
    """APE attention, torch (CPU or GPU). Returns [B, Hq, q, D] in q's dtype.

    q [B, Hq, q, D] rotated queries; k/v [B, H, N, D]; allowed [B|1, 1, q, N] bool; is_ctx [B|1, N] bool;
    temperature / scale: floats, or [Hq] tensors (one value per query head);
    q_is_ctx [B|1, q] bool: those query rows get plain attention (tau = s = 1).
    The merge is done in log space: key j gets logit s'_j + log w_G - LSE_G for its group G, so one exp and one
    matmul give w_C O_C + w_O O_O.
    """
    B, Hq, Lq, D = q.shape
    H, N = k.shape[1], k.shape[2]
    g = Hq // H
    qg = q.reshape(B, H, g * Lq, D).float()
    s = (qg @ k.float().transpose(-1, -2)) * sm_scale                # [B, H, G*q, N]
    s = s.view(B, H, g, Lq, N)
    ctx = is_ctx.view(is_ctx.shape[0], 1, 1, 1, N)
    tau = _per_row(temperature, H, g, Lq, q_is_ctx, s.device)
    sc = _per_row(scale, H, g, Lq, q_is_ctx, s.device)
    ok = allowed.view(allowed.shape[0], 1, 1, Lq, N)
    neg = torch.tensor(float("-inf"), device=s.device)
    sp = torch.where(ctx, s / tau, s).masked_fill(~ok, neg)            # s' (context scores tempered)
    lse_c = torch.logsumexp(sp.masked_fill(~ctx, neg), -1, keepdim=True)
    lse_o = torch.logsumexp(sp.masked_fill(ctx, neg), -1, keepdim=True)
    a, b = sc * tau * lse_c, lse_o
    lz = torch.logaddexp(a, b)
    off_c = torch.where(torch.isfinite(lse_c), a - lz - lse_c, torch.zeros_like(lse_c))
    off_o = torch.where(torch.isfinite(lse_o), b - lz - lse_o, torch.zeros_like(lse_o))
    p = torch.exp(sp + torch.where(ctx, off_c, off_o))                # rows sum to 1
    out = p.view(B, H, g * Lq, N) @ v.float()                          # [B, H, G*q, D]
    return out.view(B, Hq, Lq, -1).to(q.dtype)


def xformers_available() -> bool:
    """True when CUDA is present and xformers imports (never touches CUDA at import time of kvpos)."""
    if not torch.cuda.is_available():
        return False
    try:
        import xformers.ops  # noqa: F401
    except Exception:  # noqa: BLE001 - any import problem means: not available
        return False
    return True


def ape_attend_xformers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                        is_ctx: torch.Tensor, sm_scale: float, temperature: float | torch.Tensor,
                        scale: float | torch.Tensor, q_is_ctx: torch.Tensor | None = None) -> torch.Tensor:
    """`ape_attend` on CUDA with xformers: two memory_efficient_attention calls (context with queries / tau, the
    others plain) returning LSEs, merged as APE. Same arguments and result as `ape_attend`; dense additive biases
    (the question/generation phase has few queries)."""
    import xformers.ops as xops

    B, Hq, Lq, D = q.shape
    H, N = k.shape[1], k.shape[2]
    g = Hq // H
    kx = k.repeat_interleave(g, 1).transpose(1, 2)          # [B, N, Hq, D]
    vx = v.repeat_interleave(g, 1).transpose(1, 2)
    qx = q.transpose(1, 2)                                   # [B, q, Hq, D]
    ctx = is_ctx.view(-1, 1, 1, N)

    def part(mask, qq):
        bias = torch.zeros(B, Hq, Lq, N, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        o, lse = xops.memory_efficient_attention_forward_requires_grad(qq, kx, vx, attn_bias=bias, scale=sm_scale)
        return o.float(), lse.float()                        # o [B, q, Hq, D], lse [B, Hq, q]

    def knob(x):                                             # float or [Hq] -> [1, Hq|1, q]
        if isinstance(x, torch.Tensor):
            return x.to(device=q.device, dtype=torch.float32).view(1, Hq, 1).expand(1, Hq, Lq)
        return torch.full((1, 1, Lq), float(x), device=q.device)

    tq, sq = knob(temperature), knob(scale)
    if q_is_ctx is not None:                                 # rows that are context slots: plain attention
        tq = torch.where(q_is_ctx.view(-1, 1, Lq), 1.0, tq)
        sq = torch.where(q_is_ctx.view(-1, 1, Lq), 1.0, sq)
    q_c = (qx.float() / tq.transpose(1, 2)[..., None]).to(q.dtype)   # scores / tau == (q / tau) . k
    o_c, lse_c = part(allowed & ctx, q_c)
    o_o, lse_o = part(allowed & ~ctx, qx)
    a = sq * tq * lse_c
    wc = torch.sigmoid(a - lse_o).nan_to_num(0.0)            # softmax of two = sigmoid of the difference
    wc = torch.where(torch.isfinite(lse_c), torch.where(torch.isfinite(lse_o), wc, 1.0), 0.0)
    out = wc.transpose(1, 2)[..., None] * o_c.nan_to_num(0.0) + (1 - wc).transpose(1, 2)[..., None] * o_o.nan_to_num(0.0)
    return out.transpose(1, 2).to(q.dtype)                   # [B, Hq, q, D]


# ---------------------------------------------------------------------------------------------------------------------
# statistics for per-head calibration: the question's attention under parallel encoding vs under full prefill
# ---------------------------------------------------------------------------------------------------------------------

def context_stats(s: torch.Tensor, ctx: torch.Tensor, ok: torch.Tensor, grid_t: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row statistics of question scores. s [Hq, R, N] float (already times sm); ctx [N] bool; ok [R, N] bool.

    Returns, per temperature t of grid_t [G]: entropy of softmax(s_C / t) over the allowed context slots
    [Hq, R, G], LSE_C(t) = log sum_C exp(s / t) [Hq, R, G]; and LSE_O over the other allowed slots [Hq, R]."""
    neg = torch.tensor(float("-inf"))
    sc = s.masked_fill(~(ok & ctx), neg)[..., None, :] / grid_t.view(-1, 1)        # [Hq, R, G, N]
    lse_c = torch.logsumexp(sc, -1)
    p = torch.exp(sc - lse_c[..., None])
    ent = -(p * torch.where(p > 0, sc - lse_c[..., None], torch.zeros(()))).sum(-1)
    lse_o = torch.logsumexp(s.masked_fill(~(ok & ~ctx), neg), -1)
    return ent, lse_c, lse_o


class ApeStats:
    """Per-(layer, query head) means over question rows: the entropy of the context distribution and the log-odds of
    the context mass, as functions of tau (grid_t) and s (grid_s). Fed by an attention backend (`add_rows`) during
    calibration forwards; `means()` returns ([L, Hq, G], [L, Hq, G, Gs])."""

    def __init__(self, L: int, Hq: int, grid_t: torch.Tensor, grid_s: torch.Tensor) -> None:
        self.L, self.Hq, self.gt, self.gs = L, Hq, grid_t, grid_s
        self.ent = torch.zeros(L, Hq, grid_t.numel(), dtype=torch.float64)
        self.lo = torch.zeros(L, Hq, grid_t.numel(), grid_s.numel(), dtype=torch.float64)
        self.n = torch.zeros(L, dtype=torch.float64)

    @staticmethod
    def scores(q: torch.Tensor, k: torch.Tensor, sm: float) -> torch.Tensor:
        """q [1, Hq, R, D], k [1, H, N, D] -> [Hq, R, N] float scores."""
        g = q.shape[1] // k.shape[1]
        return (q[0].float() @ k[0].float().repeat_interleave(g, 0).transpose(-1, -2)) * sm

    def add_rows(self, layer: int, s: torch.Tensor, ctx: torch.Tensor, ok: torch.Tensor) -> None:
        """Accumulate question rows: s [Hq, R, N] scores, ctx [N] context columns, ok [R, N] allowed."""
        ent, lse_c, lse_o = context_stats(s.cpu(), ctx.cpu(), ok.cpu(), self.gt)
        keep = torch.isfinite(lse_c[0, :, 0]) & torch.isfinite(lse_o[0])       # rows that see both groups
        if not bool(keep.any()):
            return
        ent, lse_c, lse_o = ent[:, keep], lse_c[:, keep], lse_o[:, keep]
        lo = (self.gs.view(1, 1, 1, -1) * self.gt.view(1, 1, -1, 1) * lse_c[..., None]) - lse_o[..., None, None]
        self.ent[layer] += ent.double().sum(1)
        self.lo[layer] += lo.double().sum(1)
        self.n[layer] += float(keep.sum())

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not bool((self.n > 0).all()):
            fail("calibrate_ape prompts", "question tokens that see both context and other slots in every layer",
                 f"no usable rows in layers {torch.nonzero(self.n == 0).flatten().tolist()}")
        d = self.n.view(-1, 1, 1)
        return self.ent / d, self.lo / d.view(-1, 1, 1, 1)
