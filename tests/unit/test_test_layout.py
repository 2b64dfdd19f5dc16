"""pytest imports test modules by basename (rootdir-relative, no packages): two test files with the
same name in different folders stop the whole collection ("import file mismatch")."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], sorted(n for n, k in names.items() if k > 1)
