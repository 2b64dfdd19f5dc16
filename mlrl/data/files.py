"""Reading local dataset files: `.jsonl` / `.json` with the json module, `.parquet` (and folders saved
with `datasets.save_to_disk`) through Hugging Face `datasets`.

Why jsonl is not read through `datasets.load_dataset("json")`: its Arrow-based reader infers one
type per column across rows (the answer "7" becomes the integer 7, "0.50" becomes 0.5, missing
keys become None) and reports malformed input without a line number; a verifiable reward needs
the answer exactly as written, and a bad row must be named by file and line. Parquet carries its
own schema, so `datasets` reads it without guessing.

`read_rows` yields (where, row) pairs, where = "file:line" or "file:row N", and a problem on a line
either raises DatasetError or, with skip_malformed, is reported through the `skipped` list.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlrl.data.rows import DatasetError

SUFFIXES = (".jsonl", ".json", ".parquet")


def find_split_files(folder: Path, split: str) -> list[Path]:
    """`<folder>/<split>.{jsonl,json,parquet}`, or every shard of the split as the Hugging Face Hub
    lays them out: `<split>-*.parquet` in the folder or in its `data/` (read in name order, all of
    them: `train-00000-of-00003.parquet` is a third of the split)."""
    for suf in SUFFIXES:
        p = folder / f"{split}{suf}"
        if p.is_file():
            return [p]
    shards = sorted(folder.glob(f"{split}-*.parquet")) or sorted((folder / "data").glob(f"{split}-*.parquet"))
    if shards:
        return shards
    have = sorted(p.name for p in folder.iterdir() if p.suffix in SUFFIXES) if folder.is_dir() else []
    raise DatasetError(
        f"{folder}: no file for split {split!r} (looked for {split}.jsonl/.json/.parquet); found: {have}"
    )


def read_rows(path: Path | list[Path], skip_malformed: bool, skipped: list[str]) -> Iterator[tuple[str, Any]]:
    """(where, row) of a dataset file, folder, or a split's parquet shards (a list: read in order)."""
    if isinstance(path, list):
        for shard in path:
            yield from read_rows(shard, skip_malformed, skipped)
        return
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path, skip_malformed, skipped)
    elif path.suffix == ".json":
        yield from _read_json(path)
    elif path.suffix == ".parquet" or path.is_dir():
        yield from _read_hf(path)
    else:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r} (expected .jsonl, .json or .parquet)")


def _read_jsonl(path: Path, skip_malformed: bool, skipped: list[str]) -> Iterator[tuple[str, Any]]:
    try:
        f = path.open("rb")  # decoded line by line: a line that is not UTF-8 is named (and skippable)
    except OSError as e:
        raise DatasetError(f"{path}: cannot open ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                msg = (f"{where}: invalid JSON ({e.msg} at column {e.colno})" if isinstance(e, json.JSONDecodeError)
                       else f"{where}: not UTF-8 (byte {e.object[e.start:e.start + 1]!r} at column {e.start + 1})")
                if not skip_malformed:
                    raise DatasetError(msg) from None
                skipped.append(msg)
                continue
            yield where, row


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 (byte {e.object[e.start:e.start + 1]!r} at offset {e.start})") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a .json dataset must hold a list of rows, got {type(data).__name__}")
    for i, row in enumerate(data):
        yield f"{path}: row {i}", row


def _read_hf(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as e:
        raise DatasetError(f"{path}: cannot read with Hugging Face datasets: {type(e).__name__}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DatasetError(f"{path}: holds several splits ({', '.join(map(str, ds))}); point at one of them")
    for i, row in enumerate(ds):
        yield f"{path}: row {i}", row
