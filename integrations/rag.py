"""RAG integration: retrieved passages (strings) + a question -> an answer through `generate`, with chunk reuse.

No RAG framework is required: anything that returns a list of passage strings (a retriever, a vector DB query, a
search API) plugs in. Each passage is one chunk: tokenized on its own, its KV computed once and kept in the
ChunkStore, and placed at request time in the order the retriever returned.

Prompt (the model's chat template; a sentinel splits it into the pieces below):

    anchor   = <system prompt><user header>            cached once at positions 0.., shared by every chunk
    chunk_i  = passage_i + separator                   stored, position-independent
    question = "Question: ..." <end of user><assistant header>   computed per request

The full-prefill baseline (`answer_full`) runs the same token ids through a plain forward, so every comparison is
on identical tokens.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from kvpos._checks import check_fraction, fail
from kvpos.ape import ApeParams
from kvpos.prompt import ChatPromptBuilder, PromptParts
from kvpos.compose import LAYOUTS
from kvpos.integrations.ape import ApeBackend
from kvpos.integrations.hf.attention import layers_heads
from kvpos.integrations.mspoe import MsPoEBackend
from kvpos.integrations.pine import PineLiteBackend, pine_prefill
from kvpos.integrations.compose import ChunkComposer
from kvpos.integrations.repairs import chunks_read_most, query_aware_refresh, recompute_slots
from kvpos.cache import storage_mode
from kvpos.integrations.hf import PositionedCache, extend, generate

__all__ = ["PromptParts", "ChatPromptBuilder", "RagMethod", "RagPipeline", "RagAnswer", "ScoredAnswer", "FULL",
           "PREFIX"]

POSITIONS = ("ms_poe", "pine_lite", "pine")


@dataclass(frozen=True)
class RagMethod:
    """How a request is answered.

    layout "full": plain prefill of the whole prompt (no reuse); "prefix": exact prefix reuse as serving engines do
    it (the KV of the longest common token prefix with the previous prefix request is kept, the rest recomputed);
    "sequential" / "parallel": position-independent chunk reuse, with optional repairs: link_k (EPIC), recompute_ratio
    (CacheBlend), attn_ratio (query-aware: the question's attention over the composed cache picks that fraction of
    the chunk tokens, re-encoded in context before the question runs) and optional APE attention (ape: ApeParams).
    Repairs that re-encode in full context (sequential layout; each re-encoded slot reads every slot before it):
    tail_k (the last k tokens of every chunk), last_chunks (the m chunks nearest the question, whole),
    probe_chunks (the m chunks the question reads most, whole: see repairs.chunks_read_most, which scores every
    chunk at the same distance from the question).
    Order: link_k, recompute_ratio, tail_k, last_chunks / probe_chunks (one forward), attn_ratio.
    position: a read-time position policy (docs/positions.md): "ms_poe" (Ms-PoE, head order scored per request; with
    layout "full" the whole prompt runs under it, Ms-PoE's full form; with chunk reuse only the question and answer:
    read-time Ms-PoE), "pine_lite" (chunk reuse only: the question and answer read the chunks at importance-sorted
    positions, order-invariant) or "pine" (layout "full" only: PINE's full form, the passages prefilled together
    under its document phase, then the question and answer as in PINE-lite; integrations.pine.pine_prefill).
    lead: chunks encoded after the first `lead` lead passages of the pipeline (RagPipeline(lead=...)): every chunk
    has seen a passage before it when it is stored, as every chunk but the first has in the request (no cost per
    request; measured in docs/evaluation.md). 0: chunks encoded right after the anchor.
    storage: the request cache's PositionedCache storage ("rotated", "raw" or "int8": keys and values int8 in the
    cache; with "full" it holds the prompt and the question runs on top of it); "int8" refuses repairs and APE (they
    rewrite or re-read slots the quantized storage writes once)."""

    name: str
    layout: str = "sequential"
    link_k: int = 0
    recompute_ratio: float = 0.0
    ape: ApeParams | None = None
    attn_ratio: float = 0.0
    storage: str = "rotated"
    tail_k: int = 0
    last_chunks: int = 0
    probe_chunks: int = 0
    position: str | None = None
    lead: int = 0

    def __post_init__(self) -> None:
        if self.layout not in ("full", "prefix", *LAYOUTS):
            fail(f"RagMethod {self.name} layout", f"'full', 'prefix' or one of {LAYOUTS}", repr(self.layout))
        for knob in ("link_k", "tail_k", "last_chunks", "probe_chunks", "lead"):
            v = getattr(self, knob)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                fail(f"RagMethod {self.name} {knob}", "an int >= 0", v)
        object.__setattr__(self, "recompute_ratio", check_fraction(f"RagMethod {self.name} recompute_ratio",
                                                                   self.recompute_ratio))
        object.__setattr__(self, "attn_ratio", check_fraction(f"RagMethod {self.name} attn_ratio", self.attn_ratio))
        if self.ape is not None and not isinstance(self.ape, ApeParams):
            fail(f"RagMethod {self.name} ape", "None or an ApeParams", type(self.ape).__name__, exc=TypeError)
        if self.layout in ("full", "prefix") and (self.repairs or self.ape is not None or self.lead):
            fail(f"RagMethod {self.name}", f"no repairs, APE or lead with layout={self.layout!r} (it is exact)", self)
        if self.position not in (None, *POSITIONS):
            fail(f"RagMethod {self.name} position", f"None or one of {POSITIONS}", repr(self.position))
        if self.position is not None and (self.ape is not None or self.layout == "prefix"
                                          or (self.position == "pine_lite" and not self.reuses)
                                          or (self.position == "pine" and self.layout != "full")):
            fail(f"RagMethod {self.name} position", f"{self.position!r} without APE, with "
                 + {"pine_lite": "chunk reuse (documents composed apart)",
                    "pine": "layout 'full' (the passages prefilled together under PINE's document phase)"}.get(
                     self.position, "a layout other than 'prefix' (the exact baseline)"), self)
        storage_mode(self.storage, f"RagMethod {self.name} storage")
        if not self.mode.keeps_rotated and self.layout == "prefix":
            fail(f"RagMethod {self.name} storage", "'rotated' with layout='prefix' (the exact baseline)",
                 repr(self.storage))
        if self.mode.quantized and (self.repairs or self.ape is not None):
            fail(f"RagMethod {self.name}", "no repairs or APE with storage='int8' (they rewrite slots)", self)
        for knob in ("attn_ratio", "tail_k", "last_chunks", "probe_chunks"):
            if getattr(self, knob) and self.layout != "sequential":
                fail(f"RagMethod {self.name} {knob}", "layout='sequential' (re-encoded tokens attend to everything "
                     "before them)", repr(self.layout))

    @property
    def repairs(self) -> bool:
        """True when any repair re-encodes slots of the composed cache."""
        return bool(self.link_k or self.recompute_ratio or self.attn_ratio or self.tail_k or self.last_chunks
                    or self.probe_chunks)

    @property
    def mode(self):
        """The storage mode's capabilities (kvpos.cache.StorageMode)."""
        return storage_mode(self.storage)

    @property
    def reuses(self) -> bool:
        """True when chunks are composed from the store (not full, not prefix)."""
        return self.layout in LAYOUTS


