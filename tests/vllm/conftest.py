"""vLLM connector tests: run with the vLLM environment (`make test` does: .venv-vllm/bin/python -m pytest tests/vllm).

One engine per session (engine start takes tens of seconds on 2 cores), with the kvpos connector and a real
redis-server as the store; a second engine runs in its own process for the shared-store test."""
import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_env import MODEL  # noqa: E402

BLOCKS = 10                     # KV blocks of 128 tokens in the test engine


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    from redis_server import start_redis

    proc, port = start_redis(tmp_path_factory.mktemp("redis"))
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(5)


@pytest.fixture(scope="session")
def engine(redis_url):
    if not os.path.isfile(os.path.join(MODEL, "config.json")):
        pytest.fail(f"vLLM model folder {MODEL} missing: `make vllm-setup` exports it from the GGUF")
    from vllm import LLM

    from kvpos.integrations.vllm.engine import engine_kwargs

    # the README's configuration (prefix caching on) with a small block pool: 4 concurrent requests get preempted
    llm = LLM(**engine_kwargs(MODEL, redis_url), dtype="float32", enforce_eager=True, max_model_len=(BLOCKS - 1) * 128,
              max_num_seqs=4, enable_prefix_caching=True, max_num_batched_tokens=(BLOCKS - 1) * 128, seed=0,
              num_gpu_blocks_override=BLOCKS)
    yield llm


@pytest.fixture(scope="session")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)
