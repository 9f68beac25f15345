"""TOML configuration into frozen dataclasses, with one-line errors that name the bad key.

A config class is a frozen dataclass whose fields carry defaults and a `doc` in their metadata;
nested sections are nested dataclasses; `dict[str, str]` fields are free-form tables (labels).
Classes validate themselves in `__post_init__` and raise `ConfigError` with a message that quotes
the value and the rule, e.g. ``liveness.down_after_s (2.0) must be larger than
liveness.suspect_after_s (2.5)``.
"""

from __future__ import annotations

import dataclasses
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from phalanx.errors import ConfigError

T = TypeVar("T")


def setting(default: Any, doc: str, *, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its default, its documentation and, for strings, the allowed values."""
    meta = {"doc": doc, "choices": choices}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def comma_list(text: str) -> list[str]:
    """'A, B,,A' -> ['A', 'B']: the items of a comma-separated setting, stripped, without blanks or repeats."""
    return list(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))


def section(cls: type[T], doc: str) -> Any:
    return dataclasses.field(default_factory=cls, metadata={"doc": doc, "choices": None})


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def positive(key: str, value: float) -> None:
    require(value > 0, f"{key} ({value}) must be larger than 0")


def load(cls: type[T], path: str | Path | None) -> T:
    """Read `path` (or take every default when None) into `cls`. Raises ConfigError."""
    if path is None:
        return build(cls, {})
    path = Path(path)
    data = read_toml(path)
    try:
        return build(cls, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def read_toml(path: str | Path) -> dict[str, Any]:
    """The table in the TOML file at `path`. Raises ConfigError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text") from None


def build(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Construct `cls` from a parsed TOML table, checking keys and types."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    retired = getattr(cls, "RETIRED", {})  # keys an older release read: said on stderr and skipped, not refused
    for name in sorted(set(data) & set(retired) - set(fields)):
        print(f"phalanx: config key '{prefix}{name}' is no longer read: {retired[name]}", file=sys.stderr, flush=True)
    data = {k: v for k, v in data.items() if k not in retired or k in fields}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = prefix + unknown[0]
        known = ", ".join(prefix + name for name in fields)
        raise ConfigError(f"unknown key '{key}' (known keys: {known})")
    values: dict[str, Any] = {}
    for name, value in data.items():
        key = prefix + name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} must be a table ([{key}]), not {_kind(value)}")
            values[name] = build(hint, value, prefix=f"{key}.")
        else:
            values[name] = _coerce(key, hint, value, fields[name].metadata.get("choices"))
    return cls(**values)


def _coerce(key: str, hint: Any, value: Any, choices: tuple[str, ...] | None) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _coerce(key, args[0], value, choices)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table of strings ([{key}]), not {_kind(value)}")
        for k, v in value.items():
            if not isinstance(v, str):
                raise ConfigError(f"{key}.{k} must be a string, not {_kind(v)}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, not {_kind(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, not {_kind(value)}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, not {_kind(value)}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, not {_kind(value)}")
        if choices is not None and value not in choices:
            raise ConfigError(f"{key} ({value!r}) must be one of: {', '.join(choices)}")
        return value
    raise TypeError(f"config field {key} has an unsupported type {hint!r}")  # a bug in a config class


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return f"{type(value).__name__} {value!r}"


def describe(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every setting of `cls`, nested sections flattened; for docs."""
    rows: list[tuple[str, Any, str]] = []
    instance = cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(describe(hints[f.name], prefix=f"{prefix}{f.name}."))
        else:
            rows.append((prefix + f.name, getattr(instance, f.name), f.metadata.get("doc", "")))
    return rows


def default_toml(cls: type) -> str:
    """The default configuration of `cls` as a commented TOML document: top-level keys, then tables."""
    rows = describe(cls)
    top = [r for r in rows if "." not in r[0] and not isinstance(r[1], dict)]
    tables = [r for r in rows if r not in top]
    lines: list[str] = []
    for key, default, doc in top:
        lines += [f"# {doc}", f"{key} = {_toml_value(default)}"]
    current = None
    for key, default, doc in tables:
        if isinstance(default, dict):  # a free-form table of its own
            lines += ["", f"# {doc}", f"[{key}]", *[f"{k} = {_toml_value(v)}" for k, v in default.items()]]
            current = key
            continue
        head, _, leaf = key.rpartition(".")
        if head != current:
            lines += ["", f"[{head}]"]
            current = head
        lines += [f"# {doc}", f"{leaf} = {_toml_value(default)}"]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return repr(value)


def host_port(key: str, value: str, example: str) -> tuple[str, int]:
    """`host:port`, or `[v6]:port`, as (host, port). Raises ConfigError quoting the value."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    require(bool(sep) and bool(host) and port.isdigit() and int(port) < 65536 and not any(c in host for c in " /[]"),
            f"{key} ({value!r}) must be host:port, e.g. {example}")
    return host, int(port)


@dataclasses.dataclass(frozen=True)
class MetricsAccessConfig:
    """`[metrics]`: who may scrape /metrics, and over what."""

    tls: bool = setting(False, "serve /metrics over HTTPS with this daemon's certificate and key ([security] "
                        "cert_file, key_file)")
    client_cert: bool = setting(False, "with tls: a scrape must present a client certificate signed by the "
                                "cluster CA ([security] ca_file), e.g. `phalanx certs issue prometheus --role "
                                "client`")
    basic_auth_file: str = setting("", "file of 'USER SHA256' lines, SHA256 the hex digest of the user's password "
                                   "(`printf %s PASSWORD | sha256sum`; make it a long random one); a scrape must "
                                   "authenticate as one of them (HTTP basic auth). Needs tls: a password over plain "
                                   "HTTP is anyone's on the path")

    def __post_init__(self) -> None:
        require(self.tls or not self.client_cert, "metrics.client_cert needs metrics.tls = true")
        require(self.tls or not self.basic_auth_file, "metrics.basic_auth_file needs metrics.tls = true: a password "
                "over plain HTTP is anyone's on the path")
