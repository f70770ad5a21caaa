"""The benchmark harnesses score what they claim: bench/rag_eval.py generates APE answers with APE attention;
bench/pie_eval.py runs the strategy each --also spec names."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pie_eval  # noqa: E402
import pytest  # noqa: E402
import rag_eval  # noqa: E402

from kvpos.integrations.ape import ape_generate  # noqa: E402
from kvpos.integrations.compose import ChunkCache  # noqa: E402
from kvpos.integrations.hf import generate  # noqa: E402
from kvpos.integrations.rag import PromptParts  # noqa: E402
from kvpos.integrations.testing import tiny_model  # noqa: E402


def test_rag_eval_generates_ape_answers_under_ape_attention():
    model = tiny_model("llama")[0]
    g = torch.Generator().manual_seed(3)
    anchor = torch.randint(3, 128, (5,), generator=g)
    parts = PromptParts(anchor, [torch.randint(3, 128, (9,), generator=g) for _ in range(6)],
                        torch.randint(3, 128, (4,), generator=g))
    cc = ChunkCache(model, anchor)
    knobs = {"temperature": 0.5, "scale": 0.8}
    m = {x.name: x for x in rag_eval.build_methods(model, cc, [], 0.0, {"ape": knobs})}["ape"]

    def answer(attend: bool) -> list[int]:
        logits, cache = m.run(parts, torch.zeros(0, dtype=torch.long))
        first = torch.tensor([[int(logits[0, -1].argmax())]])
        ctx = m.attend(cache) if attend else rag_eval.contextlib.nullcontext()
        with ctx:
            out = generate(model, cache, first, max_new_tokens=8, do_sample=False)
        return [int(first)] + out[0, 1:].tolist()

    cache, _ = cc.compose(parts.chunks, layout="parallel")
    want = ape_generate(model, cache, parts.question[None], max_new_tokens=9, do_sample=False, **knobs)
    want = want[0, parts.question.numel():].tolist()
    assert answer(attend=True) == want
    assert answer(attend=False) != want      # generating outside APE (the old harness bug) gives other tokens


def test_pie_eval_specs_name_the_session_call():
    assert pie_eval.parse_spec("pie+k16+tail256") == ("pie+k16+tail256", "pie+k", {"k": 16, "tail": 256})
    assert pie_eval.parse_spec("pie+tail512") == ("pie+tail512", "pie", {"k": 0, "tail": 512})
    assert pie_eval.parse_spec("pie+k8") == ("pie+k8", "pie+k", {"k": 8, "tail": 0})
    assert pie_eval.parse_spec("pie+attn10") == ("pie+attn10", "pie+attn", {"ratio": 0.1, "probe": 16})
    assert pie_eval.parse_spec("pie+attn5+probe32") == ("pie+attn5+probe32", "pie+attn", {"ratio": 0.05, "probe": 32})
    names = [n for n, *_ in pie_eval.strategy_names([16], also=("pie+k16+tail256",))]
    assert names == ["full", "pie", "naive", "pie+k", "pie+k16+tail256"]
    for bad in ("pie+tail", "k16", "pie+tail256+k16", "naive", "pie+attn0", "pie+attn101", "pie+attn"):
        with pytest.raises(SystemExit, match="--also"):
            pie_eval.parse_spec(bad)
    with pytest.raises(SystemExit, match="twice"):
        pie_eval.strategy_names([16, 64], also=("pie+k64",))
