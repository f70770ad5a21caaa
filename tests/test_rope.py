"""RopeSpec extraction and rotate/unrotate against the float64 reference and the models' own RoPE code."""
import importlib

import pytest
import torch
import transformers as T

from kvpos import RopeLayout, RopeSpec, UnsupportedRopeError, rotate, unrotate
from kvpos.integrations.hf import rope_specs_from_model
from kvpos.reference import rotate_ref, unrotate_ref
from kvpos.integrations.hf.testing import LIMITED_ARCHS, TINY_ARCHS, tiny_model


def _spec(layout=RopeLayout.HALF, R=16, D=16, scale=1.0, angle_dtype=torch.float32):
    inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    return RopeSpec(inv, scale, R, D, layout, angle_dtype=angle_dtype)


SPECS = [_spec(), _spec(RopeLayout.INTERLEAVED), _spec(R=8), _spec(RopeLayout.INTERLEAVED, R=4), _spec(scale=1.2)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout.value}-R{s.rotary_dim}-s{s.attention_scaling}")
def test_rotate_matches_float64_reference(spec):
    x = torch.randn(2, 3, 7, spec.head_dim)
    pos = torch.randint(0, 3000, (2, 7))
    got = rotate(x, pos, spec)
    ref = rotate_ref(x, pos, spec)
    # float32 angles (like transformers): error grows with the position, ~pos * 2^-24 rad
    assert (got.double() - ref).abs().max() < 3000 * 2 ** -24 * 4 * x.abs().max() + 1e-5
    got64 = rotate(x, pos, RopeSpec(spec.inv_freq, spec.attention_scaling, spec.rotary_dim, spec.head_dim,
                                    spec.layout, angle_dtype=torch.float64))
    assert (got64.double() - ref).abs().max() < 1e-5
    assert (unrotate(got, pos, spec).double() - unrotate_ref(got.double(), pos, spec)).abs().max() < 1e-3


@pytest.mark.parametrize("spec", SPECS[:3], ids=["half", "interleaved", "partial"])
def test_group_properties(spec):
    x = torch.randn(1, 2, 5, spec.head_dim, dtype=torch.float64)
    a, b = torch.randint(0, 500, (5,)), torch.randint(0, 500, (5,))
    assert torch.allclose(unrotate(rotate(x, a, spec), a, spec), x, atol=1e-6)
    assert torch.allclose(rotate(rotate(x, a, spec), b, spec), rotate(x, a + b, spec), atol=1e-4)
    # q.k depends only on p_q - p_k
    q, k = torch.randn(1, 1, 1, spec.head_dim), torch.randn(1, 1, 1, spec.head_dim)
    s1 = (rotate(q, torch.tensor([40]), spec) * rotate(k, torch.tensor([10]), spec)).sum()
    s2 = (rotate(q, torch.tensor([130]), spec) * rotate(k, torch.tensor([100]), spec)).sum()
    assert torch.allclose(s1, s2, atol=1e-5)


def test_bf16_rotation_is_one_rounding_of_the_exact_result():
    spec = _spec(angle_dtype=torch.float64)
    x = torch.randn(1, 2, 64, 16).bfloat16()
    pos = torch.arange(1000, 1064)
    got = rotate(x, pos, spec)
    ref = rotate_ref(x, pos, spec)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref.bfloat16()) or (got.double() - ref).abs().max() <= ref.abs().max() * 2 ** -8


@pytest.mark.parametrize("arch", TINY_ARCHS + LIMITED_ARCHS)
def test_spec_reproduces_the_models_own_rotation(arch):
    """Our rotate() equals the model module's apply_rotary_pos_emb(cos, sin from the model's rotary module)."""
    model, cfg = tiny_model(arch)
    specs = rope_specs_from_model(model)
    assert len(specs) == cfg.num_hidden_layers
    mod = importlib.import_module(type(model).__module__)
    rot = next(m for n, m in model.named_modules() if n.endswith("rotary_emb"))
    pos = torch.arange(5, 45)[None]
    for li, spec in enumerate(specs):
        lt = (getattr(cfg, "layer_types", None) or [None] * len(specs))[li]
        x = torch.randn(1, 2, 40, spec.head_dim)
        cos, sin = rot(x, pos, lt) if hasattr(rot, f"{lt}_inv_freq") else rot(x, pos)
        if cos.shape[-1] == spec.head_dim or arch in ("phi3", "glm"):
            _, ref = mod.apply_rotary_pos_emb(x, x, cos, sin)
        else:  # GPT-NeoX / StableLM slice the rotary dims in the attention module, not in apply_rotary_pos_emb
            R = cos.shape[-1]
            _, r = mod.apply_rotary_pos_emb(x[..., :R], x[..., :R], cos, sin)
            ref = torch.cat([r, x[..., R:]], -1)
        assert (rotate(x, pos[0], spec) - ref).abs().max() < 1e-5, f"layer {li}"


