"""RoPE specs from a transformers model or config: the only place kvpos reads a model's rotary module.

Duck-typed on the loaded model (no transformers import at module level; `rope_specs_from_config` imports the model
type's modeling module to build its rotary module from the config alone), so that an engine holding only a config
(the vLLM connector) imports this file without the transformers adapter's attention code.
"""
from __future__ import annotations

from typing import Any

import torch

from kvpos._checks import fail
from kvpos.rope import STATIC_ROPE_TYPES, RopeLayout, RopeSpec, UnsupportedRopeError

__all__ = ["rope_specs_from_model", "rope_specs_from_config", "rotary_modules", "head_dim"]

# transformers model types whose rotate_half pairs adjacent dims (x[..., ::2], x[..., 1::2])
_INTERLEAVED_MODEL_TYPES = frozenset({"cohere", "cohere2", "glm", "glm4", "glm4_moe", "gptj", "codegen"})


def rotary_modules(model: Any) -> list:
    """The model's rotary-embedding modules (class name *RotaryEmbedding or attribute name rotary_emb), in module
    order: the one rule kvpos uses to find them (spec extraction reads the first; the forward hook goes on each)."""
    return [m for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")
            or n.endswith("rotary_emb")]


def _find_rotary(model: Any) -> Any:
    found = rotary_modules(model)
    return found[0] if found else None


def head_dim(config: Any) -> int:
    """The per-head width of a transformers config: its `head_dim` where it states one (Gemma 3: 256, not
    hidden / heads = 160), else hidden_size // num_attention_heads."""
    hd = getattr(config, "head_dim", None)
    if hd:
        return int(hd)
    return int(config.hidden_size // config.num_attention_heads)


def _rope_param(config: Any, layer_type: str | None, key: str, default: Any = None) -> Any:
    rp = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]
    return rp.get(key, default)


def _limit_for(config: Any, rope_type: str, layer_type: str | None, rotary: Any) -> int | None:
    if rope_type in STATIC_ROPE_TYPES:
        return None
    if rope_type == "dynamic":
        return int(getattr(rotary, "original_max_seq_len", None) or config.max_position_embeddings)
    if rope_type == "longrope":
        omp = getattr(config, "original_max_position_embeddings", None) or _rope_param(
            config, layer_type, "original_max_position_embeddings")
        return int(omp)
    raise UnsupportedRopeError(
        f"rope_type: expected one of {sorted(STATIC_ROPE_TYPES | {'dynamic', 'longrope'})}, got {rope_type!r}; "
        "kvpos cannot re-position keys for an encoding it does not know exactly")


# decoder layer types whose state is keys and values at positions (what a PositionedKV holds)
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def rope_specs_from_model(model: Any, angle_dtype: torch.dtype = torch.float32) -> list[RopeSpec]:
    """Build one RopeSpec per decoder layer from a loaded transformers causal LM.

    Reads `inv_freq` / `attention_scaling` from the model's rotary module (per layer type for models such as Gemma3),
    so every scaled rope_type is handled by transformers' own init functions. Raises UnsupportedRopeError for models
    without RoPE (ALiBi, learned absolute positions), M-RoPE, and unknown rope types.
    """
    config = getattr(model, "config", None)
    if config is None:
        fail("model", "a transformers model with .config", type(model).__name__, exc=TypeError)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", "?")
    rotary = _find_rotary(model)
    if rotary is None:
        raise UnsupportedRopeError(
            f"model: expected a RoPE model (a *RotaryEmbedding module), got {type(model).__name__} "
            f"(model_type={model_type!r}) without one; ALiBi and learned absolute positions cannot be re-positioned")
    if getattr(config, "rope_parameters", None) and _rope_param(config, None, "mrope_section"):
        raise UnsupportedRopeError(f"model_type={model_type!r}: M-RoPE (3-D positions) is not supported")
    if getattr(config, "kv_lora_rank", None):
        raise UnsupportedRopeError(
            f"model_type={model_type!r}: multi-head latent attention (kv_lora_rank={config.kv_lora_rank}) rotates only "
            f"a {getattr(config, 'qk_rope_head_dim', '?')}-dim part of keys built from a compressed latent; kvpos's "
            "per-layer RoPE specs do not describe that layout")
    n_layers = int(config.num_hidden_layers)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)
    other = sorted(set(layer_types) - _ATTENTION_LAYER_TYPES)
    if other:
        raise UnsupportedRopeError(
            f"model_type={model_type!r}: layer types {other} keep state other than positioned keys and values "
            "(recurrent, linear or indexed attention); run such hybrid models with transformers' own cache")
    try:
        hd = head_dim(config)
    except RuntimeError as e:       # transformers' AmbiguousGlobalPerLayerAttributeError: head sizes vary by layer
        if "per-layer" not in str(e):
            raise
        raise UnsupportedRopeError(f"model_type={model_type!r}: a heterogeneous config (head sizes that vary by "
                                   "layer) is not supported") from e
    layout = RopeLayout.INTERLEAVED if model_type in _INTERLEAVED_MODEL_TYPES else RopeLayout.HALF
    per_type: dict[str | None, RopeSpec] = {}
    specs = []
    for lt in layer_types:
        key = lt if hasattr(rotary, f"{lt}_inv_freq") else None
        if key not in per_type:
            per_type[key] = _spec_for(rotary, config, key, hd, layout, angle_dtype)
        specs.append(per_type[key])
    return specs


