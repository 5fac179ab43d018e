"""Turning request items into pixels: images and video frames, within the request's budgets.

Every function here blocks (file reads, decoding, and remote fetches when enabled) and raises
:class:`~encdisagg.BadRequestError` naming the item, as ``mm_items[i]``, for anything it
cannot use. Nothing here touches request state; where the items may come from is a
:class:`MediaPolicy`, how many pixels they may cost a :class:`~._limits.PixelBudget`,
checked against each item's header before it is decoded.
"""

from __future__ import annotations

import importlib.util
import io
import math

from PIL import Image, UnidentifiedImageError

from ..._errors import BadRequestError
from ._bytes import item_bytes
from ._limits import PixelBudget
from ._policy import VIDEO_FILE_FPS, MediaPolicy, decoder_error, item_label

__all__ = ["load_image", "load_video"]

#: ``Image.draft`` reduces a JPEG while decoding it by one of these factors.
_DRAFT_SCALES = (1, 2, 4, 8)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, UnidentifiedImageError):
        return "not an image format this server reads"
    return decoder_error(exc)


# --- images -----------------------------------------------------------------------------


def _rgb(image: Image.Image, label: str) -> Image.Image:
    try:
        return image.convert("RGB")
    except Exception as exc:  # PIL's decoders raise many types; all mean bad media here.
        raise BadRequestError(f"{label}: cannot decode image: {_describe(exc)}") from exc


