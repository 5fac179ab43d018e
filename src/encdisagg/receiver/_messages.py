"""What an encoder answers to ``POST /encode``, validated into a frozen message."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from .._errors import BadRequestError
from .._video_timing import VideoTiming, timing_from_wire

__all__ = ["PartMetadata"]


def _bad(field: str, requirement: str, value: object, req_id: str | None) -> BadRequestError:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return BadRequestError(
        f"/encode answer field {field!r} must be {requirement}; got {text}", req_id=req_id
    )


def _int(field: str, value: object, minimum: int, req_id: str | None) -> int:
    # Exact type: JSON `true` must not pass as 1.
    if type(value) is not int or value < minimum:
        raise _bad(field, f"an int >= {minimum}", value, req_id)
    return value


def _ints(field: str, value: object, req_id: str | None) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or any(
        type(item) is not int or item < 0 for item in value
    ):
        raise _bad(field, "a list of ints >= 0", value, req_id)
    return tuple(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class PartMetadata:
    """The size and layout of one encoded part, as its encoder reported it.

    Built with :meth:`from_json`, which rejects unknown fields and wrong types, naming the
    field.
    """

    req_id: str
    part_idx: int
    #: Bytes of the embedding.
    embedding_size: int
    #: Tokens (rows) of the embedding.
    embedding_len: int
    #: Width of the embedding (the language model's hidden size).
    embedding_dim: int
    #: Tokens per item.
    token_counts: tuple[int, ...]
    #: Grid per item (``(t, h, w)`` for Qwen-family models).
    grid: tuple[tuple[int, ...], ...]
    #: Video parts: each item's fps, second_per_grid_ts and timestamps (optional).
    video_timing: tuple[VideoTiming, ...] | None = None

    def __post_init__(self) -> None:
        if sum(self.token_counts) != self.embedding_len:
            raise BadRequestError(
                f"/encode answer of {self.req_id!r}: token_counts sum to "
                f"{sum(self.token_counts)}, but embedding_len is {self.embedding_len}",
                req_id=self.req_id,
            )
        if len(self.grid) != len(self.token_counts):
            raise BadRequestError(
                f"/encode answer of {self.req_id!r}: {len(self.grid)} grids for "
                f"{len(self.token_counts)} items",
                req_id=self.req_id,
            )

    @classmethod
    def from_json(cls, data: object) -> PartMetadata:
        """Validate a decoded JSON answer.

        :raises BadRequestError: for a non-object, unknown or missing fields, wrong types or
            inconsistent sizes; the message names the field.
        """
        if not isinstance(data, Mapping):
            raise BadRequestError(
                f"/encode answer must be a JSON object; got {type(data).__name__}"
            )
        raw: Mapping[str, Any] = data
        req_id = raw.get("req_id")
        rid = req_id if isinstance(req_id, str) else None
        unknown = sorted(str(key) for key in raw if key not in _FIELDS)
        if unknown:
            raise BadRequestError(
                f"/encode answer has unknown field(s): {', '.join(unknown)}", req_id=rid
            )
        missing = sorted(_FIELDS - _OPTIONAL - raw.keys())
        if missing:
            raise BadRequestError(
                f"/encode answer is missing field(s): {', '.join(missing)}", req_id=rid
            )
        if not isinstance(req_id, str) or not req_id:
            raise _bad("req_id", "a non-empty string", req_id, None)
        grid = raw["grid"]
        if not isinstance(grid, (list, tuple)):
            raise _bad("grid", "a list of lists of ints >= 0", grid, rid)
        return cls(
            req_id=req_id,
            part_idx=_int("part_idx", raw["part_idx"], 0, rid),
            embedding_size=_int("embedding_size", raw["embedding_size"], 0, rid),
            embedding_len=_int("embedding_len", raw["embedding_len"], 0, rid),
            embedding_dim=_int("embedding_dim", raw["embedding_dim"], 1, rid),
            token_counts=_ints("token_counts", raw["token_counts"], rid),
            grid=tuple(_ints("grid", item, rid) for item in grid),
            video_timing=_timing(raw.get("video_timing"), rid),
        )


_FIELDS: Final = frozenset(f.name for f in fields(PartMetadata))
#: Fields an answer may leave out (encoders that predate them, parts they do not apply to).
_OPTIONAL: Final = frozenset({"video_timing"})


def _timing(value: object, req_id: str | None) -> tuple[VideoTiming, ...] | None:
    if value is None:
        return None
    try:
        return timing_from_wire(value)
    except BadRequestError as exc:
        raise BadRequestError(f"/encode answer: {exc.message}", req_id=req_id) from None