def _spec_for(rotary: Any, config: Any, layer_type: str | None, head_dim: int, layout: RopeLayout,
              angle_dtype: torch.dtype) -> RopeSpec:
    prefix = "" if layer_type is None else f"{layer_type}_"
    rope_type = getattr(rotary, "rope_type", "default")
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type, "default")
    rope_type = str(rope_type)
    # dynamic/longrope rewrite inv_freq in forward; the original (short) set is the one valid below the limit
    inv = getattr(rotary, f"{prefix}original_inv_freq", None)
    if inv is None or rope_type in STATIC_ROPE_TYPES:
        inv = getattr(rotary, f"{prefix}inv_freq", None)
    if not isinstance(inv, torch.Tensor):
        raise UnsupportedRopeError(
            f"model_type={getattr(config, 'model_type', '?')!r}: expected a rotary module with an `inv_freq` buffer, got "
            f"{type(rotary).__name__} without one (e.g. GPT-J's table of sinusoids); kvpos cannot read its frequencies")
    scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
    limit = _limit_for(config, rope_type, layer_type, rotary)
    return RopeSpec(inv_freq=inv.detach().float().cpu(), attention_scaling=scaling, rotary_dim=2 * inv.numel(),
                    head_dim=head_dim, layout=layout, rope_type=rope_type, max_exact_position=limit,
                    angle_dtype=angle_dtype)


def rope_specs_from_config(config: Any, angle_dtype: torch.dtype = torch.float32) -> list:
    """One RopeSpec per layer from a transformers config alone (no weights): the model type's own rotary module is
    built from the config, so every rope_type is computed by transformers' init functions, as for a loaded model.
    For engines that hold the config but not a transformers model (vLLM)."""
    import importlib

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    mt = getattr(text, "model_type", None)
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(str(mt))
    try:
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError as e:
        raise UnsupportedRopeError(f"model_type: expected a transformers architecture, got {mt!r}") from e
    names = [n for n in dir(mod) if n.endswith("RotaryEmbedding") and not n.startswith("_")]
    if not names:
        raise UnsupportedRopeError(f"model_type={mt!r}: expected a *RotaryEmbedding module, got none "
                                   "(no RoPE: learned or ALiBi positions cannot be re-positioned)")
    rotary = getattr(mod, sorted(names, key=len)[0])(config=text)

    class _Shell(torch.nn.Module):
        """What rope_specs_from_model reads: .config and a rotary_emb module."""

        def __init__(self) -> None:
            super().__init__()
            self.config = text
            self.rotary_emb = rotary

    return rope_specs_from_model(_Shell(), angle_dtype=angle_dtype)
