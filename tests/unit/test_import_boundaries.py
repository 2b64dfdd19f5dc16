"""The package map, enforced:
- trainer/ is the only package importing megatron, rollout/ the only one importing vllm;
  algorithms/, bridge/, interfaces.py and types.py import neither;
- the driver half of the trainer (trainer/driver) imports no megatron, and of the rank half only
  the RPC definition (trainer/rank/service.py);
- interfaces.py (the seams) depends on nothing but the plain data types;
- checkpoints cross the driver/rank boundary only through files: nothing under trainer/ imports
  the driver's checkpoint/ package, and ckpt_files/ (the files both sides read and write) imports
  neither checkpoint/ nor trainer/;
- no two packages import each other, directly or through others (no cycles). Every import counts:
  module level, inside functions, and under TYPE_CHECKING.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "mlrl"
SPLIT = {"trainer"}  # packages whose subpackages are nodes of their own in the graph (driver vs rank)


def _imports(path: Path) -> set[str]:
    """Top-level names of everything `path` imports."""
    return {m.split(".")[0] for m in _modules(path)}


def _modules(path: Path) -> set[str]:
    """Full dotted names of everything `path` imports (absolute imports, `import_module("x")`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                mods.add(node.args[0].value)
    return mods


def _node(parts: tuple[str, ...], root: Path) -> str:
    """The graph node of a module given its path parts: its top-level package (or module), or for
    the SPLIT packages its subpackage (`trainer.rank`); a module directly inside a SPLIT package
    is that package's own node (`workflow` for workflow/api.py)."""
    top = parts[0].removesuffix(".py")
    if top in SPLIT and len(parts) > 2 and (root / top / parts[1]).is_dir():
        return f"{top}.{parts[1]}"
    return top


def _resolve(mod: str, root: Path, name: str) -> tuple[str, ...] | None:
    """The path parts (relative to `root`) of the longest prefix of `mod` that is a module or
    package of ours; None for other packages. `mlrl.x.y.name` -> ("x", "y.py") if x/y.py exists."""
    parts = mod.split(".")
    if parts[0] != name:
        return None
    for n in range(len(parts), 1, -1):
        rel = parts[1:n]
        if root.joinpath(*rel).with_suffix(".py").is_file():
            return (*rel[:-1], rel[-1] + ".py")
        if root.joinpath(*rel).is_dir():
            return (*rel, "__init__.py")
    return None


def package_graph(root: Path, name: str = "mlrl") -> dict[str, dict[str, set[str]]]:
    """node -> {imported node -> files making that import}, over the package at `root`."""
    graph: dict[str, dict[str, set[str]]] = {}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        src = _node(rel.parts, root)
        graph.setdefault(src, {})
        for mod in _modules(f):
            target = _resolve(mod, root, name)
            if target is not None and (dst := _node(target, root)) != src:
                graph[src].setdefault(dst, set()).add(str(rel))
    return graph


def find_cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Every elementary cycle found by a depth-first search (each reported once, rotated to start
    at its smallest node), e.g. [["algorithms", "experience", "algorithms"]]."""
    cycles: set[tuple[str, ...]] = set()

    def visit(node: str, path: list[str], on_path: set[str]) -> None:
        for nxt in sorted(graph.get(node, {})):
            if nxt in on_path:
                cyc = path[path.index(nxt):]
                i = cyc.index(min(cyc))
                cycles.add(tuple(cyc[i:] + cyc[:i]))
            elif len(path) < 12:
                visit(nxt, path + [nxt], on_path | {nxt})

    for start in sorted(graph):
        visit(start, [start], {start})
    return [list(c) + [c[0]] for c in sorted(cycles)]


def _describe(graph: dict[str, dict[str, set[str]]], cycle: list[str]) -> str:
    hops = [f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})" for a, b in zip(cycle, cycle[1:])]
    return "cycle: " + "; ".join(hops)


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
        if top in ("algorithms", "bridge", "types.py", "interfaces.py") and roots & {"megatron", "vllm"}:
            offenders.append(f"{rel} must import neither megatron nor vllm")
    assert not offenders, "\n".join(offenders)


def test_trainer_driver_side_stays_light():
    offenders = []
    for f in sorted((PKG / "trainer" / "driver").rglob("*.py")):
        rel = f.relative_to(PKG)
        mods = _modules(f)
        if "megatron" in {m.split(".")[0] for m in mods}:
            offenders.append(f"{rel} imports megatron (the driver side must not)")
        rank = {m for m in mods if m.startswith("mlrl.trainer.rank")} - {"mlrl.trainer.rank.service",
                                                                        "mlrl.trainer.rank.service.TrainerService"}
        if rank:
            offenders.append(f"{rel} imports rank-side modules {sorted(rank)} (only the RPC definition, rank.service)")
    assert not offenders, "\n".join(offenders)


def _relative_modules(path: Path, root: Path, name: str = "mlrl") -> set[str]:
    """Full dotted names of the relative imports in `path` (`from ..checkpoint import manager` in
    trainer/rank/x.py -> mlrl.checkpoint, mlrl.checkpoint.manager); `_modules` sees only absolute ones."""
    package = [name, *path.relative_to(root).parent.parts]
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            mod = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            mods.add(mod)
            mods.update(f"{mod}.{a.name}" for a in node.names)
    return mods


def imports_of(root: Path, folder: str, packages: tuple[str, ...], name: str = "mlrl") -> list[str]:
    """'file imports module' for every import (any level: module, function, TYPE_CHECKING; absolute
    or relative) by a module under `root/folder` of one of `packages` (e.g. "checkpoint") or below."""
    found = []
    for f in sorted((root / folder).rglob("*.py")):
        for mod in sorted(_modules(f) | _relative_modules(f, root, name)):
            if any(mod == f"{name}.{p}" or mod.startswith(f"{name}.{p}.") for p in packages):
                found.append(f"{f.relative_to(root)} imports {mod}")
    return found


def test_trainer_never_imports_the_driver_checkpoint_package():
    """The ranks write and read checkpoints through mlrl.ckpt_files (names, HF / PEFT writers,
    CheckpointError, the init_from check); mlrl.checkpoint is the driver's (commit, keep-last-k)."""
    assert list((PKG / "trainer").rglob("*.py"))
    offenders = imports_of(PKG, "trainer", ("checkpoint",))
    assert not offenders, "\n".join(offenders) + "\n(use mlrl.ckpt_files, the neutral home)"


def test_ckpt_files_is_neutral():
    assert list((PKG / "ckpt_files").rglob("*.py"))
    offenders = imports_of(PKG, "ckpt_files", ("checkpoint", "trainer"))
    offenders += [f"ckpt_files/{f.name} imports megatron or vllm" for f in (PKG / "ckpt_files").rglob("*.py")
                  if _imports(f) & {"megatron", "vllm"}]
    assert not offenders, "\n".join(offenders)


def test_checkpoint_import_checker_sees_function_local_and_relative_imports(tmp_path):
    root = tmp_path / "mlrl"
    (root / "trainer" / "rank").mkdir(parents=True)
    (root / "trainer" / "rank" / "a.py").write_text("def f():\n    from mlrl.checkpoint.manager import X\n")
    (root / "trainer" / "rank" / "b.py").write_text("from ...checkpoint import init_from\n")
    (root / "trainer" / "rank" / "c.py").write_text("import mlrl.checkpointing_other\nfrom mlrl.ckpt_files import x\n")
    assert imports_of(root, "trainer", ("checkpoint",)) == [
        "trainer/rank/a.py imports mlrl.checkpoint.manager", "trainer/rank/a.py imports mlrl.checkpoint.manager.X",
        "trainer/rank/b.py imports mlrl.checkpoint", "trainer/rank/b.py imports mlrl.checkpoint.init_from"]


def test_interfaces_depend_only_on_plain_data_types():
    allowed = {"mlrl.types", "mlrl.experience.batch"}
    mods = {m for m in _modules(PKG / "interfaces.py") if m.startswith("mlrl")}
    assert {m.rsplit(".", 1)[0] if m.rsplit(".", 1)[0] in allowed else m for m in mods} <= allowed, mods


def test_no_package_cycles():
    graph = package_graph(PKG)
    assert {"trainer.driver", "trainer.rank", "loop", "interfaces"} <= set(graph)  # the nodes are what we think
    cycles = find_cycles(graph)
    assert not cycles, "\n".join(_describe(graph, c) for c in cycles)


def test_cycle_checker_detects_a_synthetic_cycle(tmp_path):
    root = tmp_path / "mlrl"
    for pkg, src in {"a": "from mlrl.b.mod import f\n", "b": "def f():\n    from mlrl.c import g\n",
                     "c": "import typing\nif typing.TYPE_CHECKING:\n    from mlrl.a.mod import h\n"}.items():
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
        (root / pkg / "mod.py").write_text(src)
    (root / "c.py").unlink(missing_ok=True)
    (root / "c" / "__init__.py").write_text("def g():\n    pass\n")
    graph = package_graph(root)
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    (root / "c" / "mod.py").write_text("")  # break it: the checker goes quiet
    assert find_cycles(package_graph(root)) == []


def test_boundary_checker_detects_violation(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import megatron.core\nfrom vllm import LLM\n")
    assert {"megatron", "vllm"} <= _imports(bad)
