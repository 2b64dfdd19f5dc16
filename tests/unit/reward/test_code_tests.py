"""The `code_tests` reward (mlrl.reward.code): the completion's last Python block runs in a fresh
limited `python -I` process against the row's tests, all or nothing. The programs really run here
(they are the thing under test): right and wrong solutions, both test forms, a hang, a memory
bomb, an endless print, a leftover child process, the environment it sees, and the process pool
the reward runs in during training."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from mlrl.data.rows import normalise_rl_row
from mlrl.reward import AsyncRewardWrapper, get_reward_fn
from mlrl.reward import code as code_reward
from mlrl.reward.code import code_tests_reward, extract_code, parse_tests

ROOT = Path(__file__).resolve().parents[3]
ADD = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
ECHO_SUM = "```python\nimport sys\nnums = [int(x) for x in sys.stdin.read().split()]\nprint(sum(nums))\n```"
IO = [{"input": "1 2\n", "output": "3\n"}, {"input": "4 5 6", "output": "15"}]


def score(completion, **row):
    return code_tests_reward("p", completion, [], [], **row)


def test_the_last_python_block_is_the_program():
    assert extract_code(ADD) == "def add(a, b):\n    return a + b"
    two = "```py\nx = 1\n```\nthen\n```bash\nls\n```\nand\n```\nprint(2)\n```"
    assert extract_code(two) == "x = 1"                                       # a tagged block wins over a bare one
    assert extract_code("```bash\nls\n```\n```\nprint(2)\n```") == "print(2)"  # another language's is skipped
    assert extract_code("```bash\nls\n```\ntext\n```python\ny = 2\n```") == "y = 2"  # not the text between blocks
    assert extract_code("```python\nprint(1)\n") == "print(1)"              # open at the end: cut by max tokens
    assert extract_code("print(3)") == "print(3)"                           # no block: the whole completion
    # an example-output block after the code is untagged: the tagged block wins
    assert extract_code("```python\nprint(1 + 2)\n```\nOutput:\n```\n3\n```") == "print(1 + 2)"


def test_test_forms_and_bad_tests_name_what_is_expected():
    assert parse_tests(ADD_TESTS) == ("asserts", ADD_TESTS)
    assert parse_tests('["assert f() == 1"]') == ("asserts", ["assert f() == 1"])  # JSON text, as datasets store it
    assert parse_tests(IO) == ("io", [("1 2\n", "3\n"), ("4 5 6", "15")])
    assert parse_tests({"inputs": ["1"], "outputs": ["1"]}) == ("io", [("1", "1")])  # APPS' input_output
    for bad, says in [([], "non-empty list"), ("not json", "not JSON"), ([1, 2], "assert statement"),
                      (["assert x", {"input": "1", "output": "1"}], "every one"), ({"input": 1}, "non-empty list")]:
        with pytest.raises(ValueError, match=says):
            parse_tests(bad)
    with pytest.raises(ValueError, match="call-based tests"):
        parse_tests({"fn_name": "twoSum", "inputs": [[[2, 7], 9]], "outputs": [[0, 1]]})
    with pytest.raises(KeyError, match="no 'tests'"):
        score(ADD)


def test_right_and_wrong_programs_on_assert_tests():
    assert score(ADD, tests=ADD_TESTS) == 1.0
    assert score(ADD.replace("a + b", "a - b"), tests=ADD_TESTS) == 0.0     # one assert fails: nothing
    assert score("```python\ndef add(a, b) return\n```", tests=ADD_TESTS) == 0.0   # a syntax error
    assert score(ADD, answer=ADD_TESTS) == 1.0                              # `answer` holds them when no `tests`
    assert score("```python\n\n```", tests=ADD_TESTS) == 0.0                # no program
    # the program is a module, not __main__: its demo code (here reading stdin) does not run
    guarded = ADD.replace("```\nDone.", "if __name__ == '__main__':\n    print(add(int(input()), 1))\n```")
    assert score(guarded, tests=ADD_TESTS) == 1.0


@pytest.mark.parametrize("exit_early", ["import sys; sys.exit(0)", "import os; os._exit(0)",
                                        "import __main__; print(getattr(__main__, 'token', ''))"])
def test_a_wrong_program_that_leaves_before_the_asserts_scores_zero(exit_early):
    """Exit code 0 alone is not a pass: the harness prints a token after the last assert."""
    wrong = f"```python\ndef add(a, b):\n    return 0\n{exit_early}\n```"
    assert score(wrong, tests=ADD_TESTS) == 0.0


def test_right_and_wrong_programs_on_stdin_cases():
    assert score(ECHO_SUM, tests=IO) == 1.0
    trailing = ECHO_SUM.replace("print(sum(nums))", "print(sum(nums), ' ')\nprint()")
    assert score(trailing, tests=IO) == 1.0  # trailing space and blank lines
    assert score(ECHO_SUM.replace("sum(nums)", "max(nums)"), tests=IO) == 0.0   # right on case 1 only
    assert score(ECHO_SUM.replace("print(sum(nums))", "print(sum(nums)); raise SystemExit(1)"), tests=IO) == 0.0


def test_a_hang_a_memory_bomb_and_an_endless_print_score_zero_within_their_limits():
    t0 = time.monotonic()
    assert score("```python\nwhile True: pass\n```", tests=["assert True"], time_limit_s=1) == 0.0
    assert score("```python\nx = bytearray(8 << 30)\n```", tests=["assert True"]) == 0.0  # over MEMORY_MB: MemoryError
    assert score("```python\nwhile True: print('y' * 1000)\n```", tests=[{"input": "", "output": "y"}],
                 time_limit_s=3) == 0.0
    assert time.monotonic() - t0 < 15
    t0 = time.monotonic()  # the endless print is ended by the output limit, not by its 10 s
    passed, out = code_reward.run_program("while True: print('y' * 1000)", timeout_s=10)
    assert passed is False and len(out) <= code_reward.OUTPUT_MB << 20 and time.monotonic() - t0 < 8


def test_a_program_dies_with_the_process_that_scores_it(tmp_path):
    """A reward pool worker replaced after a timeout is terminated: the program it ran (its own
    process group, sleeping, so no CPU limit ends it) goes with it."""
    pid_file = tmp_path / "pid"
    program = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
    scorer = subprocess.Popen([sys.executable, "-c", "import sys; from mlrl.reward.code import run_program; "
                               "run_program(sys.argv[1], timeout_s=60)", program], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert psutil.pid_exists(child)
    finally:
        scorer.terminate()
        scorer.wait()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the program outlived its scorer"
        time.sleep(0.05)
    left = list(Path(tempfile.gettempdir()).glob(code_reward._scratch_prefix(scorer.pid) + "*"))
    assert left, "a killed scorer cannot remove its scratch folder itself"
    code_reward.remove_scratch_of(scorer.pid)  # what the reward pool does for a worker it killed
    assert not any(d.exists() for d in left)


def test_a_timed_out_reward_worker_leaves_no_scratch_folder(tmp_path):
    """workflow.reward_timeout_s ends a call whose program sleeps: the pool kills that worker (no
    cleanup runs in it) and removes the worker's scratch folder after it."""
    import asyncio

    cwd_file = tmp_path / "cwd"
    program = f"```python\nimport os, time\nopen({str(cwd_file)!r}, 'w').write(os.getcwd())\ntime.sleep(60)\n```"

    async def run():
        wrapper = AsyncRewardWrapper(get_reward_fn("code_tests"), timeout=3, max_workers=1)
        return await wrapper("p", program, [], [], tests=["assert True"], time_limit_s=60)

    assert asyncio.run(run()) == 0.0
    scratch = Path(cwd_file.read_text())
    assert scratch.name.startswith("mlrl-code-")
    deadline = time.monotonic() + 20
    while scratch.exists():
        assert time.monotonic() < deadline, f"{scratch} outlived the reward worker"
        time.sleep(0.1)


