"""The one configuration loader: YAML file, then environment overrides, validated into a dataclass.

Every component describes its configuration as (nested) dataclasses and calls `load_config`.
A bad file or value raises `ConfigError` whose message names the file, the key and what was expected.
Environment variables override the file: with prefix ``MEGATRACE_ALERTBOT_`` the variable
``MEGATRACE_ALERTBOT_FEISHU__SECRET`` sets key ``feishu.secret`` (``__`` separates nesting levels).
Values from the environment are read as YAML scalars or flow collections (``8080``, ``true``, ``[a, b]``),
except for string fields, whose values are taken verbatim (a token may be all digits or hold ``#``).
Error messages never show the value of a key that holds a secret.
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
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "save the configuration file as UTF-8"
        ) from None
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


def env_overrides(
    prefix: str, environ: Mapping[str, str] | None = None, schema: type | None = None
) -> dict[str, Any]:
    """Collect ``PREFIX_A__B=value`` variables into ``{"a": {"b": value}}``; values of string fields
    of `schema` verbatim, the others parsed as YAML."""
    environ = os.environ if environ is None else environ
    result: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(prefix) or name == prefix:
            continue
        path = [part.lower() for part in name[len(prefix) :].split("__")]
        if any(not part for part in path):
            raise ConfigError(f"environment variable {name}: empty key segment")
        value: Any = raw
        if raw != "" and not (schema is not None and _field_type(schema, path) is str):
            try:
                value = yaml.safe_load(raw)
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


def _field_type(schema: type, path: list[str]) -> Any:
    """The type hint of the field at `path` (lower-case names) in `schema`; None when there is none.
    Mappings (``dict[str, X]``) take any key."""
    hint: Any = schema
    for part in path:
        nested = _dataclass_in(hint)
        if nested is not None:
            hints = {name.lower(): value for name, value in typing.get_type_hints(nested).items()}
            if part not in hints:
                return None
            hint = hints[part]
        elif typing.get_origin(hint) is dict:
            hint = typing.get_args(hint)[1]
        else:
            return None
    return hint


# Keys whose values are never shown in an error message: their values are (or hold) secrets; a URL
# may carry a password (``postgresql://user:password@host/db``).
SECRET_KEY_PARTS = ("token", "secret", "password", "passwd", "credential", "webhook", "group_bots", "url")


def is_secret_key(key: str) -> bool:
    """Whether a dotted configuration key holds a secret (a token, a password, a webhook URL)."""
    return any(part in key.lower() for part in SECRET_KEY_PARTS)


def _describe(error: Mapping[str, Any]) -> str:
    key = ".".join(str(part) for part in error["loc"]) or "(top level)"
    kind = error["type"]
    if kind in ("missing", "missing_argument"):
        return f"key '{key}': required but missing"
    if is_secret_key(key):
        return f"key '{key}': {error['msg'].lower()} (the value is a secret and is not shown)"
    message = error["msg"].removeprefix("Value error, ")
    if isinstance(error.get("input"), Mapping):  # a section's own check, not a dict to print
        return message if message.startswith("key '") else f"key '{key}': {message}"
    return f"key '{key}': {message[:1].lower()}{message[1:]}, got {error.get('input')!r}"


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
        from_env = env_overrides(env_prefix, environ, schema)
        if from_env:
            data = merge(data, from_env)
            sources.append(f"environment {env_prefix}*")
    if overrides:
        data = merge(data, overrides)
        sources.append("command line")
    return validate(schema, data, " + ".join(sources) or "defaults")
