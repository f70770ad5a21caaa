"""ChunkStore: a chunk's KV (raw keys + values) computed once, kept under a content key, checked by a fingerprint.

Letters: L layers · H kv heads · S chunk tokens · D head_dim.

An entry holds, for one chunk of token ids encoded after an anchor prefix:

    ids       [S]           int64 token ids (the content)
    raw_keys  [L, H, S, D]  keys before RoPE, model dtype (stored under the tensor name "keys")
    values    [L, H, S, D]  values
    start     int           the position of the chunk's first token when it was encoded (= anchor length)
    fingerprint             model config, every weight, dtype, anchor ids, RoPE, kvpos format version
    meta      dict          free JSON

Keys are content addresses: namespace + sha256 of the token ids. The fingerprint is not part of the key: an entry
made by another model, dtype, weights or anchor is found and *refused* with an error that names both fingerprints
(or recomputed, with on_mismatch="recompute"), never silently used. Use one namespace per model to share a store.

Every byte of a stored entry is verified before use: the checksum covers the tensors (name, dtype, shape, bytes)
AND the metadata (format, start, fingerprint, meta); the header must parse into exactly the expected fields and
types; keys and values, as served (dequantized), must be finite. Any damage surfaces as CorruptChunkError; the store then drops the entry and the caller recomputes it. Nothing
is ever pickled or evaluated. Keys and namespaces are validated, so no input reaches a path outside a DiskBackend's
root.

Backends (all store one self-describing safetensors blob per entry):
  MemoryBackend  LRU with a byte budget, never exceeded
  DiskBackend    one file per entry under its root, written to a temp file then renamed (atomic)
  RedisBackend   a redis-server shared by processes/machines; SET of one blob (atomic); every server-side failure
                 is a StoreUnavailable (StoreServerError for errors the server answered with)
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import struct
import tempfile
import threading
from collections import OrderedDict
from types import MappingProxyType
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable, Protocol

import torch

from ._checks import fail

__all__ = [
    "ChunkKV", "Fingerprint", "ChunkStore", "MemoryBackend", "DiskBackend", "RedisBackend", "TieredBackend",
    "StoreStats",
    "FingerprintMismatch", "CorruptChunkError", "StoreUnavailable", "StoreServerError", "content_key",
    "model_fingerprint", "WeightsDigest", "serialize", "deserialize", "FORMAT_VERSION", "check_key",
    "check_namespace", "tensors_digest", "checkpoint_digest", "rope_digest", "config_digest", "SCHEMES",
    "quantize_int8", "dequantize_int8", "quantize_int4", "dequantize_int4", "INT4_GROUP", "header_fingerprint",
    "header_length",
]

FORMAT_VERSION = 2   # 2: the checksum covers metadata too (format 1 entries are refused as unverifiable)
_META_KEYS = frozenset({"format", "start", "fingerprint", "meta", "checksum"})
_MAX_HEADER = 1 << 20
# How an entry holds its keys and values. "float": as computed (entries without a scheme field are "float").
# "int8": keys int8 per channel (one scale per layer, head and channel over the chunk's tokens, taken BEFORE RoPE
# where a channel's outliers stay in that channel), values int8 per token (one scale per layer, head and token);
# read back as the dtype they were computed in. 0.27x the bytes of a float32 entry (0.53x of bfloat16).
# "int4": 4-bit codes, asymmetric (a scale and a minimum per group), two per byte: keys per channel over groups of
# INT4_GROUP tokens (before RoPE, as int8), values per token over groups of INT4_GROUP channels. 0.16x of float32.
SCHEMES = ("float", "int8", "int4")
INT4_GROUP = 64
_FLOAT_DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})
_TENSORS = MappingProxyType({"float": frozenset({"ids", "keys", "values"}),
                             "int8": frozenset({"ids", "keys", "values", "keys_scale", "values_scale"}),
                             "int4": frozenset({"ids", "keys", "values", "keys_scale", "values_scale", "keys_min",
                                                "values_min"})})
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_UNKNOWN = object()   # peek of a far backend that can only say "exists": the fingerprint is checked by get


class FingerprintMismatch(ValueError):
    """A stored chunk was computed under another model / weights / dtype / anchor / format."""


class CorruptChunkError(ValueError):
    """A stored entry is truncated, altered, crafted or unreadable."""


class StoreUnavailable(ConnectionError):
    """The backend (e.g. redis-server) cannot serve the request: unreachable, timed out, or failing."""


class StoreServerError(StoreUnavailable):
    """The server answered with an error (out of memory under noeviction, read-only replica, ...)."""


# ---------------------------------------------------------------------------------------------------------------------
# names: what may become a key or a path
# ---------------------------------------------------------------------------------------------------------------------

def check_namespace(namespace: Any) -> str:
    """A namespace: 1-64 characters of [A-Za-z0-9._-], starting with a letter or digit, no '..'."""
    if not isinstance(namespace, str) or not _NAME.fullmatch(namespace) or len(namespace) > 64 or ".." in namespace:
        fail("namespace", "1-64 characters of [A-Za-z0-9._-] starting with a letter or digit, without '..'",
             repr(namespace), "namespaces become part of storage keys and file names")
    return namespace


def check_key(key: Any) -> str:
    """A storage key: 1-200 characters of [A-Za-z0-9._-], starting with a letter or digit, no '..'."""
    if not isinstance(key, str) or not _NAME.fullmatch(key) or ".." in key:
        fail("store key", "1-200 characters of [A-Za-z0-9._-] starting with a letter or digit, without '..'",
             repr(key)[:80], "keys come from content_key(ids, namespace)")
    return key


# ---------------------------------------------------------------------------------------------------------------------
# fingerprints
# ---------------------------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------------------------
# entries
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class ChunkKV:
    """One chunk's KV: ids [S], raw_keys / values [L, H, S, D] (keys before RoPE), encoded at positions
    start..start+S-1."""

    ids: torch.Tensor
    raw_keys: torch.Tensor
    values: torch.Tensor
    start: int
    fingerprint: Fingerprint
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for what in ("ids", "raw_keys", "values"):
            if not isinstance(getattr(self, what), torch.Tensor):
                fail(f"ChunkKV.{what}", "a torch.Tensor", type(getattr(self, what)).__name__, exc=TypeError)
        if self.raw_keys.dim() != 4 or not self.raw_keys.is_floating_point():
            fail("ChunkKV.raw_keys", "a floating [L, H, S, D] tensor", f"{tuple(self.raw_keys.shape)} "
                 f"{self.raw_keys.dtype}")
        if self.values.dim() != 4 or self.values.shape[:3] != self.raw_keys.shape[:3] \
                or self.values.dtype != self.raw_keys.dtype:
            fail("ChunkKV.values", f"[L, H, S, Dv] {self.raw_keys.dtype} with L, H, S of raw_keys "
                 f"{tuple(self.raw_keys.shape)}", f"{tuple(self.values.shape)} {self.values.dtype}")
        if self.ids.dim() != 1 or self.ids.dtype != torch.long or self.ids.numel() != self.raw_keys.shape[-2]:
            fail("ChunkKV.ids", f"[S]={self.raw_keys.shape[-2]} int64 token ids",
                 f"{tuple(self.ids.shape)} {self.ids.dtype}")
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            fail("ChunkKV.start", "an int >= 0", self.start)
        if not isinstance(self.fingerprint, Fingerprint):
            fail("ChunkKV.fingerprint", "a Fingerprint", type(self.fingerprint).__name__, exc=TypeError)
        if not isinstance(self.meta, dict):
            fail("ChunkKV.meta", "a dict", type(self.meta).__name__, exc=TypeError)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.raw_keys, self.values))

    @classmethod
    def from_raw_kv(cls, ids: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], start: int,
                    fingerprint: "Fingerprint", meta: dict | None = None) -> "ChunkKV":
        """A chunk from per-layer (raw_keys [1, H, S, D], values [1, H, S, D]), e.g. PositionedKV.raw_kv(a, b)."""
        keys = torch.stack([k[0] for k, _ in kv]).contiguous()
        values = torch.stack([v[0] for _, v in kv]).contiguous()
        return cls(torch.as_tensor(ids, dtype=torch.long).flatten().clone(), keys, values, start, fingerprint,
                   dict(meta or {}))

    def layer_kv(self, start: int = 0, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (raw_keys [1, H, s, D], values [1, H, s, D]) of tokens [start, end): views, no copy."""
        end = self.num_tokens if end is None else end
        return [(self.raw_keys[i, None, :, start:end], self.values[i, None, :, start:end])
                for i in range(self.raw_keys.shape[0])]


