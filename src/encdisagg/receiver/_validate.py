"""Checking what encoders say about a part against the request's plan and the receiver.

Pure functions, no state: a part's ``/encode`` answer (:class:`PartMetadata`) and its ZMQ
header (:class:`EmbeddingHeader`) must each fit the plan and what the receiver takes (its
:class:`EmbeddingSpec`), and must agree with each other. Every rejection is a
:class:`BadRequestError` that names the field. Checks against what already arrived (repeats)
stay with the request's landing state; ``where`` names the message in every error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import BadRequestError, EncdisaggError, error_of_status
from .._numbers import whole
from .._video_timing import check_video_timing
from ..transfer import dtype_name
from ._plan import part_req_id

if TYPE_CHECKING:
    import torch

    from ..transfer import EmbeddingHeader, EmbeddingLayout
    from ._encoder_wire import PartMetadata
    from ._plan import RequestPlan

__all__ = [
    "EmbeddingSpec",
    "check_agreement",
    "check_header_ids",
    "check_header_payload",
    "check_metadata_ids",
    "check_metadata_size",
    "check_metadata_timing",
    "check_part_index",
    "encoder_error",
]


@dataclass(frozen=True, slots=True)
class EmbeddingSpec:
    """What every embedding a receiver takes is: its width, dtype and column sections.

    :raises BadRequestError: naming the field: a width that is not a positive integer, a
        dtype the wire has no name for, a layout of another width.
    """

    hidden_size: int
    dtype: torch.dtype
    #: The column sections (``None``: one section, the embedding itself).
    layout: EmbeddingLayout | None = None

    def __post_init__(self) -> None:
        size = whole("hidden_size", self.hidden_size, least=1, error=BadRequestError)
        dtype_name(self.dtype)
        if self.layout is not None and self.layout.width != size:
            raise BadRequestError(
                f"layout has {self.layout.width} columns, but hidden_size is {size}"
            )


def check_part_index(plan: RequestPlan, part_idx: int, where: str) -> None:
    """:raises BadRequestError: ``part_idx`` is not one of the plan's parts."""
    if not 0 <= part_idx < plan.num_parts:
        raise BadRequestError(
            f"{where}: part {part_idx} is outside the {plan.num_parts} parts of "
            f"request {plan.rid!r}",
            req_id=plan.rid,
        )


def check_metadata_ids(plan: RequestPlan, metadata: PartMetadata, where: str) -> None:
    """:raises BadRequestError: the answer is for another part, or for no part of the plan."""
    check_part_index(plan, metadata.part_idx, where)
    expected_id = part_req_id(plan.rid, metadata.part_idx)
    if metadata.req_id != expected_id:
        raise BadRequestError(f"{where}: req_id must be {expected_id!r}", req_id=plan.rid)


def check_metadata_size(
    plan: RequestPlan, metadata: PartMetadata, where: str, spec: EmbeddingSpec
) -> None:
    """:raises BadRequestError: a hidden size the receiver does not take, or a byte size
    that does not fit the shape."""
    if metadata.embedding_dim != spec.hidden_size:
        raise BadRequestError(
            f"{where}: embedding_dim is {metadata.embedding_dim}, the receiver takes "
            f"{spec.hidden_size}",
            req_id=plan.rid,
        )
    expected = metadata.embedding_len * metadata.embedding_dim * spec.dtype.itemsize
    if metadata.embedding_size != expected:
        raise BadRequestError(
            f"{where}: embedding_size is {metadata.embedding_size} bytes; "
            f"{metadata.embedding_len} x {metadata.embedding_dim} of "
            f"{dtype_name(spec.dtype)} take {expected}",
            req_id=plan.rid,
        )


def check_metadata_timing(plan: RequestPlan, metadata: PartMetadata, where: str) -> None:
    """:raises BadRequestError: the answer's video timing does not fit the part: timing on a
    part the plan does not hold as video, not one entry per item, or entries whose
    timestamps do not number each item's temporal grid steps."""
    check_video_timing(
        metadata.video_timing,
        modality=plan.parts[metadata.part_idx].modality.value,
        grid=metadata.grid,
        where=where,
        req_id=plan.rid,
    )


def check_header_ids(plan: RequestPlan, header: EmbeddingHeader, where: str) -> None:
    """:raises BadRequestError: the header's part count, index or id does not fit the plan."""
    if header.num_parts != plan.num_parts:
        raise BadRequestError(
            f"{where}: num_parts is {header.num_parts}, request {plan.rid!r} has {plan.num_parts}",
            req_id=plan.rid,
        )
    check_part_index(plan, header.part_idx, where)
    if header.req_id != part_req_id(plan.rid, header.part_idx):
        raise BadRequestError(f"{where}: req_id does not match part {header.part_idx}")


def check_header_payload(
    plan: RequestPlan, header: EmbeddingHeader, where: str, spec: EmbeddingSpec
) -> None:
    """:raises BadRequestError: a data part's modality, dtype, hidden size or layout is not
    what the plan and the receiver take. A header without a layout is taken to have the
    receiver's (its width is checked)."""
    planned = plan.parts[header.part_idx].modality
    if header.modality != planned.value:
        raise BadRequestError(
            f"{where}: modality is {header.modality!r}, part {header.part_idx} is "
            f"{planned.value!r}",
            req_id=plan.rid,
        )
    dtype = dtype_name(spec.dtype)
    if header.dtype != dtype:
        raise BadRequestError(
            f"{where}: dtype is {header.dtype!r}, the receiver takes {dtype!r}", req_id=plan.rid
        )
    if header.shape[1] != spec.hidden_size:
        raise BadRequestError(
            f"{where}: hidden size is {header.shape[1]}, the receiver takes {spec.hidden_size}",
            req_id=plan.rid,
        )
    layout = spec.layout
    if header.layout is None or header.layout == layout:
        return
    if layout is None and len(header.layout.sections) == 1:
        return
    expected = None if layout is None else layout.to_wire()
    raise BadRequestError(
        f"{where}: layout is {header.layout.to_wire()}, the receiver takes {expected}",
        req_id=plan.rid,
    )


def check_agreement(header: EmbeddingHeader, metadata: PartMetadata) -> None:
    """:raises BadRequestError: a part's ZMQ header and its ``/encode`` answer disagree."""
    if (
        header.shape != (metadata.embedding_len, metadata.embedding_dim)
        or header.token_counts != metadata.token_counts
        or header.grid != metadata.grid
    ):
        raise BadRequestError(
            f"part {metadata.part_idx} ({metadata.req_id!r}): its ZMQ header (shape "
            f"{list(header.shape)}, token_counts {list(header.token_counts)}) disagrees with its "
            f"/encode answer ({metadata.embedding_len} x {metadata.embedding_dim}, "
            f"token_counts {list(metadata.token_counts)})",
            req_id=metadata.req_id,
        )
    if None not in (header.video_timing, metadata.video_timing) and (
        header.video_timing != metadata.video_timing
    ):
        raise BadRequestError(
            f"part {metadata.part_idx} ({metadata.req_id!r}): its ZMQ header's video_timing "
            "disagrees with its /encode answer's",
            req_id=metadata.req_id,
        )


def encoder_error(plan: RequestPlan, header: EmbeddingHeader) -> EncdisaggError:
    """The error an encoder's error part stands for, by its HTTP status (500 if none)."""
    message = f"encoder failed part {header.part_idx} of request {plan.rid!r}: {header.error}"
    return error_of_status(header.status or 500)(message, req_id=plan.rid)
