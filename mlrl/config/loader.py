"""YAML recipe + `a.b=c` overrides -> a typed `Config`, with one-line errors naming the field.

Why by hand rather than OmegaConf structured configs: we want every error to name the dotted
field and what was expected (with a did-you-mean for unknown keys) in one line, and to check
Literal / Optional / list types, which OmegaConf reports in its own multi-line format.
YAML parsing is PyYAML's; override values are parsed as YAML scalars (`a.b=1e-5`, `a.b=[1,2]`).
Removed keys (`REMOVED`) fail first, with what to set instead.

Why not pydantic (2.x, measured on this file): of the ~170 lines below, ~70 are type coercion /
checking (`_coerce` 55, the type part of `from_dict`); the rest is YAML reading (~30), dotted
overrides (~20), unknown / removed key errors (~15) and dumping, which pydantic does not do for
us. `TypeAdapter(Config)` over these same dataclasses would replace the ~70 lines, but: in lax
mode it silently accepts what we reject (`parallel.tp=2.0` -> 2, `parallel.tp=true` -> 1,
`trainer.deterministic=yes` -> True, `trainer.lr=true` -> 1.0), and strict mode refuses a mapping
for a dataclass altogether, so identical behaviour needs a `Strict()` annotation on each of the ~60
int / bool / str fields of the schema; YAML 1.1's `1e-5` string must still parse as a float. Its
errors are multi-line ("1 validation error for Config / parallel.tp / Input should be a valid
integer, unable to parse string as an integer [type=int_parsing, ...] / For further information
visit ..."), so a one-line formatter (~20 lines) is needed anyway, and the did-you-mean for
unknown keys and Literal values, the removed-key table and the override parser stay ours. Field
docstrings and Optional / Literal need nothing either way. It would also make pydantic (today
only a transitive dependency of vllm / openai) a dependency of every trainer rank, at ~0.2 s per
process (import + adapter build). Net: ~70 plain lines traded for a formatter, ~60 annotations and
a dependency, with less clear messages: the hand coercion stays.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from mlrl.config.schema import Config


class ConfigError(ValueError):
    """A configuration problem; the message names the field and what was expected."""


REMOVED: dict[str, str] = {
    "trainer.world_size": "set cluster.trainer_devices (the number of trainer ranks)",
    "parallel.dp": "the data-parallel size is derived as cluster.trainer_devices / (tp*pp*cp); "
                   "set cluster.trainer_devices=N",
    "trainer.precision": "set model.dtype (float32|bfloat16|float16), the trainer's precision follows it",
    "mode": "asynchronous training is on exactly when rollout.staleness > 0 (set rollout.staleness=N for "
            "async, 0 for sync)",
    "trainer.warmup_steps": "renamed trainer.lr_warmup_steps (the linear LR warm-up, in optimizer updates; "
                            "the same name as the critic's)",
    "critic.warmup_steps": "renamed critic.critic_only_steps (the first RL steps that train only the critic); "
                           "the critic's LR warm-up is critic.lr_warmup_steps",
    "rollout.interrupt_on_update": "renamed rollout.interrupt_on_sync (an update is an optimizer update; "
                                   "putting the weights into the engines is the weight sync)",
}
"""Config keys that no longer exist -> what to set instead. A recipe or override that still uses one
fails on load with `<name> was removed: <this>` (before the unknown-key error and anything else)."""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML recipe (or start from the defaults), apply overrides, return a typed Config.

    Only types are checked here; call `mlrl.config.validate.validate(cfg)` for cross-field rules.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {str(p)!r} is a directory, expected a YAML file")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte at offset {e.start})") from None
        except OSError as e:
            raise ConfigError(f"config file {str(p)!r} cannot be read ({e.strerror})") from None
        raw = _yaml_mapping(text, f"config file {str(p)!r}")
    for ov in overrides or []:
        _apply_override(raw, ov)
    return from_dict(Config, raw, "")


def config_from_yaml(text: str) -> Config:
    """The inverse of `dump_yaml`: a resolved config sent to another process (trainer ranks)."""
    return from_dict(Config, _yaml_mapping(text, "config YAML"), "")


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader with three changes for configs: a key given twice in one mapping is an
    error (PyYAML keeps the last one and drops the first block without a word); only
    true / false are booleans: YAML 1.1 also reads unquoted yes / no / on / off as booleans, which
    a YAML 1.2 reader (and the eye) takes for strings, so they are refused as ambiguous, anywhere
    (workflow.kwargs too); quoted, they are strings; and numbers are YAML 1.2's: `1e-5` is a float
    (YAML 1.1 wants `1.0e-5`, and a free-form field such as workflow.kwargs got the string), a
    number with a leading zero is refused as ambiguous (YAML 1.1 reads `010` as octal 8), and
    `1:30` is a string (YAML 1.1 reads it in base 60, 90)."""


_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_AMBIGUOUS = "tag:mlrl,2026:ambiguous-bool"
_AMBIGUOUS_NUMBER = "tag:mlrl,2026:ambiguous-number"
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_StrictLoader.add_implicit_resolver(
    _AMBIGUOUS, re.compile(r"^(?:yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF)$"), list("yYnNoO"))
