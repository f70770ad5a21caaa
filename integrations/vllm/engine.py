"""Engine helpers for the kvpos connector: the LLM arguments, and filling the store through the engine.

    llm = vllm.LLM(**engine_kwargs(model_dir, store="redis://127.0.0.1:6379/0"))
    precompute(llm, RequestBuilder(tok), passages)          # batched, with a progress bar

No vllm import here: pass the LLM (or anything with the same generate) in.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from kvpos._checks import fail

from .requests import RequestBuilder

__all__ = ["engine_kwargs", "precompute", "CONNECTOR", "CONNECTOR_MODULE"]

CONNECTOR = "KvposConnector"
CONNECTOR_MODULE = "kvpos.integrations.vllm.connector"


def engine_kwargs(model_dir: str, store: str, namespace: str = "default", save: bool = True, attention: bool = False,
                  **llm_kw: Any) -> dict:
    """Keyword arguments of vllm.LLM (or `vllm serve` flags' equivalent) with the kvpos connector configured:
    kv_load_failure_policy="recompute" (a chunk that cannot be loaded is recomputed by vLLM, never an empty
    output). Prefix caching stays as vLLM sets it: kvpos requests carry their own cache salt (params.py).
    attention=True: the engine runs kvpos's attention backend (attention.py; KVPOS_VLLM_ATTENTION=1 must be set in
    the environment before vLLM starts, else ValueError)."""
    from .plugin import ENV, enabled

    from vllm.config import KVTransferConfig

    if not isinstance(store, str) or not store:
        fail("engine_kwargs store", "'redis://host:port/db' or 'disk:///absolute/path'", repr(store))
    if not isinstance(save, bool):
        fail("engine_kwargs save", "a bool", f"{type(save).__name__} {save!r}", exc=TypeError)
    if not isinstance(attention, bool):
        fail("engine_kwargs attention", "a bool", f"{type(attention).__name__} {attention!r}", exc=TypeError)
    if attention != enabled():
        fail("engine_kwargs attention", f"{ENV}=1 in the environment exactly when attention=True",
             f"attention={attention}, {ENV}={enabled()}", f"export {ENV}=1 before starting vLLM (its plugin reads "
             "it in every engine process), or pass attention=False")
    cfg = KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both",
                           kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"store": store, "namespace": namespace, "save": save,
                                                      "attention": attention})
    return {"model": model_dir, "kv_transfer_config": cfg, **llm_kw}


def precompute(llm: Any, builder: RequestBuilder, passages: Sequence[str], batch: int = 8,
               progress: bool = True, desc: str = "precompute passages (vLLM)") -> int:
    """Run anchor + passage requests through the engine (one output token each) so the connector saves every
    passage's KV; returns how many passages were sent. Passages already stored are loaded, not recomputed."""
    from tqdm import tqdm
    from vllm import SamplingParams

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        fail("precompute batch", "an int >= 1", batch)
    n = 0
    bar = tqdm(total=len(passages), desc=desc, disable=not progress, file=sys.stdout)
    for i in range(0, len(passages), batch):
        reqs = [builder.precompute_request(p) for p in passages[i:i + batch]]
        sps = [SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": params})
               for _, params in reqs]
        llm.generate([prompt for prompt, _ in reqs], sps, use_tqdm=False)
        n += len(reqs)
        bar.update(len(reqs))
    bar.close()
    return n
