"""The one configuration loader: YAML file, then environment overrides, validated into a dataclass.

Every component describes its configuration as (nested) dataclasses and calls `load_config`.
A bad file or value raises `ConfigError` whose message names the file, the key and what was expected.
Environment variables override the file: with prefix ``MEGATRACE_ALERTBOT_`` the variable
``MEGATRACE_ALERTBOT_FEISHU__SECRET`` sets key ``feishu.secret`` (``__`` separates nesting levels).
Values from the environment are read as YAML scalars or flow collections (``8080``, ``true``, ``[a, b]``).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")


class ConfigError(ValueError):
    """Configuration that cannot be used; the message says where and why."""


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from `path`; an empty file is an empty mapping."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read configuration file: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"{path}:{line} not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def env_overrides(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Collect ``PREFIX_A__B=value`` variables into ``{"a": {"b": value}}``."""
    environ = os.environ if environ is None else environ
    result: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(prefix) or name == prefix:
            continue
        path = [part.lower() for part in name[len(prefix) :].split("__")]
        if any(not part for part in path):
            raise ConfigError(f"environment variable {name}: empty key segment")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = result
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"environment variable {name}: {part} is both a value and a section")
            node = child
        node[path[-1]] = value
    return result


def merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge `override` into a copy of `base`; mappings merge, everything else replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def _describe(error: Mapping[str, Any]) -> str:
    key = ".".join(str(part) for part in error["loc"]) or "(top level)"
    kind = error["type"]
    if kind in ("missing", "missing_argument"):
        return f"key '{key}': required but missing"
    return f"key '{key}': {error['msg'].lower()}, got {error.get('input')!r}"


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field's type hint holds (directly or as ``X | None``), if any."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [arg for arg in typing.get_args(hint) if dataclasses.is_dataclass(arg)]
        return found[0] if len(found) == 1 else None
    return None


def unknown_keys(schema: type, data: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of `data` that `schema` (a dataclass, nested ones included) does not define."""
    hints = typing.get_type_hints(schema)
    names = {field.name for field in dataclasses.fields(schema)}
    found = []
    for key, value in data.items():
        if key not in names:
            found.append(f"{prefix}{key}")
            continue
        nested = _dataclass_in(hints[key])
        if nested is not None and isinstance(value, Mapping):
            found.extend(unknown_keys(nested, value, f"{prefix}{key}."))
    return found


def validate(schema: type[T], data: Mapping[str, Any], source: str) -> T:
    """Validate `data` into the dataclass `schema`, raising ConfigError that names `source` and the key."""
    extra = unknown_keys(schema, data)
    if extra:
        raise ConfigError(f"{source}: " + "; ".join(f"key '{key}': unknown key" for key in extra))
    try:
        return TypeAdapter(schema).validate_python(dict(data))
    except ValidationError as exc:
        problems = "; ".join(_describe(err) for err in exc.errors())
        raise ConfigError(f"{source}: {problems}") from None


def load_config(
    schema: type[T],
    path: str | Path | None = None,
    env_prefix: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Load `schema` from the YAML file at `path` (optional), environment overrides, then `overrides`.

    `overrides` (e.g. from command-line flags) win over the environment, which wins over the file.
    """
    data: dict[str, Any] = read_yaml(path) if path is not None else {}
    sources = [str(path)] if path is not None else []
    if env_prefix:
        from_env = env_overrides(env_prefix, environ)
        if from_env:
            data = merge(data, from_env)
            sources.append(f"environment {env_prefix}*")
    if overrides:
        data = merge(data, overrides)
        sources.append("command line")
    return validate(schema, data, " + ".join(sources) or "defaults")
