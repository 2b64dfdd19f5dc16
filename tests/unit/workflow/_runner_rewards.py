"""Module-level reward used by the runner tests (the reward pool pickles functions by reference)."""


def by_row(prompt, completions, prompt_ids, completion_ids, reward=1.0, **data):
    if reward == "fail":
        raise RuntimeError("reward failure requested by the row")
    return float(reward)
