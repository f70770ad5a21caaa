"""What a request tells the kvpos connector, validated strictly: `kv_transfer_params["kvpos"]` and the cache salt.

    {"segments": [[0, A, "anchor"], [A, B, "chunk"], ...], "save": true, "memory": true, "layout": "sequential",
     "lead": [token ids]}

lead (optional): the passages' KV is loaded from chunks encoded after anchor + lead (kvpos.integrations.compose
Anchor: a lead is in no prompt; `RequestBuilder(tok, lead=...)` precomputes such chunks with the lead in the anchor
segment). A lead request saves nothing (what vLLM computes for it was not encoded after the lead).

layout "parallel" (passages at overlapping positions after the anchor, not visible to each other; kvpos.compose)
needs the kvpos attention backend (attention.py) and is refused without it.

No engine import: the connector (scheduler side) calls `parse_request`; `RequestBuilder` writes what it accepts.

Prefix caching. vLLM hashes every block it holds by the tokens before it; blocks the connector fills from passages
encoded apart (re-positioned, position-independent KV) are not what vLLM would compute for those tokens, so they
must never be found by a request that did not ask for kvpos. With prefix caching on, a kvpos request therefore
carries a cache salt (vLLM puts it into the hash of the first block, and so of every block) that starts with
`kvpos_salt(segments)`; anything after it is the caller's own salt. A request without it is refused (it runs as
plain vLLM and says why).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvpos._checks import fail

__all__ = ["RequestParams", "parse_request", "kvpos_salt", "SALT_PREFIX", "LAYOUTS"]

SALT_PREFIX = "kvpos:"
_KEYS = ("segments", "save", "memory", "layout", "ape", "lead")
LAYOUTS = ("sequential", "parallel")


@dataclass(frozen=True)
class RequestParams:
    """A validated kvpos request: contiguous segments from token 0 (the anchor first, then passages), whether to
    save passages vLLM computes, whether to use the worker-memory tier."""

    segments: tuple[tuple[int, int, str], ...]
    save: bool
    memory: bool
    layout: str = "sequential"
    ape: tuple[float, float] | None = None      # APE's (temperature, scale) over the passages (kvpos.ape)
    lead: tuple[int, ...] = ()                  # the passages were encoded after anchor + these ids


def kvpos_salt(segments: Any, layout: str = "sequential", ape: Any = None, lead: Any = ()) -> str:
    """The cache salt prefix of a request with these segments, layout, APE knobs and lead: "kvpos:" + sha256 of their
    canonical JSON (layout, APE and lead enter only when not the defaults, so sequential salts are what they always
    were; blocks loaded from chunks of another lead hash apart)."""
    canon = json.dumps([[int(a), int(b), str(k)] for a, b, k in segments], separators=(",", ":"))
    if layout != "sequential":
        canon += "|" + str(layout)
    if ape is not None:
        canon += "|ape:" + json.dumps([float(x) for x in ape])
    if lead:
        canon += "|lead:" + json.dumps([int(x) for x in lead], separators=(",", ":"))
    return SALT_PREFIX + hashlib.sha256(canon.encode()).hexdigest()[:32]


def _flag(params: dict, key: str, default: bool) -> bool:
    v = params.get(key, default)
    if not isinstance(v, bool):
        fail(f"kvpos {key}", "true or false (a JSON boolean)", f"{type(v).__name__} {v!r}")
    return v


def parse_segments(segments: Any, n_prompt: int) -> tuple[tuple[int, int, str], ...]:
    """[start, end, kind] triples, contiguous from token 0, the first the anchor, the rest chunks, inside the
    prompt of `n_prompt` tokens. Raises ValueError naming the first problem."""
    if not isinstance(segments, list) or not segments:
        got = f"an empty list" if isinstance(segments, list) else f"{type(segments).__name__} {str(segments)[:60]}"
        fail("kvpos segments", "a non-empty list of [start, end, kind]", got)
    out, pos = [], 0
    for i, s in enumerate(segments):
        if not isinstance(s, (list, tuple)) or len(s) != 3 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in s[:2]) or not isinstance(s[2], str):
            fail(f"kvpos segments[{i}]", "[start, end, kind] with int start < end and a kind string", str(s)[:80])
        a, b, kind = s
        want = "anchor" if i == 0 else "chunk"
        if kind != want or a != pos or b <= a or b > n_prompt:
            fail(f"kvpos segments[{i}]", f"[{pos}, end <= {n_prompt}, {want!r}] (contiguous from token 0)", list(s))
        out.append((a, b, kind))
        pos = b
    return tuple(out)


def _ape(ape: Any, raw: bool) -> tuple[float, float] | None:
    """{"temperature": t, "scale": s} (finite floats > 0) -> (t, s); None stays None."""
    if ape is None:
        return None
    if not raw:
        fail("kvpos ape", "no APE (this engine runs vLLM's own attention)", str(ape)[:60],
             "start the engine with the kvpos attention backend: KVPOS_VLLM_ATTENTION=1 and "
             "engine_kwargs(..., attention=True)")
    ok = isinstance(ape, dict) and set(ape) == {"temperature", "scale"} and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < float(v) < float("inf") for v in ape.values())
    if not ok:
        fail("kvpos ape", '{"temperature": t, "scale": s}, both finite numbers > 0', str(ape)[:80])
    return float(ape["temperature"]), float(ape["scale"])


def _lead(lead: Any) -> tuple[int, ...]:
    """[id, ...] (ints >= 0) -> a tuple; absent or [] -> ()."""
    if lead is None:
        return ()
    if not isinstance(lead, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                             for x in lead):
        fail("kvpos lead", "a list of token ids (ints >= 0)", f"{type(lead).__name__} {str(lead)[:60]}")
    return tuple(lead)


def parse_request(params: Any, n_prompt: int, cache_salt: str | None, salted: bool, default_save: bool,
                  raw: bool = False) -> RequestParams:
    """Validate kv_transfer_params["kvpos"] of a request with `n_prompt` prompt tokens. `salted`: the engine runs
    with prefix caching, so `cache_salt` must start with kvpos_salt(segments, layout). `raw`: the engine runs the
    kvpos attention backend (any layout); without it only "sequential". Raises ValueError naming the offending field
    and value."""
    if not isinstance(params, dict):
        fail("kvpos params", "an object {segments, save?, memory?, layout?}",
             f"{type(params).__name__} {str(params)[:60]}")
    unknown = sorted(str(k) for k in params if k not in _KEYS)
    if unknown:
        fail("kvpos params", f"only the keys {list(_KEYS)}", f"unknown keys {unknown}")
    segments = parse_segments(params.get("segments"), n_prompt)
    layout = params.get("layout", "sequential")
    if layout not in LAYOUTS:
        fail("kvpos layout", f"one of {list(LAYOUTS)}", repr(layout)[:60])
    if layout != "sequential" and not raw:
        fail("kvpos layout", "'sequential' (this engine runs vLLM's own attention)", repr(layout),
             "start the engine with the kvpos attention backend: KVPOS_VLLM_ATTENTION=1 and "
             "engine_kwargs(..., attention=True)")
    ape = _ape(params.get("ape"), raw)
    lead = _lead(params.get("lead"))
    out = RequestParams(segments, _flag(params, "save", default_save), _flag(params, "memory", True), layout, ape,
                        lead)
    if salted:
        want = kvpos_salt(segments, layout, ape, lead)
        if not isinstance(cache_salt, str) or not cache_salt.startswith(want):
            fail("kvpos request cache_salt", f"a salt starting with {want!r} (RequestBuilder sets it)",
                 repr(cache_salt), "with prefix caching on, blocks filled from stored passages must not be hashed like "
                 "blocks vLLM computed; pass the prompt as RequestBuilder builds it (its 'cache_salt' included)")
    return out
