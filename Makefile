# Two entry points: `make run` (the main job on the embedded default) and `make test` (the whole suite).
# Both create .venv and install what is missing, so they work on a fresh Debian/Ubuntu machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION := 1

.PHONY: run test test-infra system-deps clean

system-deps:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server; }
	@$(PY) -c 'import venv, ensurepip' 2>/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq python3-venv; }
	@# aws-cdk-lib and cdk8s run their jsii kernels on Node.js (infra and charts tests).
	@command -v node >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nodejs; }

# The SGLang version images/rollout.Dockerfile pins: the protocol tests read its own request types
# and server arguments (tests/sglang_oracle.py). --no-deps: its torch/CUDA stack is not needed.
SGLANG_PIN := sglang==0.5.23

$(STAMP): pyproject.toml Makefile
	$(MAKE) system-deps
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first, so nothing later pulls a CUDA build.
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,infra,bench,env,router]'
	$(BIN)/pip install -q --no-deps $(SGLANG_PIN)
	# checkov (tests/test_charts.py, tests/test_images.py) in its own venv: its pins clash with ours.
	test -x $(VENV)/checkov/bin/checkov || { $(PY) -m venv $(VENV)/checkov && $(VENV)/checkov/bin/pip install -q checkov==3.3.30; }
	touch $@

run: $(STAMP)
	$(BIN)/moerl run

# Two workers, a test file to each at a time (module fixtures are built once); the end-to-end
# files go first (tests/conftest.py), so the last minutes are not one long file on one worker.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The pipeline's test job (infra/pipeline.py): the stacks, charts and ops manifests only.
test-infra: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_infra_*.py tests/test_ops_charts.py

clean:
	rm -rf $(VENV) runs dist cdk.out
