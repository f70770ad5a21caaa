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
ALiBi, quantized KV caches, non-decoder attention, shared-KV layers. This backend is vLLM's CPU build; the CUDA
build gets attention_cuda.KvposFlashBackend (written, not tested in an engine; see there).
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
from kvpos._kernels import decode_paged_kernel, rope_kernel_available
from kvpos.rope import RopeLayout, cos_sin, rotate, rotate_by, unrotate

from .paged import PagedLayout
from .plugin import ENV
from .rows import RowView, row_attention, row_views

__all__ = ["KvposAttentionBackend", "KvposAttentionImpl", "KvposAttentionMetadata", "KvposLayer", "RowView",
           "refuse_unsupported", "row_views"]


@dataclass
class KvposAttentionMetadata(CPUAttentionMetadata):
    """vLLM's CPU metadata plus each token's vLLM position ([T] int64) and, filled at the step's first forward, the
    per-row views (row_views)."""

    positions: torch.Tensor | None = None
    views: list | None = None
    fused: Any = None
    decode: dict | None = None
    angles: dict | None = None


class KvposMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder; keeps the token positions the runner hands it."""

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
              ) -> KvposAttentionMetadata:
        return with_positions(super().build(common_prefix_len, common_attn_metadata, fast_build),
                              common_attn_metadata, KvposAttentionMetadata)


def with_positions(m: Any, common: Any, cls: type) -> Any:
    """vLLM's metadata m as the kvpos subclass cls, with the step's token positions [T] int64 from the runner's
    common metadata (ValueError where the runner hands none)."""
    pos = common.positions
    if pos is None:
        fail("kvpos attention metadata", "the runner's token positions (CommonAttentionMetadata.positions)",
             "None", "this vLLM runner does not hand positions to attention builders; kvpos needs vLLM 0.32")
    return cls(**{f.name: getattr(m, f.name) for f in fields(m)}, positions=pos[:m.num_actual_tokens].to(torch.long))


def refuse_unsupported(num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes: Any,
                       sliding_window: int | None, kv_cache_dtype: str, logits_soft_cap: float | None = None,
                       attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                       sinks: torch.Tensor | None = None) -> None:
    """ValueError naming what a layer asks for that the kvpos backends do not serve (vLLM's impl arguments)."""
    refused = {"sliding windows": sliding_window is not None, "logits soft-capping": bool(logits_soft_cap),
               "attention sinks": sinks is not None, "ALiBi": alibi_slopes is not None,
               "quantized KV caches": kv_cache_dtype != "auto", "shared-KV layers": kv_sharing_target_layer_name,
               "non-decoder attention": attn_type != AttentionType.DECODER}
    bad = [k for k, v in refused.items() if v]
    if bad:
        fail("kvpos attention backend", "a decoder attention layer without " + ", ".join(refused), bad,
             f"unset {ENV} for this model")


class KvposLayer:
    """What both kvpos backends' impls add to vLLM's (mixed in before vLLM's impl class): refusals, the model's RoPE
    specs and this layer's, the paged layout (`layout_cls`: paged.PagedLayout on CPU, flash_layout.FlashLayout on
    CUDA), writes of raw keys (`do_kv_cache_update` un-rotates at vLLM's positions, then vLLM's own write) and the
    step's row views (`_step_views`)."""

    layout_cls: type = PagedLayout
    meta_cls: type = object

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from kvpos.integrations.hf.specs import rope_specs_from_config

        refuse_unsupported(*args, **kwargs)
        super().__init__(*args, **kwargs)
        cfg = get_current_vllm_config()
        self.specs = rope_specs_from_config(cfg.model_config.hf_config)
        self.paged = self.layout_cls(cfg.model_config.dtype)
        self.layer: int | None = None

    def _step_views(self, layer: Any, kv_cache: torch.Tensor, attn_metadata: Any, output_scale: Any,
                    output_block_scale: Any) -> tuple[list, Any] | None:
        """(the step's row views, this layer's RoPE spec); None for vLLM's profiling run (no metadata)."""
        if output_scale is not None or output_block_scale is not None:
            fail("kvpos attention forward", "no fused output quantization", "an output scale")
        if attn_metadata is None:
            return None
        if not isinstance(attn_metadata, self.meta_cls):
            fail("kvpos attention metadata", self.meta_cls.__name__, type(attn_metadata).__name__)
        if attn_metadata.views is None:
            attn_metadata.views = row_views(attn_metadata, kv_cache.shape[2], _step_rows())
        return attn_metadata.views, self._spec(layer)

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


class KvposAttentionImpl(KvposLayer, CPUAttentionBackendImpl):
    """See the module docstring."""

    meta_cls = KvposAttentionMetadata

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, output_scale: Any = None, output_block_scale: Any = None
                ) -> torch.Tensor:
        """query [T, Hq, D] rotated at vLLM's positions; output [T, Hq, D]."""
        step = self._step_views(layer, kv_cache, attn_metadata, output_scale, output_block_scale)
        if step is None:
            return output
        views, spec = step
        if not self.paged.affine(kv_cache):
            for v in views:
                output[v.q0:v.q1] = self._row(query, kv_cache, attn_metadata.positions, v, spec, 0, v.q1 - v.q0)
            return output
        for v in views:                        # the queries vLLM's kernel cannot serve
            if v.lead:
                output[v.q0:v.q0 + v.lead] = self._row(query, kv_cache, attn_metadata.positions, v, spec, 0, v.lead)
        rest = [v for v in views if v.lead < v.q1 - v.q0]
        if rest and all(v.q1 - v.q0 == 1 for v in rest) and self._decodes_paged(kv_cache, spec):
            self._decode_paged(query, kv_cache, attn_metadata, rest, output, spec)
        elif rest:
            self._through_vllm(layer, query, key, value, kv_cache, attn_metadata, output, spec)
        return output

    def _decodes_paged(self, kv_cache: torch.Tensor, spec: Any) -> bool:
        """Whether decode rows can run through kvpos's paged raw-key kernel: float32 cache in an affine layout,
        half-layout RoPE over every dim, the kernel built."""
        return (kv_cache.dtype == torch.float32 and kv_cache.is_contiguous() and spec.layout is RopeLayout.HALF
                and spec.rotary_dim == spec.head_dim and rope_kernel_available() and self.paged.affine(kv_cache))

    def _decode_paged(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: KvposAttentionMetadata,
                      rows: list[RowView], output: torch.Tensor, spec: Any) -> None:
        """One query per row: each row's raw keys read from vLLM's blocks and rotated as they are scored
        (kvpos._kernels.decode_paged_kernel), no copy of the cache; queries turned to their logical positions.
        The rows' tables, lengths and cos / sin are made at the step's first layer (per RoPE spec)."""
        table, lens, cos, sin, idx = _decode_tables(meta, rows, spec)
        q = query[idx]                                                                  # [B, Hq, D]
        logical = [r for r, v in enumerate(rows) if v.logical is not None]
        if logical:
            sub = torch.tensor(logical)
            vq = q[sub][:, :, None]                                                     # [B', Hq, 1, D]
            at = torch.stack([rows[r].logical[-1] for r in logical])
            q = q.clone()
            q[sub] = rotate(unrotate(vq, meta.positions[idx[sub]][:, None], spec), at[:, None], spec
                            )[:, :, 0].to(q.dtype)
        out = decode_paged_kernel(q, kv_cache, table, lens, cos, sin, self.scale, *self.paged.strides(kv_cache))
        if out is None:
            fail("kvpos paged decode", "the paged kernel to serve an eligible step", "None",
                 "report this: _decodes_paged and decode_paged_kernel disagree")
        output[idx] = out.to(output.dtype)

    def _row(self, query: torch.Tensor, kv_cache: torch.Tensor, positions: torch.Tensor, v: RowView, spec: Any,
             a: int, b: int) -> torch.Tensor:
        """The row's queries a..b in torch (rows.row_attention) -> [b - a, Hq, D]."""
        raw, val = self.paged.gather_blocks(kv_cache, v.block_ids, v.s)         # [H, s, D]
        return row_attention(query, positions, v, spec, self.scale, raw, val, a, b)

    def _through_vllm(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kv_cache: torch.Tensor, meta: KvposAttentionMetadata, output: torch.Tensor, spec: Any) -> None:
        """The queries after each row's lead (causal by token index): each row's blocks copied into the step's
        scratch cache (_kernel_batch) and their keys rotated there, in place, to the row's logical positions (the
        unused slots of a last block at position 0: never read), queries turned to theirs, and vLLM's own CPU
        attention kernel over it; output rows written in place."""
        sched = {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_size,
                 "dtype": self.paged.dtype, "sliding_window_size": -1, "isa": layer.isa,
                 "enable_kv_split": vllm_envs.VLLM_CPU_ATTN_SPLIT_KV, "kv_cache_dtype": self.kv_cache_dtype}
        scratch, sub, starts, idx = _kernel_batch(meta, kv_cache, sched)
        q = query if idx is None else query[idx]
        for i, (v, first) in enumerate(zip([v for v in meta.views if v.lead < v.q1 - v.q0], starts)):
            n_blk = v.block_ids.numel()
            kpos = torch.arange(v.s) if v.logical is None else v.logical
            self.paged.copy_blocks(kv_cache, v.block_ids, scratch, first)              # raw keys, values
            keys = self.paged.key_blocks(scratch)[first:first + n_blk]                  # [n, H, bs, D]
            rotate_by(keys, *_block_angles(meta, i, kpos, (n_blk, keys.shape[2]), spec), spec, out=keys)   # in place
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


