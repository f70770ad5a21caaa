"""The entry format (specified in FORMAT.md beside this file): ChunkKV, `serialize` and the verifying
`deserialize`; header reads for cheap existence checks."""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from types import MappingProxyType
from dataclasses import dataclass, field

import torch

from .._checks import fail
from .codecs import INT4_GROUP, check_scheme, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from .errors import CorruptChunkError
from .fingerprint import FORMAT_VERSION, Fingerprint


_META_KEYS = frozenset({"format", "start", "fingerprint", "meta", "checksum"})
_MAX_HEADER = 1 << 20

_FLOAT_DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})
_TENSORS = MappingProxyType({"float": frozenset({"ids", "keys", "values"}),
                             "int8": frozenset({"ids", "keys", "values", "keys_scale", "values_scale"}),
                             "int4": frozenset({"ids", "keys", "values", "keys_scale", "values_scale", "keys_min",
                                                "values_min"})})


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
