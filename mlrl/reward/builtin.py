"""Built-in verifiable rewards: `exact_match`, `boxed`, `gsm8k`, `math_verify`.

All have the registry signature `fn(prompt, completions, prompt_ids, completion_ids, **data)`
and read the reference from `data["answer"]`; each returns 1.0 or 0.0. Which one to use:
- `exact_match`: the whole completion (stripped) equals the answer (stripped) — the tiny
  synthetic tasks `copy_digit` / `add_digits`;
- `gsm8k`: numeric answers; takes the model's `#### n`, else its last `\\boxed{n}`, else the
  last number in the completion, and compares it numerically with the answer (a GSM8K
  solution's `#### n` line is understood too) — GSM8K and the `arith_word` synthetic task;
- `boxed`: the last `\\boxed{...}` must equal the answer (numerically when both are numbers,
  else as normalised strings);
- `math_verify`: symbolic equivalence through the math-verify package (LaTeX, fractions,
  sets ...), the same extraction settings as AReaL's math reward.
"""

from __future__ import annotations

import logging
import re
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


def extract_final_number(completion: str) -> Fraction | None:
    """The model's final numeric answer: `#### n`, else the last `\\boxed{}`, else the last number."""
    if "####" in completion:
        n = last_number(completion.rsplit("####", 1)[1].split("\n")[0])
        if n is not None:
            return n
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


@register_reward("exact_match")
def exact_match_reward(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    """1.0 iff the completion, stripped, equals the answer, stripped."""
    if answer is None:
        raise KeyError("exact_match reward: the row has no 'answer'")
    return float(str(completions).strip() == str(answer).strip())


@register_reward("gsm8k")
def gsm8k_reward(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    """1.0 iff the model's final number (#### n / \\boxed{n} / last number) equals the answer."""
    if answer is None:
        raise KeyError("gsm8k reward: the row has no 'answer'")
    gold = gsm8k_gold(answer)
    if gold is None:
        raise ValueError(f"gsm8k reward: answer {answer!r} holds no number")
    pred = extract_final_number(str(completions))
    return float(pred is not None and pred == gold)


@register_reward("boxed")
def boxed_reward(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    """1.0 iff the last \\boxed{...} of the completion equals the answer."""
    if answer is None:
        raise KeyError("boxed reward: the row has no 'answer'")
    pred = extract_boxed(str(completions))
    if pred is None:
        return 0.0
    gold = extract_boxed(str(answer))
    gold = str(answer) if gold is None else gold
    a, b = parse_number(pred), parse_number(gold)
    if a is not None and b is not None:
        return float(a == b)
    return float(_normalise(pred) == _normalise(gold))


_MV_LOCK = threading.Lock()
_MV_CONFIG: Any = None


@register_reward("math_verify")
def math_verify_reward(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    """1.0 iff math-verify finds the completion's answer equivalent to the reference."""
    global _MV_CONFIG
    if answer is None:
        raise KeyError("math_verify reward: the row has no 'answer'")
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    with _MV_LOCK:
        if _MV_CONFIG is None:
            _MV_CONFIG = (ExprExtractionConfig(try_extract_without_anchor=True), LatexExtractionConfig())
            # math-verify warns on every call made without its signal-based timeout.
            logging.getLogger("math_verify").setLevel(logging.ERROR)
    # math-verify's own timeouts use signal.alarm, which only works in a main thread (the pool
    # workers); elsewhere AsyncRewardWrapper's timeout is the guard.
    in_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if in_main else None
    gold = parse(str(answer), extraction_config=_MV_CONFIG, parsing_timeout=timeout)
    pred = parse(str(completions), extraction_config=_MV_CONFIG, parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, float_rounding=6, timeout_seconds=timeout))
