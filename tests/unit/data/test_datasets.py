"""get_dataset: files (jsonl / json / parquet / folders), malformed rows, registry, synthetic tasks, GSM8K, SFT."""

import json
import os
import re

import pytest

from mlrl.data import (
    DatasetError,
    RLDataset,
    SFTDataset,
    get_dataset,
    list_datasets,
    register_dataset,
    sft_example,
    tokenize_messages,
)
from mlrl.data.gsm8k import gsm8k_dir
from mlrl.data.synthetic import TASKS, generate
from mlrl.modelzoo import SPECIALS, WORDS
from mlrl.reward import extract_final_number, get_reward_fn
from mlrl.workflow import apply_chat_template, load_hf_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_hf_tokenizer("builtin:tiny-llama")


def write_jsonl(path, rows, raw_lines=()):
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


ROW = {"messages": [{"role": "user", "content": "copy 7"}], "answer": "007", "level": 3}


def test_jsonl_rows_keep_answers_and_metadata_exactly(tmp_path):
    p = write_jsonl(
        tmp_path / "d.jsonl", [ROW, {"question": "copy 2", "answer": 2}, {"prompt": "copy 3", "answer": "3"}]
    )
    ds = get_dataset(str(p))
    assert isinstance(ds, RLDataset) and len(ds) == 3
    assert ds[0] == ROW  # "007" stays a string, metadata kept
    assert (
        ds[1]["messages"] == [{"role": "user", "content": "copy 2"}]
        and ds[1]["answer"] == 2
        and ds[1]["question"] == "copy 2"
    )
    assert ds[2]["messages"][0]["content"] == "copy 3"


def test_malformed_rows_name_file_and_line_or_are_counted(tmp_path):
    p = write_jsonl(
        tmp_path / "bad.jsonl",
        [ROW],
        raw_lines=[
            "",
            '{"messages": [}',
            json.dumps({"messages": []}),
            json.dumps({"messages": [{"role": "user", "content": "x"}]}),
        ],
    )
    with pytest.raises(DatasetError, match=re.escape(f"{p}:3: invalid JSON")):
        get_dataset(str(p))
    ds = get_dataset(str(p), skip_malformed=True)
    assert len(ds) == 1 and len(ds.skipped) == 3
    assert ds.skipped[0].startswith(f"{p}:3: invalid JSON")
    assert ds.skipped[1].startswith(f"{p}:4: 'messages' must be a non-empty list")
    assert ds.skipped[2].startswith(f"{p}:5: the row has no 'answer'")
    assert len(get_dataset(str(p), skip_malformed=True, require_answer=False)) == 2


@pytest.mark.parametrize(
    "row,msg",
    [
        ({"messages": [{"role": "robot", "content": "x"}], "answer": 1}, "messages\\[0\\].role must be one of"),
        ({"messages": [{"role": "user", "content": 3}], "answer": 1}, "messages\\[0\\].content must be a string"),
        ({"text": "hi", "answer": 1}, "the row has no 'messages'"),
        ([1, 2], "a row must be a JSON object"),
    ],
)
def test_row_errors(tmp_path, row, msg):
    p = write_jsonl(tmp_path / "r.jsonl", [row])
    with pytest.raises(DatasetError, match=f"{re.escape(str(p))}:1: {msg}"):
        get_dataset(str(p))


