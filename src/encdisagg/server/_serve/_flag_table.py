"""The options of ``encdisagg serve``: each flag, its environment variable, its config key.

One table drives the three sources a value may come from: a flag (``--max-batch-size 16``),
an environment variable (``ENCDISAGG_MAX_BATCH_SIZE=16``) and the TOML file's key
(``encoder.max_batch_size``). Flags and variables arrive as text and are converted here, so a
value of the wrong kind is reported with the others instead of stopping the parse at the
first. Imports nothing heavy: the command line checks every value before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = ["ENV_PREFIX", "FLAGS", "SERVER_KEYS", "Flag", "expected", "fits"]

Kind = Literal["str", "int", "float", "bool", "list"]

#: ``--max-batch-size`` is also ``ENCDISAGG_MAX_BATCH_SIZE``.
ENV_PREFIX: Final = "ENCDISAGG_"

_TRUE: Final = ("1", "true", "yes", "on")
_FALSE: Final = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class Flag:
    """One ``serve`` option."""

    #: The argparse destination (``max_batch_size`` for ``--max-batch-size``).
    dest: str
    kind: Kind
    #: The config key: ``encoder.FIELD`` or ``server.KEY``; ``None``: no key (``--config``).
    key: str | None
    #: The values allowed, if a fixed set.
    choices: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    def convert(self, value: object) -> Any:
        """``value`` (text from a flag or the environment; typed values pass) as this
        option's kind. Not async.

        :raises ValueError: naming the kind expected (the caller names the source).
        """
        if not isinstance(value, str):
            return value
        text = value.strip()
        if self.kind == "int":
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"expected an integer; got {value!r}") from None
        if self.kind == "float":
            try:
                return float(text)
            except ValueError:
                raise ValueError(f"expected a number; got {value!r}") from None
        if self.kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(f"expected true or false (1/0, yes/no, on/off); got {value!r}")
        if self.kind == "list":
            return [entry.strip() for entry in text.split(",") if entry.strip()]
        return value


#: Every option of ``serve`` but ``--check``, in the order ``--help`` lists them.
FLAGS: Final[tuple[Flag, ...]] = (
    Flag("config", "str", None),
    Flag("host", "str", "server.host"),
    Flag("port", "int", "server.port"),
    Flag("model", "str", "encoder.model"),
    Flag("transfer", "str", "encoder.transfer", ("zmq", "mooncake", "loopback")),
    Flag("mooncake_protocol", "str", "encoder.mooncake_protocol", ("tcp", "rdma")),
    Flag("mooncake_metadata", "str", "encoder.mooncake_metadata"),
    Flag("dp", "int", "server.dp"),
    Flag("device", "str", "encoder.device"),
    Flag("dtype", "str", "encoder.dtype"),
    Flag("devices", "list", "server.devices"),
    Flag("max_batch_size", "int", "encoder.max_batch_size"),
    Flag("request_timeout", "float", "encoder.request_timeout_s"),
    Flag("send_timeout", "float", "encoder.send_timeout_s"),
    Flag("prefix_cache_mb", "int", "encoder.prefix_cache_mb"),
    Flag("staged_memory_limit_mb", "int", "encoder.staged_memory_limit_mb"),
    Flag("global_cache", "str", "encoder.global_cache"),
    Flag("max_body_mb", "int", "server.max_body_mb"),
    Flag("health_timeout", "float", "server.health_timeout_s"),
    Flag("freeze_heap", "bool", "server.freeze_heap"),
    Flag("worker_class", "str", "server.worker_class", ("asyncio", "trio")),
    Flag("api_key", "str", "server.api_key"),
    Flag("allowed_peers", "list", "server.allowed_peers"),
    Flag("log_level", "str", "server.log_level", ("debug", "info", "warning", "error", "critical")),
    Flag("log_format", "str", "server.log_format", ("text", "json")),
    Flag("registry", "str", "server.registry"),
    Flag("registry_lease_ttl", "int", "server.registry_lease_ttl_s"),
    Flag("grpc_port", "int", "server.grpc_port"),
    Flag("wire", "str", "server.wire", ("encdisagg", "sglang", "vllm")),
    Flag("register_with", "str", "server.register_with"),
    Flag("advertise_url", "str", "server.advertise_url"),
    Flag("drain_delay", "float", "server.drain_delay_s"),
    Flag("drain_timeout", "float", "server.drain_timeout_s"),
    Flag("ready_min_workers", "int", "server.ready_min_workers"),
    Flag("vllm_connector", "str", "server.vllm_connector", ("example", "mooncake")),
    Flag("vllm_storage_path", "str", "server.vllm_storage_path"),
    Flag("vllm_store_max_bytes", "int", "server.vllm_store_max_bytes"),
    Flag("vllm_store_max_age", "float", "server.vllm_store_max_age_s"),
    Flag("vllm_dtype", "str", "server.vllm_dtype"),
    Flag("vllm_control_timeout", "float", "server.vllm_control_timeout_s"),
    Flag("vllm_refresh_after", "float", "server.vllm_refresh_after_s"),
)

#: The ``[server]`` table's keys and their kinds.
SERVER_KEYS: Final[dict[str, Kind]] = {
    flag.key.removeprefix("server."): flag.kind
    for flag in FLAGS
    if flag.key is not None and flag.key.startswith("server.")
}

_EXPECTED: Final[dict[Kind, str]] = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "list": "a list of strings",
}


def expected(kind: Kind) -> str:
    """How an error names the kind: ``"an integer"``. Not async."""
    return _EXPECTED[kind]


def fits(kind: Kind, value: object) -> bool:
    """Whether a TOML value is of ``kind`` (a boolean is never a number). Not async."""
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float))
    if kind == "list":
        return isinstance(value, list) and all(isinstance(entry, str) for entry in value)
    return isinstance(value, str)
