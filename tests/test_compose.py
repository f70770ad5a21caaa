"""Chunk reuse: compose() against the independent reference forward; link/selective recompute limits."""
import pytest
import torch

from kvpos.integrations.compose import SEG_ANCHOR, SEG_CHUNK0, Anchor, ChunkComposer, compose, encode_chunk
from kvpos.integrations.hf import PositionedCache, extend, forward_reference, generate
from kvpos.integrations.hf.testing import tiny_model
from kvpos.store import model_fingerprint


def _setup(arch="llama", n_chunks=3, seed=0):
    model = tiny_model(arch)[0]
    g = torch.Generator().manual_seed(seed)
    anchor = torch.randint(3, 128, (5,), generator=g)
    chunks = [torch.randint(3, 128, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g)
              for _ in range(n_chunks)]
    q = torch.randint(3, 128, (1, 4), generator=g)
    return model, anchor, chunks, q


def _reference(model, anchor, chunks, q, layout, lead=None):
    """One forward reproducing how the composed cache was computed.

    Chunk i was encoded after the anchor (and the lead) at positions A+Ld.. and then moved by delta_i; by RoPE
    relativity that equals encoding it after a copy of the anchor (and lead) placed at delta_i... So the reference
    sequence is [anchor | (anchor+lead copy_i, chunk_i) for each i | query], where chunk_i sees its copy and itself,
    the copies are invisible to the query, and the query sees the anchor, every chunk and itself. Every position is
    offset by Ld (the lead's length; relativity again) so that none is negative."""
    lead = anchor[:0] if lead is None else lead
    A, off = anchor.numel(), lead.numel()
    ctx = torch.cat([anchor, lead])
    segs, p = [], A                                # (ids, positions, kind, owner)
    segs.append((anchor, torch.arange(A) + off, "anchor"))
    for c in chunks:
        L = c.numel()
        start = p if layout == "sequential" else A
        d = start - ctx.numel()
        segs.append((ctx, torch.arange(d, d + ctx.numel()) + off, "copy"))
        segs.append((c, torch.arange(start, start + L) + off, "chunk"))
        p = start + L if layout == "sequential" else max(p, A + L)
    segs.append((q[0], torch.arange(p, p + q.shape[1]) + off, "query"))
    ids = torch.cat([x for x, _, _ in segs])[None]
    pos = torch.cat([x for _, x, _ in segs])[None]
    N = ids.shape[1]
    allowed = torch.zeros(N, N, dtype=torch.bool)
    bounds, s = [], 0
    for x, _, kind in segs:
        bounds.append((s, s + x.numel(), kind))
        s += x.numel()
    for j, (s0, e0, kind) in enumerate(bounds):
        allowed[s0:e0, s0:e0] = torch.tril(torch.ones(e0 - s0, e0 - s0, dtype=torch.bool))
        if kind == "chunk":
            cs, ce, _ = bounds[j - 1]
            allowed[s0:e0, cs:ce] = True
        if kind == "query":
            for s1, e1, k1 in bounds[:-1]:
                if k1 != "copy":
                    allowed[s0:e0, s1:e1] = True
    return forward_reference(model, ids, pos, allowed[None, None])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "phi3", "cohere", "gpt_neox"])
@pytest.mark.parametrize("layout", ["sequential", "parallel"])
def test_compose_equals_block_masked_reference(arch, layout):
    over = {"sliding_window": 4096} if arch == "gemma3" else {}
    model = tiny_model(arch, **over)[0]
    _, anchor, chunks, q = _setup()
    cc = ChunkComposer(model, anchor)
    order = [2, 0, 1]
    cache, info = cc.compose([chunks[i] for i in order], layout=layout)
    got = extend(model, cache, q)
    ref = _reference(model, anchor, [chunks[i] for i in order], q, layout)
    assert (got - ref[:, -4:]).abs().max() < 1e-4
    assert info.misses == 3 and info.hits == 0
    seg = cache.segments[0]
    assert (seg[:5] == SEG_ANCHOR).all() and int(seg[5]) == SEG_CHUNK0
    # the second request is served from the store
    _, info2 = cc.compose([chunks[1], chunks[2]], layout=layout)
    assert info2.hits == 2 and info2.misses == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3", "cohere"])