def test_json_parquet_and_split_folders(tmp_path):
    import datasets

    (tmp_path / "train.json").write_text(json.dumps([ROW, ROW]))
    datasets.Dataset.from_list([ROW] * 3).to_parquet(str(tmp_path / "test.parquet"))
    assert len(get_dataset(str(tmp_path), split="train")) == 2
    pq = get_dataset(str(tmp_path), split="test")
    assert len(pq) == 3 and pq[0]["answer"] == "007" and pq[0]["messages"] == ROW["messages"]
    with pytest.raises(DatasetError, match="no file for split 'valid'"):
        get_dataset(str(tmp_path), split="valid")
    with pytest.raises(DatasetError, match="no such file or folder, and not a registered name"):
        get_dataset(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.json").write_text("{\n  bad")
    with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / 'x.json'}:2: invalid JSON")):
        get_dataset(str(tmp_path / "x.json"))


def test_a_file_that_is_not_utf8_names_its_line_and_can_be_skipped(tmp_path):
    """Before, UnicodeDecodeError came out as a traceback: no line named, data.skip_malformed not
    applied."""
    p = tmp_path / "d.jsonl"
    p.write_bytes(json.dumps(ROW).encode() + b"\n" + b'{"answer": "caf\xe9"}\n' + json.dumps(ROW).encode() + b"\n")
    with pytest.raises(DatasetError, match=re.escape(f"{p}:2: not UTF-8 (byte b'\\xe9' at column 16)")):
        get_dataset(str(p))
    ds = get_dataset(str(p), skip_malformed=True)
    assert len(ds) == 2 and ds.skipped == [f"{p}:2: not UTF-8 (byte b'\\xe9' at column 16)"]
    (tmp_path / "x.json").write_bytes(b'[{"a": "\xff"}]')
    with pytest.raises(DatasetError, match="x.json: not UTF-8"):
        get_dataset(str(tmp_path / "x.json"))


def test_a_saved_dataset_dict_folder_gives_the_split_asked_for(tmp_path):
    """DatasetDict.save_to_disk writes dataset_dict.json and one folder per split: it was taken for a
    folder of split files and refused ("no file for split 'train'")."""
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([ROW] * 3),
                          "test": datasets.Dataset.from_list([ROW])}).save_to_disk(str(tmp_path / "dd"))
    assert len(get_dataset(str(tmp_path / "dd"), split="train")) == 3
    assert len(get_dataset(str(tmp_path / "dd"), split="test")) == 1
    with pytest.raises(DatasetError, match="a saved DatasetDict without a 'valid' split .it has: test, train"):
        get_dataset(str(tmp_path / "dd"), split="valid")


def test_a_split_in_parquet_shards_is_read_whole(tmp_path):
    """The Hub's layout: data/train-0000k-of-0000n.parquet; every shard's rows, in shard order."""
    import datasets

    (tmp_path / "data").mkdir()
    for k in range(3):
        rows = [dict(ROW, answer=str(10 * k + i)) for i in range(k + 2)]
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "data" / f"train-0000{k}-of-00003.parquet"))
    ds = get_dataset(str(tmp_path), split="train")
    assert [r["answer"] for r in ds] == ["0", "1", "10", "11", "12", "20", "21", "22", "23"]


def test_max_length_drops_long_prompts(tmp_path, tok):
    long = {"messages": [{"role": "user", "content": " ".join(["copy"] * 40)}], "answer": "1"}
    p = write_jsonl(tmp_path / "d.jsonl", [ROW, long])
    ds = get_dataset(str(p), tokenizer=tok, max_length=16)
    assert len(ds) == 1 and ds.too_long == 1


def test_max_length_measures_prompts_as_the_workflow_renders_them(tmp_path, tok):
    """rlvr's enable_thinking: false adds Qwen3's empty think block to every prompt: the filter must
    count it, not the plain template's rendering."""
    from mlrl.workflow import apply_chat_template

    rows = [ROW, dict(ROW, messages=[{"role": "user", "content": "copy 7 " * 3}])]
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    n = len(apply_chat_template(tok, rows[1]["messages"], add_generation_prompt=True))
    plain = get_dataset(str(p), tokenizer=tok, max_length=n)
    assert len(plain) == 2 and plain.too_long == 0 and plain.longest_prompt == n

    def think_block(row):  # what the workflow sends: the template's rendering and 3 tokens more
        return apply_chat_template(tok, row["messages"], add_generation_prompt=True) + [0, 0, 0]

    rendered = get_dataset(str(p), tokenizer=tok, max_length=n, prompt_ids=think_block)
    assert len(rendered) == 1 and rendered.too_long == 1 and rendered.longest_prompt == len(think_block(ROW))


