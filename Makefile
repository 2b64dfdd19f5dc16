# The README's two commands: `make demo` and `make test`. Both create .venv on first use
# (scripts/setup_env.sh; a no-op when nothing changed).
PY := .venv/bin/python

.PHONY: setup demo test test-unit test-integration lint gpu-check
setup:
	@bash scripts/setup_env.sh

demo: setup
	$(PY) -m mlrl.launch

# scripts/setup_slurm.sh: Debian's slurm-wlm + munge for tests/integration/slurm (no-op when present)
test: setup
	@bash scripts/setup_slurm.sh
	$(PY) -m pytest -n 2 --no-loadscope-reorder tests

# ruff, then the type check (basedpyright, pyright's standard mode over mlrl/), both configured in
# pyproject.toml ([tool.ruff], [tool.basedpyright]; --project: a pyrightconfig.json in a parent
# folder would otherwise win); .ci/run runs this before the tests
lint: setup
	$(PY) -m ruff check .
	.venv/bin/basedpyright --project pyproject.toml

test-unit: setup
	$(PY) -m pytest -n 2 --no-loadscope-reorder tests/unit

test-integration: setup
	@bash scripts/setup_slurm.sh
	$(PY) -m pytest -n 2 --no-loadscope-reorder tests/integration

# On a CUDA machine with the GPU environment (README, GPU environment; not .venv, which is the CPU
# one): tests/gpu, then the train-step bench on a Qwen3-1.7B shape, then a one-line summary.
# PYTHON=/path/to/python picks another interpreter.
gpu-check:
	@bash scripts/gpu_check.sh
