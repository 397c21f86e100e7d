# One command runs the app (`make run`), one runs the tests (`make test`).
# Both create .venv on first use: `make run` installs what running needs,
# `make test` adds the test extra (torch CPU, transformers, pytest).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUM := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
RUN_STAMP := $(VENV)/.run-$(SUM)
TEST_STAMP := $(VENV)/.test-$(SUM)
PIP := $(BIN)/pip install -q --disable-pip-version-check

.PHONY: run test test-prerequisites venv bench clean

$(RUN_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) -e .
	rm -f $(VENV)/.run-* $(VENV)/.test-* $(VENV)/.installed-*
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	$(PIP) -e ".[test]"
	touch $(TEST_STAMP)

venv: $(TEST_STAMP)

run: $(RUN_STAMP)
	$(BIN)/tierlab $(ARGS)

test-prerequisites:
	@command -v tmux >/dev/null || { echo "tmux is needed for the terminal smoke test: apt-get install tmux" >&2; exit 1; }

test: test-prerequisites $(TEST_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(RUN_STAMP)
	$(BIN)/tierlab bench kernels

clean:
	rm -rf $(VENV) build *.egg-info
