"""The read path: rotate-on-read for raw storage (one scratch buffer per forward), fused decode reads, int8
dequantizing reads."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._checks import fail
from .._kernels import decode_q8_kernel, decode_raw_kernel
from .._posmap_kernels import PinePlan, decode_heads_kernel, pine_plan
from .storages import INT8, RAW, StorageMode
from ..rope import RopeLayout, RopeSpec, _apply, cos_sin
from .buffers import _alloc
from .layers import SlotLayer
from ..posmap import factored_tables, scaled_cos_sin


TABLE_SPAN = 4096         # positions the kept factored tables grow by (4096 / F more rows, F: posmap.factor_bits)
_KEEP_MAX = 64            # kept tables per cache (distinct ratio sets); past it the memo starts over


def _kept_tables(keep: dict | None, key: tuple, ratios: tuple[float, ...], span: int, spec: RopeSpec
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """factored_tables of `ratios` spanning >= `span` positions, from `keep` where a long enough one is there."""
    got = None if keep is None else keep.get(key)
    if got is None or got[0] < span:
        span = -(-span // TABLE_SPAN) * TABLE_SPAN
        got = (span, factored_tables(torch.tensor(ratios, dtype=torch.float64), span, spec))
        if keep is not None:
            if len(keep) >= _KEEP_MAX:
                keep.clear()
            keep[key] = got
    return got[1]


@dataclass
class _ReadState:
    """Rotate-on-read state (storage="raw") for one forward: cos/sin of the first `n` slot positions per RoPE spec
    and one scratch buffer that every layer rotates into (the layers run one after the other), dropped with the
    forward so that nothing beyond the raw keys and values stays resident."""

    n: int
    cs: dict = field(default_factory=dict)        # spec.identity -> (cos, sin) [B, 1, n, R/2]; ("scaled", identity) [B, n, R/2]
    scratch: dict = field(default_factory=dict)   # (B, H, D, dtype, device) -> [B, H, n, D]

    def cos_sin(self, spec: RopeSpec, pos: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.cs.get(spec.identity)
        if cs is None:
            cos, sin = cos_sin(pos[:, : self.n], spec, device=device)
            cs = self.cs[spec.identity] = (cos[:, None], sin[:, None])
        return cs

    def scaled_cos_sin(self, spec: RopeSpec, pos: torch.Tensor, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, n, R/2] multiplied by the spec's attention scaling: what a fused reader takes (once per
        spec and forward, shared by its layers)."""
        key = ("scaled", spec.identity)
        cs = self.cs.get(key)
        if cs is None:
            cos, sin = self.cos_sin(spec, pos, device)
            s = spec.attention_scaling
            cos, sin = cos[:, 0], sin[:, 0]
            cs = self.cs[key] = (cos * s, sin * s) if s != 1.0 else (cos, sin)
        return cs

    def factored(self, spec: RopeSpec, ratios: tuple[float, ...], pos: torch.Tensor, keep: dict | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Factored tables [Rt, NT, R/2] of positions p / r for each distinct ratio (kvpos.posmap.factored_tables),
        spanning at least the first `n` slot positions; None when one of them is negative (the factored form needs
        t >= 0). Once per (spec, ratios) and forward, shared by its layers; `keep` (the cache's map_tables) holds
        them across forwards, built for a span rounded up to TABLE_SPAN positions (a longer table has the same
        rows: the numbers do not depend on it)."""
        key = ("factored", spec.identity, ratios)
        if key not in self.cs:
            p = pos[:, : self.n]
            lo, hi = (int(p.min()), int(p.max())) if p.numel() else (0, 0)
            self.cs[key] = None if lo < 0 else _kept_tables(keep, key, ratios, hi + 1, spec)
        return self.cs[key]

    def head_rows(self, ratios: torch.Tensor) -> tuple[tuple[float, ...], torch.Tensor]:
        """(the distinct ratios ascending, [Hq] int64 the row of each query head among them), once per forward."""
        listed = tuple(ratios.double().tolist())           # a few heads: unique in Python, no torch call
        key = ("heads", listed)
        got = self.cs.get(key)
        if got is None:
            distinct = tuple(sorted(set(listed)))
            got = self.cs[key] = (distinct, torch.tensor([distinct.index(x) for x in listed]))
        return got

    def mapped_cos_sin(self, spec: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, T, R/2] of explicit key positions [B, T], times the attention scaling: computed again only
        when the positions differ from the last ones of this spec in the forward (its layers share one table)."""
        key = ("mapped", spec.identity)
        last = self.cs.get(key)
        if last is None or last[0].shape != positions.shape or not torch.equal(last[0], positions):
            cos, sin = cos_sin(positions, spec, device=positions.device)
            s = spec.attention_scaling
            last = self.cs[key] = (positions.clone(), cos * s, sin * s)
        return last[1], last[2]

    def pine_plan(self, spec: RopeSpec, pos: torch.Tensor, device: torch.device, docs: tuple, window: int | None
                  ) -> PinePlan:
        """pine_plan over the first `n` slots (their scaled tables, positions, the last one the query's) and `docs` =
        (doc, start, size, end, mask) as PositionedKV.decode_pine takes them: laid out once per (spec, window) and
        forward while the same tensors come unchanged (same objects, no in-place write since: their version
        counters), as they do from every layer of a step."""
        key = ("pine", spec.identity, window)
        seen = tuple((t, t._version) if isinstance(t, torch.Tensor) else (t, None) for t in docs)
        got = self.cs.get(key)
        if got is None or len(got[0]) != len(seen) or any(a is not b or u != w for (a, u), (b, w) in zip(got[0], seen)):
            cos, sin = self.scaled_cos_sin(spec, pos, device)
            p = pos[:, : self.n]
            doc, start, size, end, mask = docs
            plan = pine_plan(cos, sin, spec.inv_freq, doc, start, size, end, p, p[:, -1], mask, spec.attention_scaling,
                             spec.rotary_dim, spec.layout is RopeLayout.INTERLEAVED, window,
                             angle_f32=spec.angle_dtype == torch.float32)
            got = self.cs[key] = (seen, plan)
        return got[1]

    def value_buffer(self, layer: "SlotLayer") -> torch.Tensor:
        """[B, H, n, Dv] in the keys' dtype: where storage="int8" dequantizes a layer's values (shared by layers)."""
        B, H, _, Dv = layer.value_store.shape
        key = ("v", B, H, Dv, layer.key_dtype, layer.slot_device)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = _alloc((B, H, self.n, Dv), layer.key_dtype, layer.slot_device)
        return buf

    def buffer(self, layer: "SlotLayer") -> torch.Tensor:
        """[B, H, n, D] in the keys' dtype: where a layer's keys are rotated on read (shared by layers)."""
        B, H, _, D = layer.key_store.shape
        key = (B, H, D, layer.key_dtype, layer.slot_device)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = _alloc((B, H, self.n, D), layer.key_dtype, layer.slot_device)
        return buf


class _Reads:
    """PositionedKV's reads (a mixin: every name it uses is PositionedKV's)."""

    def fused_inputs_raw(self, index: int, state: "_ReadState | None" = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """storage="raw": layer `index`'s (raw keys, values [B, H, T, D], cos, sin [B, T, R/2] float32 of the slots'
        positions, multiplied by the RoPE attention scaling): what an attention needs to rotate keys on read itself.
        `state`: the forward's read state (`write_rotated_(..., hand_raw=True)` leaves it in `handout`)."""
        l, cos, sin = self._fused_read_setup("fused_inputs_raw", index, RAW, state)
        return l.raw_k[:, :, : l.n], l.v[:, :, : l.n], cos, sin

    def _fused_read_setup(self, op: str, index: int, mode: StorageMode, state: "_ReadState | None"
                          ) -> tuple[SlotLayer, torch.Tensor, torch.Tensor]:
        """Layer `index` (checked: allocated, of storage `mode`) and its slots' scaled cos / sin [B, T, R/2]."""
        l = self.layers[index]
        if l.mode is not mode or not l.allocated:
            fail(f"{op} layer {index}", f"an allocated layer with storage={mode.name!r}",
                 f"storage={l.storage!r}, allocated={l.allocated}")
        st = self.read_state() if state is None or state.n != l.n else state
        cos, sin = st.scaled_cos_sin(l.spec, self.table.pos, l.slot_device)
        return l, cos, sin

    def drop_tail_(self, n0: int) -> None:
        """Forget every slot from `n0` on (a step that failed in attention, running or just committed); positions,
        keys untouched."""
        if self.running_forward is not None and self.running_forward.n0 == n0:
            self._rollback_forward()
            return
        self.running_forward = None
        marks = self._committed
        for i, l in enumerate(self.layers):
            if marks is not None and marks[0] == n0 and i in marks[1]:
                l.restore(marks[1][i])
            else:
                l.truncate(n0)
        self.table.truncate(n0)

    def read_state(self) -> _ReadState:
        """The running forward's (or recompute's) rotate-on-read state, else a transient one."""
        for run in (self.running_overwrite, self.running_forward):
            if run is not None:
                if run.read is None or run.read.n != self.table.n:
                    run.read = _ReadState(self.table.n)
                return run.read
        return _ReadState(self.table.n)

    def rotate_on_read(self, index: int, fresh: tuple[int | torch.Tensor, torch.Tensor] | None = None
                        ) -> torch.Tensor:
        """Layer `index`'s keys rotated from raw to the table's positions. `fresh` = (slots, keys [B, H, S, D] the
        engine rotated itself) are copied in as they are (bit-identical to a plain cache): slots an int m for the
        tail [m, n) (a forward's new slots: only [0, m) is rotated), or a slot index [S] (a recompute)."""
        l = self.layers[index]
        st = self.read_state()
        n = l.n
        upto = fresh[0] if fresh is not None and isinstance(fresh[0], int) else n
        cos, sin = st.cos_sin(l.spec, self.table.pos, l.slot_device)
        out = st.buffer(l)[:, :, :n]
        if upto:
            _apply(l.raw_source(upto), cos[:, :, :upto], sin[:, :, :upto], l.spec, l.spec.attention_scaling, out=out[:, :, :upto])
        if fresh is None:
            pass
        elif isinstance(fresh[0], int):
            out[:, :, upto:] = fresh[1].to(out.dtype)
        else:
            out[:, :, fresh[0].to(out.device)] = fresh[1].to(out.dtype)
        if not torch.compiler.is_compiling():          # attention backends (which read it) run eagerly
            self.last_read = (index, out.data_ptr())    # what holds_keys accepts (the forward may commit first)
        return out

    def read_layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s (keys rotated to their positions, values) as attention reads them (read buffers for
        storage="raw" / "int8": valid until the next layer is read in the same forward)."""
        return self.layer_keys(index), self.layers[index].values_on_read(self.read_state())

    def fused_inputs_int8(self, index: int, state: "_ReadState | None" = None) -> dict:
        """storage="int8": what a fused reader needs of layer `index`: key codes [B, H, T, D] int8 (sealed slots
        [0, q)), rows [T] int32, scales ks [B, H, R, D], the tail kt / vt [B, H, >= T - q, D], value codes
        [B, H, T, Dv] int8 and scales vs [B, H, T, 1] (sealed slots), q, and cos / sin [B, T, R/2] float32 (scaled like
        `fused_inputs_raw`)."""
        l, cos, sin = self._fused_read_setup("fused_inputs_int8", index, INT8, state)
        n = l.n
        return dict(codes=l.k_codes[:, :, :n], rows=l.rows[:n], ks=l.ks, kt=l.kt, vcodes=l.v_codes[:, :, :n],
                    vs=l.vs[:, :, :n], vt=l.vt, q=l.q, cos=cos, sin=sin)

    def decode_fused(self, index: int, state: "_ReadState | None", q: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor | None:
        """Attention of one query token per row q [B, Hq, D] over layer `index` by the fused kernel of this storage
        (raw keys rotated in registers; int8: dequantized and rotated in registers): [B, Hq, D] float32, or None
        where the kernel cannot serve. mask: None or additive float32 [B|1, T]."""
        spec = self.layers[index].spec
        inter = spec.layout is RopeLayout.INTERLEAVED
        if self.mode.quantized:
            d = self.fused_inputs_int8(index, state)
            return decode_q8_kernel(q, d["codes"], d["rows"], d["ks"], d["kt"], d["q"], d["vcodes"], d["vs"],
                                    d["vt"], d["cos"], d["sin"], mask, scale, spec.rotary_dim, inter)
        k, v, cos, sin = self.fused_inputs_raw(index, state)
        return decode_raw_kernel(q, k, v, cos, sin, mask, scale, spec.rotary_dim, inter)

    def _raw_read(self, index: int, state: "_ReadState | None") -> "tuple[SlotLayer, _ReadState] | None":
        """(layer `index`, the read state its fused read shares) for a storage="raw" layer, None otherwise: `state`,
        or the running forward's, or a fresh one where its slot count differs from the layer's."""
        l = self.layers[index]
        if l.mode is not RAW or not l.allocated:
            return None
        st = self.read_state() if state is None else state
        return l, (st if st.n == l.n else _ReadState(l.n))

    def decode_pine(self, index: int, q: torch.Tensor, doc: torch.Tensor, start: torch.Tensor, size: torch.Tensor,
                    end: torch.Tensor, mask: torch.Tensor | None, scale: float, window: int | None = None,
                    state: "_ReadState | None" = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """PINE-lite's decode step over layer `index` (storage="raw") in one kernel call
        (`kvpos._posmap_kernels.pine_decode_kernel`): (out [B, Hq, D] float32, shift [B, Hq, n] int64), or None where it
        cannot serve. q [B, Hq, D] rotated, the query of the layer's last slot; doc [B|1, T] ints in [-1, n);
        start / size [B, n], end [B] int64 (kvpos.integrations.pine.document_layout); mask None or additive
        float32 [B|1, T]; window: the layer's sliding window, applied at the positions keys are read at. The
        kernel's per-step arguments are laid out once per forward (`_ReadState.pine_plan`) while the layers pass the
        same document tensors and mask."""
        got = self._raw_read(index, state)
        if got is None:
            return None
        l, st = got
        plan = st.pine_plan(l.spec, self.table.pos, l.slot_device, (doc, start, size, end, mask), window)
        return plan.run(q, l.raw_k[:, :, : l.n], l.v[:, :, : l.n], scale)

    def decode_mapped(self, index: int, q: torch.Tensor, mask: torch.Tensor | None, scale: float,
                      ratios: torch.Tensor | None = None, seg: torch.Tensor | None = None,
                      state: "_ReadState | None" = None, positions: torch.Tensor | None = None
                      ) -> torch.Tensor | None:
        """Decode attention over layer `index` (storage="raw") under read-time position maps, by the fused kernel:
        [B, Hq, D] float32, or None where it cannot serve (another storage, no kernel, unsupported shapes).

        q [B, Hq, V, D]: V rotated variants of each query head (for scales: rotated at p / ratios[h], times the
        attention scaling); ratios [Hq] or None: query head h reads key positions t / ratios[h] (Ms-PoE; None: the
        slots' own positions); seg [B|1, T] ints in [0, V) or None: the variant each key is scored with (PINE's
        per-document offsets; None: variant 0); mask None or additive float32 [B|1, T] or [B|1, Hq, T] (one row
        per query head: PINE's window at each head's read distances); state: a read state shared by calls
        (default: the running forward's, whose tables its layers share); positions [B, T] int64 or None:
        the keys read at these positions instead of their slots' (a piecewise distance map,
        kvpos.posmap.window_decode_map; not with ratios). Float64 reference: `kvpos.reference.decode_heads_ref`."""
        if positions is not None and ratios is not None:
            fail("decode_mapped", "ratios or positions (one map at a time)", "both")
        got = self._raw_read(index, state)
        if got is None:
            return None
        l, st = got
        spec, R, inter = l.spec, l.spec.rotary_dim, l.spec.layout is RopeLayout.INTERLEAVED
        k, v = l.raw_k[:, :, : l.n], l.v[:, :, : l.n]
        if ratios is None:
            cos, sin = (st.scaled_cos_sin(spec, self.table.pos, l.slot_device) if positions is None
                        else st.mapped_cos_sin(spec, positions))
            table = torch.zeros(q.shape[1], dtype=torch.long)
            return decode_heads_kernel(q, k, v, cos[None], sin[None], table, seg, mask, scale, R, inter)
        key, table = st.head_rows(ratios)
        fac = st.factored(spec, key, self.table.pos, self.map_tables)
        if fac is not None:
            return decode_heads_kernel(q, k, v, fac[0], fac[1], table, seg, mask, scale, R, inter,
                                       fpos=self.table.pos[:, : l.n])
        vals = torch.tensor(key, dtype=torch.float64)
        cos, sin = scaled_cos_sin(self.table.pos[:, : l.n], vals, spec)         # [B, Rt, T, R/2]: full tables
        s = spec.attention_scaling
        return decode_heads_kernel(q, k, v, (cos * s).transpose(0, 1), (sin * s).transpose(0, 1), table, seg, mask,
                                   scale, R, inter)
