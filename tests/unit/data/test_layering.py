"""`mlrl.data` is the layer below `mlrl.workflow`: workflows import datasets and the tokenizer helpers,
never the reverse (not even lazily inside a function), so the two packages cannot form a cycle."""

import ast
from pathlib import Path

DATA = Path(__file__).resolve().parents[3] / "mlrl" / "data"


def _imported_modules(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
    return mods


def test_data_never_imports_workflow():
    files = sorted(DATA.rglob("*.py"))
    assert files
    offenders = [
        f"{f.relative_to(DATA.parent)} imports {m}"
        for f in files
        for m in sorted(_imported_modules(f))
        if m == "mlrl.workflow" or m.startswith("mlrl.workflow.")
    ]
    assert not offenders, "\n".join(offenders)


def test_workflow_reexports_the_data_tokenizer_helpers():
    import mlrl.data.tokenizer as tok
    import mlrl.workflow as wf
    import mlrl.workflow.api as api

    assert wf.apply_chat_template is api.apply_chat_template is tok.apply_chat_template
    assert wf.load_hf_tokenizer is api.load_hf_tokenizer is tok.load_hf_tokenizer