def _checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """sha256 over the metadata fields (all but the checksum, canonical JSON) and every tensor's name, dtype,
    shape and bytes."""
    h = hashlib.sha256()
    h.update(json.dumps({k: meta[k] for k in sorted(meta) if k != "checksum"}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
    return h.hexdigest()


def check_scheme(scheme: Any, what: str = "scheme") -> str:
    if scheme not in SCHEMES:
        fail(what, " or ".join(repr(x) for x in SCHEMES), repr(scheme))
    return scheme


def quantize_int8(raw_keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """raw_keys [L, H, S, D], values [L, H, S, Dv] -> int8 keys with keys_scale [L, H, 1, D] (per channel over the
    tokens) and int8 values with values_scale [L, H, S, 1] (per token); symmetric, round to nearest, float32 scales.
    A zero channel / token gets scale 0 (dequantizes to exact zeros)."""
    out = {}
    for name, x, dim in (("keys", raw_keys, 2), ("values", values, 3)):
        xf = x.float()
        scale = xf.abs().amax(dim=dim, keepdim=True) / 127.0
        q = torch.where(scale > 0, xf / torch.where(scale > 0, scale, 1.0), 0.0).round_().clamp_(-127, 127)
        out[name], out[f"{name}_scale"] = q.to(torch.int8).contiguous(), scale.contiguous()
    return out


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [..] * scale (broadcast, float32), rounded once to `dtype`."""
    return (q.float() * scale).to(dtype)


def _groups(x: torch.Tensor, dim: int, g: int) -> torch.Tensor:
    """x [L, H, S, D] float32 -> groups of `g` along `dim` (2: tokens, 3: channels), the last group padded with
    copies of the last entry (padding never widens a group's range): dim 2: [L, H, S/g, g, D]; dim 3: [L, H, S, D/g, g]."""
    n = x.shape[dim]
    pad = (-n) % g
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.narrow(dim, n - 1, 1).expand(shape)], dim)
    L, H = x.shape[:2]
    if dim == 2:
        return x.reshape(L, H, -1, g, x.shape[3])
    return x.reshape(L, H, x.shape[2], -1, g)


def quantize_int4(raw_keys: torch.Tensor, values: torch.Tensor, group: int = INT4_GROUP) -> dict[str, torch.Tensor]:
    """raw_keys [L, H, S, D], values [L, H, S, Dv] (D, Dv even) -> 4-bit codes packed two per byte, uint8
    [L, H, S, D/2]; keys per channel over groups of `group` tokens (keys_scale / keys_min [L, H, ceil(S/g), D]),
    values per token over groups of `group` channels (values_scale / values_min [L, H, S, ceil(Dv/g)]). Asymmetric:
    x ~ min + code * scale with code in 0..15, round to nearest; float32 scales and minimums."""
    out = {}
    for name, x, dim in (("keys", raw_keys, 2), ("values", values, 3)):
        if x.shape[-1] % 2:
            fail(f"quantize_int4 {name}", "an even last dimension (two codes per byte)", tuple(x.shape))
        n = x.shape[dim]
        xg = _groups(x.float(), dim, group)
        red = dim + 1                                            # the within-group axis of either layout
        lo, hi = xg.amin(dim=red, keepdim=True), xg.amax(dim=red, keepdim=True)
        scale = (hi - lo) / 15.0
        code = torch.where(scale > 0, (xg - lo) / torch.where(scale > 0, scale, 1.0), 0.0).round_().clamp_(0, 15)
        L, H = x.shape[:2]
        if dim == 2:
            code = code.reshape(L, H, -1, x.shape[3])[:, :, :n]
            out[f"{name}_scale"], out[f"{name}_min"] = scale[:, :, :, 0].contiguous(), lo[:, :, :, 0].contiguous()
        else:
            code = code.reshape(L, H, x.shape[2], -1)[..., :n]
            out[f"{name}_scale"], out[f"{name}_min"] = scale[..., 0].contiguous(), lo[..., 0].contiguous()
        c = code.to(torch.uint8)
        out[name] = (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()
    return out


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dim: int, dtype: torch.dtype,
                    group: int = INT4_GROUP) -> torch.Tensor:
    """Packed codes q uint8 [L, H, S, D/2] with per-group scale / min (see quantize_int4; dim 2 = keys' token
    groups, 3 = values' channel groups) -> [L, H, S, D] of `dtype` (computed in float32, rounded once)."""
    code = torch.stack([q & 15, q >> 4], -1).flatten(-2).float()      # [L, H, S, D]
    n = code.shape[dim]
    reps = torch.arange(n, device=q.device) // group
    s, m = scale.index_select(dim, reps), lo.index_select(dim, reps)
    return (m + code * s).to(dtype)


def serialize(chunk: ChunkKV, scheme: str = "float") -> bytes:
    """One safetensors blob: tensors + metadata (format, start, fingerprint, meta, [scheme,] checksum). No pickle
    anywhere. scheme: "float" (keys and values as they are), "int8" or "int4" (see SCHEMES)."""
    from safetensors.torch import save

    check_scheme(scheme, "serialize scheme")
    tensors = {"ids": chunk.ids.contiguous()}
    if scheme == "float":
        tensors.update(keys=chunk.raw_keys.contiguous(), values=chunk.values.contiguous())
    elif scheme == "int8":
        tensors.update(quantize_int8(chunk.raw_keys, chunk.values))
    else:
        tensors.update(quantize_int4(chunk.raw_keys, chunk.values))
    meta = {"format": str(FORMAT_VERSION), "start": str(int(chunk.start)), "fingerprint": chunk.fingerprint.to_json(),
            "meta": json.dumps(chunk.meta, sort_keys=True)}
    if scheme != "float":
        meta["scheme"] = f"{scheme}/{str(chunk.raw_keys.dtype).replace('torch.', '')}"
    meta["checksum"] = _checksum(tensors, meta)
    return save(tensors, metadata=meta)


def _header(blob: bytes) -> dict:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CorruptChunkError(f"entry: expected bytes, got {type(blob).__name__}")
    if len(blob) < 8:
        raise CorruptChunkError(f"entry: expected a safetensors blob, got {len(blob)} bytes")
    (n,) = struct.unpack("<Q", bytes(blob[:8]))
    if n > len(blob) - 8 or n > _MAX_HEADER:
        raise CorruptChunkError(f"entry: header of {n} bytes in a blob of {len(blob)} (truncated or crafted)")
    try:
        head = json.loads(bytes(blob[8:8 + n]))
    except ValueError as e:
        raise CorruptChunkError("entry: unreadable safetensors header") from e
    if not isinstance(head, dict) or not isinstance(head.get("__metadata__"), dict):
        raise CorruptChunkError("entry: expected a header object with __metadata__")
    meta = head["__metadata__"]
    fmt = meta.get("format")
    if fmt != str(FORMAT_VERSION):
        why = " (its checksum does not cover the metadata; recompute it)" if fmt == "1" else ""
        raise CorruptChunkError(f"entry: expected kvpos format {FORMAT_VERSION}, got {str(fmt)[:20]!r}{why}")
    if set(meta) - {"scheme"} != _META_KEYS or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptChunkError(f"entry: expected metadata {sorted(_META_KEYS)} [+ scheme] as strings, got "
                                f"{sorted(meta)[:10]}")
    scheme, _ = _scheme_of(meta)
    if set(head) != {"__metadata__"} | _TENSORS[scheme]:
        raise CorruptChunkError(f"entry: expected tensors {sorted(_TENSORS[scheme])} (scheme {scheme}), got "
                                f"{sorted(k for k in head if k[:2] != '__')[:10]}")
    return meta


def header_fingerprint(head: bytes) -> Fingerprint:
    """The fingerprint an entry's header claims, from the blob's first bytes (at least 8 + the header length):
    what a cheap existence check compares (unverified: the checksum covers the whole blob, `deserialize` checks it)."""
    meta = _header(head)
    return Fingerprint.from_json(meta["fingerprint"])


def header_length(first8: bytes) -> int:
    """Bytes of an entry's header including the 8-byte length prefix (from the blob's first 8 bytes)."""
    if len(first8) < 8:
        raise CorruptChunkError(f"entry: expected a safetensors blob, got {len(first8)} bytes")
    (n,) = struct.unpack("<Q", bytes(first8[:8]))
    if n > _MAX_HEADER:
        raise CorruptChunkError(f"entry: header of {n} bytes (crafted)")
    return 8 + n


def _scheme_of(meta: dict) -> tuple[str, torch.dtype | None]:
    """(scheme, dtype keys and values are read back as) of an entry's metadata; no scheme field = "float"."""
    if "scheme" not in meta:
        return "float", None
    m = re.fullmatch(r"(int8|int4)/(float32|bfloat16|float16)", meta["scheme"])
    if m is None:
        raise CorruptChunkError(f"entry: scheme: expected one of int8|int4/<float32|bfloat16|float16>, got "
                                f"{meta['scheme'][:40]!r}")
    return m[1], _FLOAT_DTYPES[m[2]]


def _dequantized(tensors: dict[str, torch.Tensor], scheme: str, dtype: torch.dtype | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw_keys, values) of a verified entry, dequantized for scheme "int8" after checking dtypes and shapes."""
    k, v = tensors["keys"], tensors["values"]
    if scheme == "float":
        return k, v
    if scheme == "int4":
        return _dequantized_int4(tensors, dtype)
    ks, vs = tensors["keys_scale"], tensors["values_scale"]
    if k.dtype != torch.int8 or v.dtype != torch.int8 or ks.dtype != torch.float32 or vs.dtype != torch.float32:
        raise CorruptChunkError(f"entry: int8 scheme: expected int8 keys/values and float32 scales, got "
                                f"{k.dtype}/{v.dtype}/{ks.dtype}/{vs.dtype}")
    if k.dim() != 4 or v.dim() != 4 or tuple(ks.shape) != (*k.shape[:2], 1, k.shape[3]) \
            or tuple(vs.shape) != (*v.shape[:3], 1):
        raise CorruptChunkError(f"entry: int8 scheme: scale shapes {tuple(ks.shape)} / {tuple(vs.shape)} do not "
                                f"fit keys {tuple(k.shape)} / values {tuple(v.shape)}")
    if not (torch.isfinite(ks).all() and torch.isfinite(vs).all() and (ks >= 0).all() and (vs >= 0).all()):
        raise CorruptChunkError("entry: int8 scheme: scales must be finite and >= 0")
    return dequantize_int8(k, ks, dtype), dequantize_int8(v, vs, dtype)


def _dequantized_int4(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw_keys, values) of a verified int4 entry, after checking dtypes, shapes and that scales are usable."""
    k, v = tensors["keys"], tensors["values"]
    side = [tensors[n] for n in ("keys_scale", "keys_min", "values_scale", "values_min")]
    if k.dtype != torch.uint8 or v.dtype != torch.uint8 or any(t.dtype != torch.float32 for t in side):
        raise CorruptChunkError(f"entry: int4 scheme: expected uint8 keys/values and float32 scales, got "
                                f"{k.dtype}/{v.dtype}/{[str(t.dtype) for t in side]}")
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise CorruptChunkError(f"entry: int4 scheme: keys {tuple(k.shape)} / values {tuple(v.shape)} do not fit")
    L, H, S, D2 = k.shape
    g = INT4_GROUP
    want = [(L, H, -(-S // g), 2 * D2)] * 2 + [(L, H, S, -(-(2 * v.shape[3]) // g))] * 2
    if [tuple(t.shape) for t in side] != want:
        raise CorruptChunkError(f"entry: int4 scheme: scale shapes {[tuple(t.shape) for t in side]} do not fit "
                                f"keys {tuple(k.shape)} / values {tuple(v.shape)}")
    if not all(bool(torch.isfinite(t).all()) for t in side) or (side[0] < 0).any() or (side[2] < 0).any():
        raise CorruptChunkError("entry: int4 scheme: scales must be finite and >= 0, minimums finite")
    return (dequantize_int4(k, side[0], side[1], 2, dtype), dequantize_int4(v, side[2], side[3], 3, dtype))


def deserialize(blob: bytes) -> ChunkKV:
    """Parse and verify a blob; any truncation, alteration, crafted field or foreign format raises
    CorruptChunkError (never another exception type)."""
    try:
        return _deserialize(blob)
    except CorruptChunkError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a damaged blob makes a parser raise is corruption
        raise CorruptChunkError(f"entry: unreadable ({type(e).__name__}: {str(e)[:200]})") from e


def _deserialize(blob: bytes) -> ChunkKV:
    from safetensors.torch import load

    meta = _header(blob)
    tensors = load(bytes(blob))
    if not hmac.compare_digest(_checksum(tensors, meta), meta["checksum"]):
        raise CorruptChunkError("entry: checksum mismatch (the stored bytes were altered)")
    if not re.fullmatch(r"[0-9]{1,15}", meta["start"]):
        raise CorruptChunkError(f"entry: start: expected a non-negative int, got {meta['start'][:20]!r}")
    extra = json.loads(meta["meta"])
    if not isinstance(extra, dict):
        raise CorruptChunkError("entry: meta: expected a JSON object")
    keys, values = _dequantized(tensors, *_scheme_of(meta))
    for name, t in (("keys", keys), ("values", values)):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CorruptChunkError(f"entry: {name}: expected finite numbers, got NaN or inf (after dequantizing: "
                                    "a crafted entry, e.g. huge scales, or KV of a diverged forward); recompute it")
    try:
        return ChunkKV(tensors["ids"], keys, values, int(meta["start"]), Fingerprint.from_json(meta["fingerprint"]),
                       extra)
    except (TypeError, ValueError) as e:
        raise CorruptChunkError(f"entry: {e}") from e


# ---------------------------------------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------------------------------------

class Backend(Protocol):
    def get(self, key: str) -> ChunkKV | None: ...
    def put(self, key: str, chunk: ChunkKV) -> bool: ...
    def delete(self, key: str) -> None: ...
    def contains(self, key: str) -> bool: ...
    # optional: the fingerprint an entry's header claims (None: no entry), reading the header only
    def peek(self, key: str) -> Fingerprint | None: ...


class MemoryBackend:
    """In-process LRU with a byte budget: the sum of stored entries' bytes never exceeds `max_bytes`.

    An entry larger than the budget is not stored (put returns False). Entries are kept as tensors (no copy on get:
    treat them as read-only)."""

    def __init__(self, max_bytes: int = 2 << 30) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            fail("MemoryBackend max_bytes", "a positive int", max_bytes)
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict[str, ChunkKV] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._d)

    def __bool__(self) -> bool:       # an empty backend is still a backend (never replaced by `x or default`)
        return True

    def get(self, key: str) -> ChunkKV | None:
        check_key(key)
        with self._lock:
            c = self._d.get(key)
            if c is not None:
                self._d.move_to_end(key)
            return c

    def put(self, key: str, chunk: ChunkKV) -> bool:
        check_key(key)
        size = chunk.nbytes()
        if size > self.max_bytes:
            return False
        stored = ChunkKV(chunk.ids.clone(), chunk.raw_keys.clone(), chunk.values.clone(), chunk.start,
                         chunk.fingerprint, dict(chunk.meta))
        with self._lock:
            if key in self._d:
                self.bytes -= self._d.pop(key).nbytes()
            while self._d and self.bytes + size > self.max_bytes:
                _, old = self._d.popitem(last=False)
                self.bytes -= old.nbytes()
                self.evictions += 1
            self._d[key] = stored
            self.bytes += size
            assert self.bytes <= self.max_bytes, "MemoryBackend: byte budget exceeded"
        return True

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            c = self._d.pop(key, None)
            if c is not None:
                self.bytes -= c.nbytes()

    def contains(self, key: str) -> bool:
        """Whether an entry is held under `key` (not verified: `get` verifies)."""
        return check_key(key) in self._d

    def peek(self, key: str) -> Fingerprint | None:
        c = self._d.get(check_key(key))
        return None if c is None else c.fingerprint

    def keys(self) -> frozenset:
        """The keys held now."""
        with self._lock:
            return frozenset(self._d)


class TieredBackend:
    """A near MemoryBackend in front of a far backend (disk, Redis): gets try near first and copy far hits near;
    puts go far first, then near (a far failure raises and leaves both as they were); deletes remove both.

    Entries in the near tier were verified when they came in (from the far tier) or were computed here."""

    def __init__(self, near: MemoryBackend, far: Backend) -> None:
        if not isinstance(near, MemoryBackend):
            fail("TieredBackend near", "a MemoryBackend", type(near).__name__, exc=TypeError)
        for what in ("get", "put", "delete", "contains"):
            if not callable(getattr(far, what, None)):
                fail("TieredBackend far", f"a backend with {what}()", type(far).__name__, exc=TypeError)
        self.near, self.far = near, far

    def __bool__(self) -> bool:
        return True

    def get(self, key: str) -> ChunkKV | None:
        c = self.near.get(key)
        if c is not None:
            return c
        c = self.far.get(key)
        if c is not None:
            self.near.put(key, c)
        return c

    def put(self, key: str, chunk: ChunkKV) -> bool:
        """Far first, then near; the near tier holds what the far one serves (a quantized far scheme: the chunk as
        it reads back from it), so every engine sharing the far store serves the same KV for one passage."""
        ok = self.far.put(key, chunk)
        scheme = getattr(self.far, "scheme", "float")
        self.near.put(key, chunk if scheme == "float" else deserialize(serialize(chunk, scheme)))
        return ok

    def delete(self, key: str) -> None:
        self.far.delete(key)
        self.near.delete(key)

    def contains(self, key: str) -> bool:
        return self.near.contains(key) or self.far.contains(key)

    def peek(self, key: str) -> Fingerprint | None:
        fp = self.near.peek(key)
        if fp is not None:
            return fp
        peek = getattr(self.far, "peek", None)
        if peek is None:
            return None if not self.far.contains(key) else _UNKNOWN
        return peek(key)


class DiskBackend:
    """One safetensors file per entry under `root`; atomic writes (temp file + fsync + rename). Keys are
    validated and every path is checked to resolve inside the root (symbolic links included)."""

    def __init__(self, root: str | os.PathLike, scheme: str = "float") -> None:
        """scheme: how new entries hold keys and values ("float", "int8" or "int4", see SCHEMES); entries of any scheme
        are read."""
        self.scheme = check_scheme(scheme, "DiskBackend scheme")
        self.root = os.path.realpath(os.fspath(root))
        os.makedirs(self.root, exist_ok=True)

    def path(self, key: str) -> str:
        check_key(key)
        p = os.path.join(self.root, key[:2], f"{key}.safetensors")
        if os.path.commonpath([os.path.realpath(p), self.root]) != self.root:
            fail("store key", f"a path inside {self.root}", os.path.realpath(p), "remove the link that points out")
        return p

    def get(self, key: str) -> ChunkKV | None:
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"disk store {p}: {type(e).__name__}: {e}") from e
        try:
            return deserialize(blob)
        except CorruptChunkError as e:
            raise CorruptChunkError(f"{p}: {e}") from e

    def put(self, key: str, chunk: ChunkKV) -> bool:
        p = self.path(key)
        blob = serialize(chunk, self.scheme)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(p), prefix=".tmp-", suffix=".safetensors")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return True

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass

    def contains(self, key: str) -> bool:
        """Whether a file is held under `key` (not verified: `get` verifies)."""
        return os.path.exists(self.path(key))

    def peek(self, key: str) -> Fingerprint | None:
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                head = f.read(8)
                head += f.read(header_length(head) - 8)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"disk store {p}: {type(e).__name__}: {e}") from e
        return header_fingerprint(head)


class RedisBackend:
    """Entries as one blob per key in a redis-server (SET is atomic). Every failure is a StoreUnavailable:
    unreachable or timed out (no retries: `timeout_s` bounds each call), or an error the server answered
    (StoreServerError: out of memory, read-only, ...). A key holding another Redis type is a corrupt entry."""

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0, prefix: str = "kvpos:",
                 timeout_s: float = 5.0, ttl_s: int | None = None, scheme: str = "float") -> None:
        """scheme: how new entries hold keys and values ("float", "int8" or "int4", see SCHEMES); entries of any scheme
        are read."""
        self.scheme = check_scheme(scheme, "RedisBackend scheme")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError("RedisBackend: expected the `redis` package, got none; pip install 'kvpos[redis]'") from e
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
                or timeout_s <= 0:
            fail("RedisBackend timeout_s", "a finite number of seconds > 0", timeout_s)
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s <= 0):
            fail("RedisBackend ttl_s", "None or an int number of seconds > 0", ttl_s)
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9._:-]{0,64}", prefix):
            fail("RedisBackend prefix", "up to 64 characters of [A-Za-z0-9._:-]", repr(prefix))
        self._redis = redis
        self.address = f"{host}:{port}/{db}"
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.timeout_s = float(timeout_s)
        self.client = redis.Redis(host=host, port=port, db=db, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))

    def _call(self, what: str, fn, *args, **kw):
        E = self._redis.exceptions
        try:
            return fn(*args, **kw)
        except E.ResponseError as e:
            if "WRONGTYPE" in str(e):
                raise CorruptChunkError(f"redis {what}: the key holds another Redis type ({e})") from e
            raise StoreServerError(f"redis {what} at {self.address}: the server answered {type(e).__name__}: {e}; "
                                   "fix the server (memory, replica role), or build the ChunkStore with "
                                   "on_unavailable='recompute'") from e
        except (E.RedisError, OSError) as e:
            raise StoreUnavailable(
                f"redis {what}: expected a redis-server at {self.address} answering within {self.timeout_s}s, got "
                f"{type(e).__name__}: {e}; start redis-server, or build the ChunkStore with "
                "on_unavailable='recompute'") from e

    def ping(self) -> bool:
        return bool(self._call("ping", self.client.ping))

    def get(self, key: str) -> ChunkKV | None:
        k = self.prefix + check_key(key)
        blob = self._call("get", self.client.get, k)
        if blob is None:
            return None
        try:
            return deserialize(blob)
        except CorruptChunkError as e:
            raise CorruptChunkError(f"redis key {k}: {e}") from e

    def put(self, key: str, chunk: ChunkKV) -> bool:
        k = self.prefix + check_key(key)
        blob = serialize(chunk, self.scheme)
        self._call("set", self.client.set, k, blob, ex=self.ttl_s)
        return True

    def delete(self, key: str) -> None:
        self._call("delete", self.client.delete, self.prefix + check_key(key))

    def contains(self, key: str) -> bool:
        """Whether the server holds `key` (not verified: `get` verifies)."""
        return bool(self._call("exists", self.client.exists, self.prefix + check_key(key)))

    def peek(self, key: str) -> Fingerprint | None:
        """The fingerprint in the entry's header: one GETRANGE of its first 16 KiB (a second if the header is
        longer), never the tensors."""
        k = self.prefix + check_key(key)
        head = self._call("getrange", self.client.getrange, k, 0, (16 << 10) - 1)
        if not head:
            return None
        n = header_length(head)
        if n > len(head):
            head += self._call("getrange", self.client.getrange, k, len(head), n - 1)
        return header_fingerprint(head)


