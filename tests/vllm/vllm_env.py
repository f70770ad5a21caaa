"""Where the vLLM tests find the exported model (make vllm-setup writes it)."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.environ.get("KVPOS_VLLM_MODEL", os.path.join(ROOT, ".venv-vllm", "smollm2-fp32"))