def test_registry_and_batches():
    @register_dataset("unit_tiny")
    def load(split, k=2):
        return [{"messages": [{"role": "user", "content": f"copy {i}"}], "answer": str(i)} for i in range(k)]

    ds = get_dataset("unit_tiny", k=5)
    assert len(ds) == 5 and "unit_tiny" in list_datasets() and "synthetic:copy_digit" in list_datasets()
    with pytest.raises(ValueError, match="already registered"):
        register_dataset("unit_tiny")(lambda split: [])
    b1 = [r["answer"] for b in ds.batches(2, epoch=0, seed=3) for r in b]
    b2 = [r["answer"] for b in ds.batches(2, epoch=0, seed=3) for r in b]
    b3 = [r["answer"] for b in ds.batches(2, epoch=1, seed=3) for r in b]
    assert b1 == b2 and len(b1) == 4 and b1 != b3  # same (seed, epoch) -> same order; next epoch reshuffles


@pytest.mark.parametrize("task", sorted(TASKS))
def test_synthetic_tasks_are_deterministic_and_split(task):
    a, b = generate(task, "train", seed=1, num_rows=200), generate(task, "train", seed=1, num_rows=200)
    assert a == b and generate(task, "train", seed=2, num_rows=200) != a
    test = generate(task, "test", seed=1, num_rows=100)
    assert test != a[:100]
    if TASKS[task].heldout is not None:
        train_prompts = {r["messages"][0]["content"] for r in generate(task, "train", seed=0, num_rows=2000)}
        test_prompts = {r["messages"][0]["content"] for r in generate(task, "test", seed=0, num_rows=500)}
        assert not train_prompts & test_prompts
    ds = get_dataset(f"synthetic:{task}", num_rows=7)
    assert len(ds) == 7 and ds.reward == TASKS[task].reward


TINY_TASKS = ["copy_digit", "add_digits", "copy_pair", "sum_digits", "reverse_digits", "reverse_var", "repeat_digit"]
ANSWER_WORDS = {"copy_digit": {1}, "add_digits": {1}, "copy_pair": {2}, "sum_digits": {2}, "reverse_digits": {4},
                "reverse_var": {2, 3, 4, 5}, "repeat_digit": {16}}


@pytest.mark.parametrize("task", TINY_TASKS)
def test_tiny_tasks_fit_the_tiny_vocabulary(task, tok):
    vocab = set(SPECIALS + WORDS)
    lengths = set()
    for r in generate(task, "train", num_rows=300):
        assert all(w in vocab for w in r["messages"][0]["content"].split())
        ids = apply_chat_template(tok, r["messages"], add_generation_prompt=True)
        assert tok.unk_token_id not in ids
        ans = tok(r["answer"], add_special_tokens=False)["input_ids"]
        lengths.add(len(ans))
        assert tok.decode(ans) == r["answer"] and tok.unk_token_id not in ans  # one token per answer word
        reward = get_reward_fn(TASKS[task].reward)
        assert reward("", r["answer"], [], [], **r) == 1.0
    assert lengths == ANSWER_WORDS[task]
    if task == "add_digits":
        for r in generate(task, "test", num_rows=50):
            _, a, b = r["messages"][0]["content"].split()
            assert int(a) + int(b) == int(r["answer"]) < 10


def test_tiny_task_answers_are_right():
    for r in generate("sum_digits", "train", num_rows=100):
        _, a, b = r["messages"][0]["content"].split()
        assert int(r["answer"].replace(" ", "")) == int(a) + int(b)
    for task in ("reverse_digits", "reverse_var"):
        for r in generate(task, "train", num_rows=100):
            assert r["answer"].split() == r["messages"][0]["content"].split()[1:][::-1]
    for r in generate("copy_pair", "train", num_rows=50):
        assert r["answer"].split() == r["messages"][0]["content"].split()[1:]
    for r in generate("repeat_digit", "train", num_rows=20):
        assert r["answer"].split() == [r["messages"][0]["content"].split()[1]] * 16