@pytest.mark.parametrize("layout", ["sequential", "parallel"])
def test_chunks_encoded_after_a_lead_equal_the_block_masked_reference(arch, layout):
    """A lead: every chunk encoded after anchor + lead (the lead's slots dropped), placed as usual."""
    over = {"sliding_window": 4096} if arch == "gemma3" else {}
    model = tiny_model(arch, **over)[0]
    _, anchor, chunks, q = _setup()
    lead = torch.randint(3, 128, (6,), generator=torch.Generator().manual_seed(7))
    cc = ChunkComposer(model, anchor, lead_ids=lead)
    assert cc.anchor.chunk_start == 11 and torch.equal(cc.anchor.context_ids, torch.cat([anchor, lead]))
    order = [1, 2, 0]
    cache, _ = cc.compose([chunks[i] for i in order], layout=layout)
    assert cache.num_slots == 5 + sum(c.numel() for c in chunks)          # no lead slot in the request
    got = extend(model, cache, q)
    ref = _reference(model, anchor, [chunks[i] for i in order], q, layout, lead=lead)
    assert (got - ref[:, -4:]).abs().max() < 1e-4
    plain = _reference(model, anchor, [chunks[i] for i in order], q, layout)
    assert (got - plain[:, -4:]).abs().max() > 1e-3                       # the lead changed what was stored


def test_a_lead_is_part_of_the_store_identity_and_with_lead_shares_the_backend():
    model, anchor, chunks, q = _setup()
    lead = torch.randint(3, 128, (6,), generator=torch.Generator().manual_seed(7))
    base = ChunkComposer(model, anchor)
    led = base.with_lead(lead)
    assert led.store.backend is base.store.backend and led.fingerprint != base.fingerprint
    assert led.fingerprint == model_fingerprint(model, torch.cat([anchor, lead]), led.anchor.cache.specs)
    base.precompute(chunks, progress=False)
    assert not any(led.store.contains(c) for c in chunks)                  # never served across leads
    _, info = led.compose(chunks)
    assert info.misses == 3
    _, info = led.compose(chunks)
    assert info.hits == 3
    assert base.with_lead(lead[:0]).fingerprint == base.fingerprint       # an empty lead is no lead
    plain = encode_chunk(model, base.anchor, chunks[0], base.fingerprint)
    with pytest.raises(ValueError, match=r"compose chunks\[0\]: expected a chunk encoded after this anchor and lead "
                                         r"\(start 11\), got 5"):
        compose(model, led.anchor, [plain])
    with pytest.raises(ValueError, match=r"Anchor context: expected the cache of anchor \+ lead"):
        Anchor(anchor, base.anchor.cache, lead)


def test_link_recompute_of_all_tokens_equals_full_prefill():
    model, anchor, chunks, q = _setup(n_chunks=4)
    cc = ChunkComposer(model, anchor)
    cache, info = cc.compose(chunks, layout="sequential", link_k=10 ** 6)
    got = extend(model, cache, q)
    full = model(torch.cat([anchor, *chunks, q[0]])[None]).logits
    assert (got - full[:, -4:]).abs().max() < 1e-4
    # every chunk was a miss (encoded once) and every chunk after the first was re-encoded as link tokens
    assert info.tokens_computed == sum(c.numel() for c in chunks) + sum(c.numel() for c in chunks[1:])


def test_link_recompute_changes_only_the_link_tokens_and_improves_fidelity():
    model, anchor, chunks, q = _setup(n_chunks=4, seed=3)
    full = model(torch.cat([anchor, *chunks, q[0]])[None]).logits[:, -4:]
    cc = ChunkComposer(model, anchor)
    errs = []
    for k in (0, 2, 4):
        cache, info = cc.compose(chunks, layout="sequential", link_k=k)
        errs.append((extend(model, cache, q) - full).abs().max().item())
        assert info.tokens_reused == sum(c.numel() for c in chunks) - k * 3
    assert errs[2] < errs[0], f"link recompute should move toward full prefill: {errs}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_selective_recompute_of_everything_equals_full_prefill(arch):
    model, anchor, chunks, q = _setup(arch)
    cc = ChunkComposer(model, anchor)
    cache, info = cc.compose(chunks, layout="sequential", recompute_ratio=1.0)
    got = extend(model, cache, q)
    full = model(torch.cat([anchor, *chunks, q[0]])[None]).logits
    assert (got - full[:, -4:]).abs().max() < 1e-4


