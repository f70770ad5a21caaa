"""PositionedCache: the core PositionedKV speaking transformers' `Cache` protocol (a thin shim).

Letters: B batch · H kv heads · T cached slots · S new tokens · D head_dim.

How positions arrive (transformers 5.x): attention layers call `cache.update(k_rotated, v, layer_idx,
kwargs={..., "position_ids": [B|1, S]})` after applying RoPE. The first layer of a forward reads the positions and
the core (`PositionedKV.write_rotated_`) keeps them for every later layer of that forward.

`from_model` puts a forward pre-hook on the model's rotary module. It records, per thread (a context variable, never
an attribute), which model is running and at which positions. The cache uses it twice: models that do not pass
position_ids to the cache (GPT-NeoX) get their positions from it, and a cache refuses a forward of any model other
than the one it was built for (another RoPE base would silently corrupt its keys).
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache

from kvpos._checks import fail
from kvpos._kernels import kernel_status, rope_kernel_available
from kvpos.cache import PositionedKV
from kvpos.rope import RopeSpec

from .specs import rope_specs_from_model
from .attention import RawHandoff, switch_to_kvpos, uses_kvpos_attention
from .handoff import check_raw_handoff
from .layers import LayerProtocol, protocol_layer_class
from .positions import NO_POSITIONS_FIX, ForwardNote, direct_positions, install_forward_hook, passed_positions
from .scope import hand_off, pending_handoff, take_note

__all__ = ["PositionedCache", "READS"]

READS = ("auto", "torch", "fused")


class PositionedCache(PositionedKV, Cache):
    """A transformers Cache that stores keys unrotated beside int64 positions and re-rotates only moved slots.

    Use it anywhere a DynamicCache goes:

        cache = PositionedCache.from_model(model)
        out = model.generate(ids, cache=cache, max_new_tokens=20)     # same tokens as DynamicCache
        cache.shift_(10, 40, +100)                                   # move slots 10..39 by +100 positions
        out2 = kvpos.integrations.hf.generate(model, cache, more_ids, max_new_tokens=20)

    Memory: storage="rotated" (default) keeps raw keys + rotated keys + values (1.5x a DynamicCache), buffers
    growing geometrically (no per-step cat); storage="raw" keeps raw keys + values (the size of a DynamicCache) and
    rotates keys on read; storage="int8" keeps them as int8 codes (`kvpos.cache.QuantSlotLayer`: keys per channel
    over 32-token groups, values per token, the newest <= 32 tokens unquantized; bytes in
    results/bench_memory.md; approximate; no recompute forwards, no torch.compile). How raw keys are read (`read`):
      "auto" (default): decode steps (one token per row) hand the raw keys to the "kvpos" attention (from_model
          switches an SDPA model to it), whose fused C kernel rotates each key in registers while it scores it
          (`kvpos._kernels.decode_raw_kernel`; int8: `decode_q8_kernel`, which also dequantizes in registers);
          other forwards, and calls the kernel cannot serve, rotate (int8: dequantize and rotate) the layer into
          per-forward scratch buffers and run SDPA. `cache.read_counts` counts layer reads by path.
      "torch": always the scratch buffer + SDPA (the reference path).
      "fused": decode steps must take the kernel: a step it cannot serve raises (the cache keeps its slots).

    torch.compile: decoding compiles without graph breaks (the traced update reads no tensor value on the host).
    `cache.reserve_(T + new_tokens)` before compiled decoding keeps DynamicCache's graph count (a growth inside a
    compiled forward compiles one more graph, once). `capacity=C` makes a fixed-capacity cache like transformers'
    StaticCache: buffers of C slots allocated once, every forward reads all C (the mask hides unused slots), so
    shapes stay static and `torch.compile(..., fullgraph=True)` / `generate(compile_config=...)` apply; position
    operations work between forwards as usual. Inside a compiled forward the cache cannot see which model runs
    (torch.compile does not trace context variables): it checks shapes only, and refuses offloading, recompute
    forwards, models that do not pass position_ids to it (GPT-NeoX) and RoPE types with an exact-range limit.
    """

    def __init__(self, specs: Sequence[RopeSpec], raw_dtype: torch.dtype | None = None, origin: Any = None,
                 model_id: str | None = None, offloading: bool = False, storage: str = "rotated",
                 capacity: int | None = None, read: str = "auto") -> None:
        """Prefer `from_model(model)`: it reads the specs and binds the cache to that model (origin).

        offloading: keep every layer but the one computing on CPU (transformers' offloading=True; on a CPU-only
        machine it moves nothing). Position operations bring every layer back first. storage, capacity, read: see
        the class."""
        PositionedKV.__init__(self, specs, raw_dtype, origin, storage, capacity)
        Cache.__init__(self, layers=self.layers)
        if not isinstance(offloading, bool):
            fail("PositionedCache offloading", "a bool", type(offloading).__name__, exc=TypeError)
        if read not in READS:
            fail("PositionedCache read", " or ".join(repr(r) for r in READS), repr(read))
        if read == "fused" and self.mode.keeps_rotated:
            fail("PositionedCache read", "'auto' or 'torch' with storage='rotated' (only raw keys are read by the "
                 "fused kernel)", repr(read), "pass storage='raw' or 'int8' with read='fused'")
        self.read = read
        self.read_counts = {"fused": 0, "torch": 0}     # storage="raw" / "int8" decode layer reads, by path
        # why decode steps may not hand raw keys to the model's attention (from_model checks the model), or None
        self.handoff_refused: str | None = None
        self._modules: frozenset | None = None
        self.offloading = offloading
        self.model_id = model_id
        self._limited = any(s.max_exact_position is not None for s in self.specs)

    def _new_layer(self, index: int, spec: RopeSpec) -> LayerProtocol:
        return protocol_layer_class(self.mode)(self, index, spec, self.raw_dtype, self.capacity)

    def empty_like(self) -> "PositionedCache":
        out = type(self)(self.specs, self.raw_dtype, self.origin, self.model_id, self.offloading, self.storage,
                         self.capacity, self.read)
        out.handoff_refused = self.handoff_refused
        return out

    def __iter__(self):
        """Per layer (rotated keys [B, H, T, D], values, None): what DynamicCache yields, so that
        DynamicCache(ddp_cache_data=iter(cache)) rebuilds a plain cache (the data-parallel path)."""
        for i, l in enumerate(self.layers):
            yield self.layer_keys(i), l.values, None

    def check_idle(self, op: str) -> int:
        if self.offloading:
            for l in self.layers:
                l.prefetch()
        return PositionedKV.check_idle(self, op)

    def __bool__(self) -> bool:
        """False for a model whose RoPE frequencies change with length (dynamic, longrope): transformers' Phi-3
        generate drops a truthy cache at the switch length and continues without it, which would leave this cache
        silently behind; kept, the cache refuses the first position beyond its exact range with an error instead."""
        return not self._limited

    @classmethod
    def from_model(cls, model: torch.nn.Module, raw_dtype: torch.dtype | None = None,
                   angle_dtype: torch.dtype = torch.float32, storage: str = "rotated", capacity: int | None = None,
                   read: str = "auto") -> "PositionedCache":
        """Build an empty cache for `model` (one RopeSpec per layer; refuses models it cannot serve exactly).
        capacity: a fixed capacity in slots (see the class), for compiled decoding with static shapes.
        storage="raw" with read "auto" / "fused" switches an SDPA model to the "kvpos" attention (SDPA itself for
        ordinary keys), which runs the fused raw-key kernel on decode steps."""
        specs = rope_specs_from_model(model, angle_dtype=angle_dtype)
        origin = install_forward_hook(model)
        out = cls(specs, raw_dtype=raw_dtype, origin=origin, model_id=getattr(model, "name_or_path", None),
                  storage=storage, capacity=capacity, read=read)
        if not out.mode.keeps_rotated and read != "torch":
            impl = getattr(model.config, "_attn_implementation", None)
            if impl in ("sdpa", "kvpos"):
                switch_to_kvpos(model)
            elif read == "fused":
                fail("PositionedCache.from_model(read='fused') model", "attn_implementation 'sdpa' (switched to "
                     "'kvpos', whose attention reads raw keys)", repr(impl), "load it with attn_implementation='sdpa'")
            out.handoff_refused = check_raw_handoff(model, out)
            if out.handoff_refused is not None and read == "fused":
                fail(f"PositionedCache.from_model(storage={storage!r}, read='fused') model",
                     "an architecture whose attention reads the raw keys exactly as the cache hands them out",
                     f"{type(model).__name__}: {out.handoff_refused}",
                     "use read='auto' (keys rotated into a buffer where the hand-off is not exact) or read='torch'")
        return out

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
        for i, l in enumerate(cache.layers):
            if l.keys is None or l.keys.shape[2] != T:
                fail(f"from_dynamic layer {i}", f"{T} cached keys (sliding-window layers keep fewer)",
                     None if l.keys is None else l.keys.shape[2])
        kv = [(l.keys, l.values) for l in cache.layers]
        return cls.from_rotated(out.specs, kv, positions, raw_dtype, origin=out.origin, model_id=out.model_id)

    # -- the transformers write path -----------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store S new slots of layer `layer_idx`: k [B, H, S, D] already rotated by the model; returns all
        (rotated keys, values) of the layer. Positions come from the model's forward (recorded by its rotary
        module) or, for a direct call, from `cache_kwargs={"position_ids": pos}` (pos int64 [B|1, S], the positions
        the keys were rotated at; a dict as the fourth positional argument is read the same way).

        With autograd recording (grad enabled, keys or values requiring grad) the cache stores detached copies and
        returns fresh tensors in which the new slots are the model's own keys and values: gradients flow through
        this forward's tokens (as with DynamicCache within one forward), never into earlier forwards' cached slots,
        and no stored buffer is part of a graph (a later write cannot invalidate a backward)."""
        if args and isinstance(args[0], dict) and "cache_kwargs" not in kwargs:
            kwargs = {**kwargs, "cache_kwargs": args[0]}
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            return self._update_recording(key_states, value_states, layer_idx, kwargs)
        return self._update(key_states, value_states, layer_idx, kwargs)

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: dict,
                handoff: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` without autograd; handoff=False: never hand raw keys to the attention (rotate into a buffer)."""
        if torch.compiler.is_compiling():
            return self._update_traced(key_states, value_states, layer_idx, kwargs)
        if self.offloading:
            self.layers[layer_idx].prefetch()
        fw = self.running_forward
        B, S = key_states.shape[0], key_states.shape[2]
        if fw is not None and layer_idx not in fw.done and self.running_overwrite is None and fw.S == S:
            pos = fw.pos                                     # a later layer of the running forward
        else:
            pos = self._incoming_positions(layer_idx, key_states, kwargs, self._forward_note(layer_idx, kwargs))
        if handoff and not self.mode.keeps_rotated and self.read != "torch" and S == 1 \
                and self.running_overwrite is None:
            out = self._update_handoff(layer_idx, key_states, value_states, pos)
        else:
            out = self.write_rotated_(layer_idx, key_states, value_states, pos)
        if self.offloading and layer_idx > 0:
            self.layers[layer_idx - 1].offload()          # attention of layer_idx - 1 is done: its KV can leave
        return out

    def _update_recording(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, kwargs: dict
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` under autograd: store detached k / v [B, H, S, D]; return copies of the layer's keys and values
        with the new slots replaced by k / v themselves (differentiable)."""
        if self.capacity is not None and torch.compiler.is_compiling():
            fail("a compiled forward of a fixed-capacity PositionedCache with autograd recording", "torch.no_grad() "
                 "or torch.inference_mode() around it (a cache serves inference)", "grad enabled and keys "
                 "requiring grad", "wrap the compiled decode in torch.no_grad()")
        S = k.shape[2]
        slots = None if self.running_overwrite is None else self.running_overwrite.slots
        with torch.no_grad():
            keys, values = self._update(k.detach(), v.detach(), layer_idx, kwargs, handoff=False)
            keys, values = keys.clone(), values.clone()
        n = self.layers[layer_idx].n
        idx = slots if slots is not None else torch.arange(n - S, n)
        idx = idx.to(keys.device)
        keys = keys.index_copy(2, idx, k.to(keys.dtype))
        values = values.index_copy(2, idx, v.to(values.dtype))
        return keys, values

    def _why_not_handoff(self, k: torch.Tensor) -> str | None:
        """Why a decode step of storage="raw" cannot hand raw keys to the fused reader, or None."""
        if self.handoff_refused is not None:
            return self.handoff_refused
        if not rope_kernel_available():
            return f"the C kernels are not built ({kernel_status()})"
        model = self.origin() if self.origin is not None else None
        if model is None or not uses_kvpos_attention(model):
            return "the model's attention is not 'kvpos' (build the cache with from_model on an SDPA model)"
        if k.device.type != "cpu" or k.dtype not in (torch.float32, torch.bfloat16):
            return f"keys {k.dtype} on {k.device.type} (the kernel reads fp32 / bf16 on CPU)"
        if self.raw_dtype not in (None, k.dtype):
            return f"raw_dtype {self.raw_dtype} differs from the keys' {k.dtype}"
        if k.shape[-1] > 256:
            return f"head_dim {k.shape[-1]} > 256"
        return None

    def _update_handoff(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step of storage="raw": store the token and hand the layer's raw keys to the "kvpos" attention,
        which rotates them on read (fused kernel); where that reader is not in place, rotate into a buffer
        (read="auto") or refuse before writing anything (read="fused")."""
        why = self._why_not_handoff(k)
        if why is not None:
            if self.read == "fused":
                fail(f"PositionedCache(read='fused') layer {layer_idx}", "a decode step the fused raw-key kernel "
                     "serves", why, "use read='auto'")
            self.read_counts["torch"] += 1
            return self.write_rotated_(layer_idx, k, v, pos)
        self._check_handoff_taken(layer_idx)
        n0 = self.layers[layer_idx].n
        keys, values = self.write_rotated_(layer_idx, k, v, pos, hand_raw=True)
        hand_off(RawHandoff(weakref.ref(self), layer_idx, keys.data_ptr(), keys.shape[2], n0, self.handout,
                              self.read == "fused", values.data_ptr(), self._model_modules()))
        return keys, values

    def _model_modules(self) -> frozenset:
        """ids of the modules of the model this cache serves (computed once)."""
        if self._modules is None:
            model = self.origin() if self.origin is not None else None
            self._modules = frozenset() if model is None else frozenset(id(m) for m in model.modules())
        return self._modules

    def _check_handoff_taken(self, layer_idx: int) -> None:
        """The raw keys handed to an earlier layer of the running forward must have been read by its attention
        (else that layer attended to something else: refuse before going on)."""
        read = pending_handoff()
        fw = self.running_forward
        if read is None or read.calls or read.cache_ref() is not self or fw is None or read.n0 != fw.n0 \
                or read.layer == layer_idx:
            return
        self.drop_tail_(fw.n0)
        fail(f"PositionedCache(storage={self.storage!r}) layer {read.layer}: raw-key hand-off",
             "the layer's attention reading the raw keys the cache returned", "no 'kvpos' attention call took them",
             "build the cache with read='torch' (keys rotated into a buffer: exact for every architecture)")

    def _update_traced(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: dict
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` inside torch.compile: only Python the compiler traces without a graph break (no context
        variable, no tensor value read on the host). What the eager path checks from data it checks from shapes;
        what it cannot check it refuses at trace time (an error, never a silent difference)."""
        fw = self.running_forward
        if fw is not None and layer_idx not in fw.done and self.running_overwrite is None \
                and fw.S == key_states.shape[2]:
            pos = fw.pos
        else:
            if self.offloading:
                fail("PositionedCache(offloading=True) under torch.compile", "an eager forward (layers move "
                     "between devices between calls)", "a compiled forward", "build the cache with offloading=False")
            if self.running_overwrite is not None:
                fail("cache.overwriting(...) under torch.compile", "an eager recompute forward", "a compiled one",
                     "run partial recomputation (edits, repairs) without torch.compile")
            if self._limited:
                fail("PositionedCache under torch.compile", "a model whose RoPE has no exact-range limit (the "
                     "compiled path cannot read positions to check it)", "a dynamic / longrope RoPE", "run it eagerly")
            pos = passed_positions(kwargs)
            if pos is None:
                fail(f"cache.update layer {layer_idx} under torch.compile: position_ids", "the positions passed by "
                     "the model to the cache", None, "this architecture does not pass them (GPT-NeoX); run it eagerly")
            B, S = key_states.shape[0], key_states.shape[2]
            if pos.dim() != 2 or pos.shape[-1] != S or pos.shape[0] not in (1, B):
                fail(f"cache.update layer {layer_idx}: position_ids", f"[B|1, S] = [{B}|1, {S}]", tuple(pos.shape))
            pos = pos.to(device=key_states.device, dtype=torch.long).expand(B, S)
        return self.write_rotated_(layer_idx, key_states, value_states, pos)

    def _forward_note(self, index: int, kwargs: dict) -> ForwardNote | None:
        """The running forward's note (consumed); refuses a forward of another model than this cache's. A direct
        call with `cache_kwargs={"position_ids": ...}` needs no note (the caller states the positions)."""
        note = take_note()
        if self.origin is None or (note is None and self.running_overwrite is not None):
            return note                    # recompute forwards: the first layer consumed and checked the note
        if note is None and direct_positions(kwargs):
            return None
        if note is None:
            self._refuse_compile_fallback(index)
            if passed_positions(kwargs) is None:
                fail(f"cache.update layer {index}: position_ids", "the positions the new keys were rotated at",
                     ("no positions (no model forward recorded them and none were passed; under torch.compile: a model "
                      "that does not pass position_ids to the cache, such as GPT-NeoX, which must run eagerly)"),
                     NO_POSITIONS_FIX)
        if note is None or note.model() is not self.origin():
            got = ("a forward of a model without kvpos's hook (or, under torch.compile, a model that does not pass "
                   "position_ids to the cache, such as GPT-NeoX: run it eagerly)") if note is None else \
                "a forward of another model"
            fail(f"cache.update layer {index}", f"a forward of the model this cache was built for "
                 f"({self.model_id or 'from_model'})", got,
                 "build one cache per model with PositionedCache.from_model(model); another model's keys (another "
                 "RoPE base, other weights) would make this cache's keys wrong")
        return note

    def _refuse_compile_fallback(self, index: int) -> None:
        """No forward note: the usual cause is a torch.compile'd forward whose traced update refused and fell back
        to eager here (the rotary hook records nothing under compile). Name the refusal the trace could not raise."""
        if self.mode.quantized:
            fail(f"cache.update layer {index}", "an eager forward (storage='int8' is not compiled: its quantized "
                 "writes run eagerly only)", "a forward with no eager rotary-module call (torch.compile)",
                 "decode storage='int8' eagerly, or compile with storage='raw' or 'rotated'")
        if self.capacity is not None:
            self.sync_count()
            if self.table.n + 1 > self.capacity:
                fail(f"cache.update layer {index}", f"at most {self.capacity} slots (the fixed capacity)",
                     f"a forward after {self.table.n} slots (a compiled decode past the capacity)",
                     "build the cache with a larger capacity=")

    def _incoming_positions(self, index: int, k: torch.Tensor, kwargs: dict, note: ForwardNote | None
                            ) -> torch.Tensor:
        """[B, S] int64 positions of the keys the model is handing over (read once per forward)."""
        B, S = k.shape[0], k.shape[2]
        pos = passed_positions(kwargs)
        if pos is None and note is not None:
            pos = note.positions
        if pos is None and self.running_overwrite is not None and self.running_overwrite.pos is not None:
            pos = self.running_overwrite.pos                        # a later layer of a recompute forward
        if pos is None:
            fail(f"cache.update layer {index}: position_ids", "the positions of the new keys (passed by the model "
                 "or recorded from its rotary module)", None, NO_POSITIONS_FIX)
        if pos.dim() == 3:
            fail("position_ids", "[B, S] (1-D positions per token)", tuple(pos.shape), "M-RoPE is not supported")
        if pos.shape[-1] != S or pos.shape[0] not in (1, B):
            # a position tensor of a different forward (stale hook) or a model slicing tokens: refuse, never guess
            fail(f"cache.update layer {index}: position_ids", f"[B|1, S] = [{B}|1, {S}] for {S} new keys",
                 tuple(pos.shape))
        return pos.to(device=k.device, dtype=torch.long).expand(B, S)

    # -- transformers Cache protocol -----------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """T; inside a compiled forward of a fixed-capacity cache the slot count tensor (as StaticCache returns)."""
        if self.capacity is not None and torch.compiler.is_compiling():
            return self.table.count
        self.settle()
        return self.layers[layer_idx].n if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        self.settle()
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder batch rows for beam search."""
        self.reorder_rows_(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_rows_(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.batch_size > 0:
            self.reorder_rows_(torch.arange(self.table.batch_size).repeat_interleave(repeats))

    def __repr__(self) -> str:
        return PositionedKV.__repr__(self)