def test_gemma3_has_two_rope_specs():
    model, _ = tiny_model("gemma3")
    specs = rope_specs_from_model(model)
    assert specs[0] is not specs[1]
    assert not torch.equal(specs[0].inv_freq, specs[1].inv_freq)


def test_models_without_rope_are_refused():
    cfg = T.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)
    with pytest.raises(UnsupportedRopeError, match="expected a RoPE model"):
        rope_specs_from_model(T.GPT2LMHeadModel(cfg))
    cfg = T.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)
    with pytest.raises(UnsupportedRopeError, match="ALiBi"):
        rope_specs_from_model(T.BloomForCausalLM(cfg))


@pytest.mark.parametrize("arch,limit", [("llama_dynamic", 64), ("phi3_longrope", 64)])
def test_length_dependent_rope_has_an_exact_range(arch, limit):
    model, _ = tiny_model(arch)
    spec = rope_specs_from_model(model)[0]
    assert spec.max_exact_position == limit
    x = torch.randn(1, 1, 1, spec.head_dim)
    rotate(x, torch.tensor([limit - 1]), spec)
    with pytest.raises(ValueError, match=f"positions < {limit} for rope_type='{spec.rope_type}'"):
        rotate(x, torch.tensor([limit]), spec)


def test_rotate_errors():
    spec = _spec()
    x = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match=r"rotate: pos: expected shape \[S\]=4"):
        rotate(x, torch.arange(5), spec)
    with pytest.raises(TypeError, match="rotate: pos: expected an int64 tensor"):
        rotate(x, torch.arange(4).float(), spec)
    with pytest.raises(ValueError, match="rotate: x: expected a 4-D tensor"):
        rotate(x[0], torch.arange(4), spec)
    with pytest.raises(ValueError, match="rotate: x: expected last dim head_dim=16"):
        rotate(torch.randn(1, 2, 4, 8), torch.arange(4), spec)
    with pytest.raises(ValueError, match="RopeSpec.rotary_dim"):
        RopeSpec(torch.ones(4), 1.0, 6, 16)
    with pytest.raises(ValueError, match="attention_scaling"):
        RopeSpec(torch.ones(4), 0.0, 8, 16)


def test_rotate_leaves_input_unchanged_and_accepts_non_contiguous():
    spec = _spec(R=8)
    big = torch.randn(1, 2, 10, 16)
    x = big[:, :, 2:9]
    before = x.clone()
    pos = torch.arange(7)
    out = rotate(x, pos, spec)
    assert torch.equal(x, before)
    assert torch.allclose(out, rotate(x.contiguous(), pos, spec))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout.value}-R{s.rotary_dim}-s{s.attention_scaling}")
def test_fused_kernel_equals_torch_path(spec, dtype, monkeypatch):
    import kvpos.rope as rope
    from kvpos._kernels import rope_kernel_available

    if not rope_kernel_available():
        pytest.skip("C kernel not built on this machine (the torch path is what runs)")
    x = torch.randn(2, 3, 40, spec.head_dim).to(dtype)[:, :, 3:37]   # non-contiguous slice, as in the cache
    pos = torch.randint(0, 5000, (2, 34))
    fast = rotate(x, pos, spec)
    monkeypatch.setattr(rope, "rope_apply_kernel", lambda *a, **k: False)
    slow = rotate(x, pos, spec)
    if dtype == torch.float32:
        assert (fast - slow).abs().max() < 1e-5
    else:  # both round a float32 result once; they may differ by one bf16 ulp where float32 sums differ
        assert ((fast.float() - slow.float()).abs() <= slow.float().abs() * 2 ** -7 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout.value}-R{s.rotary_dim}-s{s.attention_scaling}")
