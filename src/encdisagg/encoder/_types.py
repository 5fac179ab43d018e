"""Requests, results and destinations of the Encoder's public API."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .._errors import BadRequestError
from .._modality import Modality
from .._numbers import whole
from .._video_timing import VideoTiming

__all__ = [
    "Destination",
    "EncodeRequest",
    "EncodeResult",
    "EncoderStats",
    "MooncakeDestination",
    "SglangZmqDestination",
    "ZmqDestination",
]


def _require_text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"{name} must be a non-empty string")
    return value


@dataclass(frozen=True, slots=True)
class EncodeRequest:
    """One part of a multimodal request: its media items and where the part sits.

    Invalid values raise :class:`~encdisagg.BadRequestError` naming the field.
    """

    req_id: str
    items: Sequence[object]
    modality: Modality | str = Modality.IMAGE
    num_parts: int = 1
    part_idx: int = 0
    hashes: Sequence[str] | None = None
    _modality: Modality = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _require_text("req_id", self.req_id)
        items = self.items
        # Lists and tuples (nearly every caller) skip the slower abstract-class check.
        if (type(items) is not list and type(items) is not tuple) and (
            isinstance(items, (str, bytes)) or not isinstance(items, Sequence)
        ):
            raise BadRequestError("items must be a list of media items")
        if len(items) == 0:
            raise BadRequestError(f"items must not be empty (req_id {self.req_id!r})")
        if type(items) is not tuple:
            object.__setattr__(self, "items", tuple(items))
        modality = self.modality
        if type(modality) is not Modality:
            modality = Modality.parse(modality)
            object.__setattr__(self, "modality", modality)
        object.__setattr__(self, "_modality", modality)
        num_parts = whole("num_parts", self.num_parts, least=1, error=BadRequestError)
        part_idx = whole("part_idx", self.part_idx, error=BadRequestError)
        if not 0 <= part_idx < num_parts:
            raise BadRequestError(f"part_idx must be in [0, {num_parts}); got {part_idx}")
        if self.hashes is not None:
            if isinstance(self.hashes, str) or not isinstance(self.hashes, Sequence):
                raise BadRequestError("hashes must be a list of strings")
            if len(self.hashes) != len(self.items):
                raise BadRequestError(
                    f"hashes has {len(self.hashes)} entries but items has {len(self.items)}"
                )
            for index, value in enumerate(self.hashes):
                _require_text(f"hashes[{index}]", value)
            object.__setattr__(self, "hashes", tuple(self.hashes))

    @property
    def kind(self) -> Modality:
        """The parsed modality."""
        return self._modality


@dataclass(frozen=True, slots=True)
class EncodeResult:
    """What an encode staged: the embedding's size and per-item layout."""

    req_id: str
    num_tokens: int
    hidden_size: int
    dtype: str
    nbytes: int
    token_counts: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]
    #: For videos: each item's fps, second_per_grid_ts and timestamps (``None`` otherwise).
    video_timing: tuple[VideoTiming, ...] | None = None


@dataclass(frozen=True, slots=True)
class ZmqDestination:
    """A receiver's ZMQ PULL endpoint, ``"tcp://host:port"``."""

    url: str

    def __post_init__(self) -> None:
        _require_text("receive_url", self.url)
        if "://" not in self.url:
            raise BadRequestError(f"receive_url must look like tcp://host:port; got {self.url!r}")

    @property
    def identity(self) -> str:
        """What counts as one destination for ``receive_count``."""
        return self.url


@dataclass(frozen=True, slots=True)
class SglangZmqDestination(ZmqDestination):
    """A PULL endpoint of SGLang's language side: the push's header frame is ``header``
    (SGLang's pickled ``EmbeddingData``, written by the SGLang wire), sent as is in place
    of ours, before the raw bytes it describes."""

    header: bytes = b""


@dataclass(frozen=True, slots=True)
class MooncakeDestination:
    """A receiver's registered buffer, written with the Mooncake transfer engine."""

    session_id: str
    buffer_address: int
    endpoint: str

    def __post_init__(self) -> None:
        _require_text("session_id", self.session_id)
        whole("buffer_address", self.buffer_address, least=1, error=BadRequestError)
        _require_text("endpoint", self.endpoint)

    @property
    def identity(self) -> str:
        """What counts as one destination for ``receive_count``."""
        return self.endpoint


Destination = ZmqDestination | MooncakeDestination


@dataclass(frozen=True, slots=True)
class EncoderStats:
    """A snapshot of what an Encoder holds. ``live_requests``, ``staged_bytes`` and
    ``inflight_transfers`` are zero when it is idle and nothing is held.

    ``held_bytes``: staged bytes a transfer may still touch (it ended with an unknown
    outcome); they stay counted in ``staged_bytes`` too until the engine reports the
    transfer ended.

    ``retired_ids`` / ``retired_bytes``: ended and abandoned request ids the encoder still
    remembers (to answer 409 and late waiters), and the bytes they and their errors hold.
    """

    live_requests: int
    staged_bytes: int
    registered_regions: int
    inflight_transfers: int
    cache_entries: int
    held_bytes: int = 0
    retired_ids: int = 0
    retired_bytes: int = 0
