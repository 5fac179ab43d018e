"""What one encoder publishes under the registry prefix: a strict, versioned JSON record."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Final

from .._errors import BadRequestError
from .._modality import Modality

__all__ = ["EncoderLoad", "EncoderRecord"]

#: The record format; a reader refuses other versions rather than guess.
RECORD_VERSION: Final = 1
#: Largest record accepted from the registry.
MAX_RECORD_BYTES: Final = 64 * 1024
_FIELDS: Final = frozenset(
    {
        "v",
        "url",
        "model",
        "modalities",
        "transfers",
        "capacity",
        "queue_depth",
        "staged_bytes",
        "draining",
    }
)


@dataclass(frozen=True, slots=True)
class EncoderLoad:
    """How busy an encoder is: the figures its record refreshes every few seconds."""

    #: Requests it holds (encoding, staged or being delivered).
    queue_depth: int = 0
    #: Bytes of embeddings staged and not yet delivered.
    staged_bytes: int = 0


def _count(value: object, name: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequestError(f"encoder record: {name} must be an integer >= {minimum}")
    return value


def _names(value: object, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise BadRequestError(f"encoder record: {name} must be a non-empty list of strings")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class EncoderRecord:
    """One encoder as the registry holds it.

    :ivar url: its HTTP base URL, ``http://host:port``.
    :ivar model: the model it serves (``EncoderConfig.model``).
    :ivar modalities: the modalities it encodes.
    :ivar transfers: the transfer kinds it delivers with (``"zmq"``, ``"mooncake"``).
    :ivar capacity: encodes it runs at once (batch size times workers): load is measured
        against it.
    :ivar draining: it is shutting down: it takes no new parts, and finishes those it has
        (its key is deleted next; a client does not fail over what it still delivers).
    """

    url: str
    model: str
    modalities: tuple[Modality, ...]
    transfers: tuple[str, ...]
    capacity: int
    load: EncoderLoad = field(default_factory=EncoderLoad)
    draining: bool = False

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise BadRequestError(f"encoder record: url must be http(s); got {self.url!r}")
        _count(self.capacity, "capacity", minimum=1)

    def with_load(self, load: EncoderLoad) -> EncoderRecord:
        return dataclasses.replace(self, load=load)

    def as_draining(self) -> EncoderRecord:
        return dataclasses.replace(self, draining=True)

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "v": RECORD_VERSION,
            "url": self.url,
            "model": self.model,
            "modalities": [m.value for m in self.modalities],
            "transfers": list(self.transfers),
            "capacity": self.capacity,
            "queue_depth": self.load.queue_depth,
            "staged_bytes": self.load.staged_bytes,
            "draining": self.draining,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> EncoderRecord:
        """Decode a record strictly. Not async.

        :raises BadRequestError: naming the field: unknown or missing fields, wrong types,
            another version, an oversized record.
        """
        if len(raw) > MAX_RECORD_BYTES:
            raise BadRequestError(f"encoder record: larger than {MAX_RECORD_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise BadRequestError("encoder record: not JSON") from None
        if not isinstance(body, dict):
            raise BadRequestError("encoder record: not a JSON object")
        if body.get("v") != RECORD_VERSION:
            raise BadRequestError(f"encoder record: version must be {RECORD_VERSION}")
        if set(body) != _FIELDS:
            odd = sorted(set(body) ^ _FIELDS)
            raise BadRequestError(f"encoder record: unknown or missing field {odd[0]!r}")
        url, model, draining = body["url"], body["model"], body["draining"]
        if not isinstance(draining, bool):
            raise BadRequestError("encoder record: draining must be true or false")
        if not isinstance(url, str) or not isinstance(model, str) or not model:
            raise BadRequestError("encoder record: url and model must be strings")
        modalities = tuple(
            Modality.parse(m, field="encoder record modalities")
            for m in _names(body["modalities"], "modalities")
        )
        return cls(
            url=url,
            model=model,
            modalities=modalities,
            transfers=_names(body["transfers"], "transfers"),
            capacity=_count(body["capacity"], "capacity", minimum=1),
            load=EncoderLoad(
                queue_depth=_count(body["queue_depth"], "queue_depth"),
                staged_bytes=_count(body["staged_bytes"], "staged_bytes"),
            ),
            draining=draining,
        )
