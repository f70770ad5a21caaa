"""The `vllm.general_plugins` entry point `kvpos_attention`: vLLM calls `register()` in each of its processes.

Off by default. With KVPOS_VLLM_ATTENTION=1 in the environment it registers kvpos's attention backend
(attention.KvposAttentionBackend) in place of vLLM's CPU_ATTN, for every engine that process starts. No vLLM import
at module level: plugins load early in vLLM's start-up.
"""
from __future__ import annotations

import os

from kvpos._checks import fail

__all__ = ["ENV", "BACKEND", "register", "enabled"]

ENV = "KVPOS_VLLM_ATTENTION"
BACKEND = "kvpos.integrations.vllm.attention.KvposAttentionBackend"


def enabled() -> bool:
    """Whether KVPOS_VLLM_ATTENTION asks for the backend ("1"; unset or "0": no). Other values raise ValueError."""
    flag = os.environ.get(ENV, "")
    if flag not in ("", "0", "1"):
        fail(ENV, "'1' (kvpos attention on) or '0' / unset (off)", repr(flag))
    return flag == "1"


def register() -> None:
    """Register the kvpos backend over CPU_ATTN when enabled() (the platform's CPU selector then returns it)."""
    if not enabled():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