FULL = RagMethod("full", layout="full")
PREFIX = RagMethod("prefix", layout="prefix")


@dataclass
class RagAnswer:
    """The answer and what it cost."""

    text: str
    token_ids: list[int]
    report: dict = field(default_factory=dict)


@dataclass
class ScoredAnswer(RagAnswer):
    """An answer with its scores (RagPipeline.answer_scored): first_logprobs [V] of the first answer token and the
    gold answer's mean per-token NLL."""

    first_logprobs: torch.Tensor | None = None
    gold_nll: float | None = None


class RagPipeline:
    """Answer questions over retrieved passages with position-independent chunk reuse.

    Defaults: sequential layout, no repairs (link_k, recompute_ratio off); their measured fidelity and cost are in
    results/rag_eval*.md and results/bench_ttft.md.

        rag = RagPipeline(model, tok)                                  # memory chunk store, sequential layout
        ans = rag.answer(retriever(query), query)                      # ans.text, ans.report
        ans.report  -> {"chunks_hit": 3, "chunks_missed": 1, "tokens_computed": 190, "tokens_reused": 840,
                        "ttft_s": ..., "total_s": ..., ...}

    `answer_parts(parts, method)` and `score(parts, method, ids)` are the one path every answer takes (the
    benchmarks call them too).

    lead: passages (strings; e.g. a few typical passages of the corpus, never the request's) that every chunk is
    encoded after and no request holds (RagMethod.lead; the pipeline's own method uses all of them). The store then
    holds chunks under the fingerprint of anchor + lead. `composer` serves the pipeline's own method;
    `composer_for(j)` the chunks encoded after the first j lead passages.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, system_prompt: str | None = None,
                 layout: str = "sequential", link_k: int = 0, recompute_ratio: float = 0.0, backend: Any = None,
                 store: Any = None, namespace: str = "default", builder: ChatPromptBuilder | None = None,
                 lead: Sequence[str] = (), **store_kw: Any) -> None:
        self.model, self.tok = model, tokenizer
        self.builder = builder if builder is not None else ChatPromptBuilder(tokenizer, system_prompt)
        if isinstance(lead, str):
            fail("RagPipeline lead", "a sequence of passage strings", "a str", exc=TypeError)
        self.lead_ids = [self.builder.chunk_ids(p) for p in lead]
        base = ChunkComposer(model, self.builder.anchor_ids, store=store, backend=backend, namespace=namespace,
                             **store_kw)
        self._composers = {0: base}
        self.method = RagMethod("default", layout, link_k if layout == "sequential" else 0, recompute_ratio,
                                lead=len(self.lead_ids) if layout in LAYOUTS else 0)
        self.composer = self.composer_for(self.method.lead)
        self._prefix: tuple[torch.Tensor, PositionedCache] | None = None   # the last prefix request: ids, prompt KV

    def composer_for(self, lead: int) -> ChunkComposer:
        """The composer of chunks encoded after the first `lead` lead passages (built on first use, same store
        backend)."""
        if isinstance(lead, bool) or not isinstance(lead, int) or not 0 <= lead <= len(self.lead_ids):
            fail("RagPipeline lead", f"an int in [0, {len(self.lead_ids)}] (the pipeline's lead passages)", lead,
                 "give RagPipeline(lead=[...]) enough passages")
        if lead not in self._composers:
            self._composers[lead] = self._composers[0].with_lead(torch.cat(self.lead_ids[:lead]))
        return self._composers[lead]

    def precompute(self, chunks: Sequence[Any], leads: Sequence[int] = (0,), progress: bool = False) -> int:
        """Compute and store every chunk not yet stored, for each lead count in `leads`; returns how many."""
        return sum(self.composer_for(j).precompute(chunks, progress=progress) for j in dict.fromkeys(leads))

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).strip()

    def _request(self, parts: PromptParts, method: RagMethod) -> tuple[Any, Any]:
        cache, info = self.composer_for(method.lead).compose(parts.chunks, layout=method.layout,
                                                             link_k=method.link_k,
                                                             recompute_ratio=method.recompute_ratio,
                                                             storage=method.storage)
        plan, ids = info.plan, torch.cat(parts.chunks)
        if method.tail_k:
            self._reencode(cache, info, ids, plan.tail_slots(method.tail_k))
        if method.last_chunks or method.probe_chunks:
            n = len(plan.slots)
            chosen = set(range(max(0, n - method.last_chunks), n))
            chosen |= set(chunks_read_most(self.model, cache, list(plan.slots), parts.question, method.probe_chunks))
            info.extra["reencoded_chunks"] = sorted(chosen)
            self._reencode(cache, info, ids, plan.slots_of(sorted(chosen)))
        if method.attn_ratio:
            slots = plan.chunk_slots()
            n = query_aware_refresh(self.model, cache, slots, ids, parts.question, method.attn_ratio,
                                    plan.allowed()[slots])
            info.tokens_computed += n
            info.tokens_reused -= n
        return cache, info

    def _reencode(self, cache: PositionedCache, info: Any, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Re-encode chunk `slots` in place, each reading every slot before it (the full-prefill pattern)."""
        n = recompute_slots(self.model, cache, slots, ids[slots - info.plan.anchor_len], info.plan.allowed()[slots])
        info.tokens_computed += n
        info.tokens_reused -= n

    def prime_prefix(self, parts: PromptParts) -> None:
        """Prefill a request's prompt and keep its KV as the prefix cache the next "prefix" request reuses from
        (what a serving engine keeps from the previous request)."""
        cache = PositionedCache.from_model(self.model)
        ids = parts.full_ids()[0]
        extend(self.model, cache, ids[None], last_logits=True)
        self._prefix = (ids, cache)

    def _prefix_request(self, ids: torch.Tensor) -> tuple[PositionedCache, torch.Tensor, int]:
        """(cache holding ids, logits of the recomputed tail, tokens reused): the longest common prefix with the last
        prefix request is kept, the rest recomputed (exact)."""
        lcp = 0
        if self._prefix is not None:
            prev_ids, prev = self._prefix
            n = min(prev_ids.numel(), ids.numel())
            diff = (prev_ids[:n] != ids[:n]).nonzero()
            lcp = min(int(diff[0]) if diff.numel() else n, ids.numel() - 1)
            cache = prev.copy(headroom=ids.numel() - lcp)
            cache.crop(lcp - cache.num_slots)
        else:
            cache = PositionedCache.from_model(self.model)
        logits = extend(self.model, cache, ids[None, lcp:], last_logits=True)
        return cache, logits, lcp

    def _attention(self, method: RagMethod) -> Any:
        """A new attention backend for one request of `method` (None: plain attention)."""
        if method.ape is not None:
            return ApeBackend(method.ape)
        if method.position == "ms_poe":
            return MsPoEBackend.scored(*layers_heads(self.model))
        return PineLiteBackend() if method.position in ("pine_lite", "pine") else None

    def _pine_prompt(self, parts: PromptParts, method: RagMethod) -> PositionedCache:
        """PINE's full form: anchor as the prefix, the passages prefilled together under its document phase."""
        return pine_prefill(self.model, parts.anchor[None], list(parts.chunks), storage=method.storage)

    @torch.no_grad()
    def score(self, parts: PromptParts, method: RagMethod, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [1, Q + E, V] over the question and `extra` token ids [E] (teacher forced after it), for a request
        built by `method` from a fresh cache: the first-token distribution is row Q - 1."""
        extra = torch.zeros(0, dtype=torch.long) if extra is None else torch.as_tensor(extra, dtype=torch.long)
        q = torch.cat([parts.question, extra])
        if method.position == "pine":
            cache, attention = self._pine_prompt(parts, method), self._attention(method)
            rows = [extend(self.model, cache, parts.question[None], attention=attention)]
            if extra.numel():
                rows.append(extend(self.model, cache, extra[None], attention=attention))
            return torch.cat(rows, 1)
        if not method.reuses and method.position:      # the prompt in one forward (Ms-PoE scores its last row)
            cache = PositionedCache.from_model(self.model, storage=method.storage)
            attention = self._attention(method)
            rows = [extend(self.model, cache, parts.full_ids(), attention=attention)[:, -parts.question.numel():]]
            if extra.numel():
                rows.append(extend(self.model, cache, extra[None], attention=attention))
            return torch.cat(rows, 1)
        if not method.reuses and not method.mode.keeps_rotated:       # the question on top of the stored prompt
            cache = PositionedCache.from_model(self.model, storage=method.storage)
            extend(self.model, cache, torch.cat([parts.anchor, *parts.chunks])[None])
            return extend(self.model, cache, q[None])
        if not method.reuses:                  # full and prefix are exact: the same logits
            ids = torch.cat([parts.full_ids(), extra[None]], 1)
            return self.model(ids).logits[:, ids.shape[1] - q.numel():]
        cache, _ = self._request(parts, method)
        attention = self._attention(method)
        if method.position and extra.numel():          # as answer_scored: a scored policy reads the question first
            return torch.cat([extend(self.model, cache, parts.question[None], attention=attention),
                              extend(self.model, cache, extra[None], attention=attention)], 1)
        return extend(self.model, cache, q[None], attention=attention)

    def _prompt(self, parts: PromptParts, method: RagMethod) -> tuple[PositionedCache, torch.Tensor, Any, dict]:
        """Build the request's cache with `method` and run the prompt's last tokens: (cache holding the whole prompt,
        logits [V] of its last row, the attention backend to continue with, report). report: tokens computed and
        reused, and for reuse methods chunks hit / missed, fetch_s, compose_s."""
        if not method.reuses:
            ids = parts.full_ids()[0]
            if method.layout == "prefix":
                cache, logits, reused = self._prefix_request(ids)
            elif method.position == "pine":
                cache, attention = self._pine_prompt(parts, method), self._attention(method)
                logits = extend(self.model, cache, parts.question[None], attention=attention, last_logits=True)
                return cache, logits[0, -1], attention, {"method": method.name, "tokens_computed": ids.numel(),
                                                         "tokens_reused": 0}
            else:
                cache, reused = PositionedCache.from_model(self.model, storage=method.storage), 0
                attention = self._attention(method)
                if method.mode.keeps_rotated or attention is not None:
                    logits = extend(self.model, cache, ids[None], last_logits=True, attention=attention)
                else:                          # as `score`: the prompt stored, then the question on top of it
                    extend(self.model, cache, ids[None, : ids.numel() - parts.question.numel()], last_logits=True)
                    logits = extend(self.model, cache, parts.question[None], last_logits=True)
                return cache, logits[0, -1], attention, {"method": method.name,
                                                         "tokens_computed": ids.numel() - reused,
                                                         "tokens_reused": reused}
            return cache, logits[0, -1], None, {"method": method.name, "tokens_computed": ids.numel() - reused,
                                                "tokens_reused": reused}
        cache, info = self._request(parts, method)
        attention = self._attention(method)
        logits = extend(self.model, cache, parts.question[None], attention=attention, last_logits=True)
        report = {"method": method.name, "chunks_hit": info.hits, "chunks_missed": info.misses,
                  "tokens_computed": info.tokens_computed + parts.question.numel(),
                  "tokens_reused": info.tokens_reused + parts.anchor.numel(), "layout": method.layout,
                  "link_k": method.link_k, "recompute_ratio": method.recompute_ratio, "fetch_s": info.fetch_s,
                  "compose_s": info.compose_s, **info.extra,
                  "store": asdict(self.composer_for(method.lead).store.stats) | {"events": []}}
        return cache, logits[0, -1], attention, report

    def _keep_prefix(self, parts: PromptParts, method: RagMethod, cache: PositionedCache) -> None:
        """A prefix request's prompt KV becomes the prefix cache of the next one (before tokens are generated)."""
        if method.layout == "prefix":
            self._prefix = (parts.full_ids()[0], cache.copy())

    @torch.no_grad()
    def answer_parts(self, parts: PromptParts, method: RagMethod, max_new_tokens: int = 48) -> RagAnswer:
        """Greedy answer to a tokenized request with `method`; report: chunks hit/missed, tokens computed/reused,
        ttft_s (request start to the first token), total_s."""
        t0 = time.perf_counter()
        cache, last, attention, report = self._prompt(parts, method)
        first = int(last.argmax())
        report["ttft_s"] = time.perf_counter() - t0
        self._keep_prefix(parts, method, cache)
        ids = self._continue(cache, first, max_new_tokens, attention)
        report["total_s"] = time.perf_counter() - t0
        return RagAnswer(self._decode(ids), ids, report)

    @torch.no_grad()
    def answer_scored(self, parts: PromptParts, method: RagMethod, gold: Any,
                      max_new_tokens: int = 48) -> "ScoredAnswer":
        """One request, answered and scored (what an evaluation needs, at the cost of one request): the greedy answer
        as `answer_parts` gives it (report["ttft_s"] times the prompt up to the first token), then the cache cut
        back to the prompt and the gold answer's token ids `gold` [G] teacher forced on it with the same attention.
        Returns the answer, the first-token log-probabilities [V] (float32) and the gold answer's mean per-token
        negative log-likelihood (nats)."""
        gold = torch.as_tensor(gold, dtype=torch.long).reshape(-1)
        if gold.numel() == 0:
            fail("answer_scored gold", "at least one token id", "an empty sequence")
        t0 = time.perf_counter()
        cache, last, attention, report = self._prompt(parts, method)
        first_lp = torch.log_softmax(last.float(), -1)
        first = int(first_lp.argmax())
        report["ttft_s"] = time.perf_counter() - t0
        self._keep_prefix(parts, method, cache)
        n = cache.num_slots
        ids = self._continue(cache, first, max_new_tokens, attention)
        report["total_s"] = time.perf_counter() - t0
        cache.crop(n - cache.num_slots)
        lps = first_lp[None]
        if gold.numel() > 1:
            more = extend(self.model, cache, gold[None, :-1], attention=attention)[0].float()
            lps = torch.cat([lps, torch.log_softmax(more, -1)])
        nll = float(-lps.gather(1, gold[:, None]).mean())
        return ScoredAnswer(self._decode(ids), ids, report, first_lp, nll)

    def _continue(self, cache: PositionedCache, first: int, max_new_tokens: int, attention: Any) -> list[int]:
        """Greedy tokens after the first one (which is not yet in the cache), up to max_new_tokens in all."""
        ids = [first]
        eos = self.tok.eos_token_id
        if max_new_tokens > 1 and first != eos:
            out = generate(self.model, cache, torch.tensor([[first]]), attention=attention,
                           max_new_tokens=max_new_tokens - 1, do_sample=False, pad_token_id=eos)
            ids += out[0, 1:].tolist()
        return ids

    def answer(self, passages: Sequence[str], question: str, max_new_tokens: int = 48, **overrides: Any) -> RagAnswer:
        """Greedy answer using cached chunks (computed and stored on a miss). overrides: layout / link_k /
        recompute_ratio for this request."""
        parts = self.builder.parts(passages, question)
        m = self.method
        layout = overrides.pop("layout", m.layout)
        method = RagMethod("request", layout, overrides.pop("link_k", m.link_k if layout == "sequential" else 0),
                           overrides.pop("recompute_ratio", m.recompute_ratio),
                           lead=m.lead if layout in LAYOUTS else 0)
        if overrides:
            fail("answer overrides", "layout / link_k / recompute_ratio", sorted(overrides), exc=TypeError)
        return self.answer_parts(parts, method, max_new_tokens)

    def answer_full(self, passages: Sequence[str], question: str, max_new_tokens: int = 48) -> RagAnswer:
        """The baseline: plain full prefill of the same token ids, greedy."""
        return self.answer_parts(self.builder.parts(passages, question), FULL, max_new_tokens)
