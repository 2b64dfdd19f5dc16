from mlrl.data.sampler import PromptSampler


def test_resume_sees_every_prompt_once_across_epochs():
    rows = list(range(10))
    straight = PromptSampler(rows, seed=3).next_batch(27)
    a = PromptSampler(rows, seed=3)
    first = a.next_batch(13)
    b = PromptSampler.from_state(rows, a.state(), seed=3)
    assert first + b.next_batch(14) == straight
    assert sorted(straight[:10]) == rows and sorted(straight[10:20]) == rows  # each epoch is a permutation
    assert straight[:10] != straight[10:20]  # reshuffled per epoch


def test_no_shuffle_is_in_order():
    assert PromptSampler(list("abc"), seed=0, shuffle=False).next_batch(4) == ["a", "b", "c", "a"]