def test_arith_word_answers_are_right():
    for r in generate("arith_word", "train", num_rows=300):
        q = r["messages"][0]["content"]
        a, b = map(int, re.findall(r"\d+", q)[:2])
        expected = a * b if "in each bag" in q else (a - b if ("gives" in q or "lost" in q) else a + b)
        assert int(r["answer"]) == expected >= 0
        assert get_reward_fn("gsm8k")("", f"So the answer is \\boxed{{{expected}}}.", [], [], **r) == 1.0
        assert extract_final_number(f"{a} and {b} give {expected}") == expected


@pytest.mark.skipif(not gsm8k_dir().is_dir(), reason=f"GSM8K folder {gsm8k_dir()} is absent")
def test_gsm8k_from_the_shared_folder():
    ds = get_dataset("gsm8k", split="test")
    assert len(ds) == 1319 and ds.reward == "gsm8k"
    row = ds[0]
    assert re.fullmatch(r"-?\d+(\.\d+)?", row["answer"]) and "####" in row["solution"]
    assert row["messages"][0]["role"] == "user" and "\\boxed{}" in row["messages"][0]["content"]
    assert get_reward_fn("gsm8k")("", row["solution"], [], [], **row) == 1.0


def test_gsm8k_dir_override_and_missing_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MLRL_GSM8K_DIR", str(tmp_path))
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    ds = get_dataset("gsm8k")
    assert ds[0]["answer"] == "2" and len(ds) == 1
    monkeypatch.setenv("MLRL_GSM8K_DIR", str(tmp_path / "absent"))
    with pytest.raises(DatasetError, match="MLRL_GSM8K_DIR"):
        get_dataset("gsm8k")
    assert os.environ["MLRL_GSM8K_DIR"].endswith("absent")


def test_sft_masks_cover_assistant_content_only(tok, tmp_path):
    msgs = [{"role": "user", "content": "copy 7"}, {"role": "assistant", "content": "7"},
            {"role": "user", "content": "copy 3"}, {"role": "assistant", "content": "3"}]
    ids, mask = tokenize_messages(tok, msgs)
    assert ids == apply_chat_template(tok, msgs)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "7 . 3 ."
    p = write_jsonl(
        tmp_path / "sft.jsonl", [{"messages": msgs}, dict(ROW, answer="9"), {"prompt": "copy 4", "completion": "4"}]
    )
    ds = get_dataset(str(p), kind="sft", tokenizer=tok)
    assert isinstance(ds, SFTDataset) and len(ds) == 3
    rl_as_sft = ds[1]
    assert tok.decode([t for t, m in zip(rl_as_sft["input_ids"], rl_as_sft["loss_mask"]) if m]) == "9 ."
    plain = ds[2]
    assert plain["input_ids"][-1] == tok.eos_token_id and plain["loss_mask"] == [0, 0, 1, 1]
    cut = get_dataset(str(p), kind="sft", tokenizer=tok, max_length=6, skip_malformed=True)
    assert cut.truncated >= 1 and all(len(e["input_ids"]) <= 6 for e in cut)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        get_dataset(str(p), kind="sft")


def test_a_conversation_opened_by_the_assistant_trains_its_content_not_the_templates_opening():
    """SmolLM2's template puts BOS-less default system prompt + "<|im_start|>assistant\\n" before a
    first assistant turn: none of it is the assistant's (it was all trained, the first token too)."""
    smol = load_hf_tokenizer("builtin:smollm2-135m-instruct")
    msgs = [{"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Yo"}]
    ids, mask = tokenize_messages(smol, msgs)
    assert ids == apply_chat_template(smol, msgs) and mask[0] == 0
    assert smol.decode([t for t, m in zip(ids, mask) if m]) == "Hello there<|im_end|>\nYo<|im_end|>\n"
    # a DPO pair with no prompt masks the same way on both sides
    from mlrl.data.preference import preference_example

    chosen, rejected = preference_example(smol, {"chosen": [msgs[0]], "rejected": [dict(msgs[0], content="Bye")]},
                                          "row 1")
    assert smol.decode([t for t, m in zip(*chosen) if m]) == "Hello there<|im_end|>\n"
    assert smol.decode([t for t, m in zip(*rejected) if m]) == "Bye<|im_end|>\n"


