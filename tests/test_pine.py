"""PINE-lite (integrations/pine.py, kvpos.posmap offsets): answers identical under every order of the documents,
and equal to a float64 reference that builds each head's and query's document positions explicitly."""
import itertools

import pytest
import torch

from kvpos.posmap import pine_shifts
from kvpos.reference import distance_attend_ref, unrotate_ref
from kvpos.integrations.compose import ChunkComposer
from kvpos.integrations.hf import AttentionCall, extend
from kvpos.integrations.hf.testing import tiny_model
from kvpos.integrations.pine import PineLiteBackend, document_layout


def _setup(arch, n_docs=4, seed=0):
    """gemma3: its tiny model's sliding window of 8 on layer 0, narrower than the documents (PINE then moves the
    window to the positions it reads keys at)."""
    model = tiny_model(arch)[0]
    g = torch.Generator().manual_seed(seed)
    anchor = torch.randint(3, 128, (5,), generator=g)
    docs = [torch.randint(3, 128, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g)
            for _ in range(n_docs)]
    return model, ChunkComposer(model, anchor), docs, torch.randint(3, 128, (1, 4), generator=g)


def _answer(model, composer, docs, q, backend, steps=2, storage=None):
    cache, _ = composer.compose(docs, layout="sequential", storage=storage)
    logits = [extend(model, cache, q, attention=backend)[0]]
    for _ in range(steps):
        logits.append(extend(model, cache, logits[-1][-1].argmax()[None, None], attention=backend)[0])
    return torch.cat(logits)


@pytest.mark.parametrize("arch,storage", [("llama", None), ("qwen2", None), ("phi3", None), ("cohere", None),
                                          ("llama", "raw"), ("gemma3", None), ("gemma3", "raw")])
def test_pine_lite_answers_do_not_depend_on_the_order_of_the_documents(arch, storage):
    """storage="raw": the decode steps through the fused kernel, invariant too."""
    model, composer, docs, q = _setup(arch)
    first = _answer(model, composer, docs, q, PineLiteBackend(), storage=storage)
    plain = [_answer(model, composer, docs, q, None, steps=0)]
    worst = 0.0
    for perm in itertools.permutations(range(4)):
        got = _answer(model, composer, [docs[i] for i in perm], q, PineLiteBackend(), storage=storage)
        worst = max(worst, float((got - first).abs().max()))
        if len(plain) < 3:
            plain.append(_answer(model, composer, [docs[i] for i in perm], q, None, steps=0))
    assert worst <= 1e-5, worst
    assert max(float((p - plain[0]).abs().max()) for p in plain[1:]) > 1e-3      # plain reuse does depend on it


