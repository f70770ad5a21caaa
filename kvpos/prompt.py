"""Prompts as pieces: anchor / passage chunks / question token ids, split out of a chat template.

Letters: A anchor tokens · S_i chunk i's tokens · Q question tokens.

    anchor   = <system prompt><user header>            cached once at positions 0.., shared by every chunk
    chunk_i  = passage_i + separator                   stored, position-independent
    question = "Question: ..." <end of user><assistant header>   computed per request

The full prompt is exactly anchor + chunks + question, so full prefill and every reuse method see identical token
ids. `tokenizer` is anything with apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) and
__call__(text, add_special_tokens=False).input_ids (a transformers tokenizer); nothing here imports an engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ._checks import fail

__all__ = ["PromptParts", "ChatPromptBuilder"]

_SENTINEL = "\u2063KVPOS_CONTENT\u2063"


@dataclass
class PromptParts:
    """Token ids of one request: anchor [A], chunks [S_i] each, question [Q]."""

    anchor: torch.Tensor
    chunks: list[torch.Tensor]
    question: torch.Tensor

    def full_ids(self, order: Sequence[int] | None = None) -> torch.Tensor:
        """[1, A + sum S_i + Q] ids of the plain prompt (chunks in `order`)."""
        chunks = self.chunks if order is None else [self.chunks[i] for i in order]
        return torch.cat([self.anchor, *chunks, self.question])[None]


class ChatPromptBuilder:
    """Split a chat-template prompt into anchor / passage chunks / question token ids."""

    def __init__(self, tokenizer: Any, system_prompt: str | None = None, passage_sep: str = "\n\n",
                 question_prefix: str = "Question: ", passages_header: str = "", turns: bool = True) -> None:
        """turns=False: all passages and the question in one user message, passages separated by `passage_sep`.
        turns=True (default): every passage is its own user message (a chunk ends with the template's end-of-turn
        + next-user header), so each chunk starts exactly where the anchor ends in the full prompt too; independently
        encoded chunks stay much closer to full prefill that way (measured in results/rag_eval*.md)."""
        self.tok = tokenizer
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
        msgs.append({"role": "user", "content": _SENTINEL})
        if turns:
            msgs.append({"role": "user", "content": _SENTINEL})
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        want = 2 if turns else 1
        if text.count(_SENTINEL) != want:
            fail("chat template", f"{want} user-content slot(s)", f"{text.count(_SENTINEL)} occurrences")
        pieces = text.split(_SENTINEL)
        head, tail = pieces[0], pieces[-1]
        self.anchor_text = head + passages_header
        self.tail_text = tail
        self.sep = pieces[1] if turns else passage_sep
        self.turns = turns
        self.question_prefix = question_prefix
        self.anchor_ids = self._ids(self.anchor_text)

    def _ids(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tok(text, add_special_tokens=False).input_ids, dtype=torch.long)

    def chunk_ids(self, passage: str) -> torch.Tensor:
        if not isinstance(passage, str) or not passage.strip():
            fail("passage", "a non-empty string", repr(passage)[:40])
        return self._ids(passage.strip() + self.sep)   # turns: the end-of-turn + next user header close the chunk

    def question_ids(self, question: str, answer_prefix: str = "") -> torch.Tensor:
        if not isinstance(question, str) or not question.strip():
            fail("question", "a non-empty string", repr(question)[:40])
        return self._ids(self.question_prefix + question.strip() + self.tail_text + answer_prefix)

    def parts(self, passages: Sequence[str], question: str) -> PromptParts:
        if isinstance(passages, str) or not passages:
            fail("passages", "a non-empty list of strings", type(passages).__name__ if passages else "[]")
        return PromptParts(self.anchor_ids, [self.chunk_ids(p) for p in passages], self.question_ids(question))
