"""kvpos as vLLM's attention: an engine with the kvpos backend (raw keys in the paged cache, positions applied in
attention) runs in its own process over the session's Redis store (attention_engine.py); its outputs are checked
against vLLM's own backend (this session's engine) and kvpos's transformers path for the same layout."""
import json
import os
import subprocess
import sys

import pytest
import torch
from vllm_env import MODEL, ROOT
from vllm import SamplingParams

from kvpos.integrations.vllm.engine import engine_kwargs
from kvpos.integrations.vllm.params import parse_request
from kvpos.integrations.vllm.plugin import ENV, enabled

TOL = 2e-3                       # first-step log-probabilities of two engines' fp32 kernels (as the connector tests)


@pytest.fixture(scope="module")
def backend_run(redis_url, tmp_path_factory):
    out = tmp_path_factory.mktemp("attention") / "out.json"
    env = {**os.environ, ENV: "1"}
    res = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "attention_engine.py"), MODEL,
                          redis_url, str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert res.returncode == 0 and out.exists(), res.stderr[-4000:]
    return {c["name"]: c for c in json.loads(out.read_text())["cases"]}


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def _check(case, ref_logprobs, ref_tokens):
    """The case's first-step log-probabilities within TOL of ref_logprobs [V], its greedy tokens equal."""
    for t, x in case["logprobs"].items():
        assert abs(float(ref_logprobs[int(t)]) - x) < TOL, (case["name"], t, float(ref_logprobs[int(t)]), x)
    assert case["tokens"] == ref_tokens, case["name"]


def _kvpos_reference(model, tok, case, layout):
    """kvpos's transformers path over the same request: chunks composed in `layout` (cropped to what the engine
    loaded in the sequential layout, where vLLM computes the rest in context), the rest extended, then greedy (with
    APE over the passages when the request asks for it)."""
    import contextlib

    from kvpos.integrations.ape import use_ape
    from kvpos.integrations.compose import ChunkComposer
    from kvpos.integrations.hf import extend, generate
    from kvpos.prompt import PromptParts

    ids = torch.tensor(case["prompt"]["prompt_token_ids"])
    segs = case["params"]["kvpos"]["segments"]
    parts = PromptParts(ids[:segs[0][1]], [ids[a:b] for a, b, _ in segs[1:]], ids[segs[-1][1]:])
    cache, _ = ChunkComposer(model, parts.anchor).compose(parts.chunks, layout=layout)
    done = segs[-1][1]
    if layout == "sequential":
        done = case["kvpos"]["loaded_tokens"]
        cache.crop(done - cache.num_slots)
    ape = case["params"]["kvpos"].get("ape")
    with use_ape(model, cache, ape["temperature"], ape["scale"]) if ape else contextlib.nullcontext():
        logits = extend(model, cache, ids[done:][None])[0, -1].float()
        first = int(logits.argmax())
        more = generate(model, cache, torch.tensor([[first]]), max_new_tokens=len(case["tokens"]) - 1,
                        do_sample=False, pad_token_id=tok.eos_token_id)
    return torch.log_softmax(logits, -1), [first] + more[0, 1:].tolist()


def test_a_plain_request_gets_vllms_own_output(backend_run, engine):
    """No kvpos parameters: raw keys rotated in attention give vLLM's own log-probabilities and greedy tokens."""
    case = backend_run["plain"]
    sp = SamplingParams(max_tokens=len(case["tokens"]), temperature=0.0, logprobs=5, ignore_eos=True)
    out = engine.generate(case["prompt"], sp, use_tqdm=False)[0].outputs[0]
    stock = {int(t): x.logprob for t, x in out.logprobs[0].items()}
    for t, x in case["logprobs"].items():
        assert int(t) in stock and abs(stock[int(t)] - x) < TOL, (t, stock.get(int(t)), x)
    assert case["tokens"] == list(out.token_ids)
    assert case["kvpos"] is None


@pytest.mark.parametrize("name", ["parallel_computed", "parallel_loaded", "parallel_mixed", "parallel_ape"])
def test_parallel_layout_in_the_engine_equals_kvpos_transformers_path(backend_run, hf_model, tok, name):
    """Passages at overlapping positions after the anchor, not visible to each other: computed by the engine under
    the backend's mask, loaded raw from the store, or both, the output equals kvpos's parallel composition; with
    APE's temperature and scale too (use_ape on the transformers path)."""
    case = backend_run[name]
    ref_lp, ref_tokens = _kvpos_reference(hf_model, tok, case, "parallel")
    _check(case, ref_lp, ref_tokens)