class ExplicitPine:
    """Reference: per head and query row, document importance from raw q.k in float64, documents sorted, each key's
    position written out, attention at explicit distances (kvpos.reference.distance_attend_ref), head by head."""

    needs_cache = True

    def __init__(self, config):
        self.config = config

    def __call__(self, call, binding):
        cache = binding.cache_layer_keys(call)
        layer = cache.layers[call.layer]
        B, Hq, Lq, _ = call.query.shape
        N = call.key.shape[2]
        pos, seg = cache.table.pos[:, :N], cache.table.segment[:, :N]
        doc = [int(s) - 16 if s >= 16 else -1 for s in seg[0].tolist()]
        n = max(doc) + 1
        slots = {d: [j for j in range(N) if doc[j] == d] for d in range(n)}
        start = {d: int(pos[0, slots[d][0]]) for d in range(n)}
        end = max(start[d] + len(slots[d]) for d in range(n))             # where the documents end
        q_raw = unrotate_ref(call.query, pos[:, N - Lq:], layer.spec)
        k_raw, v = layer.raw_keys.double(), layer.values.double()
        cfg = self.config
        window = cfg.sliding_window if (getattr(cfg, "layer_types", None) or [""] * 99)[call.layer] == \
            "sliding_attention" else None
        # every earlier slot (no hidden slots here): importance over all of them, the window at the read distances
        allowed = (torch.arange(N)[None] <= torch.arange(N - Lq, N)[:, None])[None, None]
        g = Hq // k_raw.shape[1]
        out = torch.zeros(B, Hq, Lq, v.shape[-1], dtype=torch.float64)
        for h in range(Hq):
            kh = k_raw[:, h // g: h // g + 1]
            dist = torch.zeros(1, Lq, N, dtype=torch.long)
            for i in range(Lq):
                raw = (q_raw[0, h, i] @ kh[0, 0].T) * call.scaling
                in_docs = [j for j in range(N) if doc[j] >= 0 and bool(allowed[0, 0, i, j])]
                a = torch.softmax(raw[in_docs], 0)
                imp = {d: sum(float(a[in_docs.index(j)]) for j in slots[d]) / len(slots[d]) for d in range(n)}
                new_end, new_start = end, {}
                for d in sorted(range(n), key=lambda d: (-imp[d], d)):
                    new_start[d] = new_end - len(slots[d])
                    new_end = new_start[d]
                p = int(pos[0, N - Lq + i])
                for j in range(N):
                    t = int(pos[0, j]) if doc[j] < 0 else new_start[doc[j]] + int(pos[0, j]) - start[doc[j]]
                    dist[0, i, j] = p - t
            ok = allowed[:, 0] & (dist < window) if window is not None else allowed[:, 0]
            out[:, h:h + 1] = distance_attend_ref(q_raw[:, h:h + 1], kh, v[:, h // g: h // g + 1], dist,
                                                  ok, layer.spec, call.scaling)
        return AttentionCall.finish(out.to(call.query.dtype))


@pytest.mark.parametrize("arch,storage", [("llama", None), ("phi3", None), ("cohere", None), ("llama", "raw"),
                                          ("phi3", "raw"), ("qwen2", "raw"), ("gemma3", None), ("gemma3", "raw")])
def test_pine_lite_equals_the_explicit_position_reference_in_prefill_and_decode(arch, storage):
    """storage="raw": decode steps run the importance kernel and the fused position-map kernel (the counts say so)."""
    model, composer, docs, q = _setup(arch, seed=1)
    backend = PineLiteBackend()
    got = _answer(model, composer, docs, q, backend, storage=storage)
    layers = model.config.num_hidden_layers                # sliding-window layers too: one mask row per head
    assert backend.read_counts["fused"] == (2 * layers if storage == "raw" else 0)
    assert backend.importance_counts["fused"] == (2 * layers if storage == "raw" else 0)   # the importance kernel
    want = _answer(model, composer, docs, q, ExplicitPine(model.config))
    assert (got - want).abs().max() < 1e-4, float((got - want).abs().max())


def test_pine_lite_decode_lays_out_each_step_once_and_sees_what_changed_between_steps(monkeypatch):
    """The per-step arguments of the decode kernel (documents, mask, tables) are laid out once per forward and
    shared by its layers; a later step after the cache changed (a document moved, a slot hidden) is laid out again:
    the backend kept across those steps answers as a fresh one does."""
    import kvpos.cache.reads as reads
    model, composer, docs, q = _setup("llama", seed=1)
    built = []
    real = reads.pine_plan
    monkeypatch.setattr(reads, "pine_plan", lambda *a, **k: built.append(1) or real(*a, **k))
    cache, _ = composer.compose(docs, layout="sequential", storage="raw")
    kept = PineLiteBackend()
    extend(model, cache, q, attention=kept)
    tok = torch.tensor([[7]])
    extend(model, cache, tok, attention=kept)
    assert len(built) == 1                           # one decode forward: one layout for all its layers
    assert kept.read_counts["fused"] == model.config.num_hidden_layers
    first = cache.table.pos[0].tolist().index(5)     # the first document slot (after the 5 anchor tokens)
    for change in (lambda c: c.shift_(first, first + 2, -1), lambda c: c.hide_(first + 2, first + 3)):
        change(cache)
        fresh_cache = cache.copy()
        got = extend(model, cache, tok, attention=kept)
        want = extend(model, fresh_cache, tok, attention=PineLiteBackend())
        assert torch.equal(got, want)
        stale = extend(model, cache.copy(), tok, attention=None)
        assert (got - stale).abs().max() > 1e-4      # the policy still acts after the change
    assert len(built) == 5                           # each step laid out again (kept and fresh backends)


def test_pine_shifts_put_the_most_important_document_last_and_pack_the_rest_before_it():
    imp = torch.tensor([[[[0.1, 0.7, 0.2]]]])                                  # doc 1, then doc 2, then doc 0
    start, size, end = torch.tensor([[5, 8, 15]]), torch.tensor([[3, 7, 4]]), torch.tensor([19])
    shift = pine_shifts(imp, start, size, end)[0, 0, 0]
    new_start = (start[0] + shift).tolist()
    assert new_start == [5, 12, 8]                 # doc 1 ends at 19, doc 2 ends at 12, doc 0 ends at 8


def test_document_layout_and_refusals():
    seg = torch.tensor([[1, 1, 16, 16, 17, 0]])
    pos = torch.tensor([[0, 1, 2, 3, 2, 4]])
    doc, n, start, size, end = document_layout(seg, pos)
    assert doc.tolist() == [[-1, -1, 0, 0, 1, -1]] and n == 2
    assert start.tolist() == [[2, 2]] and size.tolist() == [[2, 1]]
    assert end.tolist() == [4]                    # documents at overlapping positions end where the last one ends
    _, _, _, _, end = document_layout(torch.tensor([[1, 16, 16, 17, 17, 17]]), torch.tensor([[0, 1, 2, 3, 4, 5]]))
    assert end.tolist() == [6]                    # sequential: the first start + all document tokens
    with pytest.raises(ValueError, match="PINE-lite documents: expected segments SEG_CHUNK0"):
        document_layout(torch.tensor([[1, 17]]), torch.tensor([[0, 1]]))


def test_pine_lite_on_a_sliding_window_layer_refuses_a_custom_mask_it_cannot_move():
    """The window is re-applied at PINE's positions from the default visibility; a custom mask inside the window
    would be silently overridden, so it is refused by name."""
    model, composer, docs, q = _setup("gemma3")
    cache, _ = composer.compose(docs, layout="sequential")
    T, S = cache.num_slots, q.shape[1]
    mask = torch.ones(1, 1, S, T + S, dtype=torch.bool).tril(T)
    mask[..., T - 1] = False                                     # hide the last document token from the question
    with pytest.raises(ValueError, match=r"PineLiteBackend layer 0 \(sliding window 8\).*default mask"):
        extend(model, cache, q, attention_mask=mask, attention=PineLiteBackend())
    assert cache.num_slots == T                                 # the failed forward left the cache as it was
