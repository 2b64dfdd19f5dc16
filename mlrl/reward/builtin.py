"""Built-in verifiable rewards: `exact_match`, `token_match`, `boxed`, `gsm8k`, `math_verify`.

All have the registry signature `fn(prompt, completions, prompt_ids, completion_ids, **data)`
and read the reference from `data["answer"]`; each returns 1.0 or 0.0, but `token_match`, which
gives partial credit. Which one to use:
- `exact_match`: the whole completion (stripped) equals the answer (stripped) — the tiny
  synthetic tasks `copy_digit` / `add_digits` / `sum_digits`;
- `token_match`: the share of the answer's whitespace-separated words that the completion has at
  the same position, over the longer of the two (extra words cost as much as missing ones) — long
  answers such as `copy_pair` / `reverse_*` / `repeat_digit`, where all-or-nothing gives a
  random init almost no signal;
- `gsm8k`: numeric answers; takes the model's `#### ...` line, else its last `\\boxed{...}`,
  else the last number in the completion, and checks it against the answer (a GSM8K
  solution's `#### n` line is understood too) — GSM8K and the `arith_word` synthetic task;
- `boxed`: the last `\\boxed{...}` must equal the answer;
- `math_verify`: math-verify extracts the answer from the whole completion itself (LaTeX,
  boxed, plain expressions: the same extraction settings as AReaL's math reward).

Equivalence is math-verify's (`parse` + `verify`: sympy-backed, so `\\frac{1}{2}`, `0.5`,
`1/2`; `2x+2`, `2(x+1)`; `3,000`, `3000`; `10^3`, `1000` all match) for `gsm8k`, `boxed` and
`math_verify`. The reference is read as `\\boxed{<answer>}` (after a GSM8K `####`), because
math-verify only finds a bare `x+1` inside LaTeX delimiters.

Where hand-written regexes remain, and why:
- `exact_match` is plain string equality and never touches math-verify: it is the reward of
  the toy synthetic tasks (and of the CPU demo), whose rewards must not change by a bit;
- answer *extraction* for `gsm8k` / `boxed` (`extract_boxed`, the `####` line, the last
  number): GSM8K's `####` convention and "the last `\\boxed{}` wins" are ours, not
  math-verify's (its own extractor, used by `math_verify`, may pick a different span);
- the old numeric / normalised-string comparison (`parse_number`, `extract_final_number`,
  `_normalise`) is the fallback when math-verify cannot read a side (empty or unparsable
  text such as `72.`), and when it reads exactly one side as an expression in letters and
  the other as a plain number: math-verify turns stray prose into products of symbols
  (`5 dollars` -> 5*d*o*l*l*a*r*s), which must not make a right number wrong.

Timeouts: math-verify's own timeout is `signal.alarm`, which raises in any thread but the
main one and would cancel a SIGALRM timer someone else set (pytest-timeout, for one). It is
used only on a main thread where SIGALRM is idle — the reward pool's worker processes — and
disabled (`parsing_timeout=None`, `timeout_seconds=None`) elsewhere, e.g. in the threads of
`AsyncRewardWrapper(max_workers=0)`, whose own timeout is then the guard (a runaway sympy
evaluation such as `10^{10^{10}}` keeps its thread busy: prefer the process pool).
"""

from __future__ import annotations

import functools
import logging
import re
import signal
import threading
from fractions import Fraction
from typing import Any

from mlrl.reward.registry import register_reward

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
            return None  # unbalanced
        start = text.rfind("\\boxed", 0, start)
    return None


