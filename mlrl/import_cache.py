"""Start-up cache for two scans that `import transformers` repeats in every process.

Every mlrl process imports transformers: the launcher (tokenizers), each vLLM server (vLLM imports
it), each trainer rank (the bridge reads HF configs), the tools. Its import does two things whose
result is the same each time for the same installation:

1. `transformers.utils.import_utils` calls `importlib.metadata.packages_distributions()` at import
   (`PACKAGE_DISTRIBUTION_MAPPING`): it reads the RECORD and METADATA of every installed
   distribution (~215 in .venv, ~37k file entries);
2. `transformers/__init__.py` (and `transformers/models/__init__.py`, once a model's module is
   imported) call `define_import_structure` on the `models/` folder: it reads all ~1500 model
   source files to find their `__all__`.

Measured on 2 cores (`tools/bench_rank_start.py --switch import_cache`): `import mlrl,
transformers, transformers.models.llama` 1.96 -> 0.82 CPU s, in each of the few hundred processes
a `make test` starts; 1-3 CPU s less per one-step launch. `install()` (called by
`mlrl/__init__.py`, so before any of them imports transformers) keeps both results in
`$MLRL_CACHE/import_cache/` as JSON, keyed by what they are computed from:
- the distributions: Python's version, then for each `sys.path` entry in order, the names and
  modification times of its `*.dist-info` / `*.egg-info` entries (an install, upgrade or removal
  creates or deletes one of these);
- the import structure: the transformers version, the folder, the prefix, and the path, size and
  modification time of every `.py` file under the folder (one `scandir` walk, ~30 ms).
A missing, unreadable or corrupt entry is computed as transformers computes it and written whole
(a temporary file renamed over it); a cache that cannot be written is not an error. Values are
identical to transformers' own (tests/unit/test_import_cache.py). `MLRL_IMPORT_CACHE=0` turns it
off; a process that imported transformers before mlrl is left as it is.

How: a finder first in `sys.meta_path`, for the one module `transformers.utils.import_utils`,
whose loader runs the module with `packages_distributions` answered from the cache, then wraps its
`define_import_structure`. `transformers/__init__.py` binds that name after the module has run.
"""

from __future__ import annotations

# only os and sys at import: every mlrl process, the engines' supervisors included, imports this
# module; the rest is imported when transformers is
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from pathlib import Path

ENV = "MLRL_IMPORT_CACHE"  # "0": off
TARGET = "transformers.utils.import_utils"
_DIST_SUFFIXES = (".dist-info", ".egg-info")


def install() -> bool:
    """Put the finder in place unless turned off or too late; True when it is in place."""
    if os.environ.get(ENV) == "0" or TARGET in sys.modules:
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True


def _cache_dir() -> Path:
    from mlrl.modelzoo import cache_dir

    return cache_dir() / "import_cache"


def _read(name: str) -> Any:
    import json

    try:
        return json.loads((_cache_dir() / name).read_text())
    except (OSError, ValueError):
        return None


def _write(name: str, value: Any) -> None:
    import json
    import tempfile
    from pathlib import Path

    folder = _cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(value, f)
            os.replace(tmp, folder / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


def _distributions_key() -> str:
    import hashlib

    h = hashlib.sha256(sys.version.encode())
    for entry in sys.path:
        h.update(b"\0\0" + str(entry).encode())
        try:
            with os.scandir(str(entry) or ".") as it:
                found = sorted((e.name, e.stat().st_mtime_ns) for e in it if e.name.endswith(_DIST_SUFFIXES))
        except OSError:
            continue
        for name, mtime in found:
            h.update(f"\0{name}\0{mtime}".encode())
    return h.hexdigest()


def cached_packages_distributions(compute: Callable[[], Any]) -> Callable[[], Any]:
    """`importlib.metadata.packages_distributions`, answered from the cache when its key matches."""

    def packages_distributions() -> Any:
        name = f"distributions-{_distributions_key()}.json"
        value = _read(name)
        if isinstance(value, dict) and all(isinstance(v, list) for v in value.values()):
            return value
        value = compute()
        try:
            _write(name, {str(k): list(v) for k, v in value.items()})
        except (TypeError, AttributeError, ValueError):  # not the mapping this cache knows: not kept
            pass
        return value

    return packages_distributions


def _tree_key(folder: Path, prefix: str | None, version: str) -> str:
    import hashlib

    h = hashlib.sha256(f"{version}\0{folder}\0{prefix}".encode())

    def walk(path: str) -> None:
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if e.name == "__pycache__":
                continue
            if e.is_dir():
                walk(e.path)
            elif e.name.endswith(".py"):
                st = e.stat()
                h.update(f"\0{e.path}\0{st.st_size}\0{st.st_mtime_ns}".encode())

    walk(str(folder))
    return h.hexdigest()


def _to_json(structure: dict) -> list:
    return [[sorted(backends), {m: sorted(objs) for m, objs in modules.items()}]
            for backends, modules in structure.items()]


def _from_json(value: Any) -> dict:
    return {frozenset(backends): {m: set(objs) for m, objs in modules.items()} for backends, modules in value}


def cached_define_import_structure(compute: Callable[..., Any], version: str) -> Callable[..., Any]:
    """transformers' `define_import_structure(module_path, prefix=None)`, from the cache for a
    folder whose source files have not changed. A fresh copy every call (the caller mutates it).
    A call of another form (a later release's arguments) goes to transformers' own function."""

    from pathlib import Path

    def define_import_structure(*args: Any, **kwargs: Any) -> Any:
        names = ("module_path", "prefix")
        if not 1 <= len(args) <= 2 or set(kwargs) - set(names[len(args):]):
            return compute(*args, **kwargs)
        call = {**dict(zip(names, args)), **kwargs}
        prefix = call.get("prefix")
        if not isinstance(prefix, (str, type(None))) or not isinstance(call["module_path"], (str, os.PathLike)):
            return compute(*args, **kwargs)
        folder = Path(call["module_path"])
        try:
            if folder.is_file():
                folder = folder.parent
            name = f"structure-{_tree_key(folder.resolve(), prefix, version)}.json"
        except OSError:
            return compute(*args, **kwargs)
        value = _read(name)
        if value is not None:
            try:
                return _from_json(value)
            except (TypeError, ValueError, AttributeError):
                pass
        structure = compute(*args, **kwargs)
        try:
            _write(name, _to_json(structure))
        except (TypeError, ValueError, AttributeError):  # not the structure this cache knows: not kept
            pass
        return structure

    return define_import_structure


class _Loader:
    """Runs `transformers.utils.import_utils` as its own loader would, with the two caches."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import importlib.metadata

        compute = importlib.metadata.packages_distributions
        importlib.metadata.packages_distributions = cached_packages_distributions(compute)
        try:
            self._inner.exec_module(module)
        finally:
            importlib.metadata.packages_distributions = compute
        original: Any = getattr(module, "define_import_structure", None)
        if callable(original):
            try:
                version = importlib.metadata.version("transformers")
            except importlib.metadata.PackageNotFoundError:
                return
            module.define_import_structure = cached_define_import_structure(original, version)

    def __getattr__(self, name: str) -> Any:  # get_source, get_data, ... of the file loader
        return getattr(self._inner, name)


class _Finder:
    """Answers for `transformers.utils.import_utils` once, with the spec the finders after it give
    and the loader above; nothing for every other module."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET or self.done:
            return None
        self.done = True
        for finder in [f for f in sys.meta_path if f is not self]:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None
