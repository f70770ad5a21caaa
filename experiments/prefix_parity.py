"""Is kvpos's `prefix` edit strategy as fast as transformers' own prefix reuse? (the baseline pie_eval divides by)

    PYTHONPATH=bench python experiments/prefix_parity.py [--tokens 2048] [--firsts 256 512 1024 1536 1792] [--reps 3] [--json PATH]

One real document (the start of a standard-library source file, tokenized by the model's tokenizer). For each
`first` (the index of the first edited token), side by side in one run:
  kvpos prefix   EditSession.apply(<one token replaced at first>, "prefix").update_s: copy the cache, keep the slots
                 before `first`, encode the rest after them (the update time pie_eval divides by)
  hf prefix      transformers' DynamicCache holding the first `first` tokens (built untimed), then one forward of
                 the tokens from `first` on: the prefix reuse a plain transformers user gets
  hf full        one forward of the whole document into an empty DynamicCache
All forwards skip the LM head on every position but the last (logits_to_keep=1). The ratio kvpos / hf prefix is
the parity; hf prefix / (hf full x suffix share) shows what the suffix costs per token against a full prefill
(transformers passes an explicit mask when the query is shorter than the keys, which is slower per token than the
causal full prefill on CPU: a serving engine with a causal kernel for this case would make `prefix` cheaper than
what pie_eval measures).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import sysconfig
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache

from _common import machine, markdown_table, median_time, plot, write_outputs
from kvpos.edits import Replace
from kvpos.integrations.hf import load_model
from kvpos.integrations.hf.run import cache_kwarg, logits_kwargs
from kvpos.integrations.pie import EditSession

SOURCE = "inspect.py"


def document(tok, n: int) -> torch.Tensor:
    """The first n tokens of the standard library's SOURCE. Raises SystemExit when the file is missing or short."""
    path = os.path.join(sysconfig.get_paths()["stdlib"], SOURCE)
    if not os.path.isfile(path):
        raise SystemExit(f"document: expected the standard library's {SOURCE} at {path}, got no such file")
    ids = tok(open(path, encoding="utf-8").read(), add_special_tokens=False).input_ids
    if len(ids) < n:
        raise SystemExit(f"--tokens: expected at most {len(ids)} (the length of {SOURCE}), got {n}")
    return torch.tensor(ids[:n], dtype=torch.long)


@torch.no_grad()
def hf_forward(model, ids: torch.Tensor, cache: DynamicCache) -> None:
    model(input_ids=ids[None], use_cache=True, **{cache_kwarg(model.forward): cache},
          **logits_kwargs(model.forward, True))


def measure(model, base: EditSession, first: int, reps: int) -> dict:
    """Median seconds of kvpos's and transformers' prefix updates for an edit at token `first` of the document of
    `base` (a session holding its cache; only read) (module docstring)."""
    ids = base.ids
    edit = [Replace(first, first + 1, (int(ids[first]) + 1,))]
    kvpos = [EditSession(model, ids, cache=base.cache.copy()).apply(edit, "prefix").update_s  # as pie_eval times it
             for _ in range(reps + 1)]                           # the first run warms up
    hf = []
    for _ in range(reps + 1):                                    # the first run warms up
        cache = DynamicCache(config=model.config)
        hf_forward(model, ids[:first], cache)                    # untimed: the cache before `first`
        t = time.perf_counter()
        hf_forward(model, ids[first:], cache)
        hf.append(time.perf_counter() - t)
    return {"first": first, "suffix_tokens": int(ids.numel() - first), "kvpos_prefix_s": statistics.median(kvpos[1:]),
            "hf_prefix_s": statistics.median(hf[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--firsts", type=int, nargs="+", default=[256, 512, 1024, 1536, 1792])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.reps < 1:
        raise SystemExit(f"--reps: expected >= 1, got {a.reps}")
    bad = [f for f in a.firsts if not 1 <= f < a.tokens]
    if bad:
        raise SystemExit(f"--firsts: expected token indices in [1, {a.tokens}), got {bad}")
    model, tok = load_model(a.model)
    ids = document(tok, a.tokens)
    full_s = median_time(lambda: hf_forward(model, ids, DynamicCache(config=model.config)), reps=a.reps)
    base = EditSession(model, ids)                               # one prefill, shared by every `first`
    rows = []
    for first in tqdm(a.firsts, desc="prefix_parity", file=sys.stdout):
        r = measure(model, base, first, a.reps)
        r["kvpos_over_hf"] = r["kvpos_prefix_s"] / r["hf_prefix_s"]
        r["hf_prefix_over_full_share"] = r["hf_prefix_s"] / (full_s * r["suffix_tokens"] / a.tokens)
        rows.append(r)
    table = (f"hf full prefill of {a.tokens} tokens: {full_s:.3f} s\n\n" + markdown_table(
        rows, ["first", "suffix_tokens", "kvpos_prefix_s", "hf_prefix_s", "kvpos_over_hf", "hf_prefix_over_full_share"],
        {"kvpos_prefix_s": ".3f", "hf_prefix_s": ".3f", "kvpos_over_hf": ".2f", "hf_prefix_over_full_share": ".2f"}))
    payload = {"model": a.model, "tokens": a.tokens, "source": SOURCE, "reps": a.reps, "machine": machine(),
               "hf_full_s": full_s, "rows": rows}
    write_outputs(a.json, payload, table)
    if a.json:
        xs = [r["suffix_tokens"] for r in rows]
        plot(os.path.splitext(a.json)[0] + ".png",
             {"kvpos prefix": (xs, [r["kvpos_prefix_s"] for r in rows]),
              "transformers prefix (DynamicCache)": (xs, [r["hf_prefix_s"] for r in rows]),
              "full prefill x suffix share": (xs, [full_s * x / a.tokens for x in xs])},
             "tokens recomputed after the first edit", "seconds", f"prefix reuse at {a.tokens} tokens")


if __name__ == "__main__":
    main()
