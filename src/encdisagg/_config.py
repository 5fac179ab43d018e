"""Typed, frozen, strict configuration.

``EncoderConfig`` validates itself on construction; ``from_mapping`` and ``from_toml`` reject
unknown keys by name, so a typo in a deployment file fails loudly instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from ._devices import check_device, check_dtype
from ._errors import BadRequestError, ConfigError
from ._model_names import unknown_name_problem
from ._numbers import real

if TYPE_CHECKING:
    import msgspec

__all__ = ["EncoderConfig"]

TRANSFERS = ("zmq", "mooncake", "loopback")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
#: How image preprocessing runs: the fast ``uint8`` path on the CPU, transformers' processor
#: itself, or the fast path's kernels on the model's device.
PREPROCESS_MODES = ("fast", "reference", "device")


@functools.cache
def _types() -> type[msgspec.Struct]:
    """The config's fields as a Struct, for msgspec's strict check of every value's type."""
    import msgspec

    hints = typing.get_type_hints(EncoderConfig)
    fields = [(f.name, hints[f.name]) for f in dataclasses.fields(EncoderConfig)]
    return msgspec.defstruct("EncoderConfigTypes", fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class EncoderConfig:
    """Configuration of one :class:`~encdisagg.Encoder`.

    Construct it directly (keyword arguments), from a mapping with :meth:`from_mapping`, or from
    a TOML file with :meth:`from_toml`. Invalid values raise
    :class:`~encdisagg.ConfigError` naming the field.
    """

    #: A built-in model name (``"tiny"``, ``"tiny-qwen2.5-vl"``) or a local checkpoint folder.
    model: str = "tiny"
    #: How images (and video frames) are preprocessed: ``"fast"`` resizes in ``uint8`` with
    #: torch's antialiased kernels and patchifies and normalises in one pass (grids equal the
    #: processor's; pixel values within 0.05 of its); ``"reference"`` runs transformers'
    #: processor itself, bit for bit; ``"device"`` runs the fast path's kernels on the
    #: model's device (see docs/models.md).
    preprocess: str = "fast"
    #: How embeddings leave the encoder: ``"zmq"``, ``"mooncake"`` or ``"loopback"``.
    transfer: str = "zmq"
    #: Most requests of one modality fused into one forward.
    max_batch_size: int = 8
    #: Bound on waits for a request to exist, be staged, or publish its metadata.
    request_timeout_s: float = 180.0
    #: A staged embedding not fully delivered this long after staging is released.
    send_timeout_s: float = 180.0
    #: Size of the local prefix (embedding) cache; 0 turns it off.
    prefix_cache_mb: int = 0
    #: Bound on staged embedding bytes; over it ``encode`` answers 503. ``None``: unbounded.
    staged_memory_limit_mb: int | None = None
    #: Size of the staging arena, registered once with the transfer engine (with ``zmq``, a
    #: plain buffer); embeddings are staged into it without an allocation or a registration
    #: per request. ``None``: ``staged_memory_limit_mb`` if set, else 256. 0 turns it off
    #: (every request then stages its own tensor, registered when there is an engine).
    staging_arena_mb: int | None = None
    #: How many distinct destinations must receive a request before it is released.
    default_receive_count: int = 1
    #: On shutdown, how long transfers in flight may finish before they are cancelled.
    shutdown_grace_s: float = 30.0
    #: Bound on each shielded cleanup step (deregistration, drain of a transfer's tail).
    cleanup_timeout_s: float = 10.0
    #: How long an ``abandon`` for a not-yet-existing id is remembered.
    abandon_ttl_s: float = 60.0
    #: Bound on one ZMQ push (a slow or absent receiver fails the send after this).
    zmq_send_timeout_s: float = 30.0
    #: A ZMQ push socket no push used for this long is closed (its receiver may be gone).
    zmq_idle_timeout_s: float = 60.0
    #: ZMQ push sockets kept open at once; one more receiver closes the least recently used.
    zmq_max_endpoints: int = 128
    #: A ZMQ push to an endpoint that refused every connection attempt for this long fails
    #: then, not after ``zmq_send_timeout_s`` (a receiver that went away); ``None`` waits
    #: the whole send timeout (a receiver that binds late).
    zmq_refused_grace_s: float | None = 2.0
    #: The receivers' CURVE public key (Z85): every ZMQ push is then encrypted and
    #: authenticated, and reaches only a receiver holding the matching secret key.
    zmq_curve_server_key: str | None = None
    #: Per-receiver CURVE keys, ``"tcp://host:port KEY"`` each, winning over
    #: ``zmq_curve_server_key``. With any key set, nothing is pushed in the clear.
    zmq_curve_server_keys: tuple[str, ...] = field(default_factory=tuple)
    #: Jobs that may wait for the batcher before ``encode`` pushes back.
    max_queued_jobs: int = 1024
    #: Worker threads used for preprocessing.
    preprocess_threads: int = 2
    #: Torch dtype name of the model and its embeddings (``None``: the model's default).
    dtype: str | None = None
    #: Torch device the model runs on.
    device: str = "cpu"
    #: Mooncake transport: ``"tcp"`` or ``"rdma"``.
    mooncake_protocol: str = "tcp"
    #: Mooncake metadata: ``"P2PHANDSHAKE"`` or a metadata server URL.
    mooncake_metadata: str = "P2PHANDSHAKE"
    #: Host name the Mooncake engine advertises.
    mooncake_host: str = "127.0.0.1"
    #: RDMA device names for Mooncake (empty: auto).
    mooncake_device: str = ""
    #: How long a Mooncake write is checked once per event-loop turn before the engine's
    #: completion thread polls it (0: always the thread, for hosts whose cores are scarce).
    mooncake_poll_on_loop_s: float = 0.1
    #: Largest accepted media item, in bytes.
    max_media_bytes: int = 64 * 1024 * 1024
    #: Domains from which http(s) media may be fetched; empty disables remote media.
    remote_media_domains: tuple[str, ...] = field(default_factory=tuple)
    #: Whether media items may name local files. Turn off for servers facing untrusted
    #: clients, or a client can make the encoder read any file it can access.
    allow_local_files: bool = True
    #: Global embedding cache (Mooncake Store) URL; ``None`` turns it off.
    global_cache: str | None = None
    # Media and memory budgets, decided before anything is decoded (docs/security.md).
    #: Most items in one ``encode`` request; more is a 400 naming ``mm_items``.
    max_items_per_request: int = 128
    #: Most source pixels of one image or video frame, from its header: a JPEG over it is
    #: decoded reduced to fit, anything else is a 400. ``None``: four times the model's
    #: ``max_pixels``, and at least a 4K UHD frame (3840x2160).
    max_image_pixels: int | None = None
    #: Most pixels of one request's items as the model sees them (after its resize): a
    #: 400 past it; video frames are sampled, while decoding, to fit what is left.
    max_request_pixels: int = 16_777_216
    #: Longest audio item in seconds, from its header (and checked again while decoding):
    #: a 400 past it. ``None``: the model's window (30 s for Qwen2-Audio / Qwen2.5-Omni),
    #: which also caps any larger value.
    max_audio_seconds: float | None = None
    #: Highest sample rate of an audio item, in Hz, from its header: a 400 past it.
    max_audio_sample_rate: int = 192_000
    #: Most channels of an audio item, from its header (they are averaged to mono).
    max_audio_channels: int = 8
    #: Most seconds of all one request's audio items, from their headers: a 400 past it.
    max_request_audio_seconds: float = 600.0
    #: Bound on preprocessed inputs waiting for (or in) a forward, in MiB; while over it,
    #: new encodes answer 503 with ``Retry-After``. ``None``: unbounded.
    queued_memory_limit_mb: int | None = 256

    def __post_init__(self) -> None:
        from ._strict import convert  # msgspec loads when a config is built, not on import

        typed = convert(self, _types(), "config", ConfigError, from_attributes=True)
        for f in dataclasses.fields(self):
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, getattr(typed, f.name))
        for name, allowed in (
            ("transfer", TRANSFERS),
            ("mooncake_protocol", MOONCAKE_PROTOCOLS),
            ("preprocess", PREPROCESS_MODES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}"
                )
        if not self.model:
            raise ConfigError("model must be a non-empty name or path")
        unknown_model = unknown_name_problem(self.model)
        if unknown_model is not None:
            raise ConfigError(unknown_model)
        # Named here, not when the encoder opens: a typo fails where it was written.
        check_device(self.device)
        check_dtype(self.dtype)
        for name in (
            "max_batch_size",
            "default_receive_count",
            "max_queued_jobs",
            "preprocess_threads",
            "max_media_bytes",
            "zmq_max_endpoints",
            "max_items_per_request",
            "max_request_pixels",
            "max_audio_sample_rate",
            "max_audio_channels",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1; got {getattr(self, name)}")
        for name in (
            "request_timeout_s",
            "send_timeout_s",
            "cleanup_timeout_s",
            "abandon_ttl_s",
            "zmq_send_timeout_s",
            "zmq_idle_timeout_s",
        ):
            real(name, getattr(self, name), above=0, finite=False, error=ConfigError)
        if (grace := self.zmq_refused_grace_s) is not None:
            real("zmq_refused_grace_s", grace, least=0, finite=False, error=ConfigError)
        if self.zmq_curve_server_key is not None or self.zmq_curve_server_keys:
            try:
                self.zmq_push_options()  # a malformed key fails here, naming its field
            except BadRequestError as exc:
                raise ConfigError(exc.message) from None
        real("mooncake_poll_on_loop_s", self.mooncake_poll_on_loop_s, least=0, error=ConfigError)
        if self.prefix_cache_mb < 0:
            raise ConfigError(f"prefix_cache_mb must be 0 or more; got {self.prefix_cache_mb}")
        if self.staging_arena_mb is not None and self.staging_arena_mb < 0:
            raise ConfigError(
                f"staging_arena_mb must be 0 or more, or null; got {self.staging_arena_mb}"
            )
        for name in ("staged_memory_limit_mb", "max_image_pixels", "queued_memory_limit_mb"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1 or null; got {value}")
        if self.max_audio_seconds is not None:
            real("max_audio_seconds", self.max_audio_seconds, above=0, error=ConfigError)
        real(
            "max_request_audio_seconds", self.max_request_audio_seconds, above=0, error=ConfigError
        )

    @property
    def arena_bytes(self) -> int:
        """The staging arena's size in bytes (0: no arena)."""
        if self.staging_arena_mb is not None:
            return self.staging_arena_mb * 1024 * 1024
        if self.staged_memory_limit_mb is not None:
            return self.staged_memory_limit_mb * 1024 * 1024
        return 256 * 1024 * 1024

    def zmq_push_options(self) -> dict[str, Any]:
        """The :class:`~encdisagg.transfer.ZmqPushPool` options this config sets.

        :raises ConfigError: a malformed CURVE key, naming its field.
        """
        from .transfer._zmq._curve import curve_key, parse_server_keys

        server_key = self.zmq_curve_server_key
        return {
            "send_timeout_s": self.zmq_send_timeout_s,
            "idle_timeout_s": self.zmq_idle_timeout_s,
            "max_endpoints": self.zmq_max_endpoints,
            "refused_grace_s": self.zmq_refused_grace_s,
            "curve_server_key": None
            if server_key is None
            else curve_key(server_key, "zmq_curve_server_key"),
            "curve_server_keys": parse_server_keys(
                self.zmq_curve_server_keys, "zmq_curve_server_keys"
            ),
        }

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of every configuration field."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None = None, /, **overrides: Any) -> Self:
        """Build a config from a mapping (plus keyword overrides).

        :raises ConfigError: naming every unknown key and every invalid field at once
            (one per line after the first).
        """
        values = dict(mapping or {})
        values.update(overrides)
        if set(values) <= set(cls.field_names()):
            try:
                return cls(**values)
            except ConfigError:
                pass  # look for every problem, not just this first one
        raise ConfigError("\n".join(cls.problems(values)))

    @classmethod
    def problems(cls, values: Mapping[str, Any]) -> list[str]:
        """Every reason ``values`` is not a valid config: the unknown keys (one message),
        then each invalid field, checked on its own; empty when it is valid. Not async."""
        known = set(cls.field_names())
        unknown = sorted(str(key) for key in values if key not in known)
        problems = [f"unknown configuration key(s): {', '.join(unknown)}"] if unknown else []
        valid = {key: value for key, value in values.items() if key in known}
        before = len(problems)
        try:
            cls(**valid)
        except ConfigError as whole:
            for key, value in valid.items():
                try:
                    cls(**{key: value})
                except ConfigError as exc:
                    problems.append(exc.message)
            if len(problems) == before:
                problems.append(whole.message)  # a rule between fields, not one field
        return problems

    @classmethod
    def from_toml(cls, path: str | Path) -> Self:
        """Build a config from a TOML file; keys may sit at top level or under ``[encoder]``.

        :raises ConfigError: if the file is not valid TOML or holds unknown keys.
        """
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read configuration file {path}: {exc}") from exc
        section = data.get("encoder", data)
        if not isinstance(section, dict):
            raise ConfigError(f"[encoder] in {path} must be a table")
        return cls.from_mapping(section)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied (validated like a fresh config)."""
        return self.from_mapping(self.to_mapping(), **changes)

    def to_mapping(self) -> dict[str, Any]:
        """The config as a plain dict (round-trips through :meth:`from_mapping`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
