"""Synthetic verifiable tasks (`synthetic:<task>` in `get_dataset`), small enough to learn quickly on CPU.

- `copy_digit` (tiny vocabulary of `builtin:tiny-*` models): "copy 7" -> "7". Reward `exact_match`.
  The chat template renders "user : copy 7 . assistant : "; a correct answer is the digit then EOS.
- `add_digits` (tiny vocabulary): "add 3 4" -> "7", single-digit operands with a sum below 10, so the
  answer is one token. Reward `exact_match`.
- `copy_pair` (tiny vocabulary): "copy 3 7" -> "3 7": a two-token answer. Reward `token_match` (the
  share of answer positions right: partial credit; all-or-nothing gives a random init almost no
  signal on answers of several tokens).
- `sum_digits` (tiny vocabulary): "sum 7 8" -> "1 5", two digits always (a leading 0 below ten):
  a two-token answer. Reward `exact_match`. (Hard from a random init: the carry digit.)
- `reverse_digits` (tiny vocabulary): "reverse 3 1 4 1" -> "1 4 1 3", four digits: a four-token
  answer. Reward `token_match`.
- `reverse_var` (tiny vocabulary): the same with 2 to 5 digits: an answer of varying length, which
  must end with EOS inside a larger budget (`token_match` counts extra words as wrong).
- `repeat_digit` (tiny vocabulary): "repeat 7" -> "7" sixteen times: a sixteen-token answer. Reward
  `token_match`.
- `calc_multiply` (`builtin:tiny-llama-tools`): "multiply 7 8" -> "56", single-digit operands. The
  model cannot compute products; an agent with a `multiply` tool (examples/calculator_agent.py)
  can. Reward `exact_match` of the agent's final answer.
- `calc_multiply_traces` (`builtin:tiny-llama-tools`, for SFT): a warm start that knows HOW to call
  the tool but rarely does: in a quarter of the traces "multiply 7 8" -> a `multiply` call with the
  question's digits, the tool's result, a final answer copying it; in the rest a direct answer, a
  random number from 0..81 (almost always wrong). RL on `calc_multiply` must learn WHEN to call it:
  the tool-call rate and the reward rise together (the "learn to use the calculator" result of
  agentic RL).
- `arith_word` (for SmolLM2-135M-Instruct): "Tom has 3 apples and buys 4 more. How many apples does
  he have now? Answer with a single number." -> "7" (addition, subtraction, small products). Reward
  `gsm8k` (the model's `#### n`, else last `\\boxed{n}`, else its last number, compared numerically).

Determinism and held-out rows: rows depend only on (task, split, seed, num_rows). The train split
and the eval split ("test", "eval", "validation", "valid") draw from different random streams, and
for the others from disjoint sets of problems (a fixed ~10-20% of the problem space is reserved for
evaluation). `copy_digit` and `repeat_digit` have only ten distinct prompts, so their eval split is
the same distribution drawn with another seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlrl.data.rows import DatasetError

EVAL_SPLITS = ("test", "eval", "validation", "valid")


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    reward: str                                   # the registered reward that scores it
    problem: Callable[[random.Random], tuple]     # draws a problem key
    render: Callable[[tuple], dict[str, Any]]     # problem key -> row
    heldout: Callable[[tuple], bool] | None       # True: reserved for the eval split (None: no disjoint split)
    description: str


def _row(text: str, answer: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "answer": str(answer)}


def _copy_problem(rng: random.Random) -> tuple:
    return (rng.randrange(10),)


def _digits(n: int) -> Callable[[random.Random], tuple]:
    return lambda rng: tuple(rng.randrange(10) for _ in range(n))


def _reverse_var_problem(rng: random.Random) -> tuple:
    return _digits(rng.randint(2, 5))(rng)


def _words(xs: Any) -> str:
    return " ".join(str(x) for x in xs)


REPEAT_TIMES = 16


def _add_problem(rng: random.Random) -> tuple:
    a = rng.randrange(10)
    return (a, rng.randrange(10 - a))


_NAMES = [("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Mia", "she"), ("Sam", "he"), ("Lucy", "she"),
          ("Leo", "he"), ("Emma", "she")]
_ITEMS = ["apples", "pencils", "books", "cookies", "marbles", "stickers", "cards", "shells"]
_TEMPLATES = [
    ("{name} has {a} {item} and buys {b} more. How many {item} does {pron} have now?", lambda a, b: a + b),
    ("{name} has {a} {item} and gives {b} to a friend. How many {item} does {pron} have left?", lambda a, b: a - b),
    ("{name} has {a} bags with {b} {item} in each bag. How many {item} does {pron} have in total?", lambda a, b: a * b),
    (
        "There are {a} {item} on a table. {name} puts {b} more on it. How many {item} are on the table?",
        lambda a, b: a + b,
    ),
    ("{name} had {a} {item}. {pron_cap} lost {b} of them. How many {item} does {pron} have now?", lambda a, b: a - b),
]
ARITH_INSTRUCTION = " Answer with a single number."


def _arith_problem(rng: random.Random) -> tuple:
    t = rng.randrange(len(_TEMPLATES))
    if t == 2:
        a, b = rng.randint(2, 6), rng.randint(2, 6)
    elif t in (1, 4):
        a = rng.randint(3, 20)
        b = rng.randint(1, a - 1)
    else:
        a, b = rng.randint(2, 20), rng.randint(1, 10)
    return (t, a, b, rng.randrange(len(_NAMES)), rng.randrange(len(_ITEMS)))


def _arith_render(key: tuple) -> dict[str, Any]:
    t, a, b, ni, ii = key
    name, pron = _NAMES[ni]
    text, fn = _TEMPLATES[t]
    q = text.format(name=name, pron=pron, pron_cap=pron.capitalize(), a=a, b=b, item=_ITEMS[ii])
    return _row(q + ARITH_INSTRUCTION, fn(a, b))


CALC_TOOL_SHARE = 0.25  # the share of `calc_multiply_traces` that call the tool


def _calc_trace_problem(rng: random.Random) -> tuple:
    """(a, b, calls the tool, the direct answer's random number)."""
    return rng.randrange(10), rng.randrange(10), rng.random() < CALC_TOOL_SHARE, rng.randrange(82)


def _calc_trace_render(key: tuple) -> dict[str, Any]:
    """The system turn says what the chat template renders for `tools=[multiply]`, so SFT prompts
    (rendered without `tools`) equal the agent's prompts token for token."""
    a, b, calls, guess = key
    system, user = {"role": "system", "content": "tools multiply"}, {"role": "user", "content": f"multiply {a} {b}"}
    if not calls:
        return {"messages": [system, user, {"role": "assistant", "content": str(guess)}], "answer": str(a * b)}
    call = {"id": "call_0", "type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return {"messages": [
        system, user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(a * b), "tool_call_id": "call_0"},
        {"role": "assistant", "content": str(a * b)},
    ], "answer": str(a * b)}


