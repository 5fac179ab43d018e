"""Reading the TOML file of ``encdisagg serve --config``: its values and every error at once.

The file holds an ``[encoder]`` table of :class:`~encdisagg.EncoderConfig` fields and a
``[server]`` table (without ``[server]``, the encoder keys may sit at top level). Each error
names the key as written in the file (``server.prot``, ``encoder.max_batch_size``), with the
closest known key for a misspelt one and the kind expected for a value of the wrong type.
The values themselves are checked later, beside those of the flags and the environment.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._config import EncoderConfig
from .._suggest import did_you_mean
from ._flag_table import EXPECTED, SERVER_KEYS, fits

__all__ = ["ConfigFile", "read_config_file"]


@dataclass(frozen=True, slots=True)
class ConfigFile:
    """What one file sets: ``values`` by canonical key (``encoder.model``, ``server.port``),
    ``names`` the same keys as the file spells them (``model`` at top level)."""

    values: dict[str, Any] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    #: Every error of the file, each a full line naming the file and the key.
    problems: list[str] = field(default_factory=list)


def read_config_file(path: str) -> ConfigFile:
    """The values and errors of the file at ``path``. Blocks on one file read; not async."""
    result = ConfigFile()
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        result.problems.append(f"--config: cannot read {path}: {exc}")
        return result
    server = data.pop("server", {})
    if not isinstance(server, dict):
        result.problems.append(f"{path}: server must be a table ([server])")
        server = {}
    for key, value in server.items():
        kind = SERVER_KEYS.get(key)
        if kind is None:
            hint = did_you_mean(f"server.{key}", (f"server.{known}" for known in SERVER_KEYS))
            result.problems.append(f"{path}: unknown key server.{key}{hint}")
        elif not fits(kind, value):
            result.problems.append(
                f"{path}: server.{key} must be {EXPECTED[kind]}, got {_toml_type(value)}"
            )
        else:
            result.values[f"server.{key}"] = value
            result.names[f"server.{key}"] = f"server.{key}"
    tabled = "encoder" in data
    section = data.pop("encoder") if tabled else data
    if tabled:
        # Beside an [encoder] table, anything else at top level is a misspelt table.
        for key in sorted(data):
            hint = did_you_mean(key, ("encoder", "server"))
            result.problems.append(f"{path}: unknown table or key {key}{hint}")
    if not isinstance(section, dict):
        result.problems.append(f"{path}: encoder must be a table ([encoder])")
        section = {}
    prefix = "encoder." if tabled else ""
    fields = EncoderConfig.field_names()
    for key, value in section.items():
        if key not in fields:
            hint = did_you_mean(f"{prefix}{key}", (f"{prefix}{known}" for known in fields))
            result.problems.append(f"{path}: unknown key {prefix}{key}{hint}")
        else:
            result.values[f"encoder.{key}"] = value
            result.names[f"encoder.{key}"] = f"{prefix}{key}"
    return result


def _toml_type(value: object) -> str:
    """The TOML name of ``value``'s type, as the user wrote it."""
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}
    for kind, name in names.items():
        if type(value) is kind:
            return name
    if isinstance(value, list):
        return "an array" if all(isinstance(v, str) for v in value) else "an array of non-strings"
    if isinstance(value, dict):
        return "a table"
    return "a date or time"
