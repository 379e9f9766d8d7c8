# Two entry points: `make run` (the main job on the embedded default) and `make test` (the whole suite).
# Both create .venv and install what is missing, so they work on a fresh Debian/Ubuntu machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION := 1
# aws-cdk-lib and cdk8s run their jsii kernels on Node.js, which must be a supported release (jsii
# prints an end-of-life notice on every call under Node 20). Debian's own is older (bookworm 18,
# trixie 20): where the system's node is older than 22, npm installs this Node 22 LTS build into
# the venv from npm's node-linux-<arch> package (the one npm's `node@22` package installs, taken
# directly so no install script runs), and every target finds it first on PATH. tests/conftest.py
# puts the same directory first, for pytest run by hand.
NODE_VERSION := 22.23.3
NODE_BIN := $(VENV)/node/bin
export PATH := $(CURDIR)/$(NODE_BIN):$(PATH)
# The IAM policy simulator of the infra tests (tests/iam.py), from its npm lock.
IAM_SIMULATE := tests/iam-simulate

.PHONY: run test test-infra system-deps clean

system-deps:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server; }
	@$(PY) -c 'import venv, ensurepip' 2>/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq python3-venv; }
	@# Node.js and npm: npm installs the Node 22 of $(NODE_BIN) when this one is older.
	@command -v npm >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nodejs npm; }

# The venv's node: the system's when it is 22 or later, else NODE_VERSION from npm.
$(NODE_BIN)/node:
	mkdir -p $(NODE_BIN)
	@major=$$(node -p 'process.versions.node.split(".")[0]'); \
	if [ "$$major" -ge 22 ]; then ln -sf "$$(command -v node)" $@; else \
	  arch=$$(node -p process.arch); \
	  npm install --prefix $(VENV)/node --no-save --ignore-scripts --no-audit --no-fund node-linux-$$arch@$(NODE_VERSION) && \
	  ln -sf ../node_modules/node-linux-$$arch/bin/node $@; fi
	$@ --version

# The SGLang version images/rollout.Dockerfile pins: the protocol tests read its own request types
# and server arguments (tests/sglang_oracle.py). --no-deps: its torch/CUDA stack is not needed.
SGLANG_PIN := sglang==0.5.23

$(STAMP): pyproject.toml Makefile $(IAM_SIMULATE)/package-lock.json
	$(MAKE) system-deps
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(MAKE) $(NODE_BIN)/node
	ln -sf ../node/bin/node $(BIN)/node  # `source .venv/bin/activate` finds it too
	npm ci --prefix $(IAM_SIMULATE) --ignore-scripts --no-audit --no-fund
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
	rm -rf $(VENV) runs dist cdk.out $(IAM_SIMULATE)/node_modules
