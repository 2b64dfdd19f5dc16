"""`code_tests`: the verifiable reward of code generation (HumanEval / MBPP / APPS / LiveCodeBench-style
rows), run locally: 1.0 iff the completion's program passes every test of the row, else 0.0 (all
or nothing, as DeepCoder / rLLM's and verl's code rewards score by default).

The program is the completion's last code block tagged ```python / ```python3 / ```py, else its
last bare ``` block, else the whole completion. The row's `tests` (else its `answer`) holds the
tests, as a list or as its JSON text, in one of two forms:
- assert statements (strings): the program is run as a module (not `__main__`), then every
  statement in its namespace; it passes when a random token the harness prints after the last
  assert arrives and the exit code is 0 (a program that leaves early, `sys.exit(0)` /
  `os._exit(0)`, fails) (HumanEval / MBPP: `assert add(1, 2) == 3`);
- input / output cases (`{"input": "...", "output": "..."}` objects, or APPS' `{"inputs": [...],
  "outputs": [...]}` for stdin problems; its call-based `fn_name` problems are refused): the
  program runs as `__main__` once per case with the input on stdin and passes when its stdout
  equals the output, line by line, with trailing whitespace and trailing blank lines ignored
  (APPS / CodeContests / LiveCodeBench's stdin problems). Cases run in order and stop at the
  first failure.

How it runs: a fresh `python -I` process (the interpreter running mlrl, in isolated mode: no
user site, no PYTHON* variables, the script's folder not on the path) in a temporary folder, with
an empty environment but PATH / HOME / LANG, its own process group (killed whole on timeout), and
what it sets on itself before the program starts: address space (`MEMORY_MB`), CPU seconds, a
wall-clock alarm (for a program that sleeps), written file size (stdout goes to a file, so an
endless print ends at `OUTPUT_MB`), no core files, and death with the scoring process
(PR_SET_PDEATHSIG: the reward pool replaces a worker after a timeout). Each run gets
`RUN_TIMEOUT_S` of wall time (a row's `time_limit_s` overrides it) and a whole call at most
`CALL_TIMEOUT_S`; `workflow.reward_timeout_s` (default 30 s) also counts the time a call waits
for a free `workflow.reward_workers` process.

This is not a security sandbox: the program can read the machine's files and reach its network.
For untrusted models at scale, score in a container service (verl's SandboxFusion, NeMo-RL's
sandboxed code environment) through a custom reward; this runner is for a trusted machine.

Why by hand: the local code runners of verl and rLLM live inside those frameworks, not in a
library mlrl could call, and the sandbox services need a container runtime these machines lack;
`subprocess` + `resource` do the work.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mlrl.reward.registry import register_reward

RUN_TIMEOUT_S = 5.0
CALL_TIMEOUT_S = 20.0
MEMORY_MB = 1024
OUTPUT_MB = 16

_PYTHON_FENCES = ("", "python", "python3", "py")

# run by `python -I`: the limits, then the program. Asserts: the program runs as a module (not
# __main__: its demo / input() code stays out), the asserts in its namespace, then a random token
# from the scorer, read from stdin into a local before the program starts, is printed: a program
# that exits early (sys.exit(0), os._exit(0)) never prints it. Without asserts: as __main__.
_BOOT = """\
import ctypes, resource, runpy, signal, sys
def _main():
    mem, cpu, out, wall = (int(a) for a in sys.argv[1:5])
    prog, tests = sys.argv[5], sys.argv[6]
    try:  # die with the scoring process (a reward pool worker replaced after a timeout)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    signal.alarm(wall)  # wall clock: RLIMIT_CPU does not end a program that sleeps or blocks
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.argv = [prog]
    if not tests:
        runpy.run_path(prog, run_name="__main__")
        return
    token = sys.stdin.readline().strip()
    ns = runpy.run_path(prog, run_name="__solution__")
    with open(tests) as f:
        exec(compile(f.read(), "tests.py", "exec"), ns)
    sys.stdout.write("\\n" + token + "\\n")
    sys.stdout.flush()
