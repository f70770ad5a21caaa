"""Document orders for a context of n slots: the attention basin (AttnRank) and the fixed reorders RAG frameworks
ship. Pure functions of tensors and lists; the profile's attention mass is measured by the engine glue
(kvpos.integrations.attnrank).

Letters: L layers · n document slots (slot s = the s-th document of the prompt, 0 = first).

AttnRank ("Attention Basin", arXiv 2508.05128): over probe questions, a_l(s) = the question's attention mass on the
document in slot s at layer l, normalised to sum 1 per layer. A layer is a basin when its edge slots draw more
than `tau` times the interior's mean: edge_ratio = min(a(first), a(last)) / mean(a(interior)). The shallowest
basin layer sets the slot order (slots by descending a); the rank-r document goes to slot order[r].
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence, TypeVar

import torch

from ._checks import fail

__all__ = ["AttentionBasin", "place", "lim_order", "ORDERS", "order_for"]

T = TypeVar("T")
ORDERS = ("random", "descending", "ascending", "lim", "attnrank")


@dataclass
class AttentionBasin:
    """Per-layer attention mass over n document slots, accumulated over probe questions (`add`)."""

    n: int
    total: torch.Tensor | None = None
    probes: int = 0

    def add(self, mass: torch.Tensor) -> None:
        """One probe's mass [L, n] (any scale: normalised per layer here)."""
        if mass.dim() != 2 or mass.shape[1] != self.n:
            fail("AttentionBasin.add mass", f"[L, n={self.n}]", list(mass.shape))
        m = mass.double() / mass.double().sum(1, keepdim=True).clamp_min(1e-30)
        self.total = m if self.total is None else self.total + m
        self.probes += 1

    def profile(self) -> torch.Tensor:
        """[L, n] float64: mean over probes, each layer summing to 1."""
        if self.total is None:
            fail("AttentionBasin.profile", "at least one probe added", "none")
        return self.total / self.probes

    def edge_ratio(self) -> torch.Tensor:
        """[L]: min(first, last) / mean(interior) per layer (n >= 3)."""
        if self.n < 3:
            fail("AttentionBasin edge_ratio", "n >= 3 slots (an interior)", self.n)
        a = self.profile()
        return torch.minimum(a[:, 0], a[:, -1]) / a[:, 1:-1].mean(1)

    def basin_layer(self, tau: float = 1.5) -> int:
        """The shallowest layer with edge_ratio >= tau; the layer with the largest ratio when none reaches it."""
        r = self.edge_ratio()
        hit = torch.nonzero(r >= tau).flatten()
        return int(hit[0]) if hit.numel() else int(r.argmax())

    def slot_order(self, layer: int | None = None, tau: float = 1.5) -> list[int]:
        """Slots by descending mass at `layer` (default: the basin layer): where the rank-r document goes."""
        a = self.profile()[self.basin_layer(tau) if layer is None else layer]
        return torch.argsort(-a, stable=True).tolist()


def place(ranked: Sequence[T], slot_order: Sequence[int]) -> list[T]:
    """The documents `ranked` (most relevant first) laid out so the rank-r one sits in slot slot_order[r]."""
    if sorted(slot_order) != list(range(len(ranked))):
        fail("place slot_order", f"a permutation of 0..{len(ranked) - 1}", list(slot_order))
    out: list = [None] * len(ranked)
    for r, s in enumerate(slot_order):
        out[s] = ranked[r]
    return out


def lim_order(n: int) -> list[int]:
    """"Lost in the middle" reorder (LangChain's LongContextReorder, Haystack's LostInTheMiddleRanker): ranks
    alternate between the two ends, the most relevant first, the second last, the least relevant in the middle."""
    left, right = [], []
    for r in range(n):
        (left if r % 2 == 0 else right).append(r)
    slots = left + right[::-1]                       # slots in order hold ranks: 0, 2, 4, ..., 5, 3, 1
    return [slots.index(r) for r in range(n)]


def order_for(name: str, n: int, basin: AttentionBasin | None = None, seed: int = 0, tau: float = 1.5
              ) -> list[int]:
    """slot_order of a named order (ORDERS): random (seeded), descending (best first), ascending (best last), lim,
    attnrank (needs the basin)."""
    if name == "random":
        return random.Random(seed).sample(range(n), n)
    if name == "descending":
        return list(range(n))
    if name == "ascending":
        return list(range(n))[::-1]
    if name == "lim":
        return lim_order(n)
    if name == "attnrank":
        if basin is None or basin.n != n:
            fail("order_for attnrank", f"an AttentionBasin profiled over {n} slots", basin)
        return basin.slot_order(tau=tau)
    fail("order_for name", f"one of {ORDERS}", repr(name))
