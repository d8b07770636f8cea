"""Building a `Config`: the defaults, then a YAML file, then dotted overrides; and printing one back.

OmegaConf does the loading: YAML, dotted overrides, merging, type checks and
`${...}` interpolation (`${data.max_prompt_length}`, `${oc.env:VAR}`), as verl
users write them. What is ours: the one-line `ConfigError`s with "did you
mean", the removed keys, numbers the trainer cannot compute with refused
everywhere, `trainer.plugins` loaded before the choices are checked, and the
YAML dump with each key's help (`conveyor config --describe`).

It deliberately declares no setting and checks no value against its range or
choices: the schema modules declare them and `conveyor.config.fields.check_tree`
checks them, when the merged config becomes a `Config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import math
import types
import typing
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException, ValidationError

from conveyor.config.fields import ConfigError, choices_of, field_paths, section_hints
from conveyor.config.root import Config

__all__ = ["REMOVED_KEYS", "load_config", "parse_overrides", "config_to_dict", "config_to_yaml"]

# Keys that existed once and were renamed: using one is an error that names the new key.
REMOVED_KEYS: dict[str, str] = {
    "moe_load_balance_monitor_interval": (
        "the engine-level key 'moe_load_balance_monitor_interval' was removed; "
        "use actor_rollout_ref.rollout.moe_load_balance_metrics_interval"
    ),
}


def _field_type(path: str) -> Any:
    """The declared type of a dotted key (None when there is no such key)."""
    t: Any = Config
    for part in path.split("."):
        if not dataclasses.is_dataclass(t) or part not in section_hints(t):
            return None
        t = section_hints(t)[part]
    return t


def _nearest(path: str) -> str:
    """The valid key a mistyped one most likely meant ('' when nothing is close)."""
    paths = field_paths(Config)
    section, _, leaf = path.rpartition(".")
    siblings = [p.rpartition(".")[2] for p in paths if p.rpartition(".")[0] == section]
    near = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.5)
    if near:
        return f"{section}.{near[0]}" if section else near[0]
    # The right leaf in the wrong section (e.g. `temperature=` at the top level).
    same_leaf = [p for p in paths if p.rpartition(".")[2] == leaf]
    if same_leaf:
        return same_leaf[0]
    # Keys of other sections only: the siblings were compared leaf to leaf above (a short sibling such as
    # trainer.v1 would otherwise match any trainer.* path on the shared prefix alone).
    others = [p for p in paths if p.rpartition(".")[0] != section]
    near = difflib.get_close_matches(path, others, n=1, cutoff=0.6)
    if near and not path.startswith(near[0] + "."):
        return near[0]
    return ""


def _unknown_key_message(path: str) -> str:
    near = _nearest(path)
    if near:
        return f"unknown config key {path}; did you mean {near}?"
    section = path.rpartition(".")[0]
    siblings = [p.rpartition(".")[2] for p in field_paths(Config) if p.rpartition(".")[0] == section]
    return f"unknown config key {path}; valid keys under {section or 'the top level'}: {', '.join(siblings)}"


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    return getattr(t, "__name__", str(t))


def _lookup(data: Any, path: str) -> Any:
    """The raw value at a dotted path of nested dicts (KeyError when absent)."""
    node = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(path)
        node = node[part]
    return node


# Keys that take a name or a list of names: `[a,b]` from the command line arrives as one string.
_NAME_OR_LIST_KEYS = frozenset({"target_modules"})


def _prepare(data: Any, cls: Any, prefix: str) -> Any:
    """Refuse removed keys and values given for sections; a section given null is its defaults.

    A list key given one bare string (`trainer.logger=console`) takes it as a
    comma-separated list, as verl's trackers do.
    """
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key in REMOVED_KEYS:
            raise ConfigError(f"{path}: {REMOVED_KEYS[key]}")
        t = section_hints(cls).get(key) if dataclasses.is_dataclass(cls) else None
        if dataclasses.is_dataclass(t):
            if value is None:
                value = {}
            elif not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a mapping of keys, got {type(value).__name__} {value!r}")
        elif (t is list or typing.get_origin(t) is list) and isinstance(value, str) and "${" not in value:
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif key in _NAME_OR_LIST_KEYS and isinstance(value, str) and value.startswith("[") and value.endswith("]"):
            # A key that takes a name or a list (model.target_modules): `[a,b]` from the command line is the list.
            value = [v.strip() for v in value[1:-1].split(",") if v.strip()]
        out[key] = _prepare(value, t, path + ".")
    return out


# Numbers the trainer can compute with: every float ends up in float32 tensors or
# schedules, every int in int64 tensors, seeds or counts.
_F32_MAX = 3.4028234663852886e38
_INT64_LIMIT = 2**63


def _check_number(path: str, value: Any) -> None:
    """Refuse NaN, infinities, floats beyond float32 and ints beyond int64 (bools are not numbers here)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not -_INT64_LIMIT <= value < _INT64_LIMIT:
        # str() of an int beyond 4300 digits fails: count those by their logarithm.
        digits = len(str(abs(value))) if value.bit_length() < 14_000 else int(math.log10(abs(value))) + 1
        raise ConfigError(
            f"{path}: an integer of {digits} digits is too large; give a number within +-{_INT64_LIMIT - 1}"
        )
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{path}: must be a finite number, got {value}")
        if abs(value) > _F32_MAX:
            raise ConfigError(
                f"{path}: {value:g} overflows float32 (where the trainer computes); give a number within +-3.4e38"
            )


