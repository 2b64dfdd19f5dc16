"""A trainer rank ends through `mlrl.trainer.rank.service._exit` once its service loop returned:
the exit handlers run as at a normal exit (the async checkpoint writer's, multiprocessing's joins,
logging's flush), buffered output is written, the exit code is the service's, and the
interpreter's finalisation (module teardown, native finalizers: ~1 s of torch / megatron-core /
triton state per rank at every run's end) is skipped."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import atexit, logging, os, sys
from mlrl.trainer.rank.service import _exit

class Finalised:
    def __del__(self, write=os.write):  # runs only in the interpreter's finalisation
        write(1, b"finalised")

keep = Finalised()
atexit.register(lambda: open(sys.argv[1], "w").write("handler ran"))
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
logging.getLogger("rank").info("logged")
print("buffered", end="")
_exit(int(sys.argv[2]))
"""


def test_exit_runs_the_handlers_flushes_and_keeps_the_code_without_finalising(tmp_path):
    for code in (0, 3):
        marker = tmp_path / f"handler{code}"
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(marker), str(code)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        assert proc.returncode == code, proc.stderr[-2000:]
        assert marker.read_text() == "handler ran"
        assert proc.stdout == "buffered" and "INFO:rank:logged" in proc.stderr
    # the same object is finalised on a plain exit: the check above can fail
    plain = SCRIPT.replace("_exit(int(sys.argv[2]))", "sys.exit(int(sys.argv[2]))")
    proc = subprocess.run([sys.executable, "-c", plain, str(tmp_path / "plain"), "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout == "bufferedfinalised"