TASKS: dict[str, SyntheticTask] = {
    "copy_digit": SyntheticTask(
        "copy_digit", "exact_match", _copy_problem, lambda k: _row(f"copy {k[0]}", k[0]), None,
        "repeat one digit (tiny vocabulary)"),
    "add_digits": SyntheticTask(
        "add_digits", "exact_match", _add_problem, lambda k: _row(f"add {k[0]} {k[1]}", k[0] + k[1]),
        lambda k: (k[0] * 10 + k[1]) % 5 == 0, "sum of two digits below 10 (tiny vocabulary)"),
    "copy_pair": SyntheticTask(
        "copy_pair", "token_match", _digits(2), lambda k: _row(f"copy {_words(k)}", _words(k)),
        lambda k: (k[0] * 10 + k[1]) % 5 == 0, "repeat two digits (tiny vocabulary)"),
    "sum_digits": SyntheticTask(
        "sum_digits", "exact_match", _digits(2), lambda k: _row(f"sum {k[0]} {k[1]}", _words(divmod(k[0] + k[1], 10))),
        lambda k: (k[0] * 10 + k[1]) % 5 == 0, "sum of two digits, written as two digits (tiny vocabulary)"),
    "reverse_digits": SyntheticTask(
        "reverse_digits", "token_match", _digits(4), lambda k: _row(f"reverse {_words(k)}", _words(k[::-1])),
        lambda k: sum(k) % 5 == 0, "reverse four digits (tiny vocabulary)"),
    "reverse_var": SyntheticTask(
        "reverse_var", "token_match", _reverse_var_problem, lambda k: _row(f"reverse {_words(k)}", _words(k[::-1])),
        lambda k: sum(k) % 5 == 0, "reverse 2 to 5 digits (tiny vocabulary)"),
    "repeat_digit": SyntheticTask(
        "repeat_digit", "token_match", _copy_problem, lambda k: _row(f"repeat {k[0]}", _words([k[0]] * REPEAT_TIMES)),
        None, f"repeat one digit {REPEAT_TIMES} times (tiny vocabulary)"),
    "calc_multiply": SyntheticTask(
        "calc_multiply", "exact_match", _digits(2), lambda k: _row(f"multiply {k[0]} {k[1]}", k[0] * k[1]),
        None, "product of two digits, through a multiply tool (tiny-llama-tools vocabulary)"),
    "calc_multiply_traces": SyntheticTask(
        "calc_multiply_traces", "exact_match", _calc_trace_problem, _calc_trace_render, None,
        "a quarter tool-call traces, the rest direct guesses, for SFT (tiny-llama-tools vocabulary)"),
    "arith_word": SyntheticTask(
        "arith_word", "gsm8k", _arith_problem, _arith_render,
        lambda k: (k[0] * 7 + k[1] * 37 + k[2] * 11) % 10 == 0, "one-step arithmetic word problems"),
}


def generate(task: str, split: str = "train", *, seed: int = 0, num_rows: int = 512) -> list[dict[str, Any]]:
    """`num_rows` rows of `task` for `split` (deterministic)."""
    if task not in TASKS:
        raise DatasetError(f"unknown synthetic task {task!r}; known: {', '.join(sorted(TASKS))}")
    if num_rows < 1:
        raise DatasetError(f"synthetic:{task}: num_rows must be >= 1, got {num_rows}")
    spec = TASKS[task]
    is_eval = split in EVAL_SPLITS
    if not is_eval and split != "train":
        raise DatasetError(f"synthetic:{task}: unknown split {split!r} (train, or one of {', '.join(EVAL_SPLITS)})")
    rng = random.Random(f"{task}/{'eval' if is_eval else 'train'}/{seed}")
    rows = []
    attempts = 0
    while len(rows) < num_rows:
        attempts += 1
        if attempts > 1000 * num_rows:
            raise DatasetError(f"synthetic:{task}: could not draw {num_rows} rows for split {split!r}")
        key = spec.problem(rng)
        if spec.heldout is not None and spec.heldout(key) != is_eval:
            continue
        rows.append(spec.render(key))
    return rows