# ---------------------------------------------------------------------------------------------------------------------
# the store
# ---------------------------------------------------------------------------------------------------------------------

def content_key(ids: torch.Tensor, namespace: str = "default", anchor: str = "") -> str:
    """Storage key of a chunk: namespace + sha256 of its int64 token ids, and of the anchor digest it was encoded
    after (Fingerprint.anchor) when one is given: the same passage under two anchors is two entries."""
    digest = ids_digest(ids)
    if anchor:
        digest = _sha(f"{anchor}|{digest}".encode())
    return f"{check_namespace(namespace)}-{digest}"


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    mismatches: int = 0
    corrupt: int = 0
    unavailable: int = 0
    events: list = field(default_factory=list)

    def note(self, kind: str, key: str, detail: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.events.append({"kind": kind, "key": key, "detail": detail})
        del self.events[:-100]


class ChunkStore:
    """Chunk KV by content key, checked against this store's fingerprint on every read.

    on_mismatch: "error" (default) raises FingerprintMismatch naming both fingerprints; "recompute" treats the entry
    as a miss (the caller recomputes and overwrites it). Corrupt entries (any damage, any crafted field) are always
    reported in `stats`, deleted and treated as misses (the caller recomputes them); with strict=True they raise
    CorruptChunkError instead (and stay, for inspection). on_unavailable: "error" (default) raises StoreUnavailable; "recompute" reports it and
    treats it as a miss (get) or a skipped write (put).
    """

    def __init__(self, backend: Backend, fingerprint: Fingerprint, namespace: str = "default",
                 on_mismatch: str = "error", on_unavailable: str = "error", strict: bool = False) -> None:
        if on_mismatch not in ("error", "recompute"):
            fail("ChunkStore on_mismatch", "'error' or 'recompute'", repr(on_mismatch))
        if on_unavailable not in ("error", "recompute"):
            fail("ChunkStore on_unavailable", "'error' or 'recompute'", repr(on_unavailable))
        if not isinstance(fingerprint, Fingerprint):
            fail("ChunkStore fingerprint", "a Fingerprint", type(fingerprint).__name__, exc=TypeError)
        if backend is None or not all(callable(getattr(backend, m, None)) for m in ("get", "put", "delete")):
            fail("ChunkStore backend", "a backend with get/put/delete (MemoryBackend, DiskBackend, RedisBackend)",
                 type(backend).__name__, exc=TypeError)
        self.backend = backend
        self.fingerprint = fingerprint
        self.namespace = check_namespace(namespace)
        self.on_mismatch = on_mismatch
        self.on_unavailable = on_unavailable
        self.strict = strict
        self.stats = StoreStats()

    def with_fingerprint(self, fingerprint: Fingerprint) -> "ChunkStore":
        """The same backend, namespace and settings (stats shared) under another fingerprint (e.g. new weights)."""
        out = ChunkStore(self.backend, fingerprint, self.namespace, self.on_mismatch, self.on_unavailable,
                         self.strict)
        out.stats = self.stats
        return out

    def key(self, ids: torch.Tensor) -> str:
        return content_key(ids, self.namespace, self.fingerprint.anchor)

    def contains(self, ids: torch.Tensor) -> bool:
        """Whether an entry for `ids` is stored under this store's fingerprint: the header's claim where the backend
        can read headers alone (`peek`: memory, disk, Redis), existence otherwise. Cheap and unverified: `get`
        verifies every byte and may still miss. An unavailable backend answers False under
        on_unavailable='recompute'; an unreadable header is False (`get` drops the entry)."""
        key = self.key(ids)
        peek = getattr(self.backend, "peek", None)
        try:
            if peek is None:
                return self.backend.contains(key)
            fp = peek(key)
            return fp is _UNKNOWN or fp == self.fingerprint
        except CorruptChunkError:
            return False
        except StoreUnavailable as e:
            if self.on_unavailable == "error":
                raise
            self.stats.note("unavailable", key, str(e))
            return False

    def get(self, ids: torch.Tensor) -> ChunkKV | None:
        """The stored chunk for `ids`, or None (miss). See the class docstring for mismatches and damage."""
        key = self.key(ids)
        try:
            chunk = self.backend.get(key)
        except StoreUnavailable as e:
            if self.on_unavailable == "error":
                raise
            self.stats.note("unavailable", key, str(e))
            return None
        except CorruptChunkError as e:
            if self.strict:
                raise
            self.stats.note("corrupt", key, str(e))
            self._delete_quietly(key)
            return None
        if chunk is None:
            self.stats.misses += 1
            return None
        if chunk.fingerprint != self.fingerprint:
            msg = (f"chunk {key[:24]}: computed with [{chunk.fingerprint.short()}], this store serves "
                   f"[{self.fingerprint.short()}]; recompute the chunk, use another namespace, or pass "
                   "on_mismatch='recompute'")
            if self.on_mismatch == "error":
                raise FingerprintMismatch(msg)
            self.stats.note("mismatches", key, msg)
            return None
        if not torch.equal(chunk.ids, torch.as_tensor(ids, dtype=torch.long).flatten()):
            if self.strict:
                raise CorruptChunkError(f"chunk {key[:24]}: ids differ from the key")
            self.stats.note("corrupt", key, "ids differ from the key (hash collision or tampering)")
            self._delete_quietly(key)
            return None
        self.stats.hits += 1
        return chunk

    def put(self, chunk: ChunkKV) -> bool:
        if not isinstance(chunk, ChunkKV):
            fail("ChunkStore.put chunk", "a ChunkKV", type(chunk).__name__, exc=TypeError)
        if chunk.fingerprint != self.fingerprint:
            fail("ChunkStore.put chunk", f"fingerprint [{self.fingerprint.short()}]", f"[{chunk.fingerprint.short()}]")
        key = self.key(chunk.ids)
        try:
            return self.backend.put(key, chunk)
        except StoreUnavailable as e:
            if self.on_unavailable == "error":
                raise
            self.stats.note("unavailable", key, str(e))
            return False

    def _delete_quietly(self, key: str) -> None:
        try:
            self.backend.delete(key)
        except StoreUnavailable:
            pass