def _check_numbers(data: Any, cls: Any, prefix: str) -> None:
    """`_check_number` on every value of the sections of `data` (nested dicts over the dataclasses), lists included.

    Done once for every key here, so no section has to remember it: a NaN
    coefficient would otherwise pass every `x > 0`-style check it lacks.
    Free-form mappings (`transfer_queue.transferqueue`) belong to their package.
    """
    if not isinstance(data, dict) or not dataclasses.is_dataclass(cls):
        return
    hints = section_hints(cls)
    for key, value in data.items():
        if key not in hints:
            continue  # an unknown key: the merge reports it, with the key it was probably meant to be
        if dataclasses.is_dataclass(hints[key]):
            _check_numbers(value, hints[key], f"{prefix}{key}.")
            continue
        for v in value if isinstance(value, list) else [value]:
            _check_number(f"{prefix}{key}", v)


def _translate(err: OmegaConfBaseException, sources: list[dict]) -> ConfigError:
    """One line naming the key for an OmegaConf error (unknown key, wrong type, failed interpolation)."""
    key = getattr(err, "full_key", None) or ""
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, InterpolationResolutionError):
        # "KeyError raised while resolving interpolation: \"...\"" -> the quoted reason alone.
        reason = first.split("while resolving interpolation: ", 1)[-1].strip().strip('"')
        return ConfigError(f"{key}: cannot resolve its interpolation: {reason}")
    if isinstance(err, ConfigKeyError):
        return ConfigError(_unknown_key_message(key))
    if isinstance(err, ValidationError) and key:
        t = _field_type(key)
        for data in reversed(sources):  # the last source given wins, as in the merge
            try:
                value = _lookup(data, key)
            except KeyError:
                continue
            got = "null" if value is None else f"{type(value).__name__} {value!r}"
            return ConfigError(f"{key}: expected {_type_name(t)}, got {got}")
    return ConfigError(f"{key or 'config'}: {first}")


