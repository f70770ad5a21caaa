"""kvpos as vLLM's attention on CUDA (vLLM's `vllm` build, FLASH_ATTN replaced): WRITTEN, NOT TESTED IN AN ENGINE.

The project's machines have no GPU and run vLLM's CPU build; the CUDA build of vLLM cannot be installed where a GPU
was lent (no package registry there). What is tested: on CPU, this module imports against vLLM 0.32's FlashAttention
classes and refuses what the CPU backend refuses (tests/vllm/test_attention.py); the read path it shares with the
CPU backend (rows.py: row views, positions, torch attention) and the FlashAttention block layout
(flash_layout.FlashLayout) on CPU in the test suite and, where a GPU was lent, on CUDA tensors against a float64
reference (experiments/cuda_rows_check.py). What is not: an engine start, vLLM's CUDA graphs (this backend's builder
asks for none), the connector's loads into a CUDA cache (the worker picks FlashLayout for CUDA tensors; untried).

Same contract as the CPU backend (attention.py): keys enter the paged cache un-rotated at vLLM's positions; per
batch row the request's raw keys and values are read in token order, the keys rotated to the request's logical
positions, the queries turned to theirs, and attention runs in torch (scaled_dot_product_attention, which picks its
fused CUDA kernels) under the request's visibility; APE through kvpos.ape.ape_attend. There is no fast path through
vLLM's FlashAttention kernel yet (the CPU backend's `_kernel_batch` idea: rotated keys into a per-step scratch).

    KVPOS_VLLM_ATTENTION=1 vllm serve ...  # the plugin registers KvposFlashBackend over FLASH_ATTN on CUDA
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadata, FlashAttentionMetadataBuilder)

from .attention import KvposLayer, with_positions
from .flash_layout import FlashLayout
from .rows import row_attention

__all__ = ["KvposFlashBackend", "KvposFlashImpl", "KvposFlashMetadata"]


@dataclass
class KvposFlashMetadata(FlashAttentionMetadata):
    """vLLM's FlashAttention metadata plus each token's vLLM position ([T] int64) and the step's row views."""

    positions: torch.Tensor | None = None
    views: list | None = None


class KvposFlashBuilder(FlashAttentionMetadataBuilder):
    """vLLM's FlashAttention builder; keeps the token positions; no CUDA graphs (rows are read in Python)."""

    _cudagraph_support = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, *args: Any, **kwargs: Any) -> AttentionCGSupport:
        return AttentionCGSupport.NEVER

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
              ) -> KvposFlashMetadata:
        return with_positions(super().build(common_prefix_len, common_attn_metadata, fast_build),
                              common_attn_metadata, KvposFlashMetadata)


class KvposFlashImpl(KvposLayer, FlashAttentionImpl):
    """See the module docstring."""

    layout_cls = FlashLayout
    meta_cls = KvposFlashMetadata

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, output_scale: Any = None, output_block_scale: Any = None
                ) -> torch.Tensor:
        """query [T, Hq, D] rotated at vLLM's positions; output [T, Hq, D]."""
        step = self._step_views(layer, kv_cache, attn_metadata, output_scale, output_block_scale)
        if step is None:                                            # vLLM's profiling run
            return output.fill_(0)
        views, spec = step
        for v in views:
            raw, val = self.paged.gather_blocks(kv_cache, v.block_ids, v.s)          # [H, s, D]
            output[v.q0:v.q1] = row_attention(query, attn_metadata.positions, v, spec, self.scale, raw, val, 0,
                                              v.q1 - v.q0).reshape(output[v.q0:v.q1].shape)
        return output


class KvposFlashBackend(FlashAttentionBackend):
    """vLLM's FlashAttention backend with kvpos's writes, reads and metadata (registered over FLASH_ATTN by
    plugin.register on CUDA)."""

    @staticmethod
    def get_impl_cls() -> type[KvposFlashImpl]:
        return KvposFlashImpl

    @staticmethod
    def get_builder_cls() -> type[KvposFlashBuilder]:
        return KvposFlashBuilder
