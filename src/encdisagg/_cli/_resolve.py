"""``encdisagg serve``'s options: flags over environment over the TOML file over defaults.

:func:`resolve` gathers every value with where it came from, checks them all, and reports
every error at once, each naming its source: the flag (``--port``), the environment
variable (``ENCDISAGG_PORT``) or the file and its key (``serve.toml: server.port``). It
imports neither torch nor the model code (only a CUDA device asks torch whether it exists),
so a bad option answers at once; the server itself is imported once the options are valid.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .._config import EncoderConfig
from .._devices import worker_devices
from .._errors import BadRequestError
from .._hub import looks_like_hub_id, resolve_hub_model
from .._model_names import BUILTIN_MODEL_NAMES, SERVER_MODEL_NAMES, not_a_model
from ..server._logs import LogFormat
from ..server._settings import ServerSettings
from ._config_file import read_config_file
from ._flag_table import FLAGS, Flag

__all__ = ["ServeOptions", "UsageError", "resolve"]

_MIB: Final = 1024 * 1024
_DEFAULTS: Final[dict[str, Any]] = {
    "server.host": "127.0.0.1",
    "server.port": 8000,
    "server.dp": 1,
    "server.worker_class": "asyncio",
    "server.log_level": "info",
    "server.log_format": "text",
    "server.max_body_mb": 256,
    "server.health_timeout_s": 20.0,
    # The server owns its process: its heap is frozen once the Encoder is open.
    "server.freeze_heap": True,
}
#: ServerSettings field -> the option whose source an error of that field names.
_SETTINGS_KEYS: Final = {
    # The [server] key of the same name; the gRPC service binds --host. Longer names first:
    # a message about registry_lease_ttl_s must not be taken for one about registry.
    name: "server.host" if name == "grpc_host" else f"server.{name}"
    for name in (
        "dp", "health_timeout_s", "freeze_heap", "api_key", "allowed_peers",
        "registry_lease_ttl_s", "registry", "grpc_port", "grpc_host", "wire", "register_with",
        "advertise_url", "drain_delay_s", "drain_timeout_s", "ready_min_workers",
        "vllm_connector", "vllm_storage_path", "vllm_store_max_bytes", "vllm_store_max_age_s",
        "vllm_dtype", "vllm_control_timeout_s", "vllm_refresh_after_s",
    )
}  # fmt: skip


class UsageError(Exception):
    """Invalid options: every problem, each naming its flag, variable or config key."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} errors:" + "".join(f"\n  {p}" for p in self.problems)
        super().__init__(text)


@dataclass(frozen=True, slots=True)
class Source:
    """Where a value came from, and how an error about it reads."""

    #: ``--port``, ``ENCDISAGG_PORT``, ``serve.toml: server.port``, or ``default``.
    label: str
    #: The config file's spelling of the key, for errors about a file's value.
    key: str | None = None
    path: str | None = None

    def line(self, message: str, field: str) -> str:
        """An error line about this value; ``message`` names the value ``field``."""
        if self.path is not None and self.key is not None:
            if message.startswith(f"{field} "):
                return f"{self.path}: {self.key}{message[len(field) :]}"
            return f"{self.path}: {self.key}: {message}"
        if self.label == "default":
            return message
        return f"{self.label}: {message}"


