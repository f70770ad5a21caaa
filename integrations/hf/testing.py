"""Tiny randomly initialised transformers models, one per RoPE variant kvpos supports (for tests and examples).

Every model has 2 layers, hidden 64, 4 query heads and 2 KV heads (GQA) unless the architecture forbids it; they
build in milliseconds, offline. Weights use initializer_range=0.2 (not transformers' 0.02): with 0.02 attention is
nearly uniform and moving a token by one position changes logits by ~1e-4, which would let a wrong position pass a
1e-4 test. At 0.2 an off-by-one position changes logits by 2-6. `TINY_ARCHS` names them; `tiny_model(name)` returns (model, config).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
import transformers as T

__all__ = ["TINY_ARCHS", "LIMITED_ARCHS", "tiny_model", "tiny_config", "causal_lm_types", "sweep_model"]

_COMMON = MappingProxyType(dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0))


def _rp(rope_type: str = "default", theta: float = 10000.0, **kw: Any) -> dict:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": theta, **kw}}


# name -> (config class, extra kwargs)
_SPECS: Mapping[str, tuple[Callable, dict]] = MappingProxyType({
    "llama": (T.LlamaConfig, _rp()),
    "llama_linear": (T.LlamaConfig, _rp("linear", factor=2.0)),
    "llama_yarn": (T.LlamaConfig, _rp("yarn", factor=4.0, original_max_position_embeddings=128)),
    "llama3": (T.LlamaConfig, _rp("llama3", 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=64)),
    "qwen2": (T.Qwen2Config, _rp(theta=1e6)),
    "qwen3": (T.Qwen3Config, {"head_dim": 16, **_rp(theta=1e6)}),
    "mistral": (T.MistralConfig, {"sliding_window": None, **_rp()}),
    "gemma": (T.GemmaConfig, {"head_dim": 16, **_rp()}),
    "gemma3": (T.Gemma3TextConfig, {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": (T.Phi3Config, _rp(partial_rotary_factor=0.5)),
    "gpt_neox": (T.GPTNeoXConfig, _rp(partial_rotary_factor=0.25)),
    "cohere": (T.CohereConfig, _rp()),
    "glm": (T.GlmConfig, {"head_dim": 16, **_rp(partial_rotary_factor=0.5)}),
    "stablelm": (T.StableLmConfig, _rp(partial_rotary_factor=0.25)),
})
# models whose frequencies change with length: supported below a limit, refused beyond it
_LIMITED: Mapping[str, tuple[Callable, dict]] = MappingProxyType({
    "llama_dynamic": (T.LlamaConfig, {**_rp("dynamic", factor=2.0), "max_position_embeddings": 64}),
    "phi3_longrope": (T.Phi3Config, {"original_max_position_embeddings": 64, **_rp(
        "longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8, original_max_position_embeddings=64)}),
})

TINY_ARCHS = tuple(_SPECS)
LIMITED_ARCHS = tuple(_LIMITED)


def tiny_config(name: str, **overrides: Any) -> Any:
    """The config of tiny model `name` (see TINY_ARCHS / LIMITED_ARCHS), with keyword overrides."""
    table = {**_SPECS, **_LIMITED}
    if name not in table:
        raise ValueError(f"tiny_model name: expected one of {sorted(table)}, got {name!r}")
    cls, extra = table[name]
    kw = {**_COMMON, **extra, **overrides}
    if cls is T.GPTNeoXConfig:
        kw.pop("num_key_value_heads", None)  # GPT-NeoX has no GQA
    return cls(**kw)


def tiny_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> tuple[Any, Any]:
    """(model in eval mode, config) for tiny architecture `name`, weights from `seed`."""
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = tiny_config(name, **overrides)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return model, cfg


# -- every causal-LM architecture transformers ships, built small with one generic set of overrides ------------------
_SWEEP = MappingProxyType(dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, head_dim=16, bos_token_id=1,
    eos_token_id=2, pad_token_id=0, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
    num_experts_per_tok=2, n_routed_experts=4, shared_expert_intermediate_size=32, kv_channels=16,
    ffn_hidden_size=128, n_shared_experts=1, sliding_window=512, attention_dropout=0.0, tie_word_embeddings=False))


def causal_lm_types() -> dict[str, str]:
    """{model_type: causal-LM class name} for every architecture of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def sweep_model(model_type: str, seed: int = 0) -> Any:
    """The causal LM of `model_type` built from its default config with small generic overrides (2 layers, hidden
    64, 4 query / 2 kv heads of 16, vocab 128, MoE and window sizes small), SDPA attention, eval mode. Raises
    whatever the config or the model raises when the generic overrides do not fit the architecture."""
    import logging

    from transformers import CONFIG_MAPPING

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cls = getattr(T, causal_lm_types()[model_type])
    cfg = CONFIG_MAPPING[model_type](**_SWEEP)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        model.set_attn_implementation("sdpa")
    return model