_main()
"""


def extract_code(completion: str) -> str:
    """The last code block tagged ```python / ```python3 / ```py, else the last untagged ``` block
    (an example-output block after the code is untagged: it never wins over a tagged one), else the
    whole completion. A block left open at the end (cut by the token limit) counts."""
    tagged: list[str] = []
    bare: list[str] = []
    lines: list[str] | None = None
    lang = ""

    def close() -> None:
        if lines is not None and lang in _PYTHON_FENCES:
            (tagged if lang else bare).append("\n".join(lines))

    for line in completion.splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            if lines is None:
                lines, lang = [], fence[3:].strip().lower()
            else:
                close()
                lines = None
        elif lines is not None:
            lines.append(line)
    close()
    return (tagged or bare or [completion])[-1]


def parse_tests(tests: Any) -> tuple[str, list]:
    """("asserts", [statement, ...]) or ("io", [(input, output), ...]); ValueError naming the
    expected shapes otherwise."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            raise ValueError(f"code_tests reward: the tests are a string that is not JSON: {tests[:80]!r}") from None
    if isinstance(tests, dict) and tests.get("fn_name"):
        raise ValueError(f"code_tests reward: call-based tests (fn_name {tests['fn_name']!r}, APPS' LeetCode-style "
                         "problems) are not run; give stdin / stdout cases or assert statements")
    if isinstance(tests, dict) and isinstance(tests.get("inputs"), list) and isinstance(tests.get("outputs"), list):
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"], strict=True)]
    if not isinstance(tests, list) or not tests:
        raise ValueError("code_tests reward: expected a non-empty list of assert statements or of "
                         f"{{'input': ..., 'output': ...}} cases, got {str(tests)[:80]!r}")
    if all(isinstance(t, str) for t in tests):
        return "asserts", list(tests)
    if all(isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str) for t in tests):
        return "io", [(t["input"], t["output"]) for t in tests]
    raise ValueError("code_tests reward: every test must be an assert statement (a string) or every one an "
                     f"{{'input': str, 'output': str}} case; got {str(tests)[:80]!r}")


def _same_output(got: str, want: str) -> bool:
    lines = lambda s: [ln.rstrip() for ln in s.rstrip().splitlines()]  # noqa: E731
    return lines(got) == lines(want)


SCRATCH_ENV = "MLRL_REWARD_SCRATCH"  # a random label the reward pool sets before it starts workers


def _scratch_prefix(pid: int) -> str:
    """`mlrl-code-<label>-<pid>-`: the label (the pool's, inherited by its workers) keeps processes
    of other runs, or of other pid namespaces sharing this temp folder, out of one another's names."""
    return f"mlrl-code-{os.environ.get(SCRATCH_ENV) or 'local'}-{pid}-"


def remove_scratch_of(pid: int) -> None:
    """The scratch folders run_program left in a process that was killed mid-run (a reward pool
    worker terminated after a timeout runs no cleanup): named by the pool's label and that pid."""
    for folder in Path(tempfile.gettempdir()).glob(_scratch_prefix(pid) + "*"):
        shutil.rmtree(folder, ignore_errors=True)


def run_program(source: str, stdin: str = "", timeout_s: float = RUN_TIMEOUT_S,
                tests: str | None = None) -> tuple[bool | None, str]:
    """(passed, stdout) of `source` run under the limits; passed None on timeout. Without `tests`:
    passed = exit code 0. With `tests` (assert statements; `stdin` unused): passed = exit code 0
    and the harness's token printed after the last assert."""
    with tempfile.TemporaryDirectory(prefix=_scratch_prefix(os.getpid())) as tmp:
        prog, out, test_file = Path(tmp, "main.py"), Path(tmp, "stdout"), Path(tmp, "tests.py")
        prog.write_text(source)
        token = ""
        if tests is not None:
            test_file.write_text(tests)
            token = secrets.token_hex(16)
            stdin = token + "\n"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        wall = max(1, math.ceil(timeout_s))
        args = [str(MEMORY_MB << 20), str(wall), str(OUTPUT_MB << 20), str(wall + 1), str(prog),
                str(test_file) if tests is not None else ""]
        with open(out, "wb") as stdout:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, *args], cwd=tmp, env=env,
                                    stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                proc.communicate(stdin.encode(), timeout=timeout_s)
                passed: bool | None = proc.returncode == 0
            except subprocess.TimeoutExpired:
                passed = None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its children too
                except ProcessLookupError:
                    pass
                proc.wait()
        text = out.read_text(errors="replace")
        if passed and tests is not None:
            passed = text.rstrip().endswith(token)
        return passed, text


@register_reward("code_tests")
def code_tests_reward(prompt, completions, prompt_ids, completion_ids, tests=None, answer=None,
                      time_limit_s=None, **data) -> float:
    """1.0 iff the completion's program passes every test of the row (`tests`, else `answer`)."""
    spec = tests if tests is not None else answer
    if spec is None:
        raise KeyError("code_tests reward: the row has no 'tests' (or 'answer') holding the tests")
    kind, cases = parse_tests(spec)
    per_run = float(time_limit_s) if time_limit_s is not None else RUN_TIMEOUT_S
    source = extract_code(str(completions))
    if not source.strip():
        return 0.0
    deadline = time.monotonic() + CALL_TIMEOUT_S
    if kind == "asserts":
        passed, _ = run_program(source, timeout_s=min(per_run, CALL_TIMEOUT_S), tests="\n".join(cases) + "\n")
        return float(bool(passed))
    for stdin, want in cases:
        left = deadline - time.monotonic()
        if left <= 0:
            return 0.0
        passed, got = run_program(source, stdin, timeout_s=min(per_run, left))
        if not passed or not _same_output(got, want):
            return 0.0
    return 1.0
