"""`make test` runs two pytest-xdist workers with the work units of tests/helpers/workers.py: a
module-scoped fixture runs once, the Ray and Slurm folders share one worker, the other worker's
processes are told apart."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers.workers import another_workers, work_unit

TESTS = Path(__file__).resolve().parents[1]


def test_units_are_files_session_fixture_folders_and_ray_with_slurm():
    loop = "tests/integration/loop/test_end_to_end.py"
    assert work_unit(f"{loop}::test_sync_run") == work_unit(f"{loop}::test_resume_async") == loop
    assert work_unit("tests/integration/loop/test_learns.py::test_x") != work_unit(f"{loop}::test_sync_run")
    # tests/integration/checkpoint/conftest.py saves checkpoints in session-scoped fixtures
    ckpt = {work_unit(f"tests/integration/checkpoint/{f}::t") for f in ("test_resume.py", "test_convert_checkpoint.py")}
    assert ckpt == {"tests/integration/checkpoint"}
    ray_slurm = {work_unit(f"tests/integration/{f}::t")
                 for f in ("cluster/test_multinode_run.py", "cluster/test_ray_cluster.py", "slurm/test_sbatch.py")}
    assert len(ray_slurm) == 1


def test_a_process_of_another_worker_is_told_apart(monkeypatch):
    plain = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    envs = {"gw0": {**plain, "PYTEST_XDIST_WORKER": "gw0"}, "gw1": {**plain, "PYTEST_XDIST_WORKER": "gw1"},
            "unset": plain}
    procs = {t: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=e) for t, e in envs.items()}
    try:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
        assert {t: another_workers(p.pid) for t, p in procs.items()} == {"gw0": False, "gw1": True, "unset": False}
        monkeypatch.delenv("PYTEST_XDIST_WORKER")  # one process, no xdist: nothing is excluded
        assert not any(another_workers(p.pid) for p in procs.values())
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


UNIT_TEST = '''
import os, pytest

@pytest.fixture(scope="module")
def shared():
    with open(os.environ["LOG"], "a") as f:
        f.write(f"fixture {{__name__}}\\n")

@pytest.mark.parametrize("i", range({n}))
def test_it(shared, i):
    with open(os.environ["LOG"], "a") as f:
        f.write(f"{{os.environ['PYTEST_XDIST_WORKER']}} {{__name__}}\\n")
'''


def test_two_workers_run_each_unit_whole(tmp_path):
    root = tmp_path / "repo"
    (root / "tests").mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", root / "tests" / "conftest.py")
    shutil.copytree(TESTS / "helpers", root / "tests" / "helpers", ignore=shutil.ignore_patterns("__pycache__"))
    files = {"integration/cluster/test_a.py": 3, "integration/slurm/test_b.py": 3, "integration/loop/test_c.py": 4,
             "integration/loop/test_d.py": 4, "unit/test_e.py": 4}
    for rel, n in files.items():
        (root / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "tests" / rel).write_text(UNIT_TEST.format(n=n))
    log = tmp_path / "log.txt"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          "--no-loadscope-reorder", "tests"], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LOG": str(log)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = log.read_text().split("\n")[:-1]
    fixtures = sorted(ln.split()[1] for ln in lines if ln.startswith("fixture "))
    assert fixtures == ["test_a", "test_b", "test_c", "test_d", "test_e"], lines  # once per module
    where: dict[str, set[str]] = {}
    for ln in lines:
        if not ln.startswith("fixture "):
            worker, module = ln.split()
            where.setdefault(module, set()).add(worker)
    assert sum(len(where[m]) for m in ("test_c", "test_d", "test_e")) == 3, where   # each file on one worker
    assert len(where["test_a"] | where["test_b"]) == 1, where                      # Ray and Slurm together
    assert len(set().union(*where.values())) == 2, where                            # and two workers ran
