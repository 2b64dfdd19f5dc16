"""Preference rows -> (chosen, rejected) token sequences with completion masks: TRL's three formats,
jsonl and parquet files, synthetic pairs, and what malformed rows get."""

import json

import pytest

from mlrl.data import DatasetError, get_dataset
from mlrl.data.preference import preference_example
from mlrl.workflow import load_hf_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_hf_tokenizer("builtin:tiny-llama")


def _masked(tok, side) -> str:
    ids, mask = side
    return tok.decode([t for t, m in zip(ids, mask) if m])


def _prompt(tok, side) -> list[int]:
    ids, mask = side
    return ids[: mask.index(1)]


CONVERSATIONAL = {"prompt": [{"role": "user", "content": "copy 3"}],
                  "chosen": [{"role": "assistant", "content": "3"}],
                  "rejected": [{"role": "assistant", "content": "4 5"}]}
IMPLICIT = {"chosen": [{"role": "user", "content": "copy 3"}, {"role": "assistant", "content": "3"}],
            "rejected": [{"role": "user", "content": "copy 3"}, {"role": "assistant", "content": "4 5"}]}


@pytest.mark.parametrize("row", [CONVERSATIONAL, IMPLICIT, {**CONVERSATIONAL, "prompt": "copy 3"}],
                         ids=["conversational", "implicit-prompt", "string-prompt"])
def test_conversational_rows_mask_exactly_the_completion(tok, row):
    chosen, rejected = preference_example(tok, row, "r")
    # the template renders "{role} : {content} . "; the completion is the assistant content and " ."
    assert _masked(tok, chosen) == "3 ." and _masked(tok, rejected) == "4 5 ."
    assert _prompt(tok, chosen) == _prompt(tok, rejected)  # both sides continue the same prompt tokens
    assert tok.decode(_prompt(tok, chosen)) == "user : copy 3 . assistant :"


def test_standard_string_rows_append_eos(tok):
    chosen, rejected = preference_example(tok, {"prompt": "copy 3", "chosen": "3", "rejected": "4 5"}, "r")
    assert chosen[0][-1] == rejected[0][-1] == tok.eos_token_id
    assert chosen[1] == [0, 0, 1, 1] and rejected[1] == [0, 0, 1, 1, 1]


def test_multi_turn_prompt_assistant_turns_are_not_trained(tok):
    row = {"prompt": [{"role": "user", "content": "copy 3"}, {"role": "assistant", "content": "3"},
                      {"role": "user", "content": "copy 5"}],
           "chosen": [{"role": "assistant", "content": "5"}], "rejected": [{"role": "assistant", "content": "6"}]}
    chosen, rejected = preference_example(tok, row, "r")
    assert _masked(tok, chosen) == "5 ." and _masked(tok, rejected) == "6 ."


@pytest.mark.parametrize("row, message", [
    ({"prompt": "copy 3", "chosen": "3"}, r"r7: a preference row needs 'rejected'"),
    ({"chosen": "3", "rejected": "4"}, r"r7: string 'chosen' / 'rejected' need a string 'prompt'"),
    ({"prompt": "copy 3", "chosen": "3", "rejected": "3"}, "r7: 'chosen' and 'rejected' are the same text"),
    ({"prompt": "copy 3", "chosen": "3", "rejected": " "}, "must be non-empty"),
    ({**CONVERSATIONAL, "rejected": [{"role": "user", "content": "4"}]}, "'rejected' has no assistant turn"),
    ({**CONVERSATIONAL, "chosen": [{"role": "bot", "content": "4"}]}, r"r7: 'chosen': messages\[0\].role"),
    (["copy", "3"], "r7: a preference row must be a JSON object"),
])
def test_malformed_rows_name_the_row(tok, row, message):
    with pytest.raises(DatasetError, match=message):
        preference_example(tok, row, "r7")


