"""The configuration loader: YAML files (with `base:` includes), `key=value` overrides, and the
construction of frozen dataclasses from nested mappings with type checking.

Generic: it knows no section. The sections live beside it (`model.py`, `mesh.py`, `train.py`,
`data.py`, `checkpoint.py`) and `run.py` composes them into the run's `Config`, so that a new
subsystem adds a section here without the ground floor importing the subsystem.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from composer_jax.errors import ConfigError

_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")

__all__ = [
    "build_dataclass",
    "coerce",
    "deep_merge",
    "parse_overrides",
    "plain",
    "read_yaml",
    "read_yaml_layers",
    "set_path",
    "to_dict",
]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return build_dataclass(tp, value, key)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}={value!r} is not accepted; accepted: {_type_name(tp)}")
        return value
    if origin is tuple:
        # tuple[X, ...] from a YAML list (e.g. data.sources: a list of SourceConfig mappings);
        # a fixed-length tuple[X, Y] is checked element by element.
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if args and len(args) != len(value):
            raise ConfigError(f"{key}: expected a list of {len(args)} items, got {value!r}")
        return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args))) if args else tuple(value)
    if origin in (Mapping, dict) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}={value!r}: expected {' or '.join(_type_name(a) for a in typing.get_args(tp))}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected a boolean (true/false)")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return value
    if tp is float:
        # YAML 1.1 reads 1e-6 (no dot) as a string: a decimal number written so is taken as one
        if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value
    return value


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _yaml_fields(cls: Any) -> list[dataclasses.Field]:
    """The fields a config dataclass has in YAML: all but those marked `metadata={"yaml": False}`
    (what the loader records about a config, e.g. where its model section was written)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("yaml", True)]


def build_dataclass(cls: type, data: Mapping[str, Any], prefix: str, base: Any = None) -> Any:
    """cls from a mapping of its fields. A nested section given in part keeps its field's default for
    the keys not given (which may differ from its class's defaults, e.g. `rl.sampler`); `base`, when
    given, is that default. A key listed in cls.MOVED_KEYS gets an error naming where it went; a
    field named in cls.YAML_KEYS is spelled so in YAML (`from_` -> `from`, a Python keyword); a field
    marked `metadata={"yaml": False}` is no key at all (it keeps its default)."""
    hints = typing.get_type_hints(cls)
    spelled: Mapping[str, str] = getattr(cls, "YAML_KEYS", {})
    fields = {f.name: f for f in _yaml_fields(cls)}
    field_of = {spelled.get(name, name): name for name in fields}
    moved: Mapping[str, str] = getattr(cls, "MOVED_KEYS", {})
    kwargs = {}
    for yaml_key, v in data.items():
        key = f"{prefix}.{yaml_key}" if prefix else str(yaml_key)
        if yaml_key in moved:
            raise ConfigError(f"{key} is now {moved[yaml_key]}: give {moved[yaml_key]}={v!r} instead")
        k = field_of.get(yaml_key, "")
        if not k:
            close = difflib.get_close_matches(str(yaml_key), field_of, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown key {key!r}{hint}; accepted keys: {', '.join(sorted(field_of))}")
        tp = hints[k]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and isinstance(v, Mapping):
            default = getattr(base, k) if base is not None else _field_default(fields[k])
            kwargs[k] = build_dataclass(tp, v, key, default if isinstance(default, tp) else None)
        else:
            kwargs[k] = coerce(v, tp, key)
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def set_path(tree: dict, path: Sequence[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part!r} is a value, not a section")
        node = child
    node[path[-1]] = value


def parse_overrides(overrides: Sequence[str]) -> list[tuple[list[str], Any]]:
    """`a.b=value` strings -> (path, YAML-parsed value). A key given twice is an error."""
    seen: set[str] = set()
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. model.num_layers=2)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override {item!r}: empty key part; use dotted keys like model.num_layers=2")
        if key in seen:
            raise ConfigError(f"override key {key!r} is given twice; give each key once")
        seen.add(key)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
        out.append((key.split("."), value))
    return out


def read_yaml(path: Path) -> dict:
    """Read a YAML file; a top-level `base: other.yaml` (relative to the file) is merged under it."""
    merged: dict = {}
    for _file, data in read_yaml_layers(path):
        deep_merge(merged, data)
    return merged


def read_yaml_layers(path: Path, stack: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    """The files `read_yaml(path)` merges, in merge order (each `base:` before the file naming it),
    each with its own mapping (`base` removed): where a key was written, for `model.from`
    (config/run.py `model_origin`)."""
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"config path {str(path)!r} is not a file; give a YAML file (e.g. configs/model/tiny.yaml)")
    if path in stack:
        raise ConfigError(f"config {str(path)!r} includes itself through 'base'")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at top level, got {type(data).__name__}")
    bases = data.pop("base", None)
    layers: list[tuple[Path, dict]] = []
    for b in [] if bases is None else [bases] if isinstance(bases, str) else list(bases):
        layers += read_yaml_layers((path.parent / b).resolve(), stack + (path,))
    return [*layers, (path, data)]


def deep_merge(dst: dict, src: Mapping) -> None:
    for k, v in src.items():
        if isinstance(v, Mapping) and isinstance(dst.get(k), dict):
            deep_merge(dst[k], v)
        else:
            dst[k] = v


def plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        spelled = getattr(obj, "YAML_KEYS", {})
        return {spelled.get(f.name, f.name): plain(getattr(obj, f.name)) for f in _yaml_fields(obj)}
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):  # tuples of sections (data.sources) -> YAML/JSON lists
        return [plain(v) for v in obj]
    return obj


def to_dict(cfg: Any) -> dict:
    """A config dataclass as a plain nested dict (YAML/JSON serialisable)."""
    return plain(cfg)
