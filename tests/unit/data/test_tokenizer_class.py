"""load_hf_tokenizer records the class AutoTokenizer chose for a folder and loads through it next
time (without AutoTokenizer's module, which imports transformers' model registry): the tokenizer is
the same as AutoTokenizer's, the record follows what the choice reads, and a bad record only costs
the AutoTokenizer call it was saving."""

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mlrl.data import tokenizer as tk
from mlrl.modelzoo import resolve_model_dir

TEXT = "The answer is 7 + 12 = 19, isn't it?"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5"}]


@pytest.fixture(scope="module")
def folders() -> dict[str, Path]:
    """The builtin folders, resolved in the real cache before `records` points MLRL_CACHE elsewhere."""
    return {n: resolve_model_dir(f"builtin:{n}") for n in ["tiny-llama", "tiny-qwen2", "smollm2-135m-instruct",
                                                           "tiny-llama-tools"]}


@pytest.fixture
def records(folders, tmp_path, monkeypatch):
    """A fresh record directory (MLRL_CACHE) and no per-process cache; AutoTokenizer calls counted."""
    monkeypatch.setenv("MLRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tk, "_TOKENIZERS", {})
    calls = []
    real = AutoTokenizer.from_pretrained

    def counted(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counted)
    return calls


def _load(folder: Path):
    tk._TOKENIZERS.clear()  # a new process: only the record is left
    return tk.load_hf_tokenizer(str(folder))


# three classes AutoTokenizer picks: TokenizersBackend (llama), Qwen2Tokenizer (qwen2, whose
# tokenizer_config.json names TokenizersBackend: transformers overrides it), and smollm2's
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "smollm2-135m-instruct", "tiny-llama-tools"])
def test_the_recorded_class_gives_autotokenizers_tokenizer(folders, records, name):
    folder = folders[name]
    first = _load(folder)
    assert records == [str(folder)]
    again = _load(folder)
    assert records == [str(folder)]  # the second load did not call AutoTokenizer
    auto = AutoTokenizer.from_pretrained(str(folder))
    assert type(again) is type(first) is type(auto)
    assert again.get_vocab() == auto.get_vocab()
    assert again(TEXT)["input_ids"] == auto(TEXT)["input_ids"]
    assert again.all_special_tokens == auto.all_special_tokens
    assert again.pad_token_id == first.pad_token_id
    if auto.chat_template:
        assert tk.apply_chat_template(again, MESSAGES) == tk.apply_chat_template(auto, MESSAGES)


def test_a_changed_config_or_folder_asks_autotokenizer_again(folders, records, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(folders["tiny-llama"], folder)
    _load(folder)
    _load(folder)
    assert len(records) == 1
    cfg = folder / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_max_length": 77}))
    assert _load(folder).model_max_length == 77
    assert len(records) == 2  # tokenizer_config.json is part of the key
    (folder / "tekken.json").write_text("{}")  # a file AutoTokenizer looks for by name
    _load(folder)
    assert len(records) == 3


BAD_RECORDS = ["{not json", '{"module": "transformers", "qualname": "NoSuchTokenizer"}',
               '{"module": "no_such_module", "qualname": "X"}', '{"module": "os", "qualname": "sep"}']


@pytest.mark.parametrize("record", BAD_RECORDS)
def test_a_bad_record_falls_back_to_autotokenizer_and_is_rewritten(folders, records, record):
    folder = folders["tiny-llama"]
    path = tk._class_record(folder)
    path.parent.mkdir(parents=True)
    path.write_text(record)
    tok = _load(folder)
    assert records == [str(folder)] and type(tok).__name__ == "TokenizersBackend"
    _load(folder)
    assert records == [str(folder)]  # rewritten with the class AutoTokenizer chose
    assert not [p for p in path.parent.iterdir() if p != path]  # no temporary file left beside it


def test_an_unwritable_cache_still_loads(folders, records, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MLRL_CACHE", str(tmp_path / "file"))  # a file where the cache folder would be
    folder = folders["tiny-llama"]
    assert _load(folder)(TEXT)["input_ids"] and _load(folder)(TEXT)["input_ids"]
    assert len(records) == 2
