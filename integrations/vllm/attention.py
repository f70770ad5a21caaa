"""kvpos as vLLM's attention (CPU): raw keys in the engine's paged cache, each request's logical positions applied
in attention.

Enabled by configuration, off by default: KVPOS_VLLM_ATTENTION=1 in the environment of the vLLM processes (the
plugin, plugin.py, then registers KvposAttentionBackend in place of CPU_ATTN) and
`engine_kwargs(..., attention=True)` (the connector loads and saves raw keys and accepts non-sequential layouts).

Letters: T tokens of the step · s a request's tokens so far · q its tokens in this step · H kv heads · Hq query
heads · D head dim.

Writes (`do_kv_cache_update`): the model rotated the step's keys at vLLM's positions (token indices); they are
un-rotated there with the model's RoPE spec (kvpos.rope.unrotate) and written raw. Reads (`forward`): per batch
row, the request's raw keys and values [H, s, D] are read through its block table and the keys rotated to the
request's logical positions, the queries turned from vLLM's positions to their logical ones. Queries whose
visibility is causal by token index (every sequential step, a parallel request's question and answer: almost every
token) then run through vLLM's own CPU attention kernel over a per-step scratch cache that holds each row's rotated
keys and values in a run of blocks (`_kernel_batch`; vLLM's kernel is faster than torch's fused attention on CPU:
results/bench_vllm_attention.md). The rest (passage tokens computed in the parallel layout; every query with APE)
attend in torch under the request's visibility, over the keys they may see (torch's fused CPU attention; with APE,
kvpos.ape.ape_attend over the passages). A row without a kvpos layout has logical = vLLM positions and a causal
mask: vLLM's own attention, up to rounding. The scratch costs one copy of the step's keys and values (freed after
the step): the raw cache stays the only persistent copy.

A request's layout reaches the worker through the kvpos connector's step metadata (scheduler.RowLayout); its batch
row is the one whose last scheduled token is written to a block the request holds (a block being written belongs to
one request: vLLM shares only full blocks).

Refused at engine start (ValueError naming the feature): sliding windows, logits soft-capping, attention sinks,
ALiBi, quantized KV caches, non-decoder attention, shared-KV layers. The CUDA build of vLLM selects its backends
through another platform hook; this backend is written for and tested on the CPU build only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import vllm.envs as vllm_envs
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata,
                                                 CPUAttentionMetadataBuilder)

from kvpos._checks import fail
from kvpos.ape import ape_attend
from kvpos.compose import plan_layout
from kvpos.rope import rotate, unrotate

from .paged import PagedLayout
from .plugin import ENV

__all__ = ["KvposAttentionBackend", "KvposAttentionImpl", "KvposAttentionMetadata", "RowView", "row_views"]


@dataclass
class KvposAttentionMetadata(CPUAttentionMetadata):
    """vLLM's CPU metadata plus each token's vLLM position ([T] int64) and, filled at the step's first forward, the
    per-row views (row_views)."""

    positions: torch.Tensor | None = None
    views: list | None = None
    fused: Any = None


class KvposMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder; keeps the token positions the runner hands it."""

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
              ) -> KvposAttentionMetadata:
        m = super().build(common_prefix_len, common_attn_metadata, fast_build)
        pos = common_attn_metadata.positions
        if pos is None:
            fail("kvpos attention metadata", "the runner's token positions (CommonAttentionMetadata.positions)",
                 "None", "this vLLM runner does not hand positions to attention builders; kvpos needs vLLM 0.32")
        return KvposAttentionMetadata(**{f.name: getattr(m, f.name) for f in fields(m)},
                                      positions=pos[:m.num_actual_tokens].to(torch.long))


@dataclass
class RowView:
    """Batch row `row`: query tokens [q0, q1) of the step, s tokens of the request so far, the blocks holding them
    in order ([ceil(s / block size)] int64), and, for a kvpos layout, logical positions [s] int64 and visibility of
    the row's queries [q, s] bool (None: vLLM's positions, causal); `lead`: how many of its first queries attend in
    torch (all with APE; else those up to the last whose visibility is not causal by token index, e.g. passage
    tokens computed in the parallel layout), the rest through vLLM's kernel; with APE its (temperature, scale) and
    which tokens are passages [s] bool."""

    q0: int
    q1: int
    s: int
    block_ids: torch.Tensor
    row: int = 0
    logical: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    lead: int = 0
    ape: tuple[float, float] | None = None
    is_ctx: torch.Tensor | None = None


