"""Would a guess of PINE-lite's document shifts let its decode read each key once? (issue 32, calibration only)

PINE-lite's decode step reads every key twice: once for the documents' importance (without RoPE), once for the
attention at the positions that importance gives. One exact way to read them once: score the keys at GUESSED
shifts (the previous step's) while computing the importance in the same pass, then redo only the documents whose
shift turned out different. That pays only if the shifts rarely change from one step to the next. This measures
how often they do, on real prompts: HotpotQA calibration questions with their 10 paragraphs composed from chunks
encoded apart (sequential layout, storage="raw"), greedy decode under PineLiteBackend, every layer's shifts
[Hq, n] recorded at every step. Per pair of consecutive steps and layer:

    changed_layers  share of layers where some query head's shift of some document changed
    changed_groups  share of (layer, kv head) groups with a changed shift (a group is decoded together)
    redo_slots      share of document slots in a changed document of their group: what the redo would re-read

    PYTHONPATH=bench .venv/bin/python experiments/pine_shift_stability.py --n 20 --tokens 32 \
        --json results/pine_shift_stability.json
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from tqdm import tqdm

from kvpos.cache import PositionedKV
from kvpos.integrations.compose import ChunkComposer
from kvpos.integrations.hf import generate, load_model
from kvpos.integrations.pine import use_pine_lite
from kvpos.prompt import ChatPromptBuilder
from kvpos.qa_data import hotpotqa_items


def recorded_shifts(model, cache, question, tokens: int) -> list[list[torch.Tensor]]:
    """[step][layer] shift [Hq, n] of every fused decode step (PositionedKV.decode_pine's second output)."""
    seen: list[tuple[int, torch.Tensor]] = []
    real = PositionedKV.decode_pine

    def spy(self, index, *args, **kwargs):
        got = real(self, index, *args, **kwargs)
        if got is not None:
            seen.append((index, got[1][0].clone()))
        return got

    PositionedKV.decode_pine = spy
    try:
        with torch.no_grad(), use_pine_lite(model, cache):
            generate(model, cache, question[None], max_new_tokens=tokens)
    finally:
        PositionedKV.decode_pine = real
    L = model.config.num_hidden_layers
    return [[s for _, s in seen[i:i + L]] for i in range(0, len(seen) - L + 1, L)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model, tok = load_model(threads=a.threads)
    builder = ChatPromptBuilder(tok)
    composer = ChunkComposer(model, builder.anchor_ids)
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    tot = dict(layers=0, changed_layers=0, groups=0, changed_groups=0, slots=0, redo_slots=0, steps=0)
    for item in tqdm(hotpotqa_items(a.n, split="calibration"), desc="questions"):
        parts = builder.parts(item["paragraphs"], item["question"])
        cache, _ = composer.compose(parts.chunks, layout="sequential", storage="raw")
        sizes = torch.tensor([float(c.numel()) for c in parts.chunks])
        steps = recorded_shifts(model, cache, parts.question, a.tokens)
        tot["steps"] += len(steps)
        for prev, cur in zip(steps, steps[1:]):
            for s0, s1 in zip(prev, cur):
                group = (s0 != s1).view(-1, G, s0.shape[-1]).any(1)          # [Hkv, n]: a changed document
                tot["layers"] += 1
                tot["changed_layers"] += int(group.any())
                tot["groups"] += group.shape[0]
                tot["changed_groups"] += int(group.any(1).sum())
                tot["slots"] += group.shape[0] * float(sizes.sum())
                tot["redo_slots"] += float((group.float() @ sizes).sum())
    share = {k: tot[f"changed_{k}"] / max(tot[k], 1) for k in ("layers", "groups")}
    share["redo_slots"] = tot["redo_slots"] / max(tot["slots"], 1)
    table = "\n".join(["| measure | share |", "|---|---|"]
                      + [f"| {k} | {v:.3f} |" for k, v in share.items()]
                      + ["", f"{a.n} calibration HotpotQA questions, {tot['steps']} decode steps, "
                              f"{tot['layers']} (step pair, layer) comparisons"])
    print(table)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "totals": tot, "share": share}, f, indent=1)
        with open(os.path.splitext(a.json)[0] + ".md", "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
