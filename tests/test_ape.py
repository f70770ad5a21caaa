"""APE attention backend: identity at T=S=1, the formula vs a float64 reference, batched chunk prefill, plumbing."""
import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvpos import ape
from kvpos.ape import ape_attend
from kvpos.compose import block_diagonal_allowed
from kvpos.integrations.ape import ApeCalibration, calibrate_ape, encode_chunks_batched, use_ape
from kvpos.integrations.hf import NAME, current_binding
from kvpos.integrations.compose import ChunkComposer, encode_chunk
from kvpos.integrations.hf import extend, generate
from kvpos.integrations.rag import PromptParts
from kvpos.integrations.hf.testing import tiny_model
from kvpos.reference import ape_merge_ref


def ape_extend(model, cache, q, temperature=0.7, scale=1.0):
    with use_ape(model, cache, temperature, scale):
        return extend(model, cache, q)


def ape_generate(model, cache, q, temperature=0.7, scale=1.0, **kw):
    with use_ape(model, cache, temperature, scale):
        return generate(model, cache, q, **kw)


def _setup(arch="llama", n=4, seed=0):
    model = tiny_model(arch)[0]
    g = torch.Generator().manual_seed(seed)
    anchor = torch.randint(3, 128, (5,), generator=g)
    chunks = [torch.randint(3, 128, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g) for _ in range(n)]
    q = torch.randint(3, 128, (1, 4), generator=g)
    return model, anchor, chunks, q


def test_backend_and_mask_function_are_both_registered_on_first_use():
    model, anchor, chunks, q = _setup()
    cache, _ = ChunkComposer(model, anchor).compose(chunks, layout="parallel")
    ape_extend(model, cache, q)
    assert NAME in AttentionInterface._global_mapping
    assert NAME in AttentionMaskInterface._global_mapping   # without it transformers passes attention_mask=None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "phi3"])
def test_t_s_one_equals_plain_parallel_attention(arch):
    model, anchor, chunks, q = _setup(arch)
    cc = ChunkComposer(model, anchor)
    plain_cache, _ = cc.compose(chunks, layout="parallel")
    plain = extend(model, plain_cache, q)
    ape_cache, _ = cc.compose(chunks, layout="parallel")
    got = ape_extend(model, ape_cache, q, temperature=1.0, scale=1.0)
    assert (got - plain).abs().max() < 1e-5
    assert model.config._attn_implementation == NAME and current_binding() is None   # scope closed
    again = extend(model, cc.compose(chunks, layout="parallel")[0], q)       # outside a scope "kvpos" IS sdpa
    assert torch.equal(again, plain)
    changed = ape_extend(model, cc.compose(chunks, layout="parallel")[0], q, temperature=0.6, scale=0.8)
    assert (changed - plain).abs().max() > 1e-2         # the knobs do something


def _random_attention(seed: int, ctx: tuple[int, int]):
    """q [2, 6, 5, 16] (3 query heads per kv head), k/v [2, 2, 23, 16], context slots ctx[0]:ctx[1], random mask."""
    g = torch.Generator().manual_seed(seed)
    B, H, g_, Lq, N, D = 2, 2, 3, 5, 23, 16
    q = torch.randn(B, H * g_, Lq, D, generator=g)
    k, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    is_ctx = torch.zeros(B, N, dtype=torch.bool)
    is_ctx[:, ctx[0]:ctx[1]] = True
    allowed = torch.rand(B, 1, Lq, N, generator=g) > 0.3
    allowed[..., 0] = True
    return g, q, k, v, is_ctx, allowed


@pytest.mark.parametrize("seed", range(6))
def test_ape_merge_equals_float64_reference(seed):
    g, q, k, v, is_ctx, allowed = _random_attention(seed, (4, 15))
    B, Lq = q.shape[0], q.shape[2]
    T, S = float(torch.empty(1).uniform_(0.3, 1.5, generator=g)), float(torch.empty(1).uniform_(0.3, 1.5, generator=g))
    got = ape_attend(q, k, v, allowed, is_ctx, 0.25, T, S)
    ref = ape_merge_ref(q, k, v, is_ctx, allowed, T, S, sm_scale=0.25)
    assert (got.double() - ref).abs().max() < 1e-5
    # query rows that are context slots get plain attention
    qc = torch.zeros(B, Lq, dtype=torch.bool)
    qc[:, 1] = True
    mixed = ape_attend(q, k, v, allowed, is_ctx, 0.25, T, S, q_is_ctx=qc)
    plain = ape_merge_ref(q, k, v, is_ctx, allowed, 1.0, 1.0, sm_scale=0.25)
    assert (mixed[:, :, 1].double() - plain[:, :, 1]).abs().max() < 1e-5
    assert (mixed[:, :, 0].double() - ref[:, :, 0]).abs().max() < 1e-5


