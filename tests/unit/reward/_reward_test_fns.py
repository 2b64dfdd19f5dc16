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
