"""How a request's items reach the model's ``preprocess``: the config's media budgets, and
what a preprocessing failure becomes for the client."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from ..._config import EncoderConfig
from ..._errors import BadRequestError, EncdisaggError, InternalError
from ..._modality import Modality
from ...cache import relabel_items
from ...models import ModelOptions, Preprocessed, VisionModel
from ...models._media._limits import MediaLimits
from .._types import EncodeRequest

__all__ = ["Preprocess", "item_subset", "limited_preprocess", "media_limits", "preprocess_failure"]

Preprocess = Callable[[Sequence[object], Modality], Preprocessed]


def media_limits(config: EncoderConfig) -> MediaLimits:
    """The media budgets ``config`` sets for every request."""
    return MediaLimits(
        max_items=config.max_items_per_request,
        max_image_pixels=config.max_image_pixels,
        max_request_pixels=config.max_request_pixels,
        max_audio_seconds=config.max_audio_seconds,
        max_audio_sample_rate=config.max_audio_sample_rate,
        max_audio_channels=config.max_audio_channels,
        max_request_audio_seconds=config.max_request_audio_seconds,
    )


def limited_preprocess(
    model: VisionModel, options: ModelOptions, limits: MediaLimits
) -> Preprocess:
    """``model.preprocess`` with the config's budgets, for a model that takes them."""
    if options.accepts_media_limits:
        return partial(model.preprocess, limits=limits)  # type: ignore[call-arg]
    return model.preprocess


def item_subset(request: EncodeRequest, indices: Sequence[int] | None) -> Sequence[object]:
    return request.items if indices is None else [request.items[i] for i in indices]


def preprocess_failure(
    request: EncodeRequest, indices: Sequence[int] | None, exc: Exception
) -> Exception:
    """What the client sees when a model's preprocessing raised ``exc``: ``exc`` itself, or
    a mapped error whose cause is ``exc``. Errors still name items by their place in the
    request when only ``indices`` were preprocessed."""
    mapped: Exception
    if isinstance(exc, EncdisaggError):
        if indices is None:
            return exc
        mapped = type(exc)(relabel_items(exc.message, indices), req_id=exc.req_id)
    elif isinstance(exc, (ValueError, TypeError)):
        detail = str(exc) if indices is None else relabel_items(str(exc), indices)
        mapped = BadRequestError(
            f"req_id {request.req_id!r}: preprocessing rejected the input: {detail}",
            req_id=request.req_id,
        )
    else:
        mapped = InternalError(
            f"req_id {request.req_id!r}: preprocessing failed: {exc!r}",
            req_id=request.req_id,
        )
    # Setting the cause also hides the context, as ``raise ... from exc`` would.
    mapped.__cause__ = exc
    return mapped
