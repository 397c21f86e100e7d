# One command runs the app (`make run`), one runs the tests (`make test`).
# Both create .venv on first use and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: run test test-prerequisites venv bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e ".[test]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/tierlab $(ARGS)

test-prerequisites:
	@command -v tmux >/dev/null || { echo "tmux is needed for the terminal smoke test: apt-get install tmux" >&2; exit 1; }

test: test-prerequisites $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/tierlab bench kernels

clean:
	rm -rf $(VENV) build *.egg-info
