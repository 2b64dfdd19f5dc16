#!/usr/bin/env bash
# `make gpu-check`, on a CUDA machine with the GPU environment (pyproject.vllm.toml / the
# Dockerfile): the tests/gpu tier, then tools/bench_train_step.py on a random-weight Qwen3-1.7B
# shape, then one summary line (pytest's counts, the bench's ratio line). Both always run; the
# exit status is non-zero if either failed. PYTHON picks the interpreter (default: python on PATH).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
py=${PYTHON:-python}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

"$py" -m pytest -p no:cacheprovider -o addopts="" tests/gpu -q 2>&1 | tee "$logs/pytest.txt"
tests_rc=${PIPESTATUS[0]}
"$py" tools/bench_train_step.py --device cuda --model-shape qwen3-1.7b 2>&1 | tee "$logs/bench.txt"
bench_rc=${PIPESTATUS[0]}

# pytest -q ends with e.g. "3 passed, 2 skipped in 41.20s" (or "no tests ran in ...")
counts=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected)|no tests ran' "$logs/pytest.txt" \
  | tail -n 1 | tr -d '=' | sed -E 's/^ +| +$//g')
ratio=$(grep -E '^ratio mlrl_over_hf: ' "$logs/bench.txt" | tail -n 1)
echo "gpu-check: tests/gpu: ${counts:-no pytest summary} (exit ${tests_rc}); bench: ${ratio:-no ratio line} (exit ${bench_rc})"
[[ $tests_rc -eq 0 && $bench_rc -eq 0 ]]
