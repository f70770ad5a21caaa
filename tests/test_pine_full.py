"""PINE's full form (integrations/pine.py: pine_prefill + PineDocPhase, then PineLiteBackend for the question and
answer): equal to a float64 reference that writes PINE's document phase out from its definition (importance without
RoPE, the ranking, every key's position), identical logits under every order of 4 documents, and plain attention
when there is one document."""
import itertools

import pytest
import torch

from kvpos.reference import distance_attend_ref, unrotate_ref
from kvpos.integrations.compose import ChunkComposer
from kvpos.integrations.hf import AttentionCall, PositionedCache, extend
from kvpos.integrations.pine import PineLiteBackend, pine_prefill

from test_pine import ExplicitPine, _setup


class ExplicitPineDocs:
    """Reference for the document phase, float64, head by head and document by document: the rows of document i
    score the keys of the OTHER documents without RoPE (softmax), average per document, sum over i's rows; i is
    ranked first, the others by that importance (descending, ties by index); document j's keys move back by the
    sizes ranked before it; attention at the resulting explicit distances under the call's mask."""

    needs_cache = True

    def __init__(self, sizes, config):
        self.sizes, self.config = sizes, config

    def __call__(self, call, binding):
        cache = binding.cache_layer_keys(call)
        layer = cache.layers[call.layer]
        B, Hq, Lq, _ = call.query.shape
        N = call.key.shape[2]
        P, n = N - Lq, len(self.sizes)
        pos = cache.table.pos[:, :N]
        q_raw = unrotate_ref(call.query, pos[:, P:], layer.spec)
        k_raw, v = layer.raw_keys.double(), layer.values.double()
        g = Hq // k_raw.shape[1]
        first = [P + sum(self.sizes[:i]) for i in range(n)]
        slots = {d: list(range(first[d], first[d] + self.sizes[d])) for d in range(n)}
        doc_of = {s: d for d in range(n) for s in slots[d]}
        # the layout's visibility (prefix, other documents, own document causally); a sliding layer's window is
        # applied below at the explicit distances
        allowed = torch.tensor([[s < P or doc_of[s] != doc_of[P + r] or s <= P + r for s in range(N)]
                                for r in range(Lq)])[None, None]
        types = getattr(self.config, "layer_types", None)
        window = self.config.sliding_window if types and types[call.layer] == "sliding_attention" else None
        out = torch.zeros(B, Hq, Lq, v.shape[-1], dtype=torch.float64)
        for h in range(Hq):
            kh, vh = k_raw[:, h // g: h // g + 1], v[:, h // g: h // g + 1]
            for i in range(n):
                others = [s for s in range(P, N) if doc_of[s] != i]
                imp = [0.0] * n
                for r in slots[i]:
                    a = torch.softmax(torch.stack([q_raw[0, h, r - P] @ kh[0, 0, s] for s in others]) * call.scaling, 0)
                    for j in range(n):
                        if j != i:
                            imp[j] += sum(float(a[others.index(s)]) for s in slots[j]) / len(slots[j])
                shift, before = {}, 0
                for j in [i] + sorted((j for j in range(n) if j != i), key=lambda j: (-imp[j], j)):
                    shift[j], before = before, before + self.sizes[j]
                rows = [r - P for r in slots[i]]
                dist = torch.zeros(1, len(rows), N, dtype=torch.long)
                for a_, r in enumerate(slots[i]):
                    for s in range(N):
                        dist[0, a_, s] = int(pos[0, r]) - (int(pos[0, s]) - shift.get(doc_of.get(s), 0))
                ok = allowed[:, 0][:, rows] & (dist < window) if window is not None else allowed[:, 0][:, rows]
                out[:, h:h + 1, rows] = distance_attend_ref(q_raw[:, h:h + 1, rows], kh, vh, dist,
                                                            ok, layer.spec, call.scaling)
        return AttentionCall.finish(out.to(call.query.dtype))


def _reference_prefill(model, prefix, docs):
    """PINE's layout written out here: prefix at 0..P-1, document j at E-|Dj|..E-1, rows seeing the prefix, every
    other document and their own causally; the document phase under ExplicitPineDocs."""
    cache = PositionedCache.from_model(model)
    P = prefix.shape[1]
    extend(model, cache, prefix)
    sizes = [len(d) for d in docs]
    E, S = P + sum(sizes), sum(sizes)
    pos, seen = [], torch.zeros(S, S, dtype=torch.bool)
    at = 0
    for n in sizes:
        pos += list(range(E - n, E))
        seen[at:at + n, :] = True
        seen[at:at + n, at:at + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        at += n
    mask = torch.cat([torch.ones(S, P, dtype=torch.bool), seen], 1)[None, None]
    extend(model, cache, torch.cat(docs)[None], positions=torch.tensor([pos]), attention_mask=mask,
           attention=ExplicitPineDocs(sizes, model.config))
    at = P
    for j, n in enumerate(sizes):
        cache.set_segment_(at, at + n, 16 + j)
        at += n
    return cache


def _ask(model, cache, q, backend, steps=2):
    logits = [extend(model, cache, q, attention=backend)[0]]
    for _ in range(steps):
        logits.append(extend(model, cache, logits[-1][-1].argmax()[None, None], attention=backend)[0])
    return torch.cat(logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma3"])
def test_pine_equals_the_explicit_reference_of_its_document_phase_and_question(arch):
    model, _, docs, q = _setup(arch, seed=2)
    prefix = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(9))
    got = _ask(model, pine_prefill(model, prefix, docs), q, PineLiteBackend())
    want = _ask(model, _reference_prefill(model, prefix, docs), q, ExplicitPine(model.config))
    assert (got - want).abs().max() < 1e-4, float((got - want).abs().max())
    lite, _ = ChunkComposer(model, prefix[0]).compose(docs, layout="sequential")   # documents encoded apart
    assert (_ask(model, lite, q, PineLiteBackend()) - got).abs().max() > 1e-3   # the document phase matters


@pytest.mark.parametrize("arch,storage", [("llama", None), ("cohere", None), ("llama", "raw"), ("gemma3", None)])
def test_pine_answers_do_not_depend_on_the_order_of_the_documents(arch, storage):
    model, _, docs, q = _setup(arch)
    prefix = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(9))
    first = _ask(model, pine_prefill(model, prefix, docs, storage=storage), q, PineLiteBackend())
    worst = 0.0
    for perm in itertools.permutations(range(4)):
        got = _ask(model, pine_prefill(model, prefix, [docs[i] for i in perm], storage=storage), q, PineLiteBackend())
        worst = max(worst, float((got - first).abs().max()))
    assert worst <= 1e-5, worst


def test_one_document_is_plain_attention():
    model, _, docs, q = _setup("llama")
    prefix = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(9))
    got = _ask(model, pine_prefill(model, prefix, docs[:1]), q, PineLiteBackend(), steps=0)
    plain = PositionedCache.from_model(model)
    extend(model, plain, torch.cat([prefix[0], docs[0]])[None])
    assert (got - extend(model, plain, q)[0]).abs().max() < 1e-5


