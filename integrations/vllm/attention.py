"""kvpos as vLLM's attention (CPU): raw keys in the engine's paged cache, each request's logical positions applied
in attention.

Enabled by configuration, off by default: KVPOS_VLLM_ATTENTION=1 in the environment of the vLLM processes (the
plugin, plugin.py, then registers KvposAttentionBackend in place of CPU_ATTN) and
`engine_kwargs(..., attention=True)` (the connector loads and saves raw keys and accepts non-sequential layouts).

Letters: T tokens of the step · s a request's tokens so far · q its tokens in this step · H kv heads · Hq query
heads · D head dim.

Writes (`do_kv_cache_update`): the model rotated the step's keys at vLLM's positions (token indices); they are
un-rotated there with the model's RoPE spec (kvpos.rope.unrotate) and written raw. Reads (`forward`): per batch
row, the request's raw keys and values [H, s, D] are gathered through its block table, the keys rotated to the
request's logical positions, the queries turned from vLLM's positions to their logical ones, and attention runs
under the request's visibility (torch's fused CPU attention; with APE, kvpos.ape.ape_attend over the passages). A
row without a kvpos layout has logical = vLLM positions and a causal mask: vLLM's own attention, up to rounding.

A request's layout reaches the worker through the kvpos connector's step metadata (scheduler.RowLayout); its batch
row is the one whose last scheduled token is written to a block the request holds (a block being written belongs to
one request: vLLM shares only full blocks).

Refused at engine start (ValueError naming the feature): sliding windows, logits soft-capping, attention sinks,
ALiBi, quantized KV caches, non-decoder attention, shared-KV layers. The CUDA build of vLLM selects its backends
through another platform hook; this backend is written for and tested on the CPU build only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

import torch
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
    """One batch row: query tokens [q0, q1) of the step, s tokens of the request so far, the blocks holding them in
    order ([ceil(s / block size)] int64), and, for a kvpos layout, logical positions [s] int64 and visibility of the
    row's queries [q, s] bool (None: vLLM's positions, causal); with APE its (temperature, scale) and which tokens
    are passages [s] bool."""

    q0: int
    q1: int
    s: int
    block_ids: torch.Tensor
    logical: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    ape: tuple[float, float] | None = None
    is_ctx: torch.Tensor | None = None


def _layout_positions(anchor_len: int, lengths: list[int], layout: str, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logical positions [s], visibility [s, s]) of the first s tokens of a request with this layout: the
    anchor, the passages (kvpos.compose.plan_layout), then the question and generated tokens after them."""
    plan = plan_layout(anchor_len, lengths, layout)
    P = plan.num_slots
    pieces = [torch.arange(anchor_len)] + [plan.positions(i) for i in range(len(lengths))]
    tail = torch.arange(plan.next_position, plan.next_position + max(0, s - P))
    logical = torch.cat(pieces + [tail])[:s]
    return logical, plan.allowed(max(0, s - P))[:s, :s]


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
        v = RowView(q0, q1, s, meta.block_table[i][:-(-s // block_size)].to(torch.long))
        last = int(meta.slot_mapping[q1 - 1]) // block_size
        r = by_block.get(last)
        if r is not None:
            logical, allowed = _layout_positions(r.anchor_len, r.lengths, r.layout, s)
            v.logical, v.allowed = logical, allowed[s - (q1 - q0):]
            if r.ape is not None:
                v.ape = tuple(r.ape)
                v.is_ctx = (t >= r.anchor_len) & (t < r.anchor_len + sum(r.lengths))
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
        for v in attn_metadata.views:
            output[v.q0:v.q1] = self._row(query[v.q0:v.q1], kv_cache, attn_metadata.positions[v.q0:v.q1], v, spec)
        return output

    def _row(self, q: torch.Tensor, kv_cache: torch.Tensor, vpos: torch.Tensor, v: RowView, spec: Any
             ) -> torch.Tensor:
        """Attention of one row's queries q [q, Hq, D] (rotated at vLLM positions vpos [q]) -> [q, Hq, D]."""
        raw, val = self.paged.gather_blocks(kv_cache, v.block_ids, v.s)         # [H, s, D]
        n = q.shape[0]
        qh = q.transpose(0, 1)[None]                                            # [1, Hq, q, D]
        if v.logical is None:
            kpos, mask = torch.arange(v.s), None
        else:
            kpos, mask = v.logical, v.allowed
            qh = rotate(unrotate(qh, vpos, spec), kpos[v.s - n:], spec)
        k = rotate(raw[None], kpos, spec)                                       # [1, H, s, D]
        if v.ape is not None:                                                   # APE over the passages
            out = ape_attend(qh, k, val[None], mask[None, None], v.is_ctx[None], self.scale, v.ape[0],
                             v.ape[1], q_is_ctx=v.is_ctx[v.s - n:][None])       # [1, Hq, q, D]
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