def test_files_in_jsonl_and_parquet_and_skip_malformed(tok, tmp_path):
    rows = [CONVERSATIONAL, IMPLICIT, {"prompt": "copy 3", "chosen": "3", "rejected": "3"},
            {"prompt": "copy 9", "chosen": "9", "rejected": "1"}]
    jsonl = tmp_path / "prefs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=r"prefs.jsonl:3.*same text"):
        get_dataset(str(jsonl), "train", "dpo", tok)
    ds = get_dataset(str(jsonl), "train", "dpo", tok, skip_malformed=True)
    assert len(ds) == 3 and len(ds.skipped) == 1 and "prefs.jsonl:3" in ds.skipped[0]

    import pandas as pd

    parquet = tmp_path / "prefs.parquet"
    pd.DataFrame([{"prompt": "copy 3", "chosen": "3", "rejected": "4"},
                  {"prompt": "copy 8", "chosen": "8", "rejected": "2 2"}]).to_parquet(parquet)
    pq = get_dataset(str(parquet), "train", "dpo", tok)
    assert [(sum(p["chosen"][1]), sum(p["rejected"][1])) for p in pq] == [(2, 2), (2, 3)]  # answer words + EOS


def test_truncation_is_counted_and_a_side_cut_to_nothing_is_skipped(tok, tmp_path):
    rows = [{"prompt": "copy 3 3 3 3", "chosen": "3", "rejected": "4 4 4 4 4 4"},  # 5 + 2 and 5 + 7 tokens
            {"prompt": "copy 3 3 3 3 3 3 3", "chosen": "3", "rejected": "4"}]      # the prompt alone is 8
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = get_dataset(str(data), "train", "dpo", tok, max_length=7)
    assert len(ds) == 1 and ds.truncated == 2 and "p.jsonl:2: a side has no completion token left" in ds.skipped[0]
    chosen, rejected = ds[0]["chosen"], ds[0]["rejected"]
    assert len(chosen[0]) == 7 and rejected[1] == [0] * 5 + [1, 1]
    # sides that differ only past the cut are the same pair of tokens: no gradient (loss log 2), skipped
    same = {"prompt": "copy 3", "chosen": "3 3 3 3 3 5", "rejected": "3 3 3 3 3 7"}
    data.write_text("".join(json.dumps(r) + "\n" for r in [rows[0], same]))
    ds = get_dataset(str(data), "train", "dpo", tok, max_length=7, skip_malformed=True)
    assert len(ds) == 1
    assert ds.skipped[0].endswith("p.jsonl:2: 'chosen' and 'rejected' are the same tokens after truncation to 7")


def test_synthetic_pairs_reject_a_wrong_answer(tok):
    ds = get_dataset("synthetic:add_digits", "train", "dpo", tok, num_rows=32)
    assert len(ds) == 32
    for p in ds:
        assert _masked(tok, p["chosen"]) != _masked(tok, p["rejected"])
        assert _prompt(tok, p["chosen"]) == _prompt(tok, p["rejected"])


def test_dpo_needs_a_tokenizer():
    with pytest.raises(ValueError, match="kind='dpo' needs the model's tokenizer"):
        get_dataset("synthetic:add_digits", "train", "dpo")


def test_an_empty_prompt_leaves_the_first_token_untrained(tok):
    """With nothing before it (an empty prompt, a tokenizer adding no BOS), the first completion token
    has no logprob: its loss-mask 1 diluted the SFT token mean and IPO's per-token mean."""
    from mlrl.data.chat_tokens import sft_example
    from mlrl.data.preference import preference_example

    ids, mask = sft_example(tok, {"prompt": "", "completion": "4 5"}, "row 1")
    assert len(ids) == len(mask) and mask[0] == 0 and sum(mask) == len(ids) - 1 - (ids[0] == tok.bos_token_id)
    chosen, rejected = preference_example(tok, {"prompt": "", "chosen": "4", "rejected": "5"}, "row 1")
    for side_ids, side_mask in (chosen, rejected):
        assert len(side_ids) == len(side_mask) and side_mask[0] == 0 and sum(side_mask) >= 1