# YAML 1.2's core schema (ints: decimal, 0o octal, 0x hex; floats with an optional exponent, inf, nan)
_StrictLoader.add_implicit_resolver(
    _AMBIGUOUS_NUMBER, re.compile(r"^[-+]?0[0-9_]+$"), list("-+0"))
_StrictLoader.add_implicit_resolver(  # (`_` between digits, as YAML 1.1 and Python allow: 1_000)
    _INT, re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def _ambiguous(loader: _StrictLoader, node: yaml.ScalarNode) -> Any:
    raise ConfigError(f"{node.value!r} on line {node.start_mark.line + 1} is ambiguous (YAML 1.1 reads it as a "
                      "boolean): write true / false, or quote it for a string")


def _ambiguous_number(loader: _StrictLoader, node: yaml.ScalarNode) -> Any:
    raise ConfigError(f"{node.value!r} on line {node.start_mark.line + 1} is ambiguous (YAML 1.1 reads a leading "
                      "zero as octal): write it without the leading zero, or quote it for a string")


def _yaml12_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    v = node.value
    return int(v[2:], 8) if v.startswith("0o") else int(v, 0) if v.startswith("0x") else int(v.replace("_", ""))


def _yaml12_float(loader: _StrictLoader, node: yaml.ScalarNode) -> float:
    v = node.value.lower().replace("_", "")
    return float(v.replace(".inf", "inf").replace(".nan", "nan"))


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: construct_mapping merges it below
            continue
        key = loader.construct_object(key_node)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:  # `? [a, b]`: a list or mapping as a key
            raise ConfigError(f"line {line}: a mapping key must be a plain value, got a {key_node.id}") from None
        if first is not None:
            raise ConfigError(f"duplicate key {key!r} on line {line} (first on line {first}): YAML would keep only "
                              "the last one; merge them into one block")
        seen[key] = line
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)
_StrictLoader.add_constructor(_AMBIGUOUS, _ambiguous)
_StrictLoader.add_constructor(_AMBIGUOUS_NUMBER, _ambiguous_number)
_StrictLoader.add_constructor(_INT, _yaml12_int)
_StrictLoader.add_constructor(_FLOAT, _yaml12_float)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects


def _yaml_mapping(text: str, what: str) -> dict[str, Any]:
    try:
        raw = _load_yaml(text) or {}
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} must hold a mapping at the top level, got {type(raw).__name__}")
    return raw


def _apply_override(raw: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like a.b=value")
    key, _, value = override.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r} has an empty key part")
    text = value.strip()
    try:
        parsed = _load_yaml(value) if text != "" else None
    except yaml.YAMLError:
        parsed = value
    except ConfigError as e:
        raise ConfigError(f"override {override!r}: {e}") from None
    # a value is YAML, except where plain text would be read as more than it says: ' #' starts no
    # comment (run_dir=runs/a #1), and a collection is only written `{...}` / `[...]`
    # (kwargs.note=Answer: briefly is a string, not {Answer: briefly})
    flow = text[:1] in ("{", "[", "'", '"')
    if not flow and (" #" in text or text.startswith("#") or isinstance(parsed, (dict, list))):
        parsed = text
    node = raw
    for part in parts[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[parts[-1]] = parsed


def from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass `cls` from a mapping, checking keys and types recursively."""
    where = prefix or "<root>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of fields, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if _join(prefix, key) in REMOVED:
            raise ConfigError(f"{_join(prefix, key)} was removed: {REMOVED[_join(prefix, key)]}")
        if key not in hints:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f" (did you mean {_join(prefix, close[0])!r}?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"unknown config key {_join(prefix, key)!r}{hint}")
        kwargs[key] = _coerce(hints[key], value, _join(prefix, key))
    return cls(**kwargs)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _describe(tp: Any) -> str:
    """What a value of type `tp` looks like in a config file (for error messages)."""
    if typing.get_origin(tp) is Literal:
        return ", ".join(repr(a) for a in typing.get_args(tp))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(tp: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_dict(tp, value, name)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors: list[ConfigError] = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, name)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        wanted = " or ".join(_describe(a) for a in args if a is not type(None))
        raise ConfigError(f"{name}: got {value!r}, expected {wanted}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{name}: got {value!r}, expected one of {', '.join(repr(a) for a in args)}{hint}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name}: got {value!r}, expected a list")
        return [_coerce(args[0], v, f"{name}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: got {value!r}, expected a mapping")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: got {value!r}, expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: got {value!r} ({type(value).__name__}), expected an integer")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads 1e-5 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{name}: got {value!r} ({type(value).__name__}), expected a number")
        if not math.isfinite(number):  # nan passes every `x < 0` range check
            raise ConfigError(f"{name}: got {value!r}, expected a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: got {value!r} ({type(value).__name__}), expected a string")
    raise ConfigError(f"{name}: unsupported type {tp}")


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


class _StrictDumper(yaml.SafeDumper):
    """Quotes every string `_StrictLoader` would read as something else (`'1e3'`, `'010'`, `'yes'`):
    the dumped config (what the trainer ranks and checkpoints read back) round-trips exactly."""


_StrictDumper.yaml_implicit_resolvers = _StrictLoader.yaml_implicit_resolvers


def dump_yaml(cfg: Any) -> str:
    return yaml.dump(to_dict(cfg), Dumper=_StrictDumper, sort_keys=False, default_flow_style=False)
