"""What one encoder publishes under the registry prefix: a strict, versioned JSON record."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Final

import msgspec

from .. import _strict
from .._errors import BadRequestError
from .._modality import Modality
from .._numbers import whole

__all__ = ["EncoderLoad", "EncoderRecord"]

#: The record format; a reader refuses other versions rather than guess.
RECORD_VERSION: Final = 1
#: Largest record accepted from the registry.
MAX_RECORD_BYTES: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class EncoderLoad:
    """How busy an encoder is: the figures its record refreshes every few seconds."""

    #: Requests it holds (encoding, staged or being delivered).
    queue_depth: int = 0
    #: Bytes of embeddings staged and not yet delivered.
    staged_bytes: int = 0


_Names = Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class _Wire(_strict.Message, frozen=True):
    """The record as JSON: exactly these fields."""

    v: int
    url: str
    model: Annotated[str, msgspec.Meta(min_length=1)]
    modalities: _Names
    transfers: _Names
    capacity: Annotated[int, msgspec.Meta(ge=1)]
    queue_depth: _Count
    staged_bytes: _Count
    draining: bool

    def __post_init__(self) -> None:
        if self.v != RECORD_VERSION:
            raise ValueError(f"version must be {RECORD_VERSION}; got {self.v}")


_DECODER: Final = msgspec.json.Decoder(_Wire)


def _error(message: str) -> BadRequestError:
    return BadRequestError(f"encoder record: {message}")


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
        whole("encoder record: capacity", self.capacity, least=1, error=BadRequestError)

    def with_load(self, load: EncoderLoad) -> EncoderRecord:
        return dataclasses.replace(self, load=load)

    def as_draining(self) -> EncoderRecord:
        return dataclasses.replace(self, draining=True)

    def to_json(self) -> bytes:
        return msgspec.json.encode(
            _Wire(
                v=RECORD_VERSION,
                url=self.url,
                model=self.model,
                modalities=tuple(m.value for m in self.modalities),
                transfers=self.transfers,
                capacity=self.capacity,
                queue_depth=self.load.queue_depth,
                staged_bytes=self.load.staged_bytes,
                draining=self.draining,
            )
        )

    @classmethod
    def from_json(cls, raw: bytes) -> EncoderRecord:
        """Decode a record strictly. Not async.

        :raises BadRequestError: naming the field: unknown or missing fields, wrong types,
            another version, an oversized record.
        """
        if len(raw) > MAX_RECORD_BYTES:
            raise _error(f"larger than {MAX_RECORD_BYTES} bytes")
        wire = _strict.decode(_DECODER, raw, "the record", _error)
        return cls(
            url=wire.url,
            model=wire.model,
            modalities=tuple(
                Modality.parse(m, field="encoder record modalities") for m in wire.modalities
            ),
            transfers=wire.transfers,
            capacity=wire.capacity,
            load=EncoderLoad(wire.queue_depth, wire.staged_bytes),
            draining=wire.draining,
        )
