"""`gsm8k`, `boxed` and `math_verify` check answers with math-verify (equivalent forms match, the
regex comparison only as a fallback); off the main thread and beside someone else's SIGALRM
timer math-verify runs without its signal-based timeout; `exact_match` never touches it."""

import asyncio
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import mlrl.reward.builtin as builtin
from mlrl.reward import AsyncRewardWrapper, get_reward_fn


def call(name, completion, answer):
    return get_reward_fn(name)("prompt", completion, [1], [2], answer=answer)


@pytest.fixture(autouse=True, scope="module")
def _shutdown_pools():
    yield
    AsyncRewardWrapper.shutdown_pools()


# Each of these was scored wrongly by the regex-only comparison.
@pytest.mark.parametrize(
    "name,completion,answer,expected",
    [
        ("boxed", "so \\boxed{2x+2}", "2(x+1)", 1.0),
        ("boxed", "\\boxed{\\frac12}", "0.5", 1.0),
        ("boxed", "\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),
        ("boxed", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("boxed", "\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
        ("gsm8k", "#### \\frac{1}{2}", "0.5", 1.0),          # regex read the last number, 2
        ("gsm8k", "It is \\boxed{10^3} dollars.", "1000", 1.0),
        ("gsm8k", "\\boxed{72 \\cdot 2}", "#### 144", 1.0),
        ("gsm8k", "\\boxed{72 \\cdot 2}", "2", 0.0),          # regex: last number 2 == 2, a false 1.0
        ("math_verify", "\\boxed{x+1}", "x+1", 1.0),          # a bare reference was not parsed before
        ("math_verify", "Thus $\\boxed{2x+2}$.", "2(x+1)", 1.0),
    ],
)
def test_equivalent_forms_that_the_regex_got_wrong(name, completion, answer, expected):
    assert call(name, completion, answer) == expected


@pytest.mark.parametrize("name", ["gsm8k", "boxed", "math_verify"])
@pytest.mark.parametrize(
    "completion,answer",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{1/2}", "\\frac{1}{2}"),
        ("\\boxed{3,000}", "3000"),
        ("\\boxed{3000}", "#### 3,000"),
    ],
)
def test_equivalent_forms_match_in_every_math_reward(name, completion, answer):
    assert call(name, completion, answer) == 1.0


@pytest.mark.parametrize("name", ["gsm8k", "boxed", "math_verify"])
@pytest.mark.parametrize(
    "completion,answer",
    [("\\boxed{0.51}", "\\frac{1}{2}"), ("\\boxed{71}", "72"), ("\\boxed{-72}", "72"), ("\\boxed{2x+1}", "2(x+1)")],
)
def test_wrong_answers_score_zero(name, completion, answer):
    assert call(name, completion, answer) == 0.0


@pytest.mark.parametrize(
    "name,completion,answer,expected",
    [
        ("gsm8k", "#### 5 dollars", "5", 1.0),       # math-verify reads 5*d*o*l*l*a*r*s: the regex decides
        ("gsm8k", "#### 72.", "72", 1.0),            # math-verify cannot parse '72.': the regex decides
        ("gsm8k", "#### 73 dollars", "72", 0.0),
        ("boxed", "\\boxed{}", "0", 0.0),
        ("boxed", "\\boxed{seven}", "seven", 1.0),
    ],
)
def test_regex_fallback_when_math_verify_cannot_decide(name, completion, answer, expected):
    assert call(name, completion, answer) == expected


def test_math_equal_reports_undecidable_as_none():
    assert builtin.math_equal("#### 1,000", "10^3") is True
    assert builtin.math_equal("2(x+1)", "2x + 1") is False
    assert builtin.math_equal("5", "5 dollars") is None
    assert builtin.math_equal("72", "") is None


CASES = [("gsm8k", "So \\boxed{\\frac{1}{2}}", "0.5", 1.0), ("boxed", "\\boxed{2x+2}", "2(x+1)", 1.0),
         ("math_verify", "The answer is $\\frac{1}{2}$", "0.5", 1.0), ("gsm8k", "#### 71", "72", 0.0)]


def test_works_off_the_main_thread():
    """math-verify's default timeout is signal.alarm, which raises ValueError in any other thread."""
    errors, results = [], {}

    def run():
        try:
            for name, completion, answer, _ in CASES:
                results[name, completion] = call(name, completion, answer)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not errors and not t.is_alive()
    assert results == {(n, c): want for n, c, _, want in CASES}
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda case: call(*case[:3]), CASES * 4))
    assert got == [want for *_, want in CASES] * 4


def test_main_thread_leaves_another_sigalrm_timer_alone():
    """math-verify's alarm(0) would cancel a pending timer (pytest-timeout's, say)."""
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 100.0)
    try:
        for name, completion, answer, want in CASES:
            assert call(name, completion, answer) == want
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 90.0 < remaining <= 100.0
        assert signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not fired


def test_timeout_setting_per_context():
    assert builtin._mv_timeout() == builtin._MV_TIMEOUT_S     # main thread, SIGALRM idle
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(builtin._mv_timeout).result() is None


async def test_reward_pool_and_thread_mode():
    for workers in (1, 0):
        w = AsyncRewardWrapper(get_reward_fn("gsm8k"), max_workers=workers, timeout=60)
        got = await asyncio.gather(*(w("p", c, [], [], answer=a) for n, c, a, _ in CASES if n == "gsm8k"))
        assert got == [want for n, *_, want in CASES if n == "gsm8k"]
        assert w.stats.failures == 0 and w.stats.timeouts == 0


async def test_runaway_sympy_is_cut_by_math_verify_in_a_pool_worker():
    """A pool worker's main thread has SIGALRM to itself: math-verify's own 5 s timeout ends the
    evaluation of 10^(10^10) (0.0) before the wrapper's timeout would have to kill the pool."""
    w = AsyncRewardWrapper(get_reward_fn("gsm8k"), max_workers=1, timeout=30)
    t0 = time.monotonic()
    assert await w("p", "\\boxed{10^{10^{10}}}", [], [], answer="72") == 0.0
    assert w.stats.timeouts == 0 and w.stats.failures == 0
    assert time.monotonic() - t0 < 25


def test_exact_match_never_uses_math_verify(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("exact_match must stay plain string equality")

    monkeypatch.setattr(builtin, "math_equal", boom)
    monkeypatch.setattr(builtin, "_mv_parse", boom)
    for k in range(10):
        assert call("exact_match", f" {k}\n", str(k)) == 1.0
        assert call("exact_match", f"{k}.0", str(k)) == 0.0     # no numeric equivalence
    assert call("exact_match", "1/2", "0.5") == 0.0
