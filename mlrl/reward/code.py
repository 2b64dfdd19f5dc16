"""`code_tests`: the verifiable reward of code generation (HumanEval / MBPP / APPS / LiveCodeBench-style
rows), run locally: 1.0 iff the completion's program passes every test of the row, else 0.0 (all
or nothing, as DeepCoder / rLLM's and verl's code rewards score by default).

The program is the completion's last fenced code block (```python, ```py or a bare ```), or the
whole completion when it has none. The row's `tests` (else its `answer`) holds the tests, as a
list or as its JSON text, in one of two forms:
- assert statements (strings): the program, then every statement, run as one script; it passes
  when the script exits 0 (HumanEval / MBPP: `assert add(1, 2) == 3`);
- input / output cases (`{"input": "...", "output": "..."}` objects): the program runs once per
  case with the input on stdin and passes when its stdout equals the output, line by line, with
  trailing whitespace and trailing blank lines ignored (APPS / CodeContests / LiveCodeBench's
  stdin problems). Cases run in order and stop at the first failure.

How it runs: a fresh `python -I` process (the interpreter running mlrl, in isolated mode: no
user site, no PYTHON* variables, the script's folder not on the path) in a temporary folder, with
an empty environment but PATH / HOME / LANG, its own process group (killed whole on timeout), and
limits it sets on itself before the program starts: address space (`MEMORY_MB`), CPU seconds,
written file size (stdout goes to a file, so an endless print ends at `OUTPUT_MB`), no core
files. Each run gets `RUN_TIMEOUT_S` of wall time (a row's `time_limit_s` overrides it) and a
whole call at most `CALL_TIMEOUT_S` (under `workflow.reward_timeout_s`'s default 30 s).

This is not a security sandbox: the program can read the machine's files and reach its network.
For untrusted models at scale, score in a container service (verl's SandboxFusion, NeMo-RL's
sandboxed code environment) through a custom reward; the local runner is what TRL- and verl-style
recipes use for their code rewards on a trusted machine.

Why by hand: no library on PyPI runs generated code under resource limits without a service or
a container runtime (which these machines lack); `subprocess` + `resource` is the standard way.
"""

from __future__ import annotations

import json
import os
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

# run by `python -I` before the program: the limits, then the program as __main__
_BOOT = """\
import resource, runpy, sys
mem, cpu, out = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = [sys.argv[4]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def extract_code(completion: str) -> str:
    """The last fenced code block (```python / ```py / a bare ```; a block left open at the end,
    cut by the token limit, counts), else the whole completion."""
    blocks: list[str] = []
    lines: list[str] | None = None
    lang = ""
    for line in completion.splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            if lines is None:
                lines, lang = [], fence[3:].strip().lower()
            else:
                if lang in _PYTHON_FENCES:
                    blocks.append("\n".join(lines))
                lines = None
        elif lines is not None:
            lines.append(line)
    if lines is not None and lang in _PYTHON_FENCES:
        blocks.append("\n".join(lines))
    return blocks[-1] if blocks else completion


def parse_tests(tests: Any) -> tuple[str, list]:
    """("asserts", [statement, ...]) or ("io", [(input, output), ...]); ValueError naming the
    expected shapes otherwise."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            raise ValueError(f"code_tests reward: the tests are a string that is not JSON: {tests[:80]!r}") from None
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


def run_program(source: str, stdin: str = "", timeout_s: float = RUN_TIMEOUT_S) -> tuple[int | None, str]:
    """(exit code, stdout) of `source` run under the limits; exit code None on timeout."""
    with tempfile.TemporaryDirectory(prefix="mlrl-code-") as tmp:
        prog, out = Path(tmp, "main.py"), Path(tmp, "stdout")
        prog.write_text(source)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        limits = [str(MEMORY_MB << 20), str(max(1, int(timeout_s + 0.999))), str(OUTPUT_MB << 20), str(prog)]
        with open(out, "wb") as stdout:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, *limits], cwd=tmp, env=env,
                                    stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                proc.communicate(stdin.encode(), timeout=timeout_s)
                code: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its children too
                except ProcessLookupError:
                    pass
                proc.wait()
        return code, out.read_text(errors="replace")


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
        code, _ = run_program(source + "\n\n" + "\n".join(cases) + "\n", timeout_s=min(per_run, CALL_TIMEOUT_S))
        return float(code == 0)
    for stdin, want in cases:
        left = deadline - time.monotonic()
        if left <= 0:
            return 0.0
        code, got = run_program(source, stdin, timeout_s=min(per_run, left))
        if code != 0 or not _same_output(got, want):
            return 0.0
    return 1.0
