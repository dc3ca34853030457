# kvgate: two commands on a fresh machine.
#   make demo   start the real vLLM testbed and show what kvgate does with it
#   make test   install everything, start what the tests need, run the whole suite
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
DEMO_VLLM_PORT ?= 8000

.PHONY: venv testbed system-deps lint test demo demo-stop clean

$(BIN)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import gateway, estimator, fastapi, transformers"
	@touch $@

venv: $(BIN)/.installed

testbed:
	bash tests/testbed/install.sh >/dev/null

system-deps:
	bash tests/system_deps.sh

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: venv testbed system-deps
	bash tests/run.sh

demo: venv testbed
	bash deploy/demo.sh $(DEMO_VLLM_PORT)

demo-stop:
	-test -f build/demo-kvgate.pid && kill $$(cat build/demo-kvgate.pid) && rm -f build/demo-kvgate.pid
	$(BIN)/python tests/testbed/testbed.py stop --pidfile build/demo-vllm.pid

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache .pytest_cache .hypothesis
