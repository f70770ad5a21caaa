"""The model's confidence while it generates: the margin of every greedy step, and a stop once one falls too low.

    watch = MarginWatch(floor=1.0)
    out = generate(model, cache, ids, max_new_tokens=32, **watch.gen_kwargs({}))   # adds the processor and the stop
    watch.margins    # [steps] log p(top 1) - log p(top 2) in nats, row 0
    watch.low        # True once a step's margin fell below floor (generation stopped there)

A small margin is where a small change to the cache can change the greedy token; EditSession.complete uses it to
decide when an approximate edit's output needs the exact recompute.
"""
from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from kvpos._checks import fail


class MarginWatch(LogitsProcessor):
    """Record each step's margin (nats) of row 0; `low` turns True at the first step whose margin is below `floor`
    (floor 0: only records). Scores pass through unchanged. One watch per generate call (it keeps the margins)."""

    def __init__(self, floor: float = 0.0) -> None:
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= float(floor) < float("inf"):
            fail("MarginWatch floor", "a finite number of nats >= 0 (0 = record only)", floor)
        self.floor = float(floor)
        self.margins: list[float] = []
        self.low = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """scores: [B, V] the step's next-token scores (row 0 is watched). Returns scores unchanged."""
        top = scores[0].topk(2).values.double()     # log-softmax's normalizer cancels in the difference
        m = float(top[0] - top[1])
        self.margins.append(m)
        if m < self.floor:
            self.low = True
        return scores

    def gen_kwargs(self, kwargs: dict) -> dict:
        """A copy of generate keyword arguments with this watch appended to `logits_processor` and its stop to
        `stopping_criteria` (lists the caller gave are kept, in front)."""
        kw = dict(kwargs)
        kw["logits_processor"] = LogitsProcessorList([*(kw.get("logits_processor") or []), self])
        kw["stopping_criteria"] = StoppingCriteriaList([*(kw.get("stopping_criteria") or []), self.stopper()])
        return kw

    def stopper(self) -> StoppingCriteria:
        """A stopping criterion that ends generation once this watch has seen a low margin."""
        return _StopWhenLow(self)


class _StopWhenLow(StoppingCriteria):
    def __init__(self, watch: MarginWatch) -> None:
        self.watch = watch

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.watch.low, dtype=torch.bool, device=input_ids.device)