def test_a_rows_tools_reach_the_template_in_sft_and_dpo():
    """TRL's tool-calling datasets carry `tools` beside `messages`: the model must learn its calls
    with the schemas in the prompt, as the agent proxy renders them at rollout time."""
    import json

    from mlrl.data.preference import preference_example

    tools_tok = load_hf_tokenizer("builtin:tiny-llama-tools")
    tool = {"type": "function", "function": {"name": "multiply", "parameters": {"type": "object"}}}
    msgs = [{"role": "user", "content": "multiply 7 6"}, {"role": "assistant", "content": "42"}]
    ids, mask = sft_example(tools_tok, {"messages": msgs, "tools": [tool]}, "row 1")
    assert ids == apply_chat_template(tools_tok, msgs, tools=[tool])
    assert tools_tok.decode(ids).startswith("system : tools multiply")
    assert tools_tok.decode([t for t, m in zip(ids, mask) if m]).startswith("42")
    assert sft_example(tools_tok, {"messages": msgs, "tools": json.dumps([tool])}, "row 1") == (ids, mask)
    chosen, _ = preference_example(tools_tok, {"prompt": msgs[:1], "chosen": msgs[1:], "tools": [tool],
                                               "rejected": [{"role": "assistant", "content": "41"}]}, "row 2")
    assert chosen[0] == ids
    with pytest.raises(DatasetError, match="row 3: 'tools' must be a list of tool schemas"):
        sft_example(tools_tok, {"messages": msgs, "tools": {"name": "multiply"}}, "row 3")


def test_a_row_whose_mask_cannot_be_built_is_named():
    smol = load_hf_tokenizer("builtin:smollm2-135m-instruct")
    row = {"messages": [{"role": "user", "content": "list"}, {"role": "assistant", "content": "\n\n1. a"}]}
    with pytest.raises(DatasetError, match=r"^data.jsonl:3: the chat template is not prefix-stable"):
        sft_example(smol, row, "data.jsonl:3")


def test_dataset_from_config(tok, tmp_path):
    from mlrl.config.schema import DataConfig
    from mlrl.data import dataset_from_config

    cfg = DataConfig(train="synthetic:add_digits", eval="synthetic:add_digits", num_synthetic=40, max_prompt_tokens=32)
    train, ev = dataset_from_config(cfg, tokenizer=tok, seed=1), dataset_from_config(cfg, "eval", tokenizer=tok, seed=1)
    assert len(train) == 40 and len(ev) == 40 and ev.split == "test"
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in ev}
    p = write_jsonl(tmp_path / "d.jsonl", [ROW] * 600, raw_lines=["{oops"])
    big = dataset_from_config(DataConfig(train=str(p), skip_malformed=True, num_synthetic=8), tokenizer=tok)
    assert len(big) == 600 and len(big.skipped) == 1   # num_synthetic does not cap files
    with pytest.raises(ValueError, match="data.eval is not set"):
        dataset_from_config(DataConfig(), "eval")
    # a bad file is reported with the setting that named it
    with pytest.raises(DatasetError, match=r"^data\.eval: dataset '/nope.jsonl'"):
        dataset_from_config(DataConfig(eval="/nope.jsonl"), "eval", tokenizer=tok)


def unregistered_loader(split, n=3):
    return [{"messages": [{"role": "user", "content": f"{split} {i}"}], "answer": str(i)} for i in range(n)]


def test_loader_by_module_path():
    ds = get_dataset(f"{__name__}:unregistered_loader", split="test", n=2)
    assert [r["messages"][0]["content"] for r in ds] == ["test 0", "test 1"]
    with pytest.raises(DatasetError, match="has no attribute"):
        get_dataset(f"{__name__}:nope")
