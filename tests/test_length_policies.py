"""Length policies (kvpos.window: LM-Infinite, StreamingLLM, STRING) against an eager float64 reference that builds
each policy's distance and mask matrices explicitly from its definition, on tiny random models: prefill under the
policy, then decode steps, logits compared at every step."""
import pytest
import torch

from kvpos.reference import distance_attend_ref, unrotate_ref
from kvpos.window import WindowConfig, lm_infinite, streaming_llm, string_shift
from kvpos.integrations.hf import AttentionCall, PositionedCache, extend
from kvpos.integrations.hf.testing import tiny_model
from kvpos.integrations.window import WindowBackend

N_GLOBAL, LOCAL, CEIL = 4, 8, 16           # LM-Infinite / StreamingLLM
SHIFT_AT, NEAR = 12, 4                     # STRING: distances >= 12 read as d - 12 + 4


def _lm_infinite(r, j, d, middle):
    """(kept, distance) of key slot j for the query at slot r (true distance d), as LM-Infinite defines them."""
    if r - j < LOCAL:
        return True, d
    if j < N_GLOBAL:
        return True, CEIL
    return middle, CEIL


def _streaming(r, j, d):
    if r - j < LOCAL:
        return True, d
    return j < N_GLOBAL, N_GLOBAL + LOCAL - 1 - j        # the sink's distance in the renumbered cache


def _string(r, j, d):
    return True, d if d < SHIFT_AT else d - SHIFT_AT + NEAR


POLICIES = {
    "lm_infinite": (lm_infinite(LOCAL, n_global=N_GLOBAL, distance=CEIL), lambda r, j, d: _lm_infinite(r, j, d, False)),
    "lm_infinite_topk_all": (lm_infinite(LOCAL, n_global=N_GLOBAL, distance=CEIL, top_k=1.0),
                             lambda r, j, d: _lm_infinite(r, j, d, True)),
    "streaming_llm": (streaming_llm(LOCAL, sinks=N_GLOBAL), _streaming),
    "string": (string_shift(SHIFT_AT, NEAR), _string),
}


class ExplicitDistances:
    """Reference attention backend: the policy's (kept, distance) per (query slot, key slot) built by `rule`, the
    queries unrotated and every score taken at its distance in float64 (kvpos.reference.distance_attend_ref)."""

    needs_cache = True

    def __init__(self, rule):
        self.rule = rule

    def __call__(self, call, binding):
        cache = binding.cache_layer_keys(call)
        layer = cache.layers[call.layer]
        B, Hq, Lq, D = call.query.shape
        N = call.key.shape[2]
        pos = cache.table.pos[:, :N]
        dist = torch.zeros(B, Lq, N, dtype=torch.long)
        keep = torch.zeros(B, Lq, N, dtype=torch.bool)
        for b in range(B):
            for i, r in enumerate(range(N - Lq, N)):
                for j in range(r + 1):
                    keep[b, i, j], dist[b, i, j] = self.rule(r, j, int(pos[b, r] - pos[b, j]))
        q_raw = unrotate_ref(call.query, pos[:, N - Lq:], layer.spec)
        out = distance_attend_ref(q_raw, layer.raw_keys[:, :, :N], layer.values[:, :, :N], dist, keep, layer.spec,
                                  call.scaling)
        return AttentionCall.finish(out.to(call.query.dtype))


def _run(model, backend, ids, steps, storage="rotated"):
    """Prefill `ids` under `backend`, then greedy decode `steps` tokens under it: the logits of every step."""
    cache = PositionedCache.from_model(model, storage=storage)
    logits = [extend(model, cache, ids, attention=backend)[0]]
    for _ in range(steps):
        nxt = logits[-1][-1].argmax()[None, None]
        logits.append(extend(model, cache, nxt, attention=backend)[0])
    return logits


@pytest.mark.parametrize("arch,storage", [("llama", "rotated"), ("phi3", "rotated"), ("cohere", "rotated"),
                                          ("gemma3", "rotated"), ("llama", "raw"), ("phi3", "raw"), ("qwen2", "raw")])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_length_policy_equals_explicit_distance_reference_in_prefill_and_decode(arch, storage, policy):
    """storage="raw": decode steps read the keys at the policy's mapped positions in the fused kernel."""
    cfg, rule = POLICIES[policy]
    model = tiny_model(arch, **({"sliding_window": 4096} if arch == "gemma3" else {}))[0]
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    backend = WindowBackend(cfg)
    got = _run(model, backend, ids, steps=3, storage=storage)
    assert backend.read_counts["fused"] == (3 * model.config.num_hidden_layers if storage == "raw" else 0)
    want = _run(model, ExplicitDistances(rule), ids, steps=3)
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 1e-4, (policy, arch, float((g - w).abs().max()))


def test_policies_reach_past_their_window_and_differ_from_plain_attention():
    """The test above can fail: on 40 tokens each policy changes the logits of plain attention."""
    model = tiny_model("llama")[0]
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    plain = _run(model, None, ids, steps=0)[0]
    for name, (cfg, _) in POLICIES.items():
        assert (_run(model, WindowBackend(cfg), ids, steps=0)[0] - plain).abs().max() > 1e-3, name


def test_policies_with_a_window_covering_the_context_equal_plain_attention():
    model = tiny_model("qwen2")[0]
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    plain = _run(model, None, ids, steps=2)
    for cfg in (lm_infinite(64, n_global=4), streaming_llm(64), string_shift(64, 16)):
        for g, w in zip(_run(model, WindowBackend(cfg), ids, steps=2), plain):
            assert (g - w).abs().max() < 1e-4


@pytest.mark.parametrize("make, match", [
    (lambda: WindowConfig(sink_distance=-1), "WindowConfig.sink_distance: expected None, an int >= 0"),
    (lambda: WindowConfig(sink_distance="slots"), "WindowConfig.sink_distance"),
    (lambda: WindowConfig(far_scores="shifted", selector="index"), "WindowConfig.selector: expected 'all', 'exact'"),
    (lambda: WindowConfig(shift=-2), "WindowConfig.shift: expected an int >= 0"),
    (lambda: string_shift(8, 16), "string_shift local: expected an int in \\[0, shifted_offset=8\\]"),
])
def test_bad_policy_parameters_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()
