"""`get_dataset`: one entry point for every dataset a config can name, and the registry behind it.

`name_or_path` may be:
- `synthetic:<task>` — a generated verifiable task (`mlrl.data.synthetic`);
- a registered name (`@register_dataset("name")` on a loader `fn(split, **kwargs) -> list[dict]`),
  e.g. `gsm8k`, or `pkg.module:loader` for a loader in a module nobody imported yet;
- a file (`.jsonl`, `.json`, `.parquet`), or a folder holding `<split>.jsonl|.json|.parquet` (or a
  folder written by `datasets.save_to_disk`).

`kind="rl"` returns an `RLDataset` of prompt rows; with a tokenizer and `max_length`, prompts whose
chat-templated length exceeds it are dropped and counted. `kind="sft"` returns an `SFTDataset` of
`{"input_ids", "loss_mask"}` (a tokenizer is required; sequences longer than `max_length` are cut
and counted). `kind="dpo"` returns a `PreferenceDataset` of `{"chosen": (input_ids, loss_mask),
"rejected": (...)}` pairs (`mlrl.data.preference`: TRL's preference formats; a synthetic task gives
pairs whose rejected side is a wrong answer); sides longer than `max_length` are cut and counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

from mlrl.data import synthetic
from mlrl.data.chat_tokens import NoAssistantTurn, sft_example
from mlrl.data.files import find_split_files, read_rows
from mlrl.data.preference import Side, preference_example, synthetic_pairs
from mlrl.data.rows import SOURCE_KEY, DatasetError, RLDataset, SourceSpan, normalise_rl_row
from mlrl.data.tokenizer import apply_chat_template
from mlrl.registry import Registry

Loader = Callable[..., list[dict[str, Any]]]
_DATASETS: Registry[Loader] = Registry("dataset")


def register_dataset(name: str) -> Callable[[Loader], Loader]:
    """Decorator: `@register_dataset("my_data")` on `fn(split: str, **kwargs) -> list[dict]` (RL rows)."""
    return _DATASETS.register(name, check_name=lambda n: not n.startswith("synthetic:"))


def list_datasets() -> list[str]:
    from mlrl.data import gsm8k  # noqa: F401  (registers itself)

    return _DATASETS.names() + [f"synthetic:{t}" for t in sorted(synthetic.TASKS)]


@dataclass
class SFTDataset(Sequence):
    """Tokenised SFT examples: each `{"input_ids": [T], "loss_mask": [T]}`."""

    examples: list[dict[str, list[int]]]
    name: str = ""
    split: str = "train"
    skipped: list[str] = field(default_factory=list)
    truncated: int = 0
    no_assistant: list[str] = field(default_factory=list)  # rows without an assistant turn: always skipped

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: Any) -> Any:
        return self.examples[i]


@dataclass
class PreferenceDataset(Sequence):
    """Tokenised preference pairs: each `{"chosen": (input_ids, loss_mask), "rejected": (...)}`."""

    examples: list[dict[str, Side]]
    name: str = ""
    split: str = "train"
    skipped: list[str] = field(default_factory=list)
    truncated: int = 0  # pairs with a side cut at max_length

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: Any) -> Any:
        return self.examples[i]


def _find_loader(name_or_path: str) -> Loader | None:
    """A registered loader, or `pkg.module:loader` for one not registered by name (raises
    LookupFailed, a ValueError, when it cannot be imported); None for a file or folder."""
    from mlrl.data import gsm8k  # noqa: F401  (registers itself)

    loader = _DATASETS.get(name_or_path)
    if loader is None and ":" in name_or_path and not Path(name_or_path).exists():
        from mlrl.reward import import_from_string

        loader = import_from_string(name_or_path)
    return loader


def _raw_rows(name_or_path: str, split: str, skip_malformed: bool, skipped: list[str], seed: int,
              num_rows: int | None, kwargs: dict[str, Any]) -> tuple[list[tuple[str, Any]], str | None]:
    if name_or_path.startswith("synthetic:"):
        task = name_or_path.split(":", 1)[1]
        rows = synthetic.generate(task, split, seed=seed, num_rows=num_rows or 512, **kwargs)
        return [(f"{name_or_path}[{i}]", r) for i, r in enumerate(rows)], synthetic.TASKS[task].reward
    try:
        loader = _find_loader(name_or_path)
    except ValueError as e:
        raise DatasetError(f"dataset {name_or_path!r}: {e}") from None
    if loader is not None:
        rows = loader(split, **kwargs)
        if not isinstance(rows, (list, tuple)):
            raise DatasetError(
                f"dataset loader {name_or_path!r} returned {type(rows).__name__}, expected a list of rows"
            )
        return [(f"{name_or_path}/{split}[{i}]", r) for i, r in enumerate(rows)], getattr(loader, "reward", None)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise DatasetError(f"dataset {name_or_path!r}: no such file or folder, and not a registered name "
                           f"(registered: {', '.join(list_datasets())})")
    if path.is_dir() and (path / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: one folder per split
        if not (path / split / "state.json").is_file():
            raise DatasetError(f"dataset {name_or_path!r}: a saved DatasetDict without a {split!r} split (it has: "
                               f"{', '.join(sorted(p.name for p in path.iterdir() if (p / 'state.json').is_file()))})")
        return list(read_rows(path / split, skip_malformed, skipped)), None
    if path.is_dir() and not (path / "dataset_info.json").exists() and not (path / "state.json").exists():
        return list(read_rows(find_split_files(path, split), skip_malformed, skipped)), None
    return list(read_rows(path, skip_malformed, skipped)), None


@overload
def get_dataset(name_or_path: str, split: str = ..., kind: Literal["rl"] = ..., tokenizer: Any = ...,
                max_length: int | None = ..., *, skip_malformed: bool = ..., require_answer: bool = ...,
                seed: int = ..., num_rows: int | None = ...,
                prompt_ids: Callable[[dict[str, Any]], list[int]] | None = ..., **kwargs: Any) -> RLDataset: ...
@overload
def get_dataset(name_or_path: str, split: str, kind: Literal["sft"], tokenizer: Any = ...,
                max_length: int | None = ..., *, skip_malformed: bool = ..., require_answer: bool = ...,
                seed: int = ..., num_rows: int | None = ..., **kwargs: Any) -> SFTDataset: ...
@overload
def get_dataset(name_or_path: str, split: str, kind: Literal["dpo"], tokenizer: Any = ...,
                max_length: int | None = ..., *, skip_malformed: bool = ..., require_answer: bool = ...,
                seed: int = ..., num_rows: int | None = ..., **kwargs: Any) -> PreferenceDataset: ...
@overload
def get_dataset(name_or_path: str, split: str = ..., kind: str = ..., tokenizer: Any = ...,
                max_length: int | None = ..., *, skip_malformed: bool = ..., require_answer: bool = ...,
                seed: int = ..., num_rows: int | None = ...,
                prompt_ids: Callable[[dict[str, Any]], list[int]] | None = ...,
                **kwargs: Any) -> RLDataset | SFTDataset | PreferenceDataset: ...
def get_dataset(
    name_or_path: str,
    split: str = "train",
    kind: str = "rl",
    tokenizer: Any = None,
    max_length: int | None = None,
    *,
    skip_malformed: bool = False,
    require_answer: bool = True,
    seed: int = 0,
    num_rows: int | None = None,
    prompt_ids: Callable[[dict[str, Any]], list[int]] | None = None,
    **kwargs: Any,
) -> RLDataset | SFTDataset | PreferenceDataset:
    """Load a dataset for RL prompts (`kind="rl"`), supervised fine-tuning (`kind="sft"`) or
    preference optimisation (`kind="dpo"`).

    `seed` / `num_rows` apply to synthetic tasks (num_rows also caps other sources); `prompt_ids`
    (RL): how the workflow renders a row's prompt (e.g. rlvr's `enable_thinking`), measured against
    `max_length` instead of the plain chat template; extra kwargs go to the registered loader or the
    synthetic generator."""
    if kind not in ("rl", "sft", "dpo"):
        raise ValueError(f"get_dataset: kind must be 'rl', 'sft' or 'dpo', got {kind!r}")
    if kind in ("sft", "dpo") and tokenizer is None:
        raise ValueError(f"get_dataset: kind={kind!r} needs the model's tokenizer")
    skipped: list[str] = []
    raw, reward = _raw_rows(str(name_or_path), split, skip_malformed, skipped, seed, num_rows, kwargs)
    if num_rows is not None and not str(name_or_path).startswith("synthetic:"):
        raw = raw[:num_rows]
    if kind == "rl":
        return _build_rl(raw, str(name_or_path), split, skipped, skip_malformed, require_answer, tokenizer,
                         max_length, reward, prompt_ids)
    if kind == "dpo":
        if str(name_or_path).startswith("synthetic:"):
            raw = list(zip([w for w, _ in raw], synthetic_pairs([r for _, r in raw], str(name_or_path)[10:])))
        return _build_dpo(raw, str(name_or_path), split, skipped, skip_malformed, tokenizer, max_length)
    return _build_sft(raw, str(name_or_path), split, skipped, skip_malformed, tokenizer, max_length)


def _build_rl(raw, name, split, skipped, skip_malformed, require_answer, tokenizer, max_length, reward,
              prompt_ids=None) -> RLDataset:
    rows, too_long, longest = [], 0, 0
    for where, row in raw:
        try:
            r = normalise_rl_row(row, where, require_answer)
        except DatasetError as e:
            if not skip_malformed:
                raise
            skipped.append(str(e))
            continue
        if max_length is not None and (prompt_ids is not None or tokenizer is not None):
            n = len(prompt_ids(r) if prompt_ids is not None
                    else apply_chat_template(tokenizer, r["messages"], add_generation_prompt=True))
            if n > max_length:
                too_long += 1
                continue
            longest = max(longest, n)
        rows.append(r)
    if not rows:
        raise DatasetError(f"dataset {name!r} split {split!r}: no usable rows "
                           f"({len(skipped)} malformed, {too_long} longer than {max_length} tokens)")
    return RLDataset(rows, name=name, split=split, skipped=skipped, too_long=too_long, reward=reward,
                     longest_prompt=longest)


def _build_sft(raw, name, split, skipped, skip_malformed, tokenizer, max_length) -> SFTDataset:
    examples, truncated, no_assistant = [], 0, []
    for where, row in raw:
        try:
            ids, mask = sft_example(tokenizer, row, where)
        except NoAssistantTurn as e:  # nothing to learn from: skipped whatever skip_malformed says
            no_assistant.append(str(e))
            continue
        except DatasetError as e:
            if not skip_malformed:
                raise
            skipped.append(str(e))
            continue
        if max_length is not None and len(ids) > max_length:
            ids, mask = ids[:max_length], mask[:max_length]
            truncated += 1
        if not any(mask):
            skipped.append(f"{where}: no trainable token left (after truncation to {max_length})")
            continue
        examples.append({"input_ids": ids, "loss_mask": mask})
    if not examples:
        raise DatasetError(f"dataset {name!r} split {split!r}: no usable SFT examples ({len(skipped)} skipped, "
                           f"{len(no_assistant)} without an assistant turn)")
    return SFTDataset(examples, name=name, split=split, skipped=skipped, truncated=truncated,
                      no_assistant=no_assistant)


def _build_dpo(raw, name, split, skipped, skip_malformed, tokenizer, max_length) -> PreferenceDataset:
    examples, truncated = [], 0
    for where, row in raw:
        try:
            sides = preference_example(tokenizer, row, where)
        except DatasetError as e:
            if not skip_malformed:
                raise
            skipped.append(str(e))
            continue
        if max_length is not None and any(len(ids) > max_length for ids, _ in sides):
            sides = tuple((ids[:max_length], mask[:max_length]) for ids, mask in sides)
            truncated += 1
        if not all(any(mask) for _, mask in sides):
            skipped.append(f"{where}: a side has no completion token left (after truncation to {max_length})")
            continue
        if sides[0][0] == sides[1][0]:  # the sides differed only past the cut: the pair teaches nothing
            skipped.append(f"{where}: 'chosen' and 'rejected' are the same tokens after truncation to {max_length}")
            continue
        examples.append({"chosen": sides[0], "rejected": sides[1]})
    if not examples:
        raise DatasetError(f"dataset {name!r} split {split!r}: no usable preference pairs ({len(skipped)} skipped; "
                           f"e.g. {skipped[0] if skipped else '-'})")
    return PreferenceDataset(examples, name=name, split=split, skipped=skipped, truncated=truncated)


def default_reward(name_or_path: str) -> str | None:
    """The reward a dataset is made for, known without loading it: a synthetic task's, or a
    registered loader's `reward` attribute (gsm8k); None for files and other loaders."""
    if name_or_path.startswith("synthetic:"):
        task = synthetic.TASKS.get(name_or_path.split(":", 1)[1])
        return task.reward if task is not None else None
    try:
        loader = _find_loader(name_or_path)
    except ValueError:  # (its import error is the loading's to name)
        return None
    reward = getattr(loader, "reward", None) if loader is not None else None
    return reward if isinstance(reward, str) else None


