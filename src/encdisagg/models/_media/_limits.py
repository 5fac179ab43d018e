"""Media budgets, decided from headers before anything is decoded.

A request may hold at most ``max_items`` items; each image (or video frame) at most
``max_image_pixels`` source pixels; and all its items together at most ``max_request_pixels``
pixels *as the model sees them*, after its resize rule (an upscaled 64x64 frame costs what
the model will really process). Preprocessing memory grows with that last figure (about
24 bytes per pixel for a Qwen2-VL processor), so it bounds what one request can cost. Every
decision here is synchronous and never decodes; a refusal is a
:class:`~encdisagg.BadRequestError` naming the item and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._errors import BadRequestError
from ..._numbers import real, whole

__all__ = [
    "DEFAULT_MAX_AUDIO_CHANNELS",
    "DEFAULT_MAX_AUDIO_SAMPLE_RATE",
    "DEFAULT_MAX_ITEMS",
    "DEFAULT_MAX_REQUEST_AUDIO_SECONDS",
    "DEFAULT_MAX_REQUEST_PIXELS",
    "MediaLimits",
    "PixelBudget",
    "ResizeRule",
    "derived_image_pixels",
]

DEFAULT_MAX_ITEMS = 128
#: About 21,000 merged tokens of a Qwen2-VL model: more than one request's context holds.
DEFAULT_MAX_REQUEST_PIXELS = 16_777_216
#: Audio items above 192 kHz or with more than 8 channels are refused by default.
DEFAULT_MAX_AUDIO_SAMPLE_RATE = 192_000
DEFAULT_MAX_AUDIO_CHANNELS = 8
#: Ten minutes: 15,000 tokens of Qwen2-Audio, more than one request's context holds.
DEFAULT_MAX_REQUEST_AUDIO_SECONDS = 600.0
#: The derived image budget is never below a 4K UHD frame.
_UHD_PIXELS = 3840 * 2160
#: Decoding a video walks every frame up to the last one kept (animated images composite
#: each frame on the previous one); that walk may touch at most this many times the
#: request's pixel budget.
VIDEO_DECODE_FACTOR = 16


def derived_image_pixels(model_max_pixels: int) -> int:
    """The default per-image budget of a model that resizes to at most ``model_max_pixels``:
    four times that, and at least a 4K UHD frame."""
    return max(4 * model_max_pixels, _UHD_PIXELS)


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """The budgets one request's media must fit.

    :param max_items: most items in one request.
    :param max_image_pixels: most source pixels of one image or video frame (width x
        height from its header); larger JPEGs are decoded reduced (``Image.draft``) to fit,
        anything else is refused. ``None``: :func:`derived_image_pixels` of the model.
    :param max_request_pixels: most pixels of all the request's items after the model's
        resize; video frames are sampled (while decoding) to fit what is left of it.
    :param max_audio_seconds: longest audio item, in seconds. ``None``: the model's own
        window (30 s for Qwen2-Audio and Qwen2.5-Omni); a longer setting is capped to it.
    :param max_audio_sample_rate: highest sample rate of an audio item, in Hz.
    :param max_audio_channels: most channels of an audio item (they are averaged to mono).
    :param max_request_audio_seconds: most seconds of all the request's audio items.
    :raises BadRequestError: naming the field, for a value that is not a positive integer.
    """

    max_items: int = DEFAULT_MAX_ITEMS
    max_image_pixels: int | None = None
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS
    # Audio budgets, read from each item's header before its samples are decoded.
    max_audio_seconds: float | None = None
    max_audio_sample_rate: int = DEFAULT_MAX_AUDIO_SAMPLE_RATE
    max_audio_channels: int = DEFAULT_MAX_AUDIO_CHANNELS
    max_request_audio_seconds: float = DEFAULT_MAX_REQUEST_AUDIO_SECONDS

    def __post_init__(self) -> None:
        counts = ("max_items", "max_request_pixels", "max_audio_sample_rate", "max_audio_channels")
        for name in counts:
            whole(name, getattr(self, name), least=1, error=BadRequestError)
        if self.max_image_pixels is not None:
            whole("max_image_pixels", self.max_image_pixels, least=1, error=BadRequestError)
        if self.max_audio_seconds is not None:
            real("max_audio_seconds", self.max_audio_seconds, above=0, error=BadRequestError)
        seconds = self.max_request_audio_seconds
        real("max_request_audio_seconds", seconds, above=0, error=BadRequestError)

    def check_items(self, count: int) -> None:
        """:raises BadRequestError: naming ``mm_items``, for more than ``max_items``."""
        if count > self.max_items:
            raise BadRequestError(
                f"mm_items has {count} items, more than max_items_per_request ({self.max_items})"
            )


@dataclass(frozen=True, slots=True)
class ResizeRule:
    """How a model resizes what it is given: both sides to multiples of ``factor``, the
    area into ``[min_pixels, max_pixels]``, the aspect ratio kept (Qwen2-VL's
    ``smart_resize``)."""

    factor: int
    min_pixels: int
    max_pixels: int

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """``(height, width)`` a ``width`` x ``height`` source is resized to.

        :raises ValueError: for an aspect ratio the model refuses (above 200).
        """
        # Imported here: the rule is transformers' own, and only models that use it load it.
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        resized_height, resized_width = smart_resize(
            height,
            width,
            factor=self.factor,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )
        return int(resized_height), int(resized_width)

    def model_pixels(self, width: int, height: int) -> int:
        """Pixels the model processes for a ``width`` x ``height`` source.

        :raises ValueError: for an aspect ratio the model refuses (above 200).
        """
        resized_height, resized_width = self.resized(width, height)
        return resized_height * resized_width


class PixelBudget:
    """What is left of one request's pixel budget while its items are decoded in order.

    Not thread-safe: one per ``preprocess`` call.

    :param limits: the request's limits.
    :param image_pixels: the resolved per-image source budget.
    :param image_rule: how the model resizes images.
    :param video_rule: how the model resizes video frames.
    """

    __slots__ = ("_image_rule", "_limits", "_spent", "_video_rule", "image_pixels")

    def __init__(
        self,
        limits: MediaLimits,
        *,
        image_pixels: int,
        image_rule: ResizeRule,
        video_rule: ResizeRule,
    ) -> None:
        self._limits = limits
        self.image_pixels = image_pixels
        self._image_rule = image_rule
        self._video_rule = video_rule
        self._spent = 0

    @property
    def remaining(self) -> int:
        return self._limits.max_request_pixels - self._spent

    def check_source(self, label: str, width: int, height: int) -> None:
        """:raises BadRequestError: the source has more pixels than ``max_image_pixels``."""
        if width * height > self.image_pixels:
            raise BadRequestError(
                f"{label}: image is {width}x{height} ({width * height} pixels), more than "
                f"max_image_pixels ({self.image_pixels})"
            )

    def frame_cost(self, label: str, width: int, height: int, *, video: bool) -> int:
        """Model pixels of one image or frame. :raises BadRequestError: the model refuses
        its aspect ratio."""
        rule = self._video_rule if video else self._image_rule
        try:
            return rule.model_pixels(width, height)
        except ValueError as exc:
            raise BadRequestError(f"{label}: cannot preprocess image: {exc}") from None

    def spend(self, label: str, pixels: int) -> None:
        """Count ``pixels`` more. :raises BadRequestError: past ``max_request_pixels``."""
        if pixels > self.remaining:
            raise BadRequestError(
                f"{label}: the request's items need {self._spent + pixels} pixels after "
                f"resizing, more than max_request_pixels ({self._limits.max_request_pixels})"
            )
        self._spent += pixels

    def frames_that_fit(
        self, label: str, wanted: int, *, frame_pixels: int, source_pixels: int
    ) -> int:
        """How many frames to keep out of ``wanted`` (at least 1): what is left of the
        budget at ``frame_pixels`` model pixels each, and no more decoded source frames of
        ``source_pixels`` each than ``max_request_pixels`` holds (kept frames stay in
        memory at their source size until the model resizes them).

        :raises BadRequestError: not even one frame fits.
        """
        frame_pixels = max(frame_pixels, 1)
        if frame_pixels > self.remaining:
            self.spend(label, frame_pixels)  # raises, naming the limit
        fit = min(
            self.remaining // frame_pixels,
            max(1, self._limits.max_request_pixels // max(source_pixels, 1)),
        )
        return max(1, min(wanted, fit))

    def check_video_walk(self, label: str, frames: int, width: int, height: int) -> None:
        """:raises BadRequestError: decoding ``frames`` frames of a ``width`` x ``height``
        canvas would touch more than ``VIDEO_DECODE_FACTOR`` times ``max_request_pixels``."""
        limit = VIDEO_DECODE_FACTOR * self._limits.max_request_pixels
        if frames * width * height > limit:
            raise BadRequestError(
                f"{label}: reaching the sampled frames decodes {frames} frames of "
                f"{width}x{height} ({frames * width * height} pixels), more than "
                f"{VIDEO_DECODE_FACTOR} x max_request_pixels ({limit})"
            )
