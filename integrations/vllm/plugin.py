"""The `vllm.general_plugins` entry point `kvpos_attention`: vLLM calls `register()` in each of its processes.

Off by default. With KVPOS_VLLM_ATTENTION=1 in the environment it registers kvpos's attention backend in place of
vLLM's, for every engine that process starts: attention.KvposAttentionBackend over CPU_ATTN on the CPU build, and
attention_cuda.KvposFlashBackend over FLASH_ATTN on CUDA (written, not tested in an engine: see its docstring). No
vLLM import at module level: plugins load early in vLLM's start-up.
"""
from __future__ import annotations

import os

from kvpos._checks import fail

__all__ = ["ENV", "BACKEND", "CUDA_BACKEND", "register", "enabled", "backend_for"]

ENV = "KVPOS_VLLM_ATTENTION"
BACKEND = "kvpos.integrations.vllm.attention.KvposAttentionBackend"
CUDA_BACKEND = "kvpos.integrations.vllm.attention_cuda.KvposFlashBackend"


def enabled() -> bool:
    """Whether KVPOS_VLLM_ATTENTION asks for the backend ("1"; unset or "0": no). Other values raise ValueError."""
    flag = os.environ.get(ENV, "")
    if flag not in ("", "0", "1"):
        fail(ENV, "'1' (kvpos attention on) or '0' / unset (off)", repr(flag))
    return flag == "1"


def backend_for(platform: str) -> tuple[str, str]:
    """(vLLM's backend name to replace, kvpos's backend class path) on a platform ("cpu" or "cuda"); ValueError on
    others."""
    pairs = {"cpu": ("CPU_ATTN", BACKEND), "cuda": ("FLASH_ATTN", CUDA_BACKEND)}
    if platform not in pairs:
        fail("kvpos attention platform", "'cpu' or 'cuda'", repr(platform), f"unset {ENV} on this platform")
    return pairs[platform]


def register() -> None:
    """Register the kvpos backend over the platform's own (backend_for) when enabled()."""
    if not enabled():
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    name, path = backend_for("cuda" if current_platform.is_cuda() else "cpu" if current_platform.is_cpu() else
                             current_platform.device_type)
    register_backend(getattr(AttentionBackendEnum, name), path)