def _block_angles(meta: KvposAttentionMetadata, i: int, kpos: torch.Tensor, blocks: tuple[int, int], spec: Any
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [n, bs, R/2] of the kernel batch's row i at its key positions kpos [s] int64 laid out in
    blocks = (n, bs) (the slots after s at position 0: never read), made at the step's first layer and reused by
    the others (memoised on the step's metadata per row and RoPE spec)."""
    memo = meta.angles if meta.angles is not None else {}
    meta.angles = memo
    key = (i, spec.identity)
    if key not in memo:
        n_blk, bs = blocks
        pos = torch.cat([kpos, kpos.new_zeros(n_blk * bs - kpos.numel())]).view(n_blk, bs)
        spec.check_positions(pos, "kvpos attention: key positions")
        # stored [n, R/2, bs] (viewed as [n, bs, R/2]): the rotation kernel reads vLLM's token-major keys with them
        memo[key] = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in cos_sin(pos, spec))
    return memo[key]


def _decode_tables(meta: KvposAttentionMetadata, rows: list[RowView], spec: Any) -> tuple:
    """(block table [B, maxb] int64, lengths [B] int64, cos, sin [B, D / 2, smax] float32 scaled, the rows' query
    token indices [B] int64) of a decode step, memoised on the step's metadata per RoPE spec."""
    memo = meta.decode if meta.decode is not None else {}
    meta.decode = memo
    key = spec.identity
    if key not in memo:
        lens = torch.tensor([v.s for v in rows])
        table = torch.zeros(len(rows), max(v.block_ids.numel() for v in rows), dtype=torch.long)
        smax = int(lens.max())
        cos = torch.zeros(len(rows), spec.rotary_dim // 2, smax)
        sin = torch.zeros(len(rows), spec.rotary_dim // 2, smax)
        for r, v in enumerate(rows):
            table[r, :v.block_ids.numel()] = v.block_ids
            c, s = cos_sin(torch.arange(v.s) if v.logical is None else v.logical, spec)   # [s, R/2]
            cos[r, :, :v.s] = c.T * spec.attention_scaling
            sin[r, :, :v.s] = s.T * spec.attention_scaling
        memo[key] = (table, lens, cos, sin, torch.tensor([v.q0 for v in rows]))
    return memo[key]


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
            sub, idx = replace(meta, block_table=table, views=None, fused=None, decode=None, angles=None), None
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
                          causal=True, dynamic_causal=None, views=None, fused=None, decode=None, angles=None)
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


def _layer_meta(layer_name: str) -> Any:
    """This layer's kvpos metadata of the running step (None outside a step with requests)."""
    raw = get_forward_context().attn_metadata
    if isinstance(raw, list):
        fail("kvpos attention", "one metadata dict per step", "micro-batched metadata (a list)",
             "turn off dual-batch overlap / speculative decoding with the kvpos backend")
    meta = raw.get(layer_name) if isinstance(raw, dict) else None
    return meta if hasattr(meta, "views") and hasattr(meta, "positions") else None


def _step_rows() -> list:
    """The kvpos connector's layouts of the running step ([] without the connector: every row is vLLM's)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return []
    conn = get_kv_transfer_group()
    step_rows = getattr(conn, "step_rows", None)
    return step_rows() if step_rows is not None else []