def test_bad_inputs_are_named():
    model, _, docs, _ = _setup("llama")
    with pytest.raises(ValueError, match="pine_prefill prefix_ids"):
        pine_prefill(model, torch.tensor([1, 2]), docs)
    with pytest.raises(ValueError, match="pine_prefill docs"):
        pine_prefill(model, torch.tensor([[1, 2]]), [docs[0], torch.tensor([], dtype=torch.long)])


@pytest.mark.parametrize("n", [3, 20])            # 20 > the head width 16: the values wider than the keys
def test_the_fused_softmax_mass_equals_the_float64_reference(n):
    """kvpos.posmap.softmax_mass (the document phase's importance through one fused attention with one-hot values)
    against segment_mass_ref row by row: grouped-query heads, slots in no group, per-head masks, a row that sees
    nothing (zeros)."""
    from kvpos.posmap import softmax_mass
    from kvpos.reference import segment_mass_ref

    g = torch.Generator().manual_seed(3)
    B, H, G, Lq, N, D = 2, 2, 3, 5, 40, 16
    q = torch.randn(B, H * G, Lq, D, generator=g)
    k = torch.randn(B, H, N, D, generator=g)
    group = torch.randint(-1, n, (B, N), generator=g)
    allowed = torch.rand(B, H * G, Lq, N, generator=g) > 0.3
    allowed[1, 4, 2] = False                       # this row sees no key
    got = softmax_mass(q, k.repeat_interleave(G, 1), group, n, 0.3, allowed)
    for r in range(Lq):
        want = segment_mass_ref(q[:, :, r], k, group, n, allowed[:, :, r], 0.3)
        assert torch.allclose(got[:, :, r].double(), want, atol=1e-6), (r, (got[:, :, r].double() - want).abs().max())
    assert torch.equal(got[1, 4, 2], torch.zeros(n))
