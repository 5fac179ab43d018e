"""How the server around the Encoder behaves: data parallelism, limits, probe bounds.

The ``vllm_*`` settings of ``--wire vllm`` are checked here too, without importing torch, so
the command line refuses a bad one before the model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Final

from .._devices import CANONICAL_DTYPES, check_device, check_dtype
from .._errors import ConfigError
from .._numbers import real, whole
from ..registry import parse_registry_url
from ._access import ApiKey, PeerAllowList

__all__ = ["ServerSettings", "canonical_dtype"]

#: The integer settings and their least value (``worker_restart_limit`` 0: never restart).
_COUNTS: Final = {
    "dp": 1,
    "max_body_bytes": 1,
    "worker_max_inflight": 1,
    "ready_min_workers": 1,
    "worker_restart_limit": 0,
    "vllm_store_max_bytes": 1,
    "registry_lease_ttl_s": 2,
}
#: vLLM's EC connectors this server produces for: shared storage, and the Mooncake push.
_VLLM_CONNECTORS: Final = ("example", "mooncake")

#: The dtype spellings this server writes files in: the floating dtypes but float64.
_VLLM_DTYPES: Final = tuple(name for name, dtype in CANONICAL_DTYPES.items() if dtype != "float64")


def canonical_dtype(name: str) -> str:
    """``name`` (any accepted spelling, ``torch.`` prefix allowed) as a torch attribute
    name (what vLLM's ``reserve`` and safetensors' header name): ``"bf16"`` ->
    ``"bfloat16"``. Not async.

    :raises ConfigError: for a name that is no floating dtype this server writes.
    """
    return check_dtype(name, "vllm_dtype", _VLLM_DTYPES) or name


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    """How the server around the Encoder behaves (the Encoder itself: ``EncoderConfig``).

    Invalid values raise :class:`~encdisagg.ConfigError` naming the field.
    """

    #: Data-parallel worker processes; 1 runs the Encoder in the server's own process.
    dp: int = 1
    #: Largest request body accepted; larger ones are answered 413.
    max_body_bytes: int = 256 * 1024 * 1024
    #: Bound on one health probe encode.
    health_timeout_s: float = 20.0
    #: Bound on starting the data-parallel workers (each loads its model).
    worker_start_timeout_s: float = 300.0
    #: How long a stopping worker may drain before it is terminated (``None``: the
    #: Encoder's ``shutdown_grace_s`` plus ``cleanup_timeout_s`` plus 5 s).
    worker_stop_timeout_s: float | None = None
    #: Event loop inside each worker: ``"asyncio"``, ``"trio"``, or ``None`` for the
    #: front's own.
    worker_backend: str | None = None
    #: Calls one worker runs at once; more wait in its queue.
    worker_max_inflight: int = 256
    #: Once the Encoder is open (and in every data-parallel worker), collect garbage and
    #: freeze what survived (``gc.freeze``), so the collector's full passes skip the
    #: model's and libraries' objects. ``encdisagg serve`` turns it on; off by default for
    #: an app embedded in someone else's process, whose heap is theirs.
    freeze_heap: bool = False
    #: Log level of the workers.
    worker_log_level: str = "info"
    #: Log lines of the workers: ``"text"`` or ``"json"`` (one object a line).
    worker_log_format: str = "text"
    #: The device of each data-parallel worker, in rank order (``"cuda:0"``, ``"cuda:1"``);
    #: ``None``: every worker uses the config's ``device``.
    worker_devices: tuple[str, ...] | None = None
    #: When set, every route except ``/health`` and ``/metrics`` requires
    #: ``Authorization: Bearer <api_key>`` (401 otherwise). Never shown in a repr.
    api_key: str | None = field(default=None, repr=False)
    #: When set, the hosts and networks (``"10.0.0.0/8"``, ``"prefill-0"``) that a
    #: ``/send`` or push destination may name; anything else is refused with 403.
    allowed_peers: tuple[str, ...] | None = None
    #: When set (``etcd://HOST:PORT/PREFIX``), the server registers itself there for
    #: clients that discover encoders (``EncoderClient(registry=...)``), under a lease of
    #: ``registry_lease_ttl_s`` and with its load refreshed every ``registry_refresh_s``.
    registry: str | None = None
    registry_lease_ttl_s: int = 5
    registry_refresh_s: float = 2.0
    #: When set, SGLang's ``SglangEncoder`` gRPC service (with ``grpc.health.v1`` and
    #: reflection) is served on this port beside HTTP (0: a free port); needs the ``grpc``
    #: extra. Its RPCs take the SGLang wire's bodies.
    grpc_port: int | None = None
    #: The address the gRPC server listens on (``encdisagg serve``: its ``--host``).
    grpc_host: str = "127.0.0.1"
    #: The HTTP routes' protocol: ``"encdisagg"`` (ours), or ``"sglang"``: SGLang 0.5.20's
    #: language side talks to this server as to its own encoder (its ``/encode`` bodies,
    #: its three transfer modes, its pickled ``EmbeddingData`` header frames), or
    #: ``"vllm"``: vLLM's disaggregated-encoder proxy calls ``/v1/chat/completions``
    #: (docs/vllm.md).
    wire: str = "encdisagg"
    #: With the sglang wire: SGLang's encoder bootstrap (``http://host:port``) this server
    #: registers itself with at startup (``POST /register_encoder_url``, retried) and
    #: unregisters from on shutdown.
    register_with: str | None = None
    #: The URL registered there (``encdisagg serve``: ``http://HOST:PORT`` of its own).
    advertise_url: str | None = None
    #: ``encdisagg serve``'s drain: once the first SIGINT/SIGTERM turned readiness false and
    #: withdrew the registry key, the listener stays open this long (0 allowed) while
    #: encodes are still admitted, so probes and load balancers see the 503 first.
    drain_delay_s: float = 5.0
    #: Bound on the drain: after the delay, the server waits for the requests it admitted
    #: (delivered, released or expired) at most this long, then closes.
    drain_timeout_s: float = 30.0
    #: Data parallel: ``/health/ready`` answers 200 while at least this many workers serve
    #: (all of them, when there are fewer).
    ready_min_workers: int = 1
    #: Data parallel: a worker that dies is restarted (with backoff) at most this many times
    #: within ``worker_restart_window_s``; then the front gives up on its rank (0: never).
    worker_restart_limit: int = 5
    worker_restart_window_s: float = 60.0
    #: With the vllm wire: the PD's EC connector, ``"example"`` (shared storage) or
    #: ``"mooncake"`` (push into the PD's registered buffers; needs transfer='mooncake').
    vllm_connector: str = "example"
    #: ``"example"``: the PD's ``shared_storage_path`` (each item's file goes beneath it).
    vllm_storage_path: str | None = None
    #: ``"example"``: the files this server wrote are swept, oldest first, beyond this many
    #: bytes, and once older than ``vllm_store_max_age_s``.
    vllm_store_max_bytes: int = 8 * 1024**3
    vllm_store_max_age_s: float = 3600.0
    #: ``"example"``: the dtype the files are written in (the PD's); ``None``: the Encoder's.
    vllm_dtype: str | None = None
    #: ``"mooncake"``: bound on each control exchange with the PD's shards.
    vllm_control_timeout_s: float = 30.0
    #: ``"mooncake"``: reservations older than this are refreshed before the write (the
    #: PD's own bound is twice this).
    vllm_refresh_after_s: float = 150.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _COUNTS:
                whole(f.name, value, least=_COUNTS[f.name], error=ConfigError)
            elif f.name == "drain_delay_s":
                real(f.name, value, least=0, finite=False, error=ConfigError)
            elif f.name.endswith("_s") and (value is not None or f.name != "worker_stop_timeout_s"):
                real(f.name, value, above=0, finite=False, error=ConfigError)
        if not isinstance(self.freeze_heap, bool):
            raise ConfigError(f"freeze_heap must be true or false; got {self.freeze_heap!r}")
        if self.worker_backend not in (None, "asyncio", "trio"):
            raise ConfigError(
                f"worker_backend must be asyncio, trio or null; got {self.worker_backend!r}"
            )
        if self.worker_log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ConfigError(f"worker_log_level is not a log level: {self.worker_log_level!r}")
        if self.worker_log_format not in ("text", "json"):
            raise ConfigError(
                f"worker_log_format must be text or json; got {self.worker_log_format!r}"
            )
        if self.worker_devices is not None:
            if len(self.worker_devices) != self.dp:
                raise ConfigError(
                    f"worker_devices lists {len(self.worker_devices)} device(s) for dp={self.dp}"
                )
            for device in self.worker_devices:
                check_device(device, "worker_devices")
        if self.api_key is not None:
            ApiKey(self.api_key)
        peers: object = self.allowed_peers
        # A lone string would otherwise be read as a list of one-character hosts.
        if isinstance(peers, str):
            raise ConfigError("allowed_peers must be a list of hosts or networks")
        if self.allowed_peers is not None:
            PeerAllowList.parse(self.allowed_peers)
        if self.registry is not None:
            parse_registry_url(self.registry)
        port = self.grpc_port
        if port is not None and whole("grpc_port", port, error=ConfigError) > 65535:
            raise ConfigError(f"grpc_port must be an integer in [0, 65535]; got {port!r}")
        if not isinstance(self.grpc_host, str) or not self.grpc_host:
            raise ConfigError("grpc_host must be a non-empty host name or address")
        if self.wire not in ("encdisagg", "sglang", "vllm"):
            raise ConfigError(f"wire must be encdisagg, sglang or vllm; got {self.wire!r}")
        self._check_vllm()
        for name in ("register_with", "advertise_url"):
            url: object = getattr(self, name)
            if url is not None and (
                not isinstance(url, str) or not url.startswith(("http://", "https://"))
            ):
                raise ConfigError(f"{name} must be an http(s):// URL; got {url!r}")
        if self.register_with is not None and self.wire != "sglang":
            raise ConfigError("register_with needs wire='sglang'")

    def _check_vllm(self) -> None:
        # The vllm_* values; their *_s bounds and byte budget are checked with the others'.
        if self.vllm_connector not in _VLLM_CONNECTORS:
            raise ConfigError(
                f"vllm_connector must be one of {', '.join(_VLLM_CONNECTORS)}; "
                f"got {self.vllm_connector!r}"
            )
        path: object = self.vllm_storage_path
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise ConfigError(f"vllm_storage_path must be a folder; got {path!r}")
        check_dtype(self.vllm_dtype, "vllm_dtype", _VLLM_DTYPES)
        if self.wire == "vllm" and self.vllm_connector == "example" and path is None:
            raise ConfigError(
                "vllm_storage_path is needed with vllm_connector='example': the folder the PD's "
                "ECExampleConnector reads (its shared_storage_path)"
            )