def _layout_positions(anchor_len: int, lengths: list[int], layout: str, s: int, n: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logical positions [s], visibility of the last n tokens [n, s]) of the first s tokens of a request with this
    layout: the anchor, the passages (kvpos.compose.plan_layout), then the question and generated tokens after
    them."""
    plan = plan_layout(anchor_len, lengths, layout)
    P = plan.num_slots
    pieces = [torch.arange(anchor_len)] + [plan.positions(i) for i in range(len(lengths))]
    tail = torch.arange(plan.next_position, plan.next_position + max(0, s - P))
    logical = torch.cat(pieces + [tail])[:s]
    return logical, plan.allowed(max(0, s - P), torch.arange(s - n, s))[:, :s]


def row_views(meta: KvposAttentionMetadata, block_size: int, rows: list) -> list[RowView]:
    """The step's batch rows, each matched to its kvpos layout (`rows`: scheduler.RowLayout of the step). Raises
    ValueError when a layout finds no row (a request's positions would silently be vLLM's)."""
    qsl = meta.query_start_loc.tolist()
    seq = meta.seq_lens.tolist()
    by_block = {b: r for r in rows for b in r.block_ids}
    views, used = [], set()
    for i in range(len(seq)):
        q0, q1, s = qsl[i], qsl[i + 1], int(seq[i])
        if q1 <= q0:
            continue
        t = torch.arange(s)
        v = RowView(q0, q1, s, meta.block_table[i][:-(-s // block_size)].to(torch.long), i)
        last = int(meta.slot_mapping[q1 - 1]) // block_size
        r = by_block.get(last)
        if r is not None:
            v.logical, v.allowed = _layout_positions(r.anchor_len, r.lengths, r.layout, s, q1 - q0)
            odd = (v.allowed != (t[None] <= t[s - (q1 - q0):, None])).any(1).nonzero()
            v.lead = int(odd[-1]) + 1 if odd.numel() else 0
            if r.ape is not None:
                v.ape = tuple(r.ape)
                v.is_ctx = (t >= r.anchor_len) & (t < r.anchor_len + sum(r.lengths))
                v.lead = q1 - q0
            used.add(r.req_id)
        views.append(v)
    missing = sorted({r.req_id for r in rows} - used)
    if missing:
        fail("kvpos attention rows", "a batch row for every request with a kvpos layout", f"none for {missing}")
    return views


class KvposAttentionImpl(CPUAttentionBackendImpl):
    """See the module docstring."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes: Any,
                 sliding_window: int | None, kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        refused = {"sliding windows": sliding_window is not None, "logits soft-capping": bool(logits_soft_cap),
                   "attention sinks": sinks is not None, "ALiBi": alibi_slopes is not None,
                   "quantized KV caches": kv_cache_dtype != "auto", "shared-KV layers": kv_sharing_target_layer_name,
                   "non-decoder attention": attn_type != AttentionType.DECODER}
        bad = [k for k, v in refused.items() if v]
        if bad:
            fail("kvpos attention backend", "a decoder attention layer without " + ", ".join(refused), bad,
                 f"unset {ENV} for this model")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        from kvpos.integrations.hf.specs import rope_specs_from_config

        cfg = get_current_vllm_config()
        self.specs = rope_specs_from_config(cfg.model_config.hf_config)
        self.paged = PagedLayout(cfg.model_config.dtype)
        self.layer: int | None = None

    def _spec(self, layer: Any) -> Any:
        if self.layer is None:
            m = re.search(r"\.(\d+)\.", layer.layer_name)
            if m is None or int(m[1]) >= len(self.specs):
                fail("kvpos attention layer name", f"a layer index below {len(self.specs)}", layer.layer_name)
            self.layer = int(m[1])
        return self.specs[self.layer]

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """key [T, H, D] rotated at vLLM's positions: written un-rotated."""
        meta = _layer_meta(layer.layer_name)
        if meta is None:                    # vLLM's profiling / warm-up run: no request, nothing to keep
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        pos = meta.positions[:key.shape[0]]
        raw = unrotate(key.transpose(0, 1)[None], pos, self._spec(layer))[0].transpose(0, 1).to(key.dtype)
        super().do_kv_cache_update(layer, raw.contiguous(), value, kv_cache, slot_mapping)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, output_scale: Any = None, output_block_scale: Any = None
                ) -> torch.Tensor:
        """query [T, Hq, D] rotated at vLLM's positions; output [T, Hq, D]."""
        if output_scale is not None or output_block_scale is not None:
            fail("kvpos attention forward", "no fused output quantization", "an output scale")
        if attn_metadata is None:
            return output
        if not isinstance(attn_metadata, KvposAttentionMetadata):
            fail("kvpos attention metadata", "KvposAttentionMetadata", type(attn_metadata).__name__)
        spec = self._spec(layer)
        bs = kv_cache.shape[2]
        if attn_metadata.views is None:
            attn_metadata.views = row_views(attn_metadata, bs, _step_rows())
        views = attn_metadata.views
        if not self.paged.affine(kv_cache):
            for v in views:
                output[v.q0:v.q1] = self._row(query, kv_cache, attn_metadata.positions, v, spec, 0, v.q1 - v.q0)
            return output
        for v in views:                        # the queries vLLM's kernel cannot serve
            if v.lead:
                output[v.q0:v.q0 + v.lead] = self._row(query, kv_cache, attn_metadata.positions, v, spec, 0, v.lead)
        if any(v.lead < v.q1 - v.q0 for v in views):
            self._through_vllm(layer, query, key, value, kv_cache, attn_metadata, output, spec)
        return output

    def _through_vllm(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kv_cache: torch.Tensor, meta: KvposAttentionMetadata, output: torch.Tensor, spec: Any) -> None:
        """The queries after each row's lead (causal by token index): keys rotated to their logical positions into
        the step's scratch cache (_kernel_batch), queries turned to theirs, and vLLM's own CPU attention kernel over
        it; output rows written in place."""
        sched = {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_size,
                 "dtype": self.paged.dtype, "sliding_window_size": -1, "isa": layer.isa,
                 "enable_kv_split": vllm_envs.VLLM_CPU_ATTN_SPLIT_KV, "kv_cache_dtype": self.kv_cache_dtype}
        scratch, sub, starts, idx = _kernel_batch(meta, kv_cache, sched)
        q = query if idx is None else query[idx]
        for i, (v, first) in enumerate(zip([v for v in meta.views if v.lead < v.q1 - v.q0], starts)):
            raw, val = self.paged.gather_blocks(kv_cache, v.block_ids, v.s)             # [H, s, D]
            kpos = torch.arange(v.s) if v.logical is None else v.logical
            self.paged.write_run(scratch, first, rotate(raw[None], kpos, spec)[0].to(raw.dtype), val)
            if v.logical is not None:
                if q is query:
                    q = query.clone()
                a, b = v.q0 + v.lead, v.q1
                at = a if idx is None else int(sub.query_start_loc[i])
                qh = query[a:b].transpose(0, 1)[None]                                   # [1, Hq, n, D]
                q[at:at + b - a] = rotate(unrotate(qh, meta.positions[a:b], spec), kpos[v.s - (b - a):], spec
                                          )[0].transpose(0, 1).to(q.dtype)
        if idx is None:
            super().forward(layer, q, key, value, scratch, sub, output)
        else:
            out = torch.empty_like(q)
            super().forward(layer, q, key, value, scratch, sub, out)
            output[idx] = out

    def _row(self, query: torch.Tensor, kv_cache: torch.Tensor, positions: torch.Tensor, v: RowView, spec: Any,
             a: int, b: int) -> torch.Tensor:
        """Attention of the row's queries a..b (of its q0..q1; query [T, Hq, D] rotated at vLLM's positions
        `positions` [T]) in torch -> [b - a, Hq, D]."""
        raw, val = self.paged.gather_blocks(kv_cache, v.block_ids, v.s)         # [H, s, D]
        q = query[v.q0 + a:v.q0 + b]
        qh = q.transpose(0, 1)[None]                                            # [1, Hq, n, D]
        t0 = v.s - (v.q1 - v.q0)                                                # the row's first query token
        if v.logical is None:
            kpos = torch.arange(v.s)
            mask = None if (a, b) == (0, v.q1 - v.q0) else torch.arange(v.s)[None] <= torch.arange(
                t0 + a, t0 + b)[:, None]
        else:
            kpos, mask = v.logical, v.allowed[a:b]
            qh = rotate(unrotate(qh, positions[v.q0 + a:v.q0 + b], spec), kpos[t0 + a:t0 + b], spec)
        is_ctx = v.is_ctx
        if mask is not None and not bool(mask.any(0).all()):                   # only the keys some query sees
            cols = mask.any(0).nonzero().flatten()                              # (a parallel passage's own)
            raw, val, kpos, mask = raw[:, cols], val[:, cols], kpos[cols], mask[:, cols]
            is_ctx = None if is_ctx is None else is_ctx[cols]
        k = rotate(raw[None], kpos, spec)                                       # [1, H, s', D]
        if v.ape is not None:                                                   # APE over the passages
            out = ape_attend(qh, k, val[None], mask[None, None], is_ctx[None], self.scale, v.ape[0],
                             v.ape[1], q_is_ctx=v.is_ctx[t0 + a:t0 + b][None])  # [1, Hq, n, D]
            return out[0].transpose(0, 1).to(q.dtype)
        return _attend(qh, k, val[None], mask, self.scale).transpose(0, 1).to(q.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float
            ) -> torch.Tensor:
    """Grouped-query attention of q [1, Hq, n, D] over k, v [1, H, s, D] -> [Hq, n, D] (torch's fused CPU kernel);
    allowed [n, s] bool, or None: causal with the n queries last (query i sees keys up to s - n + i)."""
    n, s = q.shape[2], k.shape[2]
    if allowed is None and n == s:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0]
    if allowed is None:
        allowed = torch.ones(n, s, dtype=torch.bool).tril(s - n)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                                            enable_gqa=True)[0]


