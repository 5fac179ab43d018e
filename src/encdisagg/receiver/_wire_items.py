"""Request items as an ``/encode`` body carries them: what :class:`~encdisagg.Encoder` takes
in process, turned into JSON the encoder server reads back to the same media.

The in-process encoder takes raw bytes, file paths, PIL images, frame lists and
``{"frames", "fps"}`` maps beside the strings (data URLs, base64, URLs, server-side paths) and
``{"url", "content_hash"}`` maps the HTTP body takes. Bytes, paths and images are local to the
caller, so they travel as base64 data URLs: a :class:`~pathlib.Path` is read here, on the
caller's machine, where a string stays a string for the server to resolve.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from .._errors import BadRequestError

__all__ = ["needs_conversion", "wire_items"]

_DATA_URL_PREFIX: Final = "data:application/octet-stream;base64,"


def needs_conversion(items: Sequence[object]) -> bool:
    """Whether any item must be turned into JSON first (and may block doing so)."""
    return not all(isinstance(item, str) for item in items)


def wire_items(items: Sequence[object]) -> list[object]:
    """The items as the ``mm_items`` of an ``/encode`` body. Blocks on file reads and image
    encoding; call it in a worker thread when :func:`needs_conversion` says so.

    :raises BadRequestError: naming ``mm_items[i]`` for an item that cannot travel over
        HTTP (a NumPy waveform: send its encoded audio instead) or an unreadable path.
    """
    return [_wire_item(item, f"mm_items[{index}]") for index, item in enumerate(items)]


def _wire_item(item: object, label: str) -> object:
    if isinstance(item, str):
        return item
    if isinstance(item, (bytes, bytearray, memoryview)):
        return _data_url(bytes(item))
    if isinstance(item, Path):
        try:
            return _data_url(item.read_bytes())
        except OSError as exc:
            raise BadRequestError(f"{label}: cannot read {str(item)!r}: {exc}") from None
    if isinstance(item, (list, tuple)):
        return [_wire_item(frame, f"{label}[{number}]") for number, frame in enumerate(item)]
    if isinstance(item, dict):
        return {
            key: (_wire_item(value, f"{label}.frames") if key == "frames" else value)
            for key, value in item.items()
        }
    image_bytes = _png_bytes(item)
    if image_bytes is not None:
        return _data_url(image_bytes)
    if type(item).__module__ == "numpy":
        raise BadRequestError(
            f"{label}: a NumPy waveform cannot be sent to an encoder server (its sampling "
            "rate is not known here); send the encoded audio (WAV, FLAC, OGG, MP3) instead"
        )
    raise BadRequestError(f"{label}: unsupported item type {type(item).__name__}")


def _png_bytes(item: object) -> bytes | None:
    """A PIL image's lossless PNG encoding; ``None`` for anything else."""
    from PIL import Image  # deferred: only callers that pass images pay for the import

    if not isinstance(item, Image.Image):
        return None
    out = io.BytesIO()
    item.save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes) -> str:
    return _DATA_URL_PREFIX + base64.b64encode(data).decode("ascii")
