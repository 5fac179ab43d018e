"""``encdisagg serve``: resolve the flags and the TOML file, then serve until a signal.

The flags are declared in ``encdisagg._cli`` (so ``--help`` stays fast); this module turns
them into an :class:`~encdisagg.EncoderConfig` and :class:`ServerSettings`, and runs the
server. Invalid options exit with status 2 and a message naming the flag or field.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc

from .._config import EncoderConfig
from .._devices import worker_devices
from .._errors import BadRequestError
from ..models import BUILTIN_MODELS
from ..models._hub import looks_like_hub_id, resolve_hub_model
from ._access import is_loopback_host
from ._app import create_app
from ._backend import SERVER_MODELS
from ._grpc_serving import grpc_url
from ._logs import LOG_FORMATS, LogFormat, configure_logging
from ._malloc import return_large_frees_to_the_os
from ._noise import quiet_third_party
from ._registered import ServerRegistration
from ._runner import serve
from ._settings import ServerSettings
from ._startup import describe_startup_failure

__all__ = ["run_serve"]

_log = logging.getLogger("encdisagg.server")

_MIB: Final = 1024 * 1024

#: ``serve`` flag (argparse dest) -> EncoderConfig field.
CONFIG_FLAGS: Final = {
    "model": "model",
    "transfer": "transfer",
    "mooncake_protocol": "mooncake_protocol",
    "mooncake_metadata": "mooncake_metadata",
    "max_batch_size": "max_batch_size",
    "request_timeout": "request_timeout_s",
    "send_timeout": "send_timeout_s",
    "prefix_cache_mb": "prefix_cache_mb",
    "staged_memory_limit_mb": "staged_memory_limit_mb",
    "global_cache": "global_cache",
    "device": "device",
    "dtype": "dtype",
}
#: Keys of the TOML file's ``[server]`` table, and their types.
SERVER_KEYS: Final[dict[str, type | tuple[type, ...]]] = {
    "host": str,
    "port": int,
    "grpc_port": int,
    "dp": int,
    "worker_class": str,
    "log_level": str,
    "log_format": str,
    "max_body_mb": int,
    "health_timeout_s": (int, float),
    "api_key": str,
    "allowed_peers": list,
    "registry": str,
    "registry_lease_ttl_s": int,
    "wire": str,
    "register_with": str,
    "advertise_url": str,
    "devices": list,
    "freeze_heap": bool,
}
_DEFAULTS: Final[dict[str, Any]] = {
    "host": "127.0.0.1",
    "port": 8000,
    "dp": 1,
    "worker_class": "asyncio",
    "log_level": "info",
    "log_format": "text",
    "max_body_mb": 256,
    "health_timeout_s": 20.0,
    # The server owns its process: its heap is frozen once the Encoder is open.
    "freeze_heap": True,
}
_LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
#: The environment variable ``--api-key`` falls back to (keeps the key out of ``ps``).
API_KEY_ENV: Final = "ENCDISAGG_API_KEY"


class UsageError(Exception):
    """An invalid option; the message names it."""


@dataclass(frozen=True, slots=True)
class ServeOptions:
    config: EncoderConfig
    settings: ServerSettings
    host: str
    port: int
    worker_class: str
    log_level: str
    log_format: LogFormat = "text"


def _flag(field: str) -> str:
    for dest, name in CONFIG_FLAGS.items():
        if name == field:
            return "--" + dest.replace("_", "-")
    return field


def _read_toml(path: str) -> tuple[EncoderConfig, dict[str, Any]]:
    """The ``[encoder]`` config and the ``[server]`` table of the file at ``path``.

    :raises UsageError: listing every error of the file at once, one per line.
    """
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"--config: cannot read {path}: {exc}") from None
    problems: list[str] = []
    server = data.pop("server", {})
    if not isinstance(server, dict):
        problems.append("[server] must be a table")
        server = {}
    problems.extend(f"unknown key server.{key}" for key in sorted(server) if key not in SERVER_KEYS)
    for key, value in server.items():
        expected = SERVER_KEYS.get(key)
        if expected is None:
            continue
        # bool is an int subclass: only a bool key takes true or false.
        fits = (
            isinstance(value, bool)
            if expected is bool
            else not isinstance(value, bool) and isinstance(value, expected)
        )
        if not fits:
            problems.append(f"server.{key} has the wrong type")
    section = data.get("encoder", data)
    if "encoder" in data:
        # Beside an [encoder] table, anything else at top level is a misspelt table.
        problems.extend(f"unknown table or key {key}" for key in sorted(data) if key != "encoder")
    if not isinstance(section, dict):
        problems.append("[encoder] must be a table")
        section = {}
    problems.extend(
        f"[encoder] {problem}" if "encoder" in data else problem
        for problem in EncoderConfig.problems(section)
    )
    if len(problems) == 1:
        raise UsageError(f"--config: {path}: {problems[0]}")
    if problems:
        listed = "".join(f"\n  {problem}" for problem in problems)
        raise UsageError(f"--config: {path} has {len(problems)} errors:{listed}")
    return EncoderConfig.from_mapping(section), server


def resolve(args: argparse.Namespace) -> ServeOptions:
    """The options ``args`` (and its ``--config`` file) describe; flags win over the file.

    :raises UsageError: naming the flag or field that is invalid.
    """
    config = EncoderConfig()
    server: dict[str, Any] = {}
    if args.config is not None:
        config, server = _read_toml(args.config)
    overrides = {
        field: getattr(args, dest)
        for dest, field in CONFIG_FLAGS.items()
        if getattr(args, dest, None) is not None
    }
    try:
        config = config.replace(**overrides)
    except BadRequestError as exc:
        field = next((name for name in overrides if exc.message.startswith(name)), None)
        prefix = f"{_flag(field)}: " if field else ""
        raise UsageError(f"{prefix}{exc.message}") from None
    options = dict(_DEFAULTS)
    options.update(server)
    for key in ("host", "port", "dp", "worker_class", "log_level", "log_format", "max_body_mb"):
        value = getattr(args, key, None)
        if value is not None:
            options[key] = value
    if getattr(args, "health_timeout", None) is not None:
        options["health_timeout_s"] = args.health_timeout
    if getattr(args, "freeze_heap", None) is not None:
        options["freeze_heap"] = args.freeze_heap
    if not 0 <= options["port"] <= 65535:
        raise UsageError(f"--port must be in [0, 65535]; got {options['port']}")
    if options["worker_class"] not in ("asyncio", "trio"):
        raise UsageError(f"--worker-class must be asyncio or trio; got {options['worker_class']!r}")
    if str(options["log_level"]).lower() not in _LOG_LEVELS:
        raise UsageError(f"--log-level must be one of {', '.join(_LOG_LEVELS)}")
    if options["log_format"] not in LOG_FORMATS:
        raise UsageError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    model = config.model
    builtin = model in BUILTIN_MODELS or model in SERVER_MODELS
    if not builtin and looks_like_hub_id(model):
        try:
            model = resolve_hub_model(model)  # the config keeps the id; workers resolve it too
        except BadRequestError as exc:
            raise UsageError(f"--model: {exc.message.removeprefix('model: ')}") from None
    if not builtin and not Path(model).is_dir():
        known = ", ".join((*BUILTIN_MODELS, *SERVER_MODELS))
        raise UsageError(
            f"--model: {model!r} is neither a built-in model ({known}), a checkpoint folder, "
            "nor a Hugging Face id (ORG/NAME) in the local cache"
        )
    # Checked here, before any worker process starts, so the user reads this one line.
    if not builtin and not (Path(model) / "config.json").is_file():
        raise UsageError(f"--model: model folder {model} has no config.json")
    config, devices = _device_options(args, server, config, options["dp"])
    api_key, allowed_peers = _access_options(args, server)
    try:
        settings = ServerSettings(
            api_key=api_key,
            allowed_peers=allowed_peers,
            dp=options["dp"],
            max_body_bytes=options["max_body_mb"] * _MIB
            if isinstance(options["max_body_mb"], int) and options["max_body_mb"] > 0
            else options["max_body_mb"],
            health_timeout_s=options["health_timeout_s"],
            freeze_heap=options["freeze_heap"],
            worker_log_level=str(options["log_level"]).lower(),
            worker_log_format=options["log_format"],
            worker_devices=devices,
            **_registry_options(args, server),
            **_sglang_options(args, server, options["host"], options["port"]),
            **_grpc_options(args, server, options["host"]),
        )
    except BadRequestError as exc:
        flags = {
            "dp": "--dp",
            "max_body_bytes": "--max-body-mb",
            "health": "--health-timeout",
            "api_key": "--api-key",
            "allowed_peers": "--allowed-peers",
            "registry_lease_ttl_s": "--registry-lease-ttl",
            "registry": "--registry",
            "wire": "--wire",
            "register_with": "--register-with",
            "advertise_url": "--advertise-url",
            "grpc_port": "--grpc-port",
            "grpc_host": "--host",
        }
        flag = next((f for key, f in flags.items() if exc.message.startswith(key)), "")
        raise UsageError(f"{flag}: {exc.message}" if flag else exc.message) from None
    return ServeOptions(
        config,
        settings,
        options["host"],
        options["port"],
        options["worker_class"],
        str(options["log_level"]).lower(),
        options["log_format"],
    )


def _device_options(
    args: argparse.Namespace, server: dict[str, Any], config: EncoderConfig, dp: object
) -> tuple[EncoderConfig, tuple[str, ...] | None]:
    """``config`` on its device and, with several workers, each worker's device
    (``--devices 0,1``, else ``server.devices``, else ``cuda:RANK`` for ``--device cuda``).
    Asks torch about CUDA only when a CUDA device is named.

    :raises UsageError: naming ``--device`` or ``--devices``.
    """
    listed: Any = getattr(args, "devices", None)
    if isinstance(listed, str):
        listed = [entry.strip() for entry in listed.split(",") if entry.strip()]
    elif listed is None:
        listed = server.get("devices")
        if listed is not None and not all(isinstance(entry, str) for entry in listed):
            raise UsageError('--config: server.devices must be a list of strings ("0", "cuda:1")')
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        return config, None  # ServerSettings names --dp
    try:
        chosen = worker_devices(config.device, dp, listed)
    except BadRequestError as exc:
        flag = "--devices" if exc.message.startswith("devices") else "--device"
        message = exc.message
        if message.startswith(("device: ", "devices: ")):
            message = message.partition(": ")[2]
        raise UsageError(f"{flag}: {message}") from None
    if dp == 1:
        return config.replace(device=chosen[0]), None
    return config, chosen


def _access_options(
    args: argparse.Namespace, server: dict[str, Any]
) -> tuple[str | None, tuple[str, ...] | None]:
    """The API key (``--api-key``, else ``$ENCDISAGG_API_KEY``, else ``server.api_key``) and
    the allowed peers (``--allowed-peers a,b``, else ``server.allowed_peers``)."""
    api_key = getattr(args, "api_key", None)
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or server.get("api_key")
    peers: Any = getattr(args, "allowed_peers", None)
    if isinstance(peers, str):
        peers = [entry.strip() for entry in peers.split(",") if entry.strip()]
    elif peers is None:
        peers = server.get("allowed_peers")
    return api_key, None if peers is None else tuple(peers)


def _registry_options(args: argparse.Namespace, server: dict[str, Any]) -> dict[str, Any]:
    """``--registry`` / ``server.registry`` and the lease TTL, as ServerSettings fields."""
    options: dict[str, Any] = {}
    registry = getattr(args, "registry", None) or server.get("registry")
    if registry is not None:
        options["registry"] = registry
    ttl = getattr(args, "registry_lease_ttl", None) or server.get("registry_lease_ttl_s")
    if ttl is not None:
        options["registry_lease_ttl_s"] = ttl
    return options


def _grpc_options(args: argparse.Namespace, server: dict[str, Any], host: str) -> dict[str, Any]:
    """``--grpc-port`` / ``server.grpc_port`` (served on ``host``), as ServerSettings fields.

    :raises UsageError: when a package of the ``grpc`` extra is missing.
    """
    port = getattr(args, "grpc_port", None)
    if port is None:
        port = server.get("grpc_port")
    if port is None:
        return {}
    from ._grpc import grpc_missing

    problem = grpc_missing()
    if problem is not None:
        raise UsageError(problem)
    return {"grpc_port": port, "grpc_host": host}


def _sglang_options(
    args: argparse.Namespace, server: dict[str, Any], host: str, port: int
) -> dict[str, Any]:
    """``--wire``, ``--register-with`` and ``--advertise-url`` (or the ``[server]`` keys of
    those names), as ServerSettings fields. The advertised URL defaults to this server's
    own ``http://HOST:PORT`` (the machine's name when bound to every address).

    :raises UsageError: registering a server whose port is picked at random.
    """
    options: dict[str, Any] = {}
    for key in ("wire", "register_with", "advertise_url"):
        value = getattr(args, key, None)
        if value is None:
            value = server.get(key)
        if value is not None:
            options[key] = value
    if "register_with" in options and "advertise_url" not in options:
        if port == 0:
            raise UsageError("--register-with: give --advertise-url, or a --port other than 0")
        name = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        name = f"[{name}]" if ":" in name else name
        options["advertise_url"] = f"http://{name}:{port}"
    return options


def warn_if_exposed(host: str, settings: ServerSettings) -> bool:
    """Log a warning if ``host`` is reachable from other machines and no API key is set;
    whether it warned. Not async."""
    if settings.api_key is not None or is_loopback_host(host):
        return False
    _log.warning(
        "serving on %s without an API key: anyone who can reach this port may encode, send "
        "and release any request; set --api-key or %s",
        host,
        API_KEY_ENV,
    )
    return True


async def _watch_signals(
    stop: anyio.Event,
    force: anyio.CancelScope,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            if not stop.is_set():
                _log.info("got %s: shutting down gracefully", signal.Signals(signum).name)
                stop.set()
            else:
                _log.warning("got %s again: stopping now", signal.Signals(signum).name)
                force.cancel()


def _announce(url: str) -> None:
    print(f"encdisagg serving on {url}", flush=True)


async def _main(options: ServeOptions) -> None:
    config = options.config
    settings = options.settings
    app = create_app(config, settings=settings, flavour=options.worker_class)  # type: ignore[arg-type]
    stop = anyio.Event()
    drain_s = config.shutdown_grace_s + config.cleanup_timeout_s
    # Registered once serving; on a drain its key goes first, then Hypercorn drains.
    service = app.extensions["encdisagg"]
    registration = ServerRegistration(settings, config, service)

    async def drain_begins() -> None:
        await stop.wait()
        service.start_draining()

    def on_serving(url: str) -> None:
        _announce(url)
        grpc = grpc_url(service)
        if grpc is not None:
            print(f"encdisagg gRPC serving on {grpc}", flush=True)
        registration.on_serving(url)

    async with anyio.create_task_group() as group, registration:
        await group.start(_watch_signals, stop, group.cancel_scope)
        await serve(
            app,
            host=options.host,
            port=options.port,
            shutdown_trigger=lambda: registration.drain_after(drain_begins),
            on_serving=on_serving,
            graceful_timeout_s=config.shutdown_grace_s,
            startup_timeout_s=settings.worker_start_timeout_s + 60.0,
            shutdown_timeout_s=2 * drain_s + 30.0,
        )
        group.cancel_scope.cancel()


def run_serve(args: argparse.Namespace) -> int:
    """The ``serve`` subcommand: 0 after a graceful shutdown, 2 for invalid options, 1 if
    the server could not start."""
    try:
        options = resolve(args)
    except UsageError as exc:
        print(f"encdisagg serve: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(options.log_level, options.log_format)
    quiet_third_party(options.log_level)
    warn_if_exposed(options.host, options.settings)
    # Before anything large is allocated: freed bodies and images go back to the system.
    return_large_frees_to_the_os()
    try:
        anyio.run(_main, options, backend=options.worker_class)
    except (Exception, BaseExceptionGroup) as exc:
        if isinstance(exc, BaseExceptionGroup) and exc.split(Exception)[0] is None:
            raise  # only KeyboardInterrupt or SystemExit inside: not a startup failure
        _log.debug("the server failed", exc_info=exc)
        cause = describe_startup_failure(exc, host=options.host, port=options.port)
        print(f"encdisagg serve: error: {cause}", file=sys.stderr)
        return 1
    return 0
