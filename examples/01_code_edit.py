"""Edit a real file without re-prefilling it: PIE vs full recomputation vs naive reuse (SmolLM2, CPU).

The cache holds ~1k tokens of Python's textwrap.py with two real lines missing; the "developer" puts them back.
Look at: the update times (PIE should be >10x faster than full) and whether each strategy predicts the same
next line as full recomputation. How often PIE agrees with full on many samples: results/pie_eval.md
(bench/pie_eval.py); naive "conflict fast" reuse (stale suffix positions, generation at the true ones) collapses
(results/pie_eval_blend.md). What PIE still misses is stale context: the suffix's keys and values above layer 0
were computed before the edit.
"""
import sysconfig
import torch

from kvpos.integrations.hf import load_default_model
from kvpos.integrations.pie import EditSession

torch.set_num_threads(2)
model, tok = load_default_model()
path = sysconfig.get_paths()["stdlib"] + "/textwrap.py"
lines = open(path).read().split("\n")[:140]
target = len(lines) - 1
while not lines[target].strip():
    target -= 1
final = "\n".join(lines[:target])                    # end before the last newline: the model writes "\n" + line
old = "\n".join(lines[:60] + lines[62:target])       # what the cache holds: lines 60-61 missing
print(f"{path}: document of {len(tok(final).input_ids)} tokens; cached version lacks 2 lines")

base = EditSession(model, tok(old).input_ids)        # the cache we start from (prefill not timed)
RUNS = [("full", {}), ("pie", {}), ("naive", {}), ("pie+k", {"k": 8}),
        ("pie+attn", {"ratio": 0.25})]                # query-aware: the last tokens' attention picks what to refresh
for strategy, kw in RUNS:
    s = EditSession(model, base.ids, cache=base.cache.copy())
    r = s.apply_text(tok, final, strategy, **kw)      # re-tokenize, diff on tokens, update the cache
    out = tok.decode(s.generate(max_new_tokens=24))
    line = out.split("\n")[1] if "\n" in out else ""
    print(f"{strategy:8s} update {r.update_s * 1e3:7.1f} ms, encoded {r.tokens_encoded:4d} tokens -> {line!r}")
print(f"real next line:{' ' * 36}{lines[target]!r}")
