import collections
import json
import os

import pytest
import torch
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32, loaded once per session."""
    from kvpos.integrations.hf import load_default_model

    return load_default_model(torch.float32)


# CI runs the same examples every time (no flaky discoveries); set HYPOTHESIS_PROFILE=explore locally for new ones
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


from redis_server import start_redis  # noqa: E402


@pytest.fixture(scope="session")
def redis_server_port(tmp_path_factory):
    proc, port = start_redis(tmp_path_factory.mktemp("redis"))
    yield port
    proc.terminate()
    proc.wait(5)


# tests/vllm need the vLLM environment: `make test` runs them with .venv-vllm/bin/python (KVPOS_VLLM_TESTS=1)
collect_ignore = [] if os.environ.get("KVPOS_VLLM_TESTS") else ["vllm"]

_OUTCOMES = collections.defaultdict(collections.Counter)


@pytest.fixture
def fuzz_record():
    """record(category, outcome): counts for results/reliability.md (written when KVPOS_FUZZ_REPORT names a file)."""
    return lambda category, outcome: _OUTCOMES[category].update([outcome])


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("KVPOS_FUZZ_REPORT")
    if path and _OUTCOMES:
        with open(path, "w") as f:
            json.dump({k: dict(v) for k, v in _OUTCOMES.items()}, f, indent=1, sort_keys=True)
