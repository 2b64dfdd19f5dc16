"""ModelRequest takes prompt ids the way AReaL-style workflow code passes them (a BatchEncoding or
dict with input_ids, a tensor, a numpy array, a one-row batch) as list[int], and refuses anything
else in the workflow's own call with the type and the first bad value named."""

import numpy as np
import pytest
import torch
from transformers import BatchEncoding

from mlrl.types import ModelRequest


@pytest.mark.parametrize("ids", [
    [5, 6, 7],
    (5, 6, 7),
    np.array([5, 6, 7], dtype=np.int64),
    torch.tensor([5, 6, 7]),
    torch.tensor([[5, 6, 7]]),                         # a batch of one row
    [np.int32(5), np.int64(6), 7],
    {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]},
    BatchEncoding({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}),
    BatchEncoding({"input_ids": torch.tensor([[5, 6, 7]])}),
])
def test_prompt_ids_are_normalised_to_a_list_of_ints(ids):
    req = ModelRequest(input_ids=ids)
    assert req.input_ids == [5, 6, 7] and all(type(t) is int for t in req.input_ids)


@pytest.mark.parametrize(("ids", "says"), [
    ("What is 2+2?", "got text (str 'What is 2+2?')"),
    (["What", "is"], "element 0 is str 'What'"),                  # the case that failed per episode before
    ([1, 2.5], "element 1 is float '2.5'"),
    ([1, True], "element 1 is bool 'True'"),
    ({"text": "hi"}, "without an 'input_ids' key"),
    (None, "got NoneType"),
    ([[1, 2], [3, 4]], "element 0 is list"),                      # a batch of two: not one prompt
])
def test_anything_else_is_refused_with_the_type_and_value_named(ids, says):
    with pytest.raises(TypeError, match="ModelRequest.input_ids") as e:
        ModelRequest(input_ids=ids)
    assert says in str(e.value)
