"""APE on transformers: the attention backend, its scope, batched chunk prefill and per-head calibration.

The mathematics (kvpos.ape) is a pure function of q/k/v/masks; this module decides which slots are context (the
bound cache's segment labels >= SEG_CHUNK0, set by compose with layout="parallel") and runs models.

    cache, _ = composer.compose(chunks, layout="parallel")
    with use_ape(model, cache, temperature=0.7):             # or extend(..., attention=ApeBackend(...))
        logits = extend(model, cache, question_ids)
        out = generate(model, cache, first_token, max_new_tokens=20)

Over a cache with no context slots APE is plain attention (tau and s act on context slots only): the backend then
runs SDPA, by design. Every other mismatch raises: keys that are not the bound cache's (a forward run without the
bound cache, or with another one), per-head knobs of the wrong shape.
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from kvpos._checks import fail
from kvpos.ape import (DEFAULT_SCALE, DEFAULT_TEMPERATURE, GRID_S, GRID_T, ApeParams, ApeStats, ape_attend,
                       ape_attend_xformers, xformers_available)
from kvpos.cache import PositionedKV
from kvpos.compose import SEG_CHUNK0, block_diagonal_allowed
from kvpos.store import ChunkKV, Fingerprint
from kvpos.integrations.compose import Anchor
from kvpos.integrations.hf import AttentionCall, Binding, bind_attention, extend
from kvpos.integrations.hf.attention import layers_heads

__all__ = ["ApeBackend", "use_ape", "encode_chunks_batched", "ApeCalibration", "calibrate_ape", "DEFAULT_TEMPERATURE",
           "DEFAULT_SCALE"]


class ApeBackend:
    """Attention backend: APE over the bound cache's context slots (segment >= SEG_CHUNK0).

    params: ApeParams (floats, or [L, Hq] per layer and query head). stats: an optional ApeStats that records the
    question rows' statistics (calibration)."""

    needs_cache = True

    def __init__(self, params: ApeParams | None = None, stats: ApeStats | None = None) -> None:
        self.params = params if params is not None else ApeParams()
        if not isinstance(self.params, ApeParams):
            fail("ApeBackend params", "an ApeParams", type(self.params).__name__, exc=TypeError)
        self.stats = stats

    def __call__(self, call: AttentionCall, binding: Binding) -> torch.Tensor:
        cache = binding.cache_layer_keys(call)
        N, Lq = call.key.shape[2], call.query.shape[2]
        is_ctx = cache.table.segment.to(call.key.device) >= SEG_CHUNK0           # [B, N]
        if not bool(is_ctx.any()):
            return call.plain()                      # no context slots: APE is plain attention, exactly
        allowed = call.allowed()
        q_is_ctx = is_ctx[:, N - Lq:]
        tau, s = self.params.for_layer(call.layer)
        if self.stats is not None:
            _record_question_rows(self.stats, call, allowed, is_ctx, q_is_ctx)
        fn = ape_attend_xformers if call.query.is_cuda and xformers_available() else ape_attend
        out = fn(call.query, call.key, call.value, allowed, is_ctx, call.scaling, tau, s, q_is_ctx=q_is_ctx)
        return AttentionCall.finish(out)


def _record_question_rows(stats: ApeStats, call: AttentionCall, allowed: torch.Tensor, is_ctx: torch.Tensor,
                          q_is_ctx: torch.Tensor) -> None:
    rows = ~q_is_ctx[0]
    if call.query.shape[0] != 1 or not bool(rows.any()):
        return
    s = ApeStats.scores(call.query[:, :, rows], call.key, call.scaling)
    stats.add_rows(call.layer, s, is_ctx[0], allowed[0, 0][rows])


