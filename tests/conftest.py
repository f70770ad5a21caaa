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
