"""Running the suite in two pytest-xdist workers (`make test`: `pytest -n 2`): which tests must share
a worker, and telling this test's processes from the other worker's.

The suite's tests mostly wait on the processes they start (vLLM servers, torchrun ranks), so one
worker kept the two cores of a CI machine about half busy. tests/conftest.py hands xdist work
units that run whole on one worker, in collection order (integration first, the short unit tests
last, which evens out the end):
- a test file, so that its module-scoped fixture (most integration files share one launch between
  their tests) runs once, not once per worker;
- a folder whose conftest.py has a session-scoped fixture (checkpoints saved once), for the same
  reason;
- tests/integration/cluster and tests/integration/slurm together: the Ray clusters and Slurm
  daemons they start on this one machine, one at a time as before.
"""

import functools
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED_WORKER = {"tests/integration/cluster": "ray+slurm", "tests/integration/slurm": "ray+slurm"}


@functools.cache
def _has_session_fixture(folder: str) -> bool:
    conftest = ROOT / folder / "conftest.py"
    return conftest.is_file() and 'scope="session"' in conftest.read_text()


def work_unit(nodeid: str) -> str:
    """The unit of work that the test `nodeid` (relative to the repository root) belongs to."""
    path = nodeid.split("::", 1)[0]
    folder = path.rsplit("/", 1)[0]
    if folder in SHARED_WORKER:
        return SHARED_WORKER[folder]
    return folder if _has_session_fixture(folder) else path


def another_workers(pid: int) -> bool:
    """True when `pid`'s environment names another xdist worker. xdist sets PYTEST_XDIST_WORKER
    (gw0, gw1) in each worker, and every process a test starts, directly or through torchrun, vLLM
    or the raylets of a Ray cluster the worker started, inherits it; a test that scans the whole
    machine for leftover ranks or engines skips these. A process without the variable (outside
    xdist, or one started with a clean environment) is not excluded: for a "nothing left behind"
    check, counting a process that cannot be attributed is the safe side."""
    mine = os.environ.get("PYTEST_XDIST_WORKER")
    if mine is None:
        return False
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False
    tag = b"PYTEST_XDIST_WORKER="
    return any(e.startswith(tag) and e != tag + mine.encode() for e in env)
