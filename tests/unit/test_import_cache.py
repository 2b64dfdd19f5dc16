"""mlrl/import_cache.py: transformers' import reads its two scans from the cache, with the values
transformers computes itself; a changed input recomputes; a bad or unwritable cache is not an error;
MLRL_IMPORT_CACHE=0 leaves the import alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlrl import import_cache

ROOT = Path(__file__).resolve().parents[2]

# what a process sees of transformers' import: the loader of its import_utils, the distribution
# mapping it computed at import, and the models/ import structure as `transformers/__init__.py`
# asks for it (computed again here, after clearing transformers' in-process cache when the scan is
# transformers' own, so that every value is the fresh one)
PROBE = """
import json, sys
import mlrl, transformers
import transformers.models.llama
from pathlib import Path
from transformers.utils import import_utils as iu
scans_before = iu.create_import_structure_from_path.cache_info().currsize
iu.create_import_structure_from_path.cache_clear()
getattr(iu.define_import_structure, "cache_clear", lambda: None)()  # transformers' own (lru) function
s = iu.define_import_structure(Path(transformers.__file__).parent / "models", prefix="models")
print(json.dumps({
    "loader": type(iu.__loader__).__name__,
    "scans_during_import": scans_before,
    "distributions": iu.PACKAGE_DISTRIBUTION_MAPPING,
    "structure": sorted([sorted(k), sorted((m, sorted(v)) for m, v in d.items())] for k, d in s.items()),
    "lazy_names": len(dir(transformers)),
}))
"""


def _probe(cache: Path, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, MLRL_CACHE=str(cache), **env))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_transformers_import_reads_the_cache_with_transformers_own_values(tmp_path):
    pytest.importorskip("transformers")
    own = _probe(tmp_path / "off", MLRL_IMPORT_CACHE="0")
    first = _probe(tmp_path / "on")  # computes and writes
    second = _probe(tmp_path / "on")  # reads
    assert own["loader"] == "SourceFileLoader" and first["loader"] == second["loader"] == "_Loader"
    assert not (tmp_path / "off" / "import_cache").exists()
    files = sorted(p.name for p in (tmp_path / "on" / "import_cache").iterdir())
    assert any(f.startswith("distributions-") for f in files) and sum(f.startswith("structure-") for f in files) >= 2
    # transformers' own scans ran during the import without the cache (both calls), not with a hit
    assert own["scans_during_import"] >= 2 and second["scans_during_import"] == 0
    for key in ("distributions", "structure", "lazy_names"):
        assert own[key] == first[key] == second[key], key


def _tree(root: Path) -> Path:
    (root / "pkg" / "a").mkdir(parents=True)
    (root / "pkg" / "a" / "m.py").write_text("x = 1\n")
    (root / "pkg" / "n.py").write_text("y = 2\n")
    return root / "pkg"


def _counting_structure(calls: list):
    def compute(module_path, prefix=None):
        calls.append((str(module_path), prefix))
        return {frozenset(): {"a.m": {"X", "Y"}}, frozenset({"torch"}): {"n": set()}}

    return compute


def test_the_structure_is_recomputed_when_a_source_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("MLRL_CACHE", str(tmp_path / "cache"))
    pkg, calls = _tree(tmp_path), []
    define = import_cache.cached_define_import_structure(_counting_structure(calls), "5.0")
    first = define(pkg, prefix="models")
    expected = _counting_structure([])(pkg)
    assert first == expected and len(calls) == 1
    assert define(pkg / "n.py", prefix="models") == first and len(calls) == 1  # a file names its folder
    first[frozenset()]["extra"] = {"Z"}  # the caller mutates what it gets: the cache does not change
    assert "extra" not in define(pkg, prefix="models")
    assert len(calls) == 1
    define(pkg, prefix=None)  # another prefix, another entry
    assert len(calls) == 2
    (pkg / "a" / "m.py").write_text("x = 1\n__all__ = ['x']\n")
    define(pkg, prefix="models")
    assert len(calls) == 3
    assert import_cache.cached_define_import_structure(_counting_structure(calls), "5.1")(pkg, "models") == expected \
        and len(calls) == 4  # another transformers release


def test_a_corrupt_or_unwritable_cache_is_computed_as_without_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MLRL_CACHE", str(tmp_path / "cache"))
    pkg, calls = _tree(tmp_path), []
    define = import_cache.cached_define_import_structure(_counting_structure(calls), "5.0")
    expected = define(pkg)
    for entry in (tmp_path / "cache" / "import_cache").iterdir():
        entry.write_text('[["torch"], 3]')  # valid JSON, not a structure
    assert define(pkg) == expected and len(calls) == 2
    assert define(pkg) == expected and len(calls) == 2  # rewritten whole
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MLRL_CACHE", str(blocker))  # the cache folder cannot be created
    assert define(pkg) == expected and define(pkg) == expected and len(calls) == 4


def test_the_distribution_mapping_is_recomputed_when_a_distribution_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("MLRL_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    (site / "foo-1.0.dist-info").mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    calls = []

    def compute():
        calls.append(1)
        return {"foo": ["foo"]}

    mapping = import_cache.cached_packages_distributions(compute)
    assert mapping() == {"foo": ["foo"]} and mapping() == {"foo": ["foo"]} and len(calls) == 1
    (site / "bar-2.0.dist-info").mkdir()
    mapping()
    assert len(calls) == 2
    monkeypatch.setattr(sys, "path", sys.path[1:])  # another search path
    mapping()
    assert len(calls) == 3


def test_switched_off_or_too_late_installs_nothing(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setitem(sys.modules, import_cache.TARGET, None)
    assert import_cache.install() is False  # transformers' module is imported already
    monkeypatch.delitem(sys.modules, import_cache.TARGET)
    monkeypatch.setenv(import_cache.ENV, "0")
    assert import_cache.install() is False
    monkeypatch.delenv(import_cache.ENV)
    before = len(sys.meta_path)
    assert import_cache.install() is True and import_cache.install() is True
    assert len(sys.meta_path) <= before + 1


def test_calls_and_values_of_another_form_go_to_transformers_own_function(tmp_path, monkeypatch):
    """A later transformers release may pass other arguments or return other types: those calls are
    answered by its own function, uncached, never an import error."""
    monkeypatch.setenv("MLRL_CACHE", str(tmp_path / "cache"))
    pkg, calls = _tree(tmp_path), []

    def compute(*args, **kwargs):
        calls.append((args, kwargs))
        return {frozenset(): {"a.m": {"X"}}} if not kwargs.get("odd") else {frozenset({1, "x"}): {"m": {object()}}}

    define = import_cache.cached_define_import_structure(compute, "5.0")
    assert define(pkg, "models", True) == define(pkg, prefix="models", fast=True) == {frozenset(): {"a.m": {"X"}}}
    assert calls == [((pkg, "models", True), {}), ((pkg,), {"prefix": "models", "fast": True})]
    odd = define(pkg, odd=True)
    assert len(calls) == 3 and list(odd) == [frozenset({1, "x"})]
    assert define(pkg, "models") == {frozenset(): {"a.m": {"X"}}} and len(calls) == 4  # cached from here
    assert define(pkg, "models") == {frozenset(): {"a.m": {"X"}}} and len(calls) == 4
    unserialisable = import_cache.cached_define_import_structure(lambda *a, **k: {frozenset({1, "x"}): {}}, "5.0")
    assert list(unserialisable(pkg, "other")) == [frozenset({1, "x"})]
    assert not any(".tmp-" in p.name for p in (tmp_path / "cache" / "import_cache").iterdir())