def test_parallel_requests_load_passages_another_parallel_request_saved(backend_run):
    """Every passage of a parallel request is position-independent, so each is saved and later loaded."""
    assert backend_run["parallel_computed"]["kvpos"]["loaded_tokens"] == 0
    rep = backend_run["parallel_loaded"]["kvpos"]
    assert rep["loaded_tokens"] >= 256 and "load_failed" not in rep, rep
    rep = backend_run["parallel_mixed"]["kvpos"]
    assert 0 < rep["loaded_tokens"] < sum(b - a for a, b, _ in backend_run["parallel_mixed"]["params"]["kvpos"][
        "segments"]), rep                                     # stored passages loaded, the new one computed


def test_sequential_layout_on_raw_loads_equals_kvpos_transformers_path(backend_run, hf_model, tok):
    """Passages loaded raw (no rotation at load time) in another order, positions applied in attention."""
    case = backend_run["sequential_loaded"]
    assert case["kvpos"]["loaded_tokens"] >= 256, case["kvpos"]
    ref_lp, ref_tokens = _kvpos_reference(hf_model, tok, case, "sequential")
    _check(case, ref_lp, ref_tokens)


def test_the_parallel_layout_and_ape_are_refused_without_the_backend():
    """vLLM's own attention cannot read positions differently: the layout and APE are refused with the fix; bad
    APE knobs are refused by name."""
    with pytest.raises(ValueError, match=ENV):
        parse_request({"segments": [[0, 4, "anchor"], [4, 8, "chunk"]], "layout": "parallel"}, 10, None, False, True)
    with pytest.raises(ValueError, match="layout"):
        parse_request({"segments": [[0, 4, "anchor"], [4, 8, "chunk"]], "layout": "diagonal"}, 10, None, False, True,
                      raw=True)
    segs = [[0, 4, "anchor"], [4, 8, "chunk"]]
    with pytest.raises(ValueError, match=ENV):
        parse_request({"segments": segs, "ape": {"temperature": 0.7, "scale": 1.0}}, 10, None, False, True)
    for bad in ({"temperature": 0.0, "scale": 1.0}, {"temperature": 0.7}, {"temperature": True, "scale": 1.0},
                {"temperature": float("nan"), "scale": 1.0}, [0.7, 1.0]):
        with pytest.raises(ValueError, match="kvpos ape"):
            parse_request({"segments": segs, "ape": bad}, 10, None, False, True, raw=True)


