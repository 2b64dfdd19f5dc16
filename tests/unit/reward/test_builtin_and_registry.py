"""Built-in rewards against hand-written cases; registry lookup by name and dotted path."""

import pytest

from mlrl.reward import extract_boxed, get_reward_fn, list_rewards, parse_number, register_reward


def call(name, completion, answer, **data):
    return get_reward_fn(name)("prompt", completion, [1, 2], [3], answer=answer, **data)


def test_builtins_are_registered():
    assert {"exact_match", "token_match", "boxed", "gsm8k", "math_verify"} <= set(list_rewards())


@pytest.mark.parametrize(
    "completion,answer,expected",
    [("7 7 7 7", "7 7 7 7", 1.0), ("7 7 7", "7 7 7 7", 0.75), ("7 7 7 7 7", "7 7 7 7", 0.8),
     ("1 4 1 3", "1 4 1 3", 1.0), ("3 1 4 1", "1 4 1 3", 0.0), ("1 9 1 3", "1 4 1 3", 0.75), ("", "1 2", 0.0),
     ("", "", 1.0), (" 5\n", "5", 1.0)],
)
def test_token_match_gives_partial_credit_by_position(completion, answer, expected):
    assert call("token_match", completion, answer) == pytest.approx(expected)


def test_token_match_needs_an_answer():
    with pytest.raises(KeyError, match="token_match.*answer"):
        get_reward_fn("token_match")("p", "7", [], [])


@pytest.mark.parametrize(
    "completion,answer,expected",
    [("7", "7", 1.0), (" 7 \n", "7", 1.0), ("7 7", "7", 0.0), ("", "7", 0.0), ("8", 8, 1.0), ("Seven", "seven", 0.0)],
)
def test_exact_match(completion, answer, expected):
    assert call("exact_match", completion, answer) == expected


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("She has 3 + 4 = 7 apples.", "7", 1.0),
        ("The answer is \\boxed{1,234}.", "1234", 1.0),
        ("#### 72", "Natalia sold ... 72 clips.\n#### 72", 1.0),
        ("first 5 then 10 so 12", "10", 0.0),          # the LAST number counts
        ("\\boxed{10} and later 99", "10", 1.0),       # boxed beats a later number
        ("#### 0\nwrong 5", "0", 1.0),                  # a zero answer is an answer
        ("$10.00", "10", 1.0),
        ("no number here", "3", 0.0),
        ("-4 degrees", "-4", 1.0),
        # a markdown heading is not GSM8K's answer marker: before, its number beat the \boxed{} answer
        ("#### Step 1: apples\n#### Step 2: Cost of pears\n3 * 24 = 72\n\\boxed{72}.", "72", 1.0),
        ("#### Step 3: add\n2 + 3 = 5\n\\boxed{5}", "3", 0.0),
        ("#### 2. Cost of pears\n\\boxed{9}", "9", 1.0),        # a numbered heading
        ("#### 72\n\n#### Note: checked", "72", 1.0),             # the last marker that holds an answer
        ("#### Answer: 18\nShe sells 16 - 3 - 4 = 9 eggs at $2 each.", "18", 1.0),  # an answer line, not a heading
        ("#### The final answer is 5", "5", 1.0),
    ],
)
def test_gsm8k(completion, answer, expected):
    assert call("gsm8k", completion, answer) == expected


def test_gsm8k_answer_without_number_is_an_error():
    with pytest.raises(ValueError, match="holds no number"):
        call("gsm8k", "3", "no digits")


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{x + 1}", "x+1", 1.0),
        ("\\boxed{3.0}", "3", 1.0),
        ("the answer is 3", "3", 0.0),   # needs a box
        ("\\boxed{4}", "\\boxed{4}", 1.0),
        ("\\boxed{5", "5", 0.0),          # unbalanced
    ],
)
def test_boxed(completion, answer, expected):
    assert call("boxed", completion, answer) == expected


def test_math_verify_equivalence():
    assert call("math_verify", "The answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert call("math_verify", "\\boxed{72}", "72") == 1.0
    assert call("math_verify", "\\boxed{71}", "72") == 0.0


def test_helpers():
    assert extract_boxed("a \\boxed{1} b \\boxed{{2}+3}") == "{2}+3"
    assert extract_boxed("nothing") is None
    assert parse_number("1,000") == 1000 and parse_number("\\frac{3}{4}") == parse_number("0.75")
    assert parse_number("abc") is None


def test_missing_answer_is_an_error():
    with pytest.raises(KeyError, match="answer"):
        get_reward_fn("exact_match")("p", "c", [], [])


def test_registry_by_name_dotted_path_and_errors():
    @register_reward("unit_test_len")
    def my_len(prompt, completions, prompt_ids, completion_ids, **data):
        return float(len(completion_ids))

    assert get_reward_fn("unit_test_len") is my_len
    assert get_reward_fn("mlrl.reward.builtin.gsm8k_reward") is get_reward_fn("gsm8k")
    assert get_reward_fn("mlrl.reward.builtin:boxed_reward") is get_reward_fn("boxed")
    with pytest.raises(ValueError, match="unknown reward 'nope'.*exact_match"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="has no attribute"):
        get_reward_fn("mlrl.reward.builtin.nope")
    with pytest.raises(ValueError, match="already registered"):

        @register_reward("unit_test_len")
        def other(*a, **k):
            return 0.0