class _FullPrefillProbe:
    """Backend for calibration: plain attention, recording the question rows' context statistics of a full prefill
    (no cache: the forward runs with use_cache=False). `ctx` [N] marks the context columns, `rows` the question."""

    needs_cache = False

    def __init__(self, stats: ApeStats) -> None:
        self.stats = stats
        self.ctx: torch.Tensor | None = None
        self.rows = 0

    def __call__(self, call: AttentionCall, binding: Binding) -> torch.Tensor:
        N, R = call.key.shape[2], self.rows
        s = ApeStats.scores(call.query[:, :, -R:], call.key, call.scaling)
        ok = torch.arange(N)[None] <= torch.arange(N - R, N)[:, None]             # causal rows of the question
        self.stats.add_rows(call.layer, s, self.ctx, ok)
        return call.plain()


@contextlib.contextmanager
def use_ape(model: torch.nn.Module, cache: PositionedKV, temperature: float | torch.Tensor = DEFAULT_TEMPERATURE,
            scale: float | torch.Tensor = DEFAULT_SCALE) -> Iterator[ApeBackend]:
    """Within the block, `model` attends with APE (tau = temperature, s = scale) over `cache`'s context slots (this
    thread / task only). Each knob is one float, or a [L, Hq] tensor (per layer and query head, e.g. from
    `calibrate_ape`)."""
    backend = ApeBackend(ApeParams(temperature, scale).check(*layers_heads(model)))
    with bind_attention(model, backend, cache):
        yield backend


# ---------------------------------------------------------------------------------------------------------------------
# batched chunk prefill: every chunk of a request in one forward with a block-diagonal mask
# ---------------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def encode_chunks_batched(model: torch.nn.Module, anchor: Anchor, chunks: list[torch.Tensor],
                          fingerprint: Fingerprint) -> list[ChunkKV]:
    """Encode all `chunks` after `anchor` and its lead in ONE forward (block-diagonal mask, every chunk at positions
    A+L..); equals encoding them one by one (`encode_chunk`)."""
    ids = [torch.as_tensor(c, dtype=torch.long).flatten() for c in chunks]
    A = anchor.chunk_start
    lengths = [int(c.numel()) for c in ids]
    window = getattr(model.config, "sliding_window", None)
    if window and "sliding_attention" in (getattr(model.config, "layer_types", None) or []) \
            and A + max(lengths) > window:
        fail("encode_chunks_batched", f"anchor + longest chunk <= sliding_window={window}",
             A + max(lengths), "one 4-D mask serves every layer and cannot express the sliding window; "
             "encode the chunks one by one (encode_chunk)")
    cache = anchor.context.copy()
    pos = torch.cat([torch.arange(A, A + L) for L in lengths])
    allowed = block_diagonal_allowed(lengths, A)[None, None]
    extend(model, cache, torch.cat(ids)[None], positions=pos, attention_mask=allowed)
    out, s = [], A
    for c, L in zip(ids, lengths):
        out.append(ChunkKV.from_raw_kv(c, cache.raw_kv(s, s + L), A, fingerprint))
        s += L
    return out


# ---------------------------------------------------------------------------------------------------------------------
# per-head calibration (beyond the paper): fit tau and s per layer and query head so that the question's attention
# under parallel encoding looks like it does under full prefill
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class ApeCalibration:
    """Per-(layer, query head) APE knobs fitted by `calibrate_ape`; `use_ape(model, cache, **cal.knobs())`.

    temperature, scale: [L, Hq]; entropy_full / entropy_fit: mean context entropy of the question's attention
    under full prefill and under APE with the fitted tau (calibration prompts); n_prompts: how many were used.
    Saved as plain JSON (`save` / `load`), never pickled."""

    temperature: torch.Tensor
    scale: torch.Tensor
    entropy_full: torch.Tensor
    entropy_fit: torch.Tensor
    n_prompts: int

    def knobs(self) -> dict[str, torch.Tensor]:
        return {"temperature": self.temperature, "scale": self.scale}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}, f)

    @classmethod
    def load(cls, path: str) -> "ApeCalibration":
        with open(path) as f:
            d = json.load(f)
        want = {"temperature", "scale", "entropy_full", "entropy_fit", "n_prompts"}
        if not isinstance(d, dict) or set(d) != want:
            fail(f"ApeCalibration file {path}", f"a JSON object with keys {sorted(want)}",
                 sorted(d) if isinstance(d, dict) else type(d).__name__)
        cal = cls(**{k: (torch.tensor(v, dtype=torch.float32) if k != "n_prompts" else int(v)) for k, v in d.items()})
        ApeParams(cal.temperature, cal.scale).check(*cal.entropy_full.shape)
        return cal