def test_the_program_sees_no_secrets_and_leaves_no_process(monkeypatch, tmp_path):
    monkeypatch.setenv("MLRL_TEST_SECRET", "token")
    env = "```python\nimport os\nassert 'MLRL_TEST_SECRET' not in os.environ and os.getcwd() != %r\n```" % os.getcwd()
    assert score(env, tests=["assert True"]) == 1.0
    spawn = ("```python\nimport subprocess, sys\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid)\n```")
    passed, out = code_reward.run_program(extract_code(spawn))
    assert passed
    child = int(out.split()[0])
    time.sleep(0.2)
    # killed with its group
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_rows_with_tests_load_without_an_answer_and_the_reward_runs_in_the_process_pool():
    row = normalise_rl_row({"prompt": "Write add(a, b).", "tests": ADD_TESTS}, "train.jsonl:1")
    assert row["tests"] == ADD_TESTS
    with pytest.raises(Exception, match="or 'tests', for the code_tests reward"):
        normalise_rl_row({"prompt": "Write add(a, b)."}, "train.jsonl:2")
    import asyncio

    async def run():
        wrapper = AsyncRewardWrapper(get_reward_fn("code_tests"), timeout=30, max_workers=1)
        return await wrapper("p", ADD, [], [], tests=ADD_TESTS), await wrapper("p", "nothing", [], [], tests=ADD_TESTS)

    assert asyncio.run(run()) == (1.0, 0.0)
