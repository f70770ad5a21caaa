"""Fingerprints: what makes stored KV valid for a model (config, every weight, dtype, anchor, RoPE, format)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Iterable

import torch

from .._checks import fail
from .errors import CorruptChunkError


FORMAT_VERSION = 2   # 2: the checksum covers metadata too (format 1 entries are refused as unverifiable)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ids_digest(ids: torch.Tensor) -> str:
    """sha256 of int64 token ids (the content address of a chunk or an anchor)."""
    return _sha(torch.as_tensor(ids, dtype=torch.long).flatten().numpy().tobytes())


@dataclass(frozen=True)
class Fingerprint:
    """Identity of everything a chunk's KV depends on besides its own tokens."""

    model: str       # sha256 of the model config
    weights: str     # tensors_digest of every parameter and buffer (shape, dtype, all bytes; tied copies once)
    dtype: str
    anchor: str      # sha256 of the anchor prefix ids
    rope: str        # sha256 of the per-layer RoPE specs
    format: int = FORMAT_VERSION

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "Fingerprint":
        """Strict parse: a JSON object with exactly the fields, strings and an int format; CorruptChunkError else."""
        try:
            d = json.loads(s)
        except (TypeError, ValueError) as e:
            raise CorruptChunkError(f"fingerprint: expected JSON, got {str(s)[:80]!r}") from e
        want = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) != want:
            raise CorruptChunkError(f"fingerprint: expected a JSON object with keys {sorted(want)}, got "
                                    f"{sorted(d) if isinstance(d, dict) else type(d).__name__}")
        if not all(isinstance(d[k], str) for k in want - {"format"}) or type(d["format"]) is not int:
            raise CorruptChunkError("fingerprint: expected string fields and an int format, got other types")
        return cls(**d)

    def short(self) -> str:
        return (f"model={self.model[:10]} weights={self.weights[:10]} dtype={self.dtype} anchor={self.anchor[:10]} "
                f"rope={self.rope[:10]} format={self.format}")

    def with_anchor(self, anchor_ids: torch.Tensor) -> "Fingerprint":
        return replace(self, anchor=ids_digest(anchor_ids))


_CONFIG_VOLATILE = ("_name_or_path", "transformers_version", "_attn_implementation", "_attn_implementation_internal",
                    "dtype", "torch_dtype", "_commit_hash", "architectures", "quantization_config")


def config_digest(config: Any) -> str:
    """sha256 of a model config without the fields that name where it came from (path, library version, how weights
    were stored on disk): the same model loaded from GGUF, from a folder, by another transformers version digests
    the same."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    for k in _CONFIG_VOLATILE:
        d.pop(k, None)
    return _sha(json.dumps(d, sort_keys=True, default=str).encode())


def tensors_digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 over a set of tensors by content: each tensor's shape, dtype and bytes are hashed, identical tensors
    (tied weights) count once, names and order do not matter. A model in memory and its checkpoint on disk
    (save_pretrained drops tied copies and may rename) digest the same."""
    parts = set()
    for t in tensors:
        flat = t.detach().reshape(-1).contiguous().cpu()
        h = hashlib.sha256(f"{tuple(t.shape)}:{t.dtype}:".encode())
        if flat.numel():
            h.update(memoryview(flat.view(torch.uint8).numpy()))
        parts.add(h.hexdigest())
    return _sha("".join(sorted(parts)).encode())


def checkpoint_digest(folder: str) -> str:
    """tensors_digest of every tensor in a folder's *.safetensors files (what an engine loads), read one at a time."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        fail("checkpoint_digest folder", "*.safetensors files", f"none in {folder}")

    def tensors():
        for f in files:
            with safe_open(os.path.join(folder, f), framework="pt") as fh:
                for k in fh.keys():
                    yield fh.get_tensor(k)

    return tensors_digest(tensors())


class WeightsDigest:
    """sha256 over every parameter and buffer of a model (name, shape, dtype and ALL bytes), recomputed only when
    a tensor changed.

    A change is seen through each tensor's version counter (every in-place write through autograd-visible
    operations: load_state_dict, optimizer steps, `param.copy_`, indexed assignment under no_grad), its storage
    pointer and its shape; checking costs O(#tensors). Writes through `tensor.data` bypass the version counter:
    call `refresh()` after those."""

    def __init__(self, model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.Module):
            fail("WeightsDigest model", "a torch.nn.Module", type(model).__name__, exc=TypeError)
        self.model = model
        self._state: tuple | None = None
        self._digest: str | None = None
        self.computations = 0

    def _observed(self) -> tuple:
        sd = self.model.state_dict(keep_vars=True)
        return tuple((k, t.data_ptr(), t._version, tuple(t.shape), t.dtype) for k, t in sd.items())

    @torch.no_grad()
    def _compute(self) -> str:
        self.computations += 1
        return tensors_digest(self.model.state_dict().values())

    def refresh(self) -> str:
        """Recompute now (after writes through `.data`)."""
        self._state = None
        return self.digest()

    def digest(self) -> str:
        state = self._observed()
        if state != self._state or self._digest is None:
            self._digest = self._compute()
            self._state = state
        return self._digest

    def changed(self) -> bool:
        """True when a tensor changed since the last digest (the next digest() recomputes)."""
        return self._observed() != self._state


def rope_digest(specs: Iterable[Any]) -> str:
    """sha256 of the per-layer RoPE specs (their describe())."""
    return _sha(json.dumps([s.describe() for s in specs], sort_keys=True).encode())


def model_fingerprint(model: torch.nn.Module, anchor_ids: torch.Tensor, specs: Iterable[Any] = (),
                      weights: WeightsDigest | None = None) -> Fingerprint:
    """Fingerprint of (model config, every weight, dtype, anchor ids, RoPE specs, kvpos format). Pass a
    WeightsDigest to reuse its hash (recomputed only when a weight changed)."""
    w = (weights if weights is not None else WeightsDigest(model)).digest()
    cfg = getattr(model, "config", None)
    rope = rope_digest(specs)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return Fingerprint(config_digest(cfg) if cfg is not None else "none", w, dtype, ids_digest(anchor_ids), rope)