def parse_number(text: str) -> Fraction | None:
    """The single number `text` denotes ('1,234', '$5', '7.50', '-3', '3/4'), else None."""
    s = text.strip().strip("$").replace(",", "").replace("\\!", "").strip()
    s = s.rstrip(".").removesuffix("%").strip()
    if not s:
        return None
    m = re.fullmatch(r"\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> Fraction | None:
    found = _NUMBER.findall(text)
    return parse_number(found[-1]) if found else None


def gsm8k_gold(answer: Any) -> Fraction | None:
    """The reference number of a GSM8K-style answer ('... #### 72', '72', 72)."""
    s = str(answer)
    if "####" in s:
        s = s.rsplit("####", 1)[1]
    n = parse_number(s)
    return n if n is not None else last_number(s)


# '#### Step 2: ...', '#### 2. Cost of ...' (but '#### Answer: 18', '#### The final answer is 5' are answers)
_HEADING = re.compile(r"(?i)(?!.*\banswer\b)\s*(?:[^\W\d_]|\d+[.)]\s+[^\W\d_])")


def hash_answer_line(completion: str) -> str | None:
    """The text after the last GSM8K answer marker `#### ` (to the end of its line) that holds a
    number. A markdown level-4 heading (`#### Step 2: ...`, `#### 2. Cost of pears`: a word, or
    a numbered title, without the word "answer") is not an answer marker: a model that writes headings and answers in
    `\\boxed{}` (what mlrl's gsm8k prompt asks for) was scored on a number in a heading."""
    for part in reversed(completion.split("####")[1:]):
        line = part.split("\n")[0]
        if not _HEADING.match(line) and last_number(line) is not None:
            return line.strip()
    return None


def extract_final_number(completion: str) -> Fraction | None:
    """The model's final numeric answer: `#### n` (`hash_answer_line`), else the last `\\boxed{}`,
    else the last number."""
    line = hash_answer_line(completion)
    if line is not None:
        return last_number(line)
    boxed = extract_boxed(completion)
    if boxed is not None:
        n = parse_number(boxed)
        if n is None:
            n = last_number(boxed)
        if n is not None:
            return n
    return last_number(completion)


def _normalise(s: str) -> str:
    return re.sub(r"\s+", "", s.strip().strip("$").rstrip("."))


@register_reward("exact_match", inline=True)
def exact_match_reward(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    """1.0 iff the completion, stripped, equals the answer, stripped."""
    if answer is None:
        raise KeyError("exact_match reward: the row has no 'answer'")
    return float(str(completions).strip() == str(answer).strip())


@register_reward("token_match", inline=True)
def token_match_reward(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    """Partial credit: #{i : completion word i == answer word i} / max(#answer words, #completion words)."""
    if answer is None:
        raise KeyError("token_match reward: the row has no 'answer'")
    want, got = str(answer).split(), str(completions).split()
    if not want and not got:
        return 1.0
    return sum(a == b for a, b in zip(want, got)) / max(len(want), len(got))


_MV_TIMEOUT_S = 5


@functools.cache
def _mv_configs() -> tuple[Any, Any]:
    """(config for a reference / extracted answer, config for a whole completion). Imported
    lazily: math-verify pulls in sympy."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # math-verify warns once when called without its timeout, and on every parse it gives up on.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return (LatexExtractionConfig(),), (ExprExtractionConfig(try_extract_without_anchor=True), LatexExtractionConfig())


def _mv_timeout() -> int | None:
    """math-verify's timeout (seconds) when its SIGALRM guard is usable here, else None (off)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        idle = signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None) and signal.getitimer(signal.ITIMER_REAL) == (
            0.0,
            0.0,
        )
    except (AttributeError, ValueError):  # no SIGALRM (Windows)
        return None
    return _MV_TIMEOUT_S if idle else None


def _mv_parse(text: str, config: Any, timeout: int | None) -> list[Any]:
    """math-verify's reading of `text`: sympy objects, then the matched strings."""
    from math_verify import parse

    # math-verify takes parsing_timeout=None (no timeout) though it annotates the parameter int.
    return parse(text, extraction_config=config, parsing_timeout=timeout)  # pyright: ignore[reportArgumentType]


def _sympy(parsed: list[Any]) -> Any | None:
    """The first sympy object of a `parse` result; None when math-verify parsed nothing
    (a result of strings only is its unparsed fallback match)."""
    return next((x for x in parsed if not isinstance(x, str)), None)


def _reference_text(answer: Any) -> str:
    """The reference answer proper: after a GSM8K `####`, inside a `\\boxed{}`, without `$`s."""
    s = str(answer).strip()
    if "####" in s:
        s = s.rsplit("####", 1)[1].strip()
    boxed = extract_boxed(s)
    return (s if boxed is None else boxed).strip().strip("$").strip()


def _symbolic(expr: Any) -> bool:
    return bool(getattr(expr, "free_symbols", None))


def math_equal(reference: Any, candidate: str) -> bool | None:
    """Whether math-verify finds the extracted `candidate` answer equivalent to `reference`;
    None when it cannot decide (a side it cannot parse, or prose read as symbols against a
    plain number — the caller's fallback then decides)."""
    from math_verify import verify

    config, _ = _mv_configs()
    timeout = _mv_timeout()
    gold = _mv_parse("\\boxed{" + _reference_text(reference) + "}", config, timeout)
    pred = _mv_parse("\\boxed{" + candidate.strip().strip("$").strip() + "}", config, timeout)
    gold_expr, pred_expr = _sympy(gold), _sympy(pred)
    if gold_expr is None or pred_expr is None:
        return None
    if verify(gold, pred, float_rounding=6, timeout_seconds=timeout):
        return True
    if _symbolic(gold_expr) != _symbolic(pred_expr):
        return None
    return False


def final_answer_text(completion: str) -> str | None:
    """The span holding the model's final answer, in `extract_final_number`'s order: the text
    after the last `####` answer marker (`hash_answer_line`), else the last `\\boxed{}`'s content, else the
    last number — a span is skipped when it holds no number (GSM8K answers are numeric)."""
    line = hash_answer_line(completion)
    if line is not None:
        return line
    boxed = extract_boxed(completion)
    if boxed is not None and last_number(boxed) is not None:
        return boxed
    found = _NUMBER.findall(completion)
    return found[-1] if found else None


@register_reward("gsm8k")
def gsm8k_reward(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    """1.0 iff the model's final answer (#### line / \\boxed{} / last number) equals the answer:
    math-verify decides, the numeric regex comparison when it cannot."""
    if answer is None:
        raise KeyError("gsm8k reward: the row has no 'answer'")
    gold = gsm8k_gold(answer)
    if gold is None:
        raise ValueError(f"gsm8k reward: answer {answer!r} holds no number")
    completion = str(completions)
    span = final_answer_text(completion)
    if span is None:
        return 0.0
    same = math_equal(answer, span)
    if same is not None:
        return float(same)
    pred = extract_final_number(completion)
    return float(pred is not None and pred == gold)


@register_reward("boxed")
def boxed_reward(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    """1.0 iff the last \\boxed{...} of the completion equals the answer: math-verify decides,
    the numeric / normalised-string comparison when it cannot."""
    if answer is None:
        raise KeyError("boxed reward: the row has no 'answer'")
    pred = extract_boxed(str(completions))
    if pred is None:
        return 0.0
    same = math_equal(answer, pred)
    if same is not None:
        return float(same)
    gold = extract_boxed(str(answer))
    gold = str(answer) if gold is None else gold
    a, b = parse_number(pred), parse_number(gold)
    if a is not None and b is not None:
        return float(a == b)
    return float(_normalise(pred) == _normalise(gold))


@register_reward("math_verify")
def math_verify_reward(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    """1.0 iff math-verify, extracting the answer from the whole completion itself, finds it
    equivalent to the reference (0.0 when it reads nothing on either side)."""
    if answer is None:
        raise KeyError("math_verify reward: the row has no 'answer'")
    from math_verify import verify

    ref_config, completion_config = _mv_configs()
    timeout = _mv_timeout()
    gold = _mv_parse("\\boxed{" + _reference_text(answer) + "}", ref_config, timeout)
    pred = _mv_parse(str(completions), completion_config, timeout)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, float_rounding=6, timeout_seconds=timeout))
