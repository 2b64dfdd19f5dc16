"""Datasets: `get_dataset(name_or_path, split, kind="rl"|"sft", tokenizer, max_length)` over local
jsonl / json / parquet files, registered datasets (`@register_dataset`, e.g. `gsm8k`) and synthetic
verifiable tasks (`synthetic:copy_digit`, `synthetic:add_digits`, `synthetic:arith_word`).

`mlrl.data.tokenizer` holds the tokenizer helpers datasets share with workflows
(`apply_chat_template`, `load_hf_tokenizer`). `mlrl.data` is the lower layer: `mlrl.workflow` may
import it, nothing here imports `mlrl.workflow`."""

from mlrl.data.chat_tokens import sft_example, tokenize_messages
from mlrl.data.registry import SFTDataset, dataset_from_config, get_dataset, list_datasets, register_dataset
from mlrl.data.rows import DatasetError, RLDataset, normalise_rl_row
from mlrl.data.synthetic import TASKS as SYNTHETIC_TASKS

__all__ = [
    "DatasetError",
    "RLDataset",
    "SFTDataset",
    "SYNTHETIC_TASKS",
    "dataset_from_config",
    "get_dataset",
    "list_datasets",
    "normalise_rl_row",
    "register_dataset",
    "sft_example",
    "tokenize_messages",
]
