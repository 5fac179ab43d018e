"""The options of ``encdisagg serve``: each flag, its environment variable, its config key.

One table drives the three sources a value may come from: a flag (``--max-batch-size 16``),
an environment variable (``ENCDISAGG_MAX_BATCH_SIZE=16``) and the TOML file's key
(``encoder.max_batch_size``). Flags and variables arrive as text and are converted here, so a
value of the wrong kind is reported with the others instead of stopping the parse at the
first. The table also declares the flags on ``serve``'s parser, so each is written once.
Imports nothing heavy: the command line checks every value before torch loads.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Final, Literal

from .._config import PREPROCESS_MODES

__all__ = ["EXPECTED", "FLAGS", "SERVER_KEYS", "Flag", "fits"]

Kind = Literal["str", "int", "float", "bool", "list"]

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
    #: ``--help``'s name of the value (default: the choices, SECONDS for a float, the dest).
    metavar: str | None = None
    help: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def env(self) -> str:
        """``--max-batch-size`` is also ``ENCDISAGG_MAX_BATCH_SIZE``."""
        return "ENCDISAGG_" + self.dest.upper()

    def convert(self, value: object) -> Any:
        """``value`` (text from a flag or the environment; typed values pass) as this
        option's kind. Not async.

        :raises ValueError: naming the kind expected (the caller names the source).
        """
        if not isinstance(value, str) or self.kind == "str":
            return value
        text = value.strip()
        if self.kind == "list":
            return [entry.strip() for entry in text.split(",") if entry.strip()]
        if self.kind == "bool":
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
            raise ValueError(f"expected true or false (1/0, yes/no, on/off); got {value!r}")
        try:
            return int(text) if self.kind == "int" else float(text)
        except ValueError:
            raise ValueError(f"expected {EXPECTED[self.kind]}; got {value!r}") from None

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Declare this option on ``parser``: its value stays text until :meth:`convert`, so
        one wrong value does not hide the others. Not async."""
        if self.kind == "bool":
            action = argparse.BooleanOptionalAction
            parser.add_argument(self.flag, action=action, default=None, help=self.help)
            return
        choices = "{" + ",".join(self.choices) + "}" if self.choices else None
        seconds = "SECONDS" if self.kind == "float" else None
        parser.add_argument(self.flag, metavar=self.metavar or choices or seconds, help=self.help)


