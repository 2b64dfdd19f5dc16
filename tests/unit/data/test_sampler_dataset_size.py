"""The saved prompt position names the dataset length it refers to: resumed over another number of
rows (data.train, data.num_synthetic or data.max_prompt_tokens changed), the shuffled order changed
silently, repeating some prompts and skipping others. A deliberate change is allowed, and said."""

import logging

from mlrl.data.sampler import PromptSampler


def test_a_position_resumed_over_another_number_of_rows_is_said(caplog):
    rows = list(range(10))
    a = PromptSampler(rows, seed=3)
    a.next_batch(4)
    saved = a.state()
    assert saved["rows"] == 10
    with caplog.at_level(logging.WARNING, logger="mlrl.data.sampler"):
        b = PromptSampler.from_state(rows, saved, seed=3)
        assert b.next_batch(6) == a.next_batch(6)  # the same order from there
        assert not caplog.records
        c = PromptSampler.from_state(rows[:9], saved, seed=3)
    assert "one in 10 rows, and the training data has 9 now" in caplog.text
    assert c.state()["rows"] == 9 and len(c.next_batch(9)) == 9
    caplog.clear()
    old = {k: v for k, v in saved.items() if k != "rows"}  # a checkpoint from before: nothing to compare
    with caplog.at_level(logging.WARNING, logger="mlrl.data.sampler"):
        assert PromptSampler.from_state(rows[:9], old, seed=3).state()["rows"] == 9
    assert not caplog.records
