"""Rewards for tests/integration/evaluate: known in advance from the answer's tokens alone."""


def even_first_token(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    """1.0 when the first generated token id is even (about half of a random model's samples); raises
    for a row that says "boom" (a reward failure inside one episode)."""
    if "boom" in str(data.get("messages")):
        raise ValueError("boom row")
    return float(bool(completion_ids) and completion_ids[0] % 2 == 0)


def answered(prompt, completions, prompt_ids, completion_ids, answer=None, **data) -> float:
    """1.0 for any answer with a generated token, right or wrong (a reward no built-in gives)."""
    return float(bool(completion_ids))