def _draft_within(image: Image.Image, pixels: int) -> None:
    """Ask a JPEG to decode reduced (by 2, 4 or 8) to at most ``pixels``; others ignore it."""
    if image.format != "JPEG":
        return
    width, height = image.size
    for scale in _DRAFT_SCALES:
        if math.ceil(width / scale) * math.ceil(height / scale) <= pixels:
            break
    else:
        return  # even an eighth is too large: the caller refuses it
    if scale > 1:
        image.draft(image.mode, (max(1, width // scale), max(1, height // scale)))


def _admit(image: Image.Image, label: str, budget: PixelBudget | None, *, video: bool) -> None:
    """Check an opened (not yet decoded) image against the budget, reducing a JPEG first."""
    if budget is None:
        return
    if image.width * image.height > budget.image_pixels:
        _draft_within(image, budget.image_pixels)
    budget.check_source(label, image.width, image.height)
    budget.spend(label, budget.frame_cost(label, image.width, image.height, video=video))


def load_image(
    item: object,
    index: int,
    policy: MediaPolicy,
    *,
    label: str | None = None,
    budget: PixelBudget | None = None,
    video: bool = False,
) -> Image.Image:
    """Decode one image item into an RGB PIL image. Blocks on reads, decoding and fetches.

    ``item`` is a PIL image, bytes, a file path (``str`` or ``Path``), a ``data:`` URL, bare
    base64, an allow-listed ``http(s)`` URL, or ``{"url": ..., "content_hash": sha256hex}``.
    With a ``budget``, the image's header is checked before it is decoded: a JPEG over
    ``max_image_pixels`` is decoded reduced to fit, anything else over it is refused, and
    its resized pixels (as a video frame if ``video``) are counted against the request.

    :raises BadRequestError: naming ``mm_items[index]`` for anything it cannot decode, an
        empty or oversized item, one over a budget, a refused URL or a ``content_hash``
        that does not match.
    """
    label = label or item_label(index)
    if isinstance(item, Image.Image):
        _admit(item, label, budget, video=video)
        return _rgb(item, label)
    data = item_bytes(item, label, policy)
    try:
        with Image.open(io.BytesIO(data)) as image:
            _admit(image, label, budget, video=video)
            return _rgb(image, label)
    except BadRequestError:
        raise
    except Exception as exc:  # UnidentifiedImageError, DecompressionBombError, truncation...
        raise BadRequestError(f"{label}: cannot decode image: {_describe(exc)}") from exc


# --- videos -----------------------------------------------------------------------------


def _even_indices(count: int, keep: int) -> list[int]:
    """``keep`` frame numbers spread evenly over ``count`` frames, the first one included."""
    if count <= keep:
        return list(range(count))
    step = count / keep
    return [int(i * step) for i in range(keep)]


def _frame_plan(
    budget: PixelBudget | None, label: str, keep: int, width: int, height: int
) -> tuple[int, int]:
    """``(frames to keep, pixels of each)``: at most ``keep``, fewer where ``budget`` holds
    fewer. :raises BadRequestError: naming ``label`` for a frame size over the budget."""
    if budget is None:
        return keep, 0
    budget.check_source(label, width, height)
    frame_pixels = budget.frame_cost(label, width, height, video=True)
    keep = budget.frames_that_fit(
        label, keep, frame_pixels=frame_pixels, source_pixels=width * height
    )
    return keep, frame_pixels


def _sampled_frames(
    image: Image.Image, label: str, policy: MediaPolicy, budget: PixelBudget | None
) -> list[Image.Image]:
    """The frames of an animated image, sampled *before* any is decoded: only the kept
    frames are converted (and kept); the others are passed over on the way."""
    count = int(getattr(image, "n_frames", 1))  # from the file's frame headers
    width, height = image.size
    keep, frame_pixels = _frame_plan(
        budget, label, min(count, policy.max_video_frames), *image.size
    )
    indices = _even_indices(count, keep)
    if budget is not None:
        budget.check_video_walk(label, indices[-1] + 1, width, height)
    frames = []
    for number in indices:
        image.seek(number)
        frames.append(_rgb(image, label))
    if budget is not None:
        budget.spend(label, len(frames) * frame_pixels)
    return frames


def _pyav_frames(
    data: bytes,
    label: str,
    policy: MediaPolicy,
    budget: PixelBudget | None,
    frame_times: list[float] | None = None,
) -> list[Image.Image]:
    import av  # type: ignore[import-not-found,unused-ignore]  # optional dependency

    frames: list[Image.Image] = []
    times: list[float] = []  # each kept frame's presentation time, in seconds
    interval = 1.0 / VIDEO_FILE_FPS
    next_time = 0.0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            # The codec's frame size, known from the stream headers before decoding.
            keep, frame_pixels = _frame_plan(
                budget,
                label,
                policy.max_video_frames,
                int(stream.codec_context.width),
                int(stream.codec_context.height),
            )
            for frame in container.decode(stream):
                when = float(frame.time) if frame.time is not None else next_time
                if when + 1e-9 < next_time:
                    continue  # decoded, but never converted to an image or kept
                image = frame.to_image()  # type: ignore[no-untyped-call,unused-ignore]
                frames.append(image.convert("RGB"))
                times.append(when)
                next_time = when + interval
                if len(frames) >= 2 * keep:
                    # Bound memory on long videos: keep every other frame and sample half
                    # as often from here on, so the kept frames stay evenly spaced.
                    frames = frames[::2]
                    times = times[::2]
                    interval *= 2
    except BadRequestError:
        raise
    except Exception as exc:  # PyAV raises its own error tree for bad containers and codecs.
        raise BadRequestError(f"{label}: cannot decode video: {_describe(exc)}") from exc
    kept = _even_indices(len(frames), keep)
    frames = [frames[number] for number in kept]
    if frame_times is not None:
        frame_times[:] = [times[number] for number in kept]
    if budget is not None:
        budget.spend(label, len(frames) * frame_pixels)
    return frames


def _file_frames(
    data: bytes,
    label: str,
    policy: MediaPolicy,
    budget: PixelBudget | None,
    frame_times: list[float] | None = None,
) -> list[Image.Image]:
    try:
        with Image.open(io.BytesIO(data)) as image:
            return _sampled_frames(image, label, policy, budget)
    except BadRequestError:
        raise
    except Exception as exc:
        pil_error = _describe(exc)
    if importlib.util.find_spec("av") is not None:
        return _pyav_frames(data, label, policy, budget, frame_times)
    raise BadRequestError(
        f"{label}: cannot decode video: not an animated image ({pil_error}), and video files "
        "need PyAV, which is not installed; send a list of frames instead"
    )


def load_video(
    item: object,
    index: int,
    policy: MediaPolicy,
    *,
    budget: PixelBudget | None = None,
    frame_times: list[float] | None = None,
) -> list[Image.Image]:
    """Decode one video item into its RGB frames. Blocks on reads, decoding and fetches.

    A video is a list (or tuple) of frames, each in any form :func:`load_image` accepts; or an
    animated image (GIF, APNG, WebP); or, with PyAV installed, a video file, sampled at
    2 frames per second. Files with more frames than ``max_video_frames`` (or, with a
    ``budget``, than fit what is left of it) are sampled evenly down while they are
    decoded: frames left out are never converted or kept.

    ``frame_times``, when given, is filled with the kept frames' presentation times in
    seconds where the decoder knows them (video files); it stays empty otherwise.

    :raises BadRequestError: naming ``mm_items[index]`` (and the frame) for anything it
        cannot decode, an empty video, a frame list longer than ``max_video_frames``, or
        one over a budget.
    """
    label = item_label(index)
    if isinstance(item, (list, tuple)):
        if len(item) > policy.max_video_frames:
            raise BadRequestError(
                f"{label}: video has {len(item)} frames, more than max_video_frames "
                f"({policy.max_video_frames})"
            )
        frames = [
            load_image(frame, index, policy, label=f"{label}[{number}]", budget=budget, video=True)
            for number, frame in enumerate(item)
        ]
    elif isinstance(item, Image.Image):
        frames = _sampled_frames(item, label, policy, budget)
    else:
        frames = _file_frames(item_bytes(item, label, policy), label, policy, budget, frame_times)
    if not frames:
        raise BadRequestError(f"{label}: video has no frames")
    return frames