def test_selective_recompute_partial_ratio_runs_and_lies_between():
    model, anchor, chunks, q = _setup(n_chunks=4, seed=2)
    full = model(torch.cat([anchor, *chunks, q[0]])[None]).logits[:, -4:]
    cc = ChunkComposer(model, anchor)
    errs = {}
    for r in (0.0, 0.5):
        cache, info = cc.compose(chunks, layout="sequential", recompute_ratio=r)
        errs[r] = (extend(model, cache, q) - full).abs().max().item()
    assert errs[0.5] < errs[0.0]


def test_compose_errors():
    model, anchor, chunks, q = _setup()
    cc = ChunkComposer(model, anchor)
    with pytest.raises(ValueError, match="compose layout: expected 'sequential' or 'parallel', got 'diagonal'"):
        cc.compose(chunks, layout="diagonal")
    with pytest.raises(ValueError, match="compose link_k: expected 0 with layout='parallel'"):
        cc.compose(chunks, layout="parallel", link_k=2)
    with pytest.raises(ValueError, match=r"compose recompute_ratio: expected a fraction in \[0, 1\], got 1.5"):
        cc.compose(chunks, recompute_ratio=1.5)
    with pytest.raises(ValueError, match="compose chunks: expected at least one chunk"):
        compose(model, cc.anchor, [])
    other = Anchor.encode(model, anchor[:3])
    c = encode_chunk(model, other, chunks[0], model_fingerprint(model, anchor[:3]))
    with pytest.raises(ValueError, match=r"compose chunks\[0\]: expected a chunk encoded after this anchor and lead \(start 5\), got 3"):
        compose(model, cc.anchor, [c])
    with pytest.raises(ValueError, match=r"chunk ids: expected 1-D integer token ids"):
        cc.compose([torch.ones(3)])


def test_generate_after_compose_matches_reference_loop():
    model, anchor, chunks, q = _setup(n_chunks=2)
    cc = ChunkComposer(model, anchor)
    cache, _ = cc.compose(chunks, layout="sequential", link_k=100)
    out = generate(model, cache, q, max_new_tokens=6, do_sample=False)
    full = model.generate(torch.cat([anchor, *chunks, q[0]])[None], max_new_tokens=6, do_sample=False)
    assert out[0, 4:].tolist() == full[0, -6:].tolist()


@pytest.mark.parametrize("layout", ["sequential", "parallel"])
def test_plan_allowed_rows_equal_the_rows_of_the_loop_built_mask(layout):
    """LayoutPlan.allowed(n, rows) (what the vLLM backend asks per step) against a mask built slot by slot from
    the layout's definition: causal, and in the parallel layout no chunk slot sees another chunk."""
    from kvpos.compose import plan_layout

    plan = plan_layout(4, [3, 5, 2], layout)
    n = 3
    N = plan.num_slots + n
    chunk_of = {t: i for i, (s, e) in enumerate(plan.slots) for t in range(s, e)}
    want = torch.zeros(N, N, dtype=torch.bool)
    for r in range(N):
        for c in range(r + 1):
            hidden = layout == "parallel" and r in chunk_of and c in chunk_of and chunk_of[c] != chunk_of[r]
            want[r, c] = not hidden
    assert torch.equal(plan.allowed(n), want)
    rows = torch.tensor([0, 5, 8, 13, N - 1])
    assert torch.equal(plan.allowed(n, rows), want[rows])
    with pytest.raises(ValueError, match="allowed rows"):
        plan.allowed(n, torch.tensor([N]))
