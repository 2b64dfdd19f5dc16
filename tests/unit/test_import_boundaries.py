"""trainer/ is the only package importing megatron, rollout/ the only one importing vllm;
algorithms/, bridge/ and types.py import neither."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "mlrl"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                roots.add(node.args[0].value.split(".")[0])
    return roots


def test_only_trainer_imports_megatron_and_only_rollout_imports_vllm():
    offenders = []
    files = sorted(PKG.rglob("*.py"))
    assert files
    for f in files:
        rel = f.relative_to(PKG)
        top = rel.parts[0]
        roots = _imports(f)
        if "megatron" in roots and top != "trainer":
            offenders.append(f"{rel} imports megatron (only mlrl/trainer/ may)")
        if "vllm" in roots and top != "rollout":
            offenders.append(f"{rel} imports vllm (only mlrl/rollout/ may)")
        if top in ("algorithms", "bridge", "types.py") and roots & {"megatron", "vllm"}:
            offenders.append(f"{rel} must import neither megatron nor vllm")
    assert not offenders, "\n".join(offenders)


def test_boundary_checker_detects_violation(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import megatron.core\nfrom vllm import LLM\n")
    assert {"megatron", "vllm"} <= _imports(bad)
