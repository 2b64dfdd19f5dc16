# The README's two commands: `make demo` and `make test`. Both create .venv on first use
# (scripts/setup_env.sh; a no-op when nothing changed).
PY := .venv/bin/python

.PHONY: setup demo test test-unit test-integration
setup:
	@bash scripts/setup_env.sh

demo: setup
	$(PY) -m mlrl.launch

test: setup
	$(PY) -m pytest tests

test-unit: setup
	$(PY) -m pytest tests/unit

test-integration: setup
	$(PY) -m pytest tests/integration
