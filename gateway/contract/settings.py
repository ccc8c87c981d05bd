"""Typed configuration: one dataclass tree per component, from YAML + environment + flags.

Precedence: dataclass defaults < YAML file < environment < command-line flags. Every setting
has a dotted path (``redis.url``, ``pools.0.block_size``); in the environment it is
``<PREFIX><PATH>`` upper-cased with ``__`` between levels (``KVROUTE_REDIS__URL``); on the
command line ``--set redis.url=...`` (components also offer named flags for common ones).
Values from the environment and flags are parsed as YAML scalars or JSON-like YAML
(``true``, ``5``, ``[a, b]``). Unknown settings and wrong types are errors that name the
setting, never silently ignored.

It is part of the contract because the gateway, the agent and the simulator are configured
the same way (one Helm chart sets all of them); each component keeps its own schema.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

__all__ = ["ConfigError", "load_config", "parse_assignments", "to_dict"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is unknown, malformed or of the wrong type (the message names it)."""


def load_config(
    cls: type[T],
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str = "KVROUTE_",
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build ``cls`` from defaults, then ``file``, then ``env``, then ``overrides``.

    ``overrides`` maps dotted paths to values (already typed, or strings to parse).
    """
    data: dict[str, Any] = {}
    if file is not None:
        try:
            loaded = yaml.safe_load(Path(file).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {file} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {file} must hold a mapping at the top level")
        data = loaded
    for path, value in _env_assignments(cls, env or {}, env_prefix).items():
        _assign(data, path, value)
    for path, value in (overrides or {}).items():
        _assign(data, path, _Raw(value) if isinstance(value, str) else value)
    return _build(cls, data, "")


def parse_assignments(items: list[str] | None) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` (from repeated ``--set``) -> ``{"a.b": 1, "c": "x"}``."""
    out: dict[str, Any] = {}
    for item in items or []:
        path, sep, raw = item.partition("=")
        if not sep or not path:
            raise ConfigError(f"--set expects PATH=VALUE, got {item!r}")
        out[path.strip()] = _Raw(raw)
    return out


def to_dict(obj: Any) -> Any:
    """A config object as plain data (for logging and for writing it back as YAML)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# -- internals -------------------------------------------------------------------------------


class _Raw(str):
    """A setting's text from the environment or a flag, not parsed yet: a string setting
    takes it verbatim (a secret like ``true`` or ``0x1F`` stays a string); other types
    parse it as YAML (``5``, ``true``, ``[a, b]``)."""


def _parse_scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def _assign(data: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    cur: Any = data
    for i, part in enumerate(parts[:-1]):
        nxt_is_index = parts[i + 1].isdigit()
        if isinstance(cur, list):
            idx = int(part)
            while len(cur) <= idx:
                cur.append({})
            if not isinstance(cur[idx], dict | list):
                cur[idx] = [] if nxt_is_index else {}
            cur = cur[idx]
        else:
            if not isinstance(cur.get(part), dict | list):
                cur[part] = [] if nxt_is_index else {}
            cur = cur[part]
    last = parts[-1]
    if isinstance(cur, list):
        idx = int(last)
        while len(cur) <= idx:
            cur.append({})
        cur[idx] = value
    else:
        cur[last] = value


def _env_assignments(cls: type, env: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """Environment variables under ``prefix`` mapped to dotted paths of ``cls``."""
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(prefix):
            continue
        parts = [p.lower() for p in name[len(prefix) :].split("__")]
        if _is_known_path(cls, parts):
            out[".".join(parts)] = _Raw(raw)
    return out


def _is_known_path(cls: Any, parts: list[str]) -> bool:
    tp = cls
    for part in parts:
        tp = _strip_optional(tp)
        if dataclasses.is_dataclass(tp):
            hints = get_type_hints(tp)
            if part not in hints:
                return False
            tp = hints[part]
        elif get_origin(tp) is list and part.isdigit():
            tp = get_args(tp)[0]
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        else:
            return False
    return True


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _build(tp: Any, value: Any, where: str) -> Any:
    name = where or "<root>"
    if isinstance(value, _Raw):
        if tp is str or (get_origin(tp) in (typing.Union, types.UnionType) and str in get_args(tp)):
            return str(value)
        # any other type, untyped values (``Any``: workload and policy parameters) included,
        # is parsed: ``--set params.turns=[2,3]`` is a list, ``policy_params.x=1`` a number
        value = _parse_scalar(value)
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _build(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{name}: no type fits {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # type: ignore[arg-type]
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {type(value).__name__}")
        hints = get_type_hints(tp)
        fields = {f.name for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ConfigError(f"{name}: unknown setting(s) {', '.join(map(str, unknown))}")
        kwargs = {k: _build(hints[k], v, f"{where}.{k}" if where else k) for k, v in value.items()}
        try:
            obj = tp(**kwargs)  # type: ignore[operator]
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{name}: {exc}") from None
        return obj
    if origin is Literal:
        if value not in get_args(tp):
            choices = ", ".join(map(repr, get_args(tp)))
            raise ConfigError(f"{name}: must be one of {choices}, got {value!r}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {type(value).__name__}")
        (item,) = get_args(tp)
        return [_build(item, v, f"{where}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {type(value).__name__}")
        kt, vt = get_args(tp)
        return {
            _build(kt, k, f"{where}.{k}"): _build(vt, v, f"{where}.{k}") for k, v in value.items()
        }
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, bool) or value is None or isinstance(value, dict | list):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{name}: unsupported setting type {tp!r}")
