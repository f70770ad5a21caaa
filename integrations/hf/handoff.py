"""The raw-key hand-off check: at `from_model`, does this model's attention read the raw keys the cache hands it
exactly (a 4-token prefill and one decode step against the buffer path)?"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvpos._kernels import kernel_status, rope_kernel_available

from .attention import uses_kvpos_attention

if TYPE_CHECKING:
    from .cache import PositionedCache


def check_raw_handoff(model: torch.nn.Module, cache: PositionedCache) -> str | None:
    """Why decode steps of `cache` (storage "raw" / "int8") may not hand raw keys to `model`'s attention, or None.

    Decided by trying it, not by a list of architectures: a 4-token prefill at positions ~100 and one decode step
    through two empty caches like `cache`, one handing raw keys to the "kvpos" attention (the fused reader) and one
    rotating them into a buffer (read="torch", exact for every architecture). The hand-off is exact when the decode
    logits agree within rounding (an attention that reads the keys unrotated misses by O(1)) and every layer's
    attention took the keys and values the cache returned, once. No model state changes (the caches are dropped)."""
    why = _why_not_handoff_model(model, cache)
    if why is not None:
        return why
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    limits = [s.max_exact_position for s in cache.specs if s.max_exact_position is not None]
    base = max(0, min([96] + [m - 8 for m in limits]))
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = (torch.arange(5, device=dev) * 7 + 3) % max(vocab, 1)
    pos = torch.arange(base, base + 5, device=dev)[None]
    out = {}
    for mode in ("torch", "handoff"):
        probe = type(cache)(cache.specs, cache.raw_dtype, cache.origin, cache.model_id, storage=cache.storage,
                            read="torch" if mode == "torch" else "auto")
        try:
            with torch.no_grad():
                model(input_ids=ids[None, :4], position_ids=pos[:, :4], use_cache=True, **{_cache_kwarg(model): probe})
                logits = model(input_ids=ids[None, 4:], position_ids=pos[:, 4:], use_cache=True,
                               **{_cache_kwarg(model): probe}).logits[0, -1].float()
        except Exception as e:  # noqa: BLE001 - any failure of the hand-off means it is not for this model
            return f"a decode step with raw keys handed to attention raised {type(e).__name__}: {str(e)[:160]}"
        if mode == "handoff" and probe.read_counts["fused"] != len(cache.layers):
            return (f"{probe.read_counts['fused']} of {len(cache.layers)} layers' attention read the raw keys "
                    f"through the fused kernel ({probe.read_counts})")
        out[mode], dtype = logits, probe.dtype
    diff = float((out["handoff"] - out["torch"]).abs().max())
    tol = (1e-3 if dtype == torch.float32 else 5e-2) * max(1.0, float(out["torch"].abs().max()))
    if not diff <= tol:
        return (f"decode logits with the raw-key hand-off differ from the rotated-key reference by {diff:.3g} "
                f"(> {tol:.2g}): the architecture's attention does not read the keys as the cache hands them out")
    return None


def _why_not_handoff_model(model: torch.nn.Module, cache: PositionedCache) -> str | None:
    """Reasons known without running the model (the kernels, the attention implementation)."""
    if not rope_kernel_available():
        return f"the C kernels are not built ({kernel_status()})"
    if not uses_kvpos_attention(model):
        return "the model's attention is not 'kvpos' (build the cache with from_model on an SDPA model)"
    return None


def _cache_kwarg(model: torch.nn.Module) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