def test_fused_kernel_rotates_tokens_inside_longer_rows_in_place(spec, dtype):
    """Keys beside values in one row per token (vLLM's CPU blocks): the kernel serves the strided view in place
    and leaves the values untouched."""
    from kvpos._kernels import rope_apply_kernel, rope_kernel_available
    from kvpos.rope import cos_sin

    if not rope_kernel_available():
        pytest.skip("C kernel not built on this machine (the torch path is what runs)")
    rows = torch.randn(3, 2, 16, 2 * spec.head_dim).to(dtype)                  # [B, H, S, keys | values]
    keys, values = rows[..., :spec.head_dim], rows[..., spec.head_dim:].clone()
    want = rotate(keys.contiguous(), pos := torch.randint(0, 4000, (3, 16)), spec)
    cos, sin = cos_sin(pos, spec)
    assert rope_apply_kernel([keys], (cos * spec.attention_scaling)[:, None], (sin * spec.attention_scaling)[:, None],
                             spec.rotary_dim, spec.layout is RopeLayout.INTERLEAVED, [keys])
    assert torch.equal(keys, want) and torch.equal(rows[..., spec.head_dim:], values)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout.value}-R{s.rotary_dim}-s{s.attention_scaling}")
def test_rotate_by_shared_angles_equals_rotate(spec):
    from kvpos.rope import cos_sin, rotate_by

    x = torch.randn(2, 3, 9, spec.head_dim)
    pos = torch.randint(0, 3000, (2, 9))
    assert torch.equal(rotate_by(x, *cos_sin(pos, spec), spec), rotate(x, pos, spec))
    assert torch.equal(rotate_by(x, *cos_sin(pos[:1], spec), spec), rotate(x, pos[:1], spec))
    with pytest.raises(ValueError, match="rotate_by: cos"):
        rotate_by(x, *cos_sin(pos[:, :5], spec), spec)
    with pytest.raises(ValueError, match="rotate_by: x"):
        rotate_by(x[0], *cos_sin(pos, spec), spec)


@pytest.mark.parametrize("arch", TINY_ARCHS + LIMITED_ARCHS)
def test_specs_from_a_config_alone_equal_those_of_the_loaded_model(arch):
    from kvpos.integrations.hf.models import rope_specs_from_config
    model, cfg = tiny_model(arch)
    a, b = rope_specs_from_config(cfg), rope_specs_from_model(model)
    assert [s.key() for s in a] == [s.key() for s in b]
    assert [s.max_exact_position for s in a] == [s.max_exact_position for s in b]


def test_the_same_spec_rule_is_the_identity_of_what_the_rotation_depends_on():
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    a = RopeSpec(inv, 1.0, 8, 8)
    assert RopeSpec(inv.clone(), 1.0, 8, 8).identity == a.identity             # equal values, another object
    assert RopeSpec(inv, 1.0, 8, 8, rope_type="linear", max_exact_position=99).identity == a.identity
    bumped = inv.clone()
    bumped[1] = torch.nextafter(bumped[1], torch.tensor(1.0))                   # one ulp apart
    others = [RopeSpec(bumped, 1.0, 8, 8), RopeSpec(inv, 1.0 + 1e-7, 8, 8), RopeSpec(inv, 1.0, 8, 16),
              RopeSpec(inv, 1.0, 8, 8, RopeLayout.INTERLEAVED), RopeSpec(inv, 1.0, 8, 8, angle_dtype=torch.float64)]
    assert len({s.identity for s in others} | {a.identity}) == len(others) + 1


def test_head_dim_takes_the_configs_stated_width_before_hidden_over_heads():
    from types import SimpleNamespace

    from kvpos.integrations.hf.specs import head_dim

    gemma_like = SimpleNamespace(head_dim=256, hidden_size=640, num_attention_heads=4)
    assert head_dim(gemma_like) == 256                                       # not 640 / 4 = 160
    assert head_dim(SimpleNamespace(head_dim=None, hidden_size=576, num_attention_heads=9)) == 64