@torch.no_grad()
def calibrate_ape(model: torch.nn.Module, composer: Any, prompts: Sequence[Any], rounds: int = 2,
                  fit_scale: bool = True, grid_t: Sequence[float] = GRID_T, grid_s: Sequence[float] = GRID_S,
                  progress: bool = True) -> ApeCalibration:
    """Fit APE's tau and s per layer and query head on calibration prompts (never the evaluation items).

    prompts: PromptParts (anchor = composer's anchor, chunks, question). For the question tokens, per layer and
    head: tau is the grid value whose tempered context entropy under parallel encoding is closest to the entropy
    under full prefill; s (if fit_scale, else 1) is the grid value that matches the mean log-odds of the context mass
    (s*tau*LSE_C - LSE_O vs LSE_C - LSE_O of full prefill). Later layers depend on earlier layers' knobs, so the
    parallel statistics are re-measured `rounds` times, each under the previous round's fit."""
    from tqdm import tqdm

    if not prompts:
        fail("calibrate_ape prompts", "a non-empty list of PromptParts", "[]")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        fail("calibrate_ape rounds", "an int >= 1", rounds)
    L, Hq = layers_heads(model)
    gt = torch.tensor([float(x) for x in grid_t], dtype=torch.float32)
    gs = torch.tensor([float(x) for x in grid_s] if fit_scale else [1.0], dtype=torch.float32)
    ApeParams(gt.view(1, -1), gs.view(1, -1))
    A = int(composer.anchor.length)
    bar = tqdm(total=len(prompts) * (rounds + 1), desc="calibrate_ape", disable=not progress, file=sys.stdout)
    probe = _FullPrefillProbe(ApeStats(L, Hq, torch.ones(1), torch.ones(1)))
    with bind_attention(model, probe):
        for p in prompts:
            ids = p.full_ids()
            probe.ctx = torch.zeros(ids.shape[1], dtype=torch.bool)
            probe.ctx[A:A + sum(int(c.numel()) for c in p.chunks)] = True
            probe.rows = int(p.question.numel())
            model(ids, use_cache=False)
            bar.update()
    ent_full, lo_full = (x[..., 0] for x in probe.stats.means())      # [L, Hq], [L, Hq, 1]
    lo_full = lo_full[..., 0]
    tau, s = torch.ones(L, Hq), torch.ones(L, Hq)
    for _ in range(rounds):
        stats = ApeStats(L, Hq, gt, gs)
        backend = ApeBackend(ApeParams(tau, s), stats=stats)
        for p in prompts:
            cache, _ = composer.compose(p.chunks, layout="parallel")
            extend(model, cache, p.question[None], attention=backend)
            bar.update()
        ent, lo = stats.means()                                         # [L, Hq, G], [L, Hq, G, Gs]
        ti = (ent - ent_full[..., None]).abs().argmin(-1)              # [L, Hq]
        lo_t = lo.gather(2, ti[..., None, None].expand(L, Hq, 1, gs.numel()))[:, :, 0]
        si = (lo_t - lo_full[..., None]).abs().argmin(-1)
        tau, s = gt[ti], gs[si]
        ent_fit = ent.gather(2, ti[..., None])[..., 0]
    bar.close()
    return ApeCalibration(tau, s, ent_full.float(), ent_fit.float(), len(prompts))
