"""The saved prompt position names the dataset length it refers to: resumed over another number of
rows (data.train or data.max_prompt_tokens changed), the shuffled order silently changed, repeating
some prompts and skipping others."""

import pytest

from mlrl.data.sampler import PromptSampler


def test_a_position_resumes_only_over_the_same_number_of_rows():
    rows = list(range(10))
    a = PromptSampler(rows, seed=3)
    a.next_batch(4)
    saved = a.state()
    assert saved["rows"] == 10
    b = PromptSampler.from_state(rows, saved, seed=3)
    assert b.next_batch(6) == a.next_batch(6)  # the same order from there
    with pytest.raises(ValueError, match=r"one in 10 rows, and the training data has 9 now"):
        PromptSampler.from_state(rows[:9], saved, seed=3)
    old = {k: v for k, v in saved.items() if k != "rows"}  # a checkpoint from before: not checked
    assert PromptSampler.from_state(rows[:9], old, seed=3).state()["rows"] == 9
