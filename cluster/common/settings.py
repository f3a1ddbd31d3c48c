"""Settings from four layers, each key's value and where it came from.

A node's configuration (and a client's) is a set of sections, each a frozen
dataclass of typed fields with defaults: ``[node]``, ``[raft]``, ``[notifier]``,
``[archive]``... A key ``section.field`` is read, highest precedence first, from

1. a command-line flag ``--section-field VALUE`` (dashes for underscores),
2. an environment variable ``SEVENDB_SECTION_FIELD``,
3. the TOML file (``[section]`` table, ``field = value``),
4. the field's default.

Unknown keys in any layer are refused with the known ones listed, values are parsed
as the field's type (a TOML value must already have it), and the dataclass's own
validation runs last. `Settings.explain()` prints every effective value and its
origin (``--print-config``).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from sevendb.cluster.common.topology import ConfigError

__all__ = [
    "ENV_PREFIX",
    "Layers",
    "Origin",
    "Settings",
    "env_name",
    "flag_name",
    "flags_from_args",
    "section_flags",
]

ENV_PREFIX = "SEVENDB_"
T = TypeVar("T")


def env_name(section: str, field: str) -> str:
    return f"{ENV_PREFIX}{section}_{field}".upper()


def flag_name(section: str, field: str) -> str:
    return f"--{section}-{field}".replace("_", "-")


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a value came from: ``default``, ``file``, ``env`` or ``flag``, and which
    file, variable or flag."""

    layer: str
    where: str = ""

    def __str__(self) -> str:
        return self.layer if not self.where else f"{self.layer} {self.where}"


@dataclass(frozen=True)
class Layers:
    """The raw inputs: the parsed TOML file (if any), the environment and the
    ``--section-field`` flags given (name without dashes -> raw string)."""

    file: Mapping[str, Any]
    file_name: str
    environ: Mapping[str, str]
    flags: Mapping[str, str]

    @classmethod
    def read(
        cls,
        path: Path | None,
        environ: Mapping[str, str],
        flags: Mapping[str, str] | None = None,
    ) -> Layers:
        raw: Mapping[str, Any] = {}
        if path is not None:
            try:
                raw = tomllib.loads(path.read_text())
            except FileNotFoundError:
                raise ConfigError(f"{path}: no such config file") from None
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}: unreadable ({exc})") from None
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{path}: not valid TOML ({exc})") from None
        return cls(raw, str(path or ""), environ, dict(flags or {}))


def _field_kind(cls: type[Any], field: dataclasses.Field[Any]) -> Any:
    return typing.get_type_hints(cls)[field.name]


