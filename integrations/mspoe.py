"""Ms-PoE on transformers: per-head position scales (kvpos.posmap) as an attention backend over a PositionedCache.

    scales = ms_poe_scales(L, Hq)                                     # fixed head order (the head's own number)
    with use_ms_poe(model, cache, scales):                            # full form: the prompt under Ms-PoE too
        extend(model, cache, prompt_ids); out = generate(model, cache, ...)

    extend(model, cache, context_ids)                                 # read-time form: the context prefilled plainly
    backend = MsPoEBackend.scored(L, Hq)                              # head order from the question's first call
    extend(model, cache, question_ids, attention=backend); ...

The backend reads each layer's raw keys from the bound cache (any storage), unrotates the call's queries, and
attends with kvpos.posmap.scaled_attend: every query head at its own ratio, grouped-query attention exact. Layers
whose ratios are all 1 take transformers' own attention (bit-identical to plain). A scored backend fixes each
layer's head order at its first call in the scope (the last row of that call is the prompt's last token, as in
Ms-PoE, which scores once per prompt); `reset()` starts a new prompt.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from kvpos._checks import fail
from kvpos.cache import PositionedKV
from kvpos.posmap import (MS_POE_FIRST_LAYER, MS_POE_MAX, MS_POE_MIN, HeadScales, assign_ratios, ms_poe_scales,
                          position_awareness, rotate_heads, scaled_attend, turned_cos_sin)
from kvpos.rope import cos_sin, unrotate
from kvpos.integrations.hf import AttentionCall, Binding, StepMemo, bind_attention
from kvpos.integrations.hf.attention import decode_mask

__all__ = ["MsPoEBackend", "use_ms_poe", "ms_poe_scales", "HeadScales"]


class MsPoEBackend:
    """Attention backend reading positions at per-(layer, query head) scales. `scales`: a HeadScales, or None with
    `scored(...)` (the head order chosen from each layer's first call)."""

    needs_cache = True

    def __init__(self, scales: HeadScales | None) -> None:
        if scales is not None and not isinstance(scales, HeadScales):
            fail("MsPoEBackend scales", "a kvpos.posmap.HeadScales", type(scales).__name__, exc=TypeError)
        self.scales = scales
        self._scored: dict | None = None            # scored form: its parameters and the head order chosen per layer
        self.head_index: dict[int, torch.Tensor] = {}
        self.read_counts = {"fused": 0, "torch": 0}  # which path served each scaled call (decode: the fused kernel)
        self._turns = _QueryTurns()
        self._memo: dict[int, tuple] = {}            # layer -> (source, ratios, all ones): see _layer_ratios
        self._steps = StepMemo()                     # a decode forward's query position and mask, for its layers

    @classmethod
    def scored(cls, layers: int, q_heads: int, rule: str = "rank", r_min: float = MS_POE_MIN,
               r_max: float = MS_POE_MAX, first_layer: int = MS_POE_FIRST_LAYER) -> "MsPoEBackend":
        """Ms-PoE with head order from position awareness (kvpos.posmap.assign_ratios `rule`), per layer."""
        ms_poe_scales(layers, q_heads, r_min, r_max, first_layer)          # validates the parameters
        assign_ratios(torch.zeros(q_heads), rule)
        b = cls(None)
        b._scored = {"layers": layers, "q_heads": q_heads, "rule": rule, "r_min": r_min, "r_max": r_max,
                     "first_layer": first_layer}
        return b

    def reset(self) -> None:
        """Forget the head orders chosen (a new prompt)."""
        self.head_index = {}

    def ratios(self, layer: int) -> torch.Tensor | None:
        """[Hq] ratios of `layer` (None: not chosen yet)."""
        if self.scales is not None:
            return self.scales.for_layer(layer)
        p = self._scored
        if layer < p["first_layer"]:
            return torch.ones(p["q_heads"], dtype=torch.float64)
        idx = self.head_index.get(layer)
        return None if idx is None else p["r_min"] + (p["r_max"] - p["r_min"]) * idx.double() / p["q_heads"]

    def _layer_ratios(self, layer: int) -> tuple[torch.Tensor | None, bool]:
        """(ratios(layer), whether they are all 1), kept per layer while their source (the scales table, or the
        layer's chosen head order) is the same object: decode steps do not recompute them."""
        src = self.scales if self.scales is not None else self.head_index.get(layer)
        got = self._memo.get(layer)
        if got is not None and got[0] is src:
            return got[1], got[2]
        r = self.ratios(layer)
        if r is None:
            return None, False
        self._memo[layer] = (src, r, bool((r == 1).all()))
        return r, self._memo[layer][2]

    def _choose(self, call: AttentionCall, q_raw: torch.Tensor, k_raw: torch.Tensor, allowed: torch.Tensor
                ) -> torch.Tensor:
        p = self._scored
        if q_raw.shape[0] != 1:
            fail("MsPoEBackend.scored", "batch 1 (one head order per prompt)", f"batch {q_raw.shape[0]}",
                 "use MsPoEBackend(ms_poe_scales(...)) with a fixed head order for batches")
        if q_raw.shape[1] != p["q_heads"] or call.layer >= p["layers"]:
            fail("MsPoEBackend.scored", f"{p['layers']} layers of {p['q_heads']} query heads",
                 f"layer {call.layer} with {q_raw.shape[1]} query heads")
        score = position_awareness(q_raw[:, :, -1], k_raw, allowed[:, 0, -1], call.scaling)[0]
        self.head_index[call.layer] = assign_ratios(score, p["rule"])
        return self.ratios(call.layer)

    def __call__(self, call: AttentionCall, binding: Binding) -> torch.Tensor:
        r, plain = self._layer_ratios(call.layer)
        if plain:
            return call.plain()
        cache = binding.cache_layer_keys(call)
        layer = cache.layers[call.layer]
        B, Hq, Lq, _ = call.query.shape
        N = call.n_keys
        if self.scales is not None and self.scales.ratios.shape[1] != Hq:
            fail("MsPoEBackend scales", f"[L, Hq={Hq}] ratios (the model's query heads)",
                 list(self.scales.ratios.shape))
        spec = layer.spec
        if Lq == 1 and r is not None:               # a decode row: its position and mask once per forward
            q_pos, mask = self._steps.get(call, lambda: _decode_rows(cache, call))
            out = _decode_fused(cache, call, self._turns.turn_matrix(q_pos, r, spec, call.query.shape[-1]), r, mask)
            if out is not None:
                self.read_counts["fused"] += 1
                return AttentionCall.finish(out.to(call.query.dtype))
        pos = cache.table.pos[:, :N].to(call.query.device)
        q_pos = pos[:, N - Lq:]
        # a decode row with no mask sees every key: no [B, 1, 1, N] mask to build (the fused kernel then takes none)
        allowed = None if Lq == 1 and r is not None and call.mask is None else call.allowed().expand(B, 1, Lq, N)
        q_raw = None
        if r is None:
            q_raw = self._unrotated(call, q_pos, spec)
            r = self._choose(call, q_raw, layer.raw_keys, allowed)
        out = (_decode_fused(cache, call, self._turns.turn_matrix(q_pos, r, spec, call.query.shape[-1]), r,
                             None if allowed is None else decode_mask(allowed)) if Lq == 1 else None)
        self.read_counts["torch" if out is None else "fused"] += 1
        if out is None:
            allowed = call.allowed().expand(B, 1, Lq, N) if allowed is None else allowed
            q_raw = self._unrotated(call, q_pos, spec) if q_raw is None else q_raw
            out = scaled_attend(q_raw, layer.raw_keys, layer.values, q_pos, pos, r, spec, call.scaling, allowed)
        return AttentionCall.finish(out.to(call.query.dtype))

    def _unrotated(self, call: AttentionCall, q_pos: torch.Tensor, spec) -> torch.Tensor:
        """The call's queries without RoPE [B, Hq, q, D] (a decode row: the step's angles, shared by the layers)."""
        if call.query.shape[2] != 1:
            return unrotate(call.query, q_pos, spec)
        c, s = self._turns.unrotate(q_pos, spec)
        return rotate_heads(call.query, c, -s, spec, 1.0 / spec.attention_scaling)


class _QueryTurns:
    """The angles of one decode step's query position, made once and shared by the layers (every layer of a step
    reads the same position; the check is against a copy, so the next step's position is seen): (cos, sin) of the
    position to unrotate the query, and per ratio table of the turn from the model's rotation to position / r_h."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None
        self.memo: dict = {}

    def _at(self, q_pos: torch.Tensor) -> dict:
        if self.last is None or self.last.shape != q_pos.shape or not torch.equal(self.last, q_pos):
            self.last, self.memo = q_pos.clone(), {}
        return self.memo

    def unrotate(self, q_pos: torch.Tensor, spec) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin(q_pos) [B, 1, S, R/2] (unscaled, the spec's angle dtype)."""
        memo = self._at(q_pos)
        key = ("un", spec.identity)
        if key not in memo:
            c, s = cos_sin(q_pos, spec)
            memo[key] = (c[:, None], s[:, None])
        return memo[key]

    def turned(self, q_pos: torch.Tensor, r: torch.Tensor, spec) -> tuple[torch.Tensor, torch.Tensor]:
        """turned_cos_sin(q_pos, r) [B, Hq, S, R/2]: the model's query to Ms-PoE's scales in one rotation."""
        memo = self._at(q_pos)
        key = ("turned", spec.identity, tuple(r.tolist()))
        if key not in memo:
            memo[key] = turned_cos_sin(q_pos, r, spec)
        return memo[key]

    def turn_matrix(self, q_pos: torch.Tensor, r: torch.Tensor, spec, dim: int) -> torch.Tensor:
        """[B, Hq, D, D] float32 M with x @ M = rotate_heads(x, *turned(q_pos, r), spec, 1.0) for one decode row x
        [B, Hq, 1, D] (q_pos [B, 1]): the rotation applied to the identity's rows, made once per step and ratios,
        so that each layer turns its query in one matmul."""
        memo = self._at(q_pos)
        key = ("matrix", spec.identity, tuple(r.tolist()), dim)
        if key not in memo:
            c, s = self.turned(q_pos, r, spec)                               # [B, Hq, 1, R/2]
            eye = torch.eye(dim, dtype=torch.float32).expand(c.shape[0], c.shape[1], dim, dim)
            memo[key] = rotate_heads(eye, c.expand(-1, -1, dim, -1), s.expand(-1, -1, dim, -1), spec, 1.0)
        return memo[key]


def _decode_rows(cache: PositionedKV, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q_pos [B, 1] int64, additive mask [B, N] or None) of a decode call: its query position, and what it sees
    as the fused kernel takes it (decode_mask; no mask: every key)."""
    N = call.n_keys
    q_pos = cache.table.pos[:, N - 1:N].to(call.query.device)
    return q_pos, None if call.mask is None else decode_mask(call.allowed().expand(q_pos.shape[0], 1, 1, N))


def _decode_fused(cache: PositionedKV, call: AttentionCall, turn: torch.Tensor, r: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor | None:
    """One query row per batch row over storage="raw" by the position-map decode kernel: [B, Hq, 1, D] float32,
    or None where it cannot serve (then scaled_attend computes the same numbers). turn: _QueryTurns.turn_matrix of
    the query position at the ratios r (the model's query turned to the scaled positions in one rotation); mask:
    additive float32 [B, N] or None (decode_mask)."""
    q = torch.matmul(call.query.float(), turn)                                                       # [B, Hq, 1, D]
    out = cache.decode_mapped(call.layer, q, mask, call.scaling, ratios=r, state=call.read_state)
    return None if out is None else out[:, :, None]


@contextlib.contextmanager
def use_ms_poe(model: torch.nn.Module, cache: PositionedKV, scales: HeadScales | None = None, **scored: Any
               ) -> Iterator[MsPoEBackend]:
    """Within the block, `model` attends with Ms-PoE over `cache`: a fixed `scales` table, or (scales None) head
    orders scored per layer at the first call (MsPoEBackend.scored(**scored), layers and heads from the model).
    Scales that are all 1 bind nothing: the block runs plain attention, bit-identical to no Ms-PoE."""
    if scales is None:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        backend = MsPoEBackend.scored(cfg.num_hidden_layers, cfg.num_attention_heads, **scored)
    else:
        backend = MsPoEBackend(scales)
        if scales.is_identity():              # plain attention, bit for bit: nothing to bind
            yield backend
            return
    with bind_attention(model, backend, cache):
        yield backend