_DEFAULT: Final = Source("default")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    config: EncoderConfig
    settings: ServerSettings
    host: str
    port: int
    worker_class: str
    log_level: str
    log_format: LogFormat = "text"
    #: What was set, and where: canonical key -> its source's label.
    sources: tuple[tuple[str, str], ...] = ()

    def summary(self) -> list[str]:
        """A few lines saying what would serve, for ``--check``. Not async."""
        shown = f"[{self.host}]" if ":" in self.host else self.host
        config = self.config
        lines = [
            f"http://{shown}:{self.port} on {self.worker_class}, {self.settings.dp} "
            f"process(es); model {config.model} on {config.device} "
            f"(dtype {config.dtype or 'the model'}'s), transfer {config.transfer}; "
            f"log {self.log_level} as {self.log_format}"
        ]
        for key, label in self.sources:
            lines.append(f"{key} = {self._shown(key)}  ({label})")
        return lines

    def _shown(self, key: str) -> str:
        table, _, name = key.partition(".")
        if name == "api_key":
            return "(set)"
        if table == "encoder":
            return repr(getattr(self.config, name))
        if name in ("host", "port", "worker_class", "log_level", "log_format"):
            return repr(getattr(self, name))
        if name == "max_body_mb":
            return repr(self.settings.max_body_bytes // _MIB)
        if name == "devices":
            return repr(self.settings.worker_devices or self.config.device)
        return repr(getattr(self.settings, name, None))


def _gather(
    args: argparse.Namespace, environ: Mapping[str, str], problems: list[str]
) -> dict[str, tuple[Any, Source]]:
    """Every option set, by canonical key: flags over the environment over the file."""
    chosen: dict[str, tuple[Any, Source]] = {}
    path = getattr(args, "config", None) or environ.get(FLAGS[0].env) or None
    if path is not None:
        file = read_config_file(path)
        problems.extend(file.problems)
        for key, value in file.values.items():
            chosen[key] = (value, Source(f"{path}: {file.names[key]}", file.names[key], path))
    for flag in FLAGS:
        if flag.key is None:
            continue
        raw = getattr(args, flag.dest, None)
        source = Source(flag.flag)
        if raw is None:
            raw = environ.get(flag.env) or None
            source = Source(flag.env)
        if raw is None:
            continue
        try:
            value = flag.convert(raw)
        except ValueError as exc:
            problems.append(f"{source.label}: {exc}")
            chosen.pop(flag.key, None)  # checked no further: its error is said
            continue
        chosen[flag.key] = (value, source)
    for flag in FLAGS:
        _check_choice(flag, chosen, problems)
    return chosen


def _check_choice(flag: Flag, chosen: dict[str, tuple[Any, Source]], problems: list[str]) -> None:
    if not flag.choices or flag.key not in chosen:
        return
    value, source = chosen[flag.key]
    shown = value.lower() if isinstance(value, str) and flag.dest == "log_level" else value
    if shown not in flag.choices:
        name = flag.key.partition(".")[2]
        message = f"{name} must be one of {', '.join(flag.choices)}; got {value!r}"
        problems.append(source.line(message, name))
        del chosen[flag.key]
    elif shown != value:
        chosen[flag.key] = (shown, source)


def _encoder_config(
    chosen: dict[str, tuple[Any, Source]], problems: list[str]
) -> EncoderConfig | None:
    """The config of the ``encoder.*`` values, each checked on its own first."""
    values = {
        key.removeprefix("encoder."): entry
        for key, entry in chosen.items()
        if key.startswith("encoder.")
    }
    before = len(problems)
    for name, (value, source) in values.items():
        try:
            EncoderConfig(**{name: value})
        except BadRequestError as exc:
            problems.append(source.line(exc.message, name))
    if len(problems) > before:
        return None
    try:
        return EncoderConfig(**{name: value for name, (value, _source) in values.items()})
    except BadRequestError as exc:
        problems.append(exc.message)  # a rule between fields, not one field
        return None


def _check_model(model: str, source: Source) -> str | None:
    """Why ``model`` cannot load, before anything starts (folders are read), or None."""
    if model in BUILTIN_MODEL_NAMES or model in SERVER_MODEL_NAMES:
        return None
    if looks_like_hub_id(model):
        try:
            model = resolve_hub_model(model)  # the config keeps the id; workers resolve it too
        except BadRequestError as exc:
            return source.line(exc.message.removeprefix("model: "), "model")
    if not Path(model).is_dir():
        return source.line(not_a_model(model), "model")
    if not (Path(model) / "config.json").is_file():
        return source.line(f"model folder {model} has no config.json", "model")
    return None


def _get(chosen: dict[str, tuple[Any, Source]], key: str) -> tuple[Any, Source]:
    return chosen.get(key, (_DEFAULTS.get(key), _DEFAULT))


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeOptions:
    """The options ``args``, the environment (``ENCDISAGG_<FLAG>``) and the ``--config``
    file describe, in that order of precedence. Reads the file and model folders; not async.

    :raises UsageError: listing every invalid option, each naming where it was set.
    """
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    chosen = _gather(args, environ, problems)
    config = _encoder_config(chosen, problems)
    if config is not None:
        problem = _check_model(config.model, _get(chosen, "encoder.model")[1])
        if problem is not None:
            problems.append(problem)
    port, port_source = _get(chosen, "server.port")
    if not 0 <= port <= 65535:
        problems.append(port_source.line(f"port must be in [0, 65535]; got {port}", "port"))
    body_mb, body_source = _get(chosen, "server.max_body_mb")
    if body_mb < 1:
        problems.append(
            body_source.line(f"max_body_mb must be at least 1; got {body_mb}", "max_body_mb")
        )
    devices = None
    dp = _get(chosen, "server.dp")[0]
    if config is not None and not isinstance(dp, bool) and dp >= 1:
        devices = _devices(chosen, config, dp, problems)
        if devices is not None and dp == 1:
            config, devices = config.replace(device=devices[0]), None
    settings = _settings(chosen, devices, problems)
    if problems or config is None or settings is None:
        raise UsageError(problems)
    return ServeOptions(
        config,
        settings,
        _get(chosen, "server.host")[0],
        port,
        _get(chosen, "server.worker_class")[0],
        _get(chosen, "server.log_level")[0],
        _get(chosen, "server.log_format")[0],
        tuple((key, source.label) for key, (_value, source) in sorted(chosen.items())),
    )


def _settings(
    chosen: dict[str, tuple[Any, Source]],
    devices: tuple[str, ...] | None,
    problems: list[str],
) -> ServerSettings | None:
    """The ServerSettings of the ``server.*`` values (None if one is invalid)."""
    fields: dict[str, Any] = {}
    for name, key in _SETTINGS_KEYS.items():
        if key in chosen or key in _DEFAULTS:
            fields[name] = _get(chosen, key)[0]
    body_mb = _get(chosen, "server.max_body_mb")[0]
    fields["max_body_bytes"] = body_mb * _MIB if body_mb >= 1 else 1
    fields["worker_log_level"] = _get(chosen, "server.log_level")[0]
    fields["worker_log_format"] = _get(chosen, "server.log_format")[0]
    if isinstance(fields.get("allowed_peers"), list):
        fields["allowed_peers"] = tuple(fields["allowed_peers"])
    if "grpc_port" not in fields:
        fields.pop("grpc_host", None)
    else:
        from ..server._sglang._grpc_server import grpc_missing

        if (missing := grpc_missing()) is not None:
            problems.append(missing)
    before = len(problems)
    for name, value in fields.items():
        if name == "max_body_bytes":
            continue
        # Checked on its own (register_with only with the wire it needs, the vllm wire with
        # a storage path, which the full check below asks for): every error shows.
        alone = {name: value, **({"wire": "sglang"} if name == "register_with" else {})}
        if name == "wire":
            alone["vllm_storage_path"] = "."
        try:
            ServerSettings(**alone)
        except BadRequestError as exc:
            key = _SETTINGS_KEYS.get(name, f"server.{name}")
            problems.append(_get(chosen, key)[1].line(exc.message, name))
    if len(problems) > before:
        return None
    _advertise(chosen, fields, problems)
    fields["worker_devices"] = devices
    if len(problems) > before:
        return None
    try:
        return ServerSettings(**fields)
    except BadRequestError as exc:
        name = next((n for n in fields if exc.message.startswith(n)), "")
        key = _SETTINGS_KEYS.get(name, f"server.{name}")
        problems.append(_get(chosen, key)[1].line(exc.message, name))
        return None


def _advertise(
    chosen: dict[str, tuple[Any, Source]], fields: dict[str, Any], problems: list[str]
) -> None:
    """The URL ``register_with`` registers: this server's own ``http://HOST:PORT`` (the
    machine's name when bound to every address) unless given."""
    if "register_with" not in fields or "advertise_url" in fields:
        return
    host, port = _get(chosen, "server.host")[0], _get(chosen, "server.port")[0]
    if port == 0:
        source = _get(chosen, "server.register_with")[1]
        problems.append(source.line("give --advertise-url, or a --port other than 0", ""))
        return
    name = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    name = f"[{name}]" if ":" in name else name
    fields["advertise_url"] = f"http://{name}:{port}"


def _devices(
    chosen: dict[str, tuple[Any, Source]],
    config: EncoderConfig,
    dp: int,
    problems: list[str],
) -> tuple[str, ...] | None:
    """Each worker's device (``devices``, else ``cuda:RANK`` for a CUDA ``device``); with
    one worker, its device. Asks torch about CUDA only when a CUDA device is named."""
    listed, listed_source = _get(chosen, "server.devices")
    try:
        return tuple(worker_devices(config.device, dp, listed))
    except BadRequestError as exc:
        message = exc.message
        if message.startswith("devices"):
            source, name = listed_source, "devices"
        else:
            source, name = _get(chosen, "encoder.device")[1], "device"
        if message.startswith(("device: ", "devices: ")):
            message = message.partition(": ")[2]
            name = ""
        problems.append(source.line(message, name))
        return None