def _kernel_batch(meta: KvposAttentionMetadata, kv: torch.Tensor, sched: dict
                  ) -> tuple[torch.Tensor, Any, list[int], torch.Tensor | None]:
    """What vLLM's kernel runs on in this step, made at its first layer and reused by the others (one metadata
    object per step): the rows with queries after their lead, each row's blocks in a run of a scratch cache
    [sum of their blocks, H, bs, 2 D] (zeroed), metadata of that sub-batch (block table into the scratch; query
    ranges and scheduler metadata rebuilt when some queries are left out), each row's first scratch block, and the
    step's token indices of the sub-batch's queries [T'] int64 (None: every query of the step, in order)."""
    if meta.fused is None:
        import vllm._custom_ops as vllm_ops

        nb, H, bs, d2 = kv.shape
        views = [v for v in meta.views if v.lead < v.q1 - v.q0]
        counts = [v.block_ids.numel() for v in views]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        scratch = torch.zeros(max(1, sum(counts)), H, bs, d2, dtype=kv.dtype)
        whole = len(views) == len(meta.views) == len(meta.seq_lens) and all(v.lead == 0 for v in views)
        if whole:
            table = torch.zeros_like(meta.block_table)
            for v, first, c in zip(views, starts, counts):
                table[v.row, :c] = torch.arange(first, first + c, dtype=table.dtype)
            sub, idx = replace(meta, block_table=table, views=None, fused=None), None
        else:
            table = torch.zeros(len(views), max(counts), dtype=meta.block_table.dtype)
            for i, (first, c) in enumerate(zip(starts, counts)):
                table[i, :c] = torch.arange(first, first + c, dtype=table.dtype)
            nq = torch.tensor([v.q1 - v.q0 - v.lead for v in views], dtype=meta.query_start_loc.dtype)
            qsl = torch.cat([nq.new_zeros(1), nq.cumsum(0).to(nq.dtype)])
            seq = torch.tensor([v.s for v in views], dtype=meta.seq_lens.dtype)
            sm = vllm_ops.cpu_attn_get_scheduler_metadata(num_reqs=len(views), seq_lens=seq, query_start_loc=qsl,
                                                          causal=True, dynamic_causal=None, **sched)
            sub = replace(meta, num_actual_tokens=int(qsl[-1]), max_query_len=int(nq.max()), query_start_loc=qsl,
                          max_seq_len=int(seq.max()), seq_lens=seq, block_table=table, scheduler_metadata=sm,
                          causal=True, dynamic_causal=None, views=None, fused=None)
            idx = torch.cat([torch.arange(v.q0 + v.lead, v.q1) for v in views])
        meta.fused = (scratch, sub, starts, idx)
    return meta.fused


class KvposAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend with kvpos's writes, reads and metadata (registered over CPU_ATTN by plugin.register)."""

    @staticmethod
    def get_impl_cls() -> type[KvposAttentionImpl]:
        return KvposAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KvposMetadataBuilder]:
        return KvposMetadataBuilder


def _layer_meta(layer_name: str) -> KvposAttentionMetadata | None:
    """This layer's metadata of the running step (None outside a step with requests)."""
    raw = get_forward_context().attn_metadata
    if isinstance(raw, list):
        fail("kvpos attention", "one metadata dict per step", "micro-batched metadata (a list)",
             "turn off dual-batch overlap / speculative decoding with the kvpos backend")
    meta = raw.get(layer_name) if isinstance(raw, dict) else None
    return meta if isinstance(meta, KvposAttentionMetadata) else None


def _step_rows() -> list:
    """The kvpos connector's layouts of the running step ([] without the connector: every row is vLLM's)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return []
    conn = get_kv_transfer_group()
    step_rows = getattr(conn, "step_rows", None)
    return step_rows() if step_rows is not None else []
