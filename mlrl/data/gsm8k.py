"""The `gsm8k` dataset: GSM8K train/test read from the folder beside the checkout
(`../shared/data/gsm8k/{train,test}.jsonl`, overridable with the environment variable
MLRL_GSM8K_DIR); never copied into the project.

Rows become `{"messages": [user: question + instruction], "answer": "<final number>",
"solution": "<the reference solution>"}`; score them with the `gsm8k` reward.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mlrl.data.files import read_rows
from mlrl.data.registry import register_dataset
from mlrl.data.rows import DatasetError

INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_SPLITS = {"train": "train", "test": "test", "eval": "test", "validation": "test", "valid": "test"}


def gsm8k_dir() -> Path:
    env = os.environ.get("MLRL_GSM8K_DIR")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"


@register_dataset("gsm8k")
def load_gsm8k(split: str = "train", instruction: str = INSTRUCTION) -> list[dict[str, Any]]:
    if split not in _SPLITS:
        raise DatasetError(f"gsm8k: unknown split {split!r} (train or test)")
    path = gsm8k_dir() / f"{_SPLITS[split]}.jsonl"
    if not path.is_file():
        raise DatasetError(f"gsm8k: {path} not found (GSM8K lives beside the checkout in ../shared/data/gsm8k; "
                           "set MLRL_GSM8K_DIR to its folder)")
    rows = []
    for where, row in read_rows(path, skip_malformed=False, skipped=[]):
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("question"), str)
            or "####" not in str(row.get("answer", ""))
        ):
            raise DatasetError(
                f"{where}: expected a GSM8K row with 'question' and an 'answer' ending in '#### <number>'"
            )
        final = str(row["answer"]).rsplit("####", 1)[1].strip().replace(",", "")
        rows.append({"messages": [{"role": "user", "content": row["question"] + instruction}],
                     "answer": final, "solution": row["answer"]})
    return rows


load_gsm8k.reward = "gsm8k"  # type: ignore[attr-defined]