def source_reward(source: Any) -> str | None:
    """A data.mix source's own reward: data.mix[i].reward, else its datasets' (`default_reward` of
    its train and eval data; mlrl.config.validate refuses a source whose two differ)."""
    if source.reward:
        return source.reward
    return next((r for r in (default_reward(source.train or ""), default_reward(source.eval or "")) if r), None)


def mix_rewards(data: Any, fallback: str) -> dict[str, str]:
    """data.mix's rewards, source -> reward name: the source's own (data.mix[i].reward), else its
    dataset's (`default_reward`), else `fallback` (workflow.reward)."""
    return {s.name: source_reward(s) or fallback for s in data.mix}


def _mixed(data: Any, which: str, load: Callable[[str, str], RLDataset]) -> RLDataset:
    """data.mix's sources that have data for `which`, one RLDataset: each source's rows (tagged
    `data_source: <name>`, a copy of the row) in mix order, its span in `sources`."""
    rows: list[dict[str, Any]] = []
    spans, skipped, too_long, longest = [], [], 0, 0
    for i, src in enumerate(data.mix):
        name = getattr(src, which)
        if not name:
            continue
        ds = load(name, f"data.mix[{i}].{which} (source {src.name!r})")
        spans.append(SourceSpan(src.name, len(rows), len(ds), src.weight if which == "train" else None))
        rows += [{**r, SOURCE_KEY: src.name} for r in ds.rows]
        skipped += [f"{src.name}: {s}" for s in ds.skipped]
        too_long += ds.too_long
        longest = max(longest, ds.longest_prompt)
    if not rows:
        raise DatasetError(f"data.mix: no source has {which} prompts")
    return RLDataset(rows, name=data.describe(which), split="train" if which == "train" else "test",
                     skipped=skipped, too_long=too_long, longest_prompt=longest, sources=spans)


