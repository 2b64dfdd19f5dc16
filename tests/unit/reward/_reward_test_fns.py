"""Module-level reward functions for the process-pool tests (the pool pickles functions by reference)."""

import os
import time


def constant(prompt, completions, prompt_ids, completion_ids, value=1.0, **data):
    return value


def length_reward(prompt, completions, prompt_ids, completion_ids, **data):
    return float(len(completion_ids))


def raises(prompt, completions, prompt_ids, completion_ids, **data):
    raise RuntimeError("boom in reward")


def sleeps(prompt, completions, prompt_ids, completion_ids, seconds=10.0, **data):
    time.sleep(seconds)
    return 1.0


def not_a_number(prompt, completions, prompt_ids, completion_ids, **data):
    return "yes"


def worker_pid(prompt, completions, prompt_ids, completion_ids, **data):
    return float(os.getpid())


def by_completion(prompt, completions, prompt_ids, completion_ids, **data):
    """"boom" raises, "text" returns a non-number, "nan" / "inf" non-finite numbers, "sleep" hangs,
    anything else scores its length."""
    if completions == "boom":
        raise ValueError("boom in reward")
    if completions == "text":
        return "yes"
    if completions in ("nan", "inf"):
        return float(completions)
    if completions == "sleep":
        time.sleep(30)
    return float(len(completions)) + data.get("bonus", 0.0)