def _parse(kind: Any, raw: str, what: str) -> Any:
    """A string from an environment variable or flag, as `kind`."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        inner = [k for k in typing.get_args(kind) if k is not type(None)]
        if raw == "" and len(inner) < len(typing.get_args(kind)):
            return None
        return _parse(inner[0], raw, what)
    if origin is tuple:
        (item,) = {a for a in typing.get_args(kind) if a is not Ellipsis}
        return tuple(_parse(item, part.strip(), what) for part in raw.split(",") if part.strip())
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind in (int, float, str, Path):
            return kind(raw)
        if isinstance(kind, type) and issubclass(kind, str):  # a StrEnum
            return kind(raw)
    except ValueError:
        name = getattr(kind, "__name__", str(kind))
        raise ConfigError(f"{what}={raw!r}: expected {name}") from None
    raise ConfigError(f"{what}: settings of type {kind} cannot be set from text")


def _check_toml(kind: Any, value: Any, what: str) -> Any:
    """A TOML value, checked (and converted, for paths, tuples and enums) as `kind`."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        inner = [k for k in typing.get_args(kind) if k is not type(None)]
        return _check_toml(inner[0], value, what)
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{what}: expected a list, got {value!r}")
        (item,) = {a for a in typing.get_args(kind) if a is not Ellipsis}
        return tuple(_check_toml(item, v, what) for v in value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is Path and isinstance(value, str):
        return Path(value)
    if isinstance(kind, type) and issubclass(kind, str) and isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            choices = ", ".join(str(k) for k in cast(Iterable[Any], kind))
            raise ConfigError(f"{what}: {value!r} is not one of {choices}") from None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{what}: expected {kind.__name__}, got {value!r}")
    return value


class Settings:
    """Sections of settings resolved from `Layers`; see the module docstring."""

    def __init__(self, layers: Layers, sections: Mapping[str, type[Any]]) -> None:
        self._layers = layers
        self._sections = dict(sections)
        self.values: dict[str, Any] = {}
        self.origins: dict[str, dict[str, Origin]] = {}
        self._refuse_unknown()
        for section, cls in self._sections.items():
            self.values[section], self.origins[section] = self._resolve(section, cls)

    def section(self, name: str, cls: type[T]) -> T:
        value = self.values[name]
        assert isinstance(value, cls)
        return value

    def _keys(self) -> dict[str, tuple[str, str]]:
        return {
            f"{s}.{f.name}": (s, f.name)
            for s, cls in self._sections.items()
            for f in dataclasses.fields(cls)
        }

    def _refuse_unknown(self) -> None:
        keys = self._keys()
        known_env = {env_name(s, f) for s, f in keys.values()}
        known_flags = {flag_name(s, f).removeprefix("--") for s, f in keys.values()}
        where = self._layers.file_name
        for section, table in self._layers.file.items():
            if section not in self._sections or not isinstance(table, dict):
                raise ConfigError(
                    f"{where}: unknown section [{section}]; known: "
                    + ", ".join(f"[{s}]" for s in self._sections)
                )
            for field in table:
                if f"{section}.{field}" not in keys:
                    raise ConfigError(
                        f"{where}: unknown key {field!r} in [{section}]; known: "
                        + ", ".join(f.name for f in dataclasses.fields(self._sections[section]))
                    )
        for name in self._layers.environ:
            section = name.removeprefix(ENV_PREFIX).split("_", 1)[0].lower()
            if name.startswith(ENV_PREFIX) and section in self._sections and name not in known_env:
                same = sorted(n for n in known_env if n.startswith(env_name(section, "")))
                raise ConfigError(f"{name}: unknown setting; known: {', '.join(same)}")
        for flag in self._layers.flags:
            if flag not in known_flags:
                raise ConfigError(f"--{flag}: unknown setting")

    def _resolve(self, section: str, cls: type[Any]) -> tuple[Any, dict[str, Origin]]:
        values: dict[str, Any] = {}
        origins: dict[str, Origin] = {}
        for field in dataclasses.fields(cls):
            found = self._lookup(section, field.name, _field_kind(cls, field))
            if found is not None:
                values[field.name], origins[field.name] = found
            else:
                origins[field.name] = Origin("default")
        try:
            return cls(**values), origins
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"[{section}]: {exc}") from None

    def _lookup(self, section: str, field: str, kind: Any) -> tuple[Any, Origin] | None:
        """The value of one key from the highest layer that sets it, or None."""
        flag = flag_name(section, field)
        env = env_name(section, field)
        table = self._layers.file.get(section, {})
        if flag.removeprefix("--") in self._layers.flags:
            raw = self._layers.flags[flag.removeprefix("--")]
            return _parse(kind, raw, flag), Origin("flag", flag)
        if env in self._layers.environ:
            return _parse(kind, self._layers.environ[env], env), Origin("env", env)
        if field in table:
            what = f"{self._layers.file_name}: {section}.{field}"
            return _check_toml(kind, table[field], what), Origin("file", self._layers.file_name)
        return None

    def explain(self) -> str:
        """Every effective value and where it came from, as TOML with comments."""
        lines: list[str] = []
        for section, value in self.values.items():
            lines.append(f"[{section}]")
            for field in dataclasses.fields(value):
                shown = _toml_value(getattr(value, field.name))
                origin = self.origins[section][field.name]
                lines.append(f"{field.name} = {shown}  # {origin}")
            lines.append("")
        return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if value is None:
        return '""'
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def section_flags(sections: Mapping[str, type[Any]]) -> Iterable[tuple[str, str]]:
    """(flag, help) for every key, for an argparse parser."""
    for section, cls in sections.items():
        for field in dataclasses.fields(cls):
            default = field.default if field.default is not dataclasses.MISSING else None
            yield flag_name(section, field.name), f"[{section}] {field.name} (default {default!r})"


def flags_from_args(sections: Mapping[str, type[Any]], args: Mapping[str, Any]) -> dict[str, str]:
    """The settings flags set in an argparse namespace's `vars()`, keyed as
    `Layers.flags` (flag name without its dashes)."""
    out: dict[str, str] = {}
    for section, cls in sections.items():
        for field in dataclasses.fields(cls):
            flag = flag_name(section, field.name).removeprefix("--")
            value = args.get(flag.replace("-", "_"))
            if value is not None:
                out[flag] = str(value)
    return out
