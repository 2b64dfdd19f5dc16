"""tests/conftest.py ends the pytest process with pytest's exit code before native teardown: a
session whose interpreter teardown would crash still exits with its result, and that result (pass,
failure, no tests) is the code make and .ci/run see."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

CRASHES_AT_TEARDOWN = '''
import ctypes


class _CrashesWhenCollected:
    def __del__(self, _read=ctypes.string_at):  # bound now: module globals are gone by then
        _read(0)  # SIGSEGV: what a native library's teardown did on CI


KEEP = _CrashesWhenCollected()  # collected at interpreter teardown, not before


def test_passes():
    assert True
'''


def _run(tmp_path: Path, body: str, name: str = "test_it.py") -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / name).write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("body,code", [
    (CRASHES_AT_TEARDOWN, 0),
    (CRASHES_AT_TEARDOWN.replace("assert True", "assert False"), 1),
])
def test_the_exit_code_is_pytests_even_when_teardown_would_crash(tmp_path, body, code):
    out = _run(tmp_path, body)
    assert out.returncode == code, out.stdout + out.stderr
    assert ("1 passed" if code == 0 else "1 failed") in out.stdout


def test_without_the_conftest_that_teardown_crashes(tmp_path):
    """The stand-in crash is real: the same session without tests/conftest.py dies with SIGSEGV."""
    (tmp_path / "test_it.py").write_text(CRASHES_AT_TEARDOWN)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "1 passed" in out.stdout
    assert out.returncode == -11, out.returncode


def test_no_tests_is_still_exit_5(tmp_path):
    out = _run(tmp_path, "X = 1\n", name="test_empty.py")
    assert out.returncode == 5, out.stdout + out.stderr