def test_groups_may_be_empty():
    q, k, v = torch.randn(1, 2, 2, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    allowed = torch.ones(1, 1, 2, 6, dtype=torch.bool)
    for ctx in (torch.zeros(1, 6, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)):
        got = ape_attend(q, k, v, allowed, ctx, 0.3, 0.7, 0.9)
        ref = ape_merge_ref(q, k, v, ctx, allowed, 0.7, 0.9, sm_scale=0.3)
        assert torch.isfinite(got).all() and (got.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("arch", ["llama", "gemma3", "cohere"])
def test_batched_chunk_prefill_equals_per_chunk_prefill(arch):
    model, anchor, chunks, q = _setup(arch, n=5)
    if arch == "gemma3":   # the default tiny window (8) is shorter than anchor + chunk: refused, with the reason
        with pytest.raises(ValueError, match="encode_chunks_batched: expected anchor \\+ longest chunk <= sliding"):
            encode_chunks_batched(model, ChunkComposer(model, anchor).anchor, chunks, None)
        model = tiny_model(arch, sliding_window=64)[0]
    cc = ChunkComposer(model, anchor)
    batched = encode_chunks_batched(model, cc.anchor, chunks, cc.fingerprint)
    for c, b in zip(chunks, batched):
        one = encode_chunk(model, cc.anchor, c, cc.fingerprint)
        assert torch.equal(one.ids, b.ids)
        assert (one.raw_keys - b.raw_keys).abs().max() < 1e-5 and (one.values - b.values).abs().max() < 1e-5


def test_block_diagonal_mask_matches_a_loop_reference():
    lens, P = [3, 1, 4], 2
    m = block_diagonal_allowed(lens, P)
    starts = [0, 3, 4]
    for t in range(8):
        ci = max(i for i, s in enumerate(starts) if s <= t)
        for j in range(P + 8):
            want = j < P or (starts[ci] <= j - P <= t)
            assert bool(m[t, j]) == want
    with pytest.raises(ValueError, match="block_diagonal_allowed lengths: expected a non-empty list of positive"):
        block_diagonal_allowed([2, 0])


def test_parameters_pass_through_generate():
    model, anchor, chunks, q = _setup()
    cc = ChunkComposer(model, anchor)
    cache, _ = cc.compose(chunks, layout="parallel")
    out = ape_generate(model, cache, q, temperature=0.8, scale=0.9, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 9)
    assert current_binding() is None
    # plain generate with APE knobs as kwargs is refused by transformers: the scoped binding is the supported path
    with pytest.raises(ValueError, match="model_kwargs. are not used"):
        model.generate(q, max_new_tokens=2, ape_temperature=0.8)


def test_ape_argument_errors():
    model, anchor, chunks, q = _setup()
    cache, _ = ChunkComposer(model, anchor).compose(chunks, layout="parallel")
    with pytest.raises(ValueError, match="APE temperature: expected a finite float > 0, got 0"):
        ape_extend(model, cache, q, temperature=0)
    with pytest.raises(ValueError, match="APE scale: expected a finite float > 0, got nan"):
        ape_extend(model, cache, q, scale=float("nan"))
    with pytest.raises(TypeError, match="ApeBackend cache: expected a PositionedCache"):
        with use_ape(model, object()):
            pass


@pytest.mark.skipif(not ape.xformers_available(), reason="xformers path needs CUDA + the kvpos[xformers] extra")
def test_xformers_path_equals_torch_path_on_cuda():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 5, 64, generator=g).cuda().half()
    k, v = torch.randn(1, 2, 300, 64, generator=g).cuda().half(), torch.randn(1, 2, 300, 64, generator=g).cuda().half()
    ctx = torch.zeros(1, 300, dtype=torch.bool, device="cuda")
    ctx[:, 10:250] = True
    allowed = torch.ones(1, 1, 5, 300, dtype=torch.bool, device="cuda")
    a = ape.ape_attend_xformers(q, k, v, allowed, ctx, 0.125, 0.8, 0.9)
    b = ape_attend(q, k, v, allowed, ctx, 0.125, 0.8, 0.9)
    assert (a.float() - b.float()).abs().max() < 2e-2
    T, S = torch.linspace(0.5, 1.2, 6, device="cuda"), torch.linspace(0.7, 1.1, 6, device="cuda")   # per head
    qc = torch.zeros(1, 5, dtype=torch.bool, device="cuda")
    qc[:, 2] = True
    a = ape.ape_attend_xformers(q, k, v, allowed, ctx, 0.125, T, S, q_is_ctx=qc)
    b = ape_attend(q, k, v, allowed, ctx, 0.125, T, S, q_is_ctx=qc)
    assert (a.float() - b.float()).abs().max() < 2e-2


# ---------------------------------------------------------------------------------------------------------------------
# per-head knobs and calibrate_ape
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_per_head_knobs_equal_the_float64_reference_head_by_head(seed):
    g, q, k, v, is_ctx, allowed = _random_attention(seed, (3, 17))
    B, Lq, H, g_ = q.shape[0], q.shape[2], k.shape[1], q.shape[1] // k.shape[1]
    T = torch.empty(H * g_).uniform_(0.3, 1.5, generator=g)
    S = torch.empty(H * g_).uniform_(0.3, 1.5, generator=g)
    qc = torch.zeros(B, Lq, dtype=torch.bool)
    qc[:, 2] = True
    got = ape_attend(q, k, v, allowed, is_ctx, 0.25, T, S, q_is_ctx=qc)
    for h in range(H * g_):
        kv = slice(h // g_, h // g_ + 1)
        ref = ape_merge_ref(q[:, h:h + 1], k[:, kv], v[:, kv], is_ctx, allowed, float(T[h]), float(S[h]), sm_scale=0.25)
        plain = ape_merge_ref(q[:, h:h + 1], k[:, kv], v[:, kv], is_ctx, allowed, 1.0, 1.0, sm_scale=0.25)
        assert (got[:, h:h + 1, [0, 1, 3, 4]].double() - ref[:, :, [0, 1, 3, 4]]).abs().max() < 1e-5
        assert (got[:, h:h + 1, 2].double() - plain[:, :, 2]).abs().max() < 1e-5


def test_per_layer_head_tensor_equals_the_same_float_in_a_model():
    model, anchor, chunks, q = _setup("qwen2")
    cc = ChunkComposer(model, anchor)
    L, Hq = model.config.num_hidden_layers, model.config.num_attention_heads
    a = ape_extend(model, cc.compose(chunks, layout="parallel")[0], q, temperature=0.6, scale=0.8)
    b = ape_extend(model, cc.compose(chunks, layout="parallel")[0], q, temperature=torch.full((L, Hq), 0.6),
                   scale=torch.full((L, Hq), 0.8))
    assert (a - b).abs().max() < 1e-5
    T = torch.full((L, Hq), 0.6)
    T[-1, 0] = 1.3                                           # one head of the last layer differs: the output moves
    c = ape_extend(model, cc.compose(chunks, layout="parallel")[0], q, temperature=T, scale=0.8)
    assert (c - a).abs().max() > 1e-4
    with pytest.raises(ValueError, match=r"APE temperature: expected a float or a float tensor of shape \[2, 4\]"):
        ape_extend(model, cc.compose(chunks, layout="parallel")[0], q, temperature=torch.ones(3, 4))
    with pytest.raises(ValueError, match="APE scale: expected finite entries > 0, got min -1"):
        ape_extend(model, cc.compose(chunks, layout="parallel")[0], q, scale=-torch.ones(L, Hq))


def _prompts(anchor, n_chunks, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [PromptParts(anchor, [torch.randint(3, 128, (7,), generator=g) for _ in range(n_chunks)],
                        torch.randint(3, 128, (4,), generator=g)) for _ in range(n)]


def test_calibration_with_one_chunk_finds_t_s_one():
    # one chunk: parallel encoding IS full prefill, so the fitted knobs must be exactly 1 (a grid point)
    model, anchor, _, _ = _setup("llama")
    cc = ChunkComposer(model, anchor)
    cal = calibrate_ape(model, cc, _prompts(anchor, 1), progress=False)
    assert torch.equal(cal.temperature, torch.ones_like(cal.temperature))
    assert torch.equal(cal.scale, torch.ones_like(cal.scale))
    assert (cal.entropy_fit - cal.entropy_full).abs().max() < 1e-4


def test_calibration_moves_parallel_entropy_toward_full_and_round_trips(tmp_path):
    model, anchor, _, _ = _setup("llama")
    cc = ChunkComposer(model, anchor)
    prompts = _prompts(anchor, 6)
    cal = calibrate_ape(model, cc, prompts, rounds=1, progress=False)
    L, Hq = model.config.num_hidden_layers, model.config.num_attention_heads
    assert cal.temperature.shape == (L, Hq) and cal.scale.shape == (L, Hq)
    untuned = calibrate_ape(model, cc, prompts, rounds=1, progress=False, grid_t=[1.0], grid_s=[1.0])
    gap_fit = (cal.entropy_fit - cal.entropy_full).abs()[0]          # layer 0 does not depend on other layers
    gap_one = (untuned.entropy_fit - untuned.entropy_full).abs()[0]
    assert bool((gap_fit <= gap_one + 1e-6).all()) and float(gap_fit.sum()) < float(gap_one.sum())
    path = tmp_path / "cal.json"
    cal.save(str(path))
    back = ApeCalibration.load(str(path))
    assert torch.equal(back.temperature, cal.temperature) and torch.equal(back.scale, cal.scale)
    out = ape_extend(model, cc.compose(prompts[0].chunks, layout="parallel")[0], prompts[0].question[None],
                     **back.knobs())
    assert torch.isfinite(out).all()
    path.write_text('{"temperature": [[1.0]]}')
    with pytest.raises(ValueError, match="ApeCalibration file .*: expected a JSON object with keys"):
        ApeCalibration.load(str(path))
    with pytest.raises(ValueError, match="calibrate_ape prompts: expected a non-empty list"):
        calibrate_ape(model, cc, [], progress=False)