def _parse_dotlist(overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.total_training_steps=10)")
        key = item.split("=", 1)[0].strip().lstrip("+")
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key")
    # Hydra's "+key=value" (add a key) means the same as "key=value" here.
    items = [item.strip().lstrip("+") for item in overrides]
    try:
        data = OmegaConf.to_container(OmegaConf.from_dotlist(items), resolve=False)
    except OmegaConfBaseException as err:
        raise ConfigError(f"overrides {overrides}: {str(err).splitlines()[0]}") from err
    except (yaml.YAMLError, RecursionError) as err:
        # A value YAML cannot read ("@", ",", "*"): name the override it is in, and how to pass it as text.
        culprit = next((item for item in items if not _reads_as_yaml(item)), items[0])
        key, value = culprit.split("=", 1)
        what = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(
            f"override {culprit!r}: the value is not valid YAML ({what}); to pass it as text, quote "
            f"it: {key}='\"{value}\"'"
        ) from err
    for item in items:
        key, value = (part.strip() for part in item.split("=", 1))
        # YAML reads "5_0.5" as the number 50.5 (underscores are digit separators there); for a
        # key that takes text, such as rollout_is_threshold's "lower_upper", keep what was typed.
        # Optional[str], not `str | None`: what the resolved type hints compare equal to on Python 3.10-3.13.
        if "_" in value and _field_type(key) in (Any, str, Optional[str]):  # noqa: UP045
            node = data
            *parents, last = key.split(".")
            for part in parents:
                node = node[part]
            node[last] = value
    return data


def _reads_as_yaml(item: str) -> bool:
    """Whether the value of one `key=value` override parses."""
    try:
        OmegaConf.from_dotlist([item])
    except (yaml.YAMLError, RecursionError):
        return False
    except OmegaConfBaseException:
        pass
    return True


def parse_overrides(overrides: list[str]) -> dict:
    """Turn `a.b.c=value` strings into a nested dict (values parsed by OmegaConf: numbers, bools, lists)."""
    return _parse_dotlist(list(overrides))


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    from conveyor.files import read_text  # here: importing the config imports no implementation

    try:
        text = read_text(path, "--config")
    except ValueError as err:
        raise ConfigError(str(err)) from err
    try:
        loaded = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as err:
        # One line, as every config error is: where, then what.
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(err, "problem", None) or " ".join(str(err).split())
        raise ConfigError(f"--config {path}: not valid YAML{where}: {what}") from err
    except RecursionError as err:
        raise ConfigError(f"--config {path}: nested too deeply to be a config") from err
    except OSError as err:  # OmegaConf's word for a top level that is a lone number or text
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections, not a single value") from err
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections")
    return OmegaConf.to_container(loaded, resolve=False)


def _build(sources: list[dict]) -> Config:
    """Merge `sources` over the defaults, load the plugins they name, then resolve and check everything."""
    sources = [_prepare(data, Config, "") for data in sources]
    for data in sources:  # before the merge: OmegaConf cannot turn an int beyond a double into a float
        _check_numbers(data, Config, "")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), *sources)
        # Plugins register the estimators, losses and reward functions the config may name.
        from conveyor.plugins import load_plugins

        load_plugins(list(OmegaConf.select(merged, "trainer.plugins")))
        # Again once resolved (interpolations, "nan" given as text), before any section's own checks run.
        _check_numbers(OmegaConf.to_container(merged, resolve=True), Config, "")
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _translate(err, sources) from err


def load_config(config_file: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then a YAML file, then dotted overrides; interpolations resolved; validated."""
    data = _read_yaml(Path(config_file)) if config_file is not None else {}
    return _build([data, _parse_dotlist(list(overrides or []))])


def config_to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts."""
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Config, with_help: bool = False) -> str:
    """The resolved config as YAML; with_help adds each field's documentation (and valid choices) as a comment."""
    if not with_help:
        return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None)
    lines: list[str] = []
    _yaml_with_help(cfg, 0, lines)
    return "\n".join(lines) + "\n"


def _yaml_with_help(obj: Any, indent: int, lines: list[str]) -> None:
    pad = "  " * indent
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        help_ = f.metadata.get("help", "")
        choices = choices_of(f)
        if choices is not None:
            help_ += f" (one of: {', '.join(map(str, choices))})"
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{f.name}:  # {help_}")
            _yaml_with_help(value, indent + 1, lines)
        else:
            dumped = yaml.safe_dump(value, default_flow_style=True).strip()
            if dumped.endswith("..."):
                dumped = dumped[:-3].strip()
            lines.append(f"{pad}{f.name}: {dumped}  # {help_}")