def test_engine_kwargs_refuse_attention_without_the_plugin_switch():
    assert not enabled()                        # this session's engine runs vLLM's own attention
    with pytest.raises(ValueError, match=ENV):
        engine_kwargs(MODEL, "redis://127.0.0.1:1/0", attention=True)
    with pytest.raises(TypeError, match="attention"):
        engine_kwargs(MODEL, "redis://127.0.0.1:1/0", attention="yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_block_gather_returns_the_written_keys_and_values_in_token_order(dtype):
    """PagedLayout.gather_blocks (the attention read) against what was written through vLLM's own cache op, and
    against the per-element gather, for a request whose blocks are scattered and whose last block is partial."""
    from kvpos.integrations.vllm.paged import PagedLayout

    g = torch.Generator().manual_seed(0)
    nb, H, bs, D, s = 12, 3, 16, 64, 70
    kv = torch.zeros(nb, H, bs, 2 * D, dtype=dtype)
    block_ids = torch.tensor([7, 2, 11, 0, 5])
    t = torch.arange(s)
    k = torch.randn(s, H, D, generator=g).to(dtype)
    v = torch.randn(s, H, D, generator=g).to(dtype)
    paged = PagedLayout(dtype)
    paged.write(kv, k, v, block_ids[t // bs] * bs + t % bs)
    gk, gv = paged.gather_blocks(kv, block_ids, s)
    assert torch.equal(gk, k.transpose(0, 1)) and torch.equal(gv, v.transpose(0, 1))
    ek, ev = paged.gather(kv, block_ids[t // bs], t % bs)
    assert torch.equal(gk, ek) and torch.equal(gv, ev)
    with pytest.raises(ValueError, match="slots"):
        paged.gather_blocks(kv, block_ids[:2], s)


@pytest.mark.parametrize("kind", ["strided", "permuted"])
def test_paged_token_order_read_follows_any_element_map(kind):
    """The block read behind gather_blocks, on a strided element map (the view path) and on a permuted one (the
    index path), against reading each element through the map one by one."""
    from kvpos.integrations.vllm.paged import _in_token_order, _strides

    g = torch.Generator().manual_seed(1)
    nb, H, bs, D, s = 6, 2, 4, 8, 13
    kv = torch.randn(nb, H, bs, 2 * D, generator=g)
    if kind == "strided":
        m = torch.arange(D)[None] * bs + torch.arange(bs)[:, None]
    else:
        m = torch.randperm(bs * 2 * D, generator=g)[: bs * D].view(bs, D)
    block_ids = torch.tensor([4, 0, 5, 1])
    assert (_strides(m) is None) == (kind == "permuted")
    got = _in_token_order(kv, m, _strides(m), block_ids, s)
    flat = kv.view(nb, H, bs * 2 * D)
    want = torch.stack([torch.stack([flat[block_ids[t // bs], h, m[t % bs]] for t in range(s)]) for h in range(H)])
    assert got.shape == (H, s, D) and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_block_copy_and_key_view_hold_what_vllms_cache_op_wrote(dtype):
    """PagedLayout.copy_blocks + key_blocks (how the scratch cache vLLM's kernel reads is filled and its keys
    rotated in place) against what vLLM's cache op wrote at scattered blocks: the copied run reads back as the
    written keys and values, and the key view holds key t of block b at [b, :, t % bs]."""
    from kvpos.integrations.vllm.paged import PagedLayout

    g = torch.Generator().manual_seed(2)
    nb, H, bs, D, s, first = 9, 3, 16, 64, 53, 2
    block_ids = torch.tensor([6, 1, 8, 3])
    t = torch.arange(s)
    k, v = torch.randn(s, H, D, generator=g).to(dtype), torch.randn(s, H, D, generator=g).to(dtype)
    paged = PagedLayout(dtype)
    kv = torch.zeros(nb, H, bs, 2 * D, dtype=dtype)
    paged.write(kv, k, v, block_ids[t // bs] * bs + t % bs)
    dst = torch.zeros(7, H, bs, 2 * D, dtype=dtype)
    assert paged.affine(kv), f"vLLM's {dtype} block layout is no longer a strided view: its kernel path is off"
    paged.copy_blocks(kv, block_ids, dst, first)
    gk, gv = paged.gather_blocks(dst, torch.arange(first, first + 4), s)
    assert torch.equal(gk, k.transpose(0, 1)) and torch.equal(gv, v.transpose(0, 1))
    assert torch.equal(paged.key_blocks(dst)[first + t // bs, :, t % bs], k)
    with pytest.raises(ValueError, match="copy_blocks"):
        paged.copy_blocks(kv, block_ids, dst, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_write_equals_vllms_cache_op(dtype):
    """PagedLayout.write (indexed copies through the strided views where the layout is affine) leaves the layer
    tensor exactly as vLLM's own cpu_attn_reshape_and_cache does: scattered slots, a partial block, strided inputs,
    block sizes whose bf16 layout is packed (the op itself) and not."""
    import vllm._custom_ops as vllm_ops
    from kvpos.integrations.vllm.paged import PagedLayout, halves

    g = torch.Generator().manual_seed(5)
    for bs in (16, 128):
        nb, H, D = 6, 3, 64
        s = 2 * bs + 5
        slots = torch.randperm(nb * bs, generator=g)[:s]
        k = torch.randn(H, s, D, generator=g).to(dtype).transpose(0, 1)          # [s, H, D], not contiguous
        v = torch.randn(H, s, D, generator=g).to(dtype).transpose(0, 1)
        paged = PagedLayout(dtype)
        got = torch.randn(nb, H, bs, 2 * D, generator=g).to(dtype)
        want = got.clone()
        paged.write(got, k, v, slots)
        kc, vc = halves(want)
        vllm_ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), kc, vc, slots, paged.isa)
        assert torch.equal(got, want), (dtype, bs)


@pytest.mark.parametrize("interleaved", [False, True])
def test_keys_rotate_in_place_in_vllms_blocks_through_the_fused_kernel(interleaved, monkeypatch):
    """The scratch path's in-place rotation of the key view (token-major in vLLM's fp32 CPU blocks) is served by
    kvpos's C kernel (not torch's strided fallback), equals torch's rotation and the float64 reference, and leaves
    the values as they were."""
    from kvpos._kernels import rope_apply_kernel, rope_kernel_available
    from kvpos.integrations.vllm.paged import PagedLayout
    from kvpos.reference import rotate_ref
    from kvpos.rope import RopeLayout, RopeSpec, cos_sin, rotate_by

    if not rope_kernel_available():
        pytest.fail("the C kernels are not built: the vLLM suite expects them")
    g = torch.Generator().manual_seed(4)
    nb, H, bs, D = 5, 3, 16, 64
    spec = RopeSpec(1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D), 1.0, D, D,
                    RopeLayout.INTERLEAVED if interleaved else RopeLayout.HALF)
    paged = PagedLayout(torch.float32)
    kv = torch.randn(nb, H, bs, 2 * D, generator=g)
    keys = paged.key_blocks(kv)                                                  # [nb, H, bs, D] view
    raw, before = keys.clone(), kv.clone()
    pos = torch.randint(0, 4000, (nb, bs), generator=g)
    cos, sin = cos_sin(pos, spec)
    assert rope_apply_kernel([keys.clone()], cos[:, None], sin[:, None], D, interleaved, [keys.clone()])
    rotate_by(keys, cos, sin, spec, out=keys)
    want = rotate_ref(raw.double(), pos, spec)          # float64 angles: float32's differ by ~pos * 2^-24 rad
    assert (keys.double() - want).abs().max() < 1e-3
    monkeypatch.setattr("kvpos.rope.rope_apply_kernel", lambda *a, **k: False)
    assert (keys - rotate_by(raw, cos, sin, spec)).abs().max() < 1e-5            # torch's path, the same angles
    restored = kv.clone()
    paged.key_blocks(restored).copy_(raw)
    assert torch.equal(restored, before)                                         # only the key elements changed


def test_flash_layout_reads_and_writes_where_vllms_flash_attention_looks():
    """FlashLayout (the CUDA build's paged layout, used by the CUDA backend and the worker on CUDA tensors) against
    the key / value views vLLM's FlashAttentionImpl takes of a layer tensor (`kv_cache.transpose(1, 2).split(D,
    dim=-1)`), with scattered blocks and a partial last block; a physically permuted layer tensor reads the same."""
    from kvpos.integrations.vllm.flash_layout import FlashLayout

    g = torch.Generator().manual_seed(3)
    nb, H, bs, D, s = 8, 3, 16, 64, 37
    block_ids = torch.tensor([5, 1, 6])
    t = torch.arange(s)
    k, v = torch.randn(s, H, D, generator=g), torch.randn(s, H, D, generator=g)
    for kv in (torch.zeros(nb, H, bs, 2 * D), torch.zeros(nb, bs, H, 2 * D).transpose(1, 2)):
        lay = FlashLayout(torch.float32)
        lay.write(kv, k, v, block_ids[t // bs] * bs + t % bs)
        key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)          # [nb, bs, H, D] as vLLM reads them
        assert torch.equal(key_cache[block_ids[t // bs], t % bs], k)
        assert torch.equal(value_cache[block_ids[t // bs], t % bs], v)
        gk, gv = lay.gather_blocks(kv, block_ids, s)
        assert torch.equal(gk, k.transpose(0, 1)) and torch.equal(gv, v.transpose(0, 1))
        ek, ev = lay.gather(kv, block_ids[t // bs], t % bs)
        assert torch.equal(ek, gk) and torch.equal(ev, gv)
    with pytest.raises(ValueError, match="flash gather"):
        lay.gather_blocks(kv, block_ids[:2], s)


def test_cuda_backend_is_vllms_flash_attention_with_kvpos_hooks_and_refusals():
    """The CUDA variant (not run in an engine here: no GPU, CPU build of vLLM): built on vLLM's FlashAttention
    classes, no CUDA graphs, the same refusals as the CPU backend; the plugin picks it on CUDA only."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadataBuilder

    from kvpos.integrations.vllm.attention import refuse_unsupported
    from kvpos.integrations.vllm.attention_cuda import KvposFlashBackend, KvposFlashImpl, KvposFlashMetadata
    from kvpos.integrations.vllm.plugin import BACKEND, CUDA_BACKEND, backend_for

    assert issubclass(KvposFlashBackend.get_impl_cls(), FlashAttentionImpl)
    assert KvposFlashBackend.get_impl_cls() is KvposFlashImpl
    builder = KvposFlashBackend.get_builder_cls()
    assert issubclass(builder, FlashAttentionMetadataBuilder)
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER
    assert {"positions", "views"} <= set(KvposFlashMetadata.__dataclass_fields__)
    with pytest.raises(ValueError, match="sliding windows"):
        refuse_unsupported(9, 64, 0.125, 3, None, 512, "auto")
    refuse_unsupported(9, 64, 0.125, 3, None, None, "auto")
    assert backend_for("cuda") == ("FLASH_ATTN", CUDA_BACKEND) and backend_for("cpu") == ("CPU_ATTN", BACKEND)
    with pytest.raises(ValueError, match="platform"):
        backend_for("tpu")
