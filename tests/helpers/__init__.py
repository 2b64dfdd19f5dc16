"""Helpers shared by tests in several folders (kept out of the `mlrl` package: nothing here ships).

Imported as `helpers` (e.g. `from helpers.scripted_engine import ScriptedEngine`), the same way tests
import their sibling modules: `tests/conftest.py` is a rootdir conftest, so pytest (import mode
`prepend`) puts `tests/` on sys.path before any test module is imported.
"""