def dataset_from_config(data: Any, which: str = "train", *, tokenizer: Any = None, seed: int = 0,
                        prompt_ids: Callable[[dict[str, Any]], list[int]] | None = None) -> RLDataset:
    """The RL prompts `mlrl.config.schema.DataConfig` names: `data.train` (split "train") or `data.eval`
    (split "test"; a synthetic task's held-out rows), filtered by `max_prompt_tokens` (prompts as
    `prompt_ids` renders them, when given: the workflow's own rendering), `skip_malformed`
    honoured, `num_synthetic` rows for synthetic tasks."""
    if which not in ("train", "eval"):
        raise ValueError(f"dataset_from_config: which must be 'train' or 'eval', got {which!r}")

    def load(name: str, field: str) -> RLDataset:
        synthetic_rows = data.num_synthetic if str(name).startswith("synthetic:") else None
        try:
            ds = get_dataset(name, "train" if which == "train" else "test", "rl", tokenizer, data.max_prompt_tokens,
                             skip_malformed=data.skip_malformed, seed=seed, num_rows=synthetic_rows,
                             prompt_ids=prompt_ids)
        except DatasetError as e:  # which setting named the bad file or row
            raise DatasetError(f"{field}: {e}") from None
        assert isinstance(ds, RLDataset)
        return ds

    if getattr(data, "mix", None):
        return _mixed(data, which, load)
    name = data.train if which == "train" else data.eval
    if not name:
        raise ValueError(f"data.{which} is not set")
    return load(name, f"data.{which}")
