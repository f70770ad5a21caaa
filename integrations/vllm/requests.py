"""Requests for the kvpos connector: prompt token ids and the kv_transfer_params that say where anchor and
passages are. No engine import: build requests anywhere, send them to any vLLM with the connector.

    rb = RequestBuilder(tokenizer)                         # the model's chat template, one user turn per passage
    prompt, params = rb.request(passages, question)        # {"prompt_token_ids": [...], "cache_salt": "kvpos:.."},
                                                           # {"kvpos": {...}}
    llm.generate(prompt, SamplingParams(max_tokens=32, extra_args={"kv_transfer_params": params}))
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from kvpos.prompt import ChatPromptBuilder, PromptParts

from .params import kvpos_salt

__all__ = ["RequestBuilder", "segments_of"]


def segments_of(parts: PromptParts) -> list[list]:
    """[[0, A, "anchor"], [A, A + S1, "chunk"], ...] for the pieces of a prompt (the question is not a segment)."""
    out, pos = [[0, int(parts.anchor.numel()), "anchor"]], int(parts.anchor.numel())
    for c in parts.chunks:
        out.append([pos, pos + int(c.numel()), "chunk"])
        pos += int(c.numel())
    return out


class RequestBuilder:
    """Chat-template requests whose passages the connector can reuse from the kvpos store (see ChatPromptBuilder
    for the layout; turns=True puts each passage in its own user message).

    lead: passages every stored passage is encoded after and no prompt holds (as RagPipeline(lead=...)):
    `precompute_request` puts them in the anchor segment (anchor + lead + passage), `request` names their ids, so
    the connector loads the chunks encoded after anchor + lead."""

    def __init__(self, tokenizer: Any, system_prompt: str | None = None, turns: bool = True,
                 lead: Sequence[str] = (), **kw: Any) -> None:
        self.builder = ChatPromptBuilder(tokenizer, system_prompt, turns=turns, **kw)
        if isinstance(lead, str):
            raise TypeError("RequestBuilder lead: expected a sequence of passage strings, got a str")
        self.lead_ids: list[int] = [int(t) for p in lead for t in self.builder.chunk_ids(p).tolist()]

    def parts(self, passages: Sequence[str], question: str) -> PromptParts:
        return self.builder.parts(passages, question)

    def request(self, passages: Sequence[str], question: str, save: bool = True, salt: str = "",
                layout: str = "sequential", ape: tuple[float, float] | None = None) -> tuple[dict, dict]:
        """({"prompt_token_ids": ids, "cache_salt": ...}, kv_transfer_params) for passages + question; `salt`: the
        caller's own cache salt, appended to kvpos's (requests with other salts never share prefix-cache blocks);
        `layout`: "sequential" or "parallel"; `ape`: APE's (temperature, scale) over the passages (both need the
        kvpos attention backend)."""
        return self.from_parts(self.parts(passages, question), save, salt, layout, ape, self.lead_ids)

    @staticmethod
    def from_parts(parts: PromptParts, save: bool = True, salt: str = "", layout: str = "sequential",
                   ape: tuple[float, float] | None = None, lead: Sequence[int] = ()) -> tuple[dict, dict]:
        """The prompt (token ids and the cache salt that keeps loaded blocks apart from plain ones in vLLM's prefix
        cache, `salt` appended: a caller's own salt) and kv_transfer_params; `lead`: the ids the stored passages
        were encoded after, beyond the anchor."""
        ids = parts.full_ids()[0].tolist()
        segments = segments_of(parts)
        params: dict[str, Any] = {"segments": segments, "save": save}
        if layout != "sequential":
            params["layout"] = layout
        if ape is not None:
            params["ape"] = {"temperature": float(ape[0]), "scale": float(ape[1])}
        if lead:
            params["lead"] = [int(t) for t in lead]
        return ({"prompt_token_ids": ids, "cache_salt": kvpos_salt(segments, layout, ape, lead) + salt},
                {"kvpos": params})

    def precompute_request(self, passage: str) -> tuple[dict, dict]:
        """anchor (+ lead) + passage alone: the passage is computed right after them, so its KV is saved (under
        the store of chunks encoded after anchor + lead)."""
        anchor = torch.cat([self.builder.anchor_ids, torch.tensor(self.lead_ids, dtype=torch.long)])
        parts = PromptParts(anchor, [self.builder.chunk_ids(passage)], anchor[:0])
        return self.from_parts(parts, save=True)