#: Every option of ``serve`` but ``--check``, in the order ``--help`` lists them.
FLAGS: Final[tuple[Flag, ...]] = (
    Flag("config", "str", None, metavar="FILE", help="TOML configuration file"),
    Flag("host", "str", "server.host", help="address to bind (default 127.0.0.1)"),
    Flag("port", "int", "server.port", help="port to bind; 0 picks a free one (default 8000)"),
    Flag("model", "str", "encoder.model",
         help="built-in model name (tiny, ...), 'null', or a folder"),
    Flag("transfer", "str", "encoder.transfer", ("zmq", "mooncake", "loopback")),
    Flag("mooncake_protocol", "str", "encoder.mooncake_protocol", ("tcp", "rdma")),
    Flag("mooncake_metadata", "str", "encoder.mooncake_metadata", metavar="URL",
         help="P2PHANDSHAKE or a URL"),
    Flag("dp", "int", "server.dp", help="data-parallel worker processes (default 1)"),
    Flag("device", "str", "encoder.device",
         help="where the model runs: cpu (default), cuda, cuda:1, mps, xpu..."),
    Flag("dtype", "str", "encoder.dtype",
         help="model dtype: bfloat16, float16, float32 or auto (the checkpoint's)"),
    Flag("preprocess", "str", "encoder.preprocess", PREPROCESS_MODES,
         help="images and video frames: fast (default; uint8 kernels on the CPU), reference "
         "(transformers' processor) or device (the fast kernels on --device)"),
    Flag("devices", "list", "server.devices", metavar="LIST",
         help="one device per --dp worker, comma-separated: 0,1 (indexes of --device's type, "
         "CUDA by default) or cuda:0,cuda:1; default with --device cuda: cuda:RANK"),
    Flag("max_batch_size", "int", "encoder.max_batch_size"),
    Flag("request_timeout", "float", "encoder.request_timeout_s"),
    Flag("send_timeout", "float", "encoder.send_timeout_s"),
    Flag("prefix_cache_mb", "int", "encoder.prefix_cache_mb"),
    Flag("staged_memory_limit_mb", "int", "encoder.staged_memory_limit_mb"),
    Flag("global_cache", "str", "encoder.global_cache", metavar="URL",
         help="global embedding cache: mooncake://MASTER:PORT?metadata=URL[&...] (docs/cache.md)"),
    Flag("max_body_mb", "int", "server.max_body_mb", help="largest request body (default 256)"),
    Flag("health_timeout", "float", "server.health_timeout_s"),
    Flag("freeze_heap", "bool", "server.freeze_heap",
         help="once the model is loaded, freeze what is alive (gc.freeze) so the garbage "
         "collector's full passes skip it (default on)"),
    Flag("worker_class", "str", "server.worker_class", ("asyncio", "trio"), help="event loop"),
    Flag("api_key", "str", "server.api_key", metavar="KEY",
         help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
         "(default: $ENCDISAGG_API_KEY, else none)"),
    Flag("allowed_peers", "list", "server.allowed_peers", metavar="HOSTS",
         help="comma-separated hosts and networks a /send or receive URL may name "
         "(403 otherwise)"),
    Flag("log_level", "str", "server.log_level", ("debug", "info", "warning", "error", "critical")),
    Flag("log_format", "str", "server.log_format", ("text", "json"),
         help="log lines as text or one JSON object each (default text); both carry req_id"),
    Flag("registry", "str", "server.registry", metavar="URL",
         help="register in an encoder fleet: etcd://HOST:PORT/PREFIX (docs/scaling.md)"),
    Flag("registry_lease_ttl", "int", "server.registry_lease_ttl_s", metavar="SECONDS",
         help="the registry lease: how long a dead server stays routable at most (default 5)"),
    Flag("grpc_port", "int", "server.grpc_port", metavar="PORT",
         help="also serve SGLang's SglangEncoder gRPC service (with health and reflection) on "
         "--host:PORT; 0 picks a free one (needs the grpc extra; docs/sglang.md)"),
    Flag("wire", "str", "server.wire", ("encdisagg", "sglang", "vllm"),
         help="the routes' protocol: ours (default), or sglang: SGLang 0.5.20's language side "
         "uses this server as its encoder (--encoder-urls; docs/sglang.md), or vllm: vLLM's "
         "disaggregated-encoder proxy does (docs/vllm.md)"),
    Flag("register_with", "str", "server.register_with", metavar="URL",
         help="with --wire sglang: register with SGLang's encoder bootstrap at URL at startup "
         "(retried) and unregister on shutdown"),
    Flag("advertise_url", "str", "server.advertise_url", metavar="URL",
         help="the URL --register-with registers (default http://HOST:PORT of this server)"),
    Flag("drain_delay", "float", "server.drain_delay_s",
         help="on SIGTERM: keep serving (readiness 503) this long before refusing new encodes "
         "(default 5; 0 allowed)"),
    Flag("drain_timeout", "float", "server.drain_timeout_s",
         help="on SIGTERM: after the delay, wait at most this long for admitted requests to be "
         "delivered, released or expired (default 30)"),
    Flag("ready_min_workers", "int", "server.ready_min_workers", metavar="N",
         help="with --dp: /health/ready answers 200 while at least N workers serve (default 1)"),
    Flag("vllm_connector", "str", "server.vllm_connector", ("example", "mooncake"),
         help="with --wire vllm: the PD's EC connector: example (shared storage, default) or "
         "mooncake (push into the PD's buffers; needs --transfer mooncake)"),
    Flag("vllm_storage_path", "str", "server.vllm_storage_path", metavar="DIR",
         help="with --vllm-connector example: the PD's shared_storage_path"),
    Flag("vllm_store_max_bytes", "int", "server.vllm_store_max_bytes", metavar="BYTES",
         help="with --vllm-connector example: sweep the oldest files beyond this many bytes "
         "(default 8 GiB)"),
    Flag("vllm_store_max_age", "float", "server.vllm_store_max_age_s",
         help="with --vllm-connector example: sweep files older than this (default 3600)"),
    Flag("vllm_dtype", "str", "server.vllm_dtype", metavar="DTYPE",
         help="with --vllm-connector example: the files' dtype, the PD's (default: --dtype's)"),
    Flag("vllm_control_timeout", "float", "server.vllm_control_timeout_s",
         help="with --vllm-connector mooncake: bound on each control exchange (default 30)"),
    Flag("vllm_refresh_after", "float", "server.vllm_refresh_after_s",
         help="with --vllm-connector mooncake: refresh reservations older than this before "
         "writing (default 150)"),
)  # fmt: skip

#: The ``[server]`` table's keys and their kinds.
SERVER_KEYS: Final[dict[str, Kind]] = {
    flag.key.removeprefix("server."): flag.kind
    for flag in FLAGS
    if flag.key is not None and flag.key.startswith("server.")
}

#: How an error names each kind: ``"an integer"``.
EXPECTED: Final[dict[Kind, str]] = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "list": "a list of strings",
}


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
